//! `CudaVoiceEncoder`: the voice-clone encoders on the GPU, in f32, behind
//! [`CloneEncoder`]. The speaker encoder (ECAPA-TDNN, `speaker.rs`) and the speech tokenizer's
//! encoder (SEANet, transformer, downsample and split RVQ, `tokenizer.rs`) compute what the CPU
//! reference (`voxkernel_core::reference::{speaker_encoder, codec_encoder}`) computes, layer by
//! layer; the log-mel front end stays on the CPU (`MelSpectrogram`, a few milliseconds per clip:
//! docs/voice_clone.md).
//!
//! A clip is encoded eagerly: each call allocates its activations (stream-ordered), launches
//! every layer on one stream and reads the result back. The convolutions and projections are the
//! codec decoder's tiled GEMM (kernels/codec.cu, over a one-entry batch); kernels/encoder.cu
//! holds the rest.

mod speaker;
mod tokenizer;

use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, bail, ensure};
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use voxkernel_core::backend::Frame;
use voxkernel_core::checkpoint::{Checkpoint, SafetensorsFile};
use voxkernel_core::reference::mel::MelSpectrogram;
use voxkernel_core::voice_clone::{CloneEncoder, ReferenceAudio};

use self::speaker::SpeakerEncoder;
use self::tokenizer::TokenizerEncoder;
use crate::codec::{
    ACT_NONE, Batch, CodecPrecision, EPI_NONE, GEMM_THREADS, GemmKernel, GemmParams, PipeUse,
    SPLIT_COUNTERS, SPLIT_WORKSPACE_FLOATS, TiledGemm,
};
use crate::runtime::{self, device_ptr, zeros};

/// Edge rows of `gather_rows` (kernels/encoder.cu).
const PAD_REFLECT: i32 = 0;
const PAD_REPLICATE: i32 = 1;
/// Threads of the element-wise kernels, and the most blocks one is given (they loop).
const THREADS: u32 = 256;
const MAX_BLOCKS: usize = 1 << 16;
/// The kernels' shared arrays: `MAX_HEAD_DIM` (codec.cu) and `RVQ_MAX_DIM`.
const MAX_HEAD_DIM: usize = 128;
const RVQ_MAX_DIM: usize = 1024;
const RVQ_THREADS: u32 = 256;
const ATTENTION_THREADS: u32 = 128;
/// Shared memory a kernel may use without opting in.
const DEFAULT_SMEM_BYTES: usize = 48 * 1024;
/// CUDA's limit on a grid's y dimension (the GEMM's row tiles).
const MAX_GRID_Y: usize = 65_535;

