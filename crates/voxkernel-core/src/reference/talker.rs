//! The talker (spec §3.4): a Qwen3 decoder over summed text + codec rows whose `codec_head`
//! gives the codebook-0 logits of the next frame. The prefill and every decode step are the
//! same call; only the number of rows differs.

use anyhow::Result;
use candle_core::Tensor;
use candle_nn::{Linear, Module};

use super::transformer::{DecoderGeometry, KvCache, Transformer};
use super::weights::Weights;
use crate::config::TalkerConfig;

pub(crate) struct Talker {
    transformer: Transformer,
    codec_head: Linear,
}

/// What one talker call leaves for the next stage.
pub(crate) struct TalkerOutput {
    /// The final-norm hidden state of the last row, `[1, hidden]` (the code predictor's
    /// `past_hidden`).
    pub(crate) hidden: Tensor,
    /// Raw codebook-0 logits of the last row (before any logit processor).
    pub(crate) logits: Vec<f32>,
}

impl Talker {
    pub(crate) fn load(talker: &Weights, c: &TalkerConfig) -> Result<Self> {
        Ok(Self {
            transformer: Transformer::load(&talker.sub("model"), &DecoderGeometry::from(c))?,
            codec_head: talker.linear("codec_head", c.hidden_size, c.vocab_size, false)?,
        })
    }

    pub(crate) fn new_cache(&self) -> KvCache {
        self.transformer.new_cache()
    }

    /// Feeds `rows` (`[n, hidden]`) after whatever the cache holds.
    pub(crate) fn forward(&self, rows: &Tensor, cache: &mut KvCache) -> Result<TalkerOutput> {
        let hidden = self.transformer.forward(rows, cache)?;
        let last = hidden.narrow(0, hidden.dim(0)? - 1, 1)?;
        let logits = self
            .codec_head
            .forward(&last)?
            .squeeze(0)?
            .to_vec1::<f32>()?;
        Ok(TalkerOutput {
            hidden: last,
            logits,
        })
    }
}
