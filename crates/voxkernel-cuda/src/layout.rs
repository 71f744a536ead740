//! `#[repr(C)]` mirrors of the structs in `kernels/frame.cu`. Field order and types must match
//! the CUDA side exactly; device pointers are plain `u64`.

use cudarc::driver::DeviceRepr;

/// Sequences one frame launch can carry (`MAX_B` in the kernel).
pub const MAX_BATCH: usize = 4;
/// Threads per block (`THREADS` in the kernel).
pub const BLOCK_THREADS: u32 = 512;
/// Per-sequence words of the `codes` scratch (`CODE_WORDS` in the kernel).
pub const CODE_WORDS: usize = 36;
/// Offset of the kernel's own (pre-forcing) choices within a sequence's code words.
pub const OWN_CODES: usize = 18;
pub const MODE_FRAME: i32 = 0;
pub const MODE_PREFILL: i32 = 1;
/// Warps per block (`WARPS` in the kernel).
pub const BLOCK_WARPS: usize = BLOCK_THREADS as usize / 32;
/// q heads one attention pass serves (`HEADS_PER_PASS` in the kernel).
pub const HEADS_PER_PASS: usize = 2;
/// Words after the sampling values in the sampling scratch (`HIST_WORDS` in the kernel).
pub const HIST_WORDS: usize = 264;
/// Largest head_dim the attention's registers hold (`MAX_HEAD_DIM` in the kernel).
pub const MAX_HEAD_DIM: usize = 128;

/// Phase tags of the profile marks (`PH_*` in the kernel): the phase whose end a mark records,
/// with [`PHASE_TALKER`] set for the talker stack.
pub const PHASE_NAMES: [&str; 9] = [
    "start",
    "input",
    "qkv",
    "attention",
    "o_proj",
    "gate_up",
    "down",
    "head",
    "sample",
];
pub const PHASE_TALKER: u64 = 16;

/// `LayerW`: eight bf16 weight pointers per decoder layer.
pub type LayerPointers = [u64; 8];

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
    pub prefill_rows: u64,
    pub x: u64,
    pub qkv: u64,
    pub attn: u64,
    pub attn_part: u64,
    pub attn_count: u64,
    pub gate_up: u64,
    pub cp_logits: u64,
    pub codes: u64,
    pub barrier: u64,
    pub marks: u64,
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
    pub prefill_row: i32,
    pub prefill_last: i32,
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

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct EmbedParams {
    pub text_embedding: u64,
    pub fc1_w: u64,
    pub fc1_b: u64,
    pub fc2_w: u64,
    pub fc2_b: u64,
    pub codec_embedding: u64,
    pub cp_embedding: u64,
    pub speaker: u64,
    pub ref_codes: u64,
    pub rows: u64,
    pub out: u64,
    pub n_rows: i32,
    pub text_hidden: i32,
    pub text_inter: i32,
    pub hidden: i32,
    pub cp_vocab: i32,
    pub groups: i32,
}

// SAFETY: plain-old-data `#[repr(C)]` structs of integers, floats and device addresses, passed by
// value as kernel parameters; their layout mirrors the CUDA structs.
unsafe impl DeviceRepr for FrameParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for EmbedParams {}

/// Codec-track kinds of a prompt row (`CODEC_*` in the kernel).
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
        assert_eq!(std::mem::size_of::<EmbedParams>(), 11 * 8 + 6 * 4);
        let frame =
            2 * 72 + 21 * 8 + 19 * 4 + 8 * 4 * MAX_BATCH + 2 * 20 * MAX_BATCH + 17 * 4 * MAX_BATCH;
        assert_eq!(
            std::mem::size_of::<FrameParams>(),
            frame.next_multiple_of(8)
        );
    }
}
