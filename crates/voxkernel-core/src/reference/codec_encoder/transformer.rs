//! Mimi's encoder transformer (transformers `MimiTransformerModel`) at 25 Hz: pre-LayerNorm
//! layers (with bias) of RoPE attention and a GELU MLP, each output scaled per channel before its
//! residual add, no final norm.
//!
//! The attention is plain causal over the whole clip. `MimiConfig.sliding_window` (250) is NOT
//! applied: transformers 4.57.3 builds this model's mask with `create_causal_mask`, which ignores
//! it, so a clip over 10 s attends further back than 250 steps, and so do we.

use anyhow::Result;
use candle_core::{Module, Tensor};
use candle_nn::Linear;

use crate::config::CodecEncoderConfig;
use crate::reference::codec_decoder::rope_tables;
use crate::reference::fused;
use crate::reference::weights::Weights;

struct Layer {
    input_norm: (Tensor, Tensor),
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    attn_scale: Tensor,
    post_attention_norm: (Tensor, Tensor),
    fc1: Linear,
    fc2: Linear,
    mlp_scale: Tensor,
}

pub(super) struct EncoderTransformer {
    layers: Vec<Layer>,
    heads: usize,
    head_dim: usize,
    norm_eps: f32,
    /// RoPE frequencies in f32, as the official rotary embedding computes them.
    inverse_frequencies: Vec<f32>,
}

impl EncoderTransformer {
    /// `weights` under `encoder.encoder_transformer.`; `c` checked by
    /// [`TokenizerEncoderGeometry::new`](crate::encoder_geometry::TokenizerEncoderGeometry::new).
    pub(super) fn load(weights: &Weights, c: &CodecEncoderConfig) -> Result<Self> {
        let (hidden, width) = (c.hidden_size, c.num_attention_heads * c.head_dim);
        let bias = c.attention_bias;
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let w = weights.sub(&format!("layers.{i}"));
                let norm = |name: &str| -> Result<(Tensor, Tensor)> {
                    Ok((
                        w.tensor(&format!("{name}.weight"), &[hidden])?,
                        w.tensor(&format!("{name}.bias"), &[hidden])?,
                    ))
                };
                Ok(Layer {
                    input_norm: norm("input_layernorm")?,
                    q_proj: w.linear("self_attn.q_proj", hidden, width, bias)?,
                    k_proj: w.linear("self_attn.k_proj", hidden, width, bias)?,
                    v_proj: w.linear("self_attn.v_proj", hidden, width, bias)?,
                    o_proj: w.linear("self_attn.o_proj", width, hidden, bias)?,
                    attn_scale: w.tensor("self_attn_layer_scale.scale", &[hidden])?,
                    post_attention_norm: norm("post_attention_layernorm")?,
                    fc1: w.linear("mlp.fc1", hidden, c.intermediate_size, false)?,
                    fc2: w.linear("mlp.fc2", c.intermediate_size, hidden, false)?,
                    mlp_scale: w.tensor("mlp_layer_scale.scale", &[hidden])?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let inverse_frequencies = (0..c.head_dim / 2)
            .map(|i| 1.0 / (c.rope_theta as f32).powf((2 * i) as f32 / c.head_dim as f32))
            .collect();
        Ok(Self {
            layers,
            heads: c.num_attention_heads,
            head_dim: c.head_dim,
            norm_eps: c.norm_eps as f32,
            inverse_frequencies,
        })
    }

    /// `[steps, hidden]` to the same shape, positions `0..steps`.
    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let steps = x.dim(0)?;
        let (cos, sin) = rope_tables(&self.inverse_frequencies, 0, steps, x.device())?;
        let rope = (
            cos.flatten_all()?.to_vec1::<f32>()?,
            sin.flatten_all()?.to_vec1::<f32>()?,
        );
        let mut h = x.clone();
        for layer in &self.layers {
            let (w, b) = &layer.input_norm;
            let normed = candle_nn::ops::layer_norm(&h, w, b, self.norm_eps)?;
            let attended = self.attention(layer, &normed, (&rope.0, &rope.1))?;
            h = fused::scaled_residual(&h, &attended, &layer.attn_scale)?;
            let (w, b) = &layer.post_attention_norm;
            let normed = candle_nn::ops::layer_norm(&h, w, b, self.norm_eps)?;
            let mlp = layer
                .fc2
                .forward(&layer.fc1.forward(&normed)?.gelu_erf()?)?;
            h = fused::scaled_residual(&h, &mlp, &layer.mlp_scale)?;
        }
        Ok(h)
    }

    fn attention(&self, layer: &Layer, x: &Tensor, rope: (&[f32], &[f32])) -> Result<Tensor> {
        let steps = x.dim(0)?;
        let query = fused::heads_first(&layer.q_proj.forward(x)?, self.heads, Some(rope))?;
        let key = fused::heads_first(&layer.k_proj.forward(x)?, self.heads, Some(rope))?;
        let value = fused::heads_first(&layer.v_proj.forward(x)?, self.heads, None)?;
        let scale = (self.head_dim as f64).powf(-0.5) as f32;
        let probs = fused::causal_softmax(&query.matmul(&key.t()?)?, scale)?;
        let out = probs
            .matmul(&value)?
            .transpose(0, 1)?
            .reshape((steps, self.heads * self.head_dim))?;
        Ok(layer.o_proj.forward(&out)?)
    }
}
