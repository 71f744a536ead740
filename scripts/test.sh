#!/usr/bin/env bash
# Every test voxkernel has, as CI runs them. Needs a Rust toolchain; with python3 + pip it also
# fetches NVRTC (PyPI's nvidia-cuda-nvrtc wheel) so the kernels are compiled for sm_90a even
# without a GPU. GPU tests skip, printing SKIP, where no driver is present.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

nvrtc_dir=target/nvrtc
if [ ! -e "$nvrtc_dir/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  python3 -m pip install --quiet --disable-pip-version-check --target "$nvrtc_dir" 'nvidia-cuda-nvrtc>=13,<14' \
    || echo "NOTE: could not install NVRTC from PyPI; the kernel compile test will print SKIP"
fi
if [ -e "$nvrtc_dir/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  export LD_LIBRARY_PATH="$PWD/$nvrtc_dir/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

echo "== cargo test"
cargo test --workspace --locked
