//! Which frame backend, codec and voice encoder a command runs on.

use std::sync::Arc;

use anyhow::{Result, bail};
use clap::ValueEnum;
use voxkernel_core::backend::{CodecBackend, FrameBackend};
use voxkernel_core::engine::Model;
use voxkernel_core::reference::codec_decoder::CodecDecoder;
use voxkernel_core::reference::{ReferenceBackend, ReferenceCodec};
use voxkernel_core::voice_clone::{CloneEncoder, VoiceEncoder};

#[derive(Clone, Copy, ValueEnum)]
pub enum BackendChoice {
    /// CUDA when a driver is present, else CPU.
    Auto,
    Cpu,
    Cuda,
}

/// How the CUDA codec multiplies the decoder's big convolutions.
#[derive(Clone, Copy, Default, ValueEnum)]
pub enum CodecPrecision {
    /// f32 on the CUDA cores: within f32 noise of the CPU reference (docs/codec.md).
    #[default]
    F32,
    /// TF32 on the tensor cores, f32 sums: faster, with the error docs/codec.md states.
    Tf32,
}

impl BackendChoice {
    pub fn is_cuda(self) -> bool {
        match self {
            BackendChoice::Cpu => false,
            BackendChoice::Cuda => true,
            BackendChoice::Auto => voxkernel_cuda::driver_available(),
        }
    }
}

/// The frame backend with room for `slots` sequences of up to `max_len` talker positions
/// (prompt + frames) each.
pub fn frame_backend(
    choice: BackendChoice,
    model: &Model,
    slots: usize,
    max_len: usize,
) -> Result<Box<dyn FrameBackend>> {
    if choice.is_cuda() {
        let options = voxkernel_cuda::CudaOptions {
            max_slots: slots,
            max_len,
            ..Default::default()
        };
        Ok(Box::new(voxkernel_cuda::CudaBackend::new(
            &model.checkpoint,
            options,
        )?))
    } else {
        Ok(Box::new(ReferenceBackend::new(&model.checkpoint)?))
    }
}

/// The streaming codec decoder with room for `streams` streams at once.
pub fn codec_backend(
    choice: BackendChoice,
    model: &Model,
    streams: usize,
    precision: CodecPrecision,
) -> Result<Box<dyn CodecBackend>> {
    if choice.is_cuda() {
        let options = voxkernel_cuda::CudaCodecOptions {
            max_streams: streams,
            precision: match precision {
                CodecPrecision::F32 => voxkernel_cuda::CodecPrecision::F32,
                CodecPrecision::Tf32 => voxkernel_cuda::CodecPrecision::Tf32,
            },
            ..Default::default()
        };
        Ok(Box::new(voxkernel_cuda::CudaCodec::from_checkpoint(
            &model.checkpoint,
            options,
        )?))
    } else {
        if let CodecPrecision::Tf32 = precision {
            bail!("--codec-precision tf32 needs the CUDA backend; the CPU codec is f32 only");
        }
        let decoder = Arc::new(CodecDecoder::from_checkpoint(&model.checkpoint)?);
        Ok(Box::new(ReferenceCodec::new(decoder)))
    }
}

/// The voice-clone encoders of a Base model (speaker encoder and speech-tokenizer encoder).
pub fn voice_encoder(choice: BackendChoice, model: &Model) -> Result<Box<dyn CloneEncoder>> {
    if choice.is_cuda() {
        Ok(Box::new(voxkernel_cuda::CudaVoiceEncoder::from_checkpoint(
            &model.checkpoint,
        )?))
    } else {
        Ok(Box::new(VoiceEncoder::from_checkpoint(&model.checkpoint)?))
    }
}
