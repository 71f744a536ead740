#
# Copyright (c) 2026, the voxkernel authors
#
# SPDX-License-Identifier: Apache-2.0
#

"""Pipecat plugin for voxkernel, a self-hosted streaming Qwen3-TTS server."""

from pipecat_voxkernel.tts import (
    VOXKERNEL_SAMPLE_RATE,
    VoxkernelSampling,
    VoxkernelTTSService,
    VoxkernelTTSSettings,
    language_to_voxkernel_language,
)

__version__ = "0.1.0"

__all__ = [
    "VOXKERNEL_SAMPLE_RATE",
    "VoxkernelSampling",
    "VoxkernelTTSService",
    "VoxkernelTTSSettings",
    "language_to_voxkernel_language",
    "__version__",
]
