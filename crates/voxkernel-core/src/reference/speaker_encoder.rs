//! The Base models' speaker encoder: ECAPA-TDNN without BatchNorm (`Qwen3TTSSpeakerEncoder`,
//! modeling_qwen3_tts.py:95-394, spec §4.6), from log-mel frames to an x-vector of the talker's
//! width. Time-major throughout (`[frames, channels]`). Every convolution is PyTorch's
//! `padding="same"` with `padding_mode="reflect"`.

use anyhow::{Result, ensure};
use candle_core::{D, Tensor};

use super::conv1d::{Conv1d, Padding, pad_rows};
use super::fused::{self, Activation};
use super::weights::Weights;
use crate::checkpoint::Checkpoint;
use crate::encoder_geometry::{SpeakerConv, SpeakerEncoderGeometry};

/// Clamp under the variance in attentive statistics pooling (`AttentiveStatisticsPooling.eps`).
const STD_EPS: f64 = 1e-12;

/// Conv + ReLU ("TimeDelayNetBlock") with reflect "same" padding.
struct Tdnn {
    conv: Conv1d,
}

impl Tdnn {
    fn load(w: &Weights, conv: &SpeakerConv) -> Result<Self> {
        Ok(Self {
            conv: load_conv(w, conv)?,
        })
    }

    /// PyTorch's `padding="same"` (`span // 2` rows on the left, the rest on the right), the
    /// conv and ReLU.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let span = self.conv.span();
        let padded = pad_rows(x, span / 2, span - span / 2, Padding::Reflect)?;
        self.conv.forward_fused(&padded, None, Activation::Relu)
    }
}

/// TDNN 1x1, Res2Net, TDNN 1x1, squeeze-excitation, plus the input.
struct SeRes2NetBlock {
    tdnn1: Tdnn,
    /// Chunk `i >= 1` goes through `res2net[i - 1]`; chunk 0 passes through.
    res2net: Vec<Tdnn>,
    tdnn2: Tdnn,
    se_conv1: Conv1d,
    se_conv2: Conv1d,
    scale: usize,
}

impl SeRes2NetBlock {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.tdnn1.forward(x)?;
        let chunks = h.chunk(self.scale, D::Minus1)?;
        let mut outputs = vec![chunks[0].clone()];
        for (i, chunk) in chunks.iter().enumerate().skip(1) {
            let input = match i {
                1 => chunk.clone(),
                _ => (chunk + &outputs[i - 1])?,
            };
            outputs.push(self.res2net[i - 1].forward(&input)?);
        }
        let h = self.tdnn2.forward(&Tensor::cat(&outputs, D::Minus1)?)?;
        // Squeeze-excitation: a per-channel gate from the time average.
        let gate = self.se_conv1.forward(&h.mean_keepdim(0)?)?.relu()?;
        let gate = candle_nn::ops::sigmoid(&self.se_conv2.forward(&gate)?)?;
        fused::scaled_residual(x, &h, &gate.squeeze(0)?)
    }
}

pub struct SpeakerEncoder {
    block0: Tdnn,
    blocks: Vec<SeRes2NetBlock>,
    mfa: Tdnn,
    asp_tdnn: Tdnn,
    asp_conv: Conv1d,
    fc: Conv1d,
    mel_dim: usize,
}

impl SpeakerEncoder {
    /// The speaker encoder of a Base checkpoint, f32 (widened from the released bf16).
    pub fn from_checkpoint(checkpoint: &Checkpoint) -> Result<Self> {
        Self::load(
            &Weights::new(&checkpoint.model, "speaker_encoder."),
            &SpeakerEncoderGeometry::from_checkpoint(checkpoint)?,
        )
    }

    /// `weights` is `model.safetensors` under `speaker_encoder.`.
    fn load(weights: &Weights, geometry: &SpeakerEncoderGeometry) -> Result<Self> {
        let blocks = geometry
            .blocks
            .iter()
            .map(|block| {
                Ok(SeRes2NetBlock {
                    tdnn1: Tdnn::load(weights, &block.tdnn1)?,
                    res2net: block
                        .res2net
                        .iter()
                        .map(|conv| Tdnn::load(weights, conv))
                        .collect::<Result<Vec<_>>>()?,
                    tdnn2: Tdnn::load(weights, &block.tdnn2)?,
                    se_conv1: load_conv(weights, &block.se_conv1)?,
                    se_conv2: load_conv(weights, &block.se_conv2)?,
                    scale: block.res2net.len() + 1,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            block0: Tdnn::load(weights, &geometry.block0)?,
            blocks,
            mfa: Tdnn::load(weights, &geometry.mfa)?,
            asp_tdnn: Tdnn::load(weights, &geometry.asp_tdnn)?,
            asp_conv: load_conv(weights, &geometry.asp_conv)?,
            fc: load_conv(weights, &geometry.fc)?,
            mel_dim: geometry.mel_dim(),
        })
    }

    /// Log-mel frames `[frames, mel_dim]` to the x-vector `[enc_dim]`.
    pub fn forward(&self, mel: &Tensor) -> Result<Tensor> {
        let (_, mel_dim) = mel.dims2()?;
        ensure!(
            mel_dim == self.mel_dim,
            "speaker encoder: {mel_dim} mel bins, the config says {}",
            self.mel_dim
        );
        let mut h = self.block0.forward(mel)?;
        let mut aggregated = Vec::with_capacity(self.blocks.len());
        for block in &self.blocks {
            h = block.forward(&h)?;
            aggregated.push(h.clone());
        }
        let h = self.mfa.forward(&Tensor::cat(&aggregated, D::Minus1)?)?;
        let pooled = self.attentive_statistics_pooling(&h)?;
        Ok(self.fc.forward(&pooled)?.squeeze(0)?)
    }

    /// Attention over time, conditioned on the utterance's global mean and std, then the
    /// attention-weighted mean and std: `[frames, C]` to `[1, 2C]`.
    fn attentive_statistics_pooling(&self, x: &Tensor) -> Result<Tensor> {
        let frames = x.dim(0)?;
        // The official uniform weights are mask / total = 1 / frames, multiplied in first.
        let uniform = Tensor::full(1.0 / frames as f32, (frames, 1), x.device())?;
        let (mean, std) = weighted_statistics(x, &uniform)?;
        let context = Tensor::cat(
            &[
                x.clone(),
                mean.broadcast_as(x.shape())?.contiguous()?,
                std.broadcast_as(x.shape())?.contiguous()?,
            ],
            D::Minus1,
        )?;
        let scores = self
            .asp_conv
            .forward(&self.asp_tdnn.forward(&context)?.tanh()?)?;
        let attention = candle_nn::ops::softmax(&scores, 0)?;
        let (mean, std) = weighted_statistics(x, &attention)?;
        Ok(Tensor::cat(&[mean, std], D::Minus1)?)
    }
}

fn load_conv(weights: &Weights, conv: &SpeakerConv) -> Result<Conv1d> {
    Conv1d::load(weights, &conv.name, conv.shape(), true, 1, conv.dilation)
}

/// `mean = Σ w x`, `std = sqrt(max(Σ w (x - mean)², 1e-12))` over time; `[1, C]` each.
fn weighted_statistics(x: &Tensor, weights: &Tensor) -> Result<(Tensor, Tensor)> {
    let mean = x.broadcast_mul(weights)?.sum_keepdim(0)?;
    let centered = x.broadcast_sub(&mean)?;
    let variance = centered
        .sqr()?
        .broadcast_mul(weights)?
        .sum_keepdim(0)?
        .clamp(STD_EPS, f64::INFINITY)?;
    Ok((mean, variance.sqrt()?))
}
