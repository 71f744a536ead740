//! The Qwen3 decoder stack shared by the talker and the code predictor (spec §3.4, §3.6):
//! pre-norm blocks of [RMSNorm → GQA attention with per-head q/k RMSNorm before RoPE → residual;
//! RMSNorm → SwiGLU → residual], then a final RMSNorm. No biases, no embedding scaling.
//!
//! The talker's configured M-RoPE is exactly 1-D RoPE here (its three position streams are
//! always equal), so both stacks use the same NeoX half-split rotation.
//!
//! Tensors carry no batch dimension: one sequence is `[rows, hidden]`.

use anyhow::Result;
use candle_core::{D, Device, Tensor};
use candle_nn::{Linear, Module};

use super::weights::Weights;
use crate::config::{CodePredictorConfig, TalkerConfig};

/// The sizes of one decoder stack, as read from its config.
#[derive(Debug, Clone)]
pub(crate) struct DecoderGeometry {
    pub(crate) hidden: usize,
    pub(crate) num_layers: usize,
    pub(crate) num_heads: usize,
    pub(crate) num_kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) intermediate: usize,
    pub(crate) rms_norm_eps: f64,
    pub(crate) rope_theta: f64,
}

impl From<&TalkerConfig> for DecoderGeometry {
    fn from(c: &TalkerConfig) -> Self {
        Self {
            hidden: c.hidden_size,
            num_layers: c.num_hidden_layers,
            num_heads: c.num_attention_heads,
            num_kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            intermediate: c.intermediate_size,
            rms_norm_eps: c.rms_norm_eps,
            rope_theta: c.rope_theta,
        }
    }
}

impl From<&CodePredictorConfig> for DecoderGeometry {
    fn from(c: &CodePredictorConfig) -> Self {
        Self {
            hidden: c.hidden_size,
            num_layers: c.num_hidden_layers,
            num_heads: c.num_attention_heads,
            num_kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            intermediate: c.intermediate_size,
            rms_norm_eps: c.rms_norm_eps,
            rope_theta: c.rope_theta,
        }
    }
}

/// `x * rsqrt(mean(x^2) + eps) * weight` over the last dimension, in f32.
struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    fn load(w: &Weights, name: &str, dim: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            weight: w.tensor(&format!("{name}.weight"), &[dim])?,
            eps,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mean_square = x.sqr()?.mean_keepdim(D::Minus1)?;
        let inv_rms = (mean_square + self.eps)?.sqrt()?.recip()?;
        Ok(x.broadcast_mul(&inv_rms)?.broadcast_mul(&self.weight)?)
    }
}

/// 1-D rotary position embedding, `inv_freq[i] = theta^(-2i/head_dim)`, computed in f32 like
/// transformers' default RoPE init.
struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    fn new(head_dim: usize, theta: f64) -> Self {
        let base = theta as f32;
        let inv_freq = (0..head_dim / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / head_dim as f32))
            .collect();
        Self { inv_freq }
    }

    /// `cos`, `sin` tables `[rows, head_dim]` for positions `start..start + rows`, each half
    /// repeating the frequencies (`cat(freqs, freqs)`).
    fn positions(&self, start: usize, rows: usize) -> Result<Positions> {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(rows * half * 2);
        let mut sin = Vec::with_capacity(rows * half * 2);
        for pos in start..start + rows {
            let angles: Vec<f32> = self.inv_freq.iter().map(|f| f * pos as f32).collect();
            for _ in 0..2 {
                cos.extend(angles.iter().map(|a| a.cos()));
                sin.extend(angles.iter().map(|a| a.sin()));
            }
        }
        let shape = (rows, half * 2);
        Ok(Positions {
            past: start,
            cos: Tensor::from_vec(cos, shape, &Device::Cpu)?,
            sin: Tensor::from_vec(sin, shape, &Device::Cpu)?,
        })
    }
}

/// Where the rows of one forward call sit: `past` cached positions precede them.
struct Positions {
    past: usize,
    cos: Tensor,
    sin: Tensor,
}

/// `x * cos + rotate_half(x) * sin` with `rotate_half(x) = cat(-x[half:], x[:half])`;
/// `x` is `[heads, rows, head_dim]`.
fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let first = x.narrow(D::Minus1, 0, half)?;
    let second = x.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&second.neg()?, &first], D::Minus1)?;
    Ok((x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?)?)
}

/// Keys and values of every layer for the positions seen so far (post-RoPE keys).
pub(crate) struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
}

impl KvCache {
    pub(crate) fn new(num_layers: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
        }
    }

    /// Number of positions already cached (the next row's RoPE position).
    pub(crate) fn len(&self) -> Result<usize> {
        match self.layers.first() {
            Some(Some((k, _))) => Ok(k.dim(1)?),
            _ => Ok(0),
        }
    }

    /// Appends `k`, `v` (`[kv_heads, rows, head_dim]`) and returns everything cached so far.
    fn append(&mut self, layer: usize, k: Tensor, v: Tensor) -> Result<(Tensor, Tensor)> {
        let merged = match self.layers[layer].take() {
            Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 1)?, Tensor::cat(&[&pv, &v], 1)?),
            None => (k, v),
        };
        self.layers[layer] = Some(merged.clone());
        Ok(merged)
    }
}

struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

