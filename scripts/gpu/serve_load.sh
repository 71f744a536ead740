#!/bin/bash
# The server's load benchmark on the GPU machine: a random full-size 0.6B CustomVoice checkpoint
# (no EOS), `voxkernel serve --backend cuda`, then scripts/bench/load.py for 1, 4 and 16
# concurrent streams. Run from the repo root with the folder laid out by pack_e2e.sh
# (DEST=.gpu-e2e; carry its cli/, refcheck/, reference.tar.xz and wheels/):
#   bash scripts/gpu/serve_load.sh .gpu-e2e
set -u
G=$(cd "$1" && pwd)
NVRTC=$(find / -name 'libnvrtc.so.13' -not -path '/proc/*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$(dirname "$NVRTC"):${LD_LIBRARY_PATH:-}" XDG_CACHE_HOME=/tmp/vkcache
mkdir -p /tmp/vkbin
python3 -c 'import lzma,sys; open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' \
  "$G/cli/voxkernel.xz" /tmp/vkbin/voxkernel && chmod +x /tmp/vkbin/voxkernel
[ -d "$G/reference" ] || tar -C "$G" -xJf "$G/reference.tar.xz"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_off \
  "$G"/wheels/official/*.whl "$G"/wheels/common/*.whl || exit 1
PYTHONPATH=/tmp/site_off python3 "$G/refcheck/make_ckpt.py" --out /tmp/ckpt06 --size 0.6b \
  --type custom_voice --no-eos 2>&1 | tail -1
/tmp/vkbin/voxkernel serve --model /tmp/ckpt06 --backend cuda --port 0 --max-frames 100 \
  --max-sessions 16 2>/tmp/serve.log &
pid=$!
url=
for _ in $(seq 600); do
  url=$(sed -n 's/.*listening on \(http:[^ ]*\).*/\1/p' /tmp/serve.log)
  [ -n "$url" ] && break
  sleep 0.2
done
[ -n "$url" ] || { tail -20 /tmp/serve.log; exit 1; }
for n in 1 4 16; do
  echo "== $n streams"
  timeout 200 python3 scripts/bench/load.py --url "$url" --streams "$n" --rounds 3
done
kill -TERM "$pid"; wait "$pid"
