//! The codec decoder's `pre_transformer` at 12.5 Hz: pre-norm layers with RoPE attention over a
//! causal sliding window and SwiGLU, each output scaled per channel before its residual add.
//! Keys and values of the last `sliding_window - 1` frames are kept per layer, so a stream sees
//! exactly the keys a one-pass decode's window mask lets through.

use anyhow::{Result, ensure};
use candle_core::{Device, Module, Tensor};
use candle_nn::Linear;

use crate::config::CodecDecoderConfig;
use crate::reference::weights::Weights;

struct Layer {
    input_norm: Tensor,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    attn_scale: Tensor,
    post_attention_norm: Tensor,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    mlp_scale: Tensor,
}

pub(super) struct PreTransformer {
    input_proj: Linear,
    layers: Vec<Layer>,
    norm: Tensor,
    output_proj: Linear,
    rms_norm_eps: f32,
    heads: usize,
    head_dim: usize,
    sliding_window: usize,
    /// RoPE frequencies computed in f32 the way the official rotary embedding does.
    inverse_frequencies: Vec<f32>,
}

/// Post-RoPE keys and values of the most recent frames, `[rows, heads * head_dim]`.
struct KvWindow {
    keys: Option<Tensor>,
    values: Option<Tensor>,
}

/// Per-stream transformer state: a KV window per layer and the next absolute position.
pub(super) struct TransformerState {
    windows: Vec<KvWindow>,
    next_position: usize,
}