// ---- kernel parameter blocks: `#[repr(C)]` mirrors of the structs in kernels/encoder.cu ----

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct GatherParams {
    dst: u64,
    a: u64,
    b: u64,
    dst_ld: i32,
    a_ld: i32,
    b_ld: i32,
    rows: i32,
    cols: i32,
    left: i32,
    right: i32,
    mode: i32,
    pad_only: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct LayerNormParams {
    input: u64,
    out: u64,
    w: u64,
    b: u64,
    width: i32,
    eps: f32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RopeParams {
    qkv: u64,
    cos: u64,
    sin: u64,
    rows: i32,
    width: i32,
    head_dim: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CausalAttnParams {
    qkv: u64,
    out: u64,
    rows: i32,
    width: i32,
    head_dim: i32,
    scale: f32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SeGateParams {
    h: u64,
    gate: u64,
    w1: u64,
    b1: u64,
    w2: u64,
    b2: u64,
    rows: i32,
    channels: i32,
    se: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SeApplyParams {
    h: u64,
    gate: u64,
    res: u64,
    out: u64,
    out2: u64,
    rows: i32,
    channels: i32,
    out2_ld: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct PoolParams {
    x: u64,
    scores: u64,
    out: u64,
    rows: i32,
    channels: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RvqEncodeParams {
    input: u64,
    codebooks: u64,
    norms: u64,
    codes: u64,
    in_ld: i32,
    layers: i32,
    size: i32,
    dim: i32,
    first_code: i32,
}

// Kernel parameters, each mirroring its struct in kernels/encoder.cu.
kernel_params!(
    GatherParams,
    LayerNormParams,
    RopeParams,
    CausalAttnParams,
    SeGateParams,
    SeApplyParams,
    PoolParams,
    RvqEncodeParams,
);

/// Time-major rows on the device: `pad` rows of padding, the `rows` rows a layer wrote, then
/// `tail` rows of padding; `width` floats each. Allocated zeroed, so zero padding needs nothing
/// more.
struct Rows {
    buf: CudaSlice<f32>,
    base: u64,
    width: usize,
    pad: usize,
    rows: usize,
    tail: usize,
}

impl Rows {
    /// Device address of the first padding row (what a padded convolution reads first).
    fn first(&self) -> u64 {
        self.base
    }

    /// Device address of written row `r`.
    fn row(&self, r: usize) -> u64 {
        self.base + 4 * ((self.pad + r) * self.width) as u64
    }
}

/// Checkpoint tensors under a prefix, as f32, checked against their shapes.
struct Tensors<'a> {
    file: &'a SafetensorsFile,
    prefix: &'a str,
}

impl Tensors<'_> {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let full = format!("{}{name}", self.prefix);
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

/// A matrix product launch of `conv_gemm` over one clip: `m` output rows, row `t` reading input
/// rows `t + j * dilation` (`taps` of them, `cin` floats apart) from `input`.
#[derive(Debug, Clone, Copy)]
struct GemmCall {
    input: u64,
    cin: usize,
    taps: usize,
    dilation: usize,
    m: usize,
    act: i32,
    w: u64,
    n: usize,
    /// 0: none.
    bias: u64,
    epi: i32,
    out: u64,
    /// Floats between output rows (and residual rows); `n` for a plain matrix, more for a
    /// column slice of a wider one.
    out_ld: usize,
    res: u64,
    col_scale: u64,
}

impl GemmCall {
    /// `input [m, cin] @ w [cin, n]` into `out [m, n]`, nothing else applied.
    fn matmul(input: u64, cin: usize, m: usize, w: u64, n: usize, out: u64) -> Self {
        Self {
            input,
            cin,
            taps: 1,
            dilation: 1,
            m,
            act: ACT_NONE,
            w,
            n,
            bias: 0,
            epi: EPI_NONE,
            out,
            out_ld: n,
            res: 0,
            col_scale: 0,
        }
    }
}

/// The kernels of kernels/encoder.cu.
struct Kernels {
    gemm: TiledGemm,
    gather: CudaFunction,
    layer_norm: CudaFunction,
    rope: CudaFunction,
    attention: CudaFunction,
    se_gate: CudaFunction,
    se_apply: CudaFunction,
    pool: CudaFunction,
    rvq: CudaFunction,
}

/// The device side every encode call uses: one stream, the kernels, the split-depth scratch
/// of the GEMM and the one-entry batch tables.
struct Gpu {
    stream: Arc<CudaStream>,
    kernels: Kernels,
    workspace: CudaSlice<f32>,
    counters: CudaSlice<u32>,
    /// All zeros: frame 0 of entry 0, the only entry.
    _tables: CudaSlice<u32>,
    batch: Batch,
}

fn launch_config(blocks: usize, threads: u32, smem: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks.clamp(1, MAX_BLOCKS) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem as u32,
    }
}

impl Gpu {
    /// `precision`: the tiled GEMM's pipelined kernels (the encoders run f32; the TF32 form is
    /// loaded only to test the codec's kernels).
    fn new(precision: CodecPrecision) -> Result<Self> {
        let ctx = runtime::open_device()?;
        let stream = ctx.new_stream().context("creating the encoder stream")?;
        let module = runtime::load_source(&ctx, "codec", runtime::CODEC_SOURCE)?;
        let sms = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let kernels = Kernels {
            gemm: TiledGemm::load(&module, sms as usize, precision)?,
            gather: module.load_function("gather_rows")?,
            layer_norm: module.load_function("layer_norm")?,
            rope: module.load_function("rope_qk")?,
            attention: module.load_function("causal_attention")?,
            se_gate: module.load_function("se_gate")?,
            se_apply: module.load_function("se_apply")?,
            pool: module.load_function("pool_stats")?,
            rvq: module.load_function("rvq_encode")?,
        };
        let workspace = zeros::<f32>(&stream, SPLIT_WORKSPACE_FLOATS, "split-depth workspace")?;
        let counters = zeros::<u32>(&stream, SPLIT_COUNTERS, "split-depth counters")?;
        let tables = zeros::<u32>(&stream, 8, "the batch tables")?;
        let t = device_ptr(&tables, &stream);
        let batch = Batch {
            frame_entry: t,
            entry_frame0: t,
            entry_frames: t,
            entry_slot: t,
            entry_pos0: t,
            codes: t,
            rope_cos: t,
            rope_sin: t,
            frames: 1,
            entries: 1,
        };
        stream.synchronize()?;
        Ok(Self {
            stream,
            kernels,
            workspace,
            counters,
            _tables: tables,
            batch,
        })
    }

    fn rows(&self, width: usize, pad: usize, rows: usize, tail: usize, what: &str) -> Result<Rows> {
        let buf = zeros::<f32>(&self.stream, (pad + rows + tail) * width, what)?;
        Ok(Rows {
            base: device_ptr(&buf, &self.stream),
            buf,
            width,
            pad,
            rows,
            tail,
        })
    }

    /// `data` (`[rows][width]`) on the device, without padding.
    fn upload(&self, data: &[f32], width: usize) -> Result<Rows> {
        let buf = self.stream.clone_htod(data).context("uploading rows")?;
        Ok(Rows {
            base: device_ptr(&buf, &self.stream),
            buf,
            width,
            pad: 0,
            rows: data.len() / width,
            tail: 0,
        })
    }

    /// Uploads packed weights once; ops refer to them by offset from the returned address.
    fn upload_weights(&self, data: &[f32]) -> Result<(CudaSlice<f32>, u64)> {
        let buf = self
            .stream
            .clone_htod(data)
            .context("uploading encoder weights")?;
        let base = device_ptr(&buf, &self.stream);
        self.stream.synchronize()?;
        Ok((buf, base))
    }

    fn gemm(&self, g: &GemmCall) -> Result<()> {
        self.launch_gemm(
            g,
            self.kernels
                .gemm
                .plan(g.m, g.n, g.taps * g.cin, PipeUse::Never),
        )
    }

    /// `g` as `plan` shapes it (a tiled plan).
    fn launch_gemm(&self, g: &GemmCall, plan: GemmKernel) -> Result<()> {
        let k = g.taps * g.cin;
        let GemmKernel::Tiled { bm, k_split, .. } = plan else {
            bail!("internal: the encoders use the tiled GEMM only");
        };
        let (function, grid) = self
            .kernels
            .gemm
            .function(plan, g.m, g.n)
            .context("internal: no GEMM kernel for the plan")?;
        ensure!(
            grid.1 <= MAX_GRID_Y,
            "encoder: {} rows are more than one GEMM launch takes ({})",
            g.m,
            MAX_GRID_Y * bm
        );
        let p = GemmParams {
            input: g.input,
            w: g.w,
            bias: g.bias,
            out: g.out,
            res: g.res,
            col_scale: g.col_scale,
            workspace: device_ptr(&self.workspace, &self.stream),
            counters: device_ptr(&self.counters, &self.stream),
            m: g.m as i32,
            n: g.n as i32,
            k: k as i32,
            rate: g.m as i32,
            cin: g.cin as i32,
            taps: g.taps as i32,
            dilation: g.dilation as i32,
            out_width: g.out_ld as i32,
            out_stride: 1,
            bias_len: g.n as i32,
            act: g.act,
            epi: g.epi,
            k_split: k_split as i32,
            ..Default::default()
        };
        let cfg = LaunchConfig {
            grid_dim: (grid.0 as u32, grid.1 as u32, grid.2 as u32),
            block_dim: (GEMM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = self.stream.launch_builder(function);
        l.arg(&p).arg(&self.batch);
        // SAFETY: the callers size `input` for `m` rows of `taps` taps `dilation` apart, `out`
        // (and `res`) for `m` rows of `out_ld` floats, the weights for `taps * cin x n` floats
        // plus `n` of bias and column scale; split plans stay within the workspace and counters;
        // the one-entry batch maps every row to entry 0 at frame 0.
        unsafe { l.launch(cfg) }.context("launching conv_gemm")?;
        Ok(())
    }

    fn gather(&self, p: GatherParams) -> Result<()> {
        let written = if p.pad_only != 0 {
            p.left + p.right
        } else {
            p.left + p.rows + p.right
        };
        let total = written as usize * p.cols as usize;
        if total == 0 {
            return Ok(());
        }
        let mut l = self.stream.launch_builder(&self.kernels.gather);
        l.arg(&p);
        // SAFETY: `dst` holds `left + rows + right` rows of `dst_ld` floats; `a` and `b` hold
        // `rows` rows of their strides (one row for a broadcast); edge rows map into 0..rows.
        unsafe { l.launch(launch_config(total.div_ceil(THREADS as usize), THREADS, 0)) }
            .context("launching gather_rows")?;
        Ok(())
    }

    /// Fills the padding rows of `x` from its own rows (reflect or replicate).
    fn pad_in_place(&self, x: &Rows, mode: i32) -> Result<()> {
        ensure!(
            mode == PAD_REPLICATE || x.rows > x.pad.max(x.tail),
            "reflect padding of {}/{} rows needs more than {} rows, got {}",
            x.pad,
            x.tail,
            x.pad.max(x.tail),
            x.rows
        );
        self.gather(GatherParams {
            dst: x.first(),
            a: x.row(0),
            dst_ld: x.width as i32,
            a_ld: x.width as i32,
            rows: x.rows as i32,
            cols: x.width as i32,
            left: x.pad as i32,
            right: x.tail as i32,
            mode,
            pad_only: 1,
            ..Default::default()
        })
    }

    /// `[rows][width]` LayerNorm of `input` into `out` (weight and bias addresses).
    fn layer_norm(
        &self,
        input: u64,
        out: u64,
        (w, b): (u64, u64),
        rows: usize,
        width: usize,
        eps: f32,
    ) -> Result<()> {
        let p = LayerNormParams {
            input,
            out,
            w,
            b,
            width: width as i32,
            eps,
        };
        let mut l = self.stream.launch_builder(&self.kernels.layer_norm);
        l.arg(&p);
        // SAFETY: one block per row of `width` floats in both buffers.
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe { l.launch(cfg) }.context("launching layer_norm")?;
        Ok(())
    }

    fn download_u32(&self, buf: &CudaSlice<u32>) -> Result<Vec<u32>> {
        let out = self.stream.clone_dtoh(buf)?;
        self.stream.synchronize()?;
        Ok(out)
    }

    fn download(&self, x: &Rows) -> Result<Vec<f32>> {
        let all = self.stream.clone_dtoh(&x.buf)?;
        self.stream.synchronize()?;
        let start = x.pad * x.width;
        Ok(all[start..start + x.rows * x.width].to_vec())
    }
}

/// The speaker encoder and the speech tokenizer's encoder of a Base checkpoint, on the GPU
/// (device 0), with the log-mel front end on the CPU.
pub struct CudaVoiceEncoder {
    mel: MelSpectrogram,
    speaker: SpeakerEncoder,
    tokenizer: TokenizerEncoder,
    /// Encode calls take turns: they share the stream and the GEMM's split scratch.
    gpu: Mutex<Gpu>,
    device_name: String,
}

impl CudaVoiceEncoder {
    /// Loads both encoders (f32) from a Base checkpoint, compiling the kernels on first use.
    pub fn from_checkpoint(checkpoint: &Checkpoint) -> Result<Self> {
        let gpu = Gpu::new(CodecPrecision::F32)?;
        let device_name = gpu
            .stream
            .context()
            .name()
            .unwrap_or_else(|_| "unknown GPU".to_string());
        Ok(Self {
            mel: MelSpectrogram::new()?,
            speaker: SpeakerEncoder::from_checkpoint(checkpoint, &gpu)?,
            tokenizer: TokenizerEncoder::from_checkpoint(checkpoint, &gpu)?,
            gpu: Mutex::new(gpu),
            device_name,
        })
    }

    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    fn gpu(&self) -> Result<std::sync::MutexGuard<'_, Gpu>> {
        self.gpu
            .lock()
            .map_err(|_| anyhow::anyhow!("a previous encode call panicked on the GPU"))
    }
}

impl CloneEncoder for CudaVoiceEncoder {
    fn name(&self) -> String {
        format!("cuda ({}, f32; log-mel on the CPU)", self.device_name)
    }

    fn x_vector(&self, audio: &ReferenceAudio) -> Result<Vec<f32>> {
        let mel = self.mel.log_mel(audio.samples())?;
        self.speaker.forward(&*self.gpu()?, &mel)
    }

    fn reference_codes(&self, audio: &ReferenceAudio) -> Result<Vec<Frame>> {
        self.tokenizer.encode(&*self.gpu()?, audio.samples())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_blocks_have_the_kernel_layout() {
        // Sizes from the CUDA declarations: pointers first, then 4-byte fields, padded to 8.
        assert_eq!(std::mem::size_of::<GatherParams>(), 3 * 8 + 9 * 4 + 4);
        assert_eq!(std::mem::size_of::<LayerNormParams>(), 4 * 8 + 2 * 4);
        assert_eq!(std::mem::size_of::<RopeParams>(), 3 * 8 + 3 * 4 + 4);
        assert_eq!(std::mem::size_of::<CausalAttnParams>(), 2 * 8 + 4 * 4);
        assert_eq!(std::mem::size_of::<SeGateParams>(), 6 * 8 + 3 * 4 + 4);
        assert_eq!(std::mem::size_of::<SeApplyParams>(), 5 * 8 + 3 * 4 + 4);
        assert_eq!(std::mem::size_of::<PoolParams>(), 3 * 8 + 2 * 4);
        assert_eq!(std::mem::size_of::<RvqEncodeParams>(), 4 * 8 + 5 * 4 + 4);
    }

    /// The folded GEMM (`conv_gemm_fold_64`, which the codec runs on passes of many rows) and
    /// the pipelined ones (`conv_gemm_pipe_128`, split and folded) add a depth split's sums in
    /// the split launch's order, so all give the same bits; and all are the product an f64 loop
    /// on the host computes, to f32 accuracy. Rows, columns and depth are not multiples of the
    /// tile (1,000 x 200, depth 3 taps x 100 or 96 in splits of 64, the last one short), and the
    /// taps are 2 rows apart. The pipelined kernels need the input width to be a multiple of 16.
    #[test]
    #[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
    fn folded_and_pipelined_depth_splits_equal_the_split_launch_bit_for_bit() {
        assert!(runtime::driver_available(), "this test needs a CUDA driver");
        let gpu = Gpu::new(CodecPrecision::F32).unwrap();
        // (tile height, pipelined, folded); the first is the reference.
        let plain = [(64, false, false), (64, false, true)];
        let piped = [(128, true, false), (128, true, true)];
        for (cin, plans) in [(100, plain.to_vec()), (96, [plain, piped].concat())] {
            same_bits_as_the_split_launch(&gpu, cin, &plans, F32_BOUND);
        }
    }

    /// f32 sums over a depth of 300 land within a few 1e-7 of the largest output; a tap or a
    /// split dropped or counted twice is off by a whole term (~1e-2 and more).
    const F32_BOUND: f64 = 1e-5;

    /// The TF32 pipelined kernels (`CodecPrecision::Tf32`): split and folded give the same
    /// bits, and the product is the f64 one to TF32 accuracy. Operands rounded to 10-bit
    /// mantissas err by up to 2^-11 each, so on these uniform operands a sum of 288 terms is
    /// expected about 4e-4 of the largest output away at worst; the bound is 5x that, still
    /// far below a dropped term (~1e-2).
    #[test]
    #[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
    fn tf32_depth_splits_equal_the_split_launch_bit_for_bit_and_the_product_to_tf32_accuracy() {
        assert!(runtime::driver_available(), "this test needs a CUDA driver");
        let gpu = Gpu::new(CodecPrecision::Tf32).unwrap();
        same_bits_as_the_split_launch(&gpu, 96, &[(128, true, false), (128, true, true)], 2e-3);
    }

    fn same_bits_as_the_split_launch(
        gpu: &Gpu,
        cin: usize,
        plans: &[(usize, bool, bool)],
        bound: f64,
    ) {
        let (m, taps, dilation, n, k_split): (usize, usize, usize, usize, usize) =
            (1000, 3, 2, 200, 64);
        let k = taps * cin;
        let splits = k.div_ceil(k_split);
        let mut state = 11u64;
        let mut uniform = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        let input: Vec<f32> = (0..(m + (taps - 1) * dilation) * cin)
            .map(|_| uniform())
            .collect();
        let w: Vec<f32> = (0..k * n).map(|_| uniform()).collect();
        let input_dev = gpu.stream.clone_htod(&input).unwrap();
        let w_dev = gpu.stream.clone_htod(&w).unwrap();
        let mut results = Vec::new();
        for &(bm, pipe, fold) in plans {
            let out = gpu.stream.alloc_zeros::<f32>(m * n).unwrap();
            let call = GemmCall {
                taps,
                dilation,
                ..GemmCall::matmul(
                    device_ptr(&input_dev, &gpu.stream),
                    cin,
                    m,
                    device_ptr(&w_dev, &gpu.stream),
                    n,
                    device_ptr(&out, &gpu.stream),
                )
            };
            let plan = GemmKernel::Tiled {
                bm,
                pipe,
                splits,
                k_split,
                fold,
            };
            gpu.launch_gemm(&call, plan).unwrap();
            results.push(gpu.stream.clone_dtoh(&out).unwrap());
        }
        let split = &results[0];
        for (other, plan) in results.iter().zip(plans).skip(1) {
            let differing = split
                .iter()
                .zip(other)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(
                differing,
                0,
                "cin {cin}, (bm, pipe, fold) {plan:?}: {differing} of {} outputs differ",
                m * n
            );
        }
        let (mut worst, mut scale) = (0f64, 0f64);
        for g in 0..m {
            for c in 0..n {
                let want: f64 = (0..taps)
                    .flat_map(|t| (0..cin).map(move |ch| (t, ch)))
                    .map(|(t, ch)| {
                        input[(g + t * dilation) * cin + ch] as f64
                            * w[(t * cin + ch) * n + c] as f64
                    })
                    .sum();
                worst = worst.max((split[g * n + c] as f64 - want).abs());
                scale = scale.max(want.abs());
            }
        }
        let err = worst / scale;
        println!("cin {cin}, {splits} splits of {k_split}: rel err {err:.2e} against f64");
        assert!(err <= bound, "rel err {err:.2e} (bound {bound:.0e})");
    }
}
