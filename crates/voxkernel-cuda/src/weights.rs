//! The checkpoint's talker and code-predictor weights, uploaded once as bf16 in the layout the
//! kernels stream: one 256-byte-aligned device buffer, with q|k|v and gate|up concatenated so
//! each becomes a single product, and the text projection's rows padded to a multiple of 8
//! columns (the prefill's tensor-core loads are 16 bytes wide).

use std::sync::Arc;

use anyhow::{Context, Result, bail, ensure};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use safetensors::Dtype;
use voxkernel_core::checkpoint::{Checkpoint, SafetensorsFile};

use crate::layout::{LayerPointers, MAX_HEAD_DIM};

/// Geometry of one decoder stack (talker or code predictor), read from config.json.
#[derive(Debug, Clone, Copy)]
pub struct StackGeometry {
    pub hidden: usize,
    pub inter: usize,
    pub n_heads: usize,
    pub n_kv: usize,
    pub head_dim: usize,
    pub layers: usize,
    pub eps: f32,
    pub rope_theta: f64,
}

impl StackGeometry {
    pub fn q_width(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_width(&self) -> usize {
        self.n_kv * self.head_dim
    }
    pub fn qkv_width(&self) -> usize {
        self.q_width() + 2 * self.kv_width()
    }
    /// bf16 bytes of one layer's matrices and norms.
    fn layer_bytes(&self) -> u64 {
        let h = self.hidden;
        let params = self.qkv_width() * h
            + h * self.q_width()
            + 3 * self.inter * h
            + 2 * h
            + 2 * self.head_dim;
        2 * params as u64
    }
    /// `inv_freq[i] = theta^(-2i/head_dim)`, as the official rotary embedding computes it.
    pub fn inv_freq(&self) -> Vec<f32> {
        (0..self.head_dim / 2)
            .map(|i| {
                let exponent = (2 * i) as f32 / self.head_dim as f32;
                1.0 / (self.rope_theta as f32).powf(exponent)
            })
            .collect()
    }

    /// The rotary table the kernel reads: for each position `< positions` and `i < head_dim / 2`,
    /// cos then sin of the f32 angle `pos * inv_freq[i]` (as the official model forms it),
    /// evaluated in f64 and rounded once.
    pub fn rope_table(&self, positions: usize) -> Vec<f32> {
        let inv_freq = self.inv_freq();
        let mut table = Vec::with_capacity(positions * inv_freq.len() * 2);
        for pos in 0..positions {
            for &f in &inv_freq {
                let angle = f64::from(pos as f32 * f);
                table.push(angle.cos() as f32);
                table.push(angle.sin() as f32);
            }
        }
        table
    }
}

/// Everything the kernels need to know about the model's shape.
#[derive(Debug, Clone, Copy)]
pub struct Geometry {
    pub talker: StackGeometry,
    pub cp: StackGeometry,
    pub vocab: usize,
    pub cp_vocab: usize,
    pub groups: usize,
    pub text_vocab: usize,
    pub text_hidden: usize,
    pub text_inter: usize,
    pub has_projection: bool,
    pub eos_id: u32,
}

impl Geometry {
    pub fn from_checkpoint(ckpt: &Checkpoint) -> Result<Self> {
        let t = &ckpt.config.talker;
        let c = &t.code_predictor_config;
        let talker = StackGeometry {
            hidden: t.hidden_size,
            inter: t.intermediate_size,
            n_heads: t.num_attention_heads,
            n_kv: t.num_key_value_heads,
            head_dim: t.head_dim,
            layers: t.num_hidden_layers,
            eps: t.rms_norm_eps as f32,
            rope_theta: t.rope_theta,
        };
        let cp = StackGeometry {
            hidden: c.hidden_size,
            inter: c.intermediate_size,
            n_heads: c.num_attention_heads,
            n_kv: c.num_key_value_heads,
            head_dim: c.head_dim,
            layers: c.num_hidden_layers,
            eps: c.rms_norm_eps as f32,
            rope_theta: c.rope_theta,
        };
        let text_inter = ckpt
            .model
            .info("talker.text_projection.linear_fc1.weight")
            .context("model.safetensors: missing talker.text_projection.linear_fc1.weight")?
            .shape[0];
        let g = Self {
            talker,
            cp,
            vocab: t.vocab_size,
            cp_vocab: c.vocab_size,
            groups: t.num_code_groups,
            text_vocab: t.text_vocab_size,
            text_hidden: t.text_hidden_size,
            text_inter,
            has_projection: ckpt
                .model
                .info("talker.code_predictor.small_to_mtp_projection.weight")
                .is_some(),
            eos_id: t.codec_eos_token_id,
        };
        g.validate()?;
        Ok(g)
    }

