//! The Base models' speaker encoder on the GPU: ECAPA-TDNN without BatchNorm, from log-mel
//! frames to the x-vector. Mirrors `voxkernel_core::reference::speaker_encoder` layer by layer,
//! from the same `SpeakerEncoderGeometry`; every convolution is PyTorch's `padding="same"` with
//! reflect padding, made by `gather_rows` into a padded copy of the input before the GEMM reads
//! it.

use anyhow::{Result, ensure};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use voxkernel_core::checkpoint::Checkpoint;
use voxkernel_core::encoder_geometry::{
    SeRes2NetBlockGeometry, SpeakerConv, SpeakerEncoderGeometry,
};
use voxkernel_core::reference::mel::N_MELS;

use super::{
    DEFAULT_SMEM_BYTES, GatherParams, GemmCall, Gpu, PAD_REFLECT, PoolParams, Rows, SeApplyParams,
    SeGateParams, THREADS, Tensors, launch_config,
};
use crate::codec::{ACT_NONE, ACT_TANH, EPI_NONE, EPI_RELU, Packer, conv_weight, transpose};

/// A `Conv1d` with bias (`[out, in, kernel]`, dilated), its weights at packed offsets.
#[derive(Debug, Clone, Copy)]
struct Conv {
    w: usize,
    bias: usize,
    inp: usize,
    out: usize,
    kernel: usize,
    dilation: usize,
}

impl Conv {
    /// `name.weight` and `name.bias`.
    fn load(t: &Tensors, packer: &mut Packer, conv: &SpeakerConv) -> Result<Self> {
        let SpeakerConv {
            out,
            inp,
            kernel,
            dilation,
            ..
        } = *conv;
        let w = t.get(&format!("{}.weight", conv.name), &[out, inp, kernel])?;
        let bias = t.get(&format!("{}.bias", conv.name), &[out])?;
        Ok(Self {
            w: packer.push(&conv_weight(&w, out, inp, kernel)),
            bias: packer.push(&bias),
            inp,
            out,
            kernel,
            dilation,
        })
    }

    /// Reflect rows before and after: PyTorch's "same" puts `span / 2` on the left.
    fn pads(&self) -> (usize, usize) {
        let span = (self.kernel - 1) * self.dilation;
        (span / 2, span - span / 2)
    }
}

/// TDNN 1x1, Res2Net, TDNN 1x1, squeeze-excitation, plus the input.
struct SeRes2NetBlock {
    tdnn1: Conv,
    /// Chunk `i >= 1` goes through `res2net[i - 1]`; chunk 0 passes through.
    res2net: Vec<Conv>,
    tdnn2: Conv,
    /// `se_block.conv1` as `[channels][se]` and `se_block.conv2` as `[se][channels]`, with
    /// their biases.
    se_w1: usize,
    se_b1: usize,
    se_w2: usize,
    se_b2: usize,
    se: usize,
    channels: usize,
}

pub(super) struct SpeakerEncoder {
    _weights: CudaSlice<f32>,
    base: u64,
    block0: Conv,
    blocks: Vec<SeRes2NetBlock>,
    mfa: Conv,
    asp_tdnn: Conv,
    asp_conv: Conv,
    fc: Conv,
    mel_dim: usize,
}

