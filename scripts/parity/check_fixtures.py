#!/usr/bin/env python3
"""Check committed parity fixtures against the contract (/work/briefs/fixtures.md) without the model:
file layout, JSON fields, tensor names, shapes and dtypes, waveforms off the codec's clamp, and that
the greedy codebook-0 codes follow from the stored raw logits under the official processors
(repetition penalty 1.05 over previous codebook-0 ids, EOS banned for the first 2 tokens, ids
2048..3071 except EOS suppressed).

    /work/refenv/bin/python scripts/parity/check_fixtures.py tests/fixtures/parity
"""
import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

EOS = 2150
CODEC_VOCAB = 3072
SAMPLES_PER_FRAME = 1920
MIN_NEW_TOKENS = 2
REPETITION_PENALTY = 1.05
CASE_FIELDS = {"mode", "text", "language", "speaker", "instruct", "text_mode", "text_ids", "instruct_ids",
               "max_new_tokens", "prefill_len", "num_frames", "finished_by", "logit_steps"}
CHECKPOINT_FILES = ["config.json", "generation_config.json", "preprocessor_config.json", "model.safetensors",
                    "speech_tokenizer/config.json", "speech_tokenizer/preprocessor_config.json",
                    "speech_tokenizer/model.safetensors", "vocab.json", "merges.txt", "tokenizer_config.json"]


def processed_argmax(raw: torch.Tensor, previous: list) -> tuple:
    """Greedy codebook-0 pick and its margin over the runner-up, after the official processors."""
    row = raw.clone()
    for token in set(previous):
        row[token] = row[token] * REPETITION_PENALTY if row[token] < 0 else row[token] / REPETITION_PENALTY
    if len(previous) < MIN_NEW_TOKENS:
        row[EOS] = -float("inf")
    suppressed = [i for i in range(CODEC_VOCAB - 1024, CODEC_VOCAB) if i != EOS]
    row[suppressed] = -float("inf")
    top = torch.topk(row, 2)
    return int(top.indices[0]), float(top.values[0] - top.values[1])


def assert_unclamped(name: str, wav: torch.Tensor):
    # the codec clamps to [-1, 1]; a clamped fixture would hide decoder errors
    assert wav.abs().max() < 1.0, f"{name}: waveform reaches the clamp (max |x| = {wav.abs().max():.3f})"


def check_case(ckpt: Path, json_path: Path, hidden: int) -> float:
    meta = json.loads(json_path.read_text(encoding="utf-8"))
    missing = CASE_FIELDS - meta.keys()
    assert not missing, f"{json_path}: missing fields {missing}"
    t = load_file(str(json_path.with_suffix(".safetensors")))
    frames, steps = meta["num_frames"], meta["logit_steps"]
    assert t["prefill_embeds"].shape == (meta["prefill_len"], hidden), t["prefill_embeds"].shape
    assert t["trailing_embeds"].shape[1] == hidden
    assert t["codes"].shape == (frames, 16) and t["codes"].dtype == torch.int64
    assert t["logits_c0"].shape == (steps, CODEC_VOCAB)
    assert t["wav"].shape == (frames * SAMPLES_PER_FRAME,)
    assert_unclamped(json_path.stem, t["wav"])
    assert frames <= meta["max_new_tokens"] - 1
    assert (meta["mode"] == "base_xvector") == ("speaker_vector" in t)
    if meta["text_mode"] == "streaming":
        assert t["trailing_embeds"].shape[0] == len(meta["text_ids"]) + 1
    else:
        assert t["trailing_embeds"].shape[0] == 1
    if meta["finished_by"] == "eos":
        assert frames < meta["max_new_tokens"] - 1 or steps <= frames
    else:
        assert frames == meta["max_new_tokens"] - 1
    codes0 = t["codes"][:, 0].tolist()
    margins = []
    for step in range(steps):
        pick, margin = processed_argmax(t["logits_c0"][step], codes0[:step])
        expected = codes0[step] if step < frames else EOS
        assert pick == expected, f"{json_path.name}: step {step} picks {pick}, codes say {expected}"
        margins.append(margin)
    return min(margins)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", nargs="?", default="tests/fixtures/parity")
    root = Path(ap.parse_args().root)
    failures = 0
    for ckpt in sorted(p for p in root.iterdir() if p.is_dir()):
        for name in CHECKPOINT_FILES:
            assert (ckpt / name).exists(), f"{ckpt / name} missing"
        hidden = json.loads((ckpt / "config.json").read_text())["talker_config"]["hidden_size"]
        for json_path in sorted((ckpt / "cases").glob("*.json")):
            try:
                margin = check_case(ckpt, json_path, hidden)
                print(f"ok   {ckpt.name}/{json_path.stem}  (smallest codebook-0 greedy margin {margin:.4f})")
            except AssertionError as err:
                failures += 1
                print(f"FAIL {ckpt.name}/{json_path.stem}: {err}")
    long_path = root / "tiny-custom-voice" / "cases" / "decoder_long.safetensors"
    if long_path.exists():
        t = load_file(str(long_path))
        assert t["wav"].shape == (t["codes"].shape[0] * SAMPLES_PER_FRAME,)
        assert_unclamped("decoder_long", t["wav"])
        print(f"ok   decoder_long ({t['codes'].shape[0]} frames)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
