#!/usr/bin/env bash
# The Pipecat plugin's tests (python/pipecat-voxkernel), against a real `voxkernel serve`.
#
# Builds nothing: it expects target/release/voxkernel (`cargo build --release -p voxkernel-cli`),
# or the binary named by VOXKERNEL_BIN. It makes a venv in target/py-venv (PYTHON picks the
# interpreter, 3.11 or newer), installs the plugin from its source with the `test` extra (pipecat-ai,
# pytest, PocketSphinx and espeak-ng come as PyPI wheels: no system packages, no model downloads),
# and runs pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

export VOXKERNEL_BIN="${VOXKERNEL_BIN:-$root/target/release/voxkernel}"
if [ ! -x "$VOXKERNEL_BIN" ]; then
  echo "test_python.sh: no voxkernel binary at $VOXKERNEL_BIN; run 'cargo build --release -p voxkernel-cli' first" >&2
  exit 1
fi

python="${PYTHON:-python3}"
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "test_python.sh: $python is $("$python" --version 2>&1); pipecat-ai needs Python 3.11 or newer" >&2
  exit 1
fi

venv=target/py-venv
start=$(date +%s)
if [ ! -x "$venv/bin/python" ]; then
  echo "== python venv ($("$python" --version))"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
fi
echo "== pip install python/pipecat-voxkernel[test]"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  --force-reinstall --no-deps ./python/pipecat-voxkernel
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "./python/pipecat-voxkernel[test]"
echo "   installed in $(( $(date +%s) - start )) s"

echo "== pytest python/pipecat-voxkernel"
cd python/pipecat-voxkernel
# The plugin is imported from the installed wheel, not from src/.
timeout 1800 "$root/$venv/bin/python" -m pytest -p no:cacheprovider -rs "$@"