impl SpeakerEncoder {
    /// The speaker encoder of a Base checkpoint, with the CUDA kernels' limits.
    pub(super) fn from_checkpoint(checkpoint: &Checkpoint, gpu: &Gpu) -> Result<Self> {
        let geometry = SpeakerEncoderGeometry::from_checkpoint(checkpoint)?;
        let mel_dim = geometry.mel_dim();
        ensure!(
            mel_dim == N_MELS,
            "config.json: speaker_encoder_config.mel_dim is {mel_dim}; the mel front end gives \
             {N_MELS}"
        );
        for block in &geometry.blocks {
            let (channels, se) = (block.tdnn2.out, block.se_conv1.out);
            ensure!(
                4 * (channels + se) <= DEFAULT_SMEM_BYTES,
                "speaker_encoder_config: {channels} + {se} channels are too many for the CUDA \
                 squeeze-excitation kernel"
            );
        }
        let t = Tensors {
            file: &checkpoint.model,
            prefix: "speaker_encoder.",
        };
        let mut packer = Packer::default();
        let p = &mut packer;
        let blocks = geometry
            .blocks
            .iter()
            .map(|block| load_block(&t, p, block))
            .collect::<Result<Vec<_>>>()?;
        let block0 = Conv::load(&t, p, &geometry.block0)?;
        let mfa = Conv::load(&t, p, &geometry.mfa)?;
        let asp_tdnn = Conv::load(&t, p, &geometry.asp_tdnn)?;
        let asp_conv = Conv::load(&t, p, &geometry.asp_conv)?;
        let fc = Conv::load(&t, p, &geometry.fc)?;
        let (weights, base) = gpu.upload_weights(&packer.data)?;
        Ok(Self {
            _weights: weights,
            base,
            block0,
            blocks,
            mfa,
            asp_tdnn,
            asp_conv,
            fc,
            mel_dim,
        })
    }

    fn weight(&self, offset: usize) -> u64 {
        self.base + 4 * offset as u64
    }

    /// Log-mel frames (`[frames][mel_dim]`, row-major) to the x-vector.
    pub(super) fn forward(&self, gpu: &Gpu, mel: &[f32]) -> Result<Vec<f32>> {
        ensure!(
            !mel.is_empty() && mel.len().is_multiple_of(self.mel_dim),
            "speaker encoder: {} mel values are not whole frames of {}",
            mel.len(),
            self.mel_dim
        );
        let frames = mel.len() / self.mel_dim;
        let mel = gpu.upload(mel, self.mel_dim)?;
        let mut x = gpu.rows(self.block0.out, 0, frames, 0, "speaker block 0 output")?;
        self.conv(
            gpu,
            &self.block0,
            (&mel, 0),
            None,
            &x,
            0,
            ACT_NONE,
            EPI_RELU,
        )?;
        let aggregated = gpu.rows(self.mfa.inp, 0, frames, 0, "aggregated block outputs")?;
        let mut column = 0;
        for block in &self.blocks {
            x = self.se_res2net(gpu, block, &x, &aggregated, column)?;
            column += block.channels;
        }
        let channels = self.mfa.out;
        let h = gpu.rows(channels, 0, frames, 0, "aggregation output")?;
        self.conv(
            gpu,
            &self.mfa,
            (&aggregated, 0),
            None,
            &h,
            0,
            ACT_NONE,
            EPI_RELU,
        )?;

        // Attentive statistics pooling: attention over time from [h, mean, std] (the uniform
        // statistics broadcast to every row), then the attention-weighted statistics.
        let stats = gpu.rows(2 * channels, 0, 1, 0, "uniform statistics")?;
        self.pool(gpu, &h, None, &stats)?;
        let context = gpu.rows(3 * channels, 0, frames, 0, "attention context")?;
        for (part, (src, src_ld)) in [
            (h.row(0), channels),
            (stats.row(0), 0),
            (stats.row(0) + 4 * channels as u64, 0),
        ]
        .into_iter()
        .enumerate()
        {
            gpu.gather(GatherParams {
                dst: context.row(0) + 4 * (part * channels) as u64,
                a: src,
                dst_ld: context.width as i32,
                a_ld: src_ld as i32,
                rows: frames as i32,
                cols: channels as i32,
                mode: PAD_REFLECT,
                ..Default::default()
            })?;
        }
        let attention = gpu.rows(self.asp_tdnn.out, 0, frames, 0, "attention hidden")?;
        let tdnn = &self.asp_tdnn;
        self.conv(
            gpu,
            tdnn,
            (&context, 0),
            None,
            &attention,
            0,
            ACT_NONE,
            EPI_RELU,
        )?;
        let scores = gpu.rows(channels, 0, frames, 0, "attention scores")?;
        let conv = &self.asp_conv;
        self.conv(
            gpu,
            conv,
            (&attention, 0),
            None,
            &scores,
            0,
            ACT_TANH,
            EPI_NONE,
        )?;
        let pooled = gpu.rows(2 * channels, 0, 1, 0, "pooled statistics")?;
        self.pool(gpu, &h, Some(&scores), &pooled)?;
        let x_vector = gpu.rows(self.fc.out, 0, 1, 0, "x-vector")?;
        self.conv(
            gpu,
            &self.fc,
            (&pooled, 0),
            None,
            &x_vector,
            0,
            ACT_NONE,
            EPI_NONE,
        )?;
        gpu.download(&x_vector)
    }

