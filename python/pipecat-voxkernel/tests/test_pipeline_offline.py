#
# Copyright (c) 2026, the voxkernel authors
#
# SPDX-License-Identifier: Apache-2.0
#

"""A whole voice-agent turn, offline: no keys, no network beyond loopback.

espeak-ng speech → Silero VAD → PocketSphinx STT → Pipecat's OpenAI LLM service
(pointed at an OpenAI-compatible stub on loopback) → VoxkernelTTSService (a real
`voxkernel serve`) → output.

espeak-ng comes from the ``espeakng-loader`` wheel (the library and its data,
driven through ctypes here), PocketSphinx from its wheel with the English model
inside, Silero VAD and the smart-turn model from the pipecat-ai wheel.
"""

import asyncio
import ctypes
import json
import re
import time
import wave

import numpy as np
import pytest
from aiohttp import web
from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.frames.frames import (
    EndFrame,
    Frame,
    InputAudioRawFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
    TTSStoppedFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import (
    LLMContextAggregatorPair,
    LLMUserAggregatorParams,
)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.llm import OpenAILLMService
from pipecat.services.stt_service import SegmentedSTTService
from pipecat.utils.time import time_now_iso8601
from pipecat.workers.runner import WorkerRunner

from pipecat_voxkernel import VoxkernelTTSService

from conftest import FrameRecorder, RecordingTTS

espeakng_loader = pytest.importorskip(
    "espeakng_loader", reason="the test extra (espeak-ng for the user's speech) is not installed"
)
pocketsphinx = pytest.importorskip(
    "pocketsphinx", reason="the test extra (PocketSphinx STT) is not installed"
)

IN_RATE = 16000
CHUNK_S = 0.02
USER_SAYS = "What is the capital of France?"
# Short: the tiny random checkpoint rarely emits EOS, so the reply runs to the server's
# runaway guard (50 frames + 20 per text token).
REPLY = "The capital of France is Paris. Anything else?"


#
# The user's voice: espeak-ng through its C API
#

_espeak = None


def espeak(text: str) -> tuple[np.ndarray, int]:
    """Synthesize text with espeak-ng; returns int16 samples and their rate."""
    global _espeak
    if _espeak is None:
        lib = ctypes.CDLL(espeakng_loader.get_library_path())
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_Synth.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_uint,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        callback_type = ctypes.CFUNCTYPE(
            ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
        )
        chunks: list[np.ndarray] = []

        def on_audio(wav, n, _events):
            if wav and n > 0:
                chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
            return 0

        callback = callback_type(on_audio)
        # AUDIO_OUTPUT_SYNCHRONOUS = 2: synthesis runs inside espeak_Synth.
        rate = lib.espeak_Initialize(2, 0, espeakng_loader.get_data_path().encode(), 0)
        assert rate > 0, "espeak-ng failed to initialise"
        lib.espeak_SetSynthCallback(callback)
        assert lib.espeak_SetVoiceByName(b"en-us") == 0
        _espeak = (lib, rate, chunks, callback)
    lib, rate, chunks, _ = _espeak
    chunks.clear()
    data = text.encode() + b"\0"
    # position_type POS_CHARACTER = 1, flags espeakCHARS_AUTO = 0
    assert lib.espeak_Synth(data, len(data), 0, 1, 0, 0, None, None) == 0
    lib.espeak_Synchronize()
    return np.concatenate(chunks), rate


def user_speech_16k(text: str) -> bytes:
    import soxr

    samples, rate = espeak(text)
    resampled = soxr.resample(samples.astype(np.float32) / 32768.0, rate, IN_RATE)
    pcm = (np.clip(resampled, -1.0, 1.0) * 32767).astype(np.int16)
    silence = np.zeros(int(0.5 * IN_RATE), dtype=np.int16)
    return np.concatenate([silence, pcm]).tobytes()


#
# STT: PocketSphinx, whose wheel ships an en-US model
#


class PocketSphinxSTTService(SegmentedSTTService):
    """Transcribes each VAD segment with PocketSphinx."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._decoder = None

    @property
    def wants_wav_segments(self) -> bool:
        return False

    def _decode(self, audio: bytes) -> str:
        if self._decoder is None:
            self._decoder = pocketsphinx.Decoder(samprate=self.sample_rate)
        self._decoder.start_utt()
        self._decoder.process_raw(audio, full_utt=True)
        self._decoder.end_utt()
        hyp = self._decoder.hyp()
        return hyp.hypstr if hyp else ""

    async def run_stt(self, audio: bytes):
        text = await asyncio.to_thread(self._decode, audio)
        if text:
            yield TranscriptionFrame(text, self._user_id, time_now_iso8601())


#
# LLM: an OpenAI-compatible chat completions stub that streams like a model
#


class LLMStub:
    def __init__(self, reply: str, token_gap: float = 0.15):
        self.reply = reply
        self.token_gap = token_gap
        self.requests: list[dict] = []
        self.t_last_token: float | None = None
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        def chunk(delta: dict, finish: str | None = None) -> bytes:
            event = {
                "id": "chatcmpl-stub",
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": body.get("model", "stub"),
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            return f"data: {json.dumps(event)}\n\n".encode()

        await resp.write(chunk({"role": "assistant", "content": ""}))
        for tok in re.findall(r" ?[\w']+|[^\w\s]", self.reply):
            await asyncio.sleep(self.token_gap)
            await resp.write(chunk({"content": tok}))
            self.t_last_token = time.monotonic()
        await resp.write(chunk({}, "stop"))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def start(self):
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}/v1"

    async def stop(self):
        if self._runner:
            await self._runner.cleanup()


class AudioSink(FrameProcessor):
    """The pipeline's output: keeps the bot's audio."""

    def __init__(self):
        super().__init__()
        self.audio: list[tuple[float, TTSAudioRawFrame]] = []
        self.stopped = asyncio.Event()

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self.audio.append((time.monotonic(), frame))
        elif isinstance(frame, TTSStoppedFrame):
            self.stopped.set()
        await self.push_frame(frame, direction)


async def test_offline_voice_agent_turn(server, tmp_path):
    llm_stub = LLMStub(REPLY)
    await llm_stub.start()
    try:
        speech = user_speech_16k(USER_SAYS)

        stt = PocketSphinxSTTService()
        llm = OpenAILLMService(
            api_key="none",
            base_url=llm_stub.base_url,
            settings=OpenAILLMService.Settings(
                model="stub", system_instruction="You are a helpful voice assistant."
            ),
        )
        tts = RecordingTTS(
            url=server.ws_url, settings=VoxkernelTTSService.Settings(voice="ryan", seed=3)
        )
        sink = AudioSink()
        context = LLMContext()
        aggregators = LLMContextAggregatorPair(
            context, user_params=LLMUserAggregatorParams(vad_analyzer=SileroVADAnalyzer())
        )
        pipeline = Pipeline([stt, aggregators.user(), llm, tts, sink, aggregators.assistant()])
        rec = FrameRecorder(stt)
        worker = PipelineWorker(
            pipeline,
            params=PipelineParams(
                audio_in_sample_rate=IN_RATE,
                audio_out_sample_rate=24000,
                enable_metrics=True,
                enable_usage_metrics=True,
            ),
            idle_timeout_secs=None,
            observers=[rec],
        )

        async def feed_microphone():
            # Real-time 20 ms chunks: the speech, then silence until the reply
            # has been spoken (or two minutes have gone by).
            step = int(IN_RATE * CHUNK_S) * 2
            t0 = time.monotonic()
            sent = 0
            deadline = t0 + 120
            while time.monotonic() < deadline:
                if sent < len(speech):
                    chunk = speech[sent : sent + step]
                else:
                    chunk = bytes(step)
                    if sink.stopped.is_set():
                        break
                sent += len(chunk)
                await worker.queue_frame(InputAudioRawFrame(chunk, IN_RATE, 1))
                ahead = t0 + sent / 2 / IN_RATE - time.monotonic()
                if ahead > 0:
                    await asyncio.sleep(ahead)
            await worker.queue_frame(EndFrame())

        @worker.event_handler("on_pipeline_started")
        async def _started(_worker, _frame):
            asyncio.get_running_loop().create_task(feed_microphone())

        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(worker)
        await runner.run()
    finally:
        await llm_stub.stop()

    # The user was heard and transcribed.
    transcripts = [p.frame.text for p in rec.downstream if isinstance(p.frame, TranscriptionFrame)]
    assert transcripts and transcripts[0].strip(), "PocketSphinx heard nothing"
    # The LLM was asked, with the transcript as the user's message.
    assert len(llm_stub.requests) == 1, (transcripts, llm_stub.requests)
    user_msgs = [m for m in llm_stub.requests[0]["messages"] if m["role"] == "user"]
    assert user_msgs and user_msgs[-1]["content"].strip() == transcripts[0].strip()

    # The reply was spoken in one context, and its audio came out while
    # synthesis was still running: before the server's `done`, and before the
    # LLM had even finished streaming the reply's text.
    assert sink.audio, "no reply audio reached the output"
    contexts = {f.context_id for _, f in sink.audio}
    assert len(contexts) == 1, (contexts, transcripts)
    (ctx,) = contexts
    ((t_done, _, reason, usage),) = tts.done_of(ctx)
    assert reason != "cancelled", usage
    t_first_audio = sink.audio[0][0]
    assert t_first_audio < t_done, (t_first_audio, t_done)
    assert t_first_audio < llm_stub.t_last_token, (t_first_audio, llm_stub.t_last_token)
    audio_before_done = [t for t, _ in sink.audio if t < t_done]
    assert len(audio_before_done) >= 2

    # The whole reply landed in the conversation context as the assistant's turn.
    messages = context.get_messages()
    assistant = [m for m in messages if m.get("role") == "assistant"]
    assert assistant, messages
    said = " ".join(str(m.get("content")) for m in assistant)
    assert " ".join(said.split()) == " ".join(REPLY.split()), said

    # Keep what the bot said, for a person to listen to.
    with wave.open(str(tmp_path / "reply.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes(b"".join(f.audio for _, f in sink.audio))
