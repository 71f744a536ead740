//! Mimi's SEANet encoder (transformers `MimiEncoder`) and the causal `MimiConv1d` it is built
//! from: waveform `[samples, 1]` to `[samples / 960, hidden]` (25 Hz as released).

use anyhow::Result;
use candle_core::Tensor;

use crate::encoder_geometry::{CausalPadding, MimiConv, SeanetGeometry};
use crate::reference::conv1d::{Conv1d, Padding, pad_rows};
use crate::reference::fused::{self, Activation};
use crate::reference::weights::Weights;

/// A causal `MimiConv1d`: `(kernel - 1) * dilation + 1 - stride` rows of left padding, and on
/// the right just enough rows to complete the last stride (`_get_extra_padding_for_conv1d`), so
/// `time` rows become `ceil(time / stride)`.
pub(super) struct CausalConv {
    conv: Conv1d,
    padding: Padding,
}

impl CausalConv {
    /// `weights` under `encoder.`.
    pub(super) fn load(weights: &Weights, conv: &MimiConv) -> Result<Self> {
        Ok(Self {
            conv: Conv1d::load(
                weights,
                &format!("{}.conv", conv.name),
                conv.shape(),
                conv.bias,
                conv.stride,
                conv.dilation,
            )?,
            padding: match conv.padding {
                CausalPadding::Zeros => Padding::Zeros,
                CausalPadding::Replicate => Padding::Replicate,
            },
        })
    }

    fn left_padding(&self) -> usize {
        self.padding(0).0
    }

    /// Rows of padding before and after `time` rows.
    fn padding(&self, time: usize) -> (usize, usize) {
        let stride = self.conv.stride();
        let left = self.conv.span() + 1 - stride;
        (left, time.div_ceil(stride) * stride - time)
    }

    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (left, right) = self.padding(x.dim(0)?);
        self.conv.forward(&pad_rows(x, left, right, self.padding)?)
    }

    /// The conv of `ELU(x)`, plus `residual`, then `activation`: SEANet's every conv, its
    /// element-wise neighbours fused into the padding and the sum.
    fn forward_elu(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        activation: Activation,
    ) -> Result<Tensor> {
        let (left, right) = self.padding(x.dim(0)?);
        let input = fused::elu_padded(x, left, right, self.padding)?;
        self.conv.forward_fused(&input, residual, activation)
    }
}

/// ELU, conv (kernel `residual_kernel_size`), ELU, conv 1x1, plus the shortcut.
struct ResnetBlock {
    conv1: CausalConv,
    conv2: CausalConv,
    shortcut: Option<CausalConv>,
}

impl ResnetBlock {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.conv1.forward_elu(x, None, Activation::Elu)?;
        let shortcut = self.shortcut.as_ref().map(|c| c.forward(x)).transpose()?;
        // conv2 is 1x1 (no padding) and h is already ELU'd.
        let residual = shortcut.as_ref().unwrap_or(x);
        self.conv2
            .conv
            .forward_fused(&h, Some(residual), Activation::None)
    }
}

/// One stride of the encoder: residual blocks, then ELU and the strided conv that doubles the
/// channels.
struct Stage {
    blocks: Vec<ResnetBlock>,
    downsample: CausalConv,
}

/// Output frames per chunk of [`Seanet::forward`]: 2 s as released, whose first-stage
/// tensors (~13 MB) stay in cache and in the allocator's heap, where the whole 6 s clip's
/// (37 MB) were mapped and unmapped for every op.
const CHUNK_FRAMES: usize = 50;

pub(super) struct Seanet {
    conv_in: CausalConv,
    stages: Vec<Stage>,
    conv_out: CausalConv,
    /// Input samples per output frame (960 as released).
    hop: usize,
    /// Output frames a chunk recomputes before its own (the causal receptive field), whose
    /// values its zero padding would otherwise change.
    context_frames: usize,
}

