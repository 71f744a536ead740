//! Fused element-wise passes for the clone encoders, on contiguous f32 CPU tensors.
//!
//! candle runs each element-wise op as its own pass over memory and, from 64k elements up,
//! splits it over its spinning worker pool. The encoders' tensors are large (SEANet's first
//! stage is 144k x 64 for a 6 s clip) and their ops many (an 8-layer transformer, a 4-stage
//! SEANet), so that costs more than the matmuls: on a busy 2-core machine a split op waits
//! milliseconds for a descheduled worker. These functions do several ops in one pass on the
//! calling thread, leaving the matmuls (gemm) to candle.

use anyhow::{Result, bail, ensure};
use candle_core::{CpuStorage, Device, Storage, Tensor};

use super::conv1d::Padding;

/// Runs `f` on the values of `x` (made contiguous first), row-major.
fn with_values<R>(x: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
    with_all_values(&[x], |values| f(values[0]))
}

/// Like [`with_values`] for several tensors at once.
fn with_all_values<R>(xs: &[&Tensor], f: impl FnOnce(&[&[f32]]) -> Result<R>) -> Result<R> {
    let xs = xs
        .iter()
        .map(|x| x.contiguous())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let guards: Vec<_> = xs.iter().map(Tensor::storage_and_layout).collect();
    let mut values = Vec::with_capacity(xs.len());
    for (x, (storage, layout)) in xs.iter().zip(&guards) {
        let Storage::Cpu(CpuStorage::F32(data)) = &**storage else {
            bail!("fused ops take f32 tensors on the CPU, got {:?}", x.dtype());
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("fused ops take contiguous tensors");
        };
        values.push(&data[start..end]);
    }
    f(&values)
}

fn rows_cols(x: &Tensor) -> Result<(usize, usize)> {
    Ok(x.dims2()?)
}

/// ELU (alpha 1): `x` for `x > 0`, else `exp(x) - 1`, with [`exp_nonpositive`].
fn elu(x: f32) -> f32 {
    let negative = exp_nonpositive(x.min(0.0)) - 1.0;
    if x > 0.0 { x } else { negative }
}

/// `exp(x)` for `x <= 0` within about 1 ulp (Cephes' `expf`: `x = n ln 2 + r`, a degree-6
/// polynomial for `exp(r)`, times `2^n`), written without branches or libm calls so the
/// compiler vectorises the loops that use it. Below -87 it returns `exp(-87)`, which is lost
/// when the caller subtracts 1.
fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts, so that `n * LN2_HI` is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds to an integer, held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let x = x.max(-87.0);
    let shifted = x * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let exp_r = p * r * r + r + 1.0;
    let exponent = (shifted.to_bits() as i32 - ROUND.to_bits() as i32 + 127) as u32;
    exp_r * f32::from_bits(exponent << 23)
}

/// ELU of `x` `[time, channels]` with `left` rows before and `right` after, invented as
/// `padding` says: the input of a SEANet conv in one pass (ELU commutes with zero and edge
/// padding, ELU(0) being 0).
pub(crate) fn elu_padded(
    x: &Tensor,
    left: usize,
    right: usize,
    padding: Padding,
) -> Result<Tensor> {
    let (time, channels) = rows_cols(x)?;
    ensure!(time > 0, "elu_padded: no rows");
    let rows = left + time + right;
    let out = with_values(x, |values| {
        let mut out = vec![0.0f32; rows * channels];
        for (r, dst) in out.chunks_exact_mut(channels).enumerate() {
            let source = match padding {
                Padding::Zeros => (left..left + time).contains(&r).then(|| r - left),
                Padding::Replicate => Some(r.saturating_sub(left).min(time - 1)),
                Padding::Reflect => bail!("elu_padded: reflect padding is not supported"),
            };
            if let Some(source) = source {
                let src = &values[source * channels..][..channels];
                for (o, &v) in dst.iter_mut().zip(src) {
                    *o = elu(v);
                }
            }
        }
        Ok(out)
    })?;
    Ok(Tensor::from_vec(out, (rows, channels), &Device::Cpu)?)
}

