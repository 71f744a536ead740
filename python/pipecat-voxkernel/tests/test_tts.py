#
# Copyright (c) 2026, the voxkernel authors
#
# SPDX-License-Identifier: Apache-2.0
#

"""VoxkernelTTSService through `pipecat.tests.utils.run_test`, against a real server."""

import asyncio
import re
import time

from pipecat.frames.frames import (
    ErrorFrame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSUpdateSettingsFrame,
)
from pipecat.pipeline.worker import PipelineParams
from pipecat.services.tts_service import TextAggregationMode
from pipecat.tests.utils import SleepFrame, run_test
from pipecat.transcriptions.language import Language
from pipecat.utils.errors import ErrorCategory

from pipecat_voxkernel import VoxkernelSampling, VoxkernelTTSService

from conftest import FrameRecorder, RecordingTTS, VoxkernelServer

FRAME_SAMPLES = 1920  # one 80 ms frame at 24 kHz

# The tiny test checkpoint has random weights: it rarely emits EOS, so an utterance runs to
# the server's runaway guard (50 frames + 20 per text token). Texts that must finish are
# short; longer ones are cut with an interruption once the test has what it needs.
LONG_REPLY = (
    "Sure, here is a longer answer so that the speech takes a while. "
    "The weather today is mild with a light breeze from the west, "
    "and tomorrow it should be sunny in the morning and cloudy later on. "
    "If you plan to go outside, a light jacket will be enough."
)


def tokens(text: str) -> list[str]:
    """Split text as an LLM streams it: words with their leading space, punctuation apart."""
    return re.findall(r" ?[\w']+|[^\w\s]", text)


def llm_turn(text: str, gap: float = 0.0, end: bool = True) -> list:
    frames: list = [LLMFullResponseStartFrame()]
    for tok in tokens(text):
        frames.append(LLMTextFrame(tok))
        if gap:
            frames.append(SleepFrame(sleep=gap))
    if end:
        frames.append(LLMFullResponseEndFrame())
    return frames


def make_tts(server, **kwargs) -> RecordingTTS:
    settings = kwargs.pop("settings", None) or VoxkernelTTSService.Settings(voice="ryan", seed=7)
    return RecordingTTS(url=server.ws_url, settings=settings, **kwargs)


def kinds(frames, *types) -> list[str]:
    return [type(f).__name__ for f in frames if isinstance(f, types)]


def until(predicate, timeout: float):
    """SleepFrames until predicate() holds (or the timeout passes).

    run_test iterates over frames_to_send as it sends them, so a generator can
    wait for what the service has done so far before it sends the next frame.
    """
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        yield SleepFrame(sleep=0.05)


def interrupt():
    # InterruptionFrame is a system frame: it would overtake the frames queued
    # in front of it, so they get a moment to pass first.
    yield SleepFrame(sleep=0.2)
    yield InterruptionFrame()


async def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def assert_one_context_in_order(frames, context_id=None):
    """TTSStartedFrame, then only audio, then TTSStoppedFrame, for one context."""
    seq = [
        f
        for f in frames
        if isinstance(f, (TTSStartedFrame, TTSAudioRawFrame, TTSStoppedFrame))
        and (context_id is None or f.context_id == context_id)
    ]
    names = [type(f).__name__ for f in seq]
    assert names, "no TTS frames at all"
    assert names[0] == "TTSStartedFrame", names[:5]
    assert names[-1] == "TTSStoppedFrame", names[-5:]
    assert names.count("TTSStartedFrame") == 1 and names.count("TTSStoppedFrame") == 1, names
    audio = [f for f in seq if isinstance(f, TTSAudioRawFrame)]
    assert audio, "no audio between start and stop"
    ids = {f.context_id for f in seq}
    assert len(ids) == 1, f"frames of several contexts: {ids}"
    return audio