impl Attention {
    fn load(w: &Weights, g: &DecoderGeometry) -> Result<Self> {
        let q_width = g.num_heads * g.head_dim;
        let kv_width = g.num_kv_heads * g.head_dim;
        Ok(Self {
            q_proj: w.linear("q_proj", g.hidden, q_width, false)?,
            k_proj: w.linear("k_proj", g.hidden, kv_width, false)?,
            v_proj: w.linear("v_proj", g.hidden, kv_width, false)?,
            o_proj: w.linear("o_proj", q_width, g.hidden, false)?,
            q_norm: RmsNorm::load(w, "q_norm", g.head_dim, g.rms_norm_eps)?,
            k_norm: RmsNorm::load(w, "k_norm", g.head_dim, g.rms_norm_eps)?,
            num_heads: g.num_heads,
            num_kv_heads: g.num_kv_heads,
            head_dim: g.head_dim,
        })
    }

    /// `[rows, width]` → `[heads, rows, head_dim]`.
    fn split_heads(&self, x: &Tensor, heads: usize) -> Result<Tensor> {
        let rows = x.dim(0)?;
        Ok(x.reshape((rows, heads, self.head_dim))?
            .transpose(0, 1)?
            .contiguous()?)
    }

    /// Each kv head serves `num_heads / num_kv_heads` consecutive query heads.
    fn repeat_kv(&self, x: &Tensor) -> Result<Tensor> {
        let groups = self.num_heads / self.num_kv_heads;
        if groups == 1 {
            return Ok(x.clone());
        }
        let (kv_heads, len, dim) = x.dims3()?;
        Ok(x.unsqueeze(1)?
            .expand((kv_heads, groups, len, dim))?
            .reshape((kv_heads * groups, len, dim))?)
    }

    fn forward(
        &self,
        x: &Tensor,
        at: &Positions,
        layer: usize,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let rows = x.dim(0)?;
        let q = self
            .q_norm
            .forward(&self.split_heads(&self.q_proj.forward(x)?, self.num_heads)?)?;
        let k = self
            .k_norm
            .forward(&self.split_heads(&self.k_proj.forward(x)?, self.num_kv_heads)?)?;
        let v = self.split_heads(&self.v_proj.forward(x)?, self.num_kv_heads)?;
        let q = apply_rope(&q, &at.cos, &at.sin)?;
        let k = apply_rope(&k, &at.cos, &at.sin)?;
        let (k, v) = cache.append(layer, k, v)?;
        let k = self.repeat_kv(&k)?;
        let v = self.repeat_kv(&v)?;
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let scores = (q.matmul(&k.t()?.contiguous()?)? * scale)?;
        let scores = scores.broadcast_add(&causal_mask(rows, at.past)?)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let out = probs.matmul(&v.contiguous()?)?;
        let out = out
            .transpose(0, 1)?
            .reshape((rows, self.num_heads * self.head_dim))?;
        Ok(self.o_proj.forward(&out)?)
    }
}

/// `[rows, past + rows]`: row `i` (position `past + i`) sees keys `0..=past + i`.
fn causal_mask(rows: usize, past: usize) -> Result<Tensor> {
    let total = past + rows;
    let mask: Vec<f32> = (0..rows)
        .flat_map(|i| (0..total).map(move |j| if j > past + i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    Ok(Tensor::from_vec(mask, (rows, total), &Device::Cpu)?)
}

/// `down(silu(gate(x)) * up(x))`.
struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    fn load(w: &Weights, g: &DecoderGeometry) -> Result<Self> {
        Ok(Self {
            gate_proj: w.linear("gate_proj", g.hidden, g.intermediate, false)?,
            up_proj: w.linear("up_proj", g.hidden, g.intermediate, false)?,
            down_proj: w.linear("down_proj", g.intermediate, g.hidden, false)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate = candle_nn::ops::silu(&self.gate_proj.forward(x)?)?;
        let up = self.up_proj.forward(x)?;
        Ok(self.down_proj.forward(&(gate * up)?)?)
    }
}

struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl DecoderLayer {
    fn load(w: &Weights, g: &DecoderGeometry) -> Result<Self> {
        Ok(Self {
            input_layernorm: RmsNorm::load(w, "input_layernorm", g.hidden, g.rms_norm_eps)?,
            self_attn: Attention::load(&w.sub("self_attn"), g)?,
            post_attention_layernorm: RmsNorm::load(
                w,
                "post_attention_layernorm",
                g.hidden,
                g.rms_norm_eps,
            )?,
            mlp: Mlp::load(&w.sub("mlp"), g)?,
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        at: &Positions,
        layer: usize,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let attn = self
            .self_attn
            .forward(&self.input_layernorm.forward(x)?, at, layer, cache)?;
        let x = (x + attn)?;
        let mlp = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&x)?)?;
        Ok((x + mlp)?)
    }
}

/// The decoder layers and the final norm, under a prefix such as `talker.model.`.
pub(crate) struct Transformer {
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    rope: Rope,
}

impl Transformer {
    pub(crate) fn load(w: &Weights, g: &DecoderGeometry) -> Result<Self> {
        let layers = (0..g.num_layers)
            .map(|i| DecoderLayer::load(&w.sub(&format!("layers.{i}")), g))
            .collect::<Result<_>>()?;
        Ok(Self {
            layers,
            norm: RmsNorm::load(w, "norm", g.hidden, g.rms_norm_eps)?,
            rope: Rope::new(g.head_dim, g.rope_theta),
        })
    }

    pub(crate) fn new_cache(&self) -> KvCache {
        KvCache::new(self.layers.len())
    }

    /// Runs `rows` (`[n, hidden]`) at the positions following the cache; returns the
    /// final-norm hidden states `[n, hidden]`.
    pub(crate) fn forward(&self, rows: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let at = self.rope.positions(cache.len()?, rows.dim(0)?)?;
        let mut x = rows.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(&x, &at, i, cache)?;
        }
        self.norm.forward(&x)
    }
}