/// What happens to a sum last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Activation {
    None,
    Relu,
    Elu,
}

/// `((terms[0] + terms[1] + ...) + bias) + residual`, then `activation`, all `[rows, cols]`
/// with the bias per column: a convolution's per-tap products, its bias and a residual in one
/// pass, added in the order a chain of candle ops adds them.
pub(crate) fn sum(
    terms: &[&Tensor],
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
    activation: Activation,
) -> Result<Tensor> {
    let Some(first) = terms.first() else {
        bail!("fused sum of no terms");
    };
    let (rows, cols) = rows_cols(first)?;
    for term in terms.iter().chain(&residual) {
        ensure!(
            term.dims() == [rows, cols],
            "fused sum: a term of shape {:?} among [{rows}, {cols}]",
            term.dims()
        );
    }
    let bias = bias.map(|b| b.to_vec1::<f32>()).transpose()?;
    if let Some(b) = &bias {
        ensure!(
            b.len() == cols,
            "fused sum: bias of {} for {cols} columns",
            b.len()
        );
    }
    let inputs: Vec<&Tensor> = terms.iter().copied().chain(residual).collect();
    let out = with_all_values(&inputs, |values| {
        let (terms, residual) = values.split_at(terms.len());
        let mut out = terms[0].to_vec();
        for term in &terms[1..] {
            for (o, &v) in out.iter_mut().zip(*term) {
                *o += v;
            }
        }
        if let Some(bias) = &bias {
            for row in out.chunks_exact_mut(cols) {
                for (o, &b) in row.iter_mut().zip(bias) {
                    *o += b;
                }
            }
        }
        if let Some(residual) = residual.first() {
            for (o, &r) in out.iter_mut().zip(*residual) {
                *o += r;
            }
        }
        match activation {
            Activation::None => {}
            Activation::Relu => out.iter_mut().for_each(|o| *o = o.max(0.0)),
            Activation::Elu => out.iter_mut().for_each(|o| *o = elu(*o)),
        }
        Ok(out)
    })?;
    Ok(Tensor::from_vec(out, (rows, cols), &Device::Cpu)?)
}

/// `x + update * scale`, `scale` per column: a transformer's layer-scaled residual add.
pub(crate) fn scaled_residual(x: &Tensor, update: &Tensor, scale: &Tensor) -> Result<Tensor> {
    let (rows, cols) = rows_cols(x)?;
    ensure!(
        update.dims() == [rows, cols],
        "scaled residual: shapes differ"
    );
    let scale = scale.to_vec1::<f32>()?;
    ensure!(
        scale.len() == cols,
        "scaled residual: scale of {}",
        scale.len()
    );
    let out = with_all_values(&[x, update], |v| {
        let mut out = Vec::with_capacity(rows * cols);
        for (x_row, u_row) in v[0].chunks_exact(cols).zip(v[1].chunks_exact(cols)) {
            out.extend(
                x_row
                    .iter()
                    .zip(u_row)
                    .zip(&scale)
                    .map(|((&x, &u), &s)| x + u * s),
            );
        }
        Ok(out)
    })?;
    Ok(Tensor::from_vec(out, (rows, cols), &Device::Cpu)?)
}

