//! `CudaBackend`: the frame megakernel behind the `FrameBackend` contract.

use std::sync::Arc;

use anyhow::{Context, Result, bail, ensure};
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PinnedHostSlice,
    PushKernelArg, ValidAsZeroBits,
};
use voxkernel_core::backend::{
    FinishReason, Frame, FrameBackend, FrameEvent, NUM_CODE_GROUPS, SequenceSpec, SlotId,
};
use voxkernel_core::checkpoint::Checkpoint;
use voxkernel_core::prompt::{CodecSource, PromptPlan};
use voxkernel_core::sampling::{SamplerParams, SamplingConfig};

use crate::layout::{
    BLOCK_THREADS, BLOCK_WARPS, CODE_WORDS, CODEC_ID, CODEC_NONE, CODEC_REFERENCE, CODEC_SPEAKER,
    EmbedParams, FrameParams, HEADS_PER_PASS, HIST_WORDS, MAX_BATCH, MAX_HEAD_DIM, MODE_FRAME,
    MODE_PREFILL, OWN_CODES, Sampler, Stack,
};
use crate::runtime;
use crate::weights::{DeviceWeights, Geometry, StackGeometry};

/// Sizes fixed at construction: nothing is allocated on the device after `new`.
#[derive(Debug, Clone, Copy)]
pub struct CudaOptions {
    /// Concurrent sequences (KV cache slots).
    pub max_slots: usize,
    /// Talker positions per sequence: prefill rows + frames. Also bounds the trailing text rows.
    pub max_len: usize,
    /// Positions per attention block (0 = all of a sequence's in one block per kv head): long
    /// contexts then spread over more SMs.
    pub attention_chunk: usize,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            max_slots: 4,
            max_len: 2048,
            attention_chunk: 64,
        }
    }
}

/// One profile mark: block 0's SM clock when a phase of the launch ended, and which phase it
/// was (`layout::PHASE_NAMES` index, plus `layout::PHASE_TALKER` for the talker stack).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PhaseMark {
    pub phase: u64,
    pub clock: u64,
}

/// What one teacher-forced frame produced.
#[derive(Debug, Clone)]
pub struct ForcedStep {
    /// Raw codebook-0 logits of the talker step (before any logit processor).
    pub logits: Vec<f32>,
    /// The kernel's own choices for groups 1..15 of the forced frame (index 0 repeats the
    /// forced codebook 0).
    pub own_frame: Frame,
    /// The kernel's own choice for the next codebook 0.
    pub own_next_c0: u32,
}

#[derive(Debug, Clone)]
struct SlotState {
    /// Next talker position (prefill rows + frames so far).
    pos: usize,
    /// Frames produced so far (the official `generation_step`).
    frames: usize,
    /// The pending codebook-0 token: the next frame's first code.
    c0: u32,
    /// Codebook-0 tokens sampled so far (prefill included).
    n_sampled: usize,
    trailing_len: usize,
    max_frames: usize,
    sampling: SamplingConfig,
    finished: Option<FinishReason>,
}

/// Device scratch and per-slot state, all allocated once.
struct Buffers {
    talker_k: CudaSlice<f32>,
    talker_v: CudaSlice<f32>,
    cp_k: CudaSlice<f32>,
    cp_v: CudaSlice<f32>,
    talker_rope: CudaSlice<f32>,
    cp_rope: CudaSlice<f32>,
    past_hidden: CudaSlice<f32>,
    trailing: CudaSlice<f32>,
    seen: CudaSlice<u8>,
    talker_logits: CudaSlice<f32>,
    prefill_rows: CudaSlice<f32>,
    x: CudaSlice<f32>,
    qkv: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    attn_part: CudaSlice<f32>,
    attn_count: CudaSlice<u32>,
    gate_up: CudaSlice<f32>,
    cp_logits: CudaSlice<f32>,
    codes: CudaSlice<i32>,
    barrier: CudaSlice<u32>,
    marks: CudaSlice<u64>,
    embed_rows: CudaSlice<i32>,
    speaker: CudaSlice<f32>,
    ref_codes: CudaSlice<i32>,
}

