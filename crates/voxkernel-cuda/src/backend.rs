//! `CudaBackend`: the frame megakernel behind the `FrameBackend` contract.

use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail, ensure};
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PinnedHostSlice,
    PushKernelArg,
};
use voxkernel_core::backend::{
    FinishReason, Frame, FrameBackend, FrameEvent, NUM_CODE_GROUPS, SequenceSpec, SlotId,
};
use voxkernel_core::checkpoint::Checkpoint;
use voxkernel_core::official_run::ForcedStep;
use voxkernel_core::prompt::{CodecSource, PromptPlan};
use voxkernel_core::sampling::{SamplerParams, SamplingConfig};

use crate::layout::{
    BLOCK_THREADS, BLOCK_WARPS, CODE_WORDS, EXCHANGE_BITS, FULL_BATCH, FrameParams, HEADS_PER_PASS,
    HIST_WORDS, MAX_BATCH, MAX_HEAD_DIM, MODE_FRAME, MODE_HEAD, OWN_CODES, Sampler, Stack,
};
use crate::prefill::{Codec, Prefill, Segment, TalkerState, TextRow};
use crate::runtime::{self, device_ptr, zeros};
use crate::weights::{DeviceWeights, Geometry, StackGeometry};

/// Sizes fixed at construction: nothing is allocated on the device after `new`.
#[derive(Debug, Clone, Copy)]
pub struct CudaOptions {
    /// Concurrent sequences (KV cache slots).
    pub max_slots: usize,
    /// Talker positions per sequence: prefill rows + frames. Also bounds the trailing text rows.
    pub max_len: usize,
    /// Prompt rows one prefill pass holds (its scratch is sized for them); a `start` with more
    /// rows in all runs as several passes.
    pub max_prefill_rows: usize,
    /// Positions per attention block (0 = all of a sequence's in one block per kv head): long
    /// contexts then spread over more SMs.
    pub attention_chunk: usize,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            max_slots: 4,
            max_len: 2048,
            max_prefill_rows: 1024,
            attention_chunk: 32,
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

/// Where a new sequence's talker input rows come from.
enum PromptRows {
    /// Built on the GPU from the plan: text projection + codec track.
    Plan(Vec<TextRow>),
    /// Ready-made, `rows x hidden` (`start_with_rows`).
    Given(Vec<f32>),
}

/// Where a new sequence's trailing text rows come from (the last one is tts_pad).
enum TrailingRows {
    /// Text ids, projected on the GPU.
    Ids(Vec<i32>),
    /// Ready-made, `rows x hidden`.
    Given(Vec<f32>),
}

/// A sequence whose slot is claimed and whose prefill has not run yet.
struct NewSequence {
    slot: usize,
    rows: usize,
    prompt: PromptRows,
    trailing: TrailingRows,
    speaker: Option<Vec<f32>>,
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
    /// Tagged words between the frame kernel's blocks (`FrameParams::xw` ...).
    exchange: Exchange,
    attn_part: CudaSlice<f32>,
    attn_count: CudaSlice<u32>,
    codes: CudaSlice<i32>,
    marks: CudaSlice<u64>,
}

/// The frame kernel's tagged-word buffers. Zeroed at construction and whenever the epoch wraps,
/// so that no word left from an earlier launch can carry a tag a later launch waits for.
struct Exchange {
    xw: CudaSlice<u64>,
    qkv: CudaSlice<u64>,
    attn: CudaSlice<u64>,
    act: CudaSlice<u64>,
    logits: CudaSlice<u64>,
}

impl Exchange {
    fn zero(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        stream.memset_zeros(&mut self.xw)?;
        stream.memset_zeros(&mut self.qkv)?;
        stream.memset_zeros(&mut self.attn)?;
        stream.memset_zeros(&mut self.act)?;
        stream.memset_zeros(&mut self.logits)?;
        Ok(())
    }
}

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// The frame kernel's builds, narrowest first: for launches of one sequence (faster for
    /// them), of up to `FULL_BATCH`, and, where it fits the GPU, of up to `MAX_BATCH`.
    builds: Vec<FrameBuild>,
    geometry: Geometry,
    options: CudaOptions,
    weights: DeviceWeights,
    bufs: Buffers,
    prefill: Prefill,
    /// Pointers and sizes; every launch copies it and fills the per-launch fields.
    base: FrameParams,
    grid: u32,
    /// The last launch's epoch (`FrameParams::epoch`).
    epoch: u32,
    /// Record phase marks (`FrameParams::marks`) in every launch.
    profile: bool,
    /// Code words of every slot, in groups of up to `MAX_BATCH` (one launch each).
    codes_host: PinnedHostSlice<i32>,
    slots: Vec<Option<SlotState>>,
    device_name: String,
    /// The text-track id of the trailing row after the text runs out.
    tts_pad_id: u32,
}

