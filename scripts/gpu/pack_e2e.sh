#!/bin/bash
# Lays out /work/main/.gpu-e2e (git-ignored, carried to the GPU machine) for e2e.sh from this
# worktree's release build: the voxkernel CLI, every GPU test binary of voxkernel-cuda, the
# peers' benchmark scripts, make_ckpt.py with its reference files, and the wheels.
set -eu
WT=$(cd "$(dirname "$0")/../.." && pwd)
DEST=${DEST:-/work/main/.gpu-e2e}
T=${CARGO_TARGET_DIR:-$WT/target}/release
rm -rf "$DEST" && mkdir -p "$DEST"/{bin,cli,refcheck,reference/checkpoints}
test_binary() {
  (cd "$WT" && cargo test --release -p voxkernel-cuda "$@" --no-run 2>&1) \
    | grep -o 'target/release/deps/[a-z_]*-[0-9a-f]*' | head -1 | sed 's|^target/release/||'
}
cp "$T/$(test_binary --lib)" "$DEST/bin/unit"
for t in parity codec engine prefill voice_encoder; do
  cp "$T/$(test_binary --test $t)" "$DEST/bin/$t"
done
cp "$T/voxkernel" "$DEST/cli/"
strip "$DEST"/bin/* "$DEST"/cli/*
# The carried tree is limited to 64 MiB and the checkout itself is ~35: compress what can be, and
# carry the test binaries (bin/) and the peers' wheels (wheels/) in separate calls (e2e.sh).
xz -T0 -9e "$DEST"/bin/* "$DEST"/cli/*
cp /work/shared/refcheck/{make_ckpt.py,run_peers.sh,bench_official.py,bench_faster.py} "$DEST/refcheck/"
cp -a /work/shared/reference/tokenizer "$DEST/reference/"
cp /work/shared/reference/checkpoints/*.json "$DEST/reference/checkpoints/"
tar -C "$DEST" -cJf "$DEST/reference.tar.xz" reference && rm -rf "$DEST/reference"
cp -a /work/shared/wheels "$DEST/wheels"
cp "$WT/scripts/gpu/e2e.sh" "$WT/scripts/gpu/compare_peers.py" "$DEST/"
du -sh "$DEST"
