//! The speech tokenizer's encoder on the GPU (24 kHz waveform to 12.5 Hz codes): SEANet, the
//! causal transformer, the stride-2 downsample and the split residual VQ. Mirrors
//! `voxkernel_core::reference::codec_encoder` layer by layer, from the same
//! `TokenizerEncoderGeometry`.
//!
//! Every causal conv (`CausalConv`: `(kernel - 1) * dilation + 1 - stride` rows of left padding,
//! the right completing the last stride) reads a buffer its producer wrote with exactly that
//! padding around its rows. A strided conv whose kernel is a multiple of its stride (SEANet's
//! `2 * ratio`, the downsample's 4 over 2) is a stride-1 conv over `stride`-row blocks: the
//! buffer read as `[rows / stride, stride * channels]`, `kernel / stride` taps, which is how the
//! GEMM's weight rows (tap-major, `conv_weight`) already line up.

use anyhow::{Context, Result, ensure};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use voxkernel_core::backend::{Frame, NUM_CODE_GROUPS};
use voxkernel_core::checkpoint::Checkpoint;
use voxkernel_core::config::CodecEncoderConfig;
use voxkernel_core::encoder_geometry::{
    CausalPadding, MimiConv, QuantizerGeometry, SeanetGeometry, TokenizerEncoderGeometry,
};

use super::{
    ATTENTION_THREADS, CausalAttnParams, DEFAULT_SMEM_BYTES, GemmCall, Gpu, MAX_HEAD_DIM,
    PAD_REPLICATE, RVQ_MAX_DIM, RVQ_THREADS, RopeParams, Rows, RvqEncodeParams, THREADS, Tensors,
    launch_config,
};
use crate::codec::{
    ACT_ELU, ACT_NONE, EPI_GELU, EPI_NONE, EPI_RESIDUAL, Packer, conv_weight, transpose,
};
use crate::runtime::{device_ptr, zeros};

/// Floor of `cluster_usage` when the codebook is formed (`MimiEuclideanCodebook.epsilon`).
const CLUSTER_USAGE_MIN: f32 = 1e-5;

/// A causal `MimiConv1d`, its weights at packed offsets.
#[derive(Debug, Clone, Copy)]
struct CausalConv {
    w: usize,
    bias: Option<usize>,
    inp: usize,
    out: usize,
    kernel: usize,
    stride: usize,
    dilation: usize,
    padding: CausalPadding,
}

impl CausalConv {
    /// `name.conv.weight` (and `name.conv.bias` when `bias`).
    fn load(t: &Tensors, packer: &mut Packer, conv: &MimiConv) -> Result<Self> {
        let MimiConv {
            out,
            inp,
            kernel,
            bias,
            stride,
            dilation,
            padding,
            ..
        } = *conv;
        let name = &conv.name;
        ensure!(
            stride == 1 || (kernel.is_multiple_of(stride) && dilation == 1),
            "speech tokenizer {name}: kernel {kernel} is not a multiple of its stride {stride}; \
             the CUDA encoder supports only such strided convs"
        );
        let w = t.get(&format!("{name}.conv.weight"), &[out, inp, kernel])?;
        let bias = bias
            .then(|| t.get(&format!("{name}.conv.bias"), &[out]))
            .transpose()?;
        Ok(Self {
            w: packer.push(&conv_weight(&w, out, inp, kernel)),
            bias: bias.map(|b| packer.push(&b)),
            inp,
            out,
            kernel,
            stride,
            dilation,
            padding,
        })
    }

    /// Padding rows before and after `rows` input rows.
    fn pads(&self, rows: usize) -> (usize, usize) {
        let left = (self.kernel - 1) * self.dilation + 1 - self.stride;
        (left, rows.div_ceil(self.stride) * self.stride - rows)
    }