async def test_speak_frame_order_and_audio(server):
    tts = make_tts(server)
    down, up = await run_test(tts, frames_to_send=[TTSSpeakFrame("Hello there."), SleepFrame(0.1)])
    audio = assert_one_context_in_order(down)
    (ctx,) = {f.context_id for f in audio}
    assert not [f for f in up if isinstance(f, ErrorFrame)], up

    # 24 kHz is the pipeline default and voxkernel's native rate: no resampling,
    # the bytes are exactly the server's.
    assert all(f.sample_rate == 24000 and f.num_channels == 1 for f in audio)
    assert all(len(f.audio) % 2 == 0 for f in audio)
    samples = sum(len(f.audio) for f in audio) // 2
    assert samples == sum(n for _, c, n in tts.wire_audio if c == ctx)

    # One context on the wire: speak with the settings, then flush, then done.
    speaks = tts.sent_of("speak", ctx)
    assert speaks[0][1]["voice"] == "ryan" and speaks[0][1]["seed"] == 7
    assert speaks[0][1]["text_mode"] == "streaming"
    assert all("voice" not in m for _, m in speaks[1:])
    assert len(tts.sent_of("flush", ctx)) == 1
    ((_, _, reason, usage),) = tts.done_of(ctx)
    assert reason in ("eos", "max_frames", "runaway_guard"), reason
    assert usage["frames"] * FRAME_SAMPLES == samples, (usage, samples)


async def test_wire_format_matches_protocol_doc(server):
    """What docs/protocol.md promises about audio messages and `done`."""
    tts = make_tts(server)
    await run_test(tts, frames_to_send=[TTSSpeakFrame("Check this."), SleepFrame(0.1)])
    (ctx,) = {c for _, c, _ in tts.wire_audio}
    # Whole samples in every message.
    assert all(n % 2 == 0 for n in tts.wire_audio_bytes), tts.wire_audio_bytes
    # "The first audio message of a context comes after its first frame (1920
    # samples, 80 ms); later messages grow (2, 4, 8 frames, then 8 each)."
    frames = [n / FRAME_SAMPLES for _, _, n in tts.wire_audio]
    expected = [1, 2, 4] + [8] * max(0, len(frames) - 3)
    assert frames[:-1] == expected[: len(frames) - 1], frames
    assert 0 < frames[-1] <= expected[len(frames) - 1], frames
    # `done` usage: frames, audio seconds, time to first audio, RTF.
    ((_, _, reason, usage),) = tts.done_of(ctx)
    assert reason in ("eos", "max_frames", "runaway_guard"), reason
    total = sum(n for _, _, n in tts.wire_audio)
    assert usage["frames"] * FRAME_SAMPLES == total, (usage, total)
    assert abs(usage["audio_seconds"] - total / 24000) < 1e-3, usage
    assert usage["time_to_first_audio_ms"] > 0 and usage["rtf"] > 0, usage


async def test_llm_turn_streams_audio_before_text_is_complete(server):
    """Audio of a turn arrives while its text is still streaming in."""
    tts = make_tts(server)
    rec = FrameRecorder(tts)
    turn = llm_turn(LONG_REPLY, gap=0.08)

    def script():
        yield from turn
        # Enough: cut the rest of the (runaway) utterance short.
        yield from until(lambda: len(rec.of(TTSAudioRawFrame)) >= 8, 60)
        yield from interrupt()
        yield from until(lambda: tts.done, 10)

    down, up = await run_test(tts, frames_to_send=script(), observers=[rec])
    assert not [f for f in up if isinstance(f, ErrorFrame)], up
    audio = rec.of(TTSAudioRawFrame)
    assert audio
    (ctx,) = {p.frame.context_id for p in audio}

    t_first_audio = audio[0].t
    t_last_text = [p.t for p in rec.into_source if isinstance(p.frame, LLMTextFrame)][-1]
    ((t_done, _, _, _),) = tts.done_of(ctx)
    # The first audio came out of the service before the LLM had even finished
    # its text, so long before synthesis of the whole text was over.
    assert t_first_audio < t_last_text - 0.5, (t_first_audio, t_last_text)
    assert t_first_audio < t_done
    t_first_text = [p.t for p in rec.into_source if isinstance(p.frame, LLMTextFrame)][0]
    print(
        f"first audio {1000 * (t_first_audio - t_first_text):.0f} ms after the first token, "
        f"{t_last_text - t_first_audio:.2f} s before the last one"
    )
    # Audio kept coming while the text streamed in.
    assert len([p for p in audio if p.t < t_last_text]) >= 2

    # One server context for the whole turn, its text appended token by token,
    # then flushed.
    speaks = tts.sent_of("speak", ctx)
    assert len(speaks) == len(tokens(LONG_REPLY))
    assert "".join(m["text"] for _, m in speaks) == LONG_REPLY
    assert len({m["context_id"] for _, m in tts.sent_of("speak")}) == 1
    assert len(tts.sent_of("flush", ctx)) == 1


