//! The code predictor (spec §3.6): per frame, a fresh small decoder expands codebook 0 into
//! codebooks 1..15.
//!
//! ```text
//! P = small_to_mtp_projection (Linear with bias; identity when the widths match)
//! prefill, positions 0, 1: [P(past_hidden), P(CE(c0))]   -> c1 = choose(lm_head[0](h[1]))
//! step j = 1..14, position j + 1: P(group_embedding[j-1][c_j]) -> c_{j+1} = choose(lm_head[j](h))
//! ```

use anyhow::Result;
use candle_core::Tensor;
use candle_nn::{Linear, Module};

use super::embeddings::CodecEmbeddings;
use super::transformer::{DecoderGeometry, Transformer};
use super::weights::Weights;
use crate::config::TalkerConfig;

pub(crate) struct CodePredictor {
    /// Present only when the predictor is narrower than the talker (the 1.7B models).
    projection: Option<Linear>,
    transformer: Transformer,
    /// `lm_heads[j]` predicts codebook `j + 1`.
    lm_heads: Vec<Linear>,
}

impl CodePredictor {
    pub(crate) fn load(talker: &Weights, c: &TalkerConfig) -> Result<Self> {
        let w = talker.sub("code_predictor");
        let p = &c.code_predictor_config;
        let projection = if w.contains("small_to_mtp_projection.weight") {
            Some(w.linear(
                "small_to_mtp_projection",
                c.hidden_size,
                p.hidden_size,
                true,
            )?)
        } else {
            anyhow::ensure!(
                p.hidden_size == c.hidden_size,
                "code predictor hidden size {} differs from the talker's {} but the checkpoint \
                 has no talker.code_predictor.small_to_mtp_projection",
                p.hidden_size,
                c.hidden_size
            );
            None
        };
        let lm_heads = (0..c.num_code_groups - 1)
            .map(|j| w.linear(&format!("lm_head.{j}"), p.hidden_size, p.vocab_size, false))
            .collect::<Result<_>>()?;
        Ok(Self {
            projection,
            transformer: Transformer::load(&w.sub("model"), &DecoderGeometry::from(p))?,
            lm_heads,
        })
    }

    fn project(&self, x: &Tensor) -> Result<Tensor> {
        match &self.projection {
            Some(p) => Ok(p.forward(x)?),
            None => Ok(x.clone()),
        }
    }

    /// Codebooks 1..15 of one frame. `choose(group, logits)` turns the raw logits of codebook
    /// `group` into a code.
    pub(crate) fn predict(
        &self,
        past_hidden: &Tensor,
        c0: u32,
        codec: &CodecEmbeddings,
        mut choose: impl FnMut(usize, &mut [f32]) -> u32,
    ) -> Result<Vec<u32>> {
        let mut cache = self.transformer.new_cache();
        let mut codes: Vec<u32> = Vec::with_capacity(self.lm_heads.len());
        for (j, head) in self.lm_heads.iter().enumerate() {
            let input = match codes.last() {
                None => Tensor::cat(&[past_hidden, &codec.talker_row(c0)?], 0)?,
                Some(&previous) => codec.group_row(j, previous)?,
            };
            let hidden = self
                .transformer
                .forward(&self.project(&input)?, &mut cache)?;
            let last = hidden.narrow(0, hidden.dim(0)? - 1, 1)?;
            let mut logits = head.forward(&last)?.squeeze(0)?.to_vec1::<f32>()?;
            let code = choose(j + 1, &mut logits);
            codes.push(code);
        }
        Ok(codes)
    }
}
