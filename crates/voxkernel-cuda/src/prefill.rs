//! The batched prefill (`kernels/prefill.cu`): the prompt rows of many sequences go through the
//! text projection and the talker's layers together, as tensor-core matrix products with small
//! row kernels between them. Scratch is sized at construction for `max_rows` rows per pass;
//! longer calls run as several passes (a sequence may span passes: its later rows attend to the
//! cache its earlier rows wrote). The codec head and the sampling of each sequence's last row
//! are the frame kernel's (`MODE_HEAD`, driven by the backend).

use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, LaunchConfig,
    PushKernelArg,
};
use voxkernel_core::backend::NUM_CODE_GROUPS;

use crate::backend::CudaOptions;
use crate::layout::{
    ATTN_TASKS_PER_WARP, ATTN_WARPS, CODEC_ID, CODEC_NONE, CODEC_REFERENCE, CODEC_SPEAKER,
    GEMM_SROW, GEMM_STAGES, GEMM_THREADS, GEMM_TILE_F, GEMM_TILE_K, GEMM_TILE_R, Gemm, KEY_CHUNK,
    LAYER_DOWN, LAYER_GATE_UP, LAYER_IN_NORM, LAYER_K_NORM, LAYER_O, LAYER_POST_NORM, LAYER_Q_NORM,
    LAYER_QKV, LayerPointers, PREFILL_PIECES, Project, ROPE_WARPS, ROW_THREADS, Rows, SEG_WORDS,
};
use crate::runtime::{self, PREFILL_SOURCE, device_ptr, zeros};
use crate::weights::{DeviceWeights, Geometry, WeightPointers};

/// The codec track summed onto a prompt row's projected text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Codec {
    None,
    /// A row of the talker's codec embedding.
    Id(i32),
    /// The speaker vector stored for this slot ([`Prefill::set_speaker`]).
    Speaker {
        slot: usize,
    },
    /// The sum of a reference frame's 16 code embeddings.
    Reference([i32; NUM_CODE_GROUPS]),
}

/// One row for the text projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TextRow {
    pub text_id: i32,
    pub codec: Codec,
}

/// The talker's device state the prefill writes and reads, owned by the backend.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TalkerState {
    /// `[slots][layers][n_kv][max_len][head_dim]` each.
    pub k_cache: u64,
    pub v_cache: u64,
    /// `[max_len][head_dim / 2]` (cos, sin): the frame kernel's RoPE table.
    pub rope: u64,
}

/// A run of one sequence's rows within a talker pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Segment {
    pub slot: usize,
    /// The talker position of its first row.
    pub pos0: usize,
    pub rows: usize,
    /// Where the sequence's last row goes ([`Prefill::head_ptr`]) when it is in this segment.
    pub head: Option<usize>,
}

/// The tensor-core product kernel and how many of its blocks the device holds at once.
struct Products {
    gemm: CudaFunction,
    smem: u32,
    slots: usize,
}

impl Products {
    fn new(ctx: &Arc<CudaContext>, module: &Arc<CudaModule>) -> Result<Self> {
        let gemm = module
            .load_function("gemm")
            .context("prefill kernel gemm")?;
        let smem =
            (2 * GEMM_STAGES * (GEMM_TILE_F + PREFILL_PIECES * GEMM_TILE_R) * GEMM_SROW) as u32;
        gemm.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )?;
        let per_sm =
            gemm.occupancy_max_active_blocks_per_multiprocessor(GEMM_THREADS, smem as usize, None)?;
        ensure!(
            per_sm >= 1,
            "the prefill's product kernel cannot be resident on this GPU ({smem} bytes of shared \
             memory)"
        );
        let sms = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        Ok(Self {
            gemm,
            smem,
            slots: sms as usize * per_sm as usize,
        })
    }

    /// Launches `p` (its `k_split` chosen here, for partials of at most `part_floats` floats)
    /// and returns the number of depth splits.
    fn run(&self, stream: &Arc<CudaStream>, mut p: Gemm, part_floats: usize) -> Result<i32> {
        let (n, k, rows) = (p.n as usize, p.k as usize, p.rows as usize);
        let (splits, k_split) = plan_splits(n, k, rows, self.slots, part_floats);
        p.k_split = k_split as i32;
        let cfg = LaunchConfig {
            grid_dim: (
                n.div_ceil(GEMM_TILE_F) as u32,
                rows.div_ceil(GEMM_TILE_R) as u32,
                splits as u32,
            ),
            block_dim: (GEMM_THREADS, 1, 1),
            shared_mem_bytes: self.smem,
        };
        let mut launch = stream.launch_builder(&self.gemm);
        launch.arg(&p);
        // SAFETY: the caller's `w`, `x` and `out` hold [n][k], [pieces][rows][k] and the
        // partials, which `plan_splits` keeps within `part_floats`.
        unsafe { launch.launch(cfg) }.context("launching the prefill's matrix product")?;
        Ok(splits as i32)
    }
}

