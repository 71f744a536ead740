#!/bin/bash
# Lays out /work/main/.gpu (git-ignored, carried to the GPU machine) from this worktree's release
# build: test and example binaries, the official-run helpers and wheels (the tiny fixtures travel
# with the checkout itself, under tests/fixtures).
set -eu
WT=$(cd "$(dirname "$0")/../.." && pwd)
DEST=${DEST:-/work/main/.gpu}
T=${CARGO_TARGET_DIR:-$WT/target}/release
rm -rf "$DEST" && mkdir -p "$DEST"/{bin,scripts,whl}
parity=$(ls -t "$T"/deps/parity-* | grep -v '\.d$' | head -1)
cp "$parity" "$DEST/bin/parity"
cp "$T/examples/frame_bench" "$T/examples/megakernel_check" "$DEST/bin/"
strip "$DEST"/bin/*
# make_ckpt.py reads ../reference/{tokenizer,checkpoints} beside its own folder
mkdir -p "$DEST/reference/checkpoints"
cp -a /work/shared/reference/tokenizer "$DEST/reference/"
cp /work/shared/reference/checkpoints/qwen3-tts-12hz-0.6b-base.config.json "$DEST/reference/checkpoints/"
cp "$WT/scripts/gpu/official_dump.py" "$WT/scripts/gpu/check_megakernel.sh" /work/shared/refcheck/make_ckpt.py "$DEST/scripts/"
cp /work/shared/wheels/official/*.whl /work/shared/wheels/common/*.whl "$DEST/whl/"
du -sh "$DEST"
