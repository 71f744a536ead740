#!/usr/bin/env bash
# Every test voxkernel has, as CI runs them. Needs a Rust toolchain; with python3 + pip it also
# fetches NVRTC (PyPI's nvidia-cuda-nvrtc wheel) so the kernels are compiled for sm_90a even
# without a GPU. GPU tests are ignored (reported as such) where no driver is present. It also
# installs the `openai` package from PyPI into a venv (target/py-openai) for the OpenAI client
# test of `voxkernel serve`, runs a small load benchmark against the server on the CPU, and runs
# the Pipecat plugin's tests (scripts/test_python.sh) against a release build of the server.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

# The GPU machine's NVRTC version, so that the compile-and-spill test sees the registers the GPU runs get.
nvrtc_dir=target/nvrtc-13.0.88
if [ ! -e "$nvrtc_dir/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  python3 -m pip install --quiet --disable-pip-version-check --target "$nvrtc_dir" 'nvidia-cuda-nvrtc==13.0.88' \
    || echo "NOTE: could not install NVRTC from PyPI; the kernel compile test will fail"
fi
if [ -e "$nvrtc_dir/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  export LD_LIBRARY_PATH="$PWD/$nvrtc_dir/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

echo "== cargo test"
cargo test --workspace --locked

# The official `openai` Python package against `voxkernel serve` (needs PyPI, as CI has).
echo "== openai Python package against voxkernel serve"
openai_venv=target/py-openai
if [ ! -x "$openai_venv/bin/python" ]; then
  python3 -m venv "$openai_venv"
fi
"$openai_venv/bin/python" -m pip install --quiet --disable-pip-version-check 'openai>=1.60,<4'
# --workspace, as above: the same feature set, so nothing is rebuilt.
VOXKERNEL_TEST_PYTHON="$PWD/$openai_venv/bin/python" \
  cargo test --workspace --locked --test serve -- --ignored

# The load benchmark, small: 2 concurrent streams on the CPU with the tiny checkpoint (a debug
# build: its figures show the script works, not how fast voxkernel is).
echo "== load benchmark (CPU, tiny checkpoint, 2 streams)"
bench_log=target/bench-serve.log
target/debug/voxkernel serve --model tests/fixtures/parity/tiny-custom-voice --backend cpu \
  --port 0 --max-frames 40 2>"$bench_log" &
bench_pid=$!
trap 'kill "$bench_pid" 2>/dev/null || true' EXIT
bench_url=
for _ in $(seq 600); do
  bench_url=$(sed -n 's/.*listening on \(http:[^ ]*\).*/\1/p' "$bench_log")
  [ -n "$bench_url" ] && break
  kill -0 "$bench_pid" 2>/dev/null || break
  sleep 0.1
done
[ -n "$bench_url" ] || { cat "$bench_log"; echo "voxkernel serve did not start"; exit 1; }
python3 scripts/bench/load.py --url "$bench_url" --streams 2 --rounds 2
# SIGTERM: the server drains (nothing is in flight now) and exits cleanly.
kill -TERM "$bench_pid"
wait "$bench_pid"
trap - EXIT

# The Pipecat plugin against a real `voxkernel serve` (release build), including the offline
# STT -> LLM -> TTS pipeline test.
echo "== Pipecat plugin (python/pipecat-voxkernel) against voxkernel serve"
cargo build --release --locked -p voxkernel-cli
./scripts/test_python.sh
