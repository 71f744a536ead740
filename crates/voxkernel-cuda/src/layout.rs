//! `#[repr(C)]` mirrors of the structs in `kernels/frame.cu` and `kernels/prefill.cu`. Field order and types must match
//! the CUDA side exactly; device pointers are plain `u64`.

/// Sequences one frame launch can carry at most (`PARAM_B` in the kernel: the wide build's
/// `MAX_B`); the parameter arrays and per-launch buffers hold this many.
pub const MAX_BATCH: usize = 8;
/// Sequences a launch of the full build carries (its `MAX_B`); the solo build's shared memory
/// is sized as the full build's.
pub const FULL_BATCH: usize = 4;
/// Threads per block (`THREADS` in the kernel).
pub const BLOCK_THREADS: u32 = 512;
/// Per-sequence words of the `codes` scratch (`CODE_WORDS` in the kernel).
pub const CODE_WORDS: usize = 36;
/// Offset of the kernel's own (pre-forcing) choices within a sequence's code words.
pub const OWN_CODES: usize = 18;
pub const MODE_FRAME: i32 = 0;
/// Only the codec head and codebook-0 sampling of rows the prefill left in `x`.
pub const MODE_HEAD: i32 = 1;
/// Warps per block (`WARPS` in the kernel).
pub const BLOCK_WARPS: usize = BLOCK_THREADS as usize / 32;
/// q heads one attention pass serves (`HEADS_PER_PASS` in the kernel).
pub const HEADS_PER_PASS: usize = 2;
/// Words after the sampling values in the sampling scratch (`HIST_WORDS` in the kernel).
pub const HIST_WORDS: usize = 264;
/// Largest head_dim the attention's registers hold (`MAX_HEAD_DIM` in the kernel).
pub const MAX_HEAD_DIM: usize = 128;

/// Bits of a tag that count a launch's exchanges (`EXCHANGE_BITS` in the kernel).
pub const EXCHANGE_BITS: u32 = 11;

/// Phase tags of the profile marks (`PH_*` in the kernel): the phase whose end a mark records,
/// with [`PHASE_TALKER`] set for the talker stack. The last three are steps inside a predictor
/// pass's sampling (its top-k threshold, its noise and draw, its block argmax), so that the
/// "sample" phase itself is only the publication of the next input.
pub const PHASE_NAMES: [&str; 12] = [
    "start",
    "input",
    "qkv",
    "attention",
    "o_proj",
    "gate_up",
    "down",
    "head",
    "sample",
    "select",
    "draw",
    "argmax",
];
pub const PHASE_TALKER: u64 = 16;
/// Set on a mark recorded once a phase's inputs have all arrived (`PH_WAIT`): the interval it
/// ends is the wait of the next phase that ends.
pub const PHASE_WAIT: u64 = 32;

/// prefill.cu's tile sizes and block shapes (`TILE_F`, `TILE_R`, ... there).
pub const PREFILL_PIECES: usize = 3;
pub const GEMM_THREADS: u32 = 128;
pub const GEMM_TILE_F: usize = 128;
pub const GEMM_TILE_R: usize = 64;
pub const GEMM_TILE_K: usize = 32;
pub const GEMM_STAGES: usize = 4;
/// Shared-memory row of a stage, in bf16 elements (`SROW`).
pub const GEMM_SROW: usize = GEMM_TILE_K + 8;
pub const ROW_THREADS: u32 = 1024;
pub const ROPE_WARPS: usize = 8;
pub const ATTN_WARPS: usize = 8;
/// (row, q head) tasks a warp of the attention kernel can hold (`ATTN_TASKS_PER_WARP`).
pub const ATTN_TASKS_PER_WARP: usize = 2;
pub const KEY_CHUNK: usize = 32;
/// Words per entry of the prefill's segment table (`SEG_WORDS`).
pub const SEG_WORDS: usize = 4;

