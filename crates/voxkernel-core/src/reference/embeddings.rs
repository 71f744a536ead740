//! The embedding primitives (spec §3.2) and how a [`PromptPlan`] becomes talker input rows:
//!
//! ```text
//! TP(ids)      = fc2(silu(fc1(text_embedding[ids])))        (both Linear with bias)
//! CE(id)       = talker.model.codec_embedding[id]
//! FRAME(c[16]) = CE(c0) + sum_{j=1..15} predictor.codec_embedding[j-1][c_j]
//! prefill row  = TP(text_id) + codec source (nothing, CE(id), the speaker vector, or FRAME)
//! ```
//!
//! The text and codec tracks are summed, never concatenated, and nothing is scaled.

use anyhow::{Result, bail};
use candle_core::{Device, Tensor};
use candle_nn::{Linear, Module};

use super::weights::Weights;
use crate::backend::Frame;
use crate::config::TalkerConfig;
use crate::prompt::{CodecSource, PromptPlan};

/// `text_projection(text_embedding[ids])`: text ids into talker width.
pub(crate) struct TextProjection {
    table: Tensor,
    fc1: Linear,
    fc2: Linear,
}

impl TextProjection {
    fn load(talker: &Weights, c: &TalkerConfig) -> Result<Self> {
        let proj = talker.sub("text_projection");
        Ok(Self {
            table: talker.tensor(
                "model.text_embedding.weight",
                &[c.text_vocab_size, c.text_hidden_size],
            )?,
            fc1: proj.linear("linear_fc1", c.text_hidden_size, c.text_hidden_size, true)?,
            fc2: proj.linear("linear_fc2", c.text_hidden_size, c.hidden_size, true)?,
        })
    }

    /// `TP(ids)`: `[ids.len(), hidden]`.
    pub(crate) fn project(&self, ids: &[u32]) -> Result<Tensor> {
        let vocab = self.table.dim(0)?;
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            bail!("text id {bad} is outside the text vocabulary (0..{vocab})");
        }
        let rows = self
            .table
            .index_select(&Tensor::new(ids, &Device::Cpu)?, 0)?;
        let hidden = candle_nn::ops::silu(&self.fc1.forward(&rows)?)?;
        Ok(self.fc2.forward(&hidden)?)
    }
}

/// The talker's codec table and the code predictor's 15 group tables, all talker width.
pub(crate) struct CodecEmbeddings {
    talker: Tensor,
    groups: Vec<Tensor>,
    hidden: usize,
}

impl CodecEmbeddings {
    fn load(talker: &Weights, c: &TalkerConfig) -> Result<Self> {
        let predictor = &c.code_predictor_config;
        let groups = (0..c.num_code_groups - 1)
            .map(|j| {
                talker.tensor(
                    &format!("code_predictor.model.codec_embedding.{j}.weight"),
                    &[predictor.vocab_size, c.hidden_size],
                )
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            talker: talker.tensor(
                "model.codec_embedding.weight",
                &[c.vocab_size, c.hidden_size],
            )?,
            groups,
            hidden: c.hidden_size,
        })
    }

    /// `CE(id)`: `[1, hidden]`.
    pub(crate) fn talker_row(&self, id: u32) -> Result<Tensor> {
        row(&self.talker, id, "talker codec id")
    }

    /// `predictor.codec_embedding[group - 1][code]` for codebook `group` in 1..16: `[1, hidden]`.
    pub(crate) fn group_row(&self, group: usize, code: u32) -> Result<Tensor> {
        row(&self.groups[group - 1], code, "codebook code")
    }

    /// `FRAME(codes)`: `[1, hidden]`.
    pub(crate) fn frame(&self, codes: &Frame) -> Result<Tensor> {
        let mut sum = self.talker_row(codes[0])?;
        for (group, &code) in codes.iter().enumerate().skip(1) {
            sum = (sum + self.group_row(group, code)?)?;
        }
        Ok(sum)
    }
}

fn row(table: &Tensor, id: u32, what: &str) -> Result<Tensor> {
    let rows = table.dim(0)?;
    if id as usize >= rows {
        bail!("{what} {id} is outside the table (0..{rows})");
    }
    Ok(table.narrow(0, id as usize, 1)?)
}

/// Both embedding tracks of the talker input.
pub(crate) struct Embeddings {
    pub(crate) text: TextProjection,
    pub(crate) codec: CodecEmbeddings,
}

impl Embeddings {
    pub(crate) fn load(talker: &Weights, c: &TalkerConfig) -> Result<Self> {
        Ok(Self {
            text: TextProjection::load(talker, c)?,
            codec: CodecEmbeddings::load(talker, c)?,
        })
    }

    /// The talker prefill input `[plan.prefill.len(), hidden]`.
    pub(crate) fn prefill(&self, plan: &PromptPlan) -> Result<Tensor> {
        if plan.prefill.is_empty() {
            bail!("prompt plan has no prefill rows");
        }
        let text_ids: Vec<u32> = plan.prefill.iter().map(|r| r.text_id).collect();
        let text = self.text.project(&text_ids)?;
        let codec = plan
            .prefill
            .iter()
            .map(|r| self.codec_track(r.codec, plan))
            .collect::<Result<Vec<_>>>()?;
        Ok((text + Tensor::cat(&codec, 0)?)?)
    }

    /// The text-track vectors of the decode steps, `[trailing.len() + 1, hidden]`: step `g`
    /// adds row `min(g, last)`, and the last row is `tts_pad`.
    pub(crate) fn trailing(&self, plan: &PromptPlan) -> Result<Tensor> {
        let ids: Vec<u32> = plan
            .trailing
            .iter()
            .copied()
            .chain(std::iter::once(plan.tts_pad_id))
            .collect();
        self.text.project(&ids)
    }

    /// `text_projection(text_embedding[ids])` rows, for text appended to a running sequence.
    pub(crate) fn project_text(&self, ids: &[u32]) -> Result<Tensor> {
        self.text.project(ids)
    }

    fn codec_track(&self, source: CodecSource, plan: &PromptPlan) -> Result<Tensor> {
        match source {
            CodecSource::None => Ok(Tensor::zeros(
                (1, self.codec.hidden),
                candle_core::DType::F32,
                &Device::Cpu,
            )?),
            CodecSource::Id(id) => self.codec.talker_row(id),
            CodecSource::SpeakerVector => {
                let Some(vector) = &plan.speaker_vector else {
                    bail!("prompt plan has a SpeakerVector row but no speaker_vector");
                };
                if vector.len() != self.codec.hidden {
                    bail!(
                        "speaker_vector has {} values, the talker hidden size is {}",
                        vector.len(),
                        self.codec.hidden
                    );
                }
                Ok(Tensor::from_vec(
                    vector.clone(),
                    (1, vector.len()),
                    &Device::Cpu,
                )?)
            }
            CodecSource::ReferenceFrame(k) => {
                let Some(frame) = plan.reference_codes.get(k) else {
                    bail!(
                        "prompt plan row points at reference frame {k}, but it has {} reference frames",
                        plan.reference_codes.len()
                    );
                };
                self.codec.frame(frame)
            }
        }
    }
}
