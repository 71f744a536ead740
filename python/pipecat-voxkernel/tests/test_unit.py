#
# Copyright (c) 2026, the voxkernel authors
#
# SPDX-License-Identifier: Apache-2.0
#

"""Pieces of the service that need no server."""

import pytest
from pipecat.transcriptions.language import Language

from pipecat_voxkernel import (
    VoxkernelSampling,
    VoxkernelTTSService,
    language_to_voxkernel_language,
)


def test_language_names():
    assert language_to_voxkernel_language(Language.EN) == "english"
    assert language_to_voxkernel_language(Language.EN_GB) == "english"
    assert language_to_voxkernel_language(Language.ZH) == "chinese"
    assert language_to_voxkernel_language(Language.PT_BR) == "portuguese"
    assert language_to_voxkernel_language(Language.NL) is None


def test_sampling_sends_only_what_is_set():
    assert VoxkernelSampling().to_wire() == {}
    assert VoxkernelSampling(temperature=0.8, greedy=False).to_wire() == {
        "temperature": 0.8,
        "greedy": False,
    }


def test_default_settings_are_complete_and_minimal():
    tts = VoxkernelTTSService()
    tts._settings.validate_complete()
    # Only the text mode: the server's and the checkpoint's defaults apply.
    assert tts._context_settings() == {"text_mode": "streaming"}


def test_first_speak_carries_every_setting():
    tts = VoxkernelTTSService(
        text_mode="whole",
        settings=VoxkernelTTSService.Settings(
            voice="vivian",
            language=Language.JA,
            instruct="Speak softly.",
            seed=0,
            sampling=VoxkernelSampling(top_p=0.9, repetition_penalty=1.1),
        ),
    )
    assert tts._context_settings() == {
        "text_mode": "whole",
        "voice": "vivian",
        "language": "japanese",
        "instruct": "Speak softly.",
        "seed": 0,
        "sampling": {"top_p": 0.9, "repetition_penalty": 1.1},
    }


def test_language_as_a_name_passes_through():
    tts = VoxkernelTTSService(settings=VoxkernelTTSService.Settings(language="german"))
    assert tts._context_settings()["language"] == "german"


def test_bad_text_mode():
    with pytest.raises(ValueError):
        VoxkernelTTSService(text_mode="sometimes")
