#!/bin/bash
# The GPU machine's whole check (no Rust there), from the repo root (the tiny fixtures are read
# from tests/fixtures) with the folder laid out by scripts/gpu/pack_e2e.sh:
#   PART=tests bash .gpu-e2e/e2e.sh   every GPU test (carry .gpu-e2e/bin and e2e.sh)
#   PART=e2e bash .gpu-e2e/e2e.sh     on one random full-size 0.6B CustomVoice checkpoint without
#                                     EOS: `voxkernel bench --model` (frame kernel), the peers
#                                     (run_peers.sh: official qwen-tts, faster-qwen3-tts) and
#                                     `voxkernel bench --e2e`, then the ratios (carry everything
#                                     in .gpu-e2e but bin/: the two parts together are over the
#                                     64 MiB a call can carry); PEERS=0 leaves the peers out;
#                                     JOINS=N adds `--joins N` (sessions joining busy levels);
#                                     CODEC_PRECISION=tf32 decodes on the tensor cores
set -u
G=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PART=${PART:-all}
FRAMES=${FRAMES:-100}
NVRTC=$(find / -name 'libnvrtc.so.13' -not -path '/proc/*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$(dirname "$NVRTC"):${LD_LIBRARY_PATH:-}"
export XDG_CACHE_HOME=/tmp/vkcache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
B=/tmp/vkbin
mkdir -p $B && for f in "$G"/bin/*.xz "$G"/cli/*.xz; do
  [ -f "$f" ] || continue
  [ -x "$B/$(basename "$f" .xz)" ] || python3 -c 'import lzma,sys; open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' "$f" "$B/$(basename "$f" .xz)"
done
chmod +x $B/*
[ -f "$G/reference.tar.xz" ] && [ ! -d "$G/reference" ] && tar -C "$G" -xJf "$G/reference.tar.xz"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
export CKPT=/tmp/ckpt06 OUT FRAMES VOXKERNEL_FIXTURES="$PWD/tests/fixtures/parity"

make_ckpt() {
  [ -f "$CKPT/model.safetensors" ] && return
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site_off "$G"/wheels/official/*.whl "$G"/wheels/common/*.whl || exit 1
  PYTHONPATH=/tmp/site_off timeout 300 python3 "$G/refcheck/make_ckpt.py" --out "$CKPT" --size 0.6b \
    --type custom_voice --no-eos 2>&1 | tail -1
}

if [ "$PART" != e2e ]; then
  echo "== GPU tests (tiny fixtures)"
  for t in unit parity codec engine prefill voice_encoder; do
    VOXKERNEL_CLONE_FIXTURE="$PWD/tests/fixtures/clone/tiny-base" timeout 300 $B/$t --include-ignored \
      --skip full_size --test-threads=1 2>&1 | tee "$OUT/test_$t.log" \
      | grep -E 'test result|FAILED|panicked' | sed "s/^/$t: /"
  done
fi

if [ "$PART" != tests ]; then
  make_ckpt
  echo "== voxkernel bench --model (frame kernel, 300 frames)"
  timeout 200 $B/voxkernel bench --model "$CKPT" --frames 300 2>&1 | tee "$OUT/bench_frame.log" | grep '^{'
  rm -f "$OUT/peers.jsonl"
  if [ "${PEERS:-1}" = 1 ]; then
    echo "== peers (official, faster-qwen3-tts), $FRAMES frames"
    SKIP_OFFICIAL=${SKIP_OFFICIAL:-0} WHEELS="$G/wheels" bash "$G/refcheck/run_peers.sh" 2>&1 | tail -12
  fi
  echo "== voxkernel bench --e2e"
  timeout 300 $B/voxkernel bench --e2e --model "$CKPT" --backend cuda \
    --concurrency "${CONCURRENCY:-1,4,16}" --frames "$FRAMES" --joins "${JOINS:-0}" --speaker ryan \
    --codec-precision "${CODEC_PRECISION:-f32}" 2>&1 \
    | tee "$OUT/voxkernel.log" | grep -v '^{' | tail -5
  grep '^{' "$OUT/voxkernel.log" > "$OUT/voxkernel.jsonl"
  cat "$OUT/voxkernel.jsonl"
  if [ -s "$OUT/peers.jsonl" ]; then
    echo "== summary"
    python3 "$G/compare_peers.py" "$OUT/voxkernel.jsonl" "$OUT/peers.jsonl"
  fi
fi
