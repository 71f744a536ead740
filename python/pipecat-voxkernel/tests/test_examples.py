#
# Copyright (c) 2026, the voxkernel authors
#
# SPDX-License-Identifier: Apache-2.0
#

"""The examples: say.py runs against the real server; voice_agent.py compiles."""

import os
import py_compile
import subprocess
import sys
import wave
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_say_writes_speech(server, tmp_path):
    out = tmp_path / "say.wav"
    env = dict(os.environ, VOXKERNEL_URL=server.ws_url)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "say.py"), "Hello from the example.", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with wave.open(str(out)) as w:
        assert w.getframerate() == 24000 and w.getnchannels() == 1
        assert w.getnframes() >= 1920, w.getnframes()


def test_voice_agent_compiles():
    # It needs a microphone, a speaker and STT/LLM services, so CI only checks it compiles.
    py_compile.compile(str(EXAMPLES / "voice_agent.py"), doraise=True)