    /// The text projection's input width as uploaded (`text_hidden` rounded up to 8).
    pub fn text_hidden_padded(&self) -> usize {
        self.text_hidden.next_multiple_of(8)
    }

    /// The text projection's inner width as uploaded (`text_inter` rounded up to 8).
    pub fn text_inter_padded(&self) -> usize {
        self.text_inter.next_multiple_of(8)
    }

    fn validate(&self) -> Result<()> {
        for (name, s) in [
            ("talker_config", &self.talker),
            ("code_predictor_config", &self.cp),
        ] {
            for (field, width) in [
                ("hidden_size", s.hidden),
                ("intermediate_size", s.inter),
                ("num_attention_heads * head_dim", s.q_width()),
            ] {
                ensure!(
                    width.is_multiple_of(8) && width > 0,
                    "{name}.{field} = {width}: the CUDA backend needs a positive multiple of 8"
                );
            }
            // (a power of two: the frame kernel's attention splits a head's elements by shifts)
            ensure!(
                s.head_dim.is_power_of_two() && (2..=MAX_HEAD_DIM).contains(&s.head_dim),
                "{name}.head_dim = {}: the CUDA backend supports a power of two from 2 to \
                 {MAX_HEAD_DIM}",
                s.head_dim
            );
            ensure!(
                s.n_kv > 0 && s.n_heads.is_multiple_of(s.n_kv) && s.n_heads / s.n_kv < 16,
                "{name}: num_attention_heads {} / num_key_value_heads {} must be a whole group of \
                 at most 15 heads",
                s.n_heads,
                s.n_kv
            );
        }
        ensure!(
            self.groups == voxkernel_core::backend::NUM_CODE_GROUPS,
            "talker_config.num_code_groups = {}: only 16 is supported",
            self.groups
        );
        ensure!(
            self.vocab > 1024 && (self.eos_id as usize) < self.vocab,
            "talker_config.vocab_size {} / codec_eos_token_id {} are inconsistent",
            self.vocab,
            self.eos_id
        );
        ensure!(
            self.has_projection || self.cp.hidden == self.talker.hidden,
            "no small_to_mtp_projection but code predictor hidden {} != talker hidden {}",
            self.cp.hidden,
            self.talker.hidden
        );
        Ok(())
    }

