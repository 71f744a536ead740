//! The convolutional pieces of the codec decoder, time-major (`[time, channels]`) and stateful:
//! each layer takes any number of new time steps plus the [`History`] it left behind last time,
//! so a stream fed chunk by chunk computes exactly what one pass over the whole sequence does.

use anyhow::{Result, ensure};
use candle_core::{D, DType, Device, Tensor};

/// The last input rows a causal layer needs from before the current chunk.
///
/// It starts as zeros, which is exactly the official zero left-padding at the start of a
/// sequence, so the first chunk of a stream and a one-pass decode see the same input.
pub(super) struct History {
    /// `None` for layers that look at no earlier rows (kernel 1, or transposed kernel == stride).
    rows: Option<Tensor>,
}

impl History {
    fn zeros(len: usize, channels: usize, device: &Device) -> Result<Self> {
        let rows = match len {
            0 => None,
            _ => Some(Tensor::zeros((len, channels), DType::F32, device)?),
        };
        Ok(Self { rows })
    }

    /// `[history; x]`, remembering its last rows for the next chunk.
    fn extend(&mut self, x: &Tensor) -> Result<Tensor> {
        let Some(rows) = &self.rows else {
            return Ok(x.clone());
        };
        let keep = rows.dim(0)?;
        let padded = Tensor::cat(&[rows, x], 0)?;
        // A copy, so the history does not pin the whole (possibly large) padded chunk.
        self.rows = Some(padded.narrow(0, padded.dim(0)? - keep, keep)?.copy()?);
        Ok(padded)
    }
}

/// `Conv1d` with `(kernel - 1) * dilation` zeros of left padding (official `CausalConvNet`,
/// stride 1), as one matmul over the stacked taps.
pub(super) struct CausalConv {
    /// `[kernel * in, out]`: row `j * in + i` is tap `j` of input channel `i`.
    weight: Tensor,
    bias: Tensor,
    kernel: usize,
    dilation: usize,
    in_channels: usize,
}

impl CausalConv {
    /// From the PyTorch layout: `weight` `[out, in, kernel]`, `bias` `[out]`.
    pub(super) fn new(weight: &Tensor, bias: Tensor, dilation: usize) -> Result<Self> {
        let (out_channels, in_channels, kernel) = weight.dims3()?;
        let weight = weight
            .permute((2, 1, 0))?
            .contiguous()?
            .reshape((kernel * in_channels, out_channels))?;
        Ok(Self {
            weight,
            bias,
            kernel,
            dilation,
            in_channels,
        })
    }

    pub(super) fn history(&self, device: &Device) -> Result<History> {
        History::zeros((self.kernel - 1) * self.dilation, self.in_channels, device)
    }

    pub(super) fn forward(&self, history: &mut History, x: &Tensor) -> Result<Tensor> {
        let steps = x.dim(0)?;
        let padded = history.extend(x)?;
        let columns = match self.kernel {
            1 => padded,
            _ => {
                let taps = (0..self.kernel)
                    .map(|j| padded.narrow(0, j * self.dilation, steps))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Tensor::cat(&taps, 1)?
            }
        };
        Ok(columns.matmul(&self.weight)?.broadcast_add(&self.bias)?)
    }
}

/// Depthwise (`groups == channels`) causal `Conv1d`, dilation 1, as in the ConvNeXt block.
pub(super) struct DepthwiseCausalConv {
    /// One `[channels]` vector per tap, oldest first.
    taps: Vec<Tensor>,
    bias: Tensor,
}

