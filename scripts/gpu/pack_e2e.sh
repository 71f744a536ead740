#!/bin/bash
# Lays out /work/main/.gpu-e2e (git-ignored, carried to the GPU machine) for e2e.sh: the release
# `voxkernel` binary of this worktree, the peers' benchmark scripts and their wheels.
set -eu
WT=$(cd "$(dirname "$0")/../.." && pwd)
DEST=${DEST:-/work/main/.gpu-e2e}
T=${CARGO_TARGET_DIR:-$WT/target}/release
rm -rf "$DEST" && mkdir -p "$DEST"/{bin,refcheck,reference/checkpoints}
cp "$T/voxkernel" "$DEST/bin/" && strip "$DEST/bin/voxkernel"
cp /work/shared/refcheck/{make_ckpt.py,run_peers.sh,bench_official.py,bench_faster.py} "$DEST/refcheck/"
cp -a /work/shared/reference/tokenizer "$DEST/reference/"
cp /work/shared/reference/checkpoints/*.json "$DEST/reference/checkpoints/"
cp -a /work/shared/wheels "$DEST/wheels"
cp "$WT/scripts/gpu/e2e.sh" "$WT/scripts/gpu/compare_peers.py" "$DEST/"
du -sh "$DEST"
