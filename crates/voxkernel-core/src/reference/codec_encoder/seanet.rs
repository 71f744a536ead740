//! Mimi's SEANet encoder (transformers `MimiEncoder`) and the causal `MimiConv1d` it is built
//! from: waveform `[samples, 1]` to `[samples / 960, hidden]` (25 Hz as released).

use anyhow::{Result, bail, ensure};
use candle_core::Tensor;

use crate::config::CodecEncoderConfig;
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
    pub(super) fn load(
        weights: &Weights,
        name: &str,
        shape: [usize; 3],
        bias: bool,
        stride: usize,
        dilation: usize,
        padding: Padding,
    ) -> Result<Self> {
        Ok(Self {
            conv: Conv1d::load(
                weights,
                &format!("{name}.conv"),
                shape,
                bias,
                stride,
                dilation,
            )?,
            padding,
        })
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

pub(super) struct Seanet {
    conv_in: CausalConv,
    stages: Vec<Stage>,
    conv_out: CausalConv,
}

impl Seanet {
    /// `weights` under `encoder.encoder.layers.`; the layer indices follow `MimiEncoder`'s
    /// module list, where every ELU also takes an index.
    pub(super) fn load(weights: &Weights, c: &CodecEncoderConfig) -> Result<Self> {
        if !c.use_causal_conv {
            bail!(
                "speech_tokenizer encoder_config.use_causal_conv is false; only causal is supported"
            );
        }
        let padding = match c.pad_mode.as_str() {
            "constant" => Padding::Zeros,
            "replicate" => Padding::Replicate,
            other => bail!(
                "speech_tokenizer encoder_config.pad_mode {other:?} is not supported (constant, \
                 replicate)"
            ),
        };
        ensure!(
            c.audio_channels == 1,
            "speech_tokenizer encoder_config.audio_channels is {}; only mono is supported",
            c.audio_channels
        );
        let conv = |index: &str, shape, stride, dilation| {
            CausalConv::load(weights, index, shape, true, stride, dilation, padding)
        };
        let mut index = 0;
        let conv_in = conv("0", [c.num_filters, 1, c.kernel_size], 1, 1)?;
        index += 1;
        let mut channels = c.num_filters;
        let mut stages = Vec::new();
        for &ratio in c.upsampling_ratios.iter().rev() {
            let hidden = channels / c.compress;
            let mut blocks = Vec::new();
            for j in 0..c.num_residual_layers {
                let block = format!("{index}.block");
                let dilation = c.dilation_growth_rate.pow(j as u32);
                blocks.push(ResnetBlock {
                    conv1: conv(
                        &format!("{block}.1"),
                        [hidden, channels, c.residual_kernel_size],
                        1,
                        dilation,
                    )?,
                    conv2: conv(&format!("{block}.3"), [channels, hidden, 1], 1, 1)?,
                    shortcut: c
                        .use_conv_shortcut
                        .then(|| conv(&format!("{index}.shortcut"), [channels, channels, 1], 1, 1))
                        .transpose()?,
                });
                index += 1;
            }
            index += 1; // ELU
            let downsample = conv(
                &index.to_string(),
                [2 * channels, channels, 2 * ratio],
                ratio,
                1,
            )?;
            index += 1;
            stages.push(Stage { blocks, downsample });
            channels *= 2;
        }
        index += 1; // ELU
        let conv_out = conv(
            &index.to_string(),
            [c.hidden_size, channels, c.last_kernel_size],
            1,
            1,
        )?;
        Ok(Self {
            conv_in,
            stages,
            conv_out,
        })
    }

    pub(super) fn forward(&self, samples: &Tensor) -> Result<Tensor> {
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
