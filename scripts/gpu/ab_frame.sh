#!/bin/bash
# Frame-kernel variants side by side on one GPU machine (runs on different machines of the same
# kind differ by up to ~7%). Lay out the carried folder here, then run there:
#   scripts/gpu/ab_frame.sh pack A.cu B.cu ...   -> /work/main/.gpu-ab (voxkernel, the sources)
#   bash .gpu-ab/ab_frame.sh run                 (carry .gpu and .gpu-ab; .gpu from pack.sh has
#                                                 make_ckpt.py and its wheels; without
#                                                 .gpu-ab/voxkernel.xz, .gpu/bin's is used)
# Each source is compiled there with the machine's NVRTC, as is and with `#define SOLO 1` first
# (the build for launches of one sequence), and loaded through VOXKERNEL_CUBIN and
# VOXKERNEL_SOLO_CUBIN by one `voxkernel` binary, whose host side must match every variant's
# Params and shared memory.
# BASELINE=path/voxkernel.xz: another binary (its own kernel) benched first, on the same machine.
set -u
if [ "${1:-}" = pack ]; then
  shift
  WT=$(cd "$(dirname "$0")/../.." && pwd)
  DEST=/work/main/.gpu-ab
  rm -rf "$DEST" && mkdir -p "$DEST"
  cp "$WT/target/release/voxkernel" "$DEST/" && strip "$DEST/voxkernel" && xz -T0 -6 "$DEST/voxkernel"
  for f in "$@"; do cp "$f" "$DEST/"; done
  cp "$0" "$DEST/ab_frame.sh"
  du -sh "$DEST"
  exit 0
fi
G=$(cd "$(dirname "$0")" && pwd)
NVRTC=$(find / -name 'libnvrtc.so.13' -not -path '/proc/*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$(dirname "$NVRTC"):${LD_LIBRARY_PATH:-}" XDG_CACHE_HOME=/tmp/vkcache
# the packed binary, or pack.sh's when it was left out to keep the carried tree small
BIN="$G/voxkernel.xz"
[ -f "$BIN" ] || BIN=.gpu/bin/voxkernel.xz
python3 -c 'import lzma,sys; open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' \
  "$BIN" /tmp/voxkernel-ab && chmod +x /tmp/voxkernel-ab
CKPT=/tmp/ckpt06
if [ ! -d $CKPT ]; then
  mkdir -p .gpu/reference/tokenizer
  for f in vocab.json merges.txt tokenizer_config.json; do
    cp tests/fixtures/parity/tiny-custom-voice/$f .gpu/reference/tokenizer/
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl
  PYTHONPATH=/tmp/site python3 .gpu/scripts/make_ckpt.py --out $CKPT --size 0.6b --type custom_voice \
    --no-eos 2>&1 | tail -1
fi
summary() {
  python3 - "$1" "$2" <<'PY'
import json, sys
for line in open(sys.argv[2]):
    r = json.loads(line)
    if r.get("bench") == "frame":
        print(f"{sys.argv[1]}: p50 {r['ms_per_frame_p50']} p99 {r['ms_per_frame_p99']} ms ({r['ratio_to_floor']}x)")
    else:
        top = sorted(r["phases"], key=lambda p: -p["us_per_frame"])
        print("   " + ", ".join(f"{p['stack'][0]}.{p['phase']} {p['mean_us']}" for p in top[:12]))
PY
}
if [ -n "${BASELINE:-}" ]; then
  python3 -c 'import lzma,sys; open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' \
    "$BASELINE" /tmp/voxkernel-baseline && chmod +x /tmp/voxkernel-baseline
  /tmp/voxkernel-baseline bench --model $CKPT --frames 300 --profile 10 2>&1 | grep '^{' > /tmp/ab-baseline.jsonl
  summary baseline /tmp/ab-baseline.jsonl
fi
for src in "$G"/*.cu; do
  v=$(basename "$src" .cu)
  for solo in 0 1; do
  python3 - "$NVRTC" "$src" "/tmp/frame-$v-$solo.cubin" "$solo" <<'PY'
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
prog = ctypes.c_void_p()
src = (b"#define SOLO 1\n" if sys.argv[4] == "1" else b"") + open(sys.argv[2], "rb").read()
assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"frame.cu", 0, None, None) == 0
opts = [b"--gpu-architecture=sm_90a", b"-std=c++17", b"-lineinfo"]
assert lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)) == 0, "compile failed"
n = ctypes.c_size_t()
lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
cubin = ctypes.create_string_buffer(n.value)
lib.nvrtcGetCUBIN(prog, cubin)
open(sys.argv[3], "wb").write(cubin.raw)
PY
  done
  VOXKERNEL_CUBIN=/tmp/frame-$v-0.cubin VOXKERNEL_SOLO_CUBIN=/tmp/frame-$v-1.cubin \
    /tmp/voxkernel-ab bench --model $CKPT --frames 300 --profile 10 2>&1 | grep '^{' > /tmp/ab-$v.jsonl
  summary "$v" /tmp/ab-$v.jsonl
done