impl PreTransformer {
    pub(super) fn load(weights: &Weights, config: &CodecDecoderConfig) -> Result<Self> {
        let (latent, hidden, inter) = (
            config.latent_dim,
            config.hidden_size,
            config.intermediate_size,
        );
        let (heads, head_dim) = (config.num_attention_heads, config.head_dim);
        ensure!(
            config.num_key_value_heads == heads,
            "decoder_config.num_key_value_heads is {} but only {heads} (= num_attention_heads, \
             full multi-head attention as released) is supported",
            config.num_key_value_heads
        );
        ensure!(
            head_dim.is_multiple_of(2),
            "decoder_config.head_dim must be even for RoPE, got {head_dim}"
        );
        ensure!(
            config.sliding_window > 0,
            "decoder_config.sliding_window must be at least 1"
        );
        let width = heads * head_dim;
        let weights = weights.sub("pre_transformer");
        let linear = |name: &str, out: usize, inp: usize, bias: bool| -> Result<Linear> {
            weights.linear(name, inp, out, bias)
        };
        let vector = |name: &str| weights.tensor(name, &[hidden]);
        let layers = (0..config.num_hidden_layers)
            .map(|i| {
                let l = format!("layers.{i}");
                Ok(Layer {
                    input_norm: vector(&format!("{l}.input_layernorm.weight"))?,
                    q_proj: linear(&format!("{l}.self_attn.q_proj"), width, hidden, false)?,
                    k_proj: linear(&format!("{l}.self_attn.k_proj"), width, hidden, false)?,
                    v_proj: linear(&format!("{l}.self_attn.v_proj"), width, hidden, false)?,
                    o_proj: linear(&format!("{l}.self_attn.o_proj"), hidden, width, false)?,
                    attn_scale: vector(&format!("{l}.self_attn_layer_scale.scale"))?,
                    post_attention_norm: vector(&format!("{l}.post_attention_layernorm.weight"))?,
                    gate_proj: linear(&format!("{l}.mlp.gate_proj"), inter, hidden, false)?,
                    up_proj: linear(&format!("{l}.mlp.up_proj"), inter, hidden, false)?,
                    down_proj: linear(&format!("{l}.mlp.down_proj"), hidden, inter, false)?,
                    mlp_scale: vector(&format!("{l}.mlp_layer_scale.scale"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let inverse_frequencies = (0..head_dim / 2)
            .map(|i| {
                let exponent = (2 * i) as f32 / head_dim as f32;
                1.0 / (config.rope_theta as f32).powf(exponent)
            })
            .collect();
        Ok(Self {
            input_proj: linear("input_proj", hidden, latent, true)?,
            layers,
            norm: vector("norm.weight")?,
            output_proj: linear("output_proj", latent, hidden, true)?,
            rms_norm_eps: config.rms_norm_eps as f32,
            heads,
            head_dim,
            sliding_window: config.sliding_window,
            inverse_frequencies,
        })
    }

    pub(super) fn initial_state(&self) -> TransformerState {
        TransformerState {
            windows: (0..self.layers.len())
                .map(|_| KvWindow {
                    keys: None,
                    values: None,
                })
                .collect(),
            next_position: 0,
        }
    }

    /// `x`: `[frames, latent_dim]` for the next frames of the stream; returns the same shape.
    pub(super) fn forward(&self, state: &mut TransformerState, x: &Tensor) -> Result<Tensor> {
        let frames = x.dim(0)?;
        let first = state.next_position;
        let (cos, sin) = rope_tables(&self.inverse_frequencies, first, frames, x.device())?;
        let mut hidden = self.input_proj.forward(x)?;
        for (layer, window) in self.layers.iter().zip(&mut state.windows) {
            let normed = candle_nn::ops::rms_norm(&hidden, &layer.input_norm, self.rms_norm_eps)?;
            let attended = self.attention(layer, window, &normed, first, &cos, &sin)?;
            hidden = (hidden + attended.broadcast_mul(&layer.attn_scale)?)?;
            let normed =
                candle_nn::ops::rms_norm(&hidden, &layer.post_attention_norm, self.rms_norm_eps)?;
            let gate = layer.gate_proj.forward(&normed)?.silu()?;
            let mlp = layer
                .down_proj
                .forward(&(gate * layer.up_proj.forward(&normed)?)?)?;
            hidden = (hidden + mlp.broadcast_mul(&layer.mlp_scale)?)?;
        }
        state.next_position += frames;
        let normed = candle_nn::ops::rms_norm(&hidden, &self.norm, self.rms_norm_eps)?;
        Ok(self.output_proj.forward(&normed)?)
    }

    /// `x * cos + rotate_half(x) * sin` on `[frames, heads * head_dim]`.
    fn rotate(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let frames = x.dim(0)?;
        let half = self.head_dim / 2;
        let x = x.reshape((frames, self.heads, self.head_dim))?;
        let rotated = Tensor::cat(
            &[&x.narrow(2, half, half)?.neg()?, &x.narrow(2, 0, half)?],
            2,
        )?;
        let y = (x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?)?;
        Ok(y.reshape((frames, self.heads * self.head_dim))?)
    }

    fn attention(
        &self,
        layer: &Layer,
        window: &mut KvWindow,
        x: &Tensor,
        first: usize,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<Tensor> {
        let frames = x.dim(0)?;
        let query = self.rotate(&layer.q_proj.forward(x)?, cos, sin)?;
        let key = self.rotate(&layer.k_proj.forward(x)?, cos, sin)?;
        let value = layer.v_proj.forward(x)?;
        let keys = append_window(&mut window.keys, &key, self.sliding_window - 1)?;
        let values = append_window(&mut window.values, &value, self.sliding_window - 1)?;
        let key_count = keys.dim(0)?;
        let key_first = first + frames - key_count;

        let heads_first = |t: &Tensor, rows: usize| -> Result<Tensor> {
            Ok(t.reshape((rows, self.heads, self.head_dim))?
                .transpose(0, 1)?
                .contiguous()?)
        };
        let query = heads_first(&query, frames)?;
        let keys = heads_first(&keys, key_count)?;
        let values = heads_first(&values, key_count)?;
        let scale = (self.head_dim as f64).powf(-0.5);
        let scores = (query.matmul(&keys.t()?)? * scale)?;
        let mask = self.window_mask(first, frames, key_first, key_count, x.device())?;
        let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
        let out = probs
            .matmul(&values)?
            .transpose(0, 1)?
            .reshape((frames, self.heads * self.head_dim))?;
        Ok(layer.o_proj.forward(&out)?)
    }

    /// Additive mask `[frames, keys]`: query at position q sees key position k iff
    /// `q - sliding_window < k <= q` (official `sliding_window_overlay` on a causal mask).
    fn window_mask(
        &self,
        first: usize,
        frames: usize,
        key_first: usize,
        key_count: usize,
        device: &Device,
    ) -> Result<Tensor> {
        let mut mask = Vec::with_capacity(frames * key_count);
        for q in first..first + frames {
            for k in key_first..key_first + key_count {
                let visible = k <= q && q - k < self.sliding_window;
                mask.push(if visible { 0.0f32 } else { f32::NEG_INFINITY });
            }
        }
        Ok(Tensor::from_vec(mask, (frames, key_count), device)?)
    }
}

/// `[kept; new]`, keeping its last `capacity` rows for the next call.
fn append_window(kept: &mut Option<Tensor>, new: &Tensor, capacity: usize) -> Result<Tensor> {
    let all = match kept.as_ref() {
        Some(kept) => Tensor::cat(&[kept, new], 0)?,
        None => new.clone(),
    };
    let rows = all.dim(0)?;
    let keep = rows.min(capacity);
    *kept = match keep {
        0 => None,
        _ => Some(all.narrow(0, rows - keep, keep)?.copy()?),
    };
    Ok(all)
}

/// `cos` and `sin` `[positions, 1, head_dim]` for absolute positions `first..first + count`,
/// the angle rounded to f32 before the trig, as the official f32 rotary embedding (shared by the
/// codec's decoder and encoder transformers).
pub(crate) fn rope_tables(
    inverse_frequencies: &[f32],
    first: usize,
    count: usize,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let head_dim = 2 * inverse_frequencies.len();
    let mut cos = Vec::with_capacity(count * head_dim);
    let mut sin = Vec::with_capacity(count * head_dim);
    for position in first..first + count {
        let angles: Vec<f32> = inverse_frequencies
            .iter()
            .map(|f| f * position as f32)
            .collect();
        // The official table is cat(freqs, freqs): both halves share the angles.
        for _half in 0..2 {
            cos.extend(angles.iter().map(|a| a.cos()));
            sin.extend(angles.iter().map(|a| a.sin()));
        }
    }
    let shape = (count, 1, head_dim);
    Ok((
        Tensor::from_vec(cos, shape, device)?,
        Tensor::from_vec(sin, shape, device)?,
    ))
}
