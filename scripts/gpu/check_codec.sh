#!/bin/bash
# The CUDA codec decoder's GPU run (H100/H200, CUDA 13, no Rust). Run from the repo root (the
# tiny fixtures are read from tests/fixtures/parity there) with the carried .gpu-codec/ folder
# laid out by scripts/gpu/pack_codec.sh:
#   .gpu-codec/bin/{codec,codec_bench}   release builds (x86-64)
#   .gpu-codec/scripts/make_codec.py     random full-size speech tokenizer decoder (numpy)
# Steps: the full-size decoder is drawn on the CPU in the background while the GPU tests run on
# the tiny fixture codec; then the benchmark and the full-size GPU-vs-CPU check.
set -u
G=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
NVRTC=$(find / -name 'libnvrtc.so.13' -not -path '/proc/*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$(dirname "$NVRTC"):${LD_LIBRARY_PATH:-}"
export XDG_CACHE_HOME=/tmp/vkcache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "nvrtc: $NVRTC"

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
