//! `CudaCodec`: the streaming codec decoder (codes to 24 kHz waveform) on the GPU, in f32,
//! behind [`CodecBackend`]. It computes what the CPU reference
//! (`voxkernel_core::reference::codec_decoder`) computes, layer by layer, with the same
//! per-stream state: conv histories, the transposed-conv overlap, a post-RoPE K/V window per
//! transformer layer and the next absolute position.
//!
//! One `decode` call batches every listed stream into the same launches: frames of all streams
//! are laid side by side (each stream's rows behind its own history rows, see
//! `kernels/codec.cu`), so 16 streams cost about as many launches as one. Everything is allocated
//! in [`CudaCodec::new`]; a decode call only copies its codes in and its samples out.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{Context, Result, bail, ensure};
use cudarc::driver::sys::{
    CUdevice_attribute, CUevent_flags, CUfunction_attribute, CUgraphInstantiate_flags,
    CUstreamCaptureMode,
};
use cudarc::driver::{
    CudaEvent, CudaFunction, CudaGraph, CudaModule, CudaSlice, CudaStream, LaunchConfig,
    PinnedHostSlice, PushKernelArg,
};
use voxkernel_core::backend::{CodecBackend, CodecSlot, Frame, NUM_CODE_GROUPS};
use voxkernel_core::checkpoint::{Checkpoint, SafetensorsFile};
use voxkernel_core::config::{CodecDecoderConfig, SpeechTokenizerConfig};

use crate::runtime::{self, device_ptr, zeros};

/// Frames of one stream per pass, and so the most attention blocks of one (head, stream): one
/// per new query. The K/V ring keeps `window + 15` rows so a pass never overwrites a key one of
/// its own queries needs.
const MAX_PASS_FRAMES_PER_ENTRY: usize = 16;
/// Limits of the attention kernel's shared arrays (`MAX_HEAD_DIM`, `MAX_WINDOW`).
const MAX_HEAD_DIM: usize = 128;
const MAX_WINDOW: usize = 128;
/// Output samples per block of the final conv (`FINAL_ROWS`).
const FINAL_ROWS: usize = 64;
/// Columns per block of the few-rows kernel (`SK_COLS`), and the least depth per split.
const SKINNY_COLS: usize = 32;
const SKINNY_MIN_SPLIT_DEPTH: usize = 256;
/// GEMM tile width and depth chunk (`BN`, `BK`), threads per GEMM block.
const GEMM_BN: usize = 64;
const GEMM_BK: usize = 16;
pub(crate) const GEMM_THREADS: u32 = 256;
/// Split-depth scratch: partial tiles and per-tile arrival counters.
pub(crate) const SPLIT_WORKSPACE_FLOATS: usize = 1 << 22;
pub(crate) const SPLIT_COUNTERS: usize = 4096;
/// Depth splits: at most this many, each at least this deep.
const MAX_SPLITS: usize = 32;
const MIN_SPLIT_DEPTH: usize = 64;
/// Blocks per layer in the history copy (`gridDim.z`).
const HISTORY_CHUNKS: u32 = 16;
/// Shared memory a kernel may use without opting in.
const DEFAULT_SMEM_BYTES: usize = 48 * 1024;

/// Kernel sizes and constants fixed by the official module definitions (as in the CPU reference).
const PRE_CONV_KERNEL: usize = 3;
const CONV_KERNEL: usize = 7;
const RESIDUAL_DILATIONS: [usize; 3] = [1, 3, 9];
const CONVNEXT_LAYER_NORM_EPS: f32 = 1e-6;
const CLUSTER_USAGE_MIN: f32 = 1e-5;

pub(crate) const ACT_NONE: i32 = 0;
const ACT_RMS: i32 = 1;
pub(crate) const ACT_ELU: i32 = 2;
pub(crate) const ACT_TANH: i32 = 3;
pub(crate) const EPI_NONE: i32 = 0;
pub(crate) const EPI_GELU: i32 = 1;
const EPI_SILU_GATE: i32 = 2;
pub(crate) const EPI_RESIDUAL: i32 = 3;
pub(crate) const EPI_RELU: i32 = 4;

/// Sizes fixed at construction.
#[derive(Debug, Clone, Copy)]
pub struct CudaCodecOptions {
    /// Streams open at once; each keeps its histories and K/V window on the device.
    pub max_streams: usize,
    /// Frames per internal pass over all streams of a `decode` call (larger calls take several
    /// passes). Sizes the activation buffers: roughly 12 MB per frame at full size.
    pub max_pass_frames: usize,
    /// Replay each pass shape (frames, streams) as a CUDA graph captured on first use, instead
    /// of issuing its launches one by one.
    pub graphs: bool,
    /// Matrix products planned over at most this many rows (frames x rows per frame) use the
    /// few-rows kernel (weights streamed straight from memory); larger ones the tiled kernels.
    /// The default, 4, is where it measured faster on an H200 for one frame of one stream (its
    /// transformer, upsample stages, `decoder.0` and first transposed conv). With the default
    /// `plan_frames` every full-size product is planned over 8 rows or more, so the few-rows
    /// kernel serves one-frame plans (`plan_frames: 1`, or passes of one frame when
    /// `batch_invariant` is off).
    pub skinny_rows: usize,
    /// Fix each matrix product's kernel and depth split from one shape (`plan_frames`), so a
    /// stream's sums are added in the same order whatever shares its passes: its samples are
    /// then bit for bit those of its solo decode (with the same calls). Off, the plan follows
    /// each pass's row count, and a stream beside others can land a rounding step away from its
    /// solo run.
    pub batch_invariant: bool,
    /// Batch-invariant plans are made for a pass of this many frames of one stream. One frame
    /// suits a stream's first packet best; more suits the many-frame passes that follow
    /// (fewer, deeper depth splits, and the tiled kernels where one frame alone would take the
    /// few-rows one). The default, 8, trades a slower first packet for faster steady streaming
    /// (measured on an H100 in docs/codec.md, "Plans for eight frames, session 24").
    pub plan_frames: usize,
    /// Let products that allow it (input read as stored, widths multiples of 16 and 4) use the
    /// pipelined tiled kernel, which gives the same sums bit for bit; off only to compare.
    pub pipelined: bool,
    /// The arithmetic of the pipelined products (`pipelined` on). [`CodecPrecision::F32`]
    /// keeps the decode within f32 noise of the CPU reference; [`CodecPrecision::Tf32`] trades
    /// accuracy for speed (docs/codec.md, "TF32 mode").
    pub precision: CodecPrecision,
}

/// How the pipelined products (the decoder's big convolutions) multiply.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CodecPrecision {
    /// f32 multiply-adds on the CUDA cores: the same sums as the other f32 kernels.
    #[default]
    F32,
    /// The tensor cores: operands rounded to TF32 (10-bit mantissa), f32 sums. Batch
    /// invariance still holds (a stream's samples do not depend on what shares its passes).
    Tf32,
}

impl Default for CudaCodecOptions {
    fn default() -> Self {
        Self {
            max_streams: 16,
            max_pass_frames: 32,
            graphs: true,
            skinny_rows: 4,
            batch_invariant: true,
            plan_frames: 8,
            pipelined: true,
            precision: CodecPrecision::F32,
        }
    }
}

/// Graphs kept at most; a pass shape beyond that clears them (steady serving repeats a few).
const MAX_GRAPHS: usize = 64;

/// A captured pass. Its handles are used only through `&mut CudaCodec`, so never from two
/// threads at once, which is all CUDA asks of graph objects.
struct PassGraph(CudaGraph);

// SAFETY: CUDA graph and graph-exec handles may be used from any thread provided calls on them
// are serialized; `CudaCodec` owns them exclusively and touches them only through `&mut self`.
unsafe impl Send for PassGraph {}

