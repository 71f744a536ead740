#!/bin/bash
# The one script for the GPU machine (H100/H200, CUDA 13, no Rust). Run from the repo root (it
# reads tests/fixtures/parity there) with
# the carried .gpu/ folder laid out by scripts/gpu/pack.sh:
#   .gpu/bin/{parity,frame_bench,megakernel_check}   release builds (x86-64)
#   .gpu/scripts/{official_dump.py,make_ckpt.py}     .gpu/whl/*.whl (qwen-tts 0.1.1 + deps)
# Steps: GPU parity tests on the tiny checkpoints; a random full-size 0.6B CustomVoice checkpoint
# (--no-eos); the official bf16 run dumped; the teacher-forced comparison; the benchmark.
set -u
G=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
FRAMES=${FRAMES:-120}
NVRTC=$(find / -name 'libnvrtc.so.13' -not -path '/proc/*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$(dirname "$NVRTC"):${LD_LIBRARY_PATH:-}"
export XDG_CACHE_HOME=/tmp/vkcache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "nvrtc: $NVRTC"

echo "== tiny-checkpoint GPU parity tests"
VOXKERNEL_FIXTURES="$PWD/tests/fixtures/parity" timeout 300 "$G/bin/parity" --include-ignored --test-threads=1 --nocapture 2>&1 \
  | grep -vE '^\s*$' | tee "$OUT/parity.log" | tail -40

echo "== full-size 0.6B CustomVoice checkpoint (random weights, no EOS)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$G"/whl/*.whl || exit 1
CKPT=/tmp/ckpt06
PYTHONPATH=/tmp/site timeout 300 python3 "$G/scripts/make_ckpt.py" --out "$CKPT" --size 0.6b --type custom_voice --no-eos 2>&1 | tail -1

echo "== official qwen-tts greedy run (bf16, sdpa), $FRAMES frames"
PYTHONPATH=/tmp/site timeout 400 python3 "$G/scripts/official_dump.py" --ckpt "$CKPT" --frames "$FRAMES" --out /tmp/official.safetensors 2>&1 | grep -E "official:|Error|error" | tail -5

echo "== voxkernel vs official (teacher-forced)"
timeout 300 "$G/bin/megakernel_check" --model "$CKPT" --official /tmp/official.safetensors 2>&1 | tee "$OUT/check.log" | tail -12

echo "== benchmark"
timeout 300 "$G/bin/frame_bench" --model "$CKPT" --frames 300 2>&1 | tee "$OUT/bench.log" | tail -3

echo "== summary"
grep -E "test result|FAILED|panicked" "$OUT/parity.log" | head -8
grep '^{' "$OUT/check.log" "$OUT/bench.log"
