#!/bin/bash
# The CUDA codec decoder's GPU run (H100/H200, CUDA 13, no Rust). Run from the repo root (the
# tiny fixtures are read from tests/fixtures/parity there) with the carried .gpu-codec/ folder
# laid out by scripts/gpu/pack_codec.sh:
#   .gpu-codec/bin/{codec,codec_bench}   release builds (x86-64)
#   .gpu-codec/scripts/make_codec.py     random full-size speech tokenizer decoder (numpy)
# Steps: the full-size decoder is drawn on the CPU in the background while the GPU tests run on
# the tiny fixture codec; then the benchmark and the full-size GPU-vs-CPU check.
# OFFICIAL=1 adds the codec of make_ckpt.py's random 0.6B checkpoint (the one the frame-kernel
# and end-to-end checks use; every parameter random, so not conditioned like make_codec.py's):
# the official decoder decodes 20 random frames in float32 and float64, and `codec_bench --case`
# prints how far the GPU (f32 and tf32) and CPU decodes, and the official float32 one, are from
# the float64 decode. OFFICIAL_ONLY=1 runs that step alone.
set -u
G=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
NVRTC=$(find / -name 'libnvrtc.so.13' -not -path '/proc/*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$(dirname "$NVRTC"):${LD_LIBRARY_PATH:-}"
export XDG_CACHE_HOME=/tmp/vkcache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "nvrtc: $NVRTC"

if [ "${OFFICIAL:-0}" = 1 ] || [ "${OFFICIAL_ONLY:-0}" = 1 ]; then
  echo "== make_ckpt.py's full-size codec against the official float32 and float64 decodes"
  [ -d "$G/reference" ] || tar -C "$G" -xJf "$G/reference.tar.xz"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site_off "$G"/wheels/official/*.whl "$G"/wheels/common/*.whl || exit 1
  [ -f /tmp/ckpt06/model.safetensors ] || PYTHONPATH=/tmp/site_off timeout 400 python3 \
    "$G/refcheck/make_ckpt.py" --out /tmp/ckpt06 --size 0.6b --type custom_voice --no-eos 2>&1 | tail -1
  PYTHONPATH=/tmp/site_off timeout 400 python3 "$G/scripts/codec_precision.py" \
    --speech-tokenizer /tmp/ckpt06/speech_tokenizer --frames 20 --save-case "$OUT/case.safetensors" 2>&1 \
    | grep -v Warning
  timeout 300 "$G/bin/codec_bench" --model /tmp/ckpt06 --case "$OUT/case.safetensors" --batches 1 \
    --calls 10 --warmup 2 --graphs 1 --precision f32,tf32 2>&1 | tee "$OUT/official.log" | grep '"check"'
  [ "${OFFICIAL_ONLY:-0}" = 1 ] && exit 0
fi

CKPT=/tmp/codec06
python3 "$G/scripts/make_codec.py" --out "$CKPT" \
  --encoder-config "$G/scripts/qwen3-tts-tokenizer-12hz.config.json" >"$OUT/make_codec.log" 2>&1 &
MAKE=$!

echo "== GPU codec tests (tiny fixture codec) vs the CPU reference"
VOXKERNEL_FIXTURES="$PWD/tests/fixtures/parity" timeout 300 "$G/bin/codec" --include-ignored \
  --test-threads=1 --nocapture 2>&1 | tee "$OUT/tests.log" \
  | grep -E "max abs|^test |test result|panicked|calls|error" | head -80

wait "$MAKE"
cat "$OUT/make_codec.log"
echo "== benchmark and full-size check"
timeout 300 "$G/bin/codec_bench" --model "$CKPT" ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
grep -v '"profile"' "$OUT/bench.log"
echo "== GPU time per launch kind (profiled call)"
python3 - "$OUT/bench.log" <<'PY'
import json, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{"batch"') and '"profile"' in l]
groups = collections.defaultdict(float)
for r in rows:
    kind = r["profile"].split(" m=")[0].split(" layer")[0].split(" rows")[0]
    groups[(r["precision"], r["graphs"], r["skinny_rows"], r["batch"], kind)] += r["gpu_ms"]
for (precision, graphs, skinny, batch, kind), ms in sorted(groups.items()):
    print(f"{precision} graphs={graphs} skinny_rows={skinny} batch={batch:2d} {kind:14s} {ms:.3f} ms")
PY