// ---- kernel parameter blocks: `#[repr(C)]` mirrors of the structs in kernels/codec.cu ----

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Batch {
    pub(crate) frame_entry: u64,
    pub(crate) entry_frame0: u64,
    pub(crate) entry_frames: u64,
    pub(crate) entry_slot: u64,
    pub(crate) entry_pos0: u64,
    pub(crate) codes: u64,
    pub(crate) rope_cos: u64,
    pub(crate) rope_sin: u64,
    pub(crate) frames: i32,
    pub(crate) entries: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct HistLayer {
    buf: u64,
    channels: i32,
    hist: i32,
    rate: i32,
    state_offset: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct HistParams {
    layers: u64,
    state: u64,
    state_stride: i32,
    save: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RvqParams {
    tables: u64,
    out: u64,
    codebook_size: i32,
    dim: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct GemmParams {
    pub(crate) input: u64,
    pub(crate) w: u64,
    pub(crate) bias: u64,
    pub(crate) out: u64,
    pub(crate) res: u64,
    pub(crate) col_scale: u64,
    pub(crate) act_w: u64,
    pub(crate) out_freq: u64,
    pub(crate) out_inv: u64,
    pub(crate) out2: u64,
    pub(crate) out2_freq: u64,
    pub(crate) out2_inv: u64,
    pub(crate) workspace: u64,
    pub(crate) counters: u64,
    pub(crate) m: i32,
    pub(crate) n: i32,
    pub(crate) k: i32,
    pub(crate) rate: i32,
    pub(crate) cin: i32,
    pub(crate) taps: i32,
    pub(crate) dilation: i32,
    pub(crate) in_hist: i32,
    pub(crate) out_width: i32,
    pub(crate) out_hist: i32,
    pub(crate) out_stride: i32,
    pub(crate) out2_hist: i32,
    pub(crate) res_hist: i32,
    pub(crate) bias_len: i32,
    pub(crate) act: i32,
    pub(crate) epi: i32,
    pub(crate) eps: f32,
    pub(crate) k_split: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct AttnParams {
    qkv: u64,
    out: u64,
    k_ring: u64,
    v_ring: u64,
    slot_stride: i32,
    ring: i32,
    width: i32,
    head_dim: i32,
    window: i32,
    scale: f32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DwNormParams {
    input: u64,
    out: u64,
    w: u64,
    bias: u64,
    norm_w: u64,
    norm_b: u64,
    channels: i32,
    taps: i32,
    rate: i32,
    eps: f32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct FinalParams {
    input: u64,
    out: u64,
    w: u64,
    bias: f32,
    channels: i32,
    taps: i32,
    rate: i32,
    rows: i32,
}

// Kernel parameters, each mirroring its struct in kernels/codec.cu (`HistLayer` is also copied to
// the device as an array).
kernel_params!(
    Batch,
    HistLayer,
    HistParams,
    RvqParams,
    GemmParams,
    AttnParams,
    DwNormParams,
    FinalParams,
);

// ---- the decoder's shape ----

/// The decoder's sizes, checked against what the kernels support.
#[derive(Debug, Clone)]
struct Dims {
    codebook_size: usize,
    codebook_dim: usize,
    latent: usize,
    hidden: usize,
    inter: usize,
    heads: usize,
    head_dim: usize,
    layers: usize,
    eps: f32,
    rope_theta: f64,
    window: usize,
    upsampling_ratios: Vec<usize>,
    upsample_rates: Vec<usize>,
    decoder_dim: usize,
    samples_per_frame: usize,
}

impl Dims {
    fn new(config: &SpeechTokenizerConfig) -> Result<Self> {
        let d: &CodecDecoderConfig = &config.decoder_config;
        let dims = Self {
            codebook_size: d.codebook_size,
            codebook_dim: d.codebook_dim,
            latent: d.latent_dim,
            hidden: d.hidden_size,
            inter: d.intermediate_size,
            heads: d.num_attention_heads,
            head_dim: d.head_dim,
            layers: d.num_hidden_layers,
            eps: d.rms_norm_eps as f32,
            rope_theta: d.rope_theta,
            window: d.sliding_window,
            upsampling_ratios: d.upsampling_ratios.clone(),
            upsample_rates: d.upsample_rates.clone(),
            decoder_dim: d.decoder_dim,
            samples_per_frame: config.samples_per_frame(),
        };
        ensure!(
            d.num_quantizers == NUM_CODE_GROUPS,
            "decoder_config.num_quantizers is {}, but frames carry {NUM_CODE_GROUPS} codebooks",
            d.num_quantizers
        );
        ensure!(
            d.codebook_dim.is_multiple_of(2),
            "decoder_config.codebook_dim must be even, got {}",
            d.codebook_dim
        );
        ensure!(
            d.num_key_value_heads == d.num_attention_heads,
            "decoder_config.num_key_value_heads must equal num_attention_heads"
        );
        ensure!(
            dims.head_dim.is_multiple_of(4) && dims.head_dim <= MAX_HEAD_DIM,
            "decoder_config.head_dim {}: the CUDA codec supports multiples of 4 up to {MAX_HEAD_DIM}",
            dims.head_dim
        );
        ensure!(
            (1..=MAX_WINDOW).contains(&dims.window),
            "decoder_config.sliding_window {}: the CUDA codec supports 1..={MAX_WINDOW}",
            dims.window
        );
        ensure!(
            dims.decoder_dim
                .is_multiple_of(1 << dims.upsample_rates.len()),
            "decoder_config.decoder_dim {} does not halve {} times",
            dims.decoder_dim,
            dims.upsample_rates.len()
        );
        ensure!(
            !dims.upsampling_ratios.is_empty() && !dims.upsample_rates.is_empty(),
            "decoder_config needs at least one upsampling ratio and one upsample rate"
        );
        let upsampling: usize = dims
            .upsample_rates
            .iter()
            .chain(&dims.upsampling_ratios)
            .product();
        ensure!(
            upsampling == dims.samples_per_frame,
            "decoder_config upsampling {upsampling} != decode_upsample_rate {}",
            dims.samples_per_frame
        );
        ensure!(
            dims.samples_per_frame.is_multiple_of(FINAL_ROWS),
            "decode_upsample_rate {} must be a multiple of {FINAL_ROWS} for the CUDA codec",
            dims.samples_per_frame
        );
        ensure!(
            4 * (FINAL_ROWS + CONV_KERNEL - 1) * dims.output_dim() <= DEFAULT_SMEM_BYTES
                && 4 * dims.latent <= DEFAULT_SMEM_BYTES,
            "decoder widths too large for the CUDA codec's shared-memory stages"
        );
        Ok(dims)
    }

    fn width(&self) -> usize {
        self.heads * self.head_dim
    }

    fn output_dim(&self) -> usize {
        self.decoder_dim >> self.upsample_rates.len()
    }

    /// `inv_freq[i] = theta^(-2i / head_dim)`, as the CPU reference computes it (in f32).
    fn inverse_frequencies(&self) -> Vec<f32> {
        (0..self.head_dim / 2)
            .map(|i| {
                let exponent = (2 * i) as f32 / self.head_dim as f32;
                1.0 / (self.rope_theta as f32).powf(exponent)
            })
            .collect()
    }
}

// ---- weights: read from the f32 safetensors and rearranged for the kernels ----

/// The tensors under `decoder.` of the speech tokenizer file, checked against their shapes.
struct Source<'a> {
    file: &'a SafetensorsFile,
}

impl Source<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let full = format!("decoder.{name}");
        let (data, actual) = self
            .file
            .f32(&full)
            .with_context(|| format!("{}: tensor {full}", self.file.path().display()))?;
        ensure!(
            actual == shape,
            "{}: tensor {full} has shape {actual:?}, the config implies {shape:?}",
            self.file.path().display()
        );
        Ok(data)
    }
}

/// Host staging of the packed weight buffer; offsets (in floats) are 64-float aligned so every
/// matrix row the GEMM reads as float4 is 16-byte aligned.
#[derive(Default)]
pub(crate) struct Packer {
    pub(crate) data: Vec<f32>,
}

impl Packer {
    pub(crate) fn push(&mut self, values: &[f32]) -> usize {
        let offset = self.data.len().next_multiple_of(64);
        self.data.resize(offset, 0.0);
        self.data.extend_from_slice(values);
        offset
    }
}

/// `[rows, cols]` to `[cols, rows]`.
pub(crate) fn transpose(w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0.0; w.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = w[r * cols + c];
        }
    }
    t
}

/// Conv1d `[out, in, k]` to the GEMM's `[k * in, out]` (row `j * in + i`, tap 0 oldest), as
/// `CausalConv::new` arranges it.
pub(crate) fn conv_weight(w: &[f32], out: usize, inp: usize, k: usize) -> Vec<f32> {
    let mut g = vec![0.0; w.len()];
    for o in 0..out {
        for i in 0..inp {
            for j in 0..k {
                g[(j * inp + i) * out + o] = w[(o * inp + i) * k + j];
            }
        }
    }
    g
}

/// ConvTranspose1d `[in, out, m * stride]` to `[m * in, stride * out]`: GEMM tap `j` reads input
/// row `t - (m - 1) + j`, which kernel tap `(m - 1 - j) * stride + p` maps to output row
/// `t * stride + p` (the arrangement of `CausalTransConv::new`, taps in time order).
fn transposed_conv_weight(
    w: &[f32],
    inp: usize,
    out: usize,
    kernel: usize,
    stride: usize,
) -> Vec<f32> {
    let m = kernel / stride;
    let mut g = vec![0.0; w.len()];
    for j in 0..m {
        for c in 0..inp {
            for p in 0..stride {
                for o in 0..out {
                    let tap = (m - 1 - j) * stride + p;
                    g[(j * inp + c) * stride * out + p * out + o] = w[(c * out + o) * kernel + tap];
                }
            }
        }
    }
    g
}

/// SnakeBeta parameters as the CPU reference precomputes them: `exp(alpha)` and
/// `1 / (exp(beta) + 1e-9)`.
fn snake_params(alpha: &[f32], beta: &[f32]) -> (Vec<f32>, Vec<f32>) {
    (
        alpha.iter().map(|a| a.exp()).collect(),
        beta.iter().map(|b| 1.0 / (b.exp() + 1e-9)).collect(),
    )
}

// ---- the launch plan ----

/// A layer input: per entry, `hist` history rows then `rate` new rows per frame, `width` wide.
#[derive(Debug, Clone, Copy)]
struct Seg {
    ptr: u64,
    width: usize,
    hist: usize,
    rate: usize,
}

/// RMSNorm applied to a GEMM's input rows as they are loaded (weight offset in the packed
/// buffer).
#[derive(Debug, Clone, Copy)]
enum Act {
    None,
    Rms { weight: usize },
}

/// SnakeBeta applied to a GEMM's output as it is stored: offsets of `exp(alpha)` and
/// `1 / (exp(beta) + 1e-9)`.
#[derive(Debug, Clone, Copy)]
struct Snake {
    frequency: usize,
    inv_magnitude: usize,
}

#[derive(Debug, Clone, Copy)]
enum Epi {
    None,
    Gelu,
    SiluGate,
    Residual { res: Seg, scale: Option<usize> },
}

#[derive(Debug, Clone, Copy)]
struct GemmOp {
    input: Seg,
    taps: usize,
    dilation: usize,
    act: Act,
    w: usize,
    n: usize,
    bias: Option<usize>,
    bias_len: usize,
    epi: Epi,
    out: Seg,
    out_stride: usize,
    /// Stores `snake(value)` into `out` instead of the value.
    out_snake: Option<Snake>,
    /// Also stores `snake(value)` into a second segment (same width and rate).
    also: Option<(Seg, Snake)>,
}

#[derive(Debug, Clone, Copy)]
enum Op {
    History {
        save: bool,
    },
    Rvq {
        tables: usize,
        out: Seg,
    },
    Gemm(GemmOp),
    Attention {
        qkv: u64,
        out: u64,
        layer: usize,
    },
    DwNorm {
        input: Seg,
        out: Seg,
        w: usize,
        bias: usize,
        norm_w: usize,
        norm_b: usize,
    },
    Final {
        input: Seg,
        w: usize,
        bias: f32,
    },
}

/// Builds the launch plan: reads and rearranges the weights (packed on the host, uploaded
/// afterwards, so ops refer to them by offset) and allocates every layer input for
/// `frames_cap` frames and `entries_cap` streams per pass.
struct Planner<'a> {
    src: Source<'a>,
    stream: &'a Arc<CudaStream>,
    frames_cap: usize,
    entries_cap: usize,
    packer: Packer,
    activations: Vec<CudaSlice<f32>>,
    ops: Vec<Op>,
    /// Segments with history rows, in the order their state is laid out per stream.
    history: Vec<Seg>,
}

impl Planner<'_> {
    fn seg(&mut self, width: usize, hist: usize, rate: usize, what: &str) -> Result<Seg> {
        let rows = self.frames_cap * rate + self.entries_cap * hist;
        let buf = zeros::<f32>(self.stream, rows * width, what)?;
        let seg = Seg {
            ptr: device_ptr(&buf, self.stream),
            width,
            hist,
            rate,
        };
        self.activations.push(buf);
        if hist > 0 {
            self.history.push(seg);
        }
        Ok(seg)
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<usize> {
        Ok(self.packer.push(&self.src.tensor(name, &[len])?))
    }

    /// `name.weight` `[out, in]` as `[in, out]`, and `name.bias` when `bias`.
    fn linear(
        &mut self,
        name: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<(usize, Option<usize>)> {
        let w = self.src.tensor(&format!("{name}.weight"), &[out, inp])?;
        let w = self.packer.push(&transpose(&w, out, inp));
        let b = match bias {
            true => Some(self.vector(&format!("{name}.bias"), out)?),
            false => None,
        };
        Ok((w, b))
    }

    /// SnakeBeta `name`.
    fn snake(&mut self, name: &str, channels: usize) -> Result<Snake> {
        let (frequency, inv_magnitude) = snake_params(
            &self.src.tensor(&format!("{name}.alpha"), &[channels])?,
            &self.src.tensor(&format!("{name}.beta"), &[channels])?,
        );
        Ok(Snake {
            frequency: self.packer.push(&frequency),
            inv_magnitude: self.packer.push(&inv_magnitude),
        })
    }

    /// A GEMM over the rows of `input` alone (Linear, 1x1 conv, transposed conv with
    /// kernel == stride).
    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &mut self,
        input: Seg,
        act: Act,
        w: usize,
        n: usize,
        bias: Option<usize>,
        epi: Epi,
        out: Seg,
    ) {
        self.ops.push(Op::Gemm(GemmOp {
            input,
            taps: 1,
            dilation: 1,
            act,
            w,
            n,
            bias,
            bias_len: n,
            epi,
            out,
            out_stride: 1,
            out_snake: None,
            also: None,
        }));
    }

    /// Causal conv `name` (`[out, in, kernel]` + bias) from `input`, whose history rows must
    /// be exactly the conv's left padding.
    #[allow(clippy::too_many_arguments)]
    fn conv(
        &mut self,
        name: &str,
        input: Seg,
        kernel: usize,
        dilation: usize,
        epi: Epi,
        out: Seg,
        out_snake: Option<Snake>,
        also: Option<(Seg, Snake)>,
    ) -> Result<()> {
        let (inp, n) = (input.width, out.width);
        ensure!(
            input.hist == (kernel - 1) * dilation,
            "internal: {name} input keeps {} rows, needs {}",
            input.hist,
            (kernel - 1) * dilation
        );
        let w = self
            .src
            .tensor(&format!("{name}.conv.weight"), &[n, inp, kernel])?;
        let w = self.packer.push(&conv_weight(&w, n, inp, kernel));
        let bias = self.vector(&format!("{name}.conv.bias"), n)?;
        self.ops.push(Op::Gemm(GemmOp {
            input,
            taps: kernel,
            dilation,
            act: Act::None,
            w,
            n,
            bias: Some(bias),
            bias_len: n,
            epi,
            out,
            out_stride: 1,
            out_snake,
            also,
        }));
        Ok(())
    }

    /// Causal transposed conv `name` (`[in, out, kernel]` + bias), stride `stride`, from
    /// `input` (history: the `kernel / stride - 1` overlap rows) into `out` (`stride` rows per
    /// input row).
    fn transposed_conv(
        &mut self,
        name: &str,
        input: Seg,
        kernel: usize,
        stride: usize,
        out: Seg,
        also: Option<(Seg, Snake)>,
    ) -> Result<()> {
        let (inp, width) = (input.width, out.width);
        let taps = kernel / stride;
        ensure!(
            input.hist == taps - 1 && out.rate == input.rate * stride,
            "internal: {name} segments do not match its kernel {kernel} / stride {stride}"
        );
        let w = self
            .src
            .tensor(&format!("{name}.conv.weight"), &[inp, width, kernel])?;
        let w = self
            .packer
            .push(&transposed_conv_weight(&w, inp, width, kernel, stride));
        let bias = self.vector(&format!("{name}.conv.bias"), width)?;
        self.ops.push(Op::Gemm(GemmOp {
            input,
            taps,
            dilation: 1,
            act: Act::None,
            w,
            n: stride * width,
            bias: Some(bias),
            bias_len: width,
            epi: Epi::None,
            out,
            out_stride: stride,
            out_snake: None,
            also,
        }));
        Ok(())
    }

    /// RVQ lookup and projections (`Quantizer::decode`), into the `pre_conv` input.
    fn quantizer(&mut self, dims: &Dims) -> Result<Seg> {
        let (size, half, dim) = (dims.codebook_size, dims.codebook_dim / 2, dims.codebook_dim);
        let mut tables = Vec::with_capacity(NUM_CODE_GROUPS * size * half);
        let layers = std::iter::once(("rvq_first", 0)).chain((0..15).map(|l| ("rvq_rest", l)));
        for (rvq, layer) in layers {
            let codebook = format!("quantizer.{rvq}.vq.layers.{layer}._codebook");
            let sum = self
                .src
                .tensor(&format!("{codebook}.embedding_sum"), &[size, half])?;
            let usage = self
                .src
                .tensor(&format!("{codebook}.cluster_usage"), &[size])?;
            for (row, u) in sum.chunks_exact(half).zip(&usage) {
                let u = u.max(CLUSTER_USAGE_MIN);
                tables.extend(row.iter().map(|v| v / u));
            }
        }
        let tables = self.packer.push(&tables);
        let mut projection = Vec::with_capacity(2 * half * dim);
        for rvq in ["rvq_first", "rvq_rest"] {
            let w = self.src.tensor(
                &format!("quantizer.{rvq}.output_proj.weight"),
                &[dim, half, 1],
            )?;
            projection.extend(transpose(&w, dim, half));
        }
        let projection = self.packer.push(&projection);
        let rows = self.seg(2 * half, 0, 1, "RVQ rows")?;
        self.ops.push(Op::Rvq { tables, out: rows });
        let out = self.seg(dim, PRE_CONV_KERNEL - 1, 1, "pre_conv input")?;
        self.matmul(rows, Act::None, projection, dim, None, Epi::None, out);
        Ok(out)
    }

    /// `pre_transformer` (`PreTransformer::forward`) from `input`; returns its output rows.
    fn transformer(&mut self, dims: &Dims, input: Seg) -> Result<Seg> {
        let (h, width, inter) = (dims.hidden, dims.width(), dims.inter);
        let hidden = self.seg(h, 0, 1, "transformer hidden")?;
        let qkv = self.seg(3 * width, 0, 1, "q|k|v")?;
        let attn = self.seg(width, 0, 1, "attention output")?;
        let mlp = self.seg(inter, 0, 1, "SwiGLU rows")?;
        let t = "pre_transformer";
        let (w, b) = self.linear(&format!("{t}.input_proj"), h, dims.latent, true)?;
        self.matmul(input, Act::None, w, h, b, Epi::None, hidden);
        for layer in 0..dims.layers {
            let l = format!("{t}.layers.{layer}");
            let norm = self.vector(&format!("{l}.input_layernorm.weight"), h)?;
            // q | k | v side by side: one GEMM, columns [0, w) q, [w, 2w) k, [2w, 3w) v.
            let mut parts = Vec::with_capacity(3);
            for p in ["q_proj", "k_proj", "v_proj"] {
                let w = self
                    .src
                    .tensor(&format!("{l}.self_attn.{p}.weight"), &[width, h])?;
                parts.push(transpose(&w, width, h));
            }
            let mut fused = Vec::with_capacity(h * 3 * width);
            for row in 0..h {
                for part in &parts {
                    fused.extend_from_slice(&part[row * width..(row + 1) * width]);
                }
            }
            let fused = self.packer.push(&fused);
            let rms = Act::Rms { weight: norm };
            self.matmul(hidden, rms, fused, 3 * width, None, Epi::None, qkv);
            self.ops.push(Op::Attention {
                qkv: qkv.ptr,
                out: attn.ptr,
                layer,
            });
            let (o, _) = self.linear(&format!("{l}.self_attn.o_proj"), h, width, false)?;
            let scale = self.vector(&format!("{l}.self_attn_layer_scale.scale"), h)?;
            let residual = Epi::Residual {
                res: hidden,
                scale: Some(scale),
            };
            self.matmul(attn, Act::None, o, h, None, residual, hidden);

            let norm = self.vector(&format!("{l}.post_attention_layernorm.weight"), h)?;
            let gate = self
                .src
                .tensor(&format!("{l}.mlp.gate_proj.weight"), &[inter, h])?;
            let up = self
                .src
                .tensor(&format!("{l}.mlp.up_proj.weight"), &[inter, h])?;
            // Columns 2c / 2c + 1 are gate / up output c, so one thread holds both.
            let mut gate_up = vec![0.0; 2 * inter * h];
            for c in 0..inter {
                for k in 0..h {
                    gate_up[k * 2 * inter + 2 * c] = gate[c * h + k];
                    gate_up[k * 2 * inter + 2 * c + 1] = up[c * h + k];
                }
            }
            let gate_up = self.packer.push(&gate_up);
            let rms = Act::Rms { weight: norm };
            self.matmul(hidden, rms, gate_up, 2 * inter, None, Epi::SiluGate, mlp);
            let (down, _) = self.linear(&format!("{l}.mlp.down_proj"), h, inter, false)?;
            let scale = self.vector(&format!("{l}.mlp_layer_scale.scale"), h)?;
            let residual = Epi::Residual {
                res: hidden,
                scale: Some(scale),
            };
            self.matmul(mlp, Act::None, down, h, None, residual, hidden);
        }
        let norm = self.vector(&format!("{t}.norm.weight"), h)?;
        let (w, b) = self.linear(&format!("{t}.output_proj"), dims.latent, h, true)?;
        let out = self.seg(dims.latent, 0, 1, "upsample input")?;
        let rms = Act::Rms { weight: norm };
        self.matmul(hidden, rms, w, dims.latent, b, Epi::None, out);
        Ok(out)
    }

    /// The upsample stages (transposed conv with kernel == stride, then `convnext`); returns
    /// the `decoder.0` input.
    fn upsample(&mut self, dims: &Dims, mut input: Seg) -> Result<Seg> {
        let latent = dims.latent;
        let top_rate: usize = dims.upsampling_ratios.iter().product();
        let normed = self.seg(latent, 0, top_rate, "ConvNeXt normed rows")?;
        let wide = self.seg(4 * latent, 0, top_rate, "ConvNeXt hidden rows")?;
        let stages = dims.upsampling_ratios.len();
        for (i, &factor) in dims.upsampling_ratios.iter().enumerate() {
            let stage = format!("upsample.{i}");
            let block = format!("{stage}.1");
            let rate = input.rate * factor;
            let dw_in = self.seg(latent, CONV_KERNEL - 1, rate, "ConvNeXt input")?;
            self.transposed_conv(&format!("{stage}.0"), input, factor, factor, dw_in, None)?;
            let dw = self.src.tensor(
                &format!("{block}.dwconv.conv.weight"),
                &[latent, 1, CONV_KERNEL],
            )?;
            let normed = Seg { rate, ..normed };
            let op = Op::DwNorm {
                input: dw_in,
                out: normed,
                w: self.packer.push(&transpose(&dw, latent, CONV_KERNEL)),
                bias: self.vector(&format!("{block}.dwconv.conv.bias"), latent)?,
                norm_w: self.vector(&format!("{block}.norm.weight"), latent)?,
                norm_b: self.vector(&format!("{block}.norm.bias"), latent)?,
            };
            self.ops.push(op);
            let wide = Seg { rate, ..wide };
            let (w, b) = self.linear(&format!("{block}.pwconv1"), 4 * latent, latent, true)?;
            self.matmul(normed, Act::None, w, 4 * latent, b, Epi::Gelu, wide);
            let (w, b) = self.linear(&format!("{block}.pwconv2"), latent, 4 * latent, true)?;
            let gamma = self.vector(&format!("{block}.gamma"), latent)?;
            input = match i + 1 < stages {
                true => self.seg(latent, 0, rate, "upsample input")?,
                false => self.seg(latent, CONV_KERNEL - 1, rate, "decoder.0 input")?,
            };
            let residual = Epi::Residual {
                res: dw_in,
                scale: Some(gamma),
            };
            self.matmul(wide, Act::None, w, latent, b, residual, input);
        }
        Ok(input)
    }

    /// `decoder.0`, the blocks (SnakeBeta, transposed conv, residual units) and the final
    /// SnakeBeta + conv + clamp. Every SnakeBeta is applied by the layer before it, as it
    /// stores its output: the block input and the final conv input are only read activated;
    /// a residual unit's input is stored twice (plain for the residual, activated for conv1);
    /// conv1 stores act2 of its output for conv2.
    fn decoder(&mut self, dims: &Dims, input: Seg) -> Result<()> {
        let rates = &dims.upsample_rates;
        let blocks = rates.len();
        let block_act = |this: &mut Self, b: usize| {
            this.snake(&format!("decoder.{}.block.0", b + 1), dims.decoder_dim >> b)
        };
        let first_act = block_act(self, 0)?;
        let mut block_in = self.seg(dims.decoder_dim, 1, input.rate, "block input")?;
        self.conv(
            "decoder.0",
            input,
            CONV_KERNEL,
            1,
            Epi::None,
            block_in,
            Some(first_act),
            None,
        )?;
        // One scratch for every conv1 output (the conv2 input, no history): the widest stage.
        let mut rate = input.rate;
        let mut mid_floats = 0;
        for (b, &r) in rates.iter().enumerate() {
            rate *= r;
            mid_floats = mid_floats.max(rate * (dims.decoder_dim >> (b + 1)));
        }
        let mid = self.seg(mid_floats, 0, 1, "residual-unit rows")?;
        for (b, &rate) in rates.iter().enumerate() {
            let out = dims.decoder_dim >> (b + 1);
            let block = format!("decoder.{}.block", b + 1);
            let out_rate = block_in.rate * rate;
            let unit = |u: usize| format!("{block}.{}", u + 2);
            // Unit u's input: plain (the residual reads only new rows) and activated by its act1
            // (conv1 reads 6 * dilation rows back).
            let mut unit_in = self.seg(out, 0, out_rate, "residual-unit input")?;
            let act1 = self.snake(&format!("{}.act1", unit(0)), out)?;
            let mut unit_act = self.seg(out, CONV_KERNEL - 1, out_rate, "activated unit input")?;
            let name = format!("{block}.1");
            let also = Some((unit_act, act1));
            self.transposed_conv(&name, block_in, 2 * rate, rate, unit_in, also)?;
            let mid = Seg {
                width: out,
                rate: out_rate,
                ..mid
            };
            for (u, &dilation) in RESIDUAL_DILATIONS.iter().enumerate() {
                let act2 = self.snake(&format!("{}.act2", unit(u)), out)?;
                let conv1 = format!("{}.conv1", unit(u));
                let (kernel, epi) = (CONV_KERNEL, Epi::None);
                self.conv(
                    &conv1,
                    unit_act,
                    kernel,
                    dilation,
                    epi,
                    mid,
                    Some(act2),
                    None,
                )?;
                let residual = Epi::Residual {
                    res: unit_in,
                    scale: None,
                };
                let conv2 = format!("{}.conv2", unit(u));
                if let Some(&next) = RESIDUAL_DILATIONS.get(u + 1) {
                    let next_in = self.seg(out, 0, out_rate, "residual-unit input")?;
                    let act1 = self.snake(&format!("{}.act1", unit(u + 1)), out)?;
                    let hist = (CONV_KERNEL - 1) * next;
                    let next_act = self.seg(out, hist, out_rate, "activated unit input")?;
                    let also = Some((next_act, act1));
                    self.conv(&conv2, mid, 1, 1, residual, next_in, None, also)?;
                    (unit_in, unit_act) = (next_in, next_act);
                } else {
                    // The block's output: the next block's input, or the final conv's.
                    let (act, hist, what) = if b + 1 < blocks {
                        (block_act(self, b + 1)?, 1, "block input")
                    } else {
                        let name = format!("decoder.{}", blocks + 1);
                        (self.snake(&name, out)?, CONV_KERNEL - 1, "final conv input")
                    };
                    let next = self.seg(out, hist, out_rate, what)?;
                    self.conv(&conv2, mid, 1, 1, residual, next, Some(act), None)?;
                    block_in = next;
                }
            }
        }
        let out_dim = dims.output_dim();
        let last = format!("decoder.{}", blocks + 2);
        let w = self
            .src
            .tensor(&format!("{last}.conv.weight"), &[1, out_dim, CONV_KERNEL])?;
        let bias = self.src.tensor(&format!("{last}.conv.bias"), &[1])?;
        self.ops.push(Op::Final {
            input: block_in,
            w: self.packer.push(&conv_weight(&w, 1, out_dim, CONV_KERNEL)),
            bias: bias[0],
        });
        Ok(())
    }
}

/// The tiled GEMM kernels `conv_gemm_{16,32,64,128}` (and the folded `conv_gemm_fold_64`),
/// the pipelined `conv_gemm_pipe_128` (and `conv_gemm_pipe_fold_128`; their TF32 forms
/// `conv_gemm_pipe_tf32_*` in [`CodecPrecision::Tf32`]), and how to shape a launch of them; the
/// voice encoders (`crate::encoder`) use them too.
pub(crate) struct TiledGemm {
    /// Tile height, function, blocks resident per SM.
    kernels: Vec<(usize, CudaFunction, usize)>,
    /// `conv_gemm_fold_64` and its blocks resident per SM.
    folded: (CudaFunction, usize),
    /// The pipelined kernel and its folded form, each with its blocks resident per SM.
    piped: [(CudaFunction, usize); 2],
    /// The cost model's price of a multiply-add in `piped`.
    pipe_per_mac: f64,
    sms: usize,
}

/// The folded kernel's tile height.
const FOLD_BM: usize = 64;
/// The pipelined kernels' tile height (`PIPE_BM`).
const PIPE_BM: usize = 128;
/// The cost model's price of a multiply-add in the pipelined kernel, relative to
/// `conv_gemm_128`'s 1.0. Set before measuring, not tuned: with it the plans give the
/// pipelined kernel the deep convs of passes of 8 frames or more (14-21 of a pass's 71
/// products, measured from 8 to 128 frames; none in one stream's one-frame pass), which ran
/// at 20-32 TFLOP/s where the older tiled kernels reached 12-20 (docs/codec.md, session 24).
const PIPE_PER_MAC: f64 = 0.5;
/// The same price for the TF32 pipelined kernel: a guess set before the first measurement (the
/// multiply-adds cost next to nothing on the tensor cores; copying the operands remains). With
/// it the plans give the TF32 kernel 18 of a pass's 85 launches at every shape measured, and a
/// call took 15-26% less than in f32 on an H100 (docs/codec.md, "TF32 mode").
const PIPE_TF32_PER_MAC: f64 = 0.25;

impl TiledGemm {
    pub(crate) fn load(
        module: &Arc<CudaModule>,
        sms: usize,
        precision: CodecPrecision,
    ) -> Result<Self> {
        let load = |name: String| -> Result<(CudaFunction, usize)> {
            let f = module.load_function(&name)?;
            let resident =
                f.occupancy_max_active_blocks_per_multiprocessor(GEMM_THREADS, 0, None)?;
            Ok((f, resident as usize))
        };
        let tf32 = match precision {
            CodecPrecision::F32 => "",
            CodecPrecision::Tf32 => "_tf32",
        };
        Ok(Self {
            kernels: [16, 32, 64, 128]
                .into_iter()
                .map(|bm| load(format!("conv_gemm_{bm}")).map(|(f, r)| (bm, f, r)))
                .collect::<Result<_>>()?,
            folded: load(format!("conv_gemm_fold_{FOLD_BM}"))?,
            piped: [
                load(format!("conv_gemm_pipe{tf32}_{PIPE_BM}"))?,
                load(format!("conv_gemm_pipe{tf32}_fold_{PIPE_BM}"))?,
            ],
            pipe_per_mac: match precision {
                CodecPrecision::F32 => PIPE_PER_MAC,
                CodecPrecision::Tf32 => PIPE_TF32_PER_MAC,
            },
            sms,
        })
    }

    /// The kernels a plan may pick: `conv_gemm_{bm}` unless `pipe` is `Always`, and the
    /// pipelined kernel unless it is `Never`. Tile height, blocks resident per SM, pipelined.
    fn candidates(&self, pipe: PipeUse) -> impl Iterator<Item = (usize, usize, bool)> + '_ {
        let piped = (pipe != PipeUse::Never).then_some((PIPE_BM, self.piped[0].1, true));
        let plain = self.kernels.iter().filter(move |_| pipe != PipeUse::Always);
        plain
            .map(|&(bm, _, resident)| (bm, resident, false))
            .chain(piped)
    }

    /// Kernel, tile height, depth splits and depth per split: the cheapest under a rough cost
    /// model, where blocks run in waves of what fits on the GPU at once, and a block costs its
    /// multiply-adds (dearer per multiply-add in short tiles, which reload more operands, and
    /// cheaper in the pipelined kernel), a fixed start-up, and when the depth is split, writing
    /// and re-reading its partial tile.
    pub(crate) fn plan(&self, m: usize, n: usize, k: usize, pipe: PipeUse) -> GemmKernel {
        let mut best = (f64::INFINITY, 16, false, 1, k.next_multiple_of(GEMM_BK));
        for (bm, resident, piped) in self.candidates(pipe) {
            let tiles = m.div_ceil(bm) * n.div_ceil(GEMM_BN);
            for wanted in 1..=(k / MIN_SPLIT_DEPTH).clamp(1, MAX_SPLITS) {
                let k_split = k.div_ceil(wanted).next_multiple_of(GEMM_BK);
                let splits = k.div_ceil(k_split);
                let room = tiles <= SPLIT_COUNTERS
                    && tiles * splits * bm * GEMM_BN <= SPLIT_WORKSPACE_FLOATS;
                if splits > 1 && !room {
                    break;
                }
                let cost = self.cost(bm, resident, piped, m, n, k_split, splits);
                if cost < best.0 {
                    best = (cost, bm, piped, splits, k_split);
                }
            }
        }
        GemmKernel::Tiled {
            bm: best.1,
            pipe: best.2,
            splits: best.3,
            k_split: best.4,
            fold: false,
        }
    }

    /// A launch that keeps a given depth split (batch-invariant plans fix the split): folded
    /// when its tiles alone make one and a half waves of blocks or more (128-row pipelined
    /// tiles where `pipe` allows, else 64-row ones), else split across blocks at the cheapest
    /// kernel `pipe` allows. Measured on an H100 for the 64-row tiles (docs/codec.md): folding
    /// took 8-31% off every product of the codec whose folded grid had 768 tiles or more; with
    /// fewer tiles the split launch's many blocks keep more SMs busy, and folding cost up to
    /// 3.4x (256 rows).
    /// The pipelined tiles follow the same rule, not measured on its own.
    pub(crate) fn keep_split(
        &self,
        m: usize,
        n: usize,
        k_split: usize,
        splits: usize,
        pipe: PipeUse,
    ) -> GemmKernel {
        let waves = |bm: usize, resident: usize| {
            2 * m.div_ceil(bm) * n.div_ceil(GEMM_BN) >= 3 * resident * self.sms
        };
        let folded = |bm, pipe| GemmKernel::Tiled {
            bm,
            pipe,
            splits,
            k_split,
            fold: true,
        };
        if splits > 1 && pipe != PipeUse::Never && waves(PIPE_BM, self.piped[1].1) {
            return folded(PIPE_BM, true);
        }
        if splits > 1 && pipe != PipeUse::Always && waves(FOLD_BM, self.folded.1) {
            return folded(FOLD_BM, false);
        }
        let (bm, pipe) = self
            .candidates(pipe)
            .map(|(bm, resident, piped)| {
                let cost = self.cost(bm, resident, piped, m, n, k_split, splits);
                (cost, bm, piped)
            })
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .map_or((16, false), |(_, bm, piped)| (bm, piped));
        GemmKernel::Tiled {
            bm,
            pipe,
            splits,
            k_split,
            fold: false,
        }
    }

    /// The cost model of [`Self::plan`] for one shape.
    #[allow(clippy::too_many_arguments)]
    fn cost(
        &self,
        bm: usize,
        resident: usize,
        pipe: bool,
        m: usize,
        n: usize,
        k_split: usize,
        splits: usize,
    ) -> f64 {
        let tiles = m.div_ceil(bm) * n.div_ceil(GEMM_BN);
        let slots = (resident * self.sms).max(1);
        let per_mac = match bm {
            _ if pipe => self.pipe_per_mac,
            128 => 1.0,
            64 => 1.2,
            32 => 1.5,
            _ => 2.2,
        };
        let partial = if splits > 1 { 32.0 } else { 0.0 };
        let depth = k_split as f64 * per_mac + 48.0 + partial;
        let waves = (tiles * splits).div_ceil(slots) as f64;
        waves * (bm * GEMM_BN) as f64 * depth
    }

    /// The function of a tiled plan and its grid for `m x n` outputs (one block per tile when
    /// folded, else one per tile and depth split).
    pub(crate) fn function(
        &self,
        plan: GemmKernel,
        m: usize,
        n: usize,
    ) -> Option<(&CudaFunction, (usize, usize, usize))> {
        let GemmKernel::Tiled {
            bm,
            pipe,
            splits,
            fold,
            ..
        } = plan
        else {
            return None;
        };
        let grid = |z| (n.div_ceil(GEMM_BN), m.div_ceil(bm), z);
        match (pipe, fold) {
            (true, _) if bm != PIPE_BM => None,
            (true, false) => Some((&self.piped[0].0, grid(splits))),
            (true, true) => Some((&self.piped[1].0, grid(1))),
            (false, true) => (bm == FOLD_BM).then_some((&self.folded.0, grid(1))),
            (false, false) => {
                let (_, f, _) = self.kernels.iter().find(|(height, ..)| *height == bm)?;
                Some((f, grid(splits)))
            }
        }
    }
}