    /// A zeroed buffer for `rows` input rows of this conv, with its padding rows (`fill` makes
    /// them for replicate padding once the rows are written).
    fn input(&self, gpu: &Gpu, rows: usize) -> Result<Rows> {
        let (left, right) = self.pads(rows);
        gpu.rows(self.inp, left, rows, right, "causal conv input")
    }
}

/// ELU, conv (kernel `residual_kernel_size`), ELU, conv 1x1, plus the block's input.
struct ResnetBlock {
    conv1: CausalConv,
    conv2: CausalConv,
}

struct Stage {
    blocks: Vec<ResnetBlock>,
    downsample: CausalConv,
}

/// One transformer layer's weights (offsets); the biases only with `attention_bias`.
struct Layer {
    input_norm: (usize, usize),
    qkv: usize,
    qkv_bias: Option<usize>,
    o_proj: usize,
    o_bias: Option<usize>,
    attn_scale: usize,
    post_attention_norm: (usize, usize),
    fc1: usize,
    fc2: usize,
    mlp_scale: usize,
}

/// One residual VQ: `layers` codebooks, each `[dim][size]` (transposed) with its `|e|²` row.
struct Quantizer {
    codebooks: usize,
    norms: usize,
    layers: usize,
}

pub(super) struct TokenizerEncoder {
    _weights: CudaSlice<f32>,
    base: u64,
    conv_in: CausalConv,
    stages: Vec<Stage>,
    conv_out: CausalConv,
    layers: Vec<Layer>,
    downsample: Option<CausalConv>,
    /// Both input projections side by side (`[hidden][2 * dim]`: semantic, acoustic), absent
    /// when the quantizers read the latent as it is.
    input_proj: Option<usize>,
    semantic: Quantizer,
    acoustic: Quantizer,
    hidden: usize,
    heads: usize,
    head_dim: usize,
    inter: usize,
    norm_eps: f32,
    inverse_frequencies: Vec<f32>,
    codebook_size: usize,
    dim: usize,
    samples_per_frame: usize,
}

impl TokenizerEncoder {
    /// Refusing what the CUDA kernels cannot run, beyond what the geometry refuses.
    pub(super) fn from_checkpoint(checkpoint: &Checkpoint, gpu: &Gpu) -> Result<Self> {
        let config = &checkpoint.speech_tokenizer_config;
        let geometry = TokenizerEncoderGeometry::new(config)?;
        let c = &config.encoder_config;
        check_kernel_limits(c)?;
        let t = Tensors {
            file: &checkpoint.speech_tokenizer,
            prefix: "encoder.",
        };
        let mut packer = Packer::default();
        let (conv_in, stages, conv_out) = load_seanet(&t, &mut packer, &geometry.seanet)?;
        let layers = load_transformer(&t, &mut packer, c)?;
        let downsample = geometry
            .downsample
            .as_ref()
            .map(|conv| CausalConv::load(&t, &mut packer, conv))
            .transpose()?;
        let (input_proj, semantic, acoustic) = load_quantizers(&t, &mut packer, c, &geometry)?;
        let (weights, base) = gpu.upload_weights(&packer.data)?;
        let inverse_frequencies = (0..c.head_dim / 2)
            .map(|i| 1.0 / (c.rope_theta as f32).powf((2 * i) as f32 / c.head_dim as f32))
            .collect();
        Ok(Self {
            _weights: weights,
            base,
            conv_in,
            stages,
            conv_out,
            layers,
            downsample,
            input_proj,
            semantic,
            acoustic,
            hidden: c.hidden_size,
            heads: c.num_attention_heads,
            head_dim: c.head_dim,
            inter: c.intermediate_size,
            norm_eps: c.norm_eps as f32,
            inverse_frequencies,
            codebook_size: c.codebook_size,
            dim: c.vector_quantization_hidden_dimension,
            samples_per_frame: config.encode_downsample_rate,
        })
    }

    fn weight(&self, offset: usize) -> u64 {
        self.base + 4 * offset as u64
    }

