#!/bin/bash
# Lays out /work/main/.gpu (git-ignored, carried to the GPU machine) for check_megakernel.sh from
# this worktree's release build: the GPU test binaries (frame-kernel parity, engine), the
# `voxkernel` binary (its `bench` is the frame-kernel benchmark), megakernel_check, the
# official-run helpers and their wheels. The tiny fixtures travel with the checkout itself, under
# tests/fixtures. Build first:
#   cargo build --release -p voxkernel-cli -p voxkernel-cuda --tests --examples
set -eu
WT=$(cd "$(dirname "$0")/../.." && pwd)
DEST=${DEST:-/work/main/.gpu}
T=${CARGO_TARGET_DIR:-$WT/target}/release
rm -rf "$DEST" && mkdir -p "$DEST"/{bin,scripts,whl}
test_binary() {
  (cd "$WT" && cargo test --release -p voxkernel-cuda --test "$1" --no-run 2>&1) \
    | grep -o "target/release/deps/$1-[0-9a-f]*" | head -1
}
cp "${CARGO_TARGET_DIR:-$WT/target}/release/deps/$(basename "$(test_binary parity)")" "$DEST/bin/parity"
cp "${CARGO_TARGET_DIR:-$WT/target}/release/deps/$(basename "$(test_binary engine)")" "$DEST/bin/engine_gpu"
cp "$T/voxkernel" "$T/examples/megakernel_check" "$DEST/bin/"
strip "$DEST"/bin/*
# The carried tree is limited to 64 MiB: compressed binaries leave room for the wheels.
xz -T0 -6 "$DEST"/bin/*
# make_ckpt.py reads ../reference/{tokenizer,checkpoints} beside its own folder; the tokenizer
# files are the tiny fixtures' (identical), which check_megakernel.sh links there, so that the
# carried tree stays under 64 MiB.
mkdir -p "$DEST/reference/checkpoints"
cp /work/shared/reference/checkpoints/qwen3-tts-12hz-0.6b-base.config.json "$DEST/reference/checkpoints/"
cp "$WT/scripts/gpu/official_dump.py" "$WT/scripts/parity/official_forced.py" "$WT/scripts/gpu/check_megakernel.sh" \
  /work/shared/refcheck/make_ckpt.py "$DEST/scripts/"
cp /work/shared/wheels/official/*.whl /work/shared/wheels/common/*.whl "$DEST/whl/"
du -sh "$DEST"