struct Kernels {
    history: CudaFunction,
    rvq: CudaFunction,
    gemm: TiledGemm,
    /// `skinny_gemm_{4,16}`: rows per block, function, blocks resident per SM.
    skinny: Vec<(usize, CudaFunction, usize)>,
    attention: CudaFunction,
    dwnorm: CudaFunction,
    final_conv: CudaFunction,
}

/// Which tiled kernels a product may run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PipeUse {
    /// `conv_gemm_*` only (the product's input is normed or activated on load, or its widths
    /// do not allow 16-byte copies).
    Never,
    /// Any: in f32 they all give the same bits.
    Allowed,
    /// The pipelined kernel only: its TF32 sums differ from the f32 kernels', so a
    /// batch-invariant plan that picked it keeps it on passes of every size.
    Always,
}

/// How one GEMM launch is shaped.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum GemmKernel {
    /// `skinny_gemm_{rows}`: `rows` rows x 32 columns per block, the depth split in `splits`
    /// parts of `k_split`.
    Skinny {
        rows: usize,
        splits: usize,
        k_split: usize,
    },
    /// `conv_gemm_{bm}` (with `pipe`, `conv_gemm_pipe_{bm}`): `bm` x 64 tiles, the depth split
    /// in `splits` parts of `k_split`; with `fold`, `conv_gemm_fold_{bm}` (or
    /// `conv_gemm_pipe_fold_{bm}`): each block adds up every split itself.
    Tiled {
        bm: usize,
        pipe: bool,
        splits: usize,
        k_split: usize,
        fold: bool,
    },
}

