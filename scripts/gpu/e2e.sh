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
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
export CKPT=/tmp/ckpt06 OUT FRAMES

echo "== checkpoint + peers (official, faster-qwen3-tts), $FRAMES frames"
rm -f "$OUT/peers.jsonl"
SKIP_OFFICIAL=${SKIP_OFFICIAL:-0} bash "$G/refcheck/run_peers.sh" 2>&1 | tail -12

echo "== voxkernel bench --e2e"
timeout 300 "$G/bin/voxkernel" bench --e2e --model "$CKPT" --backend cuda \
  --concurrency "${CONCURRENCY:-1,4,16}" --frames "$FRAMES" --speaker ryan 2>&1 \
  | tee "$OUT/voxkernel.log" | grep -v '^{' | tail -5
grep '^{' "$OUT/voxkernel.log" > "$OUT/voxkernel.jsonl"
cat "$OUT/voxkernel.jsonl"

echo "== summary"
python3 "$G/compare_peers.py" "$OUT/voxkernel.jsonl" "$OUT/peers.jsonl"