/// `LayerW`: eight bf16 weight pointers per decoder layer.
pub type LayerPointers = [u64; 8];
/// Indices into [`LayerPointers`].
pub const LAYER_IN_NORM: usize = 0;
pub const LAYER_QKV: usize = 1;
pub const LAYER_Q_NORM: usize = 2;
pub const LAYER_K_NORM: usize = 3;
pub const LAYER_O: usize = 4;
pub const LAYER_POST_NORM: usize = 5;
pub const LAYER_GATE_UP: usize = 6;
pub const LAYER_DOWN: usize = 7;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Stack {
    pub layers: u64,
    pub final_norm: u64,
    /// `[max_len][head_dim / 2]` (cos, sin) pairs.
    pub rope: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub hidden: i32,
    pub inter: i32,
    pub n_heads: i32,
    pub n_kv: i32,
    pub head_dim: i32,
    pub n_layers: i32,
    pub max_len: i32,
    pub eps: f32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Sampler {
    pub do_sample: i32,
    pub top_k: i32,
    pub temperature: f32,
    pub repetition_penalty: f32,
    /// 1.0 = off.
    pub top_p: f32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct FrameParams {
    pub talker: Stack,
    pub cp: Stack,
    pub codec_embedding: u64,
    pub codec_head: u64,
    pub cp_embedding: u64,
    pub cp_heads: u64,
    pub proj_w: u64,
    pub proj_b: u64,
    pub past_hidden: u64,
    pub trailing: u64,
    pub seen: u64,
    pub talker_logits: u64,
    pub x: u64,
    /// Tagged words (`u64`): `xw` two buffers of `[MAX_BATCH][max_hidden]`.
    pub xw: u64,
    pub qkv: u64,
    pub attn: u64,
    pub act: u64,
    pub logits: u64,
    pub attn_part: u64,
    pub attn_count: u64,
    pub codes: u64,
    pub marks: u64,
    /// Tags of this launch: `(epoch << EXCHANGE_BITS) | exchange`; never 0.
    pub epoch: u32,
    pub vocab: i32,
    pub cp_vocab: i32,
    pub groups: i32,
    pub eos_id: i32,
    pub max_trailing: i32,
    pub max_hidden: i32,
    pub max_qkv: i32,
    pub max_q: i32,
    pub max_inter: i32,
    pub smem_x_floats: i32,
    pub mode: i32,
    pub batch: i32,
    pub forced: i32,
    pub max_marks: i32,
    pub attention_chunk: i32,
    pub attn_part_stride: i32,
    pub talker_chunks: i32,
    pub slot: [i32; MAX_BATCH],
    pub pos: [i32; MAX_BATCH],
    pub step: [i32; MAX_BATCH],
    pub c0: [i32; MAX_BATCH],
    pub n_sampled: [i32; MAX_BATCH],
    pub trailing_len: [i32; MAX_BATCH],
    pub seed_lo: [u32; MAX_BATCH],
    pub seed_hi: [u32; MAX_BATCH],
    pub talker_sampler: [Sampler; MAX_BATCH],
    pub sub_sampler: [Sampler; MAX_BATCH],
    pub forced_codes: [[i32; 17]; MAX_BATCH],
}

/// `Gemm` (prefill.cu): `out[z][r][f]` = the split-`z` part of `W[f] . X[r]`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Gemm {
    pub w: u64,
    pub x: u64,
    pub out: u64,
    pub plane: i64,
    pub n: i32,
    pub k: i32,
    pub rows: i32,
    pub pieces: i32,
    pub k_split: i32,
}

/// `Project` (prefill.cu): the text projection's row kernels.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Project {
    pub text_embedding: u64,
    pub bias: u64,
    pub codec_embedding: u64,
    pub cp_embedding: u64,
    pub speakers: u64,
    pub rows: u64,
    pub ref_codes: u64,
    pub part: u64,
    pub planes: u64,
    pub out: u64,
    pub n_rows: i32,
    pub splits: i32,
    pub width: i32,
    pub text_hidden: i32,
    pub inter: i32,
    pub hidden: i32,
    pub cp_vocab: i32,
    pub groups: i32,
}

/// `Rows` (prefill.cu): the talker layer's row kernels.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Rows {
    pub x: u64,
    pub part: u64,
    pub planes: u64,
    pub weight: u64,
    pub q_norm: u64,
    pub k_norm: u64,
    pub rope: u64,
    pub q: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub head: u64,
    pub segments: u64,
    pub row_segment: u64,
    pub row_head: u64,
    pub tiles: u64,
    pub rows: i32,
    pub splits: i32,
    pub hidden: i32,
    pub inter: i32,
    pub n_heads: i32,
    pub n_kv: i32,
    pub head_dim: i32,
    pub layer: i32,
    pub n_layers: i32,
    pub max_len: i32,
    pub tile_rows: i32,
    pub head_stride: i32,
    pub eps: f32,
}

// Kernel parameters, each mirroring its struct in kernels/frame.cu or kernels/prefill.cu.
kernel_params!(FrameParams, Gemm, Project, Rows);

/// Codec-track kinds of a prompt row (`CODEC_*` in prefill.cu).
pub const CODEC_NONE: i32 = 0;
pub const CODEC_ID: i32 = 1;
pub const CODEC_SPEAKER: i32 = 2;
pub const CODEC_REFERENCE: i32 = 3;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_have_the_sizes_the_kernel_expects() {
        // Sizes computed from the CUDA declarations (all fields 4 or 8 bytes, pointers first).
        assert_eq!(std::mem::size_of::<Stack>(), 5 * 8 + 8 * 4);
        assert_eq!(std::mem::size_of::<Sampler>(), 20);
        assert_eq!(
            std::mem::size_of::<Gemm>(),
            (4 * 8 + 5 * 4_usize).next_multiple_of(8)
        );
        assert_eq!(std::mem::size_of::<Project>(), 10 * 8 + 8 * 4);
        assert_eq!(
            std::mem::size_of::<Rows>(),
            (15 * 8 + 13 * 4_usize).next_multiple_of(8)
        );
        let frame =
            2 * 72 + 20 * 8 + 18 * 4 + 8 * 4 * MAX_BATCH + 2 * 20 * MAX_BATCH + 17 * 4 * MAX_BATCH;
        assert_eq!(
            std::mem::size_of::<FrameParams>(),
            frame.next_multiple_of(8)
        );
    }
}
