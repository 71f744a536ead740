//! voxkernel-cuda: the CUDA backend. One cooperative "megakernel" launch advances a batch of
//! sequences by one audio frame (code predictor, sub-talker sampling, talker step, codebook-0
//! sampling); new sequences are prefilled together, on the tensor cores (kernels/prefill.cu).
//! [`CudaCodec`] decodes the frames of many streams to audio (kernels/codec.cu);
//! [`CudaVoiceEncoder`] encodes reference audio for voice cloning (kernels/encoder.cu).
//! Kernels are compiled at first use with NVRTC and cached on disk. This is the only crate with
//! `unsafe` code.

/// Lets kernels take the listed structs by value (or as device arrays). List only `#[repr(C)]`
/// plain-old-data structs of integers, floats and device addresses whose layout mirrors the
/// struct of the same role in the kernel source.
macro_rules! kernel_params {
    ($($name:ident),+ $(,)?) => {
        $(
            // SAFETY: per the macro's contract, a `#[repr(C)]` struct of plain values whose
            // layout is the kernel's.
            unsafe impl cudarc::driver::DeviceRepr for $name {}
        )+
    };
}

mod backend;
pub mod bench;
mod codec;
mod encoder;
mod layout;
mod prefill;
pub mod runtime;
pub mod weights;

pub use backend::{CudaBackend, CudaOptions, PhaseMark};
pub use codec::{CodecPrecision, CudaCodec, CudaCodecOptions};
pub use encoder::CudaVoiceEncoder;
pub use layout::{MAX_BATCH, PHASE_NAMES, PHASE_TALKER};
pub use runtime::driver_available;
