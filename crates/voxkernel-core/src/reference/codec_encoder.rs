//! The speech tokenizer's encoder (24 kHz waveform to 12.5 Hz codes) on the CPU in f32:
//! `Qwen3TTSTokenizerV2Model.encode`, a transformers `MimiModel` without its decoder (spec §4.5).
//! SEANet (25 Hz) → 8-layer causal transformer → stride-2 downsample (replicate padding) →
//! split residual VQ (1 semantic + acoustic codebooks, each RVQ quantizing the same latent);
//! only the first `encoder_valid_num_quantizers` (16) codes per frame are kept.

mod seanet;
mod transformer;

use anyhow::{Result, ensure};
use candle_core::{Device, Module, Tensor};
use candle_nn::Linear;

use self::seanet::{CausalConv, Seanet};
use self::transformer::EncoderTransformer;
use super::fused;
use super::weights::Weights;
use crate::backend::{Frame, NUM_CODE_GROUPS};
use crate::checkpoint::{Checkpoint, SafetensorsFile};
use crate::config::{CodecEncoderConfig, SpeechTokenizerConfig};
use crate::encoder_geometry::{QuantizerGeometry, TokenizerEncoderGeometry};

/// Floor of `cluster_usage` when the codebook is formed (`MimiEuclideanCodebook.epsilon`).
const CLUSTER_USAGE_MIN: f64 = 1e-5;

pub struct CodecEncoder {
    seanet: Seanet,
    transformer: EncoderTransformer,
    downsample: Option<CausalConv>,
    semantic: ResidualQuantizer,
    acoustic: ResidualQuantizer,
    samples_per_frame: usize,
    sample_rate: usize,
}

impl CodecEncoder {
    pub fn from_checkpoint(checkpoint: &Checkpoint) -> Result<Self> {
        Self::load(
            &checkpoint.speech_tokenizer_config,
            &checkpoint.speech_tokenizer,
        )
    }

    /// From a speech tokenizer config and its f32 `model.safetensors`.
    pub fn load(config: &SpeechTokenizerConfig, file: &SafetensorsFile) -> Result<Self> {
        let geometry = TokenizerEncoderGeometry::new(config)?;
        let c = &config.encoder_config;
        let weights = Weights::new(file, "encoder.");
        let downsample = geometry
            .downsample
            .as_ref()
            .map(|conv| CausalConv::load(&weights, conv))
            .transpose()?;
        Ok(Self {
            seanet: Seanet::load(&weights, &geometry.seanet)?,
            transformer: EncoderTransformer::load(&weights.sub("encoder_transformer"), c)?,
            downsample,
            semantic: ResidualQuantizer::load(&weights, c, &geometry.semantic)?,
            acoustic: ResidualQuantizer::load(&weights, c, &geometry.acoustic)?,
            samples_per_frame: config.encode_downsample_rate,
            sample_rate: config.input_sample_rate as usize,
        })
    }

    /// Input samples per code frame (1920).
    pub fn samples_per_frame(&self) -> usize {
        self.samples_per_frame
    }

    /// The rate `encode` expects (24 kHz).
    pub fn sample_rate(&self) -> usize {
        self.sample_rate
    }

    /// Codes of a mono clip at `sample_rate()`: `ceil(len / 1920)` frames of 16 codes.
    pub fn encode(&self, samples: &[f32]) -> Result<Vec<Frame>> {
        ensure!(!samples.is_empty(), "codec encoder: no samples");
        let audio = Tensor::from_slice(samples, (samples.len(), 1), &Device::Cpu)?;
        let latent = self.transformer.forward(&self.seanet.forward(&audio)?)?;
        let latent = match &self.downsample {
            Some(conv) => conv.forward(&latent)?,
            None => latent,
        };
        let semantic = self.semantic.encode(&latent)?;
        let acoustic = self.acoustic.encode(&latent)?;
        // The wrapper keeps ceil(valid samples / 1920) frames of what Mimi returns.
        let frames = samples
            .len()
            .div_ceil(self.samples_per_frame)
            .min(semantic.len());
        Ok((0..frames)
            .map(|t| {
                let mut frame = [0u32; NUM_CODE_GROUPS];
                let codes = semantic[t].iter().chain(&acoustic[t]);
                for (slot, code) in frame.iter_mut().zip(codes) {
                    *slot = *code;
                }
                frame
            })
            .collect())
    }
}