/// `[steps, heads * head_dim]` to `[heads, steps, head_dim]`, with rotary embedding
/// `x * cos + rotate_half(x) * sin` when `rope` holds the `[steps, head_dim]` tables.
pub(crate) fn heads_first(
    x: &Tensor,
    heads: usize,
    rope: Option<(&[f32], &[f32])>,
) -> Result<Tensor> {
    let (steps, width) = rows_cols(x)?;
    ensure!(
        width.is_multiple_of(heads),
        "heads_first: {width} columns for {heads} heads"
    );
    let dim = width / heads;
    let half = dim / 2;
    if let Some((cos, sin)) = rope {
        ensure!(
            dim.is_multiple_of(2) && cos.len() == steps * dim && sin.len() == steps * dim,
            "heads_first: rope tables for {steps} x {dim}"
        );
    }
    let out = with_values(x, |values| {
        let mut out = vec![0.0f32; steps * width];
        for t in 0..steps {
            for h in 0..heads {
                let src = &values[t * width + h * dim..][..dim];
                let dst = &mut out[(h * steps + t) * dim..][..dim];
                match rope {
                    None => dst.copy_from_slice(src),
                    Some((cos, sin)) => {
                        let (cos, sin) = (&cos[t * dim..][..dim], &sin[t * dim..][..dim]);
                        for i in 0..dim {
                            let rotated = if i < half {
                                -src[i + half]
                            } else {
                                src[i - half]
                            };
                            dst[i] = src[i] * cos[i] + rotated * sin[i];
                        }
                    }
                }
            }
        }
        Ok(out)
    })?;
    Ok(Tensor::from_vec(out, (heads, steps, dim), &Device::Cpu)?)
}

/// Causal softmax of `scores * scale` over the last axis of `[heads, steps, steps]`: query `q`
/// sees keys `0..=q` (the rest get probability 0, as an additive -inf mask gives). Each row is
/// `exp(s - max) / sum`, as candle's softmax computes it.
pub(crate) fn causal_softmax(scores: &Tensor, scale: f32) -> Result<Tensor> {
    let (heads, steps, keys) = scores.dims3()?;
    ensure!(steps == keys, "causal softmax of {steps} x {keys} scores");
    let out = with_values(scores, |values| {
        let mut out = vec![0.0f32; heads * steps * steps];
        for (row_index, (src, dst)) in values
            .chunks_exact(steps)
            .zip(out.chunks_exact_mut(steps))
            .enumerate()
        {
            let seen = row_index % steps + 1;
            let src = &src[..seen];
            let dst = &mut dst[..seen];
            let max = src
                .iter()
                .map(|&s| s * scale)
                .fold(f32::NEG_INFINITY, f32::max);
            let mut total = 0.0f32;
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = (s * scale - max).exp();
                total += *d;
            }
            for d in dst.iter_mut() {
                *d /= total;
            }
        }
        Ok(out)
    })?;
    Ok(Tensor::from_vec(out, (heads, steps, steps), &Device::Cpu)?)
}

