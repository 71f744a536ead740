//! The reference driven teacher-forced from given talker rows and codes (an official dump),
//! so that its logits and its own greedy choices can be compared step by step.

use anyhow::{Context, Result, ensure};
use candle_core::{Device, Tensor};

use super::model::ReferenceModel;
use super::transformer::KvCache;
use crate::backend::Frame;
use crate::official_run::{ForcedStep, TeacherForced};
use crate::sampling::{SamplingConfig, sample_subtalker, sample_talker};

pub struct ReferenceForcing<'a> {
    model: &'a ReferenceModel,
    state: Option<State>,
}

struct State {
    cache: KvCache,
    trailing: Tensor,
    past_hidden: Tensor,
    history: Vec<u32>,
    frames: usize,
    sampling: SamplingConfig,
}

impl<'a> ReferenceForcing<'a> {
    pub fn new(model: &'a ReferenceModel) -> Self {
        Self { model, state: None }
    }
}

fn rows(values: &[f32], hidden: usize, what: &str) -> Result<Tensor> {
    ensure!(
        !values.is_empty() && values.len().is_multiple_of(hidden),
        "{what} ({} values) must be non-empty whole rows of the talker width {hidden}",
        values.len()
    );
    Ok(Tensor::from_vec(
        values.to_vec(),
        (values.len() / hidden, hidden),
        &Device::Cpu,
    )?)
}

impl TeacherForced for ReferenceForcing<'_> {
    fn start(
        &mut self,
        prefill: &[f32],
        trailing: &[f32],
        sampling: SamplingConfig,
        _max_frames: usize,
    ) -> Result<Vec<f32>> {
        let hidden = self.model.config.talker.hidden_size;
        let mut cache = self.model.talker.new_cache();
        let out = self
            .model
            .talker
            .forward(&rows(prefill, hidden, "prefill")?, &mut cache)?;
        self.state = Some(State {
            cache,
            trailing: rows(trailing, hidden, "trailing")?,
            past_hidden: out.hidden,
            history: Vec::new(),
            frames: 0,
            sampling,
        });
        Ok(out.logits)
    }

    /// The next frame's codebook 0 arrives with that frame, so `_next_c0` is not needed here.
    fn step(&mut self, frame: &Frame, _next_c0: u32) -> Result<ForcedStep> {
        let model = self.model;
        let s = self.state.as_mut().context("step before start")?;
        let mut own_frame = *frame;
        let params = s.sampling.subtalker;
        model.code_predictor.predict(
            &s.past_hidden,
            frame[0],
            &model.embeddings.codec,
            |group, logits| {
                own_frame[group] = sample_subtalker(logits, &params, 0.5);
                frame[group]
            },
        )?;
        s.history.push(frame[0]);
        let input = model.decode_input(frame, &s.trailing, s.frames)?;
        let out = model.talker.forward(&input, &mut s.cache)?;
        s.frames += 1;
        s.past_hidden = out.hidden;
        let mut scores = out.logits.clone();
        let own_next_c0 = sample_talker(
            &mut scores,
            &s.history,
            &model.rules,
            &s.sampling.talker,
            0.5,
        );
        Ok(ForcedStep {
            logits: out.logits,
            own_frame,
            own_next_c0,
        })
    }
}