fn zeros<T: cudarc::driver::DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    len: usize,
    what: &str,
) -> Result<CudaSlice<T>> {
    stream
        .alloc_zeros::<T>(len.max(1))
        .with_context(|| format!("allocating {what} ({len} elements)"))
}

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    frame_fn: CudaFunction,
    embed_fn: CudaFunction,
    geometry: Geometry,
    options: CudaOptions,
    weights: DeviceWeights,
    bufs: Buffers,
    /// Pointers and sizes; every launch copies it and fills the per-launch fields.
    base: FrameParams,
    embed_base: EmbedParams,
    grid: u32,
    frame_smem: u32,
    /// Record phase marks (`FrameParams::marks`) in every launch.
    profile: bool,
    embed_smem: u32,
    codes_host: PinnedHostSlice<i32>,
    slots: Vec<Option<SlotState>>,
    device_name: String,
    /// The text-track id of the trailing row after the text runs out.
    tts_pad_id: u32,
}

fn ptr<T>(slice: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    slice.device_ptr(stream).0
}

fn stack_params(
    s: &StackGeometry,
    layers: u64,
    final_norm: u64,
    rope: u64,
    k: u64,
    v: u64,
    max_len: usize,
) -> Stack {
    Stack {
        layers,
        final_norm,
        rope,
        k_cache: k,
        v_cache: v,
        hidden: s.hidden as i32,
        inter: s.inter as i32,
        n_heads: s.n_heads as i32,
        n_kv: s.n_kv as i32,
        head_dim: s.head_dim as i32,
        n_layers: s.layers as i32,
        max_len: max_len as i32,
        eps: s.eps,
    }
}

fn attention_work_floats(s: &StackGeometry) -> usize {
    let group = s.n_heads / s.n_kv;
    let partials = HEADS_PER_PASS * BLOCK_WARPS;
    // + the flag of the chunk that merges
    (group + 1) * s.head_dim + 2 * partials + partials * s.head_dim + 1
}

/// Sampling scratch: the logits, the radix histogram, and top-p's two index arrays.
fn sampling_work_floats(vocab: usize) -> usize {
    3 * vocab + HIST_WORDS
}

fn sampler(p: &SamplerParams, what: &str) -> Result<Sampler> {
    if p.do_sample {
        ensure!(
            p.temperature > 0.0,
            "{what}.temperature = {}: must be > 0 when sampling",
            p.temperature
        );
        ensure!(
            p.top_p > 0.0 && p.top_p <= 1.0,
            "{what}.top_p = {}: must be in (0, 1]",
            p.top_p
        );
    }
    Ok(Sampler {
        do_sample: p.do_sample as i32,
        top_k: p.top_k.min(i32::MAX as usize) as i32,
        temperature: p.temperature,
        repetition_penalty: p.repetition_penalty,
        top_p: p.top_p,
    })
}

