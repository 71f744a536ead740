//! The frame loop of one sequence (spec §3.5):
//!
//! ```text
//! prefill -> past_hidden, c0 of frame 0
//! loop:
//!     stop if c0 == EOS (finished: Eos) or max_frames frames are out (finished: MaxFrames);
//!         the stopping token is never expanded
//!     c1..c15 = code_predictor(past_hidden, c0)            -> emit frame g
//!     talker step on FRAME(frame g) + trailing[g]          -> past_hidden, c0 of frame g + 1
//! ```

use anyhow::Result;
use candle_core::Tensor;

use super::model::ReferenceModel;
use super::transformer::KvCache;
use crate::backend::{FinishReason, Frame, FrameEvent, NUM_CODE_GROUPS, SequenceSpec};
use crate::sampling::{SamplingConfig, sample_subtalker, sample_talker, uniform};

pub(crate) struct Sequence {
    cache: KvCache,
    /// Talker final-norm hidden state that produced `next_c0`.
    past_hidden: Tensor,
    /// Codebook 0 of frame `frames`, sampled but not yet expanded.
    next_c0: u32,
    /// Codebook-0 ids generated so far (the repetition-penalty history).
    history: Vec<u32>,
    trailing: Tensor,
    /// Frames emitted so far.
    frames: usize,
    max_frames: usize,
    sampling: SamplingConfig,
    finished: Option<FinishReason>,
}

impl Sequence {
    /// Prefill and the first codebook-0 sample.
    pub(crate) fn start(model: &ReferenceModel, spec: &SequenceSpec) -> Result<Self> {
        spec.sampling.validate()?;
        let trailing = model.embeddings.trailing(&spec.plan)?;
        let mut cache = model.talker.new_cache();
        let out = model
            .talker
            .forward(&model.embeddings.prefill(&spec.plan)?, &mut cache)?;
        let mut sequence = Self {
            cache,
            past_hidden: out.hidden,
            next_c0: 0,
            history: Vec::new(),
            trailing,
            frames: 0,
            max_frames: spec.max_frames,
            sampling: spec.sampling,
            finished: None,
        };
        sequence.sample_c0(model, out.logits);
        Ok(sequence)
    }

    /// Emits the next frame, or why the sequence is finished.
    pub(crate) fn advance(&mut self, model: &ReferenceModel) -> Result<FrameEvent> {
        if let Some(reason) = self.finished {
            return Ok(FrameEvent::Finished(reason));
        }
        let frame = self.expand(model)?;
        self.history.push(frame[0]);
        let input = model.decode_input(&frame, &self.trailing, self.frames)?;
        let out = model.talker.forward(&input, &mut self.cache)?;
        self.frames += 1;
        self.past_hidden = out.hidden;
        self.sample_c0(model, out.logits);
        Ok(FrameEvent::Frame(frame))
    }

    /// Inserts projected text rows before the final `tts_pad` row of `trailing`.
    pub(crate) fn append_trailing(&mut self, model: &ReferenceModel, ids: &[u32]) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let rows = model.embeddings.project_text(ids)?;
        let known = self.trailing.dim(0)? - 1;
        let pad = self.trailing.narrow(0, known, 1)?;
        let head = self.trailing.narrow(0, 0, known)?;
        self.trailing = Tensor::cat(&[&head, &rows, &pad], 0)?;
        Ok(())
    }

    /// Codebooks 1..15 of the pending frame.
    fn expand(&self, model: &ReferenceModel) -> Result<Frame> {
        let (seed, frame_index) = (self.sampling.seed, self.frames as u32);
        let params = self.sampling.subtalker;
        let rest = model.code_predictor.predict(
            &self.past_hidden,
            self.next_c0,
            &model.embeddings.codec,
            |group, logits| {
                sample_subtalker(logits, &params, uniform(seed, frame_index, group as u32))
            },
        )?;
        let mut frame: Frame = [0; NUM_CODE_GROUPS];
        frame[0] = self.next_c0;
        frame[1..].copy_from_slice(&rest);
        Ok(frame)
    }

    /// Samples codebook 0 of frame `frames` and decides whether the sequence stops there.
    fn sample_c0(&mut self, model: &ReferenceModel, mut logits: Vec<f32>) {
        let u = uniform(self.sampling.seed, self.frames as u32, 0);
        let c0 = sample_talker(
            &mut logits,
            &self.history,
            &model.rules,
            &self.sampling.talker,
            u,
        );
        self.next_c0 = c0;
        self.finished = if c0 == model.rules.eos_id {
            Some(FinishReason::Eos)
        } else if self.frames >= self.max_frames {
            Some(FinishReason::MaxFrames)
        } else {
            None
        };
    }
}
