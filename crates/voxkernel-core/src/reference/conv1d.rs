//! Offline `Conv1d` for the encoders, time-major (`[time, channels]`): the padding is done
//! explicitly (each encoder pads its own way) and the convolution is one matmul over the
//! stacked taps. The codec decoder has its own streaming convolutions (`codec_decoder/conv.rs`).

use anyhow::{Result, ensure};
use candle_core::{Device, Tensor};

use super::fused::{self, Activation};
use super::weights::Weights;

/// How rows are invented beyond the ends of a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Padding {
    Zeros,
    /// `x[-i] = x[i]` (PyTorch "reflect", the edge row not repeated).
    Reflect,
    /// The edge row repeated (PyTorch "replicate").
    Replicate,
}

/// `x` `[time, channels]` with `left` and `right` rows added. Reflect needs `time > max(left,
/// right)`, as in PyTorch.
pub(crate) fn pad_rows(x: &Tensor, left: usize, right: usize, mode: Padding) -> Result<Tensor> {
    if left == 0 && right == 0 {
        return Ok(x.clone());
    }
    let time = x.dim(0)?;
    match mode {
        Padding::Zeros => Ok(x.pad_with_zeros(0, left, right)?),
        Padding::Replicate => Ok(x.pad_with_same(0, left, right)?),
        Padding::Reflect => {
            ensure!(
                time > left.max(right),
                "reflect padding of {left}/{right} rows needs more than {} rows, got {time}",
                left.max(right)
            );
            let index: Vec<u32> = (0..left)
                .map(|i| left - i)
                .chain(0..time)
                .chain((0..right).map(|i| time - 2 - i))
                .map(|i| i as u32)
                .collect();
            let len = index.len();
            let index = Tensor::from_vec(index, len, x.device())?;
            Ok(x.contiguous()?.index_select(&index, 0)?)
        }
    }
}

/// Narrower inputs gather their taps into one matmul: per-tap matmuls of a few columns (the
/// 1-channel waveform conv) are slower than the copy.
const PER_TAP_MIN_CHANNELS: usize = 16;

/// A `Conv1d` applied to already padded input.
pub(crate) struct Conv1d {
    /// `[kernel * in, out]`: row `j * in + i` is tap `j` of input channel `i`.
    weight: Tensor,
    bias: Option<Tensor>,
    kernel: usize,
    stride: usize,
    dilation: usize,
}

impl Conv1d {
    /// From the PyTorch layout: `name.weight` `[out, in, kernel]` and, when `bias`,
    /// `name.bias` `[out]`.
    pub(crate) fn load(
        weights: &Weights,
        name: &str,
        [out, inp, kernel]: [usize; 3],
        bias: bool,
        stride: usize,
        dilation: usize,
    ) -> Result<Self> {
        let weight = weights.tensor(&format!("{name}.weight"), &[out, inp, kernel])?;
        let bias = bias
            .then(|| weights.tensor(&format!("{name}.bias"), &[out]))
            .transpose()?;
        Ok(Self {
            weight: weight
                .permute((2, 1, 0))?
                .contiguous()?
                .reshape((kernel * inp, out))?,
            bias,
            kernel,
            stride,
            dilation,
        })
    }

    /// Rows of padding the kernel spans beyond one step: `(kernel - 1) * dilation`.
    pub(crate) fn span(&self) -> usize {
        (self.kernel - 1) * self.dilation
    }

    pub(crate) fn stride(&self) -> usize {
        self.stride
    }