    /// One SE-Res2Net block from `x`; also writes its output into columns `column..` of
    /// `aggregated` (the multi-layer aggregation's input).
    fn se_res2net(
        &self,
        gpu: &Gpu,
        block: &SeRes2NetBlock,
        x: &Rows,
        aggregated: &Rows,
        column: usize,
    ) -> Result<Rows> {
        let (frames, c) = (x.rows, block.channels);
        // tdnn1's output, then chunk by chunk the Res2Net outputs in its place: chunk i is read
        // (into the padded input of res2net[i - 1]) before output i overwrites it.
        let chunks = gpu.rows(c, 0, frames, 0, "Res2Net chunks")?;
        let tdnn1 = &block.tdnn1;
        self.conv(gpu, tdnn1, (x, 0), None, &chunks, 0, ACT_NONE, EPI_RELU)?;
        let width = c / (block.res2net.len() + 1);
        for (i, conv) in block.res2net.iter().enumerate().map(|(i, c)| (i + 1, c)) {
            let previous = (i >= 2).then_some((&chunks, (i - 1) * width));
            let chunk = (&chunks, i * width);
            self.conv(
                gpu,
                conv,
                chunk,
                previous,
                &chunks,
                i * width,
                ACT_NONE,
                EPI_RELU,
            )?;
        }
        let h = gpu.rows(c, 0, frames, 0, "tdnn2 output")?;
        self.conv(
            gpu,
            &block.tdnn2,
            (&chunks, 0),
            None,
            &h,
            0,
            ACT_NONE,
            EPI_RELU,
        )?;

        let gate = gpu.rows(c, 0, 1, 0, "squeeze-excitation gate")?;
        let p = SeGateParams {
            h: h.row(0),
            gate: gate.row(0),
            w1: self.weight(block.se_w1),
            b1: self.weight(block.se_b1),
            w2: self.weight(block.se_w2),
            b2: self.weight(block.se_b2),
            rows: frames as i32,
            channels: c as i32,
            se: block.se as i32,
        };
        let mut l = gpu.stream.launch_builder(&gpu.kernels.se_gate);
        l.arg(&p);
        // SAFETY: one block; `h` holds `rows x channels`, the weights `channels x se` each, and
        // the shared memory `channels + se` floats (checked against the default limit at load).
        unsafe { l.launch(launch_config(1, THREADS, 4 * (c + block.se))) }?;
        let out = gpu.rows(c, 0, frames, 0, "SE-Res2Net block output")?;
        let p = SeApplyParams {
            h: h.row(0),
            gate: gate.row(0),
            res: x.row(0),
            out: out.row(0),
            out2: aggregated.row(0) + 4 * column as u64,
            rows: frames as i32,
            channels: c as i32,
            out2_ld: aggregated.width as i32,
        };
        let mut l = gpu.stream.launch_builder(&gpu.kernels.se_apply);
        l.arg(&p);
        // SAFETY: `h`, `x` and `out` hold `rows x channels`; `aggregated` holds `rows` rows of
        // `out2_ld >= column + channels` floats.
        let blocks = (frames * c).div_ceil(THREADS as usize);
        unsafe { l.launch(launch_config(blocks, THREADS, 0)) }?;
        Ok(out)
    }

