#
# Copyright (c) 2026, the voxkernel authors
#
# SPDX-License-Identifier: Apache-2.0
#

"""Pipecat text-to-speech service for a self-hosted voxkernel server.

The service speaks voxkernel's WebSocket context protocol (``/v1/tts/ws``,
see ``docs/protocol.md`` in the voxkernel repository): one connection carries
any number of contexts, every message names its ``context_id``, text is
appended with ``speak`` as the LLM streams it, ``flush`` ends a context's text,
``cancel`` stops it within one 80 ms frame, and the server answers with binary
PCM16 audio (24 kHz mono) and a ``done`` message per context.
"""

import json
from collections.abc import AsyncGenerator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from loguru import logger
from pipecat.audio.resamplers.base_audio_resampler import BaseAudioResampler
from pipecat.audio.utils import create_stream_resampler
from pipecat.frames.frames import (
    ErrorFrame,
    Frame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
)
from pipecat.processors.frame_processor import FrameProcessorSetup
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TextAggregationMode, WebsocketTTSService
from pipecat.transcriptions.language import Language
from pipecat.utils.errors import ErrorCategory
from pipecat.utils.tracing.service_decorators import traced_tts
from pipecat.utils.types import NOT_GIVEN, NotGiven
from websockets.exceptions import InvalidStatus
from websockets.protocol import State

#: The rate of the PCM that voxkernel sends; Qwen3-TTS's codec runs at 24 kHz.
VOXKERNEL_SAMPLE_RATE = 24000

#: Qwen3-TTS language names, keyed by ISO 639-1 base code.
_LANGUAGES: dict[str, str] = {
    "zh": "chinese",
    "en": "english",
    "ja": "japanese",
    "ko": "korean",
    "de": "german",
    "fr": "french",
    "ru": "russian",
    "pt": "portuguese",
    "es": "spanish",
    "it": "italian",
}

#: How each server error code is categorised for Pipecat. ``invalid_request``
#: (an unknown voice, a bad sampling value) recurs until the settings change,
#: so it is permanent; the others are transient.
_ERROR_CATEGORIES: dict[str, ErrorCategory] = {
    "invalid_json": ErrorCategory.INVALID_REQUEST,
    "invalid_request": ErrorCategory.INVALID_REQUEST,
    "unknown_context": ErrorCategory.UNKNOWN,
    "context_closed": ErrorCategory.UNKNOWN,
    "overloaded": ErrorCategory.RATE_LIMIT,
    "internal": ErrorCategory.SERVER,
}


def language_to_voxkernel_language(language: Language) -> str | None:
    """Convert a Pipecat ``Language`` to the language name voxkernel expects.

    Regional variants resolve through their base language (``en-GB`` → ``english``).

    Args:
        language: The language to convert.

    Returns:
        The Qwen3-TTS language name, or None if the model does not speak it.
    """
    return _LANGUAGES.get(str(language.value).split("-")[0].lower())