impl Seanet {
    /// `weights` under `encoder.`.
    pub(super) fn load(weights: &Weights, geometry: &SeanetGeometry) -> Result<Self> {
        let load = |conv: &MimiConv| CausalConv::load(weights, conv);
        let conv_in = load(&geometry.conv_in)?;
        let stages = geometry
            .stages
            .iter()
            .map(|stage| {
                let blocks = stage
                    .blocks
                    .iter()
                    .map(|block| {
                        Ok(ResnetBlock {
                            conv1: load(&block.conv1)?,
                            conv2: load(&block.conv2)?,
                            shortcut: block.shortcut.as_ref().map(load).transpose()?,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(Stage {
                    blocks,
                    downsample: load(&stage.downsample)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let conv_out = load(&geometry.conv_out)?;
        // How far back (in input samples) an output frame looks: each conv's left padding at
        // its input rate.
        let mut hop = 1;
        let mut reach = conv_in.left_padding();
        for stage in &stages {
            for block in &stage.blocks {
                reach += hop * (block.conv1.left_padding() + block.conv2.left_padding());
            }
            reach += hop * stage.downsample.left_padding();
            hop *= stage.downsample.conv.stride();
        }
        reach += hop * conv_out.left_padding();
        Ok(Self {
            conv_in,
            stages,
            conv_out,
            hop,
            context_frames: reach.div_ceil(hop),
        })
    }

    /// `[samples, 1]` to `[ceil(samples / hop), hidden]`, in chunks of [`CHUNK_FRAMES`] output
    /// frames. Every conv is causal, so a chunk that starts `context_frames` early and drops
    /// those gives the frames of one pass over the whole clip; chunks end on whole frames, so no
    /// conv pads their right end (the last chunk ends where the clip does, as one pass does).
    pub(super) fn forward(&self, samples: &Tensor) -> Result<Tensor> {
        let total = samples.dim(0)?;
        let frames = total.div_ceil(self.hop);
        let mut chunks = Vec::with_capacity(frames.div_ceil(CHUNK_FRAMES));
        let mut first = 0;
        while first < frames {
            let last = (first + CHUNK_FRAMES).min(frames);
            let context = first.min(self.context_frames);
            let start = (first - context) * self.hop;
            let end = (last * self.hop).min(total);
            let out = self.forward_whole(&samples.narrow(0, start, end - start)?)?;
            chunks.push(out.narrow(0, context, last - first)?);
            first = last;
        }
        Ok(Tensor::cat(&chunks, 0)?)
    }

    fn forward_whole(&self, samples: &Tensor) -> Result<Tensor> {
        let mut h = self.conv_in.forward(samples)?;
        for stage in &self.stages {
            for block in &stage.blocks {
                h = block.forward(&h)?;
            }
            h = stage.downsample.forward_elu(&h, None, Activation::None)?;
        }
        self.conv_out.forward_elu(&h, None, Activation::None)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use candle_core::{Device, Tensor};

    use super::*;
    use crate::checkpoint::Checkpoint;
    use crate::encoder_geometry::TokenizerEncoderGeometry;

    /// The tiny clone fixture's SEANet (hop 960, as released) on a clip of 3 chunks and a
    /// partial frame: the chunked pass gives the one-pass frames.
    #[test]
    fn chunks_give_the_one_pass_frames() {
        let dir =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/clone/tiny-base");
        let checkpoint = Checkpoint::open(&dir).unwrap();
        let geometry = TokenizerEncoderGeometry::new(&checkpoint.speech_tokenizer_config).unwrap();
        let weights = Weights::new(&checkpoint.speech_tokenizer, "encoder.");
        let seanet = Seanet::load(&weights, &geometry.seanet).unwrap();
        assert_eq!(seanet.hop, 960);
        assert!(seanet.context_frames >= 1);
        let samples = 2 * CHUNK_FRAMES * 960 + 20 * 960 + 123;
        let clip: Vec<f32> = (0..samples)
            .map(|i| ((i as f32 * 0.013).sin() + (i as f32 * 0.0007).cos()) * 0.3)
            .collect();
        let clip = Tensor::from_vec(clip, (samples, 1), &Device::Cpu).unwrap();
        let chunked = seanet.forward(&clip).unwrap();
        let whole = seanet.forward_whole(&clip).unwrap();
        assert_eq!(chunked.dims(), whole.dims());
        assert_eq!(chunked.dim(0).unwrap(), samples.div_ceil(960));
        // Identical on the development machine (gemm's arithmetic for a row does not depend on
        // the other rows); the bound leaves room for a gemm that blocks rows differently.
        let diff: f32 = (chunked - &whole)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar()
            .unwrap();
        let scale: f32 = whole.abs().unwrap().max_all().unwrap().to_scalar().unwrap();
        assert!(diff <= 1e-6 * scale, "max abs diff {diff} of {scale}");
    }
}