    /// `conv` over the `rows` rows of `input` from column `column` (`(rows, column)`), plus the
    /// same columns of `add` when given, reflect-padded "same", into `out` from column
    /// `out_column`. The input is gathered into a padded copy unless it can be read in place
    /// (no padding, no add, whole rows).
    #[allow(clippy::too_many_arguments)]
    fn conv(
        &self,
        gpu: &Gpu,
        conv: &Conv,
        (input, column): (&Rows, usize),
        add: Option<(&Rows, usize)>,
        out: &Rows,
        out_column: usize,
        act: i32,
        epi: i32,
    ) -> Result<()> {
        let frames = input.rows;
        let (left, right) = conv.pads();
        let source = input.row(0) + 4 * column as u64;
        let padded = if left + right > 0 || add.is_some() || input.width != conv.inp {
            ensure!(
                frames > left.max(right),
                "speaker encoder: reflect padding of {left}/{right} rows needs more than {} \
                 frames, got {frames}",
                left.max(right)
            );
            let padded = gpu.rows(conv.inp, left, frames, right, "padded conv input")?;
            let (b, b_ld) = add.map_or((0, 0), |(rows, col)| {
                (rows.row(0) + 4 * col as u64, rows.width as i32)
            });
            gpu.gather(GatherParams {
                dst: padded.first(),
                a: source,
                b,
                dst_ld: conv.inp as i32,
                a_ld: input.width as i32,
                b_ld,
                rows: frames as i32,
                cols: conv.inp as i32,
                left: left as i32,
                right: right as i32,
                mode: PAD_REFLECT,
                pad_only: 0,
            })?;
            Some(padded)
        } else {
            None
        };
        gpu.gemm(&GemmCall {
            taps: conv.kernel,
            dilation: conv.dilation,
            act,
            bias: self.weight(conv.bias),
            epi,
            out_ld: out.width,
            ..GemmCall::matmul(
                padded.as_ref().map_or(source, Rows::first),
                conv.inp,
                frames,
                self.weight(conv.w),
                conv.out,
                out.row(0) + 4 * out_column as u64,
            )
        })
    }

    /// `pool_stats`: the statistics of `x` over time, uniform or under the softmax of `scores`.
    fn pool(&self, gpu: &Gpu, x: &Rows, scores: Option<&Rows>, out: &Rows) -> Result<()> {
        let p = PoolParams {
            x: x.row(0),
            scores: scores.map_or(0, |s| s.row(0)),
            out: out.row(0),
            rows: x.rows as i32,
            channels: x.width as i32,
        };
        let mut l = gpu.stream.launch_builder(&gpu.kernels.pool);
        l.arg(&p);
        // SAFETY: one thread per channel; `x` and `scores` hold `rows x channels`, `out`
        // `2 x channels`.
        let cfg = LaunchConfig {
            grid_dim: (x.width.div_ceil(THREADS as usize) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe { l.launch(cfg) }?;
        Ok(())
    }
}

/// The squeeze-excitation's 1x1 convs are read as matrices (`se_gate` multiplies by them), the
/// rest as convs.
fn load_block(
    t: &Tensors,
    p: &mut Packer,
    block: &SeRes2NetBlockGeometry,
) -> Result<SeRes2NetBlock> {
    let (se1, se2) = (&block.se_conv1, &block.se_conv2);
    let res2net = block
        .res2net
        .iter()
        .map(|conv| Conv::load(t, p, conv))
        .collect::<Result<Vec<_>>>()?;
    let w1 = t.get(&format!("{}.weight", se1.name), &se1.shape())?;
    let b1 = t.get(&format!("{}.bias", se1.name), &[se1.out])?;
    let w2 = t.get(&format!("{}.weight", se2.name), &se2.shape())?;
    let b2 = t.get(&format!("{}.bias", se2.name), &[se2.out])?;
    Ok(SeRes2NetBlock {
        tdnn1: Conv::load(t, p, &block.tdnn1)?,
        res2net,
        tdnn2: Conv::load(t, p, &block.tdnn2)?,
        se_w1: p.push(&transpose(&w1, se1.out, se1.inp)),
        se_b1: p.push(&b1),
        se_w2: p.push(&transpose(&w2, se2.out, se2.inp)),
        se_b2: p.push(&b2),
        se: se1.out,
        channels: block.tdnn2.out,
    })
}