impl CudaBackend {
    pub fn new(checkpoint: &Checkpoint, options: CudaOptions) -> Result<Self> {
        ensure!(options.max_slots > 0, "max_slots must be at least 1");
        ensure!(options.max_len > 1, "max_len must be at least 2");
        let geometry = Geometry::from_checkpoint(checkpoint)?;
        let ctx = runtime::open_device()?;
        let stream = ctx.default_stream();
        let module = runtime::load_module(&ctx)?;
        let frame_fn = module.load_function("frame_kernel")?;
        let embed_fn = module.load_function("embed_rows")?;
        let weights = DeviceWeights::upload(checkpoint, &geometry, &stream)?;

        let (t, c) = (&geometry.talker, &geometry.cp);
        let g = geometry.groups;
        let (slots, max_len) = (options.max_slots, options.max_len);
        let max_hidden = t.hidden.max(c.hidden);
        let max_qkv = t.qkv_width().max(c.qkv_width());
        let max_q = t.q_width().max(c.q_width());
        let max_inter = t.inter.max(c.inter);
        // start + per predictor pass (input, 5 per layer, head, sampling) + the talker's
        let max_marks = 1 + g * (3 + 5 * c.layers) + 5 * t.layers + 3;
        // attention partials: per sequence, every q head's chunks (the talker's positions or the
        // predictor's groups, whichever needs more), each head_dim outputs + max + denominator
        // a chunk as long as the cache is one chunk (and keeps the kernel's int in range)
        let attention_chunk = options.attention_chunk.min(max_len.max(g));
        let max_chunks = match attention_chunk {
            0 => 1,
            chunk => max_len.max(g).div_ceil(chunk),
        };
        let attn_part_stride = t.n_heads.max(c.n_heads) * max_chunks * (MAX_HEAD_DIM + 2);
        let bufs = Buffers {
            talker_k: zeros(
                &stream,
                slots * t.layers * t.kv_width() * max_len,
                "talker K cache",
            )?,
            talker_v: zeros(
                &stream,
                slots * t.layers * t.kv_width() * max_len,
                "talker V cache",
            )?,
            cp_k: zeros(
                &stream,
                MAX_BATCH * c.layers * c.kv_width() * g,
                "predictor K cache",
            )?,
            cp_v: zeros(
                &stream,
                MAX_BATCH * c.layers * c.kv_width() * g,
                "predictor V cache",
            )?,
            talker_rope: stream
                .clone_htod(&t.rope_table(max_len))
                .context("uploading the talker's rotary table")?,
            cp_rope: stream
                .clone_htod(&c.rope_table(g))
                .context("uploading the predictor's rotary table")?,
            past_hidden: zeros(&stream, slots * t.hidden, "past_hidden")?,
            trailing: zeros(&stream, slots * max_len * t.hidden, "trailing rows")?,
            seen: zeros(&stream, slots * geometry.vocab, "codebook-0 history")?,
            talker_logits: zeros(&stream, slots * geometry.vocab, "talker logits")?,
            prefill_rows: zeros(&stream, max_len * t.hidden, "prefill rows")?,
            x: zeros(&stream, MAX_BATCH * max_hidden, "x")?,
            qkv: zeros(&stream, MAX_BATCH * max_qkv, "qkv")?,
            attn: zeros(&stream, MAX_BATCH * max_q, "attn")?,
            attn_part: zeros(&stream, MAX_BATCH * attn_part_stride, "attention partials")?,
            attn_count: zeros(
                &stream,
                MAX_BATCH * t.n_kv.max(c.n_kv),
                "attention counters",
            )?,
            gate_up: zeros(&stream, MAX_BATCH * 2 * max_inter, "gate_up")?,
            cp_logits: zeros(&stream, MAX_BATCH * geometry.cp_vocab, "predictor logits")?,
            codes: zeros(&stream, MAX_BATCH * CODE_WORDS, "codes")?,
            barrier: zeros(&stream, 1, "grid barrier")?,
            marks: zeros(&stream, 2 * max_marks, "profile marks")?,
            embed_rows: zeros(&stream, 3 * max_len, "prompt row descriptors")?,
            speaker: zeros(&stream, t.hidden, "speaker vector")?,
            ref_codes: zeros(&stream, max_len * g, "reference codes")?,
        };

        let max_k = [
            t.hidden,
            t.q_width(),
            t.inter,
            c.hidden,
            c.q_width(),
            c.inter,
        ]
        .into_iter()
        .max()
        .unwrap_or(0);
        let smem_x_floats = MAX_BATCH * max_k;
        let work = [
            attention_work_floats(t),
            attention_work_floats(c),
            sampling_work_floats(geometry.vocab),
            sampling_work_floats(geometry.cp_vocab),
        ]
        .into_iter()
        .max()
        .unwrap_or(0);
        let frame_smem = (4 * (smem_x_floats + 64 + work)) as u32;
        frame_fn.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            frame_smem as i32,
        )?;
        let embed_smem = (4 * (geometry.text_hidden + geometry.text_inter)) as u32;
        if embed_smem > 48 * 1024 {
            embed_fn.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                embed_smem as i32,
            )?;
        }
        let sms = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let resident = frame_fn.occupancy_max_active_blocks_per_multiprocessor(
            BLOCK_THREADS,
            frame_smem as usize,
            None,
        )?;
        ensure!(
            resident >= 1,
            "the frame kernel cannot be resident on this GPU ({frame_smem} bytes of shared memory, \
             {BLOCK_THREADS} threads per block)"
        );
        // One block per SM: every block must be co-resident for the grid barrier.
        let grid = sms as u32;

        let w = weights.ptr;
        let s = &stream;
        let base = FrameParams {
            talker: stack_params(
                t,
                w.talker_layers,
                w.talker_norm,
                ptr(&bufs.talker_rope, s),
                ptr(&bufs.talker_k, s),
                ptr(&bufs.talker_v, s),
                max_len,
            ),
            cp: stack_params(
                c,
                w.cp_layers,
                w.cp_norm,
                ptr(&bufs.cp_rope, s),
                ptr(&bufs.cp_k, s),
                ptr(&bufs.cp_v, s),
                g,
            ),
            codec_embedding: w.codec_embedding,
            codec_head: w.codec_head,
            cp_embedding: w.cp_embedding,
            cp_heads: w.cp_heads,
            proj_w: w.proj_w,
            proj_b: w.proj_b,
            past_hidden: ptr(&bufs.past_hidden, s),
            trailing: ptr(&bufs.trailing, s),
            seen: ptr(&bufs.seen, s),
            talker_logits: ptr(&bufs.talker_logits, s),
            prefill_rows: ptr(&bufs.prefill_rows, s),
            x: ptr(&bufs.x, s),
            qkv: ptr(&bufs.qkv, s),
            attn: ptr(&bufs.attn, s),
            attn_part: ptr(&bufs.attn_part, s),
            attn_count: ptr(&bufs.attn_count, s),
            gate_up: ptr(&bufs.gate_up, s),
            cp_logits: ptr(&bufs.cp_logits, s),
            codes: ptr(&bufs.codes, s),
            barrier: ptr(&bufs.barrier, s),
            vocab: geometry.vocab as i32,
            max_marks: max_marks as i32,
            attention_chunk: attention_chunk as i32,
            attn_part_stride: attn_part_stride as i32,
            cp_vocab: geometry.cp_vocab as i32,
            groups: g as i32,
            eos_id: geometry.eos_id as i32,
            max_trailing: max_len as i32,
            max_hidden: max_hidden as i32,
            max_qkv: max_qkv as i32,
            max_q: max_q as i32,
            max_inter: max_inter as i32,
            smem_x_floats: smem_x_floats as i32,
            ..Default::default()
        };
        let embed_base = EmbedParams {
            text_embedding: w.text_embedding,
            fc1_w: w.fc1_w,
            fc1_b: w.fc1_b,
            fc2_w: w.fc2_w,
            fc2_b: w.fc2_b,
            codec_embedding: w.codec_embedding,
            cp_embedding: w.cp_embedding,
            speaker: ptr(&bufs.speaker, s),
            ref_codes: ptr(&bufs.ref_codes, s),
            rows: ptr(&bufs.embed_rows, s),
            out: 0,
            n_rows: 0,
            text_hidden: geometry.text_hidden as i32,
            text_inter: geometry.text_inter as i32,
            hidden: t.hidden as i32,
            cp_vocab: geometry.cp_vocab as i32,
            groups: g as i32,
        };
        // SAFETY: plain page-locked host memory (no flags), fully written before it is read.
        let codes_host = unsafe { ctx.alloc_pinned_with_flags::<i32>(MAX_BATCH * CODE_WORDS, 0) }?;
        let device_name = ctx.name().unwrap_or_else(|_| "unknown GPU".to_string());
        stream.synchronize()?;
        Ok(Self {
            ctx,
            stream,
            frame_fn,
            embed_fn,
            geometry,
            options,
            weights,
            bufs,
            base,
            embed_base,
            grid,
            frame_smem,
            profile: false,
            embed_smem,
            codes_host,
            slots: vec![None; slots],
            device_name,
            tts_pad_id: checkpoint.config.tts_pad_token_id,
        })
    }

    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn options(&self) -> &CudaOptions {
        &self.options
    }

    /// While on, every launch records when each of its phases ended (block 0's SM clock);
    /// [`Self::phase_marks`] reads the last launch's marks.
    pub fn set_profile(&mut self, on: bool) {
        self.profile = on;
    }

    /// The marks of the last launch made while profiling, in order; the first is its start.
    pub fn phase_marks(&self) -> Result<Vec<PhaseMark>> {
        ensure!(self.profile, "profiling is off (set_profile(true) first)");
        let words = self.stream.clone_dtoh(&self.bufs.marks)?;
        Ok(words
            .chunks_exact(2)
            .take_while(|w| w[0] != 0)
            .map(|w| PhaseMark {
                phase: w[1],
                clock: w[0],
            })
            .collect())
    }

    /// Bytes of weights uploaded (bf16, packed).
    pub fn weight_bytes(&self) -> usize {
        self.weights.bytes
    }

    /// Starts a sequence from ready-made talker input rows (`prefill`: L x hidden) and trailing
    /// text rows (`trailing`: N x hidden, the last row is tts_pad), as the parity fixtures store them.
    pub fn start_with_rows(
        &mut self,
        prefill: &[f32],
        trailing: &[f32],
        sampling: SamplingConfig,
        max_frames: usize,
    ) -> Result<SlotId> {
        let h = self.geometry.talker.hidden;
        ensure!(
            !prefill.is_empty()
                && prefill.len().is_multiple_of(h)
                && trailing.len().is_multiple_of(h)
                && !trailing.is_empty(),
            "prefill ({}) and trailing ({}) must be non-empty whole rows of the talker width {h}",
            prefill.len(),
            trailing.len()
        );
        let (rows, trailing_len) = (prefill.len() / h, trailing.len() / h);
        let slot = self.claim_slot(rows, trailing_len, max_frames, sampling)?;
        self.stream.memcpy_htod(
            prefill,
            &mut self.bufs.prefill_rows.slice_mut(..prefill.len()),
        )?;
        let at = slot * self.options.max_len * h;
        self.stream.memcpy_htod(
            trailing,
            &mut self.bufs.trailing.slice_mut(at..at + trailing.len()),
        )?;
        self.prefill(slot, rows)
    }

    /// Drives one frame of one sequence with given codes (`frame` = this frame's 16 codes, whose
    /// codebook 0 must be the pending one; `next_c0` = the codebook-0 token to continue with),
    /// and returns the raw codebook-0 logits of the talker step and the kernel's own choices.
    pub fn step_forced(&mut self, slot: SlotId, frame: &Frame, next_c0: u32) -> Result<ForcedStep> {
        let state = self.state(slot)?;
        ensure!(
            state.c0 == frame[0],
            "forced frame starts with codebook 0 = {}, but the pending token is {}",
            frame[0],
            state.c0
        );
        let mut forced = [0i32; 17];
        for (dst, src) in forced.iter_mut().zip(frame.iter()) {
            *dst = *src as i32;
        }
        forced[16] = next_c0 as i32;
        let words = self.run_frames(&[slot.0], Some(&[forced]))?[0];
        let mut own_frame = *frame;
        for (dst, src) in own_frame.iter_mut().zip(&words[OWN_CODES..]).skip(1) {
            *dst = *src as u32;
        }
        Ok(ForcedStep {
            logits: self.logits(slot)?,
            own_frame,
            own_next_c0: words[OWN_CODES + 16] as u32,
        })
    }

    /// The raw codebook-0 logits of the sequence's last talker step (prefill or frame).
    pub fn logits(&self, slot: SlotId) -> Result<Vec<f32>> {
        self.state(slot)?;
        let v = self.geometry.vocab;
        let view = self.bufs.talker_logits.slice(slot.0 * v..(slot.0 + 1) * v);
        Ok(self.stream.clone_dtoh(&view)?)
    }

    fn state(&self, slot: SlotId) -> Result<&SlotState> {
        self.slots
            .get(slot.0)
            .and_then(|s| s.as_ref())
            .with_context(|| format!("slot {} is not an active sequence", slot.0))
    }

    fn claim_slot(
        &mut self,
        rows: usize,
        trailing_len: usize,
        max_frames: usize,
        sampling: SamplingConfig,
    ) -> Result<usize> {
        sampler(&sampling.talker, "talker")?;
        sampler(&sampling.subtalker, "subtalker")?;
        ensure!(
            rows + max_frames <= self.options.max_len,
            "prefill rows {rows} + max_frames {max_frames} exceed max_len {}",
            self.options.max_len
        );
        ensure!(
            trailing_len <= self.options.max_len,
            "{trailing_len} trailing rows exceed max_len {}",
            self.options.max_len
        );
        let slot = self
            .slots
            .iter()
            .position(Option::is_none)
            .with_context(|| format!("all {} sequence slots are busy", self.slots.len()))?;
        let v = self.geometry.vocab;
        self.stream
            .memset_zeros(&mut self.bufs.seen.slice_mut(slot * v..(slot + 1) * v))?;
        self.slots[slot] = Some(SlotState {
            pos: 0,
            frames: 0,
            c0: 0,
            n_sampled: 0,
            trailing_len,
            max_frames,
            sampling,
            finished: None,
        });
        Ok(slot)
    }

    fn launch_frame_kernel(&mut self, params: &FrameParams) -> Result<()> {
        self.stream.memset_zeros(&mut self.bufs.barrier)?;
        let mut params = *params;
        // every sequence of the talker step gets the chunks its longest one needs
        let longest = params.pos[..params.batch as usize]
            .iter()
            .copied()
            .max()
            .unwrap_or(0);
        params.talker_chunks = match params.attention_chunk {
            0 => 1,
            chunk => longest / chunk + 1,
        };
        if self.profile {
            self.stream.memset_zeros(&mut self.bufs.marks)?;
            params.marks = ptr(&self.bufs.marks, &self.stream);
        }
        let cfg = LaunchConfig {
            grid_dim: (self.grid, 1, 1),
            block_dim: (BLOCK_THREADS, 1, 1),
            shared_mem_bytes: self.frame_smem,
        };
        let mut launch = self.stream.launch_builder(&self.frame_fn);
        launch.arg(&params);
        // SAFETY: every pointer in `params` addresses a live allocation owned by `self` and sized
        // in `new` for the geometry and options the kernel is told about; the cooperative launch
        // guarantees the co-residency the grid barrier needs.
        unsafe { launch.launch_cooperative(cfg) }.context("launching the frame kernel")?;
        Ok(())
    }

    fn read_codes(&mut self) -> Result<[i32; MAX_BATCH * CODE_WORDS]> {
        self.stream
            .memcpy_dtoh(&self.bufs.codes, &mut self.codes_host)?;
        self.stream.synchronize()?;
        let mut out = [0i32; MAX_BATCH * CODE_WORDS];
        out.copy_from_slice(self.codes_host.as_slice()?);
        Ok(out)
    }

    fn prefill(&mut self, slot: usize, rows: usize) -> Result<SlotId> {
        let state = self.slots[slot].clone().context("slot vanished")?;
        let mut p = self.base;
        p.mode = MODE_PREFILL;
        p.batch = 1;
        self.fill_sequence(&mut p, 0, slot, &state)?;
        for row in 0..rows {
            p.prefill_row = row as i32;
            p.prefill_last = (row + 1 == rows) as i32;
            p.pos[0] = row as i32;
            self.launch_frame_kernel(&p)?;
        }
        let codes = self.read_codes()?;
        let st = self.slots[slot].as_mut().context("slot vanished")?;
        st.pos = rows;
        st.c0 = codes[16] as u32;
        st.n_sampled = 1;
        if st.c0 == self.geometry.eos_id {
            st.finished = Some(FinishReason::Eos);
        } else if st.max_frames == 0 {
            st.finished = Some(FinishReason::MaxFrames);
        }
        Ok(SlotId(slot))
    }

    fn fill_sequence(
        &self,
        p: &mut FrameParams,
        b: usize,
        slot: usize,
        st: &SlotState,
    ) -> Result<()> {
        p.slot[b] = slot as i32;
        p.pos[b] = st.pos as i32;
        p.step[b] = st.frames as i32;
        p.c0[b] = st.c0 as i32;
        p.n_sampled[b] = st.n_sampled as i32;
        p.trailing_len[b] = st.trailing_len as i32;
        p.seed_lo[b] = st.sampling.seed as u32;
        p.seed_hi[b] = (st.sampling.seed >> 32) as u32;
        p.talker_sampler[b] = sampler(&st.sampling.talker, "talker")?;
        p.sub_sampler[b] = sampler(&st.sampling.subtalker, "subtalker")?;
        Ok(())
    }

    /// One frame launch for up to MAX_BATCH unfinished sequences; updates their states and
    /// returns each sequence's code words.
    fn run_frames(
        &mut self,
        slots: &[usize],
        forced: Option<&[[i32; 17]]>,
    ) -> Result<Vec<[i32; CODE_WORDS]>> {
        let mut p = self.base;
        p.mode = MODE_FRAME;
        p.batch = slots.len() as i32;
        for (b, &slot) in slots.iter().enumerate() {
            let st = self.slots[slot].clone().context("slot vanished")?;
            ensure!(st.finished.is_none(), "slot {slot} has already finished");
            ensure!(
                st.pos < self.options.max_len,
                "slot {slot} reached max_len {}",
                self.options.max_len
            );
            self.fill_sequence(&mut p, b, slot, &st)?;
        }
        if let Some(f) = forced {
            p.forced = 1;
            p.forced_codes[..f.len()].copy_from_slice(f);
        }
        self.launch_frame_kernel(&p)?;
        let codes = self.read_codes()?;
        let eos = self.geometry.eos_id;
        let mut out = Vec::with_capacity(slots.len());
        for (b, &slot) in slots.iter().enumerate() {
            let mut words = [0i32; CODE_WORDS];
            words.copy_from_slice(&codes[b * CODE_WORDS..(b + 1) * CODE_WORDS]);
            let st = self.slots[slot].as_mut().context("slot vanished")?;
            st.pos += 1;
            st.frames += 1;
            st.n_sampled += 1;
            st.c0 = words[16] as u32;
            if st.c0 == eos {
                st.finished = Some(FinishReason::Eos);
            } else if st.frames >= st.max_frames {
                st.finished = Some(FinishReason::MaxFrames);
            }
            out.push(words);
        }
        Ok(out)
    }

    /// Builds the talker input rows of a plan on the GPU (text projection + codec track).
    fn embed_plan_rows(&mut self, plan: &PromptPlan, slot: usize) -> Result<()> {
        let h = self.geometry.talker.hidden;
        let max_len = self.options.max_len;
        if let Some(v) = &plan.speaker_vector {
            ensure!(
                v.len() == h,
                "speaker_vector has {} values, the talker width is {h}",
                v.len()
            );
            self.stream.memcpy_htod(v, &mut self.bufs.speaker)?;
        }
        if !plan.reference_codes.is_empty() {
            ensure!(
                plan.reference_codes.len() <= max_len,
                "{} reference frames exceed max_len {max_len}",
                plan.reference_codes.len()
            );
            let flat: Vec<i32> = plan
                .reference_codes
                .iter()
                .flat_map(|f| f.iter().map(|&c| c as i32))
                .collect();
            self.stream
                .memcpy_htod(&flat, &mut self.bufs.ref_codes.slice_mut(..flat.len()))?;
        }
        let mut prefill = Vec::with_capacity(plan.prefill.len() * 3);
        for row in &plan.prefill {
            let (kind, value) = match row.codec {
                CodecSource::None => (CODEC_NONE, 0),
                CodecSource::Id(id) => {
                    ensure!(
                        (id as usize) < self.geometry.vocab,
                        "codec id {id} is outside the codec vocabulary"
                    );
                    (CODEC_ID, id as i32)
                }
                CodecSource::SpeakerVector => {
                    ensure!(
                        plan.speaker_vector.is_some(),
                        "a prefill row uses the speaker vector but the plan has none"
                    );
                    (CODEC_SPEAKER, 0)
                }
                CodecSource::ReferenceFrame(k) => {
                    ensure!(
                        k < plan.reference_codes.len(),
                        "reference frame {k} of {}",
                        plan.reference_codes.len()
                    );
                    (CODEC_REFERENCE, k as i32)
                }
            };
            prefill.extend_from_slice(&[self.text_id(row.text_id)?, kind, value]);
        }
        let out = self.base.prefill_rows;
        self.launch_embed(&prefill, out)?;
        let mut trailing = Vec::with_capacity(3 * (plan.trailing.len() + 1));
        for &id in plan
            .trailing
            .iter()
            .chain(std::iter::once(&plan.tts_pad_id))
        {
            trailing.extend_from_slice(&[self.text_id(id)?, CODEC_NONE, 0]);
        }
        let out = self.base.trailing + (slot * max_len * h * 4) as u64;
        self.launch_embed(&trailing, out)
    }

    fn text_id(&self, id: u32) -> Result<i32> {
        ensure!(
            (id as usize) < self.geometry.text_vocab,
            "text id {id} is outside the text vocabulary ({})",
            self.geometry.text_vocab
        );
        Ok(id as i32)
    }

    fn launch_embed(&mut self, rows: &[i32], out: u64) -> Result<()> {
        let n = rows.len() / 3;
        ensure!(
            n <= self.options.max_len,
            "{n} prompt rows exceed max_len {}",
            self.options.max_len
        );
        self.stream
            .memcpy_htod(rows, &mut self.bufs.embed_rows.slice_mut(..rows.len()))?;
        let mut p = self.embed_base;
        p.n_rows = n as i32;
        p.out = out;
        let cfg = LaunchConfig {
            grid_dim: (n.min(1024) as u32, 1, 1),
            block_dim: (BLOCK_THREADS, 1, 1),
            shared_mem_bytes: self.embed_smem,
        };
        let mut launch = self.stream.launch_builder(&self.embed_fn);
        launch.arg(&p);
        // SAFETY: `rows` was just uploaded to the row buffer (n <= max_len rows) and `out` points
        // at a buffer of at least max_len talker rows.
        unsafe { launch.launch(cfg) }.context("launching the prompt-row kernel")?;
        Ok(())
    }
}