    /// Codes of a mono 24 kHz clip: `ceil(len / 1920)` frames of 16 codes.
    pub(super) fn encode(&self, gpu: &Gpu, samples: &[f32]) -> Result<Vec<Frame>> {
        ensure!(!samples.is_empty(), "codec encoder: no samples");
        // The waveform with conv_in's padding made on the host.
        let (left, right) = self.conv_in.pads(samples.len());
        let (first, last) = match self.conv_in.padding {
            CausalPadding::Zeros => (0.0, 0.0),
            CausalPadding::Replicate => (samples[0], samples[samples.len() - 1]),
        };
        let mut padded = vec![first; left];
        padded.extend_from_slice(samples);
        padded.resize(left + samples.len() + right, last);
        let audio = gpu.upload(&padded, 1)?;
        let audio = Rows {
            pad: left,
            rows: samples.len(),
            tail: right,
            ..audio
        };
        let h = self.seanet(gpu, &audio)?;
        self.transformer(gpu, &h)?;
        let latent = match &self.downsample {
            Some(conv) => {
                gpu.pad_in_place(&h, PAD_REPLICATE)?;
                let out = gpu.rows(self.hidden, 0, h.rows.div_ceil(conv.stride), 0, "latent")?;
                self.conv(gpu, conv, &h, ACT_NONE, None, &out)?;
                out
            }
            None => h,
        };
        let codes = self.quantize(gpu, &latent)?;
        let frames = samples
            .len()
            .div_ceil(self.samples_per_frame)
            .min(latent.rows);
        Ok(codes
            .chunks_exact(NUM_CODE_GROUPS)
            .take(frames)
            .map(|row| std::array::from_fn(|g| row[g]))
            .collect())
    }

    /// `conv` over `input` (which carries the conv's padding), applying `act` to what it
    /// reads and adding `residual` (rows as wide as the output) to what it writes, into the
    /// rows of `out`.
    fn conv(
        &self,
        gpu: &Gpu,
        conv: &CausalConv,
        input: &Rows,
        act: i32,
        residual: Option<&Rows>,
        out: &Rows,
    ) -> Result<()> {
        debug_assert_eq!((input.pad, input.tail), conv.pads(input.rows));
        let m = input.rows.div_ceil(conv.stride);
        gpu.gemm(&GemmCall {
            taps: conv.kernel / conv.stride,
            dilation: conv.dilation,
            act,
            bias: conv.bias.map_or(0, |b| self.weight(b)),
            epi: residual.map_or(EPI_NONE, |_| EPI_RESIDUAL),
            res: residual.map_or(0, |r| r.row(0)),
            out_ld: out.width,
            ..GemmCall::matmul(
                input.first(),
                conv.stride * conv.inp,
                m,
                self.weight(conv.w),
                conv.out,
                out.row(0),
            )
        })
    }

    /// Pads `x`, just written as the input of `conv`, by replication when the conv asks for
    /// it; zero padding is there from the allocation.
    fn fill(&self, gpu: &Gpu, x: &Rows, conv: &CausalConv) -> Result<()> {
        match conv.padding {
            CausalPadding::Zeros => Ok(()),
            CausalPadding::Replicate => gpu.pad_in_place(x, PAD_REPLICATE),
        }
    }