@dataclass
class VoxkernelSampling:
    """Sampling parameters of the talker; every field is optional.

    A field left as None takes the checkpoint's default
    (``generation_config.json``).

    Parameters:
        temperature: Softmax temperature, > 0.
        top_k: Keep the k most likely codes, >= 0 (0 keeps every code).
        top_p: Nucleus sampling threshold, in (0, 1].
        repetition_penalty: Penalty for repeated codes, > 0.
        greedy: Pick the most likely code (ignores the other fields).
    """

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    greedy: bool | None = None

    def to_wire(self) -> dict[str, Any]:
        """Return the fields that are set, as the ``sampling`` object of ``speak``."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class VoxkernelTTSSettings(TTSSettings):
    """Runtime-updatable settings of :class:`VoxkernelTTSService`.

    Settings are fixed per context on the server, so a change applies from the
    next utterance (the next assistant turn or ``TTSSpeakFrame``).

    Parameters:
        voice: Speaker of a CustomVoice model (``GET /v1/voices`` lists them);
            None for VoiceDesign models.
        language: A ``Language`` or a Qwen3-TTS language name
            (``"english"``); None lets the model detect it.
        instruct: Style instruction (VoiceDesign, 1.7B CustomVoice), or None.
        sampling: Talker sampling parameters, or None for the checkpoint's
            defaults.
        seed: Sampling seed; the same seed, text and settings give the same
            audio. None picks a random seed per utterance.
    """

    instruct: str | None | NotGiven = field(default_factory=lambda: NOT_GIVEN)
    sampling: VoxkernelSampling | None | NotGiven = field(default_factory=lambda: NOT_GIVEN)
    seed: int | None | NotGiven = field(default_factory=lambda: NOT_GIVEN)


class VoxkernelTTSService(WebsocketTTSService):
    """Streaming TTS from a self-hosted voxkernel (Qwen3-TTS) server.

    One server context is opened per assistant turn. By default text is sent
    token by token as the LLM streams it (``TextAggregationMode.TOKEN``): the
    server feeds the model one text token per audio frame, so the first audio
    comes before the sentence is complete. On an interruption the context is
    cancelled on the server, which stops within one frame, and audio still in
    flight for it is dropped.

    Audio arrives as 24 kHz PCM16 mono. It is passed on untouched when the
    pipeline's output rate is 24 kHz (Pipecat's default) and resampled
    otherwise.

    Event handlers (besides those of ``WebsocketTTSService``):
        on_context_done: The server finished a context:
            ``(service, context_id, finish_reason, usage)``.

    Example::

        tts = VoxkernelTTSService(
            url="ws://127.0.0.1:8000/v1/tts/ws",
            settings=VoxkernelTTSService.Settings(voice="ryan", language=Language.EN),
        )
    """

    Settings = VoxkernelTTSSettings
    _settings: Settings

    def __init__(
        self,
        *,
        url: str = "ws://127.0.0.1:8000/v1/tts/ws",
        api_key: str | None = None,
        sample_rate: int | None = None,
        text_mode: Literal["streaming", "whole"] = "streaming",
        text_aggregation_mode: TextAggregationMode = TextAggregationMode.TOKEN,
        settings: Settings | None = None,
        reconnect_attempts: int = 6,
        reconnect_backoff_min_wait: float = 0.5,
        reconnect_backoff_max_wait: float = 8.0,
        extra_headers: dict[str, str] | None = None,
        **kwargs,
    ):
        """Initialize the voxkernel TTS service.

        Args:
            url: WebSocket URL of the server's context endpoint.
            api_key: The server's ``--api-key``, sent as a bearer token; None
                for a server started without one.
            sample_rate: Output sample rate. None uses the pipeline's
                ``audio_out_sample_rate``; audio is resampled from 24 kHz only
                when this differs.
            text_mode: The server's text mode for every context: ``"streaming"``
                (text fed as it arrives, audio starts at the first word) or
                ``"whole"`` (nothing is synthesised before the turn's text is
                complete; use it only for text that is complete up front).
            text_aggregation_mode: ``TOKEN`` (default) sends each LLM token as
                it arrives and lets the server pace it; ``SENTENCE`` waits for
                whole sentences on the client first.
            settings: Runtime-updatable settings (voice, language, instruct,
                sampling, seed).
            reconnect_attempts: Attempts to reconnect after the connection is
                lost before the service reports itself unusable.
            reconnect_backoff_min_wait: Shortest wait between attempts, seconds.
            reconnect_backoff_max_wait: Longest wait between attempts, seconds;
                waits double from 1 s up to this.
            extra_headers: Additional HTTP headers for the WebSocket handshake.
            **kwargs: Passed to ``WebsocketTTSService`` (e.g.
                ``text_transforms``, ``stop_frame_timeout_s``).
        """
        if text_mode not in ("streaming", "whole"):
            raise ValueError(f"text_mode must be 'streaming' or 'whole', not {text_mode!r}")

        default_settings = self.Settings(
            model=None,
            voice=None,
            language=None,
            instruct=None,
            sampling=None,
            seed=None,
        )
        if settings is not None:
            default_settings.apply_update(settings)

        super().__init__(
            text_aggregation_mode=text_aggregation_mode,
            # voxkernel reports no word timings: the base class pushes the text
            # of each sentence after its audio, so interrupted text never
            # enters the LLM context.
            push_text_frames=True,
            push_start_frame=True,
            # The receive loop turns the server's `done` into TTSStoppedFrame.
            push_stop_frames=False,
            # Every audio message names its context.
            pause_frame_processing=False,
            # Sentences are appended to one context: keep them apart.
            append_trailing_space=True,
            sample_rate=sample_rate,
            settings=default_settings,
            reconnect_backoff_min_wait=reconnect_backoff_min_wait,
            reconnect_backoff_max_wait=reconnect_backoff_max_wait,
            **kwargs,
        )

        self._url = url
        self._api_key = api_key
        self._text_mode = text_mode
        self._reconnect_attempts = max(1, reconnect_attempts)
        self._extra_headers = dict(extra_headers) if extra_headers else {}

        self._receive_task = None
        # Server-side state of this connection's contexts.
        self._open_contexts: set[str] = set()  # `speak` sent, no `done` yet
        self._flushed_contexts: set[str] = set()  # `flush` sent
        self._cancelled_contexts: set[str] = set()  # `cancel` sent, no `done` yet
        self._failed_contexts: set[str] = set()  # closed by an error: send no more text
        self._audio_started: set[str] = set()  # contexts whose first audio arrived
        self._resamplers: dict[str, BaseAudioResampler] = {}
        self._odd_bytes: dict[str, bytes] = {}

        self._register_event_handler("on_context_done")

    def can_generate_metrics(self) -> bool:
        """Report that this service generates TTFB and usage metrics.

        Returns:
            True.
        """
        return True

    def language_to_service_language(self, language: Language) -> str | None:
        """Convert a Pipecat ``Language`` to a Qwen3-TTS language name.

        Args:
            language: The language to convert.

        Returns:
            The language name, or None if the model does not speak it.
        """
        return language_to_voxkernel_language(language)

    #
    # Lifecycle
    #

    async def setup(self, setup: FrameProcessorSetup):
        """Set up the service and connect to the server.

        Args:
            setup: The pipeline's setup, carrying its output sample rate.
        """
        await super().setup(setup)
        if self.sample_rate != VOXKERNEL_SAMPLE_RATE:
            logger.debug(
                f"{self}: resampling voxkernel's {VOXKERNEL_SAMPLE_RATE} Hz audio to "
                f"{self.sample_rate} Hz"
            )
        await self._connect()

    async def _connect(self):
        await super()._connect()
        await self._connect_websocket()
        if self._websocket and not self._receive_task:
            self._receive_task = self.create_task(self._receive_task_handler(self._report_error))

    async def _disconnect(self):
        await super()._disconnect()
        if self._receive_task:
            await self.cancel_task(self._receive_task)
            self._receive_task = None
        await self._disconnect_websocket()

    async def _connect_websocket(self):
        try:
            if self._websocket and self._websocket.state is State.OPEN:
                return
            logger.debug(f"{self}: connecting to {self._url}")
            headers = dict(self._extra_headers)
            if self._api_key:
                headers["Authorization"] = f"Bearer {self._api_key}"
            self._websocket = await self._websocket_connect(self._url, additional_headers=headers)
            await self._call_event_handler("on_connected")
        except Exception as e:
            self._websocket = None
            await self.push_error(
                error_msg=f"{self}: cannot connect to {self._url}: {e}",
                exception=e,
                category=_handshake_error_category(e),
            )
            await self._call_event_handler("on_connection_error", f"{e}")

    async def _disconnect_websocket(self):
        try:
            await self.stop_all_metrics()
            if self._websocket:
                logger.debug(f"{self}: disconnecting from {self._url}")
                await self._websocket.close()
        except Exception as e:
            logger.warning(f"{self}: error while closing the connection: {e}")
        finally:
            self._websocket = None
            self._forget_connection_contexts()
            await self._call_event_handler("on_disconnected")

    async def _close_connection_contexts(self):
        # A context still open on a lost connection is over: the audio that
        # came still plays, and a TTSStoppedFrame ends it so downstream state
        # (bot speaking) doesn't wait for the idle timeout.
        for context_id in self.get_audio_contexts():
            if context_id in self._open_contexts:
                await self.append_to_audio_context(
                    context_id, TTSStoppedFrame(context_id=context_id)
                )
        self._forget_connection_contexts()
        await super()._close_connection_contexts()

    async def _reconnect_websocket(self, attempt_number: int) -> bool:
        cut_short = [c for c in self.get_audio_contexts() if c in self._open_contexts]
        if cut_short:
            await self.push_error(
                error_msg=f"{self}: connection lost while speaking; {len(cut_short)} "
                "context(s) cut short",
                category=ErrorCategory.CONNECTIVITY,
            )
        return await super()._reconnect_websocket(attempt_number)

    async def _try_reconnect(self, max_retries: int = 3, report_error=None) -> bool:
        return await super()._try_reconnect(
            max_retries=max(max_retries, self._reconnect_attempts), report_error=report_error
        )

    def _forget_connection_contexts(self):
        self._open_contexts.clear()
        self._flushed_contexts.clear()
        self._cancelled_contexts.clear()
        self._failed_contexts.clear()
        self._audio_started.clear()
        self._resamplers.clear()
        self._odd_bytes.clear()

    #
    # Client → server
    #

    def _context_settings(self) -> dict[str, Any]:
        """The settings that the first `speak` of a context carries."""
        s = self._settings
        msg: dict[str, Any] = {"text_mode": self._text_mode}
        if s.voice:
            msg["voice"] = s.voice
        if s.language:
            msg["language"] = str(s.language)
        if s.instruct:
            msg["instruct"] = s.instruct
        if s.seed is not None:
            msg["seed"] = s.seed
        if isinstance(s.sampling, VoxkernelSampling):
            sampling = s.sampling.to_wire()
            if sampling:
                msg["sampling"] = sampling
        return msg

    async def _send(self, msg: dict[str, Any]):
        if not self._websocket or self._websocket.state is not State.OPEN:
            raise ConnectionError("not connected")
        await self._websocket.send(json.dumps(msg))

    @traced_tts
    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """Append text to the context on the server.

        The audio arrives on the receive loop; this yields None.

        Args:
            text: The text (a token or a sentence) to append.
            context_id: The turn's context.

        Yields:
            None, or an ErrorFrame if the text could not be sent.
        """
        if context_id in self._failed_contexts:
            # The server closed this context with an error, already reported;
            # the rest of the turn's text would only repeat it.
            yield None
            return
        if not self._websocket or self._websocket.state is not State.OPEN:
            await self._connect()
        msg: dict[str, Any] = {"type": "speak", "context_id": context_id, "text": text}
        # Only the first `speak` of a server context carries settings. A
        # context the server already finished (its `done` came) is opened anew.
        opening = context_id not in self._open_contexts
        if opening:
            msg.update(self._context_settings())
        try:
            await self._send(msg)
        except Exception as e:
            self._failed_contexts.add(context_id)
            yield ErrorFrame(
                error=f"{self}: cannot send text to the server: {e}",
                exception=e,
                category=ErrorCategory.CONNECTIVITY,
            )
            await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
            await self.remove_audio_context(context_id)
            return
        if opening:
            self._open_contexts.add(context_id)
            self._flushed_contexts.discard(context_id)
        await self.start_tts_usage_metrics(text)
        yield None

    async def flush_audio(self, context_id: str | None = None):
        """Tell the server that the context's text is complete.

        Args:
            context_id: The context to flush; None flushes the active one.
        """
        context_id = context_id or self.get_active_audio_context_id()
        if (
            not context_id
            or context_id not in self._open_contexts
            or context_id in self._flushed_contexts
        ):
            return
        self._flushed_contexts.add(context_id)
        try:
            await self._send({"type": "flush", "context_id": context_id})
        except Exception as e:
            logger.warning(f"{self}: cannot flush context {context_id}: {e}")

    async def on_audio_context_interrupted(self, context_id: str):
        """Cancel the interrupted context on the server.

        Args:
            context_id: The interrupted context.
        """
        await self.stop_all_metrics()
        self._resamplers.pop(context_id, None)
        self._odd_bytes.pop(context_id, None)
        if context_id in self._open_contexts:
            self._open_contexts.discard(context_id)
            self._cancelled_contexts.add(context_id)
            logger.debug(f"{self}: cancelling context {context_id}")
            try:
                await self._send({"type": "cancel", "context_id": context_id})
            except Exception as e:
                logger.warning(f"{self}: cannot cancel context {context_id}: {e}")
        await super().on_audio_context_interrupted(context_id)

    async def on_audio_context_completed(self, context_id: str):
        """Flush a context the base class closed while its text was still open.

        Contexts normally end with the server's ``done``. A context that is not
        the current turn's and was never flushed (its turn is over, e.g. text
        that arrived after an interruption) would otherwise wait on the server
        for text that never comes.

        Args:
            context_id: The context that finished playing.
        """
        if (
            context_id in self._open_contexts
            and context_id not in self._flushed_contexts
            and context_id != self._turn_context_id
        ):
            await self.flush_audio(context_id)
        await super().on_audio_context_completed(context_id)

    #
    # Server → client
    #

    async def _receive_messages(self):
        async for message in self._websocket:
            if isinstance(message, bytes):
                await self._handle_audio(message)
            else:
                await self._handle_message(message)

    def _wants_audio(self, context_id: str) -> bool:
        if context_id in self._cancelled_contexts:
            return False
        return (
            self.audio_context_available(context_id)
            or context_id == self._turn_context_id
            or context_id in self._open_contexts
        )

    async def _handle_audio(self, message: bytes):
        if not message:
            return
        header_len = message[0]
        if header_len < 1 or len(message) < header_len:
            logger.warning(f"{self}: malformed audio message ({len(message)} bytes)")
            return
        context_id = message[1:header_len].decode("utf-8", errors="replace")
        if not self._wants_audio(context_id):
            # Late audio of a cancelled (interrupted) context, or of one this
            # connection no longer knows.
            return
        pcm = self._odd_bytes.pop(context_id, b"") + message[header_len:]
        if len(pcm) % 2:
            self._odd_bytes[context_id] = pcm[-1:]
            pcm = pcm[:-1]
        if not pcm:
            return

        if context_id not in self._audio_started:
            self._audio_started.add(context_id)
            await self.stop_ttfb_metrics()
        if not self.audio_context_available(context_id) and context_id != self._turn_context_id:
            # The base class closed the context after its idle timeout while the
            # server was still working on it: reopen it rather than lose audio.
            await self.create_audio_context(context_id)
            await self.append_to_audio_context(context_id, TTSStartedFrame(context_id=context_id))

        if self.sample_rate != VOXKERNEL_SAMPLE_RATE:
            resampler = self._resamplers.get(context_id)
            if resampler is None:
                resampler = create_stream_resampler(quality="HQ", clear_after_secs=None)
                self._resamplers[context_id] = resampler
            pcm = await resampler.resample(pcm, VOXKERNEL_SAMPLE_RATE, self.sample_rate)
            if not pcm:
                return

        await self.append_to_audio_context(
            context_id,
            TTSAudioRawFrame(
                audio=pcm, sample_rate=self.sample_rate, num_channels=1, context_id=context_id
            ),
        )

    async def _handle_message(self, message: str):
        try:
            msg = json.loads(message)
        except ValueError:
            logger.warning(f"{self}: server sent a message that is not JSON: {message[:200]}")
            return
        kind = msg.get("type")
        if kind == "done":
            await self._handle_done(msg)
        elif kind == "error":
            await self._handle_error(msg)
        else:
            logger.warning(f"{self}: unknown message from the server: {message[:200]}")

    async def _handle_done(self, msg: dict[str, Any]):
        context_id = msg.get("context_id")
        finish_reason = msg.get("finish_reason")
        usage = msg.get("usage") or {}
        if not isinstance(context_id, str):
            return
        self._open_contexts.discard(context_id)
        self._flushed_contexts.discard(context_id)
        self._audio_started.discard(context_id)
        self._odd_bytes.pop(context_id, None)
        resampler = self._resamplers.pop(context_id, None)
        await self._call_event_handler("on_context_done", context_id, finish_reason, usage)

        if context_id in self._cancelled_contexts:
            self._cancelled_contexts.discard(context_id)
            return

        logger.debug(f"{self}: context {context_id} done ({finish_reason}): {usage}")
        if finish_reason in ("max_frames", "runaway_guard"):
            logger.warning(
                f"{self}: context {context_id} ended by the server's {finish_reason} limit"
            )

        if not self.audio_context_available(context_id):
            return
        if resampler is not None:
            tail = await resampler.flush()
            if tail:
                await self.append_to_audio_context(
                    context_id,
                    TTSAudioRawFrame(
                        audio=tail,
                        sample_rate=self.sample_rate,
                        num_channels=1,
                        context_id=context_id,
                    ),
                )
        await self.stop_ttfb_metrics()
        await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
        await self.remove_audio_context(context_id)

    async def _handle_error(self, msg: dict[str, Any]):
        context_id = msg.get("context_id")
        code = msg.get("code") or "unknown"
        text = msg.get("message") or ""
        category = _ERROR_CATEGORIES.get(code, ErrorCategory.UNKNOWN)
        if code == "invalid_request" and text.startswith("text"):
            # The text was refused (too long, say), not the settings: the next
            # utterance may well be fine.
            category = ErrorCategory.APPLICATION

        if isinstance(context_id, str):
            if context_id not in self._open_contexts:
                # A message that crossed the context's end on the wire: text or
                # a flush sent while the server was sending `done` (the model
                # ended the utterance early), or anything after a `cancel`.
                # Nothing is open to close, and nothing is wrong.
                logger.debug(
                    f"{self}: {code} for context {context_id}, which is no longer open: {text}"
                )
                return
            if code == "unknown_context":
                # "This closes nothing" (docs/protocol.md).
                await self.push_error(
                    error_msg=f"voxkernel error {code} (context {context_id}): {text}",
                    category=category,
                )
                return
            # Any other error for a context still open here closes it on the
            # server, and no `done` follows: the engine failed it, or a message
            # was refused while its text was open. (An error about a message
            # sent after `flush` or `cancel` would leave the context running,
            # but this service sends nothing to a context after either.)
            self._open_contexts.discard(context_id)
            self._flushed_contexts.discard(context_id)
            self._failed_contexts.add(context_id)
            self._resamplers.pop(context_id, None)
            if self.audio_context_available(context_id):
                await self.append_to_audio_context(
                    context_id, TTSStoppedFrame(context_id=context_id)
                )
                await self.remove_audio_context(context_id)

        await self.stop_all_metrics()
        await self.push_error(
            error_msg=f"voxkernel error {code} (context {context_id}): {text}",
            category=category,
        )


def _handshake_error_category(e: Exception) -> ErrorCategory:
    if isinstance(e, InvalidStatus):
        status = e.response.status_code
        if status == 401:
            return ErrorCategory.AUTHENTICATION
        if status == 403:
            return ErrorCategory.AUTHORIZATION
        if status == 429:
            return ErrorCategory.RATE_LIMIT
        if status >= 500:
            return ErrorCategory.SERVER
    return ErrorCategory.CONNECTIVITY
