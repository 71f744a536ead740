#!/bin/bash
# Registered voices through `voxkernel serve --backend cuda` on the tiny Base fixture: register one
# (GPU encoders), speak in it, a bad registration, list, delete, speak after the delete. Run from the
# repo root with .gpu-e2e/cli carried (scripts/gpu/pack_e2e.sh): bash scripts/gpu/serve_voices.sh
set -u
G=.gpu-e2e
NVRTC=$(find / -name 'libnvrtc.so.13' -not -path '/proc/*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$(dirname "$NVRTC"):${LD_LIBRARY_PATH:-}" XDG_CACHE_HOME=/tmp/vkcache
mkdir -p /tmp/vkbin
python3 -c 'import lzma,sys; open(sys.argv[2],"wb").write(lzma.open(sys.argv[1]).read())' "$G/cli/voxkernel.xz" /tmp/vkbin/voxkernel && chmod +x /tmp/vkbin/voxkernel
M=tests/fixtures/clone/tiny-base
/tmp/vkbin/voxkernel serve --model $M --backend cuda --port 0 --max-frames 40 2>/tmp/serve.log &
pid=$!
url=
for _ in $(seq 600); do url=$(sed -n 's/.*listening on \(http:[^ ]*\).*/\1/p' /tmp/serve.log); [ -n "$url" ] && break; sleep 0.2; done
[ -n "$url" ] || { tail -20 /tmp/serve.log; exit 1; }
echo "== POST /v1/voices"
curl -s -w ' [%{http_code} in %{time_total}s]\n' -F audio=@$M/audio/ref_a.wav -F name=alice -F "transcript=Hello, this is a test." $url/v1/voices | tee /tmp/voice.json
id=$(sed -n 's/.*"id": *"\([^"]*\)".*/\1/p' /tmp/voice.json)
echo "id=$id"
echo "== speech in it"
curl -s -o /tmp/out.wav -w '[%{http_code} %{size_download} bytes in %{time_total}s]\n' -H 'content-type: application/json' \
  -d "{\"model\":\"tts-1\",\"input\":\"Nice to meet you.\",\"voice\":\"$id\",\"response_format\":\"wav\"}" $url/v1/audio/speech
echo "== bad: missing transcript"
curl -s -w ' [%{http_code}]\n' -F audio=@$M/audio/ref_a.wav -F name=bob $url/v1/voices
echo "== list, delete, speech after delete"
curl -s $url/v1/voices; echo
curl -s -o /dev/null -w '[DELETE %{http_code}]\n' -X DELETE $url/v1/voices/$id
curl -s -w ' [%{http_code}]\n' -H 'content-type: application/json' -d "{\"model\":\"tts-1\",\"input\":\"Hi.\",\"voice\":\"$id\"}" $url/v1/audio/speech
grep -iE "encoder|voice" /tmp/serve.log | head -5
kill -TERM $pid; wait $pid