async def test_sentence_aggregation_appends_sentences_to_one_context(server):
    tts = make_tts(server, text_aggregation_mode=TextAggregationMode.SENTENCE)
    rec = FrameRecorder(tts)

    def script():
        yield from llm_turn("Hello there. How are you? I am fine.")
        yield from until(lambda: rec.of(TTSAudioRawFrame), 60)
        yield from interrupt()
        yield from until(lambda: tts.done, 10)

    down, up = await run_test(tts, frames_to_send=script(), observers=[rec])
    assert not [f for f in up if isinstance(f, ErrorFrame)], up
    speaks = tts.sent_of("speak")
    assert len({m["context_id"] for _, m in speaks}) == 1
    text = "".join(m["text"] for _, m in speaks)
    # Sentences keep a space between them when appended.
    assert "Hello there. How are you? I am fine." in text


async def test_interruption_cancels_and_drops_late_audio(server):
    tts = make_tts(server)
    rec = FrameRecorder(tts)

    def first_context_done():
        return any(reason == "cancelled" for _, _, reason, _ in tts.done)

    def script():
        # The reply is still streaming in when the user barges in, a moment
        # after its audio has started.
        turn = llm_turn(LONG_REPLY, gap=0.05, end=False)
        yield from turn[:12]
        yield from until(lambda: rec.of(TTSAudioRawFrame), 60)
        yield from turn[12:20]
        yield from interrupt()
        # Late audio of the cancelled context has time to arrive (and be dropped).
        yield from until(first_context_done, 10)
        yield SleepFrame(0.3)
        yield from llm_turn("OK.")

    down, up = await run_test(tts, frames_to_send=script(), observers=[rec])
    assert not [f for f in up if isinstance(f, ErrorFrame)], up

    started = [f for f in down if isinstance(f, TTSStartedFrame)]
    assert len(started) == 2, kinds(down, TTSStartedFrame, TTSStoppedFrame)
    first, second = started[0].context_id, started[1].context_id
    assert first != second

    # Audio of the first turn was playing when the interruption came.
    t_int = [p.t for p in rec.downstream if isinstance(p.frame, InterruptionFrame)][0]
    first_audio = [p for p in rec.of(TTSAudioRawFrame) if p.frame.context_id == first]
    assert first_audio and first_audio[0].t < t_int
    # Not one audio frame of it came out after the interruption, and it got no
    # TTSStoppedFrame (interrupted contexts end without one).
    assert not [p for p in first_audio if p.t > t_int]
    assert not [f for f in down if isinstance(f, TTSStoppedFrame) and f.context_id == first]

    # The server was told to cancel and stopped: its `done` says "cancelled".
    ((t_cancel, _),) = tts.sent_of("cancel", first)
    ((t_done, _, reason, usage),) = tts.done_of(first)
    assert reason == "cancelled", (reason, usage)
    assert t_done - t_cancel < 1.0, t_done - t_cancel
    # Audio that was already in flight may still come; it was dropped above.
    late = sum(n for t, c, n in tts.wire_audio if c == first and t > t_cancel)
    print(
        f"cancel → done {1000 * (t_done - t_cancel):.1f} ms; "
        f"{late / FRAME_SAMPLES:.1f} frames of audio arrived after the cancel (dropped)"
    )
    assert late <= 16 * FRAME_SAMPLES, f"{late / FRAME_SAMPLES:.1f} frames after cancel"

    # The next turn speaks normally in a new context.
    assert_one_context_in_order(down, second)
    assert tts.done_of(second)[0][2] != "cancelled"


