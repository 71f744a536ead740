//! Sampling parameters and the official sampling order (qwen3-tts-spec.md §3.7).

use serde::Serialize;

/// Parameters of one sampler: the talker (codebook 0) or the sub-talker (codebooks 1..15).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SamplerParams {
    /// `false` means greedy (argmax after the logit processors).
    pub do_sample: bool,
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    /// Only the talker uses it; the sub-talker's is always 1.0.
    pub repetition_penalty: f32,
}

/// Sampling for one sequence.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SamplingConfig {
    pub talker: SamplerParams,
    pub subtalker: SamplerParams,
    /// Seeds the per-sequence counter-based RNG, so a run is reproducible.
    pub seed: u64,
}
