#!/bin/bash
# The voice encoders' GPU run (H100/H200, CUDA 13, no Rust). Run from the repo root (the tiny
# fixtures are read from tests/fixtures there) with the carried folder laid out by
# scripts/gpu/pack_encoder.sh:
#   bash .gpu-encgpu/encoder.sh
# Steps: a random full-size 0.6B Base checkpoint is built (official classes, make_ckpt.py) in
# the background while the GPU tests run on the tiny fixtures (encoder parity, then the codec
# decoder's tests, which share the kernel module); then `voxkernel synth --backend cuda
# --ref-audio` on both checkpoints and the full-size encode timing.
set -u
G=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
NVRTC=$(find / -name 'libnvrtc.so.13' -not -path '/proc/*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$(dirname "$NVRTC"):${LD_LIBRARY_PATH:-}"
export XDG_CACHE_HOME=/tmp/vkcache PYTHONUNBUFFERED=1
mkdir -p /tmp/vkbin && for f in "$G"/bin/*.xz; do
  python3 -c 'import lzma,sys; open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' "$f" "/tmp/vkbin/$(basename "$f" .xz)"
done
chmod +x /tmp/vkbin/*
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
nproc

CKPT=/tmp/base06
mkdir -p "$G/reference/tokenizer"
cp tests/fixtures/clone/tiny-base/{vocab.json,merges.txt,tokenizer_config.json} "$G/reference/tokenizer/"
(
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_off \
    "$G"/wheels/official/*.whl "$G"/wheels/common/*.whl &&
  PYTHONPATH=/tmp/site_off python3 "$G/refcheck/make_ckpt.py" --out "$CKPT" --size 0.6b --type base
) >"$OUT/make_ckpt.log" 2>&1 &
MAKE=$!

echo "== GPU voice encoder vs the CPU reference (tiny Base fixture; compiles the kernels first)"
VOXKERNEL_CLONE_FIXTURE="$PWD/tests/fixtures/clone/tiny-base" timeout 150 \
  /tmp/vkbin/voice_encoder --include-ignored --skip full_size --test-threads=1 \
  --nocapture 2>&1 | tee "$OUT/voice_encoder.log" | grep -vE '^$|^running' | head -60

echo "== GPU codec decoder tests (the kernel module it shares changed)"
VOXKERNEL_FIXTURES="$PWD/tests/fixtures/parity" timeout 100 /tmp/vkbin/codec --include-ignored \
  --test-threads=1 2>&1 | tee "$OUT/codec.log" | grep -E "^test |test result|panicked" | head -40

TINY=tests/fixtures/clone/tiny-base
synth() {
  timeout 60 /tmp/vkbin/voxkernel synth --backend cuda --text "Hello there." --language english \
    --ref-audio "$TINY/audio/ref_a.wav" --max-frames 4 "$@" 2>&1 | grep -E "encoded|wrote|rror" | cut -c1-400
}
echo "== voxkernel synth --backend cuda --ref-audio (tiny; in-context, then x-vector only)"
synth --model "$TINY" --ref-text "This is the reference." -o "$OUT/tiny_icl.wav"
synth --model "$TINY" --x-vector-only -o "$OUT/tiny_xvec.wav"

wait "$MAKE"
tail -2 "$OUT/make_ckpt.log"
echo "== full-size 0.6B Base: encode time, GPU vs CPU"
VOXKERNEL_ENCODER_CKPT=$CKPT timeout 150 /tmp/vkbin/voice_encoder --include-ignored full_size \
  --nocapture 2>&1 | tee "$OUT/full_size.log" | grep -vE '^$|^running' | head -20
echo "== voxkernel synth --backend cuda --ref-audio (full-size)"
synth --model "$CKPT" --ref-text "This is the reference." -o "$OUT/full_icl.wav"