    /// `[time, in]` (padding included) to `[(time - span - 1) / stride + 1, out]`, as PyTorch's
    /// unpadded `Conv1d`.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_fused(x, None, Activation::None)
    }

    /// [`forward`](Self::forward) plus `residual`, then `activation`, the additions in one
    /// pass ([`fused::sum`]).
    pub(crate) fn forward_fused(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        activation: Activation,
    ) -> Result<Tensor> {
        let time = x.dim(0)?;
        ensure!(
            time > self.span(),
            "conv1d: {time} rows are too few for a kernel spanning {}",
            self.span() + 1
        );
        let steps = (time - self.span() - 1) / self.stride + 1;
        let x = &x.contiguous()?;
        let in_channels = x.dim(1)?;
        let terms = if self.stride == 1 && (self.kernel == 1 || in_channels >= PER_TAP_MIN_CHANNELS)
        {
            // One matmul per tap on a shifted view: no [steps, kernel * in] copy, which at the
            // codec encoder's first stage (144k rows for 6 s) costs more than the arithmetic.
            (0..self.kernel)
                .map(|j| {
                    Ok(x.narrow(0, j * self.dilation, steps)?
                        .matmul(&self.tap_weight(j, in_channels)?)?)
                })
                .collect::<Result<Vec<_>>>()?
        } else if self.kernel == 2 * self.stride
            && self.dilation == 1
            && time == (steps + 1) * self.stride
        {
            // SEANet's strided convs (kernel = 2 * stride, padded to whole strides): output t
            // reads input blocks t and t + 1, two views of one reshape, each a matmul with
            // its half of the taps (no copy of the input).
            let blocks = x.reshape((steps + 1, self.stride * in_channels))?;
            let half = self.stride * in_channels;
            vec![
                blocks
                    .narrow(0, 0, steps)?
                    .matmul(&self.weight.narrow(0, 0, half)?)?,
                blocks
                    .narrow(0, 1, steps)?
                    .matmul(&self.weight.narrow(0, half, half)?)?,
            ]
        } else {
            let taps = (0..self.kernel)
                .map(|j| self.tap(x, j * self.dilation, steps))
                .collect::<Result<Vec<_>>>()?;
            vec![Tensor::cat(&taps, 1)?.matmul(&self.weight)?]
        };
        let terms: Vec<&Tensor> = terms.iter().collect();
        fused::sum(&terms, self.bias.as_ref(), residual, activation)
    }

    /// Tap `j`'s `[in, out]` block of the stacked weight.
    fn tap_weight(&self, j: usize, in_channels: usize) -> Result<Tensor> {
        Ok(self.weight.narrow(0, j * in_channels, in_channels)?)
    }

    /// Rows `offset, offset + stride, ...` (`steps` of them).
    fn tap(&self, x: &Tensor, offset: usize, steps: usize) -> Result<Tensor> {
        if self.stride == 1 {
            return Ok(x.narrow(0, offset, steps)?);
        }
        let index: Vec<u32> = (0..steps)
            .map(|t| (offset + t * self.stride) as u32)
            .collect();
        Ok(x.index_select(&Tensor::from_vec(index, steps, &Device::Cpu)?, 0)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn column(values: &[f32]) -> Tensor {
        Tensor::from_vec(values.to_vec(), (values.len(), 1), &Device::Cpu).unwrap()
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    #[test]
    fn padding_modes_match_pytorch() {
        let x = column(&[1.0, 2.0, 3.0, 4.0]);
        // torch.nn.functional.pad(x, (2, 3), mode=...) on [1, 2, 3, 4]
        let reflect = pad_rows(&x, 2, 3, Padding::Reflect).unwrap();
        assert_eq!(values(&reflect), [3., 2., 1., 2., 3., 4., 3., 2., 1.]);
        let replicate = pad_rows(&x, 2, 1, Padding::Replicate).unwrap();
        assert_eq!(values(&replicate), [1., 1., 1., 2., 3., 4., 4.]);
        let zeros = pad_rows(&x, 1, 2, Padding::Zeros).unwrap();
        assert_eq!(values(&zeros), [0., 1., 2., 3., 4., 0., 0.]);
        assert!(pad_rows(&x, 4, 0, Padding::Reflect).is_err());
    }

    /// Every forward path (per-tap, two-block reshape, gathered taps) against a direct sum.
    #[test]
    fn all_paths_compute_the_pytorch_convolution() {
        let (inp, out, time) = (3, 2, 20);
        let x: Vec<f32> = (0..time * inp)
            .map(|i| ((i * 7) % 11) as f32 - 5.0)
            .collect();
        let xt = Tensor::from_vec(x.clone(), (time, inp), &Device::Cpu).unwrap();
        for (kernel, stride, dilation) in [(3, 1, 2), (1, 1, 1), (4, 2, 1), (3, 2, 1)] {
            let w: Vec<f32> = (0..out * inp * kernel)
                .map(|i| ((i * 5) % 7) as f32 - 3.0)
                .collect();
            let weight = Tensor::from_vec(w.clone(), (out, inp, kernel), &Device::Cpu).unwrap();
            let conv = Conv1d {
                weight: weight
                    .permute((2, 1, 0))
                    .unwrap()
                    .contiguous()
                    .unwrap()
                    .reshape((kernel * inp, out))
                    .unwrap(),
                bias: None,
                kernel,
                stride,
                dilation,
            };
            let y = conv.forward(&xt).unwrap().to_vec2::<f32>().unwrap();
            let steps = (time - (kernel - 1) * dilation - 1) / stride + 1;
            assert_eq!(y.len(), steps);
            for (t, row) in y.iter().enumerate() {
                for (o, &v) in row.iter().enumerate() {
                    let expected: f32 = (0..kernel)
                        .flat_map(|j| (0..inp).map(move |i| (j, i)))
                        .map(|(j, i)| {
                            w[(o * inp + i) * kernel + j] * x[(t * stride + j * dilation) * inp + i]
                        })
                        .sum();
                    assert_eq!(
                        v, expected,
                        "k {kernel} s {stride} d {dilation} t {t} o {o}"
                    );
                }
            }
        }
    }
}
