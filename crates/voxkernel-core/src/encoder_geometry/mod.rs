//! The voice-clone encoders' layers as the configs give them: every convolution's checkpoint
//! name, shape, stride and dilation, built after the checks the models themselves impose. The
//! CPU reference (`reference::{speaker_encoder, codec_encoder}`) and voxkernel-cuda's encoders
//! both load from these, so they read the same tensors and refuse a config with the same error;
//! a backend adds only its own limits.

mod speaker;
mod tokenizer;

pub use self::speaker::{SeRes2NetBlockGeometry, SpeakerConv, SpeakerEncoderGeometry};
pub use self::tokenizer::{
    CausalPadding, MimiConv, QuantizerGeometry, ResnetBlockGeometry, SeanetGeometry,
    SeanetStageGeometry, TokenizerEncoderGeometry,
};
