#
# Copyright (c) 2026, the voxkernel authors
#
# SPDX-License-Identifier: Apache-2.0
#

"""Fixtures: a real `voxkernel serve` on loopback, and frame recorders.

The server binary is ``$VOXKERNEL_BIN``, or ``target/release/voxkernel`` of the
repository this package sits in (``cargo build --release -p voxkernel-cli``).
It serves ``$VOXKERNEL_TEST_MODEL``, by default the repository's tiny random
CustomVoice checkpoint, on the CPU backend. It speaks noise, but its timing and
streaming behaviour are real.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from loguru import logger
from pipecat.frames.frames import Frame
from pipecat.observers.base_observer import BaseObserver, FramePushed
from pipecat.processors.frame_processor import FrameDirection

from pipecat_voxkernel import VoxkernelTTSService

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_BIN = REPO_ROOT / "target" / "release" / "voxkernel"
DEFAULT_MODEL = REPO_ROOT / "tests" / "fixtures" / "parity" / "tiny-custom-voice"

# Pipecat logs at DEBUG by default; keep test output readable.
logger.remove()
logger.add(sys.stderr, level=os.environ.get("VOXKERNEL_TEST_LOG_LEVEL", "WARNING"))


def voxkernel_bin() -> Path:
    return Path(os.environ.get("VOXKERNEL_BIN") or DEFAULT_BIN)


def voxkernel_model() -> Path:
    return Path(os.environ.get("VOXKERNEL_TEST_MODEL") or DEFAULT_MODEL)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VoxkernelServer:
    """A `voxkernel serve` process on 127.0.0.1, restartable on the same port."""

    def __init__(
        self,
        log_dir: Path,
        *,
        api_key: str | None = None,
        max_frames: int | None = None,
        name: str = "server",
    ):
        self.port = free_port()
        self.api_key = api_key
        self.max_frames = max_frames or int(os.environ.get("VOXKERNEL_TEST_MAX_FRAMES", "250"))
        self.log_path = log_dir / f"voxkernel-{name}-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/tts/ws"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def start(self, timeout: float = 180.0):
        binary = voxkernel_bin()
        if not binary.exists():
            pytest.fail(
                f"voxkernel binary not found at {binary}: build it with "
                "`cargo build --release -p voxkernel-cli` or set VOXKERNEL_BIN"
            )
        cmd = [
            str(binary),
            "serve",
            "--model",
            str(voxkernel_model()),
            "--backend",
            "cpu",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        # The random checkpoint rarely emits EOS; bound every utterance (250 frames: 20 s).
        cmd += ["--max-frames", str(self.max_frames)]
        env = dict(os.environ)
        env.pop("VOXKERNEL_API_KEY", None)  # `serve` reads its --api-key from there too
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        log = open(self.log_path, "ab")
        log.write(f"\n=== start {self.starts + 1}: {' '.join(cmd)}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self.starts += 1
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(
                    f"voxkernel serve exited with {self.proc.returncode} before it was ready; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.base_url}/readyz", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.1)
        self.kill()
        pytest.fail(f"voxkernel serve not ready within {timeout}s; log:\n{self.log_tail()}")

    def kill(self):
        """SIGKILL: the server dies without closing its connections cleanly."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def voices(self) -> dict:
        with urllib.request.urlopen(f"{self.base_url}/v1/voices", timeout=10) as r:
            return json.loads(r.read())


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One server shared by the tests that don't kill it."""
    srv = VoxkernelServer(tmp_path_factory.mktemp("voxkernel"), name="shared")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def own_server(tmp_path_factory):
    """A server of the test's own, which the test may kill and restart."""
    srv = VoxkernelServer(tmp_path_factory.mktemp("voxkernel"), name="own")
    srv.start()
    yield srv
    srv.stop()


@dataclass
class Pushed:
    t: float
    frame: Frame


class FrameRecorder(BaseObserver):
    """Records, with a monotonic timestamp, every frame one processor pushes."""

    def __init__(self, source):
        super().__init__()
        self.source = source
        self.downstream: list[Pushed] = []
        self.upstream: list[Pushed] = []
        self.into_source: list[Pushed] = []

    async def on_push_frame(self, data: FramePushed):
        now = time.monotonic()
        if data.source is self.source:
            target = (
                self.downstream if data.direction == FrameDirection.DOWNSTREAM else self.upstream
            )
            target.append(Pushed(now, data.frame))
        elif data.destination is self.source:
            self.into_source.append(Pushed(now, data.frame))

    def of(self, kind, where: str = "downstream") -> list[Pushed]:
        return [p for p in getattr(self, where) if isinstance(p.frame, kind)]


class RecordingTTS(VoxkernelTTSService):
    """The service under test, also logging the wire traffic with timestamps."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.sent: list[tuple[float, dict]] = []
        self.wire_audio: list[tuple[float, str, int]] = []  # (t, context_id, samples)
        self.wire_audio_bytes: list[int] = []  # PCM bytes of each audio message
        self.done: list[tuple[float, str, str, dict]] = []
        self.connects = 0
        self.connect_times: list[float] = []

        @self.event_handler("on_context_done")
        async def _on_done(_tts, context_id, finish_reason, usage):
            self.done.append((time.monotonic(), context_id, finish_reason, usage))

        @self.event_handler("on_connected")
        async def _on_connected(_tts):
            self.connects += 1
            self.connect_times.append(time.monotonic())

    async def _send(self, msg):
        await super()._send(msg)
        self.sent.append((time.monotonic(), msg))

    async def _handle_audio(self, message: bytes):
        if message:
            h = message[0]
            ctx = message[1:h].decode("utf-8", errors="replace")
            self.wire_audio.append((time.monotonic(), ctx, (len(message) - h) // 2))
            self.wire_audio_bytes.append(len(message) - h)
        await super()._handle_audio(message)

    def sent_of(self, kind: str, context_id: str | None = None) -> list[tuple[float, dict]]:
        return [
            (t, m)
            for t, m in self.sent
            if m["type"] == kind and (context_id is None or m["context_id"] == context_id)
        ]

    def done_of(self, context_id: str) -> list[tuple[float, str, str, dict]]:
        return [d for d in self.done if d[1] == context_id]