/// Word offsets of the per-pass tables inside the one buffer uploaded per pass.
#[derive(Debug, Clone, Copy)]
struct TableLayout {
    frame_entry: usize,
    entry_frame0: usize,
    entry_frames: usize,
    entry_slot: usize,
    entry_pos0: usize,
    codes: usize,
    rope_cos: usize,
    rope_sin: usize,
    len: usize,
}

impl TableLayout {
    fn new(frames: usize, entries: usize, half_head_dim: usize) -> Self {
        let frame_entry = 0;
        let entry_frame0 = frame_entry + frames;
        let entry_frames = entry_frame0 + entries;
        let entry_slot = entry_frames + entries;
        let entry_pos0 = entry_slot + entries;
        let codes = entry_pos0 + entries;
        let rope_cos = codes + frames * NUM_CODE_GROUPS;
        let rope_sin = rope_cos + frames * half_head_dim;
        Self {
            frame_entry,
            entry_frame0,
            entry_frames,
            entry_slot,
            entry_pos0,
            codes,
            rope_cos,
            rope_sin,
            len: rope_sin + frames * half_head_dim,
        }
    }
}

/// An open stream: its device slot and the frames decoded so far (its next RoPE position).
#[derive(Debug, Clone, Copy)]
struct Stream {
    slot: usize,
    frames: usize,
}

