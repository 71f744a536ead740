#!/bin/bash
# Lays out /work/main/.gpu-e2e (git-ignored, carried to the GPU machine) for e2e.sh: the release
# `voxkernel` binary of this worktree, the peers' benchmark scripts and their wheels.
set -eu
WT=$(cd "$(dirname "$0")/../.." && pwd)
DEST=${DEST:-/work/main/.gpu-e2e}
T=${CARGO_TARGET_DIR:-$WT/target}/release
rm -rf "$DEST" && mkdir -p "$DEST"/{bin,refcheck,reference/checkpoints}
cp "$T/voxkernel" "$DEST/bin/"
# The GPU engine test (concurrent sessions vs solo runs, streamed text) of voxkernel-cuda.
engine_test=$(cd "$WT" && cargo test --release -p voxkernel-cuda --test engine --no-run 2>&1 \
  | grep -o 'target/release/deps/engine-[0-9a-f]*' | head -1)
cp "${CARGO_TARGET_DIR:-$WT/target}/release/deps/$(basename "$engine_test")" "$DEST/bin/engine_gpu"
strip "$DEST"/bin/*
# The carried tree is limited to 64 MiB: compressed binaries leave room for the wheels.
xz -T0 -6 "$DEST"/bin/*
cp /work/shared/refcheck/{make_ckpt.py,run_peers.sh,bench_official.py,bench_faster.py} "$DEST/refcheck/"
cp -a /work/shared/reference/tokenizer "$DEST/reference/"
cp /work/shared/reference/checkpoints/*.json "$DEST/reference/checkpoints/"
cp -a /work/shared/wheels "$DEST/wheels"
cp "$WT/scripts/gpu/e2e.sh" "$WT/scripts/gpu/compare_peers.py" "$DEST/"
du -sh "$DEST"
