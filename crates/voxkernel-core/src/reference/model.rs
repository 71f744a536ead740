//! The whole talker side of a checkpoint in f32, and the taps parity tests compare against the
//! official implementation (and the CUDA backend against this one).

use anyhow::{Result, bail, ensure};
use candle_core::Tensor;

use super::code_predictor::CodePredictor;
use super::embeddings::Embeddings;
use super::talker::{Talker, TalkerOutput};
use super::weights::Weights;
use crate::backend::{Frame, NUM_CODE_GROUPS};
use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::prompt::PromptPlan;
use crate::sampling::TalkerLogitRules;

pub struct ReferenceModel {
    pub(crate) config: ModelConfig,
    pub(crate) embeddings: Embeddings,
    pub(crate) talker: Talker,
    pub(crate) code_predictor: CodePredictor,
    pub(crate) rules: TalkerLogitRules,
}

impl ReferenceModel {
    pub fn new(checkpoint: &Checkpoint) -> Result<Self> {
        let config = checkpoint.config.clone();
        let c = &config.talker;
        ensure!(
            c.num_code_groups == NUM_CODE_GROUPS
                && c.code_predictor_config.num_code_groups == NUM_CODE_GROUPS,
            "config.json: talker_config.num_code_groups is {} (code predictor {}); only {} is supported",
            c.num_code_groups,
            c.code_predictor_config.num_code_groups,
            NUM_CODE_GROUPS
        );
        let talker = Weights::new(&checkpoint.model, "talker.");
        Ok(Self {
            embeddings: Embeddings::load(&talker, c)?,
            talker: Talker::load(&talker, c)?,
            code_predictor: CodePredictor::load(&talker, c)?,
            rules: TalkerLogitRules::official(c.vocab_size, c.codec_eos_token_id),
            config,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The talker prefill input of a plan, one row per prefill row: `[L][hidden]`.
    pub fn prefill_embeds(&self, plan: &PromptPlan) -> Result<Vec<Vec<f32>>> {
        Ok(self.embeddings.prefill(plan)?.to_vec2()?)
    }

    /// The text-track vectors the decode steps add, tts_pad last: `[trailing + 1][hidden]`.
    pub fn trailing_embeds(&self, plan: &PromptPlan) -> Result<Vec<Vec<f32>>> {
        Ok(self.embeddings.trailing(plan)?.to_vec2()?)
    }

    /// Raw codebook-0 logits (before any processor) of the prefill and of the next
    /// `steps - 1` decode steps, with `codes[g]` fed as frame `g` (teacher forcing):
    /// `[steps][vocab]`.
    pub fn teacher_forced_logits(
        &self,
        plan: &PromptPlan,
        codes: &[Frame],
        steps: usize,
    ) -> Result<Vec<Vec<f32>>> {
        if steps == 0 || codes.len() + 1 < steps {
            bail!(
                "teacher_forced_logits: {steps} steps need at least {} frames of codes, got {}",
                steps.saturating_sub(1),
                codes.len()
            );
        }
        let outputs = self.teacher_forced_talker(plan, &codes[..steps - 1])?;
        Ok(outputs.into_iter().map(|o| o.logits).collect())
    }

    /// Raw logits of codebooks 1..15 of frame `frame` (`[15][predictor vocab]`), with the
    /// talker fed `codes[..frame]` and the code predictor fed `codes[frame]` (teacher forcing).
    pub fn teacher_forced_predictor_logits(
        &self,
        plan: &PromptPlan,
        codes: &[Frame],
        frame: usize,
    ) -> Result<Vec<Vec<f32>>> {
        let Some(forced) = codes.get(frame) else {
            bail!(
                "teacher_forced_predictor_logits: frame {frame} is outside the {} frames of codes",
                codes.len()
            );
        };
        let outputs = self.teacher_forced_talker(plan, &codes[..frame])?;
        let past_hidden = &outputs[frame].hidden;
        let mut rows = Vec::with_capacity(NUM_CODE_GROUPS - 1);
        self.code_predictor.predict(
            past_hidden,
            forced[0],
            &self.embeddings.codec,
            |group, logits| {
                rows.push(logits.to_vec());
                forced[group]
            },
        )?;
        Ok(rows)
    }

    /// The talker outputs of the prefill and of one decode step per frame in `codes`.
    fn teacher_forced_talker(
        &self,
        plan: &PromptPlan,
        codes: &[Frame],
    ) -> Result<Vec<TalkerOutput>> {
        let trailing = self.embeddings.trailing(plan)?;
        let mut cache = self.talker.new_cache();
        let mut outputs = vec![
            self.talker
                .forward(&self.embeddings.prefill(plan)?, &mut cache)?,
        ];
        for (g, frame) in codes.iter().enumerate() {
            let input = self.decode_input(frame, &trailing, g)?;
            outputs.push(self.talker.forward(&input, &mut cache)?);
        }
        Ok(outputs)
    }

    /// Talker input of decode step `g`: `FRAME(frame) + trailing[min(g, last)]`, `[1, hidden]`.
    pub(crate) fn decode_input(
        &self,
        frame: &Frame,
        trailing: &Tensor,
        g: usize,
    ) -> Result<Tensor> {
        let last = trailing.dim(0)? - 1;
        let text = trailing.narrow(0, g.min(last), 1)?;
        Ok((self.embeddings.codec.frame(frame)? + text)?)
    }
}