/// One entry of a pass: `frames` frames of batch entry `index`, from its frame `first`.
#[derive(Debug, Clone, Copy)]
struct PassEntry {
    index: usize,
    first: usize,
    frames: usize,
}

/// Device buffers that only need to outlive the pointers baked into the plan.
struct Owned {
    _weights: CudaSlice<f32>,
    _activations: Vec<CudaSlice<f32>>,
    _hist_layers: CudaSlice<HistLayer>,
    _counters: CudaSlice<u32>,
    _workspace: CudaSlice<f32>,
    _kv: CudaSlice<f32>,
}

pub struct CudaCodec {
    stream: Arc<CudaStream>,
    kernels: Kernels,
    ops: Vec<Op>,
    dims: Dims,
    options: CudaCodecOptions,
    weights: u64,
    hist: HistParams,
    hist_layer_count: u32,
    state: CudaSlice<f32>,
    k_ring: u64,
    v_ring: u64,
    ring: usize,
    kv_slot_stride: usize,
    workspace: u64,
    counters: u64,
    tables: CudaSlice<u32>,
    tables_host: PinnedHostSlice<u32>,
    layout: TableLayout,
    batch_base: Batch,
    wav: CudaSlice<f32>,
    wav_ptr: u64,
    wav_host: PinnedHostSlice<f32>,
    inverse_frequencies: Vec<f32>,
    sms: usize,
    device_name: String,
    streams: HashMap<CodecSlot, Stream>,
    graphs: HashMap<(usize, usize), PassGraph>,
    free_slots: Vec<usize>,
    next_id: usize,
    _owned: Owned,
}

/// Rows per block of the few-rows kernel for `m` rows (`skinny_gemm_{4,16}`).
fn skinny_height(m: usize) -> usize {
    if m <= 4 { 4 } else { 16 }
}

impl CudaCodec {
    pub fn from_checkpoint(checkpoint: &Checkpoint, options: CudaCodecOptions) -> Result<Self> {
        Self::new(
            &checkpoint.speech_tokenizer_config,
            &checkpoint.speech_tokenizer,
            options,
        )
    }

    /// From a speech tokenizer config and its f32 `model.safetensors`, like
    /// `CodecDecoder::load`.
    pub fn new(
        config: &SpeechTokenizerConfig,
        file: &SafetensorsFile,
        options: CudaCodecOptions,
    ) -> Result<Self> {
        ensure!(options.max_streams > 0, "max_streams must be at least 1");
        ensure!(
            options.max_pass_frames > 0,
            "max_pass_frames must be at least 1"
        );
        ensure!(options.plan_frames > 0, "plan_frames must be at least 1");
        let dims = Dims::new(config)?;
        let ctx = runtime::open_device()?;
        // Its own stream, so decoding can overlap the frame kernel on the default stream.
        let stream = ctx.new_stream().context("creating the codec stream")?;
        let module = runtime::load_source(&ctx, "codec", runtime::CODEC_SOURCE)?;
        let sms = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let kernels = Kernels {
            history: module.load_function("history")?,
            rvq: module.load_function("rvq_lookup")?,
            gemm: TiledGemm::load(&module, sms as usize, options.precision)?,
            skinny: [4, 16]
                .into_iter()
                .map(|rows| {
                    let f = module.load_function(&format!("skinny_gemm_{rows}"))?;
                    let resident =
                        f.occupancy_max_active_blocks_per_multiprocessor(GEMM_THREADS, 0, None)?;
                    Ok((rows, f, resident as usize))
                })
                .collect::<Result<_>>()?,
            attention: module.load_function("attention")?,
            dwnorm: module.load_function("dwconv_norm")?,
            final_conv: module.load_function("final_conv")?,
        };
        // The attention kernel stages a head's visible K/V rows (padded) in shared memory.
        let ring = dims.window + MAX_PASS_FRAMES_PER_ENTRY - 1;
        let attention_smem = 2 * ring * (dims.head_dim + 4) * 4;
        kernels.attention.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            attention_smem as i32,
        )?;
        let device_name = ctx.name().unwrap_or_else(|_| "unknown GPU".to_string());

