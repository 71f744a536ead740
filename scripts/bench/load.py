#!/usr/bin/env python3
"""Load benchmark for `voxkernel serve`: N concurrent speech streams, R rounds each.

Prints p50/p95 time to first audio (as the client sees it, and as the server reports it) and
per-stream RTF (stream wall time / audio seconds; above 1 the stream falls behind playback), plus
the aggregate audio throughput. Standard library only.

Bounded and loopback-only: it refuses any host but 127.0.0.0/8, ::1 or localhost, sends exactly
streams x rounds requests, and gives each at most --timeout seconds.

    python3 scripts/bench/load.py --url http://127.0.0.1:8000 --streams 4 --rounds 3
"""

import argparse
import base64
import http.client
import ipaddress
import json
import statistics
import sys
import threading
import time
import urllib.parse

SAMPLE_RATE = 24_000

TEXTS = [
    "Hello! Thanks for calling, how can I help you today?",
    "Sure, let me look that up for you, it will only take a moment.",
    "Your order shipped this morning and should arrive by Thursday.",
    "Is there anything else I can do for you before we finish?",
]


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def one_stream(url, args, text, seed, results, lock):
    """One SSE speech request; records client TTFA, wall time, audio seconds, server usage."""
    conn_cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(url.hostname, url.port, timeout=args.timeout)
    body = {
        "model": args.model,
        "input": text,
        "voice": args.voice,
        "response_format": "pcm",
        "stream_format": "sse",
        "seed": seed,
    }
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    start = time.monotonic()
    first = None
    audio_bytes = 0
    usage = None
    try:
        conn.request("POST", "/v1/audio/speech", json.dumps(body), headers)
        response = conn.getresponse()
        if response.status != 200:
            record = {"error": f"HTTP {response.status}: {response.read()[:200]!r}"}
        else:
            for line in response:
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[6:])
                if event["type"] == "speech.audio.delta":
                    if first is None:
                        first = time.monotonic()
                    audio_bytes += len(base64.b64decode(event["audio"]))
                elif event["type"] == "speech.audio.done":
                    usage = event["usage"]
                elif event["type"] == "error":
                    raise RuntimeError(event["error"]["message"])
            end = time.monotonic()
            audio_s = audio_bytes / 2 / SAMPLE_RATE
            record = {
                "ttfa_ms": None if first is None else (first - start) * 1e3,
                "server_ttfa_ms": (usage or {}).get("time_to_first_audio_ms"),
                "wall_s": end - start,
                "audio_s": audio_s,
                "rtf": (end - start) / audio_s if audio_s else None,
            }
    except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the run
        record = {"error": repr(e)}
    finally:
        conn.close()
    with lock:
        results.append(record)


def percentile(values, p):
    values = sorted(v for v in values if v is not None)
    if not values:
        return float("nan")
    k = (len(values) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--streams", type=int, default=4, help="concurrent streams (N)")
    parser.add_argument("--rounds", type=int, default=3, help="requests per stream, one after another")
    parser.add_argument("--model", default="tts-1")
    parser.add_argument("--voice", default="ryan")
    parser.add_argument("--api-key")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    args = parser.parse_args()

    url = urllib.parse.urlparse(args.url)
    if not url.hostname or not loopback(url.hostname):
        sys.exit(f"load.py: refusing {args.url}: only loopback addresses (127.0.0.0/8, ::1, localhost)")
    if not (1 <= args.streams <= 256 and 1 <= args.rounds <= 100):
        sys.exit("load.py: --streams must be 1..256 and --rounds 1..100")

    results, lock = [], threading.Lock()

    def worker(i):
        for r in range(args.rounds):
            one_stream(url, args, TEXTS[(i + r) % len(TEXTS)], 1000 * i + r, results, lock)

    start = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start

    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    audio = sum(r["audio_s"] for r in ok)
    summary = {
        "streams": args.streams,
        "requests": len(results),
        "ok": len(ok),
        "errors": len(errors),
        "ttfa_ms_p50": percentile([r["ttfa_ms"] for r in ok], 50),
        "ttfa_ms_p95": percentile([r["ttfa_ms"] for r in ok], 95),
        "server_ttfa_ms_p50": percentile([r["server_ttfa_ms"] for r in ok], 50),
        "server_ttfa_ms_p95": percentile([r["server_ttfa_ms"] for r in ok], 95),
        "rtf_p50": percentile([r["rtf"] for r in ok], 50),
        "rtf_p95": percentile([r["rtf"] for r in ok], 95),
        "audio_s_per_s": audio / wall if wall else float("nan"),
        "wall_s": wall,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{args.streams} concurrent streams x {args.rounds} rounds: {len(ok)}/{len(results)} ok, wall {wall:.1f} s")
        print(f"  time to first audio (client)  p50 {summary['ttfa_ms_p50']:8.1f} ms   p95 {summary['ttfa_ms_p95']:8.1f} ms")
        print(f"  time to first audio (server)  p50 {summary['server_ttfa_ms_p50']:8.1f} ms   p95 {summary['server_ttfa_ms_p95']:8.1f} ms")
        print(f"  per-stream RTF (wall/audio)   p50 {summary['rtf_p50']:8.3f}      p95 {summary['rtf_p95']:8.3f}")
        print(f"  throughput                    {summary['audio_s_per_s']:.2f} s of audio per second")
    for e in errors[:5]:
        print(f"  error: {e}", file=sys.stderr)
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
