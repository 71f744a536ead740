#
# Copyright (c) 2026, the voxkernel authors
#
# SPDX-License-Identifier: Apache-2.0
#

"""The smallest voxkernel pipeline: speak one sentence and save it as a WAV file.

    voxkernel serve --model /path/to/Qwen3-TTS-12Hz-0.6B-CustomVoice --port 8000 &
    python examples/say.py "Hello from voxkernel." --voice ryan --out hello.wav

No keys and no audio device are needed. Pass --play to also hear it through the
default speaker (needs `pip install "pipecat-ai[local]"`).
"""

import argparse
import asyncio
import os
import sys
import wave

from loguru import logger
from pipecat.frames.frames import EndFrame, Frame, TTSAudioRawFrame, TTSSpeakFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.workers.runner import WorkerRunner

from pipecat_voxkernel import VoxkernelTTSService


class WavWriter(FrameProcessor):
    """Collects the bot's audio and writes it to a WAV file at the end."""

    def __init__(self, path: str):
        super().__init__()
        self._path = path
        self._pcm = bytearray()
        self._rate = 24000

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self._pcm += frame.audio
            self._rate = frame.sample_rate
        elif isinstance(frame, EndFrame):
            with wave.open(self._path, "wb") as w:
                w.setnchannels(1)
                w.setsampwidth(2)
                w.setframerate(self._rate)
                w.writeframes(bytes(self._pcm))
            print(f"wrote {len(self._pcm) / 2 / self._rate:.2f} s of audio to {self._path}")
        await self.push_frame(frame, direction)


async def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("text", nargs="?", default="Hello! This is voxkernel speaking.")
    parser.add_argument(
        "--url", default=os.getenv("VOXKERNEL_URL", "ws://127.0.0.1:8000/v1/tts/ws")
    )
    parser.add_argument("--voice", default="ryan")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--out", default="say.wav")
    parser.add_argument("--play", action="store_true", help="also play it on the speaker")
    args = parser.parse_args()
    logger.remove()
    logger.add(sys.stderr, level="INFO")

    tts = VoxkernelTTSService(
        url=args.url,
        api_key=os.getenv("VOXKERNEL_API_KEY"),
        settings=VoxkernelTTSService.Settings(voice=args.voice, seed=args.seed),
    )
    processors = [tts, WavWriter(args.out)]
    if args.play:
        from pipecat.transports.local.audio import LocalAudioTransport, LocalAudioTransportParams

        transport = LocalAudioTransport(LocalAudioTransportParams(audio_out_enabled=True))
        processors.append(transport.output())

    worker = PipelineWorker(Pipeline(processors))
    await worker.queue_frames([TTSSpeakFrame(args.text), EndFrame()])
    runner = WorkerRunner(handle_sigint=True)
    await runner.add_workers(worker)
    await runner.run()


if __name__ == "__main__":
    asyncio.run(main())