        let frames_cap = options.max_pass_frames;
        let mut planner = Planner {
            src: Source { file },
            stream: &stream,
            frames_cap,
            entries_cap: options.max_streams.min(frames_cap),
            packer: Packer::default(),
            activations: Vec::new(),
            ops: vec![Op::History { save: false }],
            history: Vec::new(),
        };
        let latent = planner.quantizer(&dims)?;
        let pre_out = planner.seg(dims.latent, 0, 1, "pre_conv output")?;
        planner.conv(
            "pre_conv",
            latent,
            PRE_CONV_KERNEL,
            1,
            Epi::None,
            pre_out,
            None,
            None,
        )?;
        let hidden = planner.transformer(&dims, pre_out)?;
        let upsampled = planner.upsample(&dims, hidden)?;
        planner.decoder(&dims, upsampled)?;
        planner.ops.push(Op::History { save: true });
        let Planner {
            packer,
            activations,
            ops,
            history: hist_segs,
            entries_cap,
            ..
        } = planner;

        // Upload, then the per-stream state: histories and K/V rings.
        let weights_buf = stream
            .clone_htod(&packer.data)
            .context("uploading the codec weights")?;
        let weights = device_ptr(&weights_buf, &stream);
        let mut state_stride = 0;
        let hist_layers: Vec<HistLayer> = hist_segs
            .iter()
            .map(|s| {
                let layer = HistLayer {
                    buf: s.ptr,
                    channels: s.width as i32,
                    hist: s.hist as i32,
                    rate: s.rate as i32,
                    state_offset: state_stride as i32,
                };
                state_stride += s.hist * s.width;
                layer
            })
            .collect();
        let hist_layers_buf = stream.clone_htod(&hist_layers)?;
        let state = zeros::<f32>(
            &stream,
            options.max_streams * state_stride,
            "stream histories",
        )?;
        let kv_slot_stride = dims.layers * ring * dims.width();
        let kv = zeros::<f32>(
            &stream,
            2 * options.max_streams * kv_slot_stride,
            "stream K/V windows",
        )?;
        let kv_ptr = device_ptr(&kv, &stream);
        let workspace_buf = zeros::<f32>(&stream, SPLIT_WORKSPACE_FLOATS, "split-depth workspace")?;
        let counters_buf = zeros::<u32>(&stream, SPLIT_COUNTERS, "split-depth counters")?;
        let layout = TableLayout::new(frames_cap, entries_cap, dims.head_dim / 2);
        let tables = zeros::<u32>(&stream, layout.len, "pass tables")?;
        let table_ptr = device_ptr(&tables, &stream);
        let at = |words: usize| table_ptr + 4 * words as u64;
        let batch_base = Batch {
            frame_entry: at(layout.frame_entry),
            entry_frame0: at(layout.entry_frame0),
            entry_frames: at(layout.entry_frames),
            entry_slot: at(layout.entry_slot),
            entry_pos0: at(layout.entry_pos0),
            codes: at(layout.codes),
            rope_cos: at(layout.rope_cos),
            rope_sin: at(layout.rope_sin),
            frames: 0,
            entries: 0,
        };
        let wav = zeros::<f32>(&stream, frames_cap * dims.samples_per_frame, "waveform")?;
        // SAFETY: plain page-locked host memory (no flags); every read of it follows a
        // synchronize on the copy that filled it, and every write precedes the copy that reads it.
        let tables_host = unsafe { ctx.alloc_pinned_with_flags::<u32>(layout.len, 0) }?;
        // SAFETY: as above.
        let wav_host =
            unsafe { ctx.alloc_pinned_with_flags::<f32>(frames_cap * dims.samples_per_frame, 0) }?;
        stream.synchronize()?;
        let hist = HistParams {
            layers: device_ptr(&hist_layers_buf, &stream),
            state: device_ptr(&state, &stream),
            state_stride: state_stride as i32,
            save: 0,
        };
        let (workspace, counters) = (
            device_ptr(&workspace_buf, &stream),
            device_ptr(&counters_buf, &stream),
        );
        let wav_ptr = device_ptr(&wav, &stream);

