#!/bin/bash
# Where the frame kernel's warps spend their cycles, by source line and by function: Nsight
# Compute's warp-state sampling over one frame launch of one sequence (the solo build), summed
# per line of frame.cu. A sample counts a warp at an instruction, so this shows where warps wait,
# not the critical path (block 0's phase marks, `bench --profile`, show that).
# On the GPU machine, from the repository root:
#   scripts/gpu/profile_lines.sh BIN CKPT [OUT]   (BIN: the voxkernel CLI; CKPT: a 0.6B checkpoint)
set -eu
BIN=$(realpath "$1") CKPT=$(realpath "$2") OUT=${3:-/tmp/profile_lines}
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
mkdir -p "$OUT"
# The runtime compiles the solo build's source (the kernel with SOLO defined on its first line) as
# frame.cu, and the line table names it in the directory the compile ran in: a kernel cache of
# its own makes the profiled process compile in $OUT, beside this copy.
{ echo '#define SOLO 1'; cat crates/voxkernel-cuda/kernels/frame.cu; } > "$OUT/frame.cu"
rm -rf "$OUT/cache"
# Application replay: every pass reruns the benchmark, so each pass sees the same launch with its
# real exchanges (a kernel replay would find its words already tagged).
(cd "$OUT" && XDG_CACHE_HOME="$OUT/cache" "$NCU" --target-processes all --kernel-name frame_kernel --launch-skip 40 \
  --launch-count 1 --replay-mode application --import-source yes \
  --section WarpStateStats --section InstructionStats --section SourceCounters -o report -f \
  "$BIN" bench --model "$CKPT" --frames 60 --attention-chunk 32 > ncu.log 2>&1) ||
  { tail -20 "$OUT/ncu.log"; exit 1; }
"$NCU" -i "$OUT/report.ncu-rep" --page details 2>&1 | grep -E "Stall|Issued|Executed|Eligible" || true
# Per-line counters come per SASS instruction; the cubin's line table maps them to frame.cu.
"$NCU" -i "$OUT/report.ncu-rep" --page source --print-source sass --csv > "$OUT/sass.csv"
CUBIN=$(ls "$OUT"/cache/voxkernel/frame-solo-*.cubin)
NVDISASM=${NVDISASM:-$(command -v nvdisasm || echo /usr/local/cuda/bin/nvdisasm)}
"$NVDISASM" -g -c "$CUBIN" > "$OUT/frame-solo.sass"
python3 scripts/gpu/profile_lines.py "$OUT/sass.csv" "$OUT/frame-solo.sass" "$OUT/frame.cu"
