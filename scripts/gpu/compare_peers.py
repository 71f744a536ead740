#!/usr/bin/env python3
"""Prints voxkernel's e2e figures beside the peers' from one GPU run, with the ratios.
Usage: compare_peers.py voxkernel.jsonl peers.jsonl"""
import json
import sys


def lines(path):
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.startswith("{")]
    except FileNotFoundError:
        return []


def main():
    ours, peers = lines(sys.argv[1]), lines(sys.argv[2])
    # (the joining sessions' lines, `--joins`, have no peer counterpart)
    ours = [r for r in ours if r.get("bench") == "e2e"]
    rows = []
    for r in ours:
        rows.append((f"voxkernel, {r['concurrency']} session(s)",
                     r["time_to_first_audio_ms"]["p50"], r["time_to_first_audio_ms"]["p95"],
                     r["rtf_per_stream"]["p50"], r["ms_per_frame"]["wall"]))
    for p in peers:
        if "chunk_frames" in p:
            rows.append((f"faster-qwen3-tts, chunk {p['chunk_frames']}", p["first_audio_ms"], None,
                         p["rtf"], 1000 * p["total_s"] / (p["audio_s"] / 0.08)))
        elif "rtf" in p:
            rows.append((f"official qwen-tts, sampling={p['sampling']}",
                         1000 * p["first_audio_s_nonstreaming"], None, p["rtf"],
                         p["ms_per_frame_generate"]))
    print(f"{'system':42} {'TTFA p50 ms':>12} {'TTFA p95 ms':>12} {'RTF':>8} {'ms/frame':>9}")
    for name, t50, t95, rtf, mpf in rows:
        fmt = lambda v, w, d: f"{v:{w}.{d}f}" if v is not None else " " * (w - 1) + "-"
        print(f"{name:42} {fmt(t50, 12, 1)} {fmt(t95, 12, 1)} {fmt(rtf, 8, 4)} {fmt(mpf, 9, 2)}")
    solo = next((r for r in ours if r["concurrency"] == 1), None)
    fast1 = next((p for p in peers if p.get("chunk_frames") == 1), None)
    official = next((p for p in peers if p.get("sampling") is True), None)
    if solo and fast1:
        print(f"vs faster-qwen3-tts (chunk 1): TTFA {fast1['first_audio_ms'] / solo['time_to_first_audio_ms']['p50']:.1f}x lower, "
              f"RTF {fast1['rtf'] / solo['rtf_per_stream']['p50']:.1f}x lower")
    if solo and official:
        print(f"vs official qwen-tts: RTF {official['rtf'] / solo['rtf_per_stream']['p50']:.1f}x lower")
    print("gpu:", next((p.get("gpu") for p in peers if p.get("gpu")), "see nvidia-smi above"),
          "| voxkernel backends:", solo["frame_backend"] if solo else "-", "/", solo["codec_backend"] if solo else "-")


if __name__ == "__main__":
    main()