        let mut codec = Self {
            hist,
            hist_layer_count: hist_layers.len() as u32,
            k_ring: kv_ptr,
            v_ring: kv_ptr + 4 * (options.max_streams * kv_slot_stride) as u64,
            ring,
            kv_slot_stride,
            workspace,
            counters,
            weights,
            inverse_frequencies: dims.inverse_frequencies(),
            stream,
            kernels,
            ops,
            dims,
            options,
            state,
            tables,
            tables_host,
            layout,
            batch_base,
            wav_ptr,
            wav,
            wav_host,
            sms: sms as usize,
            device_name,
            streams: HashMap::new(),
            graphs: HashMap::new(),
            free_slots: (0..options.max_streams).rev().collect(),
            next_id: 0,
            _owned: Owned {
                _weights: weights_buf,
                _activations: activations,
                _hist_layers: hist_layers_buf,
                _counters: counters_buf,
                _workspace: workspace_buf,
                _kv: kv,
            },
        };
        codec.size_split_scratch()?;
        Ok(codec)
    }

    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    fn weight(&self, offset: usize) -> u64 {
        self.weights + 4 * offset as u64
    }

    /// The kernel and its tile height, depth splits and depth per split for an `m x n x k`
    /// GEMM: the few-rows kernel up to `skinny_rows` rows, else the tiled one as
    /// [`TiledGemm::plan`] shapes it. One frame has a handful of rows against megabytes of
    /// weights: short tiles, deep splits so every SM streams weights. Sixteen streams have
    /// thousands of rows: tall tiles, few splits.
    fn gemm_plan(&self, m: usize, n: usize, k: usize, pipe: PipeUse) -> GemmKernel {
        if m <= self.options.skinny_rows {
            // Enough depth splits to fill the GPU once, each streaming at least
            // SKINNY_MIN_SPLIT_DEPTH weight rows, within the split scratch.
            let rows = skinny_height(m);
            let resident = self.kernels.skinny.iter().find(|(r, ..)| *r == rows);
            let slots = resident.map_or(1, |(.., resident)| resident * self.sms);
            let tiles = n.div_ceil(SKINNY_COLS) * m.div_ceil(rows);
            let partial = rows * 4 * GEMM_THREADS as usize;
            let by_space = match tiles <= SPLIT_COUNTERS {
                true => SPLIT_WORKSPACE_FLOATS / (tiles * partial),
                false => 1,
            };
            let wanted = slots
                .div_ceil(tiles)
                .min(k / SKINNY_MIN_SPLIT_DEPTH)
                .min(by_space)
                .max(1);
            let k_split = k.div_ceil(wanted).next_multiple_of(GEMM_BK);
            return GemmKernel::Skinny {
                rows,
                splits: k.div_ceil(k_split),
                k_split,
            };
        }
        self.kernels.gemm.plan(m, n, k, pipe)
    }

    /// The launch shape of `g` over `m` rows. Batch-invariant: the kind of kernel (few-rows or
    /// tiled) and the depth split come from the rows of `plan_frames` frames, and only the tiled
    /// kernel itself (its tile height, pipelined or not, folded or not) follows `m`: all of them
    /// add a row's products in the same order. Under TF32 whether it is pipelined is fixed too.
    fn op_plan(&self, g: &GemmOp, m: usize) -> GemmKernel {
        let k = g.taps * g.input.width;
        // The pipelined kernel copies its operands as stored, 16 bytes at a time, one tap per
        // depth chunk.
        let pipe = if self.options.pipelined
            && matches!(g.act, Act::None)
            && g.input.width.is_multiple_of(GEMM_BK)
            && g.n.is_multiple_of(4)
        {
            PipeUse::Allowed
        } else {
            PipeUse::Never
        };
        if !self.options.batch_invariant {
            return self.gemm_plan(m, g.n, k, pipe);
        }
        match self.gemm_plan(g.input.rate * self.options.plan_frames, g.n, k, pipe) {
            GemmKernel::Skinny {
                splits, k_split, ..
            } => GemmKernel::Skinny {
                rows: skinny_height(m),
                splits,
                k_split,
            },
            GemmKernel::Tiled {
                splits,
                k_split,
                pipe: planned,
                ..
            } => {
                let pipe = match (self.options.precision, planned) {
                    (CodecPrecision::F32, _) => pipe,
                    (CodecPrecision::Tf32, true) => PipeUse::Always,
                    (CodecPrecision::Tf32, false) => PipeUse::Never,
                };
                self.kernels.gemm.keep_split(m, g.n, k_split, splits, pipe)
            }
        }
    }

    /// Split-depth scratch (floats, tile counters) a plan over `m` x `n` needs.
    fn split_scratch(plan: GemmKernel, m: usize, n: usize) -> (usize, usize) {
        let (splits, tiles, per_tile) = match plan {
            GemmKernel::Skinny { rows, splits, .. } => (
                splits,
                n.div_ceil(SKINNY_COLS) * m.div_ceil(rows),
                rows * 4 * GEMM_THREADS as usize,
            ),
            GemmKernel::Tiled { fold: true, .. } => (1, 0, 0),
            GemmKernel::Tiled { bm, splits, .. } => {
                (splits, n.div_ceil(GEMM_BN) * m.div_ceil(bm), bm * GEMM_BN)
            }
        };
        match splits > 1 {
            true => (tiles * splits * per_tile, tiles),
            false => (0, 0),
        }
    }

    /// Batch-invariant plans keep `plan_frames` frames' depth splits on passes of any size, which
    /// can need more split scratch than the fixed minimum: grow it to the largest pass's needs.
    fn size_split_scratch(&mut self) -> Result<()> {
        let (mut floats, mut counters) = (SPLIT_WORKSPACE_FLOATS, SPLIT_COUNTERS);
        for op in &self.ops {
            let Op::Gemm(g) = op else { continue };
            for frames in 1..=self.options.max_pass_frames {
                let m = frames * g.input.rate;
                let (f, c) = Self::split_scratch(self.op_plan(g, m), m, g.n);
                floats = floats.max(f);
                counters = counters.max(c);
            }
        }
        if floats > SPLIT_WORKSPACE_FLOATS {
            let buf = zeros::<f32>(&self.stream, floats, "split-depth workspace")?;
            self.workspace = device_ptr(&buf, &self.stream);
            self._owned._workspace = buf;
        }
        if counters > SPLIT_COUNTERS {
            let buf = zeros::<u32>(&self.stream, counters, "split-depth counters")?;
            self.counters = device_ptr(&buf, &self.stream);
            self._owned._counters = buf;
        }
        Ok(())
    }

    fn launch(&self, op: &Op, batch: &Batch) -> Result<()> {
        let (frames, entries) = (batch.frames as usize, batch.entries as u32);
        let cfg = |grid: (u32, u32, u32), threads: u32, smem: usize| LaunchConfig {
            grid_dim: grid,
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        match *op {
            Op::History { save } => {
                let p = HistParams {
                    save: save as i32,
                    ..self.hist
                };
                let mut l = self.stream.launch_builder(&self.kernels.history);
                l.arg(&p).arg(batch);
                // SAFETY: the layer table and state were sized in `new` for every segment and
                // slot; the batch tables describe at most `max_pass_frames` frames and slots
                // below `max_streams`, the sizes the segments were allocated for.
                let grid = (self.hist_layer_count, entries, HISTORY_CHUNKS);
                unsafe { l.launch(cfg(grid, 256, 0)) }.context("launching history")?;
            }
            Op::Rvq { tables, out } => {
                let p = RvqParams {
                    tables: self.weight(tables),
                    out: out.ptr,
                    codebook_size: self.dims.codebook_size as i32,
                    dim: (self.dims.codebook_dim / 2) as i32,
                };
                let mut l = self.stream.launch_builder(&self.kernels.rvq);
                l.arg(&p).arg(batch);
                // SAFETY: codes were checked against codebook_size before the pass; `out` holds
                // `max_pass_frames` rows.
                unsafe { l.launch(cfg((frames as u32, 1, 1), 256, 0)) }
                    .context("launching rvq_lookup")?;
            }
            Op::Gemm(g) => self.launch_gemm(&g, batch)?,
            Op::Attention { qkv, out, layer } => {
                let layer_offset = 4 * (layer * self.ring * self.dims.width()) as u64;
                let p = AttnParams {
                    qkv,
                    out,
                    k_ring: self.k_ring + layer_offset,
                    v_ring: self.v_ring + layer_offset,
                    slot_stride: self.kv_slot_stride as i32,
                    ring: self.ring as i32,
                    width: self.dims.width() as i32,
                    head_dim: self.dims.head_dim as i32,
                    window: self.dims.window as i32,
                    scale: (self.dims.head_dim as f64).powf(-0.5) as f32,
                };
                let mut l = self.stream.launch_builder(&self.kernels.attention);
                l.arg(&p).arg(batch);
                // SAFETY: the rings hold `ring` rows per layer and slot for `max_streams` slots;
                // entries carry at most MAX_PASS_FRAMES_PER_ENTRY frames, head_dim and window
                // were checked against the kernel's shared arrays; the dynamic shared memory
                // holds `ring` padded rows of keys and of values (its limit raised in `new`).
                let smem = 2 * self.ring * (self.dims.head_dim + 4) * 4;
                // A block per new query: an entry has at most the frames the others leave it.
                let queries = (frames + 1 - entries as usize).min(MAX_PASS_FRAMES_PER_ENTRY);
                let grid = (self.dims.heads as u32, entries, queries as u32);
                unsafe { l.launch(cfg(grid, 128, smem)) }.context("launching attention")?;
            }
            Op::DwNorm {
                input,
                out,
                w,
                bias,
                norm_w,
                norm_b,
            } => {
                let p = DwNormParams {
                    input: input.ptr,
                    out: out.ptr,
                    w: self.weight(w),
                    bias: self.weight(bias),
                    norm_w: self.weight(norm_w),
                    norm_b: self.weight(norm_b),
                    channels: input.width as i32,
                    taps: CONV_KERNEL as i32,
                    rate: input.rate as i32,
                    eps: CONVNEXT_LAYER_NORM_EPS,
                };
                let rows = (frames * input.rate) as u32;
                let mut l = self.stream.launch_builder(&self.kernels.dwnorm);
                l.arg(&p).arg(batch);
                // SAFETY: one block per new row of the pass, inside the segments allocated for
                // `max_pass_frames` frames; shared memory holds one row of `channels` floats.
                unsafe { l.launch(cfg((rows, 1, 1), 256, 4 * input.width)) }
                    .context("launching dwconv_norm")?;
            }
            Op::Final { input, w, bias } => {
                let rows = frames * input.rate;
                let p = FinalParams {
                    input: input.ptr,
                    out: self.wav_ptr,
                    w: self.weight(w),
                    bias,
                    channels: input.width as i32,
                    taps: CONV_KERNEL as i32,
                    rate: input.rate as i32,
                    rows: rows as i32,
                };
                let smem = 4 * (FINAL_ROWS + CONV_KERNEL - 1) * input.width;
                let mut l = self.stream.launch_builder(&self.kernels.final_conv);
                l.arg(&p).arg(batch);
                // SAFETY: `rows` is a multiple of FINAL_ROWS (checked in Dims::new) within the
                // waveform buffer of `max_pass_frames` frames; shared memory as computed.
                unsafe { l.launch(cfg(((rows / FINAL_ROWS) as u32, 1, 1), 256, smem)) }
                    .context("launching final_conv")?;
            }
        }
        Ok(())
    }

    fn launch_gemm(&self, g: &GemmOp, batch: &Batch) -> Result<()> {
        let m = batch.frames as usize * g.input.rate;
        let k = g.taps * g.input.width;
        let plan = self.op_plan(g, m);
        let (GemmKernel::Tiled { k_split, .. } | GemmKernel::Skinny { k_split, .. }) = plan;
        let (act, act_w) = match g.act {
            Act::None => (ACT_NONE, 0),
            Act::Rms { weight } => (ACT_RMS, self.weight(weight)),
        };
        let snake = |s: Option<Snake>| {
            s.map_or((0, 0), |s| {
                (self.weight(s.frequency), self.weight(s.inv_magnitude))
            })
        };
        let (out_freq, out_inv) = snake(g.out_snake);
        let (out2_freq, out2_inv) = snake(g.also.map(|(_, s)| s));
        let (out2, out2_hist) = g.also.map_or((0, 0), |(seg, _)| (seg.ptr, seg.hist));
        let (epi, res, res_hist, col_scale) = match g.epi {
            Epi::None => (EPI_NONE, 0, 0, 0),
            Epi::Gelu => (EPI_GELU, 0, 0, 0),
            Epi::SiluGate => (EPI_SILU_GATE, 0, 0, 0),
            Epi::Residual { res, scale } => (
                EPI_RESIDUAL,
                res.ptr,
                res.hist,
                scale.map_or(0, |s| self.weight(s)),
            ),
        };
        let p = GemmParams {
            input: g.input.ptr,
            w: self.weight(g.w),
            bias: g.bias.map_or(0, |b| self.weight(b)),
            out: g.out.ptr,
            res,
            col_scale,
            act_w,
            out_freq,
            out_inv,
            out2,
            out2_freq,
            out2_inv,
            workspace: self.workspace,
            counters: self.counters,
            m: m as i32,
            n: g.n as i32,
            k: k as i32,
            rate: g.input.rate as i32,
            cin: g.input.width as i32,
            taps: g.taps as i32,
            dilation: g.dilation as i32,
            in_hist: g.input.hist as i32,
            out_width: g.out.width as i32,
            out_hist: g.out.hist as i32,
            out_stride: g.out_stride as i32,
            out2_hist: out2_hist as i32,
            res_hist: res_hist as i32,
            bias_len: g.bias_len as i32,
            act,
            epi,
            eps: self.dims.eps,
            k_split: k_split as i32,
        };
        let (function, grid) = match plan {
            GemmKernel::Skinny { rows, splits, .. } => {
                let f = self.kernels.skinny.iter().find(|(r, ..)| *r == rows);
                let grid = (g.n.div_ceil(SKINNY_COLS), m.div_ceil(rows), splits);
                (f.map(|(_, f, _)| f), grid)
            }
            GemmKernel::Tiled { .. } => match self.kernels.gemm.function(plan, m, g.n) {
                Some((f, grid)) => (Some(f), grid),
                None => (None, (0, 0, 0)),
            },
        };
        let function = function.context("internal: no GEMM kernel for the plan")?;
        let cfg = LaunchConfig {
            grid_dim: (grid.0 as u32, grid.1 as u32, grid.2 as u32),
            block_dim: (GEMM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = self.stream.launch_builder(function);
        l.arg(&p).arg(batch);
        // SAFETY: input, output and residual segments were allocated for `max_pass_frames`
        // frames at their rates and histories, the weights hold `k x n` floats (plus bias and
        // activation vectors), and split plans stay within the workspace and counters.
        unsafe { l.launch(cfg) }.context("launching conv_gemm")?;
        Ok(())
    }

    /// Captures the launches of a pass into a graph. Everything that changes between passes of
    /// the same shape lives in device memory (the tables), so the graph replays any such pass.
    fn capture(&self, batch: &Batch) -> Result<PassGraph> {
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .context("starting a graph capture")?;
        let launched = self.ops.iter().try_for_each(|op| self.launch(op, batch));
        // End the capture whatever happened, so the stream is usable again.
        let graph = self
            .stream
            .end_capture(CUgraphInstantiate_flags(0))
            .context("instantiating the pass graph");
        launched?;
        Ok(PassGraph(
            graph?.context("the pass graph captured nothing")?,
        ))
    }

    /// What op `op` does on a pass of `frames` frames, for [`CudaCodec::profile`].
    fn describe(&self, op: &Op, frames: usize) -> String {
        match op {
            Op::History { save } => format!("history {}", if *save { "save" } else { "load" }),
            Op::Rvq { .. } => "rvq_lookup".to_string(),
            Op::Gemm(g) => {
                let (m, k) = (frames * g.input.rate, g.taps * g.input.width);
                let how = match self.op_plan(g, m) {
                    GemmKernel::Skinny { rows, splits, .. } => {
                        format!("skinny={rows} splits={splits}")
                    }
                    GemmKernel::Tiled {
                        bm,
                        pipe,
                        splits,
                        fold,
                        ..
                    } => format!(
                        "tile={bm}{} splits={splits}{}",
                        if pipe { " pipelined" } else { "" },
                        if fold { " folded" } else { "" }
                    ),
                };
                format!("gemm m={m} n={} k={k} {how}", g.n)
            }
            Op::Attention { layer, .. } => format!("attention layer {layer}"),
            Op::DwNorm { input, .. } => format!("dwconv_norm rows={}", frames * input.rate),
            Op::Final { input, .. } => format!("final_conv rows={}", frames * input.rate),
        }
    }

    /// Decodes one pass's worth of frames like [`CodecBackend::decode`] and returns the GPU
    /// time of each launch (ms, from events around it) instead of the samples.
    pub fn profile(&mut self, batch: &[(CodecSlot, &[Frame])]) -> Result<Vec<(String, f32)>> {
        let mut slots = Vec::with_capacity(batch.len());
        let mut pass = Vec::with_capacity(batch.len());
        for (index, (id, frames)) in batch.iter().enumerate() {
            let stream = *self
                .streams
                .get(id)
                .with_context(|| format!("codec stream {} is not open", id.0))?;
            slots.push(stream);
            pass.push(PassEntry {
                index,
                first: 0,
                frames: frames.len(),
            });
        }
        let total: usize = pass.iter().map(|e| e.frames).sum();
        ensure!(
            total <= self.options.max_pass_frames
                && pass.iter().all(|e| e.frames <= MAX_PASS_FRAMES_PER_ENTRY),
            "profile takes one pass: at most {} frames, {MAX_PASS_FRAMES_PER_ENTRY} per stream",
            self.options.max_pass_frames
        );
        let ctx = Arc::clone(self.stream.context());
        let events = (0..=self.ops.len())
            .map(|_| ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        self.run_pass(batch, &slots, &pass, Some(&events))?;
        for (entry, (id, _)) in pass.iter().zip(batch) {
            if let Some(stream) = self.streams.get_mut(id) {
                stream.frames += entry.frames;
            }
        }
        self.ops
            .iter()
            .zip(events.windows(2))
            .map(|(op, pair)| Ok((self.describe(op, total), pair[0].elapsed_ms(&pair[1])?)))
            .collect()
    }

    /// Runs every op over one pass and leaves its samples (in entry order) in `wav_host`; with
    /// `events`, records one before each op and one after the last.
    fn run_pass(
        &mut self,
        batch: &[(CodecSlot, &[Frame])],
        slots: &[Stream],
        pass: &[PassEntry],
        events: Option<&[CudaEvent]>,
    ) -> Result<usize> {
        let layout = self.layout;
        let half = self.dims.head_dim / 2;
        let tables = self.tables_host.as_mut_slice()?;
        let mut frame = 0;
        for (e, entry) in pass.iter().enumerate() {
            let stream = slots[entry.index];
            let position = stream.frames + entry.first;
            tables[layout.entry_frame0 + e] = frame as u32;
            tables[layout.entry_frames + e] = entry.frames as u32;
            tables[layout.entry_slot + e] = stream.slot as u32;
            tables[layout.entry_pos0 + e] = position as u32;
            let codes = &batch[entry.index].1[entry.first..entry.first + entry.frames];
            for (t, codes) in codes.iter().enumerate() {
                tables[layout.frame_entry + frame] = e as u32;
                let at = layout.codes + frame * NUM_CODE_GROUPS;
                tables[at..at + NUM_CODE_GROUPS].copy_from_slice(codes);
                // RoPE angles rounded to f32 before the trig, as the CPU reference does.
                let pos = (position + t) as f32;
                for (i, f) in self.inverse_frequencies.iter().enumerate() {
                    let angle = f * pos;
                    tables[layout.rope_cos + frame * half + i] = angle.cos().to_bits();
                    tables[layout.rope_sin + frame * half + i] = angle.sin().to_bits();
                }
                frame += 1;
            }
        }
        self.stream
            .memcpy_htod(&self.tables_host, &mut self.tables)?;
        let batch_tables = Batch {
            frames: frame as i32,
            entries: pass.len() as i32,
            ..self.batch_base
        };
        match events {
            Some(events) => {
                for (op, event) in self.ops.iter().zip(events) {
                    event.record(&self.stream)?;
                    self.launch(op, &batch_tables)?;
                }
                events[self.ops.len()].record(&self.stream)?;
            }
            None if self.options.graphs => {
                let key = (frame, pass.len());
                if !self.graphs.contains_key(&key) {
                    let graph = self.capture(&batch_tables)?;
                    if self.graphs.len() >= MAX_GRAPHS {
                        self.graphs.clear();
                    }
                    self.graphs.insert(key, graph);
                }
                self.graphs[&key]
                    .0
                    .launch()
                    .context("launching the pass graph")?;
            }
            None => {
                for op in &self.ops {
                    self.launch(op, &batch_tables)?;
                }
            }
        }
        let samples = frame * self.dims.samples_per_frame;
        self.stream
            .memcpy_dtoh(&self.wav.slice(..samples), &mut self.wav_host)?;
        self.stream.synchronize()?;
        Ok(samples)
    }
}

impl CodecBackend for CudaCodec {
    fn name(&self) -> String {
        let precision = match self.options.precision {
            CodecPrecision::Tf32 if self.options.pipelined => "tf32",
            _ => "f32",
        };
        format!("cuda codec ({}, {precision})", self.device_name)
    }

    fn samples_per_frame(&self) -> usize {
        self.dims.samples_per_frame
    }

    fn split_invariant(&self) -> bool {
        self.options.batch_invariant
    }

    fn open(&mut self) -> Result<CodecSlot> {
        let Some(slot) = self.free_slots.pop() else {
            bail!(
                "all {} codec streams are open (CudaCodecOptions::max_streams)",
                self.options.max_streams
            );
        };
        // Zero histories are the official zero left padding. The K/V ring needs no clearing:
        // a query only reads positions this stream has written since it opened.
        let stride = self.hist.state_stride as usize;
        let zeroed = self
            .stream
            .memset_zeros(&mut self.state.slice_mut(slot * stride..(slot + 1) * stride));
        if let Err(e) = zeroed {
            self.free_slots.push(slot);
            return Err(e).context("clearing the stream's histories");
        }
        let id = CodecSlot(self.next_id);
        self.next_id += 1;
        self.streams.insert(id, Stream { slot, frames: 0 });
        Ok(id)
    }

    fn decode(&mut self, batch: &[(CodecSlot, &[Frame])]) -> Result<Vec<Vec<f32>>> {
        let mut slots = Vec::with_capacity(batch.len());
        for (i, (id, frames)) in batch.iter().enumerate() {
            let Some(&stream) = self.streams.get(id) else {
                bail!("codec stream {} is not open", id.0);
            };
            ensure!(
                !batch[..i].iter().any(|(other, _)| other == id),
                "codec stream {} appears twice in one decode batch",
                id.0
            );
            for (n, frame) in frames.iter().enumerate() {
                if let Some(group) = frame
                    .iter()
                    .position(|&c| c as usize >= self.dims.codebook_size)
                {
                    bail!(
                        "frame {}: codebook {group} has code {}, valid codes are 0..{}",
                        stream.frames + n,
                        frame[group],
                        self.dims.codebook_size
                    );
                }
            }
            slots.push(stream);
        }

        let spf = self.dims.samples_per_frame;
        let mut out: Vec<Vec<f32>> = batch
            .iter()
            .map(|(_, frames)| Vec::with_capacity(frames.len() * spf))
            .collect();
        let mut done = vec![0usize; batch.len()];
        loop {
            // Fill a pass in batch order; a stream appears at most once per pass, and waits for
            // the next pass rather than being cut short by the others, so how a stream's frames
            // are split into passes does not depend on what shares its calls.
            let mut pass = Vec::new();
            let mut room = self.options.max_pass_frames;
            for (index, (_, frames)) in batch.iter().enumerate() {
                let wanted = (frames.len() - done[index]).min(MAX_PASS_FRAMES_PER_ENTRY);
                let take = match wanted > room && !pass.is_empty() {
                    true => 0,
                    false => wanted.min(room),
                };
                if take > 0 {
                    pass.push(PassEntry {
                        index,
                        first: done[index],
                        frames: take,
                    });
                    room -= take;
                }
            }
            if pass.is_empty() {
                break;
            }
            let samples = self.run_pass(batch, &slots, &pass, None)?;
            let wav = &self.wav_host.as_slice()?[..samples];
            let mut offset = 0;
            for entry in &pass {
                let len = entry.frames * spf;
                out[entry.index].extend_from_slice(&wav[offset..offset + len]);
                offset += len;
                done[entry.index] += entry.frames;
                // Kept in step with the device state after every pass.
                if let Some(stream) = self.streams.get_mut(&batch[entry.index].0) {
                    stream.frames += entry.frames;
                }
            }
        }
        Ok(out)
    }

    fn release(&mut self, slot: CodecSlot) {
        if let Some(stream) = self.streams.remove(&slot) {
            self.free_slots.push(stream.slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_blocks_have_the_kernel_layout() {
        // Sizes from the CUDA declarations: pointers first, then 4-byte fields, padded to 8.
        assert_eq!(std::mem::size_of::<Batch>(), 8 * 8 + 2 * 4);
        assert_eq!(std::mem::size_of::<HistLayer>(), 8 + 4 * 4);
        assert_eq!(std::mem::size_of::<GemmParams>(), 14 * 8 + 18 * 4);
        assert_eq!(std::mem::size_of::<AttnParams>(), 4 * 8 + 6 * 4);
        assert_eq!(std::mem::size_of::<DwNormParams>(), 6 * 8 + 4 * 4);
        assert_eq!(std::mem::size_of::<FinalParams>(), 3 * 8 + 5 * 4 + 4);
    }

    #[test]
    fn transposed_conv_weight_puts_the_oldest_input_first() {
        // in = 1, out = 1, kernel 4, stride 2 (m = 2): taps k = i * stride + p.
        let w = [10.0, 11.0, 12.0, 13.0];
        // GEMM tap 0 (input t - 1) uses kernel taps 2, 3; tap 1 (input t) uses taps 0, 1.
        assert_eq!(
            transposed_conv_weight(&w, 1, 1, 4, 2),
            vec![12.0, 13.0, 10.0, 11.0]
        );
    }

    #[test]
    fn conv_weight_is_tap_major() {
        // out = 2, in = 1, k = 2: w[o][0][j].
        let w = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(conv_weight(&w, 2, 1, 2), vec![1.0, 3.0, 2.0, 4.0]);
    }
}
