#!/usr/bin/env bash
# Every test voxkernel has, as CI runs them. Needs only a Rust toolchain (and python3 + pip
# for the NVRTC kernel compile check, which is skipped with a message when pip cannot fetch
# the NVRTC wheel).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

echo "== cargo test"
cargo test --workspace --locked