/// One build of the frame kernel and how it is launched.
struct FrameBuild {
    function: CudaFunction,
    /// The most sequences one launch carries.
    sequences: usize,
    /// `FrameParams::smem_x_floats` and the dynamic shared memory of its launches.
    smem_x_floats: i32,
    smem: u32,
}

/// `frame_kernel` of a module that carries at least `sequences` per launch (its
/// `frame_sequences`); `env` names the variable that may have given the module's CUBIN.
fn frame_function(
    module: &Arc<CudaModule>,
    stream: &Arc<CudaStream>,
    sequences: usize,
    env: &str,
) -> Result<CudaFunction> {
    let symbol = module
        .get_global("frame_sequences", stream)
        .with_context(|| {
            format!(
                "the frame kernel has no `frame_sequences`: is {env} built from another version?"
            )
        })?;
    let bytes = stream.clone_dtoh(&symbol)?;
    stream.synchronize()?;
    let carried = bytes
        .get(..4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .unwrap_or(0);
    ensure!(
        carried >= sequences as i32,
        "{env}: this frame kernel carries at most {carried} sequence(s) per launch and this \
         backend launches up to {sequences}; build it from frame.cu without `#define SOLO 1`"
    );
    Ok(module.load_function("frame_kernel")?)
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
    // k and the group's q heads; each warp's max and denominator; the warps' outputs; the flag
    // of the chunk that merges; the solo build's merge factors and each head's max
    (group + 1) * s.head_dim + 2 * partials + partials * s.head_dim + 1 + partials + HEADS_PER_PASS
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
        ensure!(
            options.max_prefill_rows > 0,
            "max_prefill_rows must be at least 1"
        );
        let geometry = Geometry::from_checkpoint(checkpoint)?;
        let ctx = runtime::open_device()?;
        let stream = ctx.default_stream();
        let modules = runtime::load_frame_modules(&ctx)?;
        let mut functions = vec![
            (
                frame_function(&modules.solo, &stream, 1, runtime::SOLO_CUBIN_ENV)?,
                1,
            ),
            (
                frame_function(&modules.full, &stream, FULL_BATCH, runtime::CUBIN_ENV)?,
                FULL_BATCH,
            ),
        ];
        if let Some(wide) = &modules.wide {
            functions.push((
                frame_function(wide, &stream, MAX_BATCH, runtime::WIDE_CUBIN_ENV)?,
                MAX_BATCH,
            ));
        }
        let weights = DeviceWeights::upload(checkpoint, &geometry, &stream)?;

        let (t, c) = (&geometry.talker, &geometry.cp);
        let g = geometry.groups;
        let (slots, max_len) = (options.max_slots, options.max_len);
        let max_hidden = t.hidden.max(c.hidden);
        let max_qkv = t.qkv_width().max(c.qkv_width());
        let max_q = t.q_width().max(c.q_width());
        let max_inter = t.inter.max(c.inter);
        for (name, st) in [("talker", t), ("code predictor", c)] {
            // The kernel's blocks that own residual rows must also compute q|k|v and gate|up
            // rows: its words are never overwritten before all their readers have read them.
            ensure!(
                st.qkv_width() >= st.hidden && st.inter >= st.hidden,
                "the frame kernel needs the {name}'s q|k|v width ({}) and intermediate size ({}) \
                 to be at least its hidden size ({})",
                st.qkv_width(),
                st.inter,
                st.hidden
            );
            // Exchanged rows are read two words per load (`collect`).
            ensure!(
                [st.hidden, st.q_width(), st.inter]
                    .iter()
                    .all(|w| w % 2 == 0),
                "the frame kernel needs the {name}'s hidden size ({}), q width ({}) and \
                 intermediate size ({}) to be even",
                st.hidden,
                st.q_width(),
                st.inter
            );
            // attention: warp 0 takes the kv head, one warp each q head of its group, the next V
            let group = st.n_heads / st.n_kv;
            ensure!(
                group + 2 <= BLOCK_WARPS,
                "the frame kernel's attention needs the {name}'s q heads per kv head ({group}) to \
                 be at most {}",
                BLOCK_WARPS - 2
            );
        }
        ensure!(
            geometry.vocab % 2 == 0 && geometry.cp_vocab % 2 == 0,
            "the frame kernel needs even codec vocabularies (talker {}, code predictor {})",
            geometry.vocab,
            geometry.cp_vocab
        );
        // start + per predictor pass (input, 5 per layer, head, sampling) + the talker's, each
        // phase with its inputs' arrival too; and three steps inside each predictor sampling
        let max_marks = 2 * (1 + g * (3 + 5 * c.layers) + 5 * t.layers + 3) + 3 * g;
        // exchanges per launch: per predictor pass the projection, 5 per layer, the head and the
        // sampling; the talker's 5 per layer and its head
        let exchanges = g * (3 + 5 * c.layers) + 5 * t.layers + 1;
        ensure!(
            exchanges < 1 << EXCHANGE_BITS,
            "the frame kernel's tags count {} exchanges per launch; this checkpoint needs {exchanges}",
            (1 << EXCHANGE_BITS) - 1
        );
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
            exchange: Exchange {
                xw: zeros(&stream, 2 * MAX_BATCH * max_hidden, "x words")?,
                qkv: zeros(&stream, MAX_BATCH * max_qkv, "qkv words")?,
                attn: zeros(&stream, MAX_BATCH * max_q, "attention words")?,
                act: zeros(&stream, MAX_BATCH * max_inter, "MLP words")?,
                logits: zeros(
                    &stream,
                    MAX_BATCH * geometry.vocab.max(geometry.cp_vocab),
                    "logits words",
                )?,
            },
            attn_part: zeros(&stream, MAX_BATCH * attn_part_stride, "attention partials")?,
            attn_count: zeros(
                &stream,
                MAX_BATCH * t.n_kv.max(c.n_kv),
                "attention counters",
            )?,
            codes: zeros(&stream, code_words(slots), "codes")?,
            marks: zeros(&stream, 2 * max_marks, "profile marks")?,
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
        let work = [
            attention_work_floats(t),
            attention_work_floats(c),
            sampling_work_floats(geometry.vocab),
            sampling_work_floats(geometry.cp_vocab),
        ]
        .into_iter()
        .max()
        .unwrap_or(0);
        let max_smem = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
            as u32;
        let mut builds = Vec::new();
        for (function, sequences) in functions {
            // The solo build keeps the full build's size: the L1 carve-out it was tuned with.
            let width = sequences.max(FULL_BATCH);
            // the split-K products' partial sums: two slots per warp pair, by row parity
            let work = work.max(2 * BLOCK_WARPS * width);
            // x inputs, the block's raw x rows, reduction words, attention / sampling scratch
            let smem_x_floats = width * max_k;
            let smem = (4 * (smem_x_floats + width * max_hidden + 64 + work)) as u32;
            let resident = smem <= max_smem
                && function
                    .set_attribute(
                        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        smem as i32,
                    )
                    .is_ok()
                && function.occupancy_max_active_blocks_per_multiprocessor(
                    BLOCK_THREADS,
                    smem as usize,
                    None,
                )? >= 1;
            if !resident {
                // Launches of many sequences fall back to the narrower builds; those must fit.
                ensure!(
                    sequences == MAX_BATCH,
                    "the frame kernel cannot be resident on this GPU ({smem} bytes of shared \
                     memory, {BLOCK_THREADS} threads per block)"
                );
                continue;
            }
            builds.push(FrameBuild {
                function,
                sequences,
                smem_x_floats: smem_x_floats as i32,
                smem,
            });
        }
        let sms = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        // One block per SM: every block must be co-resident, since blocks wait on each other's
        // words.
        let grid = sms as u32;

        let w = weights.ptr;
        let s = &stream;
        let base = FrameParams {
            talker: stack_params(
                t,
                w.talker_layers,
                w.talker_norm,
                device_ptr(&bufs.talker_rope, s),
                device_ptr(&bufs.talker_k, s),
                device_ptr(&bufs.talker_v, s),
                max_len,
            ),
            cp: stack_params(
                c,
                w.cp_layers,
                w.cp_norm,
                device_ptr(&bufs.cp_rope, s),
                device_ptr(&bufs.cp_k, s),
                device_ptr(&bufs.cp_v, s),
                g,
            ),
            codec_embedding: w.codec_embedding,
            codec_head: w.codec_head,
            cp_embedding: w.cp_embedding,
            cp_heads: w.cp_heads,
            proj_w: w.proj_w,
            proj_b: w.proj_b,
            past_hidden: device_ptr(&bufs.past_hidden, s),
            trailing: device_ptr(&bufs.trailing, s),
            seen: device_ptr(&bufs.seen, s),
            talker_logits: device_ptr(&bufs.talker_logits, s),
            xw: device_ptr(&bufs.exchange.xw, s),
            qkv: device_ptr(&bufs.exchange.qkv, s),
            attn: device_ptr(&bufs.exchange.attn, s),
            act: device_ptr(&bufs.exchange.act, s),
            logits: device_ptr(&bufs.exchange.logits, s),
            attn_part: device_ptr(&bufs.attn_part, s),
            attn_count: device_ptr(&bufs.attn_count, s),
            codes: device_ptr(&bufs.codes, s),
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
            ..Default::default()
        };
        let prefill = Prefill::new(
            &ctx,
            &stream,
            &geometry,
            &weights,
            TalkerState {
                k_cache: device_ptr(&bufs.talker_k, s),
                v_cache: device_ptr(&bufs.talker_v, s),
                rope: device_ptr(&bufs.talker_rope, s),
            },
            &options,
        )?;
        ensure!(
            prefill.head_stride() == max_hidden,
            "the prefill's last rows must use the frame kernel's x stride"
        );
        // SAFETY: plain page-locked host memory (no flags), fully written before it is read.
        let codes_host = unsafe { ctx.alloc_pinned_with_flags::<i32>(code_words(slots), 0) }?;
        let device_name = ctx.name().unwrap_or_else(|_| "unknown GPU".to_string());
        stream.synchronize()?;
        Ok(Self {
            ctx,
            stream,
            builds,
            geometry,
            options,
            weights,
            bufs,
            prefill,
            base,
            grid,
            epoch: 0,
            profile: false,
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
        self.start_sequences(vec![NewSequence {
            slot,
            rows,
            prompt: PromptRows::Given(prefill.to_vec()),
            trailing: TrailingRows::Given(trailing.to_vec()),
            speaker: None,
        }])?;
        Ok(SlotId(slot))
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
        self.check_runnable(&[slot.0])?;
        self.launch_frames(&[slot.0], Some(&[forced]), 0)?;
        let words = self.take_frames(&[slot.0])?[0];
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
        self.epoch += 1;
        if self.epoch >= 1 << (32 - EXCHANGE_BITS) {
            self.bufs.exchange.zero(&self.stream)?;
            self.epoch = 1;
        }
        let mut params = *params;
        params.epoch = self.epoch;
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
            params.marks = device_ptr(&self.bufs.marks, &self.stream);
        }
        let build = self
            .builds
            .iter()
            .find(|b| b.sequences >= params.batch as usize)
            .with_context(|| format!("no frame kernel build carries {} sequences", params.batch))?;
        params.smem_x_floats = build.smem_x_floats;
        let cfg = LaunchConfig {
            grid_dim: (self.grid, 1, 1),
            block_dim: (BLOCK_THREADS, 1, 1),
            shared_mem_bytes: build.smem,
        };
        let mut launch = self.stream.launch_builder(&build.function);
        launch.arg(&params);
        // SAFETY: every pointer in `params` addresses a live allocation owned by `self` and sized
        // in `new` for the geometry and options the kernel is told about; the cooperative launch
        // guarantees the co-residency that blocks waiting on each other's words need.
        unsafe { launch.launch_cooperative(cfg) }.context("launching the frame kernel")?;
        Ok(())
    }

    /// The first `words` code words, once the stream has finished.
    fn read_codes(&mut self, words: usize) -> Result<Vec<i32>> {
        self.stream
            .memcpy_dtoh(&self.bufs.codes, &mut self.codes_host)?;
        self.stream.synchronize()?;
        Ok(self.codes_host.as_slice()?[..words].to_vec())
    }

    /// Prefills every sequence and samples its first codebook-0 token. On an error every one
    /// of their slots is freed.
    fn start_sequences(&mut self, sequences: Vec<NewSequence>) -> Result<()> {
        let result = self.prefill_sequences(&sequences);
        if result.is_err() {
            for s in &sequences {
                self.slots[s.slot] = None;
            }
        }
        result
    }

    fn prefill_sequences(&mut self, sequences: &[NewSequence]) -> Result<()> {
        let (h, max_len) = (self.geometry.talker.hidden, self.options.max_len);
        let stream = Arc::clone(&self.stream);
        let mut rows = Vec::new();
        let mut dest = Vec::new();
        for s in sequences {
            if let Some(v) = &s.speaker {
                self.prefill.set_speaker(&stream, s.slot, v)?;
            }
            match &s.trailing {
                TrailingRows::Ids(ids) => {
                    for (j, &id) in ids.iter().enumerate() {
                        rows.push(TextRow {
                            text_id: id,
                            codec: Codec::None,
                        });
                        dest.push((s.slot * max_len + j) as i32);
                    }
                }
                TrailingRows::Given(values) => {
                    let at = s.slot * max_len * h;
                    stream.memcpy_htod(
                        values,
                        &mut self.bufs.trailing.slice_mut(at..at + values.len()),
                    )?;
                }
            }
        }
        if !rows.is_empty() {
            self.prefill
                .project(&stream, &rows, &dest, self.base.trailing)?;
        }

        // Passes of up to max_prefill_rows rows; a sequence may continue in the next pass.
        let capacity = self.prefill.max_rows();
        let mut pass: Vec<(usize, usize, usize)> = Vec::new();
        let mut used = 0;
        for (i, s) in sequences.iter().enumerate() {
            let mut done = 0;
            while done < s.rows {
                let n = (s.rows - done).min(capacity - used);
                pass.push((i, done, n));
                done += n;
                used += n;
                if used == capacity {
                    self.prefill_pass(sequences, &pass)?;
                    pass.clear();
                    used = 0;
                }
            }
        }
        if !pass.is_empty() {
            self.prefill_pass(sequences, &pass)?;
        }

        // The codec head and codebook-0 sampling of each sequence's last row, as many at once
        // as a launch carries.
        let head = self.prefill.head_ptr();
        let codes = self.base.codes;
        let stride = self.prefill.head_stride();
        let width = self.widest_launch();
        for (group, batch) in sequences.chunks(width).enumerate() {
            let first = group * width;
            let mut p = self.base;
            p.mode = MODE_HEAD;
            p.batch = batch.len() as i32;
            p.x = head + (first * stride * 4) as u64;
            p.codes = codes + (first * CODE_WORDS * 4) as u64;
            for (b, s) in batch.iter().enumerate() {
                let state = self.slots[s.slot].clone().context("slot vanished")?;
                self.fill_sequence(&mut p, b, s.slot, &state)?;
            }
            self.launch_frame_kernel(&p)?;
        }
        let words = self.read_codes(sequences.len() * CODE_WORDS)?;
        let eos = self.geometry.eos_id;
        for (s, words) in sequences.iter().zip(words.chunks(CODE_WORDS)) {
            let st = self.slots[s.slot].as_mut().context("slot vanished")?;
            st.pos = s.rows;
            st.c0 = words[16] as u32;
            st.n_sampled = 1;
            if st.c0 == eos {
                st.finished = Some(FinishReason::Eos);
            } else if st.max_frames == 0 {
                st.finished = Some(FinishReason::MaxFrames);
            }
        }
        Ok(())
    }

    /// One talker pass: `pass` lists (sequence, its first row here, rows here).
    fn prefill_pass(
        &mut self,
        sequences: &[NewSequence],
        pass: &[(usize, usize, usize)],
    ) -> Result<()> {
        let h = self.geometry.talker.hidden;
        let stream = Arc::clone(&self.stream);
        let mut rows = Vec::new();
        let mut dest = Vec::new();
        let mut segments = Vec::with_capacity(pass.len());
        let mut row0 = 0;
        for &(i, first, n) in pass {
            let s = &sequences[i];
            match &s.prompt {
                PromptRows::Plan(plan_rows) => {
                    rows.extend_from_slice(&plan_rows[first..first + n]);
                    dest.extend((row0..row0 + n).map(|r| r as i32));
                }
                PromptRows::Given(values) => {
                    self.prefill
                        .fill_rows(&stream, row0, &values[first * h..(first + n) * h])?;
                }
            }
            segments.push(Segment {
                slot: s.slot,
                pos0: first,
                rows: n,
                head: (first + n == s.rows).then_some(i),
            });
            row0 += n;
        }
        if !rows.is_empty() {
            let x = self.prefill.x_ptr();
            self.prefill.project(&stream, &rows, &dest, x)?;
        }
        self.prefill.talker(&stream, &segments)
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

    /// Fails unless every slot is an unfinished sequence with room for one more frame.
    fn check_runnable(&self, slots: &[usize]) -> Result<()> {
        for &slot in slots {
            let st = self.state(SlotId(slot))?;
            ensure!(st.finished.is_none(), "slot {slot} has already finished");
            ensure!(
                st.pos < self.options.max_len,
                "slot {slot} reached max_len {}",
                self.options.max_len
            );
        }
        Ok(())
    }

    /// The most sequences one launch of the builds this GPU runs carries.
    fn widest_launch(&self) -> usize {
        self.builds.last().map_or(1, |b| b.sequences)
    }

    /// Queues one frame launch for sequences checked by `check_runnable`, at most
    /// `widest_launch`; their code words land from sequence `first` of the codes buffer on.
    fn launch_frames(
        &mut self,
        slots: &[usize],
        forced: Option<&[[i32; 17]]>,
        first: usize,
    ) -> Result<()> {
        let mut p = self.base;
        p.mode = MODE_FRAME;
        p.batch = slots.len() as i32;
        p.codes += (first * CODE_WORDS * 4) as u64;
        for (b, &slot) in slots.iter().enumerate() {
            let st = self.state(SlotId(slot))?.clone();
            self.fill_sequence(&mut p, b, slot, &st)?;
        }
        if let Some(f) = forced {
            p.forced = 1;
            p.forced_codes[..f.len()].copy_from_slice(f);
        }
        self.launch_frame_kernel(&p)
    }

    /// Waits for the queued launches of `slots` (in launch order, their code words one after
    /// another), then advances their states and returns each sequence's code words.
    fn take_frames(&mut self, slots: &[usize]) -> Result<Vec<[i32; CODE_WORDS]>> {
        let codes = self.read_codes(slots.len() * CODE_WORDS)?;
        let eos = self.geometry.eos_id;
        let mut out = Vec::with_capacity(slots.len());
        for (&slot, words) in slots.iter().zip(codes.chunks_exact(CODE_WORDS)) {
            let words: [i32; CODE_WORDS] = words.try_into()?;
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

    /// Checks a spec against the model and the options, and claims a slot for it.
    fn new_sequence(&mut self, spec: &SequenceSpec) -> Result<NewSequence> {
        let plan = &spec.plan;
        ensure!(
            !plan.prefill.is_empty(),
            "plan.prefill: no rows; a prompt needs at least one"
        );
        let prompt = self.plan_rows(plan)?;
        let trailing = plan
            .trailing
            .iter()
            .chain(std::iter::once(&plan.tts_pad_id))
            .map(|&id| self.text_id(id))
            .collect::<Result<Vec<i32>>>()?;
        let h = self.geometry.talker.hidden;
        if let Some(v) = &plan.speaker_vector {
            ensure!(
                v.len() == h,
                "plan.speaker_vector has {} values, the talker width is {h}",
                v.len()
            );
        }
        let slot = self.claim_slot(prompt.len(), trailing.len(), spec.max_frames, spec.sampling)?;
        // Speaker rows read the vector stored for their slot.
        let prompt = prompt
            .into_iter()
            .map(|row| match row.codec {
                Codec::Speaker { .. } => TextRow {
                    codec: Codec::Speaker { slot },
                    ..row
                },
                _ => row,
            })
            .collect::<Vec<_>>();
        Ok(NewSequence {
            slot,
            rows: prompt.len(),
            prompt: PromptRows::Plan(prompt),
            trailing: TrailingRows::Ids(trailing),
            speaker: plan.speaker_vector.clone(),
        })
    }

    /// The plan's prompt rows for the GPU projection (speaker rows not yet tied to a slot).
    fn plan_rows(&self, plan: &PromptPlan) -> Result<Vec<TextRow>> {
        plan.prefill
            .iter()
            .map(|row| {
                let codec = match row.codec {
                    CodecSource::None => Codec::None,
                    CodecSource::Id(id) => {
                        ensure!(
                            (id as usize) < self.geometry.vocab,
                            "plan.prefill: codec id {id} is outside the codec vocabulary (0..{})",
                            self.geometry.vocab
                        );
                        Codec::Id(id as i32)
                    }
                    CodecSource::SpeakerVector => {
                        ensure!(
                            plan.speaker_vector.is_some(),
                            "plan.prefill: a row uses the speaker vector but plan.speaker_vector \
                             is missing"
                        );
                        Codec::Speaker { slot: 0 }
                    }
                    CodecSource::ReferenceFrame(k) => {
                        let frame = plan.reference_codes.get(k).with_context(|| {
                            format!(
                                "plan.prefill: reference frame {k} of {} in plan.reference_codes",
                                plan.reference_codes.len()
                            )
                        })?;
                        let mut codes = [0i32; NUM_CODE_GROUPS];
                        for (group, (dst, &code)) in codes.iter_mut().zip(frame).enumerate() {
                            let vocab = if group == 0 {
                                self.geometry.vocab
                            } else {
                                self.geometry.cp_vocab
                            };
                            ensure!(
                                (code as usize) < vocab,
                                "plan.reference_codes[{k}][{group}] = {code}: outside 0..{vocab}"
                            );
                            *dst = code as i32;
                        }
                        Codec::Reference(codes)
                    }
                };
                Ok(TextRow {
                    text_id: self.text_id(row.text_id)?,
                    codec,
                })
            })
            .collect()
    }

    fn text_id(&self, id: u32) -> Result<i32> {
        ensure!(
            (id as usize) < self.geometry.text_vocab,
            "text id {id} is outside the text vocabulary (0..{})",
            self.geometry.text_vocab
        );
        Ok(id as i32)
    }
}

impl FrameBackend for CudaBackend {
    fn name(&self) -> String {
        format!("cuda ({})", self.device_name)
    }

    /// Every spec's prompt rows go through one batched prefill (passes of up to
    /// `max_prefill_rows` rows), then one head launch per `widest_launch` sequences.
    fn start(&mut self, specs: &[SequenceSpec]) -> Vec<Result<SlotId>> {
        let mut results = Vec::with_capacity(specs.len());
        let mut sequences = Vec::new();
        for spec in specs {
            results.push(self.new_sequence(spec).map(|s| {
                let slot = SlotId(s.slot);
                sequences.push(s);
                slot
            }));
        }
        if sequences.is_empty() {
            return results;
        }
        if let Err(e) = self.start_sequences(sequences) {
            let message = format!("{e:#}");
            for result in results.iter_mut().filter(|r| r.is_ok()) {
                *result = Err(anyhow!("the GPU prefill failed: {message}"));
            }
        }
        results
    }

    fn step_width(&self) -> usize {
        self.widest_launch()
    }

    /// Queues a launch per `widest_launch` unfinished sequences and reads all their codes
    /// once, so that the launches follow each other without a host round trip.
    fn step(&mut self, slots: &[SlotId]) -> Result<Vec<FrameEvent>> {
        check_distinct(slots)?;
        let mut finished = Vec::with_capacity(slots.len());
        let mut launched = Vec::new();
        for slot in slots {
            let reason = self.state(*slot)?.finished;
            finished.push(reason.map(FrameEvent::Finished));
            if reason.is_none() {
                launched.push(slot.0);
            }
        }
        self.check_runnable(&launched)?;
        let width = self.widest_launch();
        for (group, chunk) in launched.chunks(width).enumerate() {
            self.launch_frames(chunk, None, group * width)?;
        }
        let mut frames = self.take_frames(&launched)?.into_iter();
        finished
            .into_iter()
            .map(|event| match event {
                Some(event) => Ok(event),
                None => {
                    let words = frames.next().context("a slot got no codes")?;
                    let mut frame: Frame = [0; NUM_CODE_GROUPS];
                    for (dst, src) in frame.iter_mut().zip(words.iter()) {
                        *dst = *src as u32;
                    }
                    Ok(FrameEvent::Frame(frame))
                }
            })
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
        let rows = ids
            .iter()
            .chain(std::iter::once(&self.tts_pad_id))
            .map(|&id| {
                Ok(TextRow {
                    text_id: self.text_id(id)?,
                    codec: Codec::None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let first = (slot.0 * max_len + known) as i32;
        let dest: Vec<i32> = (first..first + rows.len() as i32).collect();
        let stream = Arc::clone(&self.stream);
        let out = self.base.trailing;
        self.prefill.project(&stream, &rows, &dest, out)?;
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

/// Code words for `slots` sequences, in whole groups of `MAX_BATCH` (one launch each).
fn code_words(slots: usize) -> usize {
    slots.next_multiple_of(MAX_BATCH) * CODE_WORDS
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
