//! The Base models' speaker encoder: ECAPA-TDNN without BatchNorm (`Qwen3TTSSpeakerEncoder`,
//! modeling_qwen3_tts.py:95-394, spec §4.6), from log-mel frames to an x-vector of the talker's
//! width. Time-major throughout (`[frames, channels]`). Every convolution is PyTorch's
//! `padding="same"` with `padding_mode="reflect"`.

use anyhow::{Result, ensure};
use candle_core::{D, Tensor};

use super::conv1d::{Conv1d, Padding, pad_rows};
use super::fused::{self, Activation};
use super::mel::SAMPLE_RATE;
use super::weights::Weights;
use crate::checkpoint::Checkpoint;
use crate::config::{ModelType, SpeakerEncoderConfig};

/// Clamp under the variance in attentive statistics pooling (`AttentiveStatisticsPooling.eps`).
const STD_EPS: f64 = 1e-12;

/// Conv + ReLU ("TimeDelayNetBlock") with reflect "same" padding.
struct Tdnn {
    conv: Conv1d,
}

impl Tdnn {
    fn load(w: &Weights, name: &str, [out, inp, kernel, dilation]: [usize; 4]) -> Result<Self> {
        Ok(Self {
            conv: Conv1d::load(
                w,
                &format!("{name}.conv"),
                [out, inp, kernel],
                true,
                1,
                dilation,
            )?,
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
        ensure!(
            checkpoint.config.model_type == ModelType::Base,
            "only Base checkpoints have a speaker encoder (voice cloning)"
        );
        // extract_speaker_embedding asserts 24 kHz; the mel constants assume it.
        let rate = checkpoint.config.speaker_encoder.sample_rate;
        ensure!(
            rate == SAMPLE_RATE,
            "config.json: speaker_encoder_config.sample_rate is {rate}; only {SAMPLE_RATE} is \
             supported (the official mel front end is fixed to it)"
        );
        Self::load(
            &Weights::new(&checkpoint.model, "speaker_encoder."),
            &checkpoint.config.speaker_encoder,
        )
    }

    /// `weights` is `model.safetensors` under `speaker_encoder.`.
    pub(crate) fn load(weights: &Weights, config: &SpeakerEncoderConfig) -> Result<Self> {
        let c = &config.enc_channels;
        let (k, d) = (&config.enc_kernel_sizes, &config.enc_dilations);
        ensure!(
            c.len() >= 3 && k.len() == c.len() && d.len() == c.len(),
            "speaker_encoder_config: enc_channels, enc_kernel_sizes and enc_dilations must have \
             the same length (at least 3), got {}, {} and {}",
            c.len(),
            k.len(),
            d.len()
        );
        let last = c.len() - 1;
        let scale = config.enc_res2net_scale;
        let aggregated: usize = c[1..last].iter().sum();
        ensure!(
            aggregated == c[last],
            "speaker_encoder_config: the multi-layer aggregation takes {aggregated} channels \
             (enc_channels[1..-1]) but enc_channels[-1] is {}",
            c[last]
        );
        let mut blocks = Vec::new();
        for i in 1..last {
            ensure!(
                c[i] == c[i - 1] && c[i].is_multiple_of(scale),
                "speaker_encoder_config: SE-Res2Net block {i} needs enc_channels[{i}] equal to \
                 the previous width and divisible by enc_res2net_scale {scale}"
            );
            let name = format!("blocks.{i}");
            let width = c[i] / scale;
            let res2net = (0..scale - 1)
                .map(|j| {
                    Tdnn::load(
                        weights,
                        &format!("{name}.res2net_block.blocks.{j}"),
                        [width, width, k[i], d[i]],
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            let se = config.enc_se_channels;
            blocks.push(SeRes2NetBlock {
                tdnn1: Tdnn::load(weights, &format!("{name}.tdnn1"), [c[i], c[i - 1], 1, 1])?,
                res2net,
                tdnn2: Tdnn::load(weights, &format!("{name}.tdnn2"), [c[i], c[i], 1, 1])?,
                se_conv1: Conv1d::load(
                    weights,
                    &format!("{name}.se_block.conv1"),
                    [se, c[i], 1],
                    true,
                    1,
                    1,
                )?,
                se_conv2: Conv1d::load(
                    weights,
                    &format!("{name}.se_block.conv2"),
                    [c[i], se, 1],
                    true,
                    1,
                    1,
                )?,
                scale,
            });
        }
        let attention = config.enc_attention_channels;
        Ok(Self {
            block0: Tdnn::load(weights, "blocks.0", [c[0], config.mel_dim, k[0], d[0]])?,
            blocks,
            mfa: Tdnn::load(weights, "mfa", [c[last], c[last], k[last], d[last]])?,
            asp_tdnn: Tdnn::load(weights, "asp.tdnn", [attention, 3 * c[last], 1, 1])?,
            asp_conv: Conv1d::load(weights, "asp.conv", [c[last], attention, 1], true, 1, 1)?,
            fc: Conv1d::load(weights, "fc", [config.enc_dim, 2 * c[last], 1], true, 1, 1)?,
            mel_dim: config.mel_dim,
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