async def test_resamples_only_when_pipeline_asks_another_rate(server):
    tts = make_tts(server)
    down, _ = await run_test(
        tts,
        frames_to_send=[TTSSpeakFrame("Resample."), SleepFrame(0.1)],
        pipeline_params=PipelineParams(audio_out_sample_rate=16000),
    )
    audio = assert_one_context_in_order(down)
    assert all(f.sample_rate == 16000 for f in audio)
    got = sum(len(f.audio) for f in audio) // 2
    sent = sum(n for _, _, n in tts.wire_audio)
    # 24 kHz → 16 kHz: two thirds of the samples, give or take the filter.
    assert abs(got - sent * 2 / 3) < 200, (got, sent)


async def test_settings_update_at_run_time(server):
    tts = make_tts(server)
    frames = [
        TTSSpeakFrame("First voice."),
        SleepFrame(0.2),
        TTSUpdateSettingsFrame(
            delta=VoxkernelTTSService.Settings(
                voice="serena",
                language=Language.EN,
                seed=11,
                sampling=VoxkernelSampling(temperature=0.7, top_k=20),
            )
        ),
        TTSSpeakFrame("Second voice."),
        SleepFrame(0.2),
    ]
    down, up = await run_test(tts, frames_to_send=frames)
    assert not [f for f in up if isinstance(f, ErrorFrame)], up
    assert (
        kinds(down, TTSStartedFrame, TTSStoppedFrame) == ["TTSStartedFrame", "TTSStoppedFrame"] * 2
    )
    opening = [m for _, m in tts.sent_of("speak") if "text_mode" in m]
    assert len(opening) == 2
    assert opening[0]["voice"] == "ryan" and "language" not in opening[0]
    assert opening[1]["voice"] == "serena"
    assert opening[1]["language"] == "english"
    assert opening[1]["seed"] == 11
    assert opening[1]["sampling"] == {"temperature": 0.7, "top_k": 20}


async def test_same_seed_same_audio(server):
    """The seed reaches the server: two utterances with one seed sound the same."""
    tts = make_tts(server, settings=VoxkernelTTSService.Settings(voice="ryan", seed=1234))
    text = "Same again."
    down, _ = await run_test(
        tts,
        frames_to_send=[TTSSpeakFrame(text), SleepFrame(0.2), TTSSpeakFrame(text), SleepFrame(0.2)],
    )
    started = [f.context_id for f in down if isinstance(f, TTSStartedFrame)]
    assert len(started) == 2
    pcm = [
        b"".join(f.audio for f in down if isinstance(f, TTSAudioRawFrame) and f.context_id == c)
        for c in started
    ]
    assert pcm[0] and pcm[0] == pcm[1]


async def test_unknown_voice_is_an_error_frame(server):
    tts = make_tts(server, settings=VoxkernelTTSService.Settings(voice="nobody-by-this-name"))
    down, up = await run_test(tts, frames_to_send=[TTSSpeakFrame("Hello."), SleepFrame(0.5)])
    errors = [f for f in up if isinstance(f, ErrorFrame)]
    assert errors, up
    assert "invalid_request" in errors[0].error and "voice" in errors[0].error
    assert errors[0].category == ErrorCategory.INVALID_REQUEST
    assert not [f for f in down if isinstance(f, TTSAudioRawFrame)]


