#!/bin/bash
# Lays out /work/main/.gpu-prefill (git-ignored, carried to the GPU machine) for check_prefill.sh
# from this worktree's release build: the GPU test binaries (the crate's unit tests with the
# tensor-core product test, the batched-prefill tests, the fixture parity tests, the engine on the
# GPU), the prefill_bench example, the voxkernel CLI, and make_ckpt.py with its wheels and files.
set -eu
WT=$(cd "$(dirname "$0")/../.." && pwd)
DEST=${DEST:-/work/main/.gpu-prefill}
T=${CARGO_TARGET_DIR:-$WT/target}/release
rm -rf "$DEST" && mkdir -p "$DEST"/{bin,refcheck,reference/checkpoints,whl}
test_binary() {
  (cd "$WT" && cargo test --release -p voxkernel-cuda "$@" --no-run 2>&1) \
    | grep -o 'target/release/deps/[a-z_]*-[0-9a-f]*' | head -1 | sed 's|^target/release/||'
}
cp "$T/$(test_binary --lib)" "$DEST/bin/unit"
cp "$T/$(test_binary --test prefill)" "$DEST/bin/prefill"
cp "$T/$(test_binary --test parity)" "$DEST/bin/parity"
cp "$T/$(test_binary --test engine)" "$DEST/bin/engine_gpu"
cp "$T/examples/prefill_bench" "$T/voxkernel" "$DEST/bin/"
strip "$DEST"/bin/*
# The carried tree is limited to 64 MiB: compressed binaries leave room for the wheels.
xz -T0 -9e "$DEST"/bin/*
# make_ckpt.py reads ../reference/{tokenizer,checkpoints} beside its own folder.
# Compressed too (check_prefill.sh unpacks it with Python: xz may be missing there).
cp /work/shared/refcheck/make_ckpt.py "$DEST/refcheck/"
cp -a /work/shared/reference/tokenizer "$DEST/reference/"
cp /work/shared/reference/checkpoints/*.json "$DEST/reference/checkpoints/"
tar -C "$DEST" -cJf "$DEST/reference.tar.xz" reference && rm -rf "$DEST/reference"
cp /work/shared/wheels/official/*.whl /work/shared/wheels/common/*.whl "$DEST/whl/"
cp "$WT/scripts/gpu/check_prefill.sh" "$DEST/"
du -sh "$DEST"