impl DepthwiseCausalConv {
    /// From the PyTorch layout: `weight` `[channels, 1, kernel]`, `bias` `[channels]`.
    pub(super) fn new(weight: &Tensor, bias: Tensor) -> Result<Self> {
        let (_, group_width, kernel) = weight.dims3()?;
        ensure!(
            group_width == 1,
            "depthwise conv weight must be [channels, 1, kernel], got {:?}",
            weight.dims()
        );
        let taps = (0..kernel)
            .map(|j| weight.narrow(2, j, 1)?.flatten_all())
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self { taps, bias })
    }

    pub(super) fn history(&self, device: &Device) -> Result<History> {
        History::zeros(self.taps.len() - 1, self.bias.dim(0)?, device)
    }

    pub(super) fn forward(&self, history: &mut History, x: &Tensor) -> Result<Tensor> {
        let steps = x.dim(0)?;
        let padded = history.extend(x)?;
        let mut acc = self.bias.broadcast_as(x.shape())?.contiguous()?;
        for (j, tap) in self.taps.iter().enumerate() {
            acc = (acc + padded.narrow(0, j, steps)?.broadcast_mul(tap)?)?;
        }
        Ok(acc)
    }
}

/// `ConvTranspose1d` with `kernel = m * stride`, its output trimmed by `kernel - stride` on the
/// right only (official `CausalTransConvNet`). Output block `t` (`stride` rows) depends on inputs
/// `t - m + 1 ..= t`, so it is causal with an `m - 1` row history.
pub(super) struct CausalTransConv {
    /// `[m * in, stride * out]`: row `i * in + c` multiplies input `t - i`, column `p * out + o`
    /// is output row `t * stride + p`, channel `o`.
    weight: Tensor,
    bias: Tensor,
    overlap: usize,
    stride: usize,
    in_channels: usize,
    out_channels: usize,
}

impl CausalTransConv {
    /// From the PyTorch layout: `weight` `[in, out, kernel]`, `bias` `[out]`.
    pub(super) fn new(weight: &Tensor, bias: Tensor, stride: usize) -> Result<Self> {
        let (in_channels, out_channels, kernel) = weight.dims3()?;
        ensure!(
            stride > 0 && kernel.is_multiple_of(stride),
            "transposed conv kernel {kernel} is not a multiple of its stride {stride}"
        );
        let overlap = kernel / stride;
        // Tap k = i * stride + p of the kernel maps input t - i to output row t * stride + p.
        let weight = weight
            .reshape((in_channels, out_channels, overlap, stride))?
            .permute((2, 0, 3, 1))?
            .contiguous()?
            .reshape((overlap * in_channels, stride * out_channels))?;
        Ok(Self {
            weight,
            bias,
            overlap,
            stride,
            in_channels,
            out_channels,
        })
    }

    pub(super) fn history(&self, device: &Device) -> Result<History> {
        History::zeros(self.overlap - 1, self.in_channels, device)
    }

    pub(super) fn forward(&self, history: &mut History, x: &Tensor) -> Result<Tensor> {
        let steps = x.dim(0)?;
        let padded = history.extend(x)?;
        let columns = match self.overlap {
            1 => padded,
            m => {
                let taps = (0..m)
                    .map(|i| padded.narrow(0, m - 1 - i, steps))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Tensor::cat(&taps, 1)?
            }
        };
        Ok(columns
            .matmul(&self.weight)?
            .reshape((steps * self.stride, self.out_channels))?
            .broadcast_add(&self.bias)?)
    }
}

/// `x + 1 / (exp(beta) + 1e-9) * sin(x * exp(alpha))^2`, per channel.
pub(super) struct SnakeBeta {
    frequency: Tensor,
    inverse_magnitude: Tensor,
}

impl SnakeBeta {
    pub(super) fn new(alpha: &Tensor, beta: &Tensor) -> Result<Self> {
        Ok(Self {
            frequency: alpha.exp()?,
            inverse_magnitude: (beta.exp()? + 1e-9)?.recip()?,
        })
    }

    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let wave = x.broadcast_mul(&self.frequency)?.sin()?.sqr()?;
        Ok((x + wave.broadcast_mul(&self.inverse_magnitude)?)?)
    }
}

/// `nn.LayerNorm` over the last dimension, two-pass (mean, then centred variance) like PyTorch,
/// which keeps its precision when the mean is large next to the spread.
pub(super) struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    pub(super) fn new(weight: Tensor, bias: Tensor, eps: f64) -> Self {
        Self { weight, bias, eps }
    }

    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let centred = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
        let variance = centred.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = centred.broadcast_div(&(variance + self.eps)?.sqrt()?)?;
        Ok(normed
            .broadcast_mul(&self.weight)?
            .broadcast_add(&self.bias)?)
    }
}

