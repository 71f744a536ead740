#!/bin/bash
# The batched-prefill check for the GPU machine (no Rust there). Run from the repo root (it reads
# tests/fixtures/parity there) with the carried folder laid out by scripts/gpu/pack_prefill.sh:
#   bash .gpu-prefill/check_prefill.sh
# 1. GPU tests on the tiny fixtures: the tensor-core product against f64, batched prefill ==
#    solo prefill, parity with the official float32 fixtures, the engine on the GPU.
# 2. A random full-size 0.6B CustomVoice checkpoint (no EOS): prefill logits against the CPU f32
#    reference, batched against solo, host-timed prefill of 1, 4 and 16 prompts of 40 rows.
# 3. (PROFILE=1, the default) ncu: GPU time per kernel of one 1 x 40 and one 16 x 40 prefill.
# 4. `voxkernel bench --e2e --concurrency 1,4,16`: time to first audio through the engine.
# TESTS_ONLY=1 stops after step 1.
set -u
G=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
NVRTC=$(find / -name 'libnvrtc.so.13' -not -path '/proc/*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$(dirname "$NVRTC"):${LD_LIBRARY_PATH:-}"
export XDG_CACHE_HOME=/tmp/vkcache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export VOXKERNEL_FIXTURES="$PWD/tests/fixtures/parity"
mkdir -p /tmp/vkbin && for f in "$G"/bin/*.xz; do
  python3 -c 'import lzma,sys; open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' "$f" "/tmp/vkbin/$(basename "$f" .xz)"
done
chmod +x /tmp/vkbin/*
# make_ckpt.py reads ../reference beside its own folder.
[ -f "$G/reference.tar.xz" ] && python3 -c 'import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$G/reference.tar.xz" "$G"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

echo "== GPU tests (tiny fixtures)"
for t in unit prefill parity engine_gpu; do
  echo "-- $t"
  timeout 240 /tmp/vkbin/$t --include-ignored --test-threads=1 --nocapture 2>&1 | grep -vE '^\s*$' \
    > "$OUT/tests-$t.log"
  grep -E 'test result|panicked|FAILED|rel err|product n' "$OUT/tests-$t.log" | head -40
done

[ "${TESTS_ONLY:-0}" = 1 ] && exit 0

echo "== full-size 0.6B CustomVoice checkpoint (random weights, no EOS)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$G"/whl/*.whl || exit 1
CKPT=/tmp/ckpt06
PYTHONPATH=/tmp/site timeout 300 python3 "$G/refcheck/make_ckpt.py" --out "$CKPT" --size 0.6b --type custom_voice --no-eos 2>&1 | tail -1

echo "== prefill_bench: 40-row prompts"
timeout 300 /tmp/vkbin/prefill_bench --model "$CKPT" --rows 40 --sequences 1,4,16 --reps 20 --cpu-check 2 2>&1 \
  | tee "$OUT/prefill.log" | grep -E '^\{|rror'

if [ "${PROFILE:-1}" = 1 ]; then
  NCU=$(command -v ncu || find / -name ncu -type f -path '*nsight-compute*' -not -path '/proc/*' 2>/dev/null | head -1)
  for n in 1 16; do
    echo "== GPU time per kernel of one $n x 40 prefill (ncu: each kernel alone, clocks and caches untouched)"
    timeout 150 "$NCU" --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \
      /tmp/vkbin/prefill_bench --model "$CKPT" --rows 40 --sequences $n --reps 1 --warmup 0 --no-check \
      > "$OUT/ncu-$n.csv" 2>/dev/null
    python3 - "$OUT/ncu-$n.csv" <<'PY'
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
head = next(r for r in rows if r and r[0] == "ID")
data = [r for r in rows if len(r) == len(head) and r[0].isdigit()]
col = {name: i for i, name in enumerate(head)}
scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
total = collections.defaultdict(float); count = collections.Counter()
for r in data:
    key = (r[col["Kernel Name"]].split("(")[0], r[col["Grid Size"]])
    us = float(r[col["Metric Value"]].replace(",", "")) * scale[r[col["Metric Unit"]]]
    total[key] += us; count[key] += 1
for key, us in sorted(total.items(), key=lambda kv: -kv[1]):
    print(f"  {key[0]:14s} grid {key[1]:14s} x{count[key]:3d}  {us / count[key]:8.2f} us each  {us:9.1f} us")
print(f"  sum of kernel times {sum(total.values()) / 1e3:.3f} ms over {sum(count.values())} launches")
PY
  done
fi

echo "== voxkernel bench --e2e"
timeout 300 /tmp/vkbin/voxkernel bench --e2e --model "$CKPT" --backend cuda --concurrency 1,4,16 \
  --frames "${FRAMES:-100}" --speaker ryan 2>&1 | tee "$OUT/e2e.log" | grep -E '^\{|rror'
