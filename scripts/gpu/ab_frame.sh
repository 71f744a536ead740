#!/bin/bash
# Frame-kernel variants side by side on one GPU machine (runs on different machines of the same
# kind differ by up to ~7%). Each variant is a frame.cu, compiled there with the machine's NVRTC
# for every build (as is, with `#define SOLO 1` first, and with WIDEBUILD=1 `#define WIDE 1`
# first) and loaded through VOXKERNEL_CUBIN, VOXKERNEL_SOLO_CUBIN and VOXKERNEL_WIDE_CUBIN by
# one `voxkernel` binary, whose host side must match every variant's Params and shared memory.
# Lay out the carried folder here (after `cargo build --release -p voxkernel-cli -p
# voxkernel-cuda --tests`), then run there:
#   scripts/gpu/ab_frame.sh pack A.cu B.cu ...   -> /work/main/.gpu-ab (binaries, sources)
#   bash .gpu-ab/ab_frame.sh                     (carry .gpu-ab and pack.sh's .gpu/whl,
#                                                 .gpu/scripts and .gpu/reference: make_ckpt.py
#                                                 and its wheels)
# What runs, by environment (a variant is named by its source, without .cu):
#   VARIANTS      benched, and their `synth` codes and WAV md5 printed in three sampling modes
#                 (default, greedy, top-p over every kept logit); default: every source
#   SYNTH=0       no `synth`
#   TESTVARIANTS  GPU parity and engine tests with these variants' cubins
#   ROUNDS        alternating rounds of `bench` (300 frames, batch 1, phase marks); default 2
#   E2E=N         N rounds of `bench --e2e` for E2EVARIANTS (default VARIANTS) at CONC sessions
#                 (default 1,16)
#   BASELINE=path/voxkernel.xz: another binary (its own kernels) benched first.
set -u
if [ "${1:-}" = pack ]; then
  shift
  WT=$(cd "$(dirname "$0")/../.." && pwd)
  T=${CARGO_TARGET_DIR:-$WT/target}/release
  DEST=/work/main/.gpu-ab
  rm -rf "$DEST" && mkdir -p "$DEST/bin"
  test_binary() {
    (cd "$WT" && cargo test --release -p voxkernel-cuda --test "$1" --no-run 2>&1) \
      | grep -o "target/release/deps/$1-[0-9a-f]*" | head -1
  }
  cp "$T/deps/$(basename "$(test_binary parity)")" "$DEST/bin/parity"
  cp "$T/deps/$(basename "$(test_binary engine)")" "$DEST/bin/engine"
  cp "$T/voxkernel" "$DEST/bin/voxkernel"
  strip "$DEST"/bin/* && xz -T0 -6 "$DEST"/bin/*
  for f in "$@"; do cp "$f" "$DEST/"; done
  cp "$0" "$DEST/ab_frame.sh"
  du -sh "$DEST"
  exit 0
fi
G=$(cd "$(dirname "$0")" && pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
NVRTC=$(find / -name 'libnvrtc.so.13' -not -path '/proc/*' 2>/dev/null | head -1)
LD_LIBRARY_PATH="$(dirname "$NVRTC"):${LD_LIBRARY_PATH:-}"
export LD_LIBRARY_PATH XDG_CACHE_HOME=/tmp/vkcache
export VOXKERNEL_FIXTURES="$PWD/tests/fixtures/parity"
B=/tmp/ab-bin
mkdir -p "$B"
unxz_to() { python3 -c 'import lzma,sys; open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' "$1" "$2" && chmod +x "$2"; }
for f in "$G"/bin/*.xz; do
  [ -x "$B/$(basename "$f" .xz)" ] || unxz_to "$f" "$B/$(basename "$f" .xz)"
done
t0=$(date +%s)
CKPT=/tmp/ckpt06
if [ ! -s "$CKPT/model.safetensors" ]; then
  rm -rf "$CKPT"
  (
    mkdir -p .gpu/reference/tokenizer
    for f in vocab.json merges.txt tokenizer_config.json; do
      cp tests/fixtures/parity/tiny-custom-voice/$f .gpu/reference/tokenizer/
    done
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl
    PYTHONPATH=/tmp/site timeout 300 python3 .gpu/scripts/make_ckpt.py --out "$CKPT" --size 0.6b \
      --type custom_voice --no-eos 2>&1 | tail -1
  ) &
fi
ALL=$(for src in "$G"/*.cu; do basename "$src" .cu; done)
VARIANTS=${VARIANTS:-$ALL}
# build 0: as is (launches of 2-4), 1: SOLO (one sequence), 2: WIDE (5-8)
for v in $ALL; do
  for build in 0 1 ${WIDEBUILD:+2}; do
    [ -s "/tmp/ab-$v-$build.cubin" ] && continue
    python3 - "$NVRTC" "$G/$v.cu" "/tmp/ab-$v-$build.cubin" "$build" <<'PY' &
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
prog = ctypes.c_void_p()
first = {"0": b"", "1": b"#define SOLO 1\n", "2": b"#define WIDE 1\n"}[sys.argv[4]]
src = first + open(sys.argv[2], "rb").read()
assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"frame.cu", 0, None, None) == 0
opts = [b"--gpu-architecture=sm_90a", b"-std=c++17", b"-lineinfo"]
assert lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)) == 0, sys.argv[2]
n = ctypes.c_size_t()
lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
cubin = ctypes.create_string_buffer(n.value)
lib.nvrtcGetCUBIN(prog, cubin)
open(sys.argv[3], "wb").write(cubin.raw)
PY
  done
done
wait
echo "setup $(($(date +%s) - t0)) s"
with_variant() {
  local v=$1 wide=()
  shift
  [ -s "/tmp/ab-$v-2.cubin" ] && wide=("VOXKERNEL_WIDE_CUBIN=/tmp/ab-$v-2.cubin")
  timeout 300 env "VOXKERNEL_CUBIN=/tmp/ab-$v-0.cubin" "VOXKERNEL_SOLO_CUBIN=/tmp/ab-$v-1.cubin" \
    "${wide[@]}" "$@"
}
for v in ${TESTVARIANTS:-}; do
  for t in parity engine; do
    with_variant "$v" "$B/$t" --include-ignored --skip full_size --test-threads=1 > "/tmp/ab-$t.log" 2>&1
    grep -E 'test result|FAILED|panicked' "/tmp/ab-$t.log" | head -6 | sed "s/^/$v $t: /"
  done
done
if [ "${SYNTH:-1}" = 1 ]; then
  for v in $VARIANTS; do
    for mode in "" "--greedy" "--top-p 0.8 --subtalker-top-p 0.9 --top-k 0 --subtalker-top-k 100"; do
      # shellcheck disable=SC2086 # (a mode is several arguments)
      with_variant "$v" "$B/voxkernel" synth --model "$CKPT" --speaker ryan --language english \
        --text "Hello from voxkernel." --seed 1 --max-frames 40 $mode --codes-out /tmp/ab-codes.txt \
        -o /tmp/ab.wav > /tmp/ab-synth.log 2>&1 || { echo "$v synth [$mode] failed"; tail -3 /tmp/ab-synth.log; }
      echo "$v synth [$mode]: $(md5sum < /tmp/ab-codes.txt | cut -c1-12) $(md5sum < /tmp/ab.wav | cut -c1-12)"
    done
  done
fi
# `bench` JSON lines: the frame figures, and in a variant's first round its phase marks (us, mean)
summary() {
  python3 - "$1" "$2" <<'PY'
import json, sys
for line in open(sys.argv[2]):
    r = json.loads(line)
    if r.get("bench") == "frame":
        print(f"{sys.argv[1]}: p50 {r['ms_per_frame_p50']} p99 {r['ms_per_frame_p99']} ms ({r['ratio_to_floor']}x)")
    elif "phases" in r and sys.argv[1].endswith("@1"):
        print("   " + ", ".join(f"{p['stack'][0]}.{p['phase']} {p['mean_us']}" for p in r["phases"]))
PY
}
if [ -n "${BASELINE:-}" ]; then
  unxz_to "$BASELINE" /tmp/ab-baseline
  /tmp/ab-baseline bench --model "$CKPT" --frames 300 --attention-chunk 32 --profile 10 2>&1 \
    | grep '^{' > /tmp/ab-baseline.jsonl
  summary baseline@1 /tmp/ab-baseline.jsonl
fi
for round in $(seq 1 "${ROUNDS:-2}"); do
  for v in $VARIANTS; do
    with_variant "$v" "$B/voxkernel" bench --model "$CKPT" --frames 300 --attention-chunk 32 --profile 10 2>&1 \
      | grep '^{' > "/tmp/ab-$v.jsonl"
    summary "$v@$round" "/tmp/ab-$v.jsonl"
  done
  echo "round $round at $(($(date +%s) - t0)) s"
done
cat > /tmp/ab-e2e.py <<'PY'
import json, sys
for line in sys.stdin:
    if not line.startswith("{"):
        continue
    r = json.loads(line)
    if r.get("bench") != "e2e":
        continue
    m, t = r["ms_per_frame"], r["time_to_first_audio_ms"]
    print(f"  {sys.argv[1]} {r['concurrency']:>2}: wall {m['wall']:.3f} kernel {m['frame_kernel']:.3f} "
          f"codec {m['codec']:.3f} ms, RTF {r['rtf_per_stream']['p50']:.4f}, TTFA {t['p50']:.1f} / {t['p95']:.1f}")
PY
for _ in $(seq 1 "${E2E:-0}"); do
  for v in ${E2EVARIANTS:-$VARIANTS}; do
    with_variant "$v" "$B/voxkernel" bench --e2e --model "$CKPT" --backend cuda --concurrency "${CONC:-1,16}" \
      --frames 100 --speaker ryan 2>/dev/null | python3 /tmp/ab-e2e.py "$v"
  done
done