    /// SEANet: waveform to `[rows / hop, hidden]`, written into a buffer with the downsample's
    /// padding (the transformer then runs on its rows in place).
    fn seanet(&self, gpu: &Gpu, audio: &Rows) -> Result<Rows> {
        // The convs in order: each writes the input of the next.
        let mut convs: Vec<&CausalConv> = Vec::new();
        for stage in &self.stages {
            for block in &stage.blocks {
                convs.push(&block.conv1);
            }
            convs.push(&stage.downsample);
        }
        convs.push(&self.conv_out);
        let mut x = convs[0].input(gpu, audio.rows)?;
        self.conv(gpu, &self.conv_in, audio, ACT_NONE, None, &x)?;
        self.fill(gpu, &x, convs[0])?;
        let mut next = 1;
        for stage in &self.stages {
            for block in &stage.blocks {
                let h = gpu.rows(block.conv2.inp, 0, x.rows, 0, "resnet block hidden")?;
                self.conv(gpu, &block.conv1, &x, ACT_ELU, None, &h)?;
                let out = convs[next].input(gpu, x.rows)?;
                self.conv(gpu, &block.conv2, &h, ACT_ELU, Some(&x), &out)?;
                self.fill(gpu, &out, convs[next])?;
                x = out;
                next += 1;
            }
            let rows = x.rows.div_ceil(stage.downsample.stride);
            let out = convs[next].input(gpu, rows)?;
            self.conv(gpu, &stage.downsample, &x, ACT_ELU, None, &out)?;
            self.fill(gpu, &out, convs[next])?;
            x = out;
            next += 1;
        }
        let out = match &self.downsample {
            Some(conv) => conv.input(gpu, x.rows)?,
            None => gpu.rows(self.hidden, 0, x.rows, 0, "transformer rows")?,
        };
        self.conv(gpu, &self.conv_out, &x, ACT_ELU, None, &out)?;
        Ok(out)
    }

