#!/bin/bash
# Lays out /work/main/.gpu-codec (git-ignored, carried to the GPU machine) from this worktree's
# release build (cargo build --release -p voxkernel-cuda --tests --examples): the codec test and
# benchmark binaries and the scripts check_codec.sh runs (OFFICIAL=1 included).
set -eu
WT=$(cd "$(dirname "$0")/../.." && pwd)
DEST=${DEST:-/work/main/.gpu-codec}
T=${CARGO_TARGET_DIR:-$WT/target}/release
rm -rf "$DEST" && mkdir -p "$DEST"/{bin,scripts}
codec=$(ls -t "$T"/deps/codec-* | grep -v '\.d$' | head -1)
cp "$codec" "$DEST/bin/codec"
cp "$T/examples/codec_bench" "$DEST/bin/"
strip "$DEST"/bin/*
cp "$WT/scripts/gpu/check_codec.sh" "$WT/scripts/gpu/make_codec.py" "$DEST/scripts/"
cp /work/shared/reference/checkpoints/qwen3-tts-tokenizer-12hz.config.json "$DEST/scripts/"
# For OFFICIAL=1: make_ckpt.py (with the reference files it reads, compressed), the official
# package's wheels, and the script that decodes with the official codec in float32 and float64.
mkdir -p "$DEST"/{refcheck,reference/checkpoints}
cp /work/shared/refcheck/make_ckpt.py "$DEST/refcheck/"
cp -a /work/shared/reference/tokenizer "$DEST/reference/"
cp /work/shared/reference/checkpoints/*.json "$DEST/reference/checkpoints/"
tar -C "$DEST" -cJf "$DEST/reference.tar.xz" reference && rm -rf "$DEST/reference"
mkdir -p "$DEST/wheels" && cp -a /work/shared/wheels/official /work/shared/wheels/common "$DEST/wheels/"
cp "$WT/scripts/parity/codec_precision.py" "$WT/scripts/parity/official.py" "$DEST/scripts/"
du -sh "$DEST"
