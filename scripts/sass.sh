#!/usr/bin/env bash
# A kernel source compiled for sm_90a here, without a GPU or a CUDA toolkit: PyPI's NVRTC (the GPU
# machine's version, 13.0.88) and cuobjdump/nvdisasm, installed once under target/cuda-tools.
#   scripts/sass.sh FILE.cu... [DEFINE=VALUE ...] registers and spills of each function, and the
#                                                 SASS in target/sass/<name>.sass (the files in
#                                                 order as one source, as the runtime joins them:
#                                                 kernels/async_copy.cuh before codec.cu or
#                                                 prefill.cu; <name> is the last file's)
#   scripts/sass.sh --diff REV [DEFINE=VALUE ...] frame.cu at REV against the working tree, in the
#                                                 three builds (full, SOLO, WIDE): how many SASS
#                                                 instructions differ (0: the change is free)
# A DEFINE (for example WARPS=8 or SOLO=1) goes in front of the source as a #define.
set -euo pipefail
cd "$(dirname "$0")/.."
tools=target/cuda-tools
if [ ! -x "$tools/nvidia/cu13/bin/nvdisasm" ] || [ ! -e "$tools/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --target "$tools" \
    'nvidia-cuda-nvrtc==13.0.88' 'nvidia-cuda-cuobjdump>=13,<14' 'nvidia-cuda-nvdisasm>=13,<14'
  chmod +x "$tools"/nvidia/cu13/bin/*
fi
export LD_LIBRARY_PATH="$PWD/$tools/nvidia/cu13/lib" PATH="$PWD/$tools/nvidia/cu13/bin:$PATH"
mkdir -p target/sass

# compile SOURCE CUBIN [DEFINE=VALUE ...]: prints ptxas's report per function
compile() {
  python3 - "$@" <<'PY'
import ctypes, re, sys
source, cubin_path, defines = sys.argv[1], sys.argv[2], sys.argv[3:]
lib = ctypes.CDLL("libnvrtc.so.13")
head = "".join("#define %s\n" % d.replace("=", " ", 1) for d in defines)
src = (head + open(source).read()).encode()
prog = ctypes.c_void_p()
assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"kernel.cu", 0, None, None) == 0
opts = [b"--gpu-architecture=sm_90a", b"-std=c++17", b"-lineinfo", b"--ptxas-options=-v"]
ok = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)) == 0
n = ctypes.c_size_t()
lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
log = ctypes.create_string_buffer(n.value)
lib.nvrtcGetProgramLog(prog, log)
text = log.value.decode(errors="replace")
if not ok:
    sys.exit(text)
name = None
for line in text.splitlines():
    m = re.search(r"Compiling entry function '([^']+)'", line) or re.search(r"Function properties for (\S+)", line)
    if m:
        name = m.group(1)
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
    if m and name:
        print(f"  {name}: stack {m.group(1)} B, spill stores {m.group(2)} B, loads {m.group(3)} B")
    m = re.search(r"Used (\d+) registers", line)
    if m and name:
        print(f"  {name}: {m.group(1)} registers")
lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
cubin = ctypes.create_string_buffer(n.value)
lib.nvrtcGetCUBIN(prog, cubin)
open(cubin_path, "wb").write(cubin.raw)
PY
}

# SASS instructions without their addresses and encodings, under each function's name
sass() { cuobjdump -sass "$1" | grep -E '^\s+/\*[0-9a-f]+\*/|Function :' | sed 's|/\*[0-9a-f]*\*/||; s|;.*||'; }
instructions() { grep -vc 'Function :' "$1"; }

if [ "${1:-}" = --diff ]; then
  rev=$2
  shift 2
  git show "$rev:crates/voxkernel-cuda/kernels/frame.cu" > target/sass/frame-base.cu
  for build in full SOLO WIDE; do
    defines=("$@")
    [ "$build" != full ] && defines+=("$build=1")
    compile target/sass/frame-base.cu target/sass/base.cubin "${defines[@]}" > /dev/null
    compile crates/voxkernel-cuda/kernels/frame.cu target/sass/new.cubin "${defines[@]}" > /dev/null
    sass target/sass/base.cubin > "target/sass/frame-$build-base.sass"
    sass target/sass/new.cubin > "target/sass/frame-$build.sass"
    echo "$build: $(instructions "target/sass/frame-$build-base.sass") instructions at $rev," \
      "$(instructions "target/sass/frame-$build.sass") now," \
      "$(diff "target/sass/frame-$build-base.sass" "target/sass/frame-$build.sass" | grep -c '^[<>]' || true) lines differ"
  done
  exit 0
fi

files=()
while [ $# -gt 0 ] && [ -f "$1" ]; do
  files+=("$1")
  shift
done
name=$(basename "${files[-1]}" .cu)
cat "${files[@]}" > "target/sass/$name-source.cu"
compile "target/sass/$name-source.cu" "target/sass/$name.cubin" "$@"
sass "target/sass/$name.cubin" > "target/sass/$name.sass"
echo "SASS: target/sass/$name.sass ($(instructions "target/sass/$name.sass") instructions)"
