#!/bin/bash
# The end-to-end comparison for the GPU machine (no Rust there): one random full-size 0.6B
# CustomVoice checkpoint without EOS, then `voxkernel bench --e2e` and the peers
# (run_peers.sh: official qwen-tts and faster-qwen3-tts) on it, then the ratios.
# Run from the repo root with the carried folder laid out by scripts/gpu/pack_e2e.sh:
#   bash .gpu-e2e/e2e.sh
set -u
G=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
FRAMES=${FRAMES:-100}
NVRTC=$(find / -name 'libnvrtc.so.13' -not -path '/proc/*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$(dirname "$NVRTC"):${LD_LIBRARY_PATH:-}"
export XDG_CACHE_HOME=/tmp/vkcache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p /tmp/vkbin && for f in "$G"/bin/*.xz; do
  python3 -c 'import lzma,sys; open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' "$f" "/tmp/vkbin/$(basename "$f" .xz)"
done
chmod +x /tmp/vkbin/*
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
export CKPT=/tmp/ckpt06 OUT FRAMES

echo "== GPU engine tests (tiny checkpoint): concurrent == solo, streamed text == whole text"
VOXKERNEL_FIXTURES="$PWD/tests/fixtures/parity" timeout 120 /tmp/vkbin/engine_gpu --include-ignored \
  --test-threads=1 2>&1 | grep -E '^test |test result|panicked|differ' | tee "$OUT/engine_gpu.log"

echo "== checkpoint + peers (official, faster-qwen3-tts), $FRAMES frames"
rm -f "$OUT/peers.jsonl"
SKIP_OFFICIAL=${SKIP_OFFICIAL:-0} bash "$G/refcheck/run_peers.sh" 2>&1 | tail -12

echo "== voxkernel bench --e2e"
timeout 300 /tmp/vkbin/voxkernel bench --e2e --model "$CKPT" --backend cuda \
  --concurrency "${CONCURRENCY:-1,4,16}" --frames "$FRAMES" --speaker ryan 2>&1 \
  | tee "$OUT/voxkernel.log" | grep -v '^{' | tail -5
grep '^{' "$OUT/voxkernel.log" > "$OUT/voxkernel.jsonl"
cat "$OUT/voxkernel.jsonl"

echo "== summary"
python3 "$G/compare_peers.py" "$OUT/voxkernel.jsonl" "$OUT/peers.jsonl"