#[cfg(test)]
mod tests {
    //! Each stateful layer fed in pieces against a direct loop over the PyTorch definition of
    //! the whole (zero-padded, un-chunked) operation.

    use std::f32::consts::SQRT_2;

    use super::*;

    /// Deterministic values in [-1, 1).
    fn pseudo_random(len: usize, seed: u64) -> Vec<f32> {
        let mut state = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn tensor(data: &[f32], shape: &[usize]) -> Tensor {
        Tensor::from_vec(data.to_vec(), shape, &Device::Cpu).unwrap()
    }

    /// Feeds `x` (`[steps, channels]`) in pieces of the given sizes, cycling through them.
    fn run_in_pieces(
        x: &Tensor,
        sizes: &[usize],
        mut step: impl FnMut(&Tensor) -> Result<Tensor>,
    ) -> Vec<f32> {
        let steps = x.dim(0).unwrap();
        let (mut start, mut out) = (0, Vec::new());
        for &size in sizes.iter().cycle() {
            if start >= steps {
                break;
            }
            let len = size.min(steps - start);
            let y = step(&x.narrow(0, start, len).unwrap()).unwrap();
            out.extend(y.flatten_all().unwrap().to_vec1::<f32>().unwrap());
            start += len;
        }
        out
    }

    fn assert_close(actual: &[f32], expected: &[f32]) {
        assert_eq!(actual.len(), expected.len());
        for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
            assert!((a - e).abs() <= 1e-5, "element {i}: {a} vs {e}");
        }
    }

    const PIECES: [&[usize]; 4] = [&[1], &[2, 3], &[5, 1, 4], &[64]];

    #[test]
    fn causal_conv_in_pieces_equals_zero_padded_conv1d() {
        let (steps, cin, cout, kernel, dilation) = (23, 3, 4, 7, 3);
        let x = pseudo_random(steps * cin, 1);
        let w = pseudo_random(cout * cin * kernel, 2);
        let b = pseudo_random(cout, 3);
        let mut expected = vec![0.0; steps * cout];
        for t in 0..steps {
            for o in 0..cout {
                let mut acc = b[o];
                for j in 0..kernel {
                    // Tap j reads the padded input at t + j*d, i.e. x[t - (kernel-1-j)*d].
                    let Some(src) = (t + j * dilation).checked_sub((kernel - 1) * dilation) else {
                        continue;
                    };
                    for i in 0..cin {
                        acc += w[(o * cin + i) * kernel + j] * x[src * cin + i];
                    }
                }
                expected[t * cout + o] = acc;
            }
        }
        let conv = CausalConv::new(
            &tensor(&w, &[cout, cin, kernel]),
            tensor(&b, &[cout]),
            dilation,
        )
        .unwrap();
        let x = tensor(&x, &[steps, cin]);
        for sizes in PIECES {
            let mut history = conv.history(&Device::Cpu).unwrap();
            let actual = run_in_pieces(&x, sizes, |piece| conv.forward(&mut history, piece));
            assert_close(&actual, &expected);
        }
    }

    #[test]
    fn depthwise_conv_in_pieces_equals_zero_padded_grouped_conv1d() {
        let (steps, channels, kernel) = (19, 5, 7);
        let x = pseudo_random(steps * channels, 4);
        let w = pseudo_random(channels * kernel, 5);
        let b = pseudo_random(channels, 6);
        let mut expected = vec![0.0; steps * channels];
        for t in 0..steps {
            for c in 0..channels {
                let mut acc = b[c];
                for j in 0..kernel {
                    if let Some(src) = (t + j).checked_sub(kernel - 1) {
                        acc += w[c * kernel + j] * x[src * channels + c];
                    }
                }
                expected[t * channels + c] = acc;
            }
        }
        let conv =
            DepthwiseCausalConv::new(&tensor(&w, &[channels, 1, kernel]), tensor(&b, &[channels]))
                .unwrap();
        let x = tensor(&x, &[steps, channels]);
        for sizes in PIECES {
            let mut history = conv.history(&Device::Cpu).unwrap();
            let actual = run_in_pieces(&x, sizes, |piece| conv.forward(&mut history, piece));
            assert_close(&actual, &expected);
        }
    }