    /// Weight bytes one frame of the model needs (the bandwidth floor's numerator): one talker
    /// step (layers, final norm, codec head) and 15 code-predictor passes (the official 2-token
    /// prefill is one pass, as the kernel's fused first pass is up to 2 sequences; above that
    /// the kernel streams a 16th), each with the projection when present, plus 15 group heads.
    pub fn weight_bytes_per_frame(&self) -> u64 {
        let t = &self.talker;
        let c = &self.cp;
        let talker =
            t.layers as u64 * t.layer_bytes() + 2 * (t.hidden + self.vocab * t.hidden) as u64;
        let projection = if self.has_projection {
            2 * (c.hidden * t.hidden + c.hidden) as u64
        } else {
            0
        };
        let cp_pass = c.layers as u64 * c.layer_bytes() + 2 * c.hidden as u64 + projection;
        let heads = 15 * 2 * (self.cp_vocab * c.hidden) as u64;
        talker + 15 * cp_pass + heads
    }
}

/// Device addresses of every weight the kernels read.
#[derive(Debug, Clone, Copy, Default)]
pub struct WeightPointers {
    pub talker_layers: u64,
    pub talker_norm: u64,
    pub cp_layers: u64,
    pub cp_norm: u64,
    pub codec_embedding: u64,
    pub codec_head: u64,
    pub cp_embedding: u64,
    pub cp_heads: u64,
    pub proj_w: u64,
    pub proj_b: u64,
    pub text_embedding: u64,
    pub fc1_w: u64,
    pub fc1_b: u64,
    pub fc2_w: u64,
    pub fc2_b: u64,
}

/// Owns the device copies; the pointers stay valid as long as this lives.
pub struct DeviceWeights {
    _buffer: CudaSlice<u8>,
    _layer_table: CudaSlice<u64>,
    pub ptr: WeightPointers,
    /// The talker's per-layer weight addresses (the device table's rows), for the host-driven
    /// prefill.
    pub talker_layers: Vec<LayerPointers>,
    pub bytes: usize,
}

/// Host staging of the packed buffer: offsets are 256-byte aligned.
#[derive(Default)]
struct Packer {
    data: Vec<u8>,
}

impl Packer {
    fn push(&mut self, parts: &[Vec<u8>]) -> u64 {
        let offset = self.data.len().next_multiple_of(256);
        self.data.resize(offset, 0);
        for p in parts {
            self.data.extend_from_slice(p);
        }
        offset as u64
    }
}

/// Row-major `[rows][cols]` bf16 bytes with each row zero-padded to `padded` columns.
fn pad_columns(bytes: Vec<u8>, cols: usize, padded: usize) -> Vec<u8> {
    if cols == padded {
        return bytes;
    }
    let mut out = Vec::with_capacity(bytes.len() / cols * padded);
    for row in bytes.chunks_exact(2 * cols) {
        out.extend_from_slice(row);
        out.resize(out.len() + 2 * (padded - cols), 0);
    }
    out
}

/// A tensor as bf16 bytes, checked against the expected shape.
fn bf16_tensor(file: &SafetensorsFile, name: &str, shape: &[usize]) -> Result<Vec<u8>> {
    let info = file
        .info(name)
        .with_context(|| format!("model.safetensors: missing tensor {name}"))?;
    if info.shape != shape {
        bail!(
            "model.safetensors: tensor {name} has shape {:?}, config.json implies {shape:?}",
            info.shape
        );
    }
    if info.dtype == Dtype::BF16 {
        return file.bytes(name);
    }
    let (values, _) = file.f32(name)?;
    Ok(values
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
        .collect())
}

fn stack_layers(
    file: &SafetensorsFile,
    prefix: &str,
    s: &StackGeometry,
    packer: &mut Packer,
) -> Result<Vec<[u64; 8]>> {
    let (h, hd) = (s.hidden, s.head_dim);
    (0..s.layers)
        .map(|n| {
            let p = format!("{prefix}.layers.{n}");
            let t = |name: &str, shape: &[usize]| bf16_tensor(file, &format!("{p}.{name}"), shape);
            let in_norm = packer.push(&[t("input_layernorm.weight", &[h])?]);
            let qkv = packer.push(&[
                t("self_attn.q_proj.weight", &[s.q_width(), h])?,
                t("self_attn.k_proj.weight", &[s.kv_width(), h])?,
                t("self_attn.v_proj.weight", &[s.kv_width(), h])?,
            ]);
            let q_norm = packer.push(&[t("self_attn.q_norm.weight", &[hd])?]);
            let k_norm = packer.push(&[t("self_attn.k_norm.weight", &[hd])?]);
            let o = packer.push(&[t("self_attn.o_proj.weight", &[h, s.q_width()])?]);
            let post_norm = packer.push(&[t("post_attention_layernorm.weight", &[h])?]);
            let gate_up = packer.push(&[
                t("mlp.gate_proj.weight", &[s.inter, h])?,
                t("mlp.up_proj.weight", &[s.inter, h])?,
            ]);
            let down = packer.push(&[t("mlp.down_proj.weight", &[h, s.inter])?]);
            Ok([in_norm, qkv, q_norm, k_norm, o, post_norm, gate_up, down])
        })
        .collect()
}

impl DeviceWeights {
    pub fn upload(ckpt: &Checkpoint, g: &Geometry, stream: &Arc<CudaStream>) -> Result<Self> {
        let f = &ckpt.model;
        let (h, ch) = (g.talker.hidden, g.cp.hidden);
        let mut packer = Packer::default();
        let talker_layers = stack_layers(f, "talker.model", &g.talker, &mut packer)?;
        let cp_layers = stack_layers(f, "talker.code_predictor.model", &g.cp, &mut packer)?;
        let talker_norm = packer.push(&[bf16_tensor(f, "talker.model.norm.weight", &[h])?]);
        let cp_norm = packer.push(&[bf16_tensor(
            f,
            "talker.code_predictor.model.norm.weight",
            &[ch],
        )?]);
        let codec_embedding = packer.push(&[bf16_tensor(
            f,
            "talker.model.codec_embedding.weight",
            &[g.vocab, h],
        )?]);
        let codec_head = packer.push(&[bf16_tensor(f, "talker.codec_head.weight", &[g.vocab, h])?]);
        let tables = g.groups - 1;
        let cp_embedding = packer.push(
            &(0..tables)
                .map(|j| {
                    bf16_tensor(
                        f,
                        &format!("talker.code_predictor.model.codec_embedding.{j}.weight"),
                        &[g.cp_vocab, h],
                    )
                })
                .collect::<Result<Vec<_>>>()?,
        );
        let cp_heads = packer.push(
            &(0..tables)
                .map(|j| {
                    bf16_tensor(
                        f,
                        &format!("talker.code_predictor.lm_head.{j}.weight"),
                        &[g.cp_vocab, ch],
                    )
                })
                .collect::<Result<Vec<_>>>()?,
        );
        let projection = if g.has_projection {
            let w = packer.push(&[bf16_tensor(
                f,
                "talker.code_predictor.small_to_mtp_projection.weight",
                &[ch, h],
            )?]);
            let b = packer.push(&[bf16_tensor(
                f,
                "talker.code_predictor.small_to_mtp_projection.bias",
                &[ch],
            )?]);
            Some((w, b))
        } else {
            None
        };
        let (tv, th, ti) = (g.text_vocab, g.text_hidden, g.text_inter);
        let text_embedding = packer.push(&[bf16_tensor(
            f,
            "talker.model.text_embedding.weight",
            &[tv, th],
        )?]);
        let fc1_w = packer.push(&[pad_columns(
            bf16_tensor(f, "talker.text_projection.linear_fc1.weight", &[ti, th])?,
            th,
            g.text_hidden_padded(),
        )]);
        let fc1_b = packer.push(&[bf16_tensor(
            f,
            "talker.text_projection.linear_fc1.bias",
            &[ti],
        )?]);
        let fc2_w = packer.push(&[pad_columns(
            bf16_tensor(f, "talker.text_projection.linear_fc2.weight", &[h, ti])?,
            ti,
            g.text_inter_padded(),
        )]);
        let fc2_b = packer.push(&[bf16_tensor(
            f,
            "talker.text_projection.linear_fc2.bias",
            &[h],
        )?]);
        packer.push(&[]);

        let buffer = stream
            .clone_htod(&packer.data)
            .context("uploading the weights")?;
        let base = buffer.device_ptr(stream).0;
        let layer_table_host: Vec<u64> = talker_layers
            .iter()
            .chain(cp_layers.iter())
            .flat_map(|l: &LayerPointers| l.iter().map(|o| base + o))
            .collect();
        let layer_table = stream.clone_htod(&layer_table_host)?;
        let table_base = layer_table.device_ptr(stream).0;
        let at = |o: u64| base + o;
        let talker_layers: Vec<LayerPointers> =
            talker_layers.iter().map(|l| l.map(|o| base + o)).collect();
        let ptr = WeightPointers {
            talker_layers: table_base,
            talker_norm: at(talker_norm),
            cp_layers: table_base
                + (talker_layers.len() * std::mem::size_of::<LayerPointers>()) as u64,
            cp_norm: at(cp_norm),
            codec_embedding: at(codec_embedding),
            codec_head: at(codec_head),
            cp_embedding: at(cp_embedding),
            cp_heads: at(cp_heads),
            proj_w: projection.map_or(0, |(w, _)| at(w)),
            proj_b: projection.map_or(0, |(_, b)| at(b)),
            text_embedding: at(text_embedding),
            fc1_w: at(fc1_w),
            fc1_b: at(fc1_b),
            fc2_w: at(fc2_w),
            fc2_b: at(fc2_b),
        };
        Ok(Self {
            bytes: packer.data.len(),
            _buffer: buffer,
            _layer_table: layer_table,
            ptr,
            talker_layers,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stack(head_dim: usize) -> StackGeometry {
        StackGeometry {
            hidden: 1024,
            inter: 3072,
            n_heads: 16,
            n_kv: 8,
            head_dim,
            layers: 5,
            eps: 1e-6,
            rope_theta: 1e6,
        }
    }

    fn geometry(talker_head_dim: usize, cp_head_dim: usize) -> Geometry {
        Geometry {
            talker: stack(talker_head_dim),
            cp: stack(cp_head_dim),
            vocab: 3072,
            cp_vocab: 2048,
            groups: voxkernel_core::backend::NUM_CODE_GROUPS,
            text_vocab: 151_936,
            text_hidden: 2048,
            text_inter: 2048,
            has_projection: false,
            eos_id: 2150,
        }
    }

    #[test]
    fn head_dim_must_be_a_power_of_two_the_kernel_supports() {
        geometry(128, 128).validate().unwrap();
        geometry(64, 128).validate().unwrap();
        for (talker, cp, field) in [
            (128, 96, "code_predictor_config.head_dim = 96"),
            (96, 128, "talker_config.head_dim = 96"),
            (256, 128, "talker_config.head_dim = 256"),
        ] {
            let err = geometry(talker, cp).validate().unwrap_err().to_string();
            assert!(err.contains(field), "{err}");
            assert!(err.contains("a power of two from 2 to 128"), "{err}");
        }
    }

    #[test]
    fn rope_table_holds_cos_and_sin_of_each_position_angle() {
        let s = StackGeometry {
            hidden: 64,
            inter: 128,
            n_heads: 2,
            n_kv: 1,
            head_dim: 8,
            layers: 1,
            eps: 1e-6,
            rope_theta: 1e6,
        };
        let table = s.rope_table(3);
        assert_eq!(table.len(), 3 * 4 * 2);
        // position 0: no rotation
        assert!(table[..8].chunks(2).all(|cs| cs == [1.0, 0.0]));
        // inv_freq[0] = 1: position 1 turns by 1 radian, position 2 by 2
        assert_eq!(table[8], 1f64.cos() as f32);
        assert_eq!(table[9], 1f64.sin() as f32);
        assert_eq!(table[16], 2f64.cos() as f32);
        assert_eq!(table[17], 2f64.sin() as f32);
        // inv_freq[1] = 1 / theta^(2/8), in f32 as the official model computes it
        let angle = f64::from(2.0 * (1.0 / 1e6f32.powf(0.25)));
        assert_eq!(
            (table[18], table[19]),
            (angle.cos() as f32, angle.sin() as f32)
        );
    }
}