impl FrameBackend for CudaBackend {
    fn name(&self) -> String {
        format!("cuda ({})", self.device_name)
    }

    fn start(&mut self, spec: &SequenceSpec) -> Result<SlotId> {
        let plan = &spec.plan;
        ensure!(
            !plan.prefill.is_empty(),
            "the prompt plan has no prefill rows"
        );
        let slot = self.claim_slot(
            plan.prefill.len(),
            plan.trailing.len() + 1,
            spec.max_frames,
            spec.sampling,
        )?;
        if let Err(e) = self.embed_plan_rows(plan, slot) {
            self.slots[slot] = None;
            return Err(e);
        }
        self.prefill(slot, plan.prefill.len())
    }

    fn step(&mut self, slots: &[SlotId]) -> Result<Vec<FrameEvent>> {
        check_distinct(slots)?;
        let mut events: Vec<Option<FrameEvent>> = vec![None; slots.len()];
        let mut running = Vec::new();
        for (i, slot) in slots.iter().enumerate() {
            match self.state(*slot)?.finished {
                Some(reason) => events[i] = Some(FrameEvent::Finished(reason)),
                None => running.push(i),
            }
        }
        for chunk in running.chunks(MAX_BATCH) {
            let ids: Vec<usize> = chunk.iter().map(|&i| slots[i].0).collect();
            for (&i, words) in chunk.iter().zip(self.run_frames(&ids, None)?) {
                let mut frame: Frame = [0; NUM_CODE_GROUPS];
                for (dst, src) in frame.iter_mut().zip(words.iter()) {
                    *dst = *src as u32;
                }
                events[i] = Some(FrameEvent::Frame(frame));
            }
        }
        events
            .into_iter()
            .map(|e| e.context("a slot got no event"))
            .collect()
    }