    /// Full `ConvTranspose1d` output, then the right-only trim of `kernel - stride` samples.
    fn transposed_reference(
        x: &[f32],
        w: &[f32],
        b: &[f32],
        (steps, cin, cout, kernel, stride): (usize, usize, usize, usize, usize),
    ) -> Vec<f32> {
        let full_len = (steps - 1) * stride + kernel;
        let mut full = vec![0.0; full_len * cout];
        for t in 0..steps {
            for k in 0..kernel {
                for o in 0..cout {
                    for i in 0..cin {
                        full[(t * stride + k) * cout + o] +=
                            x[t * cin + i] * w[(i * cout + o) * kernel + k];
                    }
                }
            }
        }
        for (n, value) in full.iter_mut().enumerate() {
            *value += b[n % cout];
        }
        full.truncate((full_len - (kernel - stride)) * cout);
        full
    }

    #[test]
    fn transposed_conv_in_pieces_equals_right_trimmed_conv_transpose1d() {
        // (kernel, stride): the decoder blocks use 2*rate/rate, the upsampler kernel == stride.
        for (kernel, stride) in [(16, 8), (6, 3), (2, 2), (9, 3)] {
            let (steps, cin, cout) = (13, 4, 3);
            let x = pseudo_random(steps * cin, 7);
            let w = pseudo_random(cin * cout * kernel, 8);
            let b = pseudo_random(cout, 9);
            let expected = transposed_reference(&x, &w, &b, (steps, cin, cout, kernel, stride));
            assert_eq!(expected.len(), steps * stride * cout);
            let conv = CausalTransConv::new(
                &tensor(&w, &[cin, cout, kernel]),
                tensor(&b, &[cout]),
                stride,
            )
            .unwrap();
            let x = tensor(&x, &[steps, cin]);
            for sizes in PIECES {
                let mut history = conv.history(&Device::Cpu).unwrap();
                let actual = run_in_pieces(&x, sizes, |piece| conv.forward(&mut history, piece));
                assert_close(&actual, &expected);
            }
        }
    }

    #[test]
    fn transposed_conv_rejects_kernel_not_multiple_of_stride() {
        let w = Tensor::zeros((2, 2, 5), DType::F32, &Device::Cpu).unwrap();
        let b = Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
        assert!(CausalTransConv::new(&w, b, 2).is_err());
    }

    #[test]
    fn snake_beta_matches_its_formula() {
        let x = [0.3f32, -1.2, 2.5, 0.0];
        let alpha = [0.2f32, -0.4];
        let beta = [-0.1f32, 0.5];
        let snake = SnakeBeta::new(&tensor(&alpha, &[2]), &tensor(&beta, &[2])).unwrap();
        let actual = snake.forward(&tensor(&x, &[2, 2])).unwrap();
        let expected: Vec<f32> = x
            .iter()
            .enumerate()
            .map(|(n, &v)| {
                let c = n % 2;
                v + (v * alpha[c].exp()).sin().powi(2) / (beta[c].exp() + 1e-9)
            })
            .collect();
        assert_close(&actual.flatten_all().unwrap().to_vec1().unwrap(), &expected);
    }

    #[test]
    fn layer_norm_keeps_precision_with_a_large_mean() {
        // Variance as E[x^2] - E[x]^2 loses everything here in f32; the centred form does not.
        let x = [1000.0f32, 1000.001, 999.999, 1000.0];
        let norm = LayerNorm::new(tensor(&[1.0; 4], &[4]), tensor(&[0.0; 4], &[4]), 1e-12);
        let y: Vec<f32> = norm
            .forward(&tensor(&x, &[1, 4]))
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let expected = [0.0, SQRT_2, -SQRT_2, 0.0];
        for (a, e) in y.iter().zip(expected) {
            assert!((a - e).abs() < 0.05, "{y:?}");
        }
    }
}
