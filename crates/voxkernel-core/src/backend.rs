//! The narrow interface every decode backend implements: prefill a sequence, then advance a
//! batch of sequences by one audio frame at a time.

use anyhow::Result;

use crate::prompt::PromptPlan;
use crate::sampling::SamplingConfig;

/// Number of codebooks per frame (codebook 0 from the talker, 1..15 from the code predictor).
pub const NUM_CODE_GROUPS: usize = 16;

/// The 16 codes of one 80 ms frame.
pub type Frame = [u32; NUM_CODE_GROUPS];

/// Everything a backend needs to start a sequence.
#[derive(Debug, Clone)]
pub struct SequenceSpec {
    pub plan: PromptPlan,
    pub sampling: SamplingConfig,
    /// At most this many frames come out (the official `max_new_tokens` is this + 1).
    pub max_frames: usize,
}

/// A backend-owned sequence slot (KV cache, sampler state, pending codebook-0 token).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotId(pub usize);

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The talker sampled codec EOS as codebook 0.
    Eos,
    /// `max_frames` frames were produced.
    MaxFrames,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameEvent {
    Frame(Frame),
    Finished(FinishReason),
}

pub trait FrameBackend: Send {
    /// Human-readable backend and device name.
    fn name(&self) -> String;
    /// Run the prefill of a new sequence and sample its first codebook-0 token.
    fn start(&mut self, spec: &SequenceSpec) -> Result<SlotId>;
    /// Advance every listed sequence by one frame. Events come back in the order of `slots`.
    /// A finished sequence keeps answering `Finished` until it is released.
    fn step(&mut self, slots: &[SlotId]) -> Result<Vec<FrameEvent>>;
    /// Free the slot's KV cache and state.
    fn release(&mut self, slot: SlotId);
}
