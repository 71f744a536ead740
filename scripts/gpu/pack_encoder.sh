#!/bin/bash
# Lays out /work/main/.gpu-encgpu (git-ignored, carried to the GPU machine) for encoder.sh: this
# worktree's release builds (cargo test --release -p voxkernel-cuda --no-run; cargo build
# --release -p voxkernel-cli), make_ckpt.py and the official wheels it needs.
set -eu
WT=$(cd "$(dirname "$0")/../.." && pwd)
DEST=${DEST:-/work/main/.gpu-encgpu}
T=${CARGO_TARGET_DIR:-$WT/target}/release
rm -rf "$DEST" && mkdir -p "$DEST"/{bin,refcheck,reference/checkpoints}
for test in voice_encoder codec; do
  cp "$(ls -t "$T"/deps/$test-* | grep -v '\.d$' | head -1)" "$DEST/bin/$test"
done
cp "$T/voxkernel" "$DEST/bin/"
strip "$DEST"/bin/*
xz -T0 -9 "$DEST"/bin/*
cp /work/shared/refcheck/make_ckpt.py "$DEST/refcheck/"
# make_ckpt.py copies the tokenizer files from reference/tokenizer: encoder.sh links the
# identical ones of the tiny clone fixture there (the carried tree is limited to 64 MiB).
cp /work/shared/reference/checkpoints/*.json "$DEST/reference/checkpoints/"
mkdir -p "$DEST/wheels" && cp -a /work/shared/wheels/{official,common} "$DEST/wheels/"
cp "$WT/scripts/gpu/encoder.sh" "$DEST/"
du -sh "$DEST"
