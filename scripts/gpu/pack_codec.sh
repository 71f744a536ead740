#!/bin/bash
# Lays out /work/main/.gpu-codec (git-ignored, carried to the GPU machine) from this worktree's
# release build (cargo build --release -p voxkernel-cuda --tests --examples): the codec test and
# benchmark binaries and the scripts check_codec.sh runs.
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
du -sh "$DEST"
