//! The CPU reference backend (candle, f32): the executable specification the CUDA backend is
//! judged against. One concept per file:
//! - [`weights`]: checkpoint tensors as f32 candle tensors;
//! - [`codec_decoder`]: the speech tokenizer's decoder (codes to waveform), one-pass and streaming;
//! - [`codec_encoder`]: the speech tokenizer's encoder (waveform to codes; voice cloning);
//! - [`mel`] and [`speaker_encoder`]: reference audio to the Base models' x-vector;
//! - [`conv1d`]: the padded time-major convolution both encoders are built from;
//! - [`transformer`]: the Qwen3 decoder stack shared by the talker and the code predictor;
//! - [`embeddings`]: `TP`, `CE`, `FRAME` and the prompt plan's prefill and trailing rows;
//! - [`talker`]: the talker and its codec head;
//! - [`code_predictor`]: codebooks 1..15 of a frame;
//! - [`model`]: everything loaded together, plus the parity taps;
//! - [`sequence`]: the frame loop of one sequence (spec §3.5);
//! - [`forced`]: the same driven teacher-forced from given rows and codes (official dumps);
//! - [`backend`]: [`ReferenceBackend`] and [`ReferenceCodec`], the backend traits on the CPU.

mod backend;
mod code_predictor;
pub mod codec_decoder;
pub mod codec_encoder;
mod conv1d;
mod embeddings;
mod forced;
mod fused;
pub mod mel;
mod model;
mod sequence;
pub mod speaker_encoder;
mod talker;
mod transformer;
mod weights;

pub use backend::{ReferenceBackend, ReferenceCodec};
pub use forced::ReferenceForcing;
pub use model::ReferenceModel;