struct Kernels {
    gather_text: CudaFunction,
    bias_silu: CudaFunction,
    project_out: CudaFunction,
    residual_norm: CudaFunction,
    qk_rope: CudaFunction,
    attention: CudaFunction,
    silu_mul: CudaFunction,
}

/// Device scratch, allocated once.
struct Scratch {
    /// `[max_rows][hidden]`: the talker's input rows, then its residual stream.
    x: CudaSlice<f32>,
    /// `[PIECES][max_rows][widest product input]`: a product's input in bf16 pieces.
    planes: CudaSlice<u16>,
    /// A product's per-split partial sums.
    part: CudaSlice<f32>,
    /// `[max_rows][q_width]`: normed, rotated queries.
    q: CudaSlice<f32>,
    /// `[max_slots][head_stride]`: each sequence's last row after the last layer.
    head: CudaSlice<f32>,
    /// `[max_slots][hidden]`: speaker vectors, by slot.
    speakers: CudaSlice<f32>,
    /// Per-pass tables: the projection's rows and reference codes, then the talker's segments,
    /// row maps and attention tiles.
    table: CudaSlice<i32>,
}

/// `Scratch`'s device addresses, taken once (each lookup would record an event).
#[derive(Debug, Clone, Copy)]
struct ScratchPointers {
    x: u64,
    planes: u64,
    part: u64,
    q: u64,
    head: u64,
    speakers: u64,
    table: u64,
}

/// Where the per-pass tables live in `Scratch::table`.
#[derive(Debug, Clone, Copy)]
struct TableLayout {
    talker_offset: usize,
}

pub(crate) struct Prefill {
    products: Products,
    kernels: Kernels,
    scratch: Scratch,
    at: ScratchPointers,
    geometry: Geometry,
    weights: WeightPointers,
    layers: Vec<LayerPointers>,
    talker: TalkerState,
    max_len: usize,
    max_rows: usize,
    /// Floats of `part`: a product over `rows` rows and `n` outputs gets at most
    /// `part_floats / (rows * n)` depth splits.
    part_floats: usize,
    attention_smem: u32,
    head_stride: usize,
    layout: TableLayout,
}

/// Block-steps of fixed cost per product block (prologue, epilogue), in units of one
/// `GEMM_TILE_K` step: what a depth split costs beyond its share of the work.
const SPLIT_OVERHEAD_STEPS: usize = 3;

/// Most depth splits of a product: the consuming row kernel loads every split's partial sum of
/// an element, 16 at a time (`GATHER` in prefill.cu), so each 16 more cost it a round trip.
const MAX_SPLITS: usize = 32;

/// The depth splits of a product (`n` outputs, depth `k`, `rows` rows) and the depth of each:
/// the fewest block-waves times steps per block, where `slots` blocks run at once and the
/// partial sums of all splits must fit in `part_floats`.
pub(crate) fn plan_splits(
    n: usize,
    k: usize,
    rows: usize,
    slots: usize,
    part_floats: usize,
) -> (usize, usize) {
    let tiles = n.div_ceil(GEMM_TILE_F) * rows.div_ceil(GEMM_TILE_R);
    let steps = k.div_ceil(GEMM_TILE_K).max(1);
    let most = (part_floats / (rows * n).max(1)).clamp(1, steps.min(MAX_SPLITS));
    let mut best = (usize::MAX, 1);
    for splits in 1..=most {
        let per_split = steps.div_ceil(splits);
        let splits = steps.div_ceil(per_split);
        let waves = (tiles * splits).div_ceil(slots.max(1));
        let cost = waves * (per_split + SPLIT_OVERHEAD_STEPS);
        if cost < best.0 {
            best = (cost, splits);
        }
    }
    let per_split = steps.div_ceil(best.1);
    (steps.div_ceil(per_split), per_split * GEMM_TILE_K)
}

