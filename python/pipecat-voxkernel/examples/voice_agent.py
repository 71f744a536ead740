#
# Copyright (c) 2026, the voxkernel authors
#
# SPDX-License-Identifier: Apache-2.0
#

"""A voice agent on your computer: microphone → STT → LLM → voxkernel → speaker.

Start a voxkernel server first (on a GPU for real-time speech):

    voxkernel serve --model /path/to/Qwen3-TTS-12Hz-1.7B-CustomVoice --port 8000

Then pick the STT and LLM:

* Cloud (default): Deepgram for STT, OpenAI for the LLM.

      export DEEPGRAM_API_KEY=... OPENAI_API_KEY=...
      python examples/voice_agent.py

* Local, no keys: faster-whisper for STT (its model is downloaded from Hugging
  Face on first use) and any OpenAI-compatible server for the LLM, e.g. Ollama
  (`ollama pull llama3.2`) or vLLM / llama.cpp's server.

      python examples/voice_agent.py --local \
          --llm-base-url http://127.0.0.1:11434/v1 --llm-model llama3.2

Install the extras first: `pip install "pipecat-voxkernel[examples]"` (PyAudio
needs PortAudio: `apt install portaudio19-dev` or `brew install portaudio`).
Use headphones, or the agent will hear itself and interrupt itself.
"""

import argparse
import asyncio
import os
import sys

from dotenv import load_dotenv
from loguru import logger
from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.frames.frames import LLMRunFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import (
    LLMContextAggregatorPair,
    LLMUserAggregatorParams,
)
from pipecat.services.openai.llm import OpenAILLMService
from pipecat.transcriptions.language import Language
from pipecat.transports.local.audio import LocalAudioTransport, LocalAudioTransportParams
from pipecat.workers.runner import WorkerRunner

from pipecat_voxkernel import VoxkernelTTSService

SYSTEM_PROMPT = (
    "You are a friendly voice assistant. Your replies are spoken aloud, so answer in "
    "one to three short, plain sentences, without lists, markdown or emoji."
)


def make_stt(args):
    if args.local:
        from pipecat.services.whisper.stt import WhisperSTTService

        return WhisperSTTService(
            settings=WhisperSTTService.Settings(model=args.whisper_model, language=Language.EN),
        )
    from pipecat.services.deepgram.stt import DeepgramSTTService

    return DeepgramSTTService(api_key=os.environ["DEEPGRAM_API_KEY"])


def make_llm(args):
    settings = OpenAILLMService.Settings(model=args.llm_model, system_instruction=SYSTEM_PROMPT)
    if args.llm_base_url:
        # Local OpenAI-compatible servers ignore the key, but the client wants one.
        api_key = os.getenv("OPENAI_API_KEY") or "local"
        return OpenAILLMService(api_key=api_key, base_url=args.llm_base_url, settings=settings)
    return OpenAILLMService(api_key=os.environ["OPENAI_API_KEY"], settings=settings)


async def main():
    load_dotenv(override=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tts-url", default=os.getenv("VOXKERNEL_URL", "ws://127.0.0.1:8000/v1/tts/ws")
    )
    parser.add_argument("--voice", default="ryan", help="a speaker from GET /v1/voices")
    parser.add_argument("--instruct", default=None, help="style instruction (1.7B models)")
    parser.add_argument("--local", action="store_true", help="Whisper STT instead of Deepgram")
    parser.add_argument("--whisper-model", default="Systran/faster-distil-whisper-small.en")
    parser.add_argument("--llm-base-url", default=os.getenv("LLM_BASE_URL"))
    parser.add_argument("--llm-model", default=os.getenv("LLM_MODEL", "gpt-4.1-mini"))
    args = parser.parse_args()
    if args.local and not args.llm_base_url:
        parser.error("--local needs --llm-base-url (an OpenAI-compatible server)")

    logger.remove()
    logger.add(sys.stderr, level="INFO")

    transport = LocalAudioTransport(
        LocalAudioTransportParams(audio_in_enabled=True, audio_out_enabled=True)
    )
    stt = make_stt(args)
    llm = make_llm(args)
    tts = VoxkernelTTSService(
        url=args.tts_url,
        api_key=os.getenv("VOXKERNEL_API_KEY"),
        settings=VoxkernelTTSService.Settings(
            voice=args.voice, language=Language.EN, instruct=args.instruct
        ),
    )

    context = LLMContext()
    aggregators = LLMContextAggregatorPair(
        context, user_params=LLMUserAggregatorParams(vad_analyzer=SileroVADAnalyzer())
    )

    pipeline = Pipeline(
        [
            transport.input(),
            stt,
            aggregators.user(),
            llm,
            tts,
            transport.output(),
            aggregators.assistant(),
        ]
    )
    worker = PipelineWorker(
        pipeline,
        params=PipelineParams(enable_metrics=True, enable_usage_metrics=True),
    )

    @worker.event_handler("on_pipeline_started")
    async def greet(_worker, _frame):
        context.add_message({"role": "user", "content": "Say hello and offer to help."})
        await worker.queue_frame(LLMRunFrame())

    runner = WorkerRunner(handle_sigint=True)
    await runner.add_workers(worker)
    await runner.run()


if __name__ == "__main__":
    asyncio.run(main())