/// `MimiResidualVectorQuantizer.encode` for its first `layers.len()` layers: project, then per
/// layer pick the nearest codeword and subtract it.
struct ResidualQuantizer {
    input_proj: Option<Linear>,
    layers: Vec<Codebook>,
}

/// One codebook, kept in the form torch's `cdist` uses for the distance matmul.
struct Codebook {
    /// `embed_sum / clamp(cluster_usage, 1e-5)`: `[size, dim]`.
    embed: Tensor,
    /// `[dim + 2, size]`: columns `[e; 1; |e|²]`, so that `[-2x, |x|², 1] @ this` is
    /// `|x|² - 2 x·e + |e|²`.
    augmented: Tensor,
}

impl ResidualQuantizer {
    /// `weights` under `encoder.`.
    fn load(
        weights: &Weights,
        c: &CodecEncoderConfig,
        geometry: &QuantizerGeometry,
    ) -> Result<Self> {
        let weights = weights.sub(geometry.name);
        let dim = c.vector_quantization_hidden_dimension;
        let input_proj = (dim != c.hidden_size)
            .then(|| -> Result<Linear> {
                let weight = weights.tensor("input_proj.weight", &[dim, c.hidden_size, 1])?;
                Ok(Linear::new(weight.squeeze(2)?, None))
            })
            .transpose()?;
        let layers = (0..geometry.layers)
            .map(|q| {
                let w = weights.sub(&format!("layers.{q}.codebook"));
                let sum = w.tensor("embed_sum", &[c.codebook_size, dim])?;
                let usage = w
                    .tensor("cluster_usage", &[c.codebook_size])?
                    .clamp(CLUSTER_USAGE_MIN, f64::INFINITY)?;
                let embed = sum.broadcast_div(&usage.unsqueeze(1)?)?;
                let ones = Tensor::ones((c.codebook_size, 1), embed.dtype(), embed.device())?;
                let norms = embed.sqr()?.sum_keepdim(1)?;
                let augmented = Tensor::cat(&[&embed, &ones, &norms], 1)?
                    .t()?
                    .contiguous()?;
                Ok(Codebook { embed, augmented })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { input_proj, layers })
    }

    /// `[frames, hidden]` to `frames` rows of `layers.len()` codes.
    fn encode(&self, latent: &Tensor) -> Result<Vec<Vec<u32>>> {
        let mut residual = match &self.input_proj {
            Some(proj) => proj.forward(latent)?,
            None => latent.clone(),
        };
        let frames = residual.dim(0)?;
        let mut codes = vec![Vec::with_capacity(self.layers.len()); frames];
        for codebook in &self.layers {
            let indices = codebook.nearest(&residual)?;
            for (row, &index) in codes.iter_mut().zip(&indices) {
                row.push(index);
            }
            let index = Tensor::from_vec(indices, frames, residual.device())?;
            residual = (residual - codebook.embed.index_select(&index, 0)?)?;
        }
        Ok(codes)
    }
}

impl Codebook {
    /// Index of the nearest codeword per row (`torch.cdist` then `argmin`, first on ties):
    /// `sqrt(max(|x|² - 2 x·e + |e|², 0))` through one matmul, as cdist computes it.
    fn nearest(&self, x: &Tensor) -> Result<Vec<u32>> {
        let ones = Tensor::ones((x.dim(0)?, 1), x.dtype(), x.device())?;
        let norms = x.sqr()?.sum_keepdim(1)?;
        let augmented = Tensor::cat(&[&(x * -2.0)?, &norms, &ones], 1)?;
        fused::row_argmin_distance(&augmented.matmul(&self.augmented)?)
    }
}