/// Per row of squared distances `[rows, cols]` (which rounding may leave below 0), the index
/// of the nearest column as `torch.cdist` then `argmin` picks it: the smallest
/// `sqrt(max(d, 0))`, the first on ties (the square root can merge nearby values).
pub(crate) fn row_argmin_distance(squared: &Tensor) -> Result<Vec<u32>> {
    let (_, cols) = rows_cols(squared)?;
    with_values(squared, |values| {
        Ok(values
            .chunks_exact(cols)
            .map(|row| {
                let mut best = (0, f32::INFINITY);
                for (i, &d) in row.iter().enumerate() {
                    let distance = d.max(0.0).sqrt();
                    if distance < best.1 {
                        best = (i, distance);
                    }
                }
                best.0 as u32
            })
            .collect())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(values: &[f32], shape: (usize, usize)) -> Tensor {
        Tensor::from_vec(values.to_vec(), shape, &Device::Cpu).unwrap()
    }

    #[test]
    fn the_polynomial_exp_is_within_two_ulp_of_libm() {
        let mut worst = 0u32;
        let mut x = -90.0f32;
        while x <= 0.0 {
            let ours = exp_nonpositive(x);
            let libm = x.max(-87.0).exp();
            worst = worst.max(ours.to_bits().abs_diff(libm.to_bits()));
            x += 1e-3;
        }
        assert!(worst <= 2, "{worst} ulp");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(elu(-200.0), -1.0);
        assert_eq!(elu(2.5), 2.5);
    }

    #[test]
    fn fused_passes_equal_the_candle_ops() {
        let x = tensor(&[-1.5, 0.25, 3.0, -0.01, 0.0, -7.0], (3, 2));
        let max_diff = |a: Tensor, b: Tensor| -> f32 {
            (a - b)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar()
                .unwrap()
        };
        let elu_x = x.elu(1.0).unwrap();
        for padding in [Padding::Zeros, Padding::Replicate] {
            let ours = elu_padded(&x, 2, 1, padding).unwrap();
            let expected = super::super::conv1d::pad_rows(&elu_x, 2, 1, padding).unwrap();
            assert!(max_diff(ours, expected) < 1e-7, "{padding:?}");
        }

        let y = tensor(&[1.0, -2.0, 0.5, 4.0, -3.0, 1.0], (3, 2));
        let z = tensor(&[0.5, 0.5, -4.0, 0.25, 1.0, -1.0], (3, 2));
        let bias = Tensor::from_vec(vec![0.5f32, -10.0], 2, &Device::Cpu).unwrap();
        let chained = (&x + &y).unwrap().broadcast_add(&bias).unwrap();
        let chained = (&z + chained).unwrap();
        let summed = sum(&[&x, &y], Some(&bias), Some(&z), Activation::None).unwrap();
        assert_eq!(
            summed.to_vec2::<f32>().unwrap(),
            chained.to_vec2::<f32>().unwrap()
        );
        let relu = sum(&[&x, &y], Some(&bias), Some(&z), Activation::Relu).unwrap();
        assert_eq!(
            relu.to_vec2::<f32>().unwrap(),
            chained.relu().unwrap().to_vec2::<f32>().unwrap()
        );
        let elu = sum(&[&x, &y], Some(&bias), Some(&z), Activation::Elu).unwrap();
        assert!(max_diff(elu, chained.elu(1.0).unwrap()) < 1e-6);

        let scaled = scaled_residual(&x, &y, &bias).unwrap();
        let expected = (&x + y.broadcast_mul(&bias).unwrap()).unwrap();
        assert_eq!(
            scaled.to_vec2::<f32>().unwrap(),
            expected.to_vec2::<f32>().unwrap()
        );
    }

    #[test]
    fn heads_and_causal_softmax_match_the_plain_ops() {
        let (steps, heads, dim) = (3, 2, 4);
        let values: Vec<f32> = (0..steps * heads * dim)
            .map(|i| i as f32 * 0.1 - 1.0)
            .collect();
        let x = tensor(&values, (steps, heads * dim));
        let cos: Vec<f32> = (0..steps * dim).map(|i| (i as f32 * 0.3).cos()).collect();
        let sin: Vec<f32> = (0..steps * dim).map(|i| (i as f32 * 0.3).sin()).collect();
        let ours = heads_first(&x, heads, Some((&cos, &sin))).unwrap();
        let x3 = x.reshape((steps, heads, dim)).unwrap();
        let half = dim / 2;
        let rotated = Tensor::cat(
            &[
                &x3.narrow(2, half, half).unwrap().neg().unwrap(),
                &x3.narrow(2, 0, half).unwrap(),
            ],
            2,
        )
        .unwrap();
        let cos_t = Tensor::from_vec(cos.clone(), (steps, 1, dim), &Device::Cpu).unwrap();
        let sin_t = Tensor::from_vec(sin.clone(), (steps, 1, dim), &Device::Cpu).unwrap();
        let expected = (x3.broadcast_mul(&cos_t).unwrap() + rotated.broadcast_mul(&sin_t).unwrap())
            .unwrap()
            .transpose(0, 1)
            .unwrap();
        let diff = (ours.clone() - expected)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap();
        assert!(diff.to_scalar::<f32>().unwrap() < 1e-6);

        let scores = ours.matmul(&ours.t().unwrap()).unwrap();
        let probs = causal_softmax(&scores, 0.5).unwrap();
        let mask: Vec<f32> = (0..steps)
            .flat_map(|q| (0..steps).map(move |k| if k <= q { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        let mask = tensor(&mask, (steps, steps));
        let expected = candle_nn::ops::softmax(
            &(scores * 0.5).unwrap().broadcast_add(&mask).unwrap(),
            candle_core::D::Minus1,
        )
        .unwrap();
        let diff = (probs - expected)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap();
        assert!(diff.to_scalar::<f32>().unwrap() < 1e-6);
    }
}
