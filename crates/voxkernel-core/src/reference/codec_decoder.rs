//! The speech tokenizer's decoder (codes to 24 kHz waveform) on the CPU in f32, one-pass and
//! streaming. Mirrors `Qwen3TTSTokenizerV2Decoder` of qwen-tts 0.1.1 (spec §4.2-4.4).
//!
//! Every stage is causal, so the decoder is written once, as a stream: each layer consumes the
//! new time steps plus the state it left behind (conv histories, transposed-conv overlap, a KV
//! window per transformer layer with absolute RoPE positions). A one-pass decode is that stream
//! fed the whole sequence, and any split of the frames computes the same function (equal up to
//! f32 rounding of differently blocked matmuls). See
//! `docs/codec.md` for the design and for how this differs from the official decode beyond
//! 300 frames.

mod conv;
mod transformer;

use std::sync::Arc;

use anyhow::{Result, bail, ensure};
use candle_core::{Device, Module, Tensor};
use candle_nn::Linear;

use self::conv::{CausalConv, CausalTransConv, DepthwiseCausalConv, History, LayerNorm, SnakeBeta};
pub(crate) use self::transformer::rope_tables;
use self::transformer::{PreTransformer, TransformerState};
use super::weights::Weights;
use crate::backend::{Frame, NUM_CODE_GROUPS};
use crate::checkpoint::{Checkpoint, SafetensorsFile};
use crate::config::{CodecDecoderConfig, SpeechTokenizerConfig};

/// Official `chunked_decode` schedule: frames per chunk, and left-context frames re-decoded
/// before every chunk but the first.
pub const OFFICIAL_CHUNK_FRAMES: usize = 300;
pub const OFFICIAL_LEFT_CONTEXT_FRAMES: usize = 25;

/// Frames per internal pass. Bounds memory (the last stage holds 1920 rows per frame) whatever
/// size of push the caller makes; the result does not depend on it beyond f32 rounding.
const FRAMES_PER_PASS: usize = 16;

/// Kernel sizes and residual-unit dilations fixed by the official module definitions.
const PRE_CONV_KERNEL: usize = 3;
const CONV_KERNEL: usize = 7;
const RESIDUAL_DILATIONS: [usize; 3] = [1, 3, 9];
const CONVNEXT_LAYER_NORM_EPS: f64 = 1e-6;
const CLUSTER_USAGE_MIN: f64 = 1e-5;

/// The decoder's weights. Cheap to share: streams hold an `Arc` of it.
pub struct CodecDecoder {
    quantizer: Quantizer,
    pre_conv: CausalConv,
    pre_transformer: PreTransformer,
    upsample: Vec<UpsampleStage>,
    conv_in: CausalConv,
    blocks: Vec<DecoderBlock>,
    final_act: SnakeBeta,
    conv_out: CausalConv,
    samples_per_frame: usize,
    device: Device,
}

/// Residual vector quantizer decode: codebook 0 through `rvq_first`, codebooks 1.. through
/// `rvq_rest`, each summed in its codebook space and then projected.
struct Quantizer {
    /// Per codebook, `embedding_sum / clamp(cluster_usage, 1e-5)`: `[codebook_size, dim]`.
    tables: Vec<Tensor>,
    first_proj: Linear,
    rest_proj: Linear,
    codebook_size: usize,
}

/// Causal `ConvTranspose1d` (kernel == stride) followed by a ConvNeXt block.
struct UpsampleStage {
    upsample: CausalTransConv,
    dwconv: DepthwiseCausalConv,
    norm: LayerNorm,
    pwconv1: Linear,
    pwconv2: Linear,
    gamma: Tensor,
}

struct ResidualUnit {
    act1: SnakeBeta,
    conv1: CausalConv,
    act2: SnakeBeta,
    conv2: CausalConv,
}