    fn append_trailing(&mut self, slot: SlotId, ids: &[u32]) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let known = self.state(slot)?.trailing_len - 1;
        let max_len = self.options.max_len;
        ensure!(
            known + ids.len() < max_len,
            "{} trailing rows exceed max_len {max_len}",
            known + ids.len() + 1
        );
        let mut rows = Vec::with_capacity(3 * (ids.len() + 1));
        for &id in ids.iter().chain(std::iter::once(&self.tts_pad_id)) {
            rows.extend_from_slice(&[self.text_id(id)?, CODEC_NONE, 0]);
        }
        let h = self.geometry.talker.hidden;
        let out = self.base.trailing + ((slot.0 * max_len + known) * h * 4) as u64;
        self.launch_embed(&rows, out)?;
        if let Some(state) = self.slots[slot.0].as_mut() {
            state.trailing_len += ids.len();
        }
        Ok(())
    }

    fn release(&mut self, slot: SlotId) {
        if let Some(s) = self.slots.get_mut(slot.0) {
            *s = None;
        }
    }
}

/// Fails unless `slots` are distinct (a sequence cannot advance twice in one launch).
fn check_distinct(slots: &[SlotId]) -> Result<()> {
    let mut seen = std::collections::BTreeSet::new();
    for s in slots {
        if !seen.insert(s.0) {
            bail!("slot {} listed twice in one step", s.0);
        }
    }
    Ok(())
}
