//! voxkernel-core: the Qwen3-TTS model definition (config, checkpoint, tokenizer, prompt plan,
//! sampling), the CPU reference backend, and the backend-agnostic engine. Nothing here knows
//! about CUDA.

pub mod backend;
pub mod checkpoint;
pub mod config;
pub mod encoder_geometry;
pub mod engine;
pub mod hub;
pub mod official_run;
pub mod prompt;
pub mod reference;
pub mod sampling;
pub mod tokenizer;
pub mod voice_clone;
