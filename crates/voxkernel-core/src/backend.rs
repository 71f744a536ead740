//! The narrow interface every decode backend implements: prefill new sequences (several at
//! once), then advance a batch of sequences by one audio frame at a time.

use anyhow::{Result, anyhow};

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
    /// Run the prefill of each new sequence and sample its first codebook-0 token; a backend
    /// may run the prefills of one call together. Returns one result per spec, in order. A spec
    /// the backend cannot start (invalid for it, no free slot) fails alone and holds no slot;
    /// a failure of the backend itself fails every spec of the call and keeps none of their
    /// slots.
    fn start(&mut self, specs: &[SequenceSpec]) -> Vec<Result<SlotId>>;
    /// [`start`](Self::start) with one spec.
    fn start_one(&mut self, spec: &SequenceSpec) -> Result<SlotId> {
        self.start(std::slice::from_ref(spec))
            .pop()
            .unwrap_or_else(|| Err(anyhow!("the backend returned no result for the spec")))
    }
    /// Advance every listed sequence by one frame. Events come back in the order of `slots`.
    /// A finished sequence keeps answering `Finished` until it is released.
    fn step(&mut self, slots: &[SlotId]) -> Result<Vec<FrameEvent>>;
    /// The most sequences the device advances in one pass (a launch); a step of more runs
    /// several passes one after the other. The engine steps a round in groups of this many,
    /// so that a session arriving mid-round waits for one group, not for all of them.
    fn step_width(&self) -> usize {
        usize::MAX
    }
    /// Append text-track ids to the slot's trailing ids (streaming text mode, text arriving
    /// while the sequence runs). Step `g` adds trailing id `g`, or `tts_pad` once they run out,
    /// so the caller must append id `g` before step `g` when it wants it used.
    fn append_trailing(&mut self, slot: SlotId, ids: &[u32]) -> Result<()>;
    /// Free the slot's KV cache and state.
    fn release(&mut self, slot: SlotId);
}

/// A codec-decoder stream owned by a [`CodecBackend`] (conv histories, transformer window).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CodecSlot(pub usize);

/// The streaming codec decoder for many streams: frames in, 24 kHz mono f32 PCM out.
pub trait CodecBackend: Send {
    /// Human-readable backend and device name.
    fn name(&self) -> String;
    /// Output samples per frame (1920 at 24 kHz).
    fn samples_per_frame(&self) -> usize;
    /// A new stream at position 0.
    fn open(&mut self) -> Result<CodecSlot>;
    /// Decode each entry's frames, appended to its stream. Returns, per entry and in order,
    /// exactly `frames.len() * samples_per_frame()` samples: the one-pass decode's samples for
    /// those frames, whatever the split.
    fn decode(&mut self, batch: &[(CodecSlot, &[Frame])]) -> Result<Vec<Vec<f32>>>;
    /// Free the stream's state.
    fn release(&mut self, slot: CodecSlot);
    /// Whether `decode` gives a stream the same samples, bit for bit, however its frames are
    /// split into calls and whatever shares them. Only then may the engine send a packet early
    /// (`EngineOptions::pacing`): it changes where a stream's frames are split, not its audio.
    fn split_invariant(&self) -> bool {
        false
    }
}