/// SnakeBeta, causal `ConvTranspose1d` by `rate`, then residual units with dilations 1, 3, 9.
struct DecoderBlock {
    act: SnakeBeta,
    upsample: CausalTransConv,
    units: Vec<ResidualUnit>,
}

impl CodecDecoder {
    pub fn from_checkpoint(checkpoint: &Checkpoint) -> Result<Self> {
        Self::load(
            &checkpoint.speech_tokenizer_config,
            &checkpoint.speech_tokenizer,
        )
    }

    /// From a speech tokenizer config and its f32 `model.safetensors`.
    pub fn load(config: &SpeechTokenizerConfig, file: &SafetensorsFile) -> Result<Self> {
        let decoder = &config.decoder_config;
        validate(decoder, config.samples_per_frame())?;
        let device = Device::Cpu;
        let weights = Weights::new(file, "decoder.");
        let latent = decoder.latent_dim;
        let conv = |name: &str, out: usize, inp: usize, kernel: usize, dilation: usize| {
            let weight = weights.tensor(&format!("{name}.conv.weight"), &[out, inp, kernel])?;
            CausalConv::new(
                &weight,
                weights.tensor(&format!("{name}.conv.bias"), &[out])?,
                dilation,
            )
        };
        let transposed = |name: &str, inp: usize, out: usize, kernel: usize, stride: usize| {
            let weight = weights.tensor(&format!("{name}.conv.weight"), &[inp, out, kernel])?;
            CausalTransConv::new(
                &weight,
                weights.tensor(&format!("{name}.conv.bias"), &[out])?,
                stride,
            )
        };
        let snake = |name: &str, channels: usize| {
            SnakeBeta::new(
                &weights.tensor(&format!("{name}.alpha"), &[channels])?,
                &weights.tensor(&format!("{name}.beta"), &[channels])?,
            )
        };
        let linear = |name: &str, out: usize, inp: usize| weights.linear(name, inp, out, true);

        let upsample = decoder
            .upsampling_ratios
            .iter()
            .enumerate()
            .map(|(i, &factor)| {
                let stage = format!("upsample.{i}");
                let block = format!("{stage}.1");
                Ok(UpsampleStage {
                    upsample: transposed(&format!("{stage}.0"), latent, latent, factor, factor)?,
                    dwconv: DepthwiseCausalConv::new(
                        &weights.tensor(
                            &format!("{block}.dwconv.conv.weight"),
                            &[latent, 1, CONV_KERNEL],
                        )?,
                        weights.tensor(&format!("{block}.dwconv.conv.bias"), &[latent])?,
                    )?,
                    norm: LayerNorm::new(
                        weights.tensor(&format!("{block}.norm.weight"), &[latent])?,
                        weights.tensor(&format!("{block}.norm.bias"), &[latent])?,
                        CONVNEXT_LAYER_NORM_EPS,
                    ),
                    pwconv1: linear(&format!("{block}.pwconv1"), 4 * latent, latent)?,
                    pwconv2: linear(&format!("{block}.pwconv2"), latent, 4 * latent)?,
                    gamma: weights.tensor(&format!("{block}.gamma"), &[latent])?,
                })
            })
            .collect::<Result<Vec<_>>>()?;

        let blocks = decoder
            .upsample_rates
            .iter()
            .enumerate()
            .map(|(i, &rate)| {
                let (inp, out) = (decoder.decoder_dim >> i, decoder.decoder_dim >> (i + 1));
                let block = format!("decoder.{}.block", i + 1);
                let units = RESIDUAL_DILATIONS
                    .iter()
                    .enumerate()
                    .map(|(u, &dilation)| {
                        let unit = format!("{block}.{}", u + 2);
                        Ok(ResidualUnit {
                            act1: snake(&format!("{unit}.act1"), out)?,
                            conv1: conv(&format!("{unit}.conv1"), out, out, CONV_KERNEL, dilation)?,
                            act2: snake(&format!("{unit}.act2"), out)?,
                            conv2: conv(&format!("{unit}.conv2"), out, out, 1, 1)?,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(DecoderBlock {
                    act: snake(&format!("{block}.0"), inp)?,
                    upsample: transposed(&format!("{block}.1"), inp, out, 2 * rate, rate)?,
                    units,
                })
            })
            .collect::<Result<Vec<_>>>()?;

        let blocks_len = decoder.upsample_rates.len();
        let output_dim = decoder.decoder_dim >> blocks_len;
        Ok(Self {
            quantizer: Quantizer::load(&weights, decoder)?,
            pre_conv: conv("pre_conv", latent, decoder.codebook_dim, PRE_CONV_KERNEL, 1)?,
            pre_transformer: PreTransformer::load(&weights, decoder)?,
            upsample,
            conv_in: conv("decoder.0", decoder.decoder_dim, latent, CONV_KERNEL, 1)?,
            blocks,
            final_act: snake(&format!("decoder.{}", blocks_len + 1), output_dim)?,
            conv_out: conv(
                &format!("decoder.{}", blocks_len + 2),
                1,
                output_dim,
                CONV_KERNEL,
                1,
            )?,
            samples_per_frame: config.samples_per_frame(),
            device,
        })
    }

    /// Output samples per frame (1920 at 24 kHz).
    pub fn samples_per_frame(&self) -> usize {
        self.samples_per_frame
    }

    /// The whole sequence as one causal pass with positions `0..codes.len()`; equal to the
    /// official decode up to 300 frames. Any [`CodecStream`] split of `codes` gives the same.
    pub fn decode(self: &Arc<Self>, codes: &[Frame]) -> Result<Vec<f32>> {
        self.stream()?.push(codes)
    }

    /// The official `Qwen3TTSTokenizerV2Model.decode` schedule (`chunked_decode(300, 25)`):
    /// chunks of 300 frames, each a fresh pass (RoPE restarting at 0) over the chunk plus 25
    /// frames of left context, whose samples are dropped. Identical to [`Self::decode`] up to
    /// 300 frames; beyond, it reproduces the official chunk-boundary approximation.
    pub fn decode_official(self: &Arc<Self>, codes: &[Frame]) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(codes.len() * self.samples_per_frame);
        let mut start = 0;
        while start < codes.len() {
            let end = (start + OFFICIAL_CHUNK_FRAMES).min(codes.len());
            let context = start.min(OFFICIAL_LEFT_CONTEXT_FRAMES);
            let wav = self.decode(&codes[start - context..end])?;
            out.extend_from_slice(&wav[context * self.samples_per_frame..]);
            start = end;
        }
        Ok(out)
    }

    /// A new stream at position 0.
    pub fn stream(self: &Arc<Self>) -> Result<CodecStream> {
        Ok(CodecStream {
            state: self.initial_state()?,
            decoder: Arc::clone(self),
            frames_decoded: 0,
        })
    }

    fn initial_state(&self) -> Result<DecoderState> {
        let device = &self.device;
        let upsample = self
            .upsample
            .iter()
            .map(|stage| {
                Ok([
                    stage.upsample.history(device)?,
                    stage.dwconv.history(device)?,
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        let blocks = self
            .blocks
            .iter()
            .map(|block| {
                let units = block
                    .units
                    .iter()
                    .map(|unit| Ok([unit.conv1.history(device)?, unit.conv2.history(device)?]))
                    .collect::<Result<Vec<_>>>()?;
                Ok(BlockState {
                    upsample: block.upsample.history(device)?,
                    units,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(DecoderState {
            pre_conv: self.pre_conv.history(device)?,
            transformer: self.pre_transformer.initial_state(),
            upsample,
            conv_in: self.conv_in.history(device)?,
            blocks,
            conv_out: self.conv_out.history(device)?,
        })
    }

    /// The samples of `codes`, continuing from `state`.
    fn forward(&self, state: &mut DecoderState, codes: &[Frame]) -> Result<Vec<f32>> {
        let latent = self.quantizer.decode(codes, &self.device)?;
        let latent = self.pre_conv.forward(&mut state.pre_conv, &latent)?;
        let mut hidden = self
            .pre_transformer
            .forward(&mut state.transformer, &latent)?;
        for (stage, [upsample, dwconv]) in self.upsample.iter().zip(&mut state.upsample) {
            hidden = stage.upsample.forward(upsample, &hidden)?;
            hidden = stage.convnext(dwconv, &hidden)?;
        }
        let mut wav = self.conv_in.forward(&mut state.conv_in, &hidden)?;
        for (block, block_state) in self.blocks.iter().zip(&mut state.blocks) {
            wav = block.forward(block_state, &wav)?;
        }
        let wav = self.final_act.forward(&wav)?;
        let wav = self.conv_out.forward(&mut state.conv_out, &wav)?;
        Ok(wav.clamp(-1f32, 1f32)?.flatten_all()?.to_vec1()?)
    }
}

fn validate(config: &CodecDecoderConfig, samples_per_frame: usize) -> Result<()> {
    ensure!(
        config.num_quantizers == NUM_CODE_GROUPS,
        "decoder_config.num_quantizers is {}, but frames carry {NUM_CODE_GROUPS} codebooks",
        config.num_quantizers
    );
    ensure!(
        config.codebook_dim.is_multiple_of(2),
        "decoder_config.codebook_dim must be even (codebooks are codebook_dim / 2 wide), got {}",
        config.codebook_dim
    );
    ensure!(
        config
            .decoder_dim
            .is_multiple_of(1 << config.upsample_rates.len()),
        "decoder_config.decoder_dim {} does not halve {} times",
        config.decoder_dim,
        config.upsample_rates.len()
    );
    let upsampling: usize = config
        .upsample_rates
        .iter()
        .chain(&config.upsampling_ratios)
        .product();
    if upsampling != samples_per_frame {
        bail!(
            "decoder_config upsample_rates {:?} x upsampling_ratios {:?} = {upsampling} samples \
             per frame, but decode_upsample_rate is {samples_per_frame}",
            config.upsample_rates,
            config.upsampling_ratios
        );
    }
    Ok(())
}

impl Quantizer {
    fn load(weights: &Weights, config: &CodecDecoderConfig) -> Result<Self> {
        let (size, dim) = (config.codebook_size, config.codebook_dim / 2);
        // The official decoder builds its quantizer with n_q_semantic = 1 whatever the config
        // says, so codebook 0 alone goes through `rvq_first`.
        let table = |rvq: &str, layer: usize| -> Result<Tensor> {
            let codebook = format!("quantizer.{rvq}.vq.layers.{layer}._codebook");
            let sum = weights.tensor(&format!("{codebook}.embedding_sum"), &[size, dim])?;
            let usage = weights.tensor(&format!("{codebook}.cluster_usage"), &[size])?;
            let usage = usage.clamp(CLUSTER_USAGE_MIN, f64::INFINITY)?;
            Ok(sum.broadcast_div(&usage.unsqueeze(1)?)?)
        };
        let projection = |rvq: &str| -> Result<Linear> {
            let weight = weights.tensor(
                &format!("quantizer.{rvq}.output_proj.weight"),
                &[config.codebook_dim, dim, 1],
            )?;
            Ok(Linear::new(weight.squeeze(2)?, None))
        };
        let mut tables = vec![table("rvq_first", 0)?];
        for layer in 0..NUM_CODE_GROUPS - 1 {
            tables.push(table("rvq_rest", layer)?);
        }
        Ok(Self {
            tables,
            first_proj: projection("rvq_first")?,
            rest_proj: projection("rvq_rest")?,
            codebook_size: size,
        })
    }

    /// `[frames, codebook_dim]`.
    fn decode(&self, codes: &[Frame], device: &Device) -> Result<Tensor> {
        let lookup = |group: usize| -> Result<Tensor> {
            let ids = codes.iter().map(|frame| frame[group]).collect::<Vec<u32>>();
            Ok(self.tables[group].index_select(&Tensor::new(ids, device)?, 0)?)
        };
        let mut rest = lookup(1)?;
        for group in 2..NUM_CODE_GROUPS {
            rest = (rest + lookup(group)?)?;
        }
        let first = self.first_proj.forward(&lookup(0)?)?;
        Ok((first + self.rest_proj.forward(&rest)?)?)
    }

    fn check(&self, codes: &[Frame], first_frame: usize) -> Result<()> {
        for (n, frame) in codes.iter().enumerate() {
            if let Some(group) = frame.iter().position(|&c| c as usize >= self.codebook_size) {
                bail!(
                    "frame {}: codebook {group} has code {}, valid codes are 0..{}",
                    first_frame + n,
                    frame[group],
                    self.codebook_size
                );
            }
        }
        Ok(())
    }
}

impl UpsampleStage {
    fn convnext(&self, dwconv: &mut History, x: &Tensor) -> Result<Tensor> {
        let h = self.dwconv.forward(dwconv, x)?;
        let h = self.norm.forward(&h)?;
        let h = self.pwconv1.forward(&h)?.gelu_erf()?;
        let h = self.pwconv2.forward(&h)?.broadcast_mul(&self.gamma)?;
        Ok((x + h)?)
    }
}

impl DecoderBlock {
    fn forward(&self, state: &mut BlockState, x: &Tensor) -> Result<Tensor> {
        let mut h = self
            .upsample
            .forward(&mut state.upsample, &self.act.forward(x)?)?;
        for (unit, [conv1, conv2]) in self.units.iter().zip(&mut state.units) {
            let r = unit.conv1.forward(conv1, &unit.act1.forward(&h)?)?;
            let r = unit.conv2.forward(conv2, &unit.act2.forward(&r)?)?;
            h = (h + r)?;
        }
        Ok(h)
    }
}

/// Everything a stream carries from one push to the next.
struct DecoderState {
    pre_conv: History,
    transformer: TransformerState,
    /// Per upsample stage: transposed conv, ConvNeXt depthwise conv.
    upsample: Vec<[History; 2]>,
    conv_in: History,
    blocks: Vec<BlockState>,
    conv_out: History,
}

struct BlockState {
    upsample: History,
    /// Per residual unit: its two convs.
    units: Vec<[History; 2]>,
}

/// Incremental decode: the concatenated output of any sequence of pushes equals (up to f32
/// rounding) [`CodecDecoder::decode`] of all the frames pushed since the start or the last reset.
/// It owns an `Arc` of the decoder, so it is `Send + 'static` and can live in a session.
pub struct CodecStream {
    decoder: Arc<CodecDecoder>,
    state: DecoderState,
    frames_decoded: usize,
}

impl CodecStream {
    /// The samples completed by `frames`: exactly `samples_per_frame` per frame.
    pub fn push(&mut self, frames: &[Frame]) -> Result<Vec<f32>> {
        self.decoder.quantizer.check(frames, self.frames_decoded)?;
        let mut out = Vec::with_capacity(frames.len() * self.decoder.samples_per_frame);
        for pass in frames.chunks(FRAMES_PER_PASS) {
            out.extend(self.decoder.forward(&mut self.state, pass)?);
            self.frames_decoded += pass.len();
        }
        Ok(out)
    }

    /// Back to position 0 with empty histories, as a new stream.
    pub fn reset(&mut self) -> Result<()> {
        self.state = self.decoder.initial_state()?;
        self.frames_decoded = 0;
        Ok(())
    }

    /// Frames pushed since the start or the last reset.
    pub fn frames_decoded(&self) -> usize {
        self.frames_decoded
    }
}