    /// The encoder transformer over the rows of `h`, in place.
    fn transformer(&self, gpu: &Gpu, h: &Rows) -> Result<()> {
        let (rows, hidden) = (h.rows, self.hidden);
        let width = self.heads * self.head_dim;
        ensure!(
            4 * rows <= DEFAULT_SMEM_BYTES,
            "codec encoder: {rows} transformer steps are more than the CUDA attention kernel \
             takes ({})",
            DEFAULT_SMEM_BYTES / 4
        );
        let half = self.head_dim / 2;
        let mut cos = Vec::with_capacity(rows * half);
        let mut sin = Vec::with_capacity(rows * half);
        for position in 0..rows {
            // Angles rounded to f32 before the trig, as the CPU reference's rope_tables.
            for f in &self.inverse_frequencies {
                let angle = f * position as f32;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        let cos = gpu.upload(&cos, half)?;
        let sin = gpu.upload(&sin, half)?;
        let normed = gpu.rows(hidden, 0, rows, 0, "normed rows")?;
        let qkv = gpu.rows(3 * width, 0, rows, 0, "q|k|v")?;
        let attended = gpu.rows(width, 0, rows, 0, "attention output")?;
        let mlp = gpu.rows(self.inter, 0, rows, 0, "MLP hidden")?;
        let w = |offset: usize| self.weight(offset);
        for layer in &self.layers {
            let norm = (w(layer.input_norm.0), w(layer.input_norm.1));
            gpu.layer_norm(h.row(0), normed.row(0), norm, rows, hidden, self.norm_eps)?;
            gpu.gemm(&GemmCall {
                bias: layer.qkv_bias.map_or(0, w),
                ..GemmCall::matmul(
                    normed.row(0),
                    hidden,
                    rows,
                    w(layer.qkv),
                    3 * width,
                    qkv.row(0),
                )
            })?;
            self.attention(gpu, &qkv, &attended, &cos, &sin)?;
            gpu.gemm(&GemmCall {
                bias: layer.o_bias.map_or(0, w),
                epi: EPI_RESIDUAL,
                res: h.row(0),
                col_scale: w(layer.attn_scale),
                ..GemmCall::matmul(
                    attended.row(0),
                    width,
                    rows,
                    w(layer.o_proj),
                    hidden,
                    h.row(0),
                )
            })?;
            let norm = (
                w(layer.post_attention_norm.0),
                w(layer.post_attention_norm.1),
            );
            gpu.layer_norm(h.row(0), normed.row(0), norm, rows, hidden, self.norm_eps)?;
            gpu.gemm(&GemmCall {
                epi: EPI_GELU,
                ..GemmCall::matmul(
                    normed.row(0),
                    hidden,
                    rows,
                    w(layer.fc1),
                    self.inter,
                    mlp.row(0),
                )
            })?;
            gpu.gemm(&GemmCall {
                epi: EPI_RESIDUAL,
                res: h.row(0),
                col_scale: w(layer.mlp_scale),
                ..GemmCall::matmul(mlp.row(0), self.inter, rows, w(layer.fc2), hidden, h.row(0))
            })?;
        }
        Ok(())
    }

    /// RoPE on the queries and keys of `qkv` in place, then causal attention into `out`.
    fn attention(&self, gpu: &Gpu, qkv: &Rows, out: &Rows, cos: &Rows, sin: &Rows) -> Result<()> {
        let rows = qkv.rows;
        let width = self.heads * self.head_dim;
        let p = RopeParams {
            qkv: qkv.row(0),
            cos: cos.row(0),
            sin: sin.row(0),
            rows: rows as i32,
            width: width as i32,
            head_dim: self.head_dim as i32,
        };
        let mut l = gpu.stream.launch_builder(&gpu.kernels.rope);
        l.arg(&p);
        // SAFETY: `qkv` holds `rows x 3 * width`, the tables `rows x head_dim / 2`.
        let pairs = rows * width;
        unsafe { l.launch(launch_config(pairs.div_ceil(THREADS as usize), THREADS, 0)) }
            .context("launching rope_qk")?;
        let p = CausalAttnParams {
            qkv: qkv.row(0),
            out: out.row(0),
            rows: rows as i32,
            width: width as i32,
            head_dim: self.head_dim as i32,
            scale: (self.head_dim as f64).powf(-0.5) as f32,
        };
        let mut l = gpu.stream.launch_builder(&gpu.kernels.attention);
        l.arg(&p);
        let cfg = LaunchConfig {
            grid_dim: (self.heads as u32, rows as u32, 1),
            block_dim: (ATTENTION_THREADS, 1, 1),
            shared_mem_bytes: 4 * rows as u32,
        };
        // SAFETY: one block per (head, row); head_dim <= MAX_HEAD_DIM (checked at load); the
        // dynamic shared memory holds one score per row (checked against the default limit).
        unsafe { l.launch(cfg) }.context("launching causal_attention")?;
        Ok(())
    }

    /// The split RVQ: the semantic quantizer and the acoustic one each encode the same latent
    /// (after their own input projection); returns `[frames][16]` codes.
    fn quantize(&self, gpu: &Gpu, latent: &Rows) -> Result<Vec<u32>> {
        let frames = latent.rows;
        let projected = match self.input_proj {
            Some(w) => {
                let out = gpu.rows(2 * self.dim, 0, frames, 0, "projected latent")?;
                let n = 2 * self.dim;
                let call = GemmCall::matmul(
                    latent.row(0),
                    self.hidden,
                    frames,
                    self.weight(w),
                    n,
                    out.row(0),
                );
                gpu.gemm(&call)?;
                Some(out)
            }
            None => None,
        };
        let codes = zeros::<u32>(&gpu.stream, frames * NUM_CODE_GROUPS, "codes")?;
        let codes_ptr = device_ptr(&codes, &gpu.stream);
        let (input, in_ld, acoustic_column) = match &projected {
            Some(p) => (p.row(0), p.width, self.dim),
            None => (latent.row(0), latent.width, 0),
        };
        let mut first_code = 0;
        for (quantizer, column) in [(&self.semantic, 0), (&self.acoustic, acoustic_column)] {
            let p = RvqEncodeParams {
                input: input + 4 * column as u64,
                codebooks: self.weight(quantizer.codebooks),
                norms: self.weight(quantizer.norms),
                codes: codes_ptr,
                in_ld: in_ld as i32,
                layers: quantizer.layers as i32,
                size: self.codebook_size as i32,
                dim: self.dim as i32,
                first_code,
            };
            let mut l = gpu.stream.launch_builder(&gpu.kernels.rvq);
            l.arg(&p);
            // SAFETY: one block per frame; `input` holds `frames` rows of `in_ld` floats, the
            // codebooks `layers x dim x size` floats (dim <= RVQ_MAX_DIM, checked at load),
            // `codes` `frames x 16`, and first_code + layers <= 16.
            unsafe { l.launch(launch_config(frames, RVQ_THREADS, 0)) }
                .context("launching rvq_encode")?;
            first_code += quantizer.layers as i32;
        }
        gpu.download_u32(&codes)
    }
}

/// What the kernels support beyond what the model needs (`TokenizerEncoderGeometry::new`).
fn check_kernel_limits(c: &CodecEncoderConfig) -> Result<()> {
    ensure!(
        c.head_dim <= MAX_HEAD_DIM,
        "speech_tokenizer encoder_config.head_dim {}: the CUDA encoder supports even sizes up to \
         {MAX_HEAD_DIM}",
        c.head_dim
    );
    ensure!(
        !c.use_conv_shortcut,
        "speech_tokenizer encoder_config.use_conv_shortcut is true; the CUDA encoder supports \
         the released identity shortcut only (use the CPU encoder)"
    );
    let dim = c.vector_quantization_hidden_dimension;
    ensure!(
        dim <= RVQ_MAX_DIM,
        "speech_tokenizer encoder_config.vector_quantization_hidden_dimension {dim}: the CUDA \
         encoder supports up to {RVQ_MAX_DIM}"
    );
    Ok(())
}

/// SEANet's convs; the resnet blocks' shortcuts are the identity (`check_kernel_limits`).
fn load_seanet(
    t: &Tensors,
    packer: &mut Packer,
    geometry: &SeanetGeometry,
) -> Result<(CausalConv, Vec<Stage>, CausalConv)> {
    let mut load = |conv: &MimiConv| CausalConv::load(t, packer, conv);
    let conv_in = load(&geometry.conv_in)?;
    let mut stages = Vec::new();
    for stage in &geometry.stages {
        let mut blocks = Vec::new();
        for block in &stage.blocks {
            blocks.push(ResnetBlock {
                conv1: load(&block.conv1)?,
                conv2: load(&block.conv2)?,
            });
        }
        let downsample = load(&stage.downsample)?;
        stages.push(Stage { blocks, downsample });
    }
    let conv_out = load(&geometry.conv_out)?;
    Ok((conv_in, stages, conv_out))
}

/// The transformer layers under `encoder.encoder_transformer.`, with q, k and v fused into one
/// `[hidden][3 * width]` matrix.
fn load_transformer(
    t: &Tensors,
    packer: &mut Packer,
    c: &CodecEncoderConfig,
) -> Result<Vec<Layer>> {
    let (hidden, width) = (c.hidden_size, c.num_attention_heads * c.head_dim);
    let bias = c.attention_bias;
    (0..c.num_hidden_layers)
        .map(|i| {
            let l = format!("encoder_transformer.layers.{i}");
            let mut vector = |name: &str, len: usize| -> Result<usize> {
                Ok(packer.push(&t.get(&format!("{l}.{name}"), &[len])?))
            };
            let input_norm = (
                vector("input_layernorm.weight", hidden)?,
                vector("input_layernorm.bias", hidden)?,
            );
            let post_attention_norm = (
                vector("post_attention_layernorm.weight", hidden)?,
                vector("post_attention_layernorm.bias", hidden)?,
            );
            let attn_scale = vector("self_attn_layer_scale.scale", hidden)?;
            let mlp_scale = vector("mlp_layer_scale.scale", hidden)?;
            let o_bias = bias
                .then(|| vector("self_attn.o_proj.bias", hidden))
                .transpose()?;
            let mut parts = Vec::with_capacity(3);
            let mut biases = Vec::with_capacity(3 * width);
            for p in ["q_proj", "k_proj", "v_proj"] {
                let w = t.get(&format!("{l}.self_attn.{p}.weight"), &[width, hidden])?;
                parts.push(transpose(&w, width, hidden));
                if bias {
                    biases.extend(t.get(&format!("{l}.self_attn.{p}.bias"), &[width])?);
                }
            }
            let mut fused = Vec::with_capacity(hidden * 3 * width);
            for row in 0..hidden {
                for part in &parts {
                    fused.extend_from_slice(&part[row * width..(row + 1) * width]);
                }
            }
            let mut linear = |name: &str, out: usize, inp: usize| -> Result<usize> {
                let w = t.get(&format!("{l}.{name}.weight"), &[out, inp])?;
                Ok(packer.push(&transpose(&w, out, inp)))
            };
            let o_proj = linear("self_attn.o_proj", hidden, width)?;
            let fc1 = linear("mlp.fc1", c.intermediate_size, hidden)?;
            let fc2 = linear("mlp.fc2", hidden, c.intermediate_size)?;
            Ok(Layer {
                input_norm,
                qkv: packer.push(&fused),
                qkv_bias: bias.then(|| packer.push(&biases)),
                o_proj,
                o_bias,
                attn_scale,
                post_attention_norm,
                fc1,
                fc2,
                mlp_scale,
            })
        })
        .collect()
}

/// The two residual VQs under `encoder.quantizer.`: the input projections (fused) and the
/// codebooks the geometry keeps, formed as the CPU reference forms them (`embed_sum /
/// clamp(cluster_usage, 1e-5)`, `|e|²` summed in order).
fn load_quantizers(
    t: &Tensors,
    packer: &mut Packer,
    c: &CodecEncoderConfig,
    geometry: &TokenizerEncoderGeometry,
) -> Result<(Option<usize>, Quantizer, Quantizer)> {
    let (dim, size) = (c.vector_quantization_hidden_dimension, c.codebook_size);
    let project = dim != c.hidden_size;
    let mut projections = Vec::new();
    let mut quantizers = Vec::new();
    for &QuantizerGeometry { name, layers } in [&geometry.semantic, &geometry.acoustic] {
        if project {
            let w = t.get(
                &format!("{name}.input_proj.weight"),
                &[dim, c.hidden_size, 1],
            )?;
            projections.push(transpose(&w, dim, c.hidden_size));
        }
        let mut codebooks = Vec::with_capacity(layers * dim * size);
        let mut norms = Vec::with_capacity(layers * size);
        for q in 0..layers {
            let book = format!("{name}.layers.{q}.codebook");
            let sum = t.get(&format!("{book}.embed_sum"), &[size, dim])?;
            let usage = t.get(&format!("{book}.cluster_usage"), &[size])?;
            let embed: Vec<f32> = sum
                .chunks_exact(dim)
                .zip(&usage)
                .flat_map(|(row, u)| {
                    let u = u.max(CLUSTER_USAGE_MIN);
                    row.iter().map(move |v| v / u)
                })
                .collect();
            norms.extend(
                embed
                    .chunks_exact(dim)
                    .map(|row| row.iter().fold(0.0f32, |acc, v| acc + v * v)),
            );
            codebooks.extend(transpose(&embed, size, dim));
        }
        quantizers.push(Quantizer {
            codebooks: packer.push(&codebooks),
            norms: packer.push(&norms),
            layers,
        });
    }
    // Side by side: row r of the fused matrix is row r of the semantic then the acoustic one.
    let input_proj = project.then(|| {
        let mut fused = Vec::with_capacity(2 * dim * c.hidden_size);
        for row in 0..c.hidden_size {
            for p in &projections {
                fused.extend_from_slice(&p[row * dim..(row + 1) * dim]);
            }
        }
        packer.push(&fused)
    });
    let acoustic = quantizers.pop().context("internal: two quantizers")?;
    let semantic = quantizers.pop().context("internal: two quantizers")?;
    Ok((input_proj, semantic, acoustic))
}
