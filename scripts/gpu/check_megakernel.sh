#!/bin/bash
# The one script for the GPU machine (H100/H200, CUDA 13, no Rust). Run from the repo root (it
# reads tests/fixtures/parity there) with the carried folder laid out by scripts/gpu/pack.sh:
#   bash .gpu/scripts/check_megakernel.sh
#   .gpu/bin/{parity,engine_gpu,voxkernel,megakernel_check}.xz   release builds (x86-64)
#   .gpu/scripts/{official_dump.py,official_forced.py,make_ckpt.py}   .gpu/whl/*.whl (qwen-tts 0.1.1 + deps)
# Steps: the GPU parity and sampler tests on the tiny checkpoints; the GPU engine tests; a random
# full-size 0.6B CustomVoice checkpoint (--no-eos); `voxkernel bench` on it once per attention
# chunk length in CHUNKS, each with a phase profile; with OFFICIAL=1 also the official bf16 run
# dumped, the teacher-forced comparison against it, and the official model compared with itself
# the same way under other arithmetic (the noise floor under that comparison).
set -u
G=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
FRAMES=${FRAMES:-120}
CHUNKS=${CHUNKS:-"32"}
NVRTC=$(find / -name 'libnvrtc.so.13' -not -path '/proc/*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$(dirname "$NVRTC"):${LD_LIBRARY_PATH:-}"
export XDG_CACHE_HOME=/tmp/vkcache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
B=/tmp/vkbin
mkdir -p $B && for f in "$G"/bin/*.xz; do
  python3 -c 'import lzma,sys; open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' "$f" "$B/$(basename "$f" .xz)"
done
chmod +x $B/*
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
echo "nvrtc: $NVRTC"

echo "== tiny-checkpoint GPU parity and sampler tests"
VOXKERNEL_FIXTURES="$PWD/tests/fixtures/parity" timeout 400 $B/parity --include-ignored --test-threads=1 --nocapture 2>&1 \
  | grep -vE '^\s*$' | tee "$OUT/parity.log" | tail -40

echo "== GPU engine tests (tiny checkpoint): concurrent == solo, streamed text == whole text"
VOXKERNEL_FIXTURES="$PWD/tests/fixtures/parity" timeout 200 $B/engine_gpu --include-ignored \
  --test-threads=1 2>&1 | grep -E '^test |test result|panicked|differ' | tee "$OUT/engine.log"

echo "== full-size 0.6B CustomVoice checkpoint (random weights, no EOS)"
mkdir -p "$G/reference/tokenizer"
for f in vocab.json merges.txt tokenizer_config.json; do
  cp "$PWD/tests/fixtures/parity/tiny-custom-voice/$f" "$G/reference/tokenizer/"
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$G"/whl/*.whl || exit 1
CKPT=/tmp/ckpt06
PYTHONPATH=/tmp/site timeout 300 python3 "$G/scripts/make_ckpt.py" --out "$CKPT" --size 0.6b --type custom_voice --no-eos 2>&1 | tail -1

if [ "${OFFICIAL:-0}" = 1 ]; then
  echo "== official qwen-tts greedy run (bf16, sdpa), $FRAMES frames"
  PYTHONPATH=/tmp/site timeout 400 python3 "$G/scripts/official_dump.py" --ckpt "$CKPT" --frames "$FRAMES" --out /tmp/official.safetensors 2>&1 | grep -E "official:|Error|error" | tail -5
  echo "== voxkernel vs official (teacher-forced)"
  timeout 300 $B/megakernel_check --model "$CKPT" --official /tmp/official.safetensors 2>&1 | tee "$OUT/check.log" | tail -12
  echo "== the official model against itself, teacher-forced the same way (bf16 sdpa / bf16 eager / f32)"
  PYTHONPATH=/tmp/site timeout 300 python3 "$G/scripts/official_forced.py" --ckpt "$CKPT" \
    --dump /tmp/official.safetensors --frames "$FRAMES" 2>&1 | grep -E " vs |forced|Error" | tee "$OUT/official_forced.log"
fi

echo "== frame-kernel benchmark (300 frames after 20 warm-up, sampling on), attention chunks: $CHUNKS"
rm -f "$OUT/bench.jsonl"
for chunk in $CHUNKS; do
  timeout 300 $B/voxkernel bench --model "$CKPT" --frames 300 --attention-chunk "$chunk" --profile 10 2>&1 \
    | tee -a "$OUT/bench.log" | grep '^{' >> "$OUT/bench.jsonl"
done

echo "== summary"
grep -E "test result|FAILED|panicked" "$OUT/parity.log" "$OUT/engine.log" | head -12
grep '^{' "$OUT/check.log" 2>/dev/null
grep ' vs ' "$OUT/official_forced.log" 2>/dev/null
grep '"bench":"frame"' "$OUT/bench.jsonl"
python3 - "$OUT/bench.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("bench") == "frame":
        print(f"chunk {r['attention_chunk']:>3}: p50 {r['ms_per_frame_p50']} ms, "
              f"p99 {r['ms_per_frame_p99']} ms, {r['ratio_to_floor']}x floor {r['floor_ms']} ms ({r['gpu']})")
        continue
    top = sorted(r["phases"], key=lambda p: -p["us_per_frame"])
    print(f"  profile: kernel {r['kernel_us']} us/frame at {r['sm_clock_mhz']} MHz; " + ", ".join(
        f"{p['stack'][0]}.{p['phase']} {p['us_per_frame']} ({p['mean_us']} x{p['per_frame']:g})" for p in top))
EOF