async def test_reconnects_after_server_restart(own_server):
    """The server dies mid-utterance and comes back: the service reconnects and speaks again."""
    tts = make_tts(own_server)
    rec = FrameRecorder(tts)
    restarted = asyncio.Event()
    killed_at: list[float] = []
    speak_again_at: list[float] = []

    async def chaos():
        # Kill the server while the first utterance is playing, then bring it back.
        await wait_for(lambda: rec.of(TTSAudioRawFrame), 60, "the first audio")
        killed_at.append(time.monotonic())
        await asyncio.to_thread(own_server.kill)
        await asyncio.sleep(0.5)
        await asyncio.to_thread(own_server.start)
        restarted.set()

    def script():
        yield TTSSpeakFrame(LONG_REPLY)
        yield from until(restarted.is_set, 180)
        # The service reconnects by itself, before it is asked to speak again.
        yield from until(lambda: tts.connects >= 2, 40)
        speak_again_at.append(time.monotonic())
        yield TTSSpeakFrame("After the restart.")

    (down, up), _ = await asyncio.gather(
        run_test(tts, frames_to_send=script(), observers=[rec]), chaos()
    )
    assert restarted.is_set() and own_server.starts == 2
    assert tts.connects >= 2, tts.connects
    assert tts.connect_times[1] < speak_again_at[0], "reconnected only when asked to speak"

    started = [f.context_id for f in down if isinstance(f, TTSStartedFrame)]
    assert len(started) == 2, kinds(down, TTSStartedFrame, TTSStoppedFrame)
    first, second = started
    # The utterance cut short still ends with a TTSStoppedFrame, promptly (not
    # after an idle timeout), and no audio of it comes after that.
    first_frames = [p for p in rec.downstream if getattr(p.frame, "context_id", None) == first]
    assert isinstance(first_frames[-1].frame, TTSStoppedFrame), [
        type(p.frame).__name__ for p in first_frames[-3:]
    ]
    assert first_frames[-1].t - killed_at[0] < 2.5
    # The next utterance, on the new connection, is whole.
    assert_one_context_in_order(down, second)
    assert tts.done_of(second)
    assert tts.is_usable
    # The lost connection was reported, as transient errors only.
    errors = [f for f in up if isinstance(f, ErrorFrame)]
    assert any("connection lost" in e.error for e in errors), errors
    assert all(not e.category.is_permanent for e in errors), errors


async def test_api_key(tmp_path_factory):
    srv = VoxkernelServer(tmp_path_factory.mktemp("voxkernel"), api_key="sesame", name="auth")
    srv.start()
    try:
        tts = make_tts(srv, api_key="sesame")
        down, up = await run_test(
            tts, frames_to_send=[TTSSpeakFrame("Open sesame."), SleepFrame(0.1)]
        )
        assert_one_context_in_order(down)
        assert not [f for f in up if isinstance(f, ErrorFrame)], up

        tts = make_tts(srv, api_key="not-the-key")
        down, up = await run_test(
            tts, frames_to_send=[TTSSpeakFrame("Let me in."), SleepFrame(0.3)]
        )
        errors = [f for f in up if isinstance(f, ErrorFrame)]
        assert errors and errors[0].category == ErrorCategory.AUTHENTICATION, errors
        assert not tts.is_usable
        assert not [f for f in down if isinstance(f, TTSAudioRawFrame)]
    finally:
        srv.stop()


async def test_context_ended_early_by_the_server(tmp_path_factory):
    """The server may end a context before its text is complete (the model's EOS, or here
    the --max-frames limit). Text still streaming in opens a new context, with the
    settings again; what crossed the `done` on the wire causes no error."""
    srv = VoxkernelServer(tmp_path_factory.mktemp("voxkernel"), max_frames=5, name="short")
    srv.start()
    try:
        tts = make_tts(srv)
        text = "One two three four five six seven eight nine ten eleven twelve."
        down, up = await run_test(tts, frames_to_send=llm_turn(text, gap=0.1) + [SleepFrame(0.5)])
    finally:
        srv.stop()
    assert not [f for f in up if isinstance(f, ErrorFrame)], up
    assert tts.is_usable
    names = kinds(down, TTSStartedFrame, TTSStoppedFrame)
    assert len(names) >= 4 and names == ["TTSStartedFrame", "TTSStoppedFrame"] * (len(names) // 2)
    reasons = [reason for _, _, reason, _ in tts.done]
    assert reasons[0] == "max_frames" and set(reasons) <= {"max_frames", "eos"}, reasons
    opening = [m for _, m in tts.sent_of("speak") if "text_mode" in m]
    assert len(opening) == len(tts.done) and all(m["voice"] == "ryan" for m in opening)