impl Prefill {
    /// `talker`: the caches and RoPE table, laid out for `options`.
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        geometry: &Geometry,
        weights: &DeviceWeights,
        talker: TalkerState,
        options: &CudaOptions,
    ) -> Result<Self> {
        let (max_len, max_slots, max_rows) =
            (options.max_len, options.max_slots, options.max_prefill_rows);
        ensure!(
            max_rows > 0,
            "max_prefill_rows must be at least 1 (rows per prefill pass)"
        );
        ensure!(
            geometry.talker.head_dim.is_multiple_of(4),
            "talker_config.head_dim = {}: the prefill's attention reads 4 dims at a time, so it \
             must be a multiple of 4",
            geometry.talker.head_dim
        );
        let module = runtime::load_source(ctx, "prefill", PREFILL_SOURCE)?;
        let load = |name: &str| {
            module
                .load_function(name)
                .with_context(|| format!("prefill kernel {name}"))
        };
        let products = Products::new(ctx, &module)?;
        let kernels = Kernels {
            gather_text: load("gather_text")?,
            bias_silu: load("bias_silu")?,
            project_out: load("project_out")?,
            residual_norm: load("residual_norm")?,
            qk_rope: load("qk_rope")?,
            attention: load("attention")?,
            silu_mul: load("silu_mul")?,
        };
        let g = geometry;
        let t = &g.talker;
        let (tp, t1p) = (g.text_hidden_padded(), g.text_inter_padded());
        let widest_input = [t.hidden, t.q_width(), t.inter, tp, t1p]
            .into_iter()
            .max()
            .unwrap_or(0);
        let widest_output = [t.qkv_width(), 2 * t.inter, t.hidden, g.text_inter]
            .into_iter()
            .max()
            .unwrap_or(0);
        // Room for a few depth splits even when a pass has few rows.
        let part_floats = max_rows.max(8 * GEMM_TILE_R) * widest_output;
        let head_stride = t.hidden.max(g.cp.hidden);
        let tile_rows = attention_tile_rows(geometry);
        let projection_words = max_rows * (4 + NUM_CODE_GROUPS);
        let talker_words =
            SEG_WORDS * max_slots + 2 * max_rows + 2 * (max_rows.div_ceil(tile_rows) + max_slots);
        let scratch = Scratch {
            x: zeros(stream, max_rows * t.hidden, "the prefill's rows")?,
            planes: zeros(
                stream,
                PREFILL_PIECES * max_rows * widest_input,
                "the prefill's product inputs",
            )?,
            part: zeros(stream, part_floats, "the prefill's partial sums")?,
            q: zeros(stream, max_rows * t.q_width(), "the prefill's queries")?,
            head: zeros(stream, max_slots * head_stride, "the prefill's last rows")?,
            speakers: zeros(
                stream,
                max_slots * t.hidden,
                "the prefill's speaker vectors",
            )?,
            table: zeros(
                stream,
                projection_words + talker_words,
                "the prefill's tables",
            )?,
        };

        let attention_smem =
            (4 * (KEY_CHUNK * (t.head_dim + 4)
                + KEY_CHUNK * t.head_dim
                + ATTN_WARPS * ATTN_TASKS_PER_WARP * t.head_dim)) as u32;
        kernels.attention.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            attention_smem as i32,
        )?;
        let at = ScratchPointers {
            x: device_ptr(&scratch.x, stream),
            planes: device_ptr(&scratch.planes, stream),
            part: device_ptr(&scratch.part, stream),
            q: device_ptr(&scratch.q, stream),
            head: device_ptr(&scratch.head, stream),
            speakers: device_ptr(&scratch.speakers, stream),
            table: device_ptr(&scratch.table, stream),
        };
        Ok(Self {
            products,
            kernels,
            scratch,
            at,
            geometry: *geometry,
            weights: weights.ptr,
            layers: weights.talker_layers.clone(),
            talker,
            max_len,
            max_rows,
            part_floats,
            attention_smem,
            head_stride,
            layout: TableLayout {
                talker_offset: projection_words,
            },
        })
    }

    pub(crate) fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// The rows a talker pass reads (`[max_rows][hidden]`).
    pub(crate) fn x_ptr(&self) -> u64 {
        self.at.x
    }

    /// Each sequence's last row after the last layer, `[sequence][head_stride]` (the frame
    /// kernel's `x` layout, so `MODE_HEAD` can read it in place).
    pub(crate) fn head_ptr(&self) -> u64 {
        self.at.head
    }

    pub(crate) fn head_stride(&self) -> usize {
        self.head_stride
    }

    /// Ready-made talker input rows into the pass's rows from `row0` on.
    pub(crate) fn fill_rows(
        &mut self,
        stream: &Arc<CudaStream>,
        row0: usize,
        rows: &[f32],
    ) -> Result<()> {
        let at = row0 * self.geometry.talker.hidden;
        stream.memcpy_htod(rows, &mut self.scratch.x.slice_mut(at..at + rows.len()))?;
        Ok(())
    }

    /// The speaker vector that `Codec::Speaker { slot }` rows add.
    pub(crate) fn set_speaker(
        &mut self,
        stream: &Arc<CudaStream>,
        slot: usize,
        vector: &[f32],
    ) -> Result<()> {
        let h = self.geometry.talker.hidden;
        ensure!(
            vector.len() == h,
            "speaker_vector has {} values, the talker width is {h}",
            vector.len()
        );
        stream.memcpy_htod(
            vector,
            &mut self.scratch.speakers.slice_mut(slot * h..(slot + 1) * h),
        )?;
        Ok(())
    }

    fn upload_table(
        &mut self,
        stream: &Arc<CudaStream>,
        offset: usize,
        words: &[i32],
    ) -> Result<u64> {
        stream.memcpy_htod(
            words,
            &mut self.scratch.table.slice_mut(offset..offset + words.len()),
        )?;
        Ok(self.at.table + 4 * offset as u64)
    }

    fn launch<P: DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        f: &CudaFunction,
        cfg: LaunchConfig,
        params: &P,
        what: &str,
    ) -> Result<()> {
        let mut launch = stream.launch_builder(f);
        launch.arg(params);
        // SAFETY: every pointer in `params` addresses scratch or weights owned by the backend and
        // sized in `new` for `max_rows` rows; the caller keeps `rows <= max_rows`.
        unsafe { launch.launch(cfg) }.with_context(|| format!("launching the prefill's {what}"))?;
        Ok(())
    }

    /// `part` = the split partial sums of `W . X` (`n` outputs, depth `k`, `rows` rows, X in
    /// `pieces` bf16 pieces in `planes`). Returns the number of splits.
    fn gemm(
        &self,
        stream: &Arc<CudaStream>,
        w: u64,
        n: usize,
        k: usize,
        rows: usize,
        pieces: usize,
    ) -> Result<i32> {
        let p = Gemm {
            w,
            x: self.at.planes,
            out: self.at.part,
            plane: (rows * k) as i64,
            n: n as i32,
            k: k as i32,
            rows: rows as i32,
            pieces: pieces as i32,
            k_split: 0,
        };
        self.products.run(stream, p, self.part_floats)
    }

    /// text_projection(text_embedding[row.text_id]) + the row's codec track, written to row
    /// `dest[i]` of `out` (f32 rows of the talker width), `max_rows` rows per pass.
    pub(crate) fn project(
        &mut self,
        stream: &Arc<CudaStream>,
        rows: &[TextRow],
        dest: &[i32],
        out: u64,
    ) -> Result<()> {
        ensure!(
            rows.len() == dest.len(),
            "one destination per projected row"
        );
        let g = self.geometry;
        let w = self.weights;
        let (tp, t1p) = (g.text_hidden_padded(), g.text_inter_padded());
        for (rows, dest) in rows.chunks(self.max_rows).zip(dest.chunks(self.max_rows)) {
            let n = rows.len();
            let mut words = vec![0i32; n * (4 + NUM_CODE_GROUPS)];
            let (descs, ref_codes) = words.split_at_mut(4 * n);
            for (i, (row, &d)) in rows.iter().zip(dest).enumerate() {
                let (kind, value) = match row.codec {
                    Codec::None => (CODEC_NONE, 0),
                    Codec::Id(id) => (CODEC_ID, id),
                    Codec::Speaker { slot } => (CODEC_SPEAKER, slot as i32),
                    Codec::Reference(codes) => {
                        ref_codes[i * NUM_CODE_GROUPS..(i + 1) * NUM_CODE_GROUPS]
                            .copy_from_slice(&codes);
                        (CODEC_REFERENCE, 0)
                    }
                };
                descs[4 * i..4 * i + 4].copy_from_slice(&[row.text_id, kind, value, d]);
            }
            let table = self.upload_table(stream, 0, &words)?;
            let mut p = Project {
                text_embedding: w.text_embedding,
                bias: w.fc1_b,
                codec_embedding: w.codec_embedding,
                cp_embedding: w.cp_embedding,
                speakers: self.at.speakers,
                rows: table,
                ref_codes: table + 4 * 4 * n as u64,
                part: self.at.part,
                planes: self.at.planes,
                out,
                n_rows: n as i32,
                splits: 0,
                width: tp as i32,
                text_hidden: g.text_hidden as i32,
                inter: g.text_inter as i32,
                hidden: g.talker.hidden as i32,
                cp_vocab: g.cp_vocab as i32,
                groups: NUM_CODE_GROUPS as i32,
            };
            let grid = per_row(n);
            let k = &self.kernels;
            self.launch(stream, &k.gather_text, grid, &p, "text gather")?;
            // Text embeddings are bf16: one piece is exact.
            p.splits = self.gemm(stream, w.fc1_w, g.text_inter, tp, n, 1)?;
            p.width = t1p as i32;
            self.launch(stream, &k.bias_silu, grid, &p, "projection SiLU")?;
            p.splits = self.gemm(stream, w.fc2_w, g.talker.hidden, t1p, n, PREFILL_PIECES)?;
            p.bias = w.fc2_b;
            self.launch(stream, &k.project_out, grid, &p, "projection output")?;
        }
        Ok(())
    }

    /// Runs the talker's layers over the pass's rows (`x`, the segments' rows in order): writes
    /// every row's K and V into its slot's cache at its position, and each finished sequence's
    /// last row to its head row.
    pub(crate) fn talker(&mut self, stream: &Arc<CudaStream>, segments: &[Segment]) -> Result<()> {
        let rows: usize = segments.iter().map(|s| s.rows).sum();
        ensure!(
            rows > 0 && rows <= self.max_rows,
            "a prefill pass holds 1..={} rows, not {rows}",
            self.max_rows
        );
        let t = self.geometry.talker;
        let tile_rows = attention_tile_rows(&self.geometry);
        let mut segment_words = Vec::with_capacity(SEG_WORDS * segments.len());
        let mut row_segment = Vec::with_capacity(rows);
        let mut row_head = vec![-1i32; rows];
        let mut tiles = Vec::new();
        let mut row0 = 0;
        for (i, s) in segments.iter().enumerate() {
            ensure!(
                s.pos0 + s.rows <= self.max_len,
                "prefill rows up to position {} exceed max_len {}",
                s.pos0 + s.rows,
                self.max_len
            );
            segment_words.extend([s.slot, s.pos0, row0, s.rows].map(|v| v as i32));
            row_segment.extend(std::iter::repeat_n(i as i32, s.rows));
            if let Some(head) = s.head {
                row_head[row0 + s.rows - 1] = head as i32;
            }
            for t0 in (0..s.rows).step_by(tile_rows) {
                tiles.extend([i as i32, t0 as i32]);
            }
            row0 += s.rows;
        }
        let n_tiles = tiles.len() / 2;
        let words: Vec<i32> = [segment_words, row_segment, row_head, tiles].concat();
        let table = self.upload_table(stream, self.layout.talker_offset, &words)?;
        let segments_ptr = table;
        let row_segment_ptr = segments_ptr + 4 * (SEG_WORDS * segments.len()) as u64;
        let row_head_ptr = row_segment_ptr + 4 * rows as u64;
        let tiles_ptr = row_head_ptr + 4 * rows as u64;

        let mut p = Rows {
            x: self.at.x,
            part: 0,
            planes: self.at.planes,
            weight: self.layers[0][LAYER_IN_NORM],
            q_norm: 0,
            k_norm: 0,
            rope: self.talker.rope,
            q: self.at.q,
            k_cache: self.talker.k_cache,
            v_cache: self.talker.v_cache,
            head: 0,
            segments: segments_ptr,
            row_segment: row_segment_ptr,
            row_head: row_head_ptr,
            tiles: tiles_ptr,
            rows: rows as i32,
            splits: 0,
            hidden: t.hidden as i32,
            inter: t.inter as i32,
            n_heads: t.n_heads as i32,
            n_kv: t.n_kv as i32,
            head_dim: t.head_dim as i32,
            layer: 0,
            n_layers: t.layers as i32,
            max_len: self.max_len as i32,
            tile_rows: tile_rows as i32,
            head_stride: self.head_stride as i32,
            eps: t.eps,
        };
        let rows_cfg = per_row(rows);
        let k = &self.kernels;
        self.launch(stream, &k.residual_norm, rows_cfg, &p, "input norm")?;
        p.part = self.at.part;
        for layer in 0..t.layers {
            let lw = self.layers[layer];
            p.layer = layer as i32;
            p.splits = self.gemm(stream, lw[LAYER_QKV], t.qkv_width(), t.hidden, rows, 3)?;
            p.q_norm = lw[LAYER_Q_NORM];
            p.k_norm = lw[LAYER_K_NORM];
            let rope = LaunchConfig {
                grid_dim: (
                    rows as u32,
                    (t.n_heads + t.n_kv).div_ceil(ROPE_WARPS) as u32,
                    1,
                ),
                block_dim: (32 * ROPE_WARPS as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            self.launch(stream, &k.qk_rope, rope, &p, "q/k norm + RoPE")?;
            let attention = LaunchConfig {
                grid_dim: (n_tiles as u32, t.n_kv as u32, 1),
                block_dim: (32 * ATTN_WARPS as u32, 1, 1),
                shared_mem_bytes: self.attention_smem,
            };
            self.launch(stream, &k.attention, attention, &p, "attention")?;
            p.splits = self.gemm(stream, lw[LAYER_O], t.hidden, t.q_width(), rows, 3)?;
            p.weight = lw[LAYER_POST_NORM];
            self.launch(stream, &k.residual_norm, rows_cfg, &p, "post norm")?;
            p.splits = self.gemm(stream, lw[LAYER_GATE_UP], 2 * t.inter, t.hidden, rows, 3)?;
            let silu = LaunchConfig {
                grid_dim: (
                    rows as u32,
                    t.inter.div_ceil(ROW_THREADS as usize) as u32,
                    1,
                ),
                ..rows_cfg
            };
            self.launch(stream, &k.silu_mul, silu, &p, "SiLU")?;
            p.splits = self.gemm(stream, lw[LAYER_DOWN], t.hidden, t.inter, rows, 3)?;
            let last = layer + 1 == t.layers;
            p.weight = if last {
                0
            } else {
                self.layers[layer + 1][LAYER_IN_NORM]
            };
            p.head = if last { self.at.head } else { 0 };
            self.launch(stream, &k.residual_norm, rows_cfg, &p, "residual")?;
        }
        Ok(())
    }
}

/// One block of `ROW_THREADS` per row.
fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Rows per attention block: one (row, q head) task per warp, or one row whose kv group is
/// wider than the block (at most `ATTN_TASKS_PER_WARP` tasks per warp: groups are validated
/// to hold at most 15 heads).
fn attention_tile_rows(g: &Geometry) -> usize {
    (ATTN_WARPS / (g.talker.n_heads / g.talker.n_kv)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_cover_the_depth_and_fit_the_partials() {
        for &(n, k, rows) in &[
            (4096, 1024, 40),
            (1024, 3072, 640),
            (6144, 1024, 640),
            (128, 16, 3),
            (16, 8, 1),
            (1024, 2048, 1024),
        ] {
            let part = 1024 * 6144;
            let (splits, k_split) = plan_splits(n, k, rows, 264, part);
            assert!((1..=MAX_SPLITS).contains(&splits) && k_split.is_multiple_of(GEMM_TILE_K));
            // Every split has depth to do, and together they cover k.
            assert!(
                (splits - 1) * k_split < k && splits * k_split >= k,
                "{n} {k} {rows}"
            );
            assert!(splits * rows * n <= part.max(rows * n));
        }
    }

    #[test]
    fn few_rows_split_the_depth_and_many_rows_do_not() {
        // 40 rows of a 1024-wide output: 8 tiles for 264 resident blocks, so split deep.
        assert_eq!(plan_splits(1024, 3072, 40, 264, 1024 * 6144).0, MAX_SPLITS);
        // 640 rows of a 6144-wide output already make 480 tiles: splitting only adds waves.
        assert_eq!(plan_splits(6144, 1024, 640, 264, 1024 * 6144).0, 1);
        // No room for partials: one split.
        assert_eq!(plan_splits(1024, 3072, 40, 264, 1024 * 40).0, 1);
    }
}

#[cfg(test)]
mod gpu_tests {
    use half::bf16;

    use super::*;

    /// A reproducible uniform in [-1, 1).
    fn uniform(state: &mut u64) -> f32 {
        *state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// The tensor-core product at the talker's shapes, with the splits the planner picks,
    /// against an f64 product on the host: the three bf16 pieces keep f32 accuracy.
    #[test]
    #[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
    fn product_matches_f64_at_the_talkers_shapes() {
        assert!(runtime::driver_available(), "this test needs a CUDA driver");
        let ctx = runtime::open_device().unwrap();
        let stream = ctx.default_stream();
        let module = runtime::load_source(&ctx, "prefill", PREFILL_SOURCE).unwrap();
        let products = Products::new(&ctx, &module).unwrap();
        let part_floats = 1024 * 6144;
        let mut state = 7u64;
        for &(n, k, rows, pieces) in &[
            (4096, 1024, 40, 3),
            (1024, 3072, 40, 3),
            (1024, 2048, 640, 3),
            (6144, 1024, 97, 3),
            (2048, 2048, 33, 1),
            (136, 24, 3, 3),
        ] {
            let w: Vec<bf16> = (0..n * k)
                .map(|_| bf16::from_f32(uniform(&mut state) * 0.05))
                .collect();
            // Activations over several binades, as after a norm.
            let x: Vec<f32> = (0..rows * k)
                .map(|i| {
                    let v = uniform(&mut state) * (1 + i % 7) as f32;
                    if pieces == 1 {
                        bf16::from_f32(v).to_f32()
                    } else {
                        v
                    }
                })
                .collect();
            let mut planes = vec![bf16::ZERO; 3 * rows * k];
            for (i, &v) in x.iter().enumerate() {
                let hi = bf16::from_f32(v);
                let r1 = v - hi.to_f32();
                let mid = bf16::from_f32(r1);
                planes[i] = hi;
                planes[rows * k + i] = mid;
                planes[2 * rows * k + i] = bf16::from_f32(r1 - mid.to_f32());
            }
            let w_dev = stream
                .clone_htod(&w.iter().map(|v| v.to_bits()).collect::<Vec<u16>>())
                .unwrap();
            let x_dev = stream
                .clone_htod(&planes.iter().map(|v| v.to_bits()).collect::<Vec<u16>>())
                .unwrap();
            let part = stream.alloc_zeros::<f32>(part_floats).unwrap();
            let p = Gemm {
                w: device_ptr(&w_dev, &stream),
                x: device_ptr(&x_dev, &stream),
                out: device_ptr(&part, &stream),
                plane: (rows * k) as i64,
                n: n as i32,
                k: k as i32,
                rows: rows as i32,
                pieces,
                k_split: 0,
            };
            let splits = products.run(&stream, p, part_floats).unwrap() as usize;
            let got = stream.clone_dtoh(&part).unwrap();
            let (mut worst, mut scale) = (0f64, 0f64);
            for r in 0..rows {
                for f in 0..n {
                    let want: f64 = (0..k)
                        .map(|j| w[f * k + j].to_f64() * x[r * k + j] as f64)
                        .sum();
                    let sum: f32 = (0..splits).map(|z| got[(z * rows + r) * n + f]).sum();
                    worst = worst.max((sum as f64 - want).abs());
                    scale = scale.max(want.abs());
                }
            }
            let err = worst / scale;
            println!(
                "product n {n} k {k} rows {rows} pieces {pieces}: {splits} splits, rel err {err:.2e}"
            );
            // f32 accumulation over a depth of 1-3 thousand reaches a few 1e-6 of the largest
            // output; one bf16 piece alone would be ~1e-3 off.
            assert!(err <= 1e-5, "n {n} k {k} rows {rows}: rel err {err:.2e}");
        }
    }
}
