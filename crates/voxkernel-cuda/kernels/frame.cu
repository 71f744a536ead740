// voxkernel frame megakernel (version 1.19: phases chained by tagged words, no grid barriers; o,
// down and gate|up tasks shared by warp pairs; V appended by a warp of its own; norm weights
// loaded before the wait; a sampler with two barriers per radix round; the predictor's first
// two positions in one pass; one exp per warp state in the attention's merge; matvec inputs in
// two planes, so that their shared-memory reads use every bank; a build for launches of one
// sequence; a warp's first cached K/V row loaded before the wait, and rows read whole before
// they are stored; in the solo build, the attention merge's factors once per warp state and
// the flat collect out of line; the talker's attention chunks counted by one acquire-release
// increment; the block argmax's warp results reduced by one warp; a wide build for launches of
// up to eight sequences; exchanged words polled two per load, the rows of every sequence of a
// launch at once; each product's first batch asked of L2 at the tail of the product before;
// normed inputs read and written in pairs, no integer division between a phase's inputs and its
// products; profile marks inside the predictor's sampler; in the solo build, each product's
// second batch asked of L2 behind the phase's first polls).
//
// One cooperative launch advances up to MAX_B sequences (the solo build: one) by one audio
// frame:
//   code predictor (15 passes: past_hidden and CE(c0) as two rows of one pass, or as two
//   single-token passes when 2 * batch rows do not fit MAX_B; then 14 group embeddings),
//   sub-talker sampling, frame embedding + trailing text row, one talker step, codec head,
//   codebook-0 sampling. In HEAD mode it only finishes a prefill (prefill.cu leaves each
//   sequence's last talker row in x): final norm, codec head, past_hidden, codebook-0 sampling.
// Activations stay f32 (shared memory, and tagged words between blocks); weights are bf16,
// streamed once.
// No toolkit headers: NVRTC compiles this file with nothing but its own builtins.

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned long long u64;

// The host compiles this file three times: as is (the full build), for launches of up to 4
// sequences; with WIDE 1 first, for launches of up to 8 (many sessions); and with SOLO 1 first,
// for launches of one sequence. The per-row loops of a matvec are unrolled as wide as the most
// rows its pass carries and guarded at run time: MAX_B wide in the full and wide builds; in the
// solo build 2 wide in the fused first predictor pass and 1 wide elsewhere. Unrolled 4 wide,
// they cost a launch of one sequence ~0.15 ms of its ~2.78 (docs/kernel-notes.md, "Version
// 1.9"); unrolled 8 wide, ~0.57 ms of 3.39 (session 9), so launches of 2-4 keep the full build.
#ifndef SOLO
#define SOLO 0
#endif
#ifndef WIDE
#define WIDE 0
#endif
// Sequences the Params arrays and the x-word buffers are laid out for (the host's MAX_BATCH),
// the same in every build.
#define PARAM_B 8
#define MAX_B (SOLO ? 2 : WIDE ? 8 : 4)
// The loop width of a pass of one row per sequence.
#define SEQ_B (SOLO ? 1 : MAX_B)
// The most sequences a launch of this build may carry; the host reads it from the module.
__constant__ int frame_sequences = SOLO ? 1 : MAX_B;
#define WARPS 16
#define THREADS (WARPS * 32)
#define MAX_HEAD_DIM 128
#define MODE_FRAME 0
#define MODE_HEAD 1
#define NEG_INF (-__int_as_float(0x7f800000))
// Per-sequence words of `codes`: [0,16) the frame's codes, 16 the next codebook 0, 17 the EOS
// flag, [18,34) the kernel's own choice for each group and 34 for the next codebook 0 (they
// differ from the used ones only under teacher forcing).
#define CODE_WORDS 36
#define OWN 18
// q heads one attention pass over the positions serves (they share each K and V load).
#define HEADS_PER_PASS 2
// Per-lane registers holding one head_dim vector.
#define HEAD_REGS (MAX_HEAD_DIM / 32)
// Words after the sampling values: the radix histogram (256) and its two state words, padded.
#define HIST_WORDS 264

// Phase tags of the profile marks (src/layout.rs mirrors them): the phase a barrier closes,
// or'ed with PH_TALKER for the talker stack.
#define PH_START 0
#define PH_INPUT 1
#define PH_QKV 2
#define PH_ATTENTION 3
#define PH_O 4
#define PH_GATE_UP 5
#define PH_DOWN 6
#define PH_HEAD 7
#define PH_SAMPLE 8
// Marks inside a predictor pass's sample phase, before its own: the top-k threshold found, the
// noise and draw loop done (with top-p, its filter too), the block argmax done (the phase's mark
// then ends the publication of the next input).
#define PH_SELECT 9
#define PH_DRAW 10
#define PH_ARGMAX 11
#define PH_TALKER 16
// Or'ed into a mark recorded once a phase's inputs have all arrived (the phase it belongs to is
// the next one that ends): the profile splits each phase into its wait and the rest.
#define PH_WAIT 32

struct LayerW {
  const bf16_t* in_norm;
  const bf16_t* qkv;      // [q_width + 2 * kv_width, hidden]: q, k, v rows concatenated
  const bf16_t* q_norm;
  const bf16_t* k_norm;
  const bf16_t* o;        // [hidden, q_width]
  const bf16_t* post_norm;
  const bf16_t* gate_up;  // [2 * inter, hidden]: gate rows then up rows
  const bf16_t* down;     // [hidden, inter]
};

struct Stack {
  const LayerW* layers;
  const bf16_t* final_norm;
  const float2* rope;     // [max_len][head_dim / 2]: cos and sin of pos * inv_freq[i]
  float* k_cache;         // [cache_slots][layers][n_kv][max_len][head_dim]
  float* v_cache;
  int hidden, inter, n_heads, n_kv, head_dim, n_layers, max_len;
  float eps;
  __device__ int qkv_rows() const { return (n_heads + 2 * n_kv) * head_dim; }
};

struct Sampler {
  int do_sample;
  int top_k;
  float temperature;
  float repetition_penalty;
  float top_p;  // 1 = off
};

struct Params {
  Stack talker;
  Stack cp;
  const bf16_t* codec_embedding;  // [vocab, H]
  const bf16_t* codec_head;       // [vocab, H]
  const bf16_t* cp_embedding;     // [groups - 1][cp_vocab][H]
  const bf16_t* cp_heads;         // [groups - 1][cp_vocab][cp_hidden]
  const bf16_t* proj_w;           // [cp_hidden, H] or null (identity)
  const bf16_t* proj_b;
  float* past_hidden;             // [slots][H]
  float* trailing;                // [slots][max_trailing][H]
  unsigned char* seen;            // [slots][vocab]
  float* talker_logits;           // [slots][vocab]: a copy for the host
  const float* x;                 // [PARAM_B][max_hidden]: the prefill's last rows (MODE_HEAD)
  // Tagged words (see "exchange" below):
  u64* xw;                        // [2][PARAM_B][max_hidden]: the residual stream / layer input
  u64* qkv;                       // [PARAM_B][max_qkv]
  u64* attn;                      // [PARAM_B][max_q]
  u64* act;                       // [PARAM_B][max_inter]: SiLU(gate) * up
  u64* logits;                    // [PARAM_B][max(vocab, cp_vocab)]
  float* attn_part;               // [PARAM_B][attn_part_stride]: partial attention of each chunk
  u32* attn_count;                // [PARAM_B][max kv heads]: chunks done; zero between phases
  int* codes;                     // [PARAM_B][CODE_WORDS]
  u64* marks;                     // null, or [max_marks][2]: profile marks (clock64, phase tag)
  u32 epoch;                      // this launch's tags: (epoch << EXCHANGE_BITS) | exchange
  int vocab, cp_vocab, groups, eos_id, max_trailing;
  int max_hidden, max_qkv, max_q, max_inter;
  int smem_x_floats;              // MAX_B * widest matvec input
  int mode, batch, forced;
  int max_marks;
  int attention_chunk;            // positions per attention block; 0 = all of a sequence's
  int attn_part_stride;           // floats of attn_part per sequence
  int talker_chunks;              // attention chunks of the talker step (its longest sequence)
  int slot[PARAM_B];
  int pos[PARAM_B];
  int step[PARAM_B];
  int c0[PARAM_B];
  int n_sampled[PARAM_B];
  int trailing_len[PARAM_B];
  u32 seed_lo[PARAM_B];
  u32 seed_hi[PARAM_B];
  Sampler talker_sampler[PARAM_B];
  Sampler sub_sampler[PARAM_B];
  int forced_codes[PARAM_B][17];
};

// The host mirrors these structs (src/layout.rs); a size mismatch fails the compile.
static_assert(sizeof(Stack) == 72, "Stack layout changed: update src/layout.rs");
static_assert(sizeof(Params) == 1496, "Params layout changed: update src/layout.rs");

// The thread index, read where it is used: kept out of the compiler's loop-invariant hoisting,
// whose long-lived copies of index arithmetic would otherwise spill registers.
__device__ __forceinline__ int tid() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}
__device__ __forceinline__ int bid() {
  int b;
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(b));
  return b;
}

// ---------------------------------------------------------------------------------------------
// small helpers

__device__ __forceinline__ float bf_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ float bf2f(bf16_t v) { return __uint_as_float(((u32)v) << 16); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Weights never change during a launch, so the non-coherent path is legal for them only.
__device__ __forceinline__ uint4 ld_weights(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

// Counts one of n at a counter with acquire-release semantics at GPU scope: returns the old
// count, and the n-th call (old n - 1) leaves the counter at 0 again.
__device__ __forceinline__ u32 count_acq_rel(u32* p, u32 n) {
  u32 old;
  asm volatile("atom.acq_rel.gpu.global.inc.u32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(p), "r"(n - 1)
               : "memory");
  return old;
}

// Profile (Params::marks): block 0's thread 0 records its SM clock at the end of each phase and
// which phase it was. Out of line, so that the rarely taken call holds no registers in the
// kernel; the count lives in shared memory for the same reason.
__device__ __noinline__ void record_mark(u64* marks, int max_marks, int phase) {
  __shared__ int n_marks;
  const int n = phase == PH_START ? 0 : n_marks;
  if (n < max_marks) {
    marks[2 * n] = (u64)clock64();
    marks[2 * n + 1] = (u64)phase;
  }
  n_marks = n + 1;
}

// ---------------------------------------------------------------------------------------------
// exchange between blocks: tagged words
//
// Every value one block hands to another travels as a 64-bit word {tag, f32 bits}, stored and
// loaded with single-copy-atomic 64-bit accesses. A reader spins on exactly the words it needs
// until they carry the tag it expects, so no grid barrier and no fence stands between phases: a
// value is usable one store and one load after it is produced. A tag names one exchange of one
// launch, (epoch << EXCHANGE_BITS) | k, with k numbering the launch's exchanges by where they
// happen (below), so every block derives it from its loop counters; 0 is never used, so zeroed
// words match nothing.
//
// Reuse: a word is overwritten only by a block that has (transitively) read words produced by
// every block that read the old value, after that read. The phases guarantee it: a block reads
// a phase's inputs only when it produces something in that phase, and its outputs are read by
// the next phase's producers (all of them, except attention, which reads its group's and is read
// by every o-projection block). The host checks the shapes this relies on: every block owning
// residual rows (o and down) also has q|k|v and gate|up rows, so it has read the x it adds to.
#define EXCHANGE_BITS 11

__device__ __forceinline__ u64 ld_word(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void publish(u64* p, float v, u32 tag) {
  const u64 w = ((u64)tag << 32) | __float_as_uint(v);
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
}

__device__ __forceinline__ float word_value(u64 w) { return __uint_as_float((u32)w); }

// Two adjacent words in one 16-byte load (each single-copy atomic on its own).
__device__ __forceinline__ ulonglong2 ld_word_pair(const u64* p) {
  ulonglong2 v;
  asm volatile("ld.relaxed.gpu.global.v2.u64 {%0, %1}, [%2];"
               : "=l"(v.x), "=l"(v.y)
               : "l"(p)
               : "memory");
  return v;
}

// Word pairs a thread loads before it waits on the first.
#define COLLECT_PAIRS 4
// A thread's elements of a row as wide as the widest hidden (2,048): its norm weights, or a row
// read from global memory (row_elements).
#define NORM_REGS 4

// Element j (j < NORM_REGS) of a thread's share of a row, from pair `base` on: elements go to
// threads two by two, as collect() polls them, so that a thread can use the elements it collected
// before the block synchronises. A loop over a row steps base by ROW_PAIRS_STEP from tid().
__device__ __forceinline__ int row_element(int base, int j) {
  return 2 * (base + (j >> 1) * THREADS) + (j & 1);
}
#define ROW_PAIRS_STEP (THREADS * NORM_REGS / 2)

__device__ __forceinline__ float to_f32(bf16_t v) { return bf2f(v); }
__device__ __forceinline__ float to_f32(float v) { return v; }

// A thread's elements row_element(base, j) of a row of n (0 past n), every load issued before
// any is used: in a loop that stores each element as it arrives, each load would wait for the
// one before it.
template <typename T>
__device__ __forceinline__ void row_elements(const T* row, int n, int base,
                                             float (&v)[NORM_REGS]) {
#pragma unroll
  for (int j = 0; j < NORM_REGS; j++) {
    const int i = row_element(base, j);
    v[j] = i < n ? to_f32(row[i]) : 0.f;
  }
}

// Where element i of a matvec input row of n elements lives in xs: the row's 16-byte chunks of 8
// elements are split into two planes, their first halves then their second halves. A matvec
// lane reads one chunk's 8 inputs as two 16-byte loads; with the chunks of a warp's lanes
// adjacent in each plane, the 32 lanes of each load cover every bank once (packed chunks, 32
// bytes apart, would use half the banks and take twice the cycles).
__device__ __forceinline__ int plane_index(int i, int n) {
  return ((i >> 2) & 1) * (n >> 1) + ((i >> 3) << 2) + (i & 3);
}

// 16-byte weight chunks a lane loads before it uses the first.
#define MATVEC_DEPTH 4

// Lines of a warp's weights asked of L2 (`prefetch.global.L2`: nothing comes back to the warp).
// One lane per 128-byte line asks: `at` is that lane's first chunk (null for the other lanes, or
// without a row), `n` the chunks from it to the row's end of the warp's part; a batch of
// MATVEC_DEPTH chunks per lane is asked.
struct Prefetch {
  const uint4* at;
  int n;
};

__device__ __forceinline__ void prefetch_l2(const Prefetch& f) {
  if (!f.at) return;
#pragma unroll
  for (int j = 0; j < MATVEC_DEPTH; j++)
    if (32 * j < f.n) asm volatile("prefetch.global.L2 [%0];" ::"l"(f.at + 32 * j) : "memory");
}

// out[r * n + i] = the value of src[r * stride + i] for rows r < rows and i < n (with PLANES,
// out[r * n + plane_index(i, n)]), once each carries `tag`. A thread takes word pairs, pair q of
// every row being thread q % THREADS's (row_element's), and its (pair, row) slots
// COLLECT_PAIRS at a time, every load out before it waits on the first: a pair still stale once
// the one before it has landed costs one more round trip, so two words per load halve the round
// trips after the last producer's words land (docs/kernel-notes.md, "Version 1.14"), and the rows
// of a launch of several sequences are awaited together, not one after another. n is even and
// src 16-byte aligned (the host checks the model's widths). The block's threads share the words;
// the caller synchronises the block before reading `out`. `then` (second_batch_of) is asked of
// L2 once the first polls are out.
template <bool PLANES = false>
__device__ void collect(const u64* src, int stride, int rows, int n, u32 tag, float* out,
                        Prefetch then = Prefetch{nullptr, 0}) {
  const int pairs = n >> 1;
  const int slots = rows * ((pairs - tid() + THREADS - 1) / THREADS);
  int q = tid(), r = 0;  // the next slot's pair and row
  for (int s0 = 0; s0 < slots; s0 += COLLECT_PAIRS) {
    // (every element set: a conditionally set one would count as live from the kernel's entry)
    ulonglong2 w[COLLECT_PAIRS];
    int slot[COLLECT_PAIRS];  // (row << 24) | pair, or -1
#pragma unroll
    for (int j = 0; j < COLLECT_PAIRS; j++) {
      slot[j] = s0 + j < slots ? (r << 24) | q : -1;
      w[j] = slot[j] >= 0 ? ld_word_pair(src + (size_t)r * stride + 2 * q)
                          : make_ulonglong2(0ull, 0ull);
      if (++r == rows) {
        r = 0;
        q += THREADS;
      }
    }
    // (behind the first polls, so that they are not answered after its lines)
    if (s0 == 0) prefetch_l2(then);
#pragma unroll
    for (int j = 0; j < COLLECT_PAIRS; j++) {
      if (slot[j] < 0) continue;
      const int row = slot[j] >> 24, i = slot[j] & 0xffffff;
      const u64* at = src + (size_t)row * stride + 2 * i;
      while ((u32)(w[j].x >> 32) != tag || (u32)(w[j].y >> 32) != tag) w[j] = ld_word_pair(at);
      // (plane_index keeps an even element's successor next to it)
      *reinterpret_cast<float2*>(out + row * n + (PLANES ? plane_index(2 * i, n) : 2 * i)) =
          make_float2(word_value(w[j].x), word_value(w[j].y));
    }
  }
}

// collect without planes. In the solo build it is one out-of-line function: measured 20-30 us per
// frame faster at batch 1 than inlined where it is called; in the full build the same form made
// launches of 4 4% slower (docs/kernel-notes.md, "Version 1.12").
#if SOLO
__device__ __noinline__
#else
__device__ __forceinline__
#endif
void collect_flat(const u64* src, int stride, int rows, int n, u32 tag, float* out,
                  Prefetch then = Prefetch{nullptr, 0}) {
  collect<false>(src, stride, rows, n, tag, out, then);
}

// Exchanges are numbered by where they happen, so that every block derives the same tag from
// its loop counters (no state to carry). Predictor pass `step` owns 3 + 5 L numbers (L layers)
// from pass_exchange(p, step): +0 the projection's x, +1 + 5 l + k layer l's (k: LX_*),
// +1 + 5 L the head's logits, +2 + 5 L the next input x (sampling, or codebook 0's embedding
// after an unfused first pass; a fused one uses pass 1's numbers). The talker's follow: +5 l + k
// for layer l, +5 L its head's logits.
#define LX_QKV 0
#define LX_ATTN 1
#define LX_O 2     // x after the o projection
#define LX_ACT 3
#define LX_DOWN 4  // x after the down projection
#define LAYER_EXCHANGES 5

__device__ __forceinline__ u32 tag_of(const Params& p, int exchange) {
  return (p.epoch << EXCHANGE_BITS) | (u32)exchange;
}

__device__ __forceinline__ int pass_exchange(const Params& p, int step) {
  return 1 + step * (3 + LAYER_EXCHANGES * p.cp.n_layers);
}

__device__ __forceinline__ int talker_exchange(const Params& p) {
  return pass_exchange(p, p.groups);
}

// The next input x of a predictor pass: its exchange number.
__device__ __forceinline__ int next_input_exchange(const Params& p, int step) {
  return pass_exchange(p, step) + 2 + LAYER_EXCHANGES * p.cp.n_layers;
}

// Where a layer's input x is found, in one int (registers are scarce): x words of buffer
// `slot` at exchange `ex` as (slot << 16) | ex, or one of the sources below. The x words live in
// two buffers: the projection writes buffer 1 from buffer 0; every other x goes to buffer 0 (its
// readers have all read before any writer of the next x can have its inputs: see "Reuse" above).
#define X_PAST (-1)   // past_hidden of the sequence's slot (written by the previous launch)
#define X_PLAIN (-2)  // Params::x (written by the prefill, before this launch)
// The fused first predictor pass's rows: rows [0, nb/2) codebook 0's embedding (position 1),
// rows [nb/2, nb) past_hidden (position 0). The rows the head reads come first.
#define X_C0_PAST (-3)

__device__ __forceinline__ int x_words(int slot, int exchange) { return (slot << 16) | exchange; }

// The dynamic shared memory: a matvec's inputs (xs), the block's raw x rows (xr), reduction
// words, attention / sampling scratch. Addresses are computed where used, from the array and
// the launch's constants: pointers kept live across the kernel would cost registers.
extern __shared__ float smem[];
__device__ __forceinline__ float* sm_xs() { return smem; }
__device__ __forceinline__ float* sm_xr(const Params& p) { return smem + p.smem_x_floats; }
// (16-byte aligned: smem_x_floats is 4 or 8 rows of max_k floats, MAX_B is even, max_hidden even)
__device__ __forceinline__ float* sm_red(const Params& p) {
  return smem + p.smem_x_floats + MAX_B * p.max_hidden;
}
__device__ __forceinline__ int* sm_redi(const Params& p) {
  return reinterpret_cast<int*>(sm_red(p) + 32);
}
__device__ __forceinline__ float* sm_work(const Params& p) { return sm_red(p) + 64; }

__device__ __forceinline__ u64* x_buffer(const Params& p, int slot) {
  return p.xw + (size_t)slot * PARAM_B * p.max_hidden;
}

// The block's threads are done with the phase (and its shared memory); the profile mark.
__device__ __forceinline__ void end_phase(const Params& p, int phase) {
  __syncthreads();
  if (p.marks && bid() == 0 && tid() == 0) record_mark(p.marks, p.max_marks, phase);
}

// The profile mark of a phase's inputs having arrived (called after the barrier that follows
// the block's last wait).
__device__ __forceinline__ void inputs_arrived(const Params& p) {
  if (p.marks && bid() == 0 && tid() == 0) record_mark(p.marks, p.max_marks, PH_WAIT);
}

// x of every sequence (its first n elements) into out ([nb][n], shared memory; with PLANES as
// a matvec input, plane_index); a thread's elements are row_element's, and the caller
// synchronises the block.
template <bool PLANES = false>
__device__ void collect_x_rows(const Params& p, int in, int nb, int n, float* out,
                               Prefetch then = Prefetch{nullptr, 0}) {
  const int H = p.talker.hidden;
  if (in >= 0) {
    const u64* src = x_buffer(p, in >> 16);
    if (PLANES)
      collect<true>(src, p.max_hidden, nb, n, tag_of(p, in & 0xffff), out, then);
    else
      collect_flat(src, p.max_hidden, nb, n, tag_of(p, in & 0xffff), out, then);
    return;
  }
  for (int b = 0; b < nb; b++) {
    float* o = out + b * n;
    // (X_C0_PAST: rows below nb / 2 are codebook 0's embedding, the others past_hidden)
    const int past = in == X_C0_PAST ? b - nb / 2 : b;
    const bool table = past < 0;
    const float* src = in == X_PLAIN ? p.x + (size_t)b * p.max_hidden
                                     : p.past_hidden + (size_t)p.slot[table ? 0 : past] * H;
    for (int base = tid(); 2 * base < n; base += ROW_PAIRS_STEP) {
      float v[NORM_REGS];
      if (table)
        row_elements(p.codec_embedding + (size_t)p.c0[b] * H, n, base, v);
      else
        row_elements(src, n, base, v);
#pragma unroll
      for (int j = 0; j < NORM_REGS; j++) {
        const int i = row_element(base, j);
        if (i < n) o[PLANES ? plane_index(i, n) : i] = v[j];
      }
    }
  }
}

// x of every sequence as matvec inputs (xs).
__device__ void collect_x(const Params& p, int in, int nb, int n, float* xs) {
  collect_x_rows<true>(p, in, nb, n, xs);
  __syncthreads();
}

// x of every sequence into xr ([nb][n]) and rmsnorm(x) * w into xs (as matvec inputs, in
// planes; every block that needs the norm computes it: cheaper than an exchange). The weights
// are loaded before the words are awaited, and each thread squares and scales the elements it
// collected itself (row_element), so that one barrier (the sums of squares) stands between the
// last word's arrival and the normed rows.
__device__ void collect_x_norm(const Params& p, int in, int nb, int n, const bf16_t* w, float eps,
                               float* xr, float* xs, Prefetch then = Prefetch{nullptr, 0}) {
  const int warp = tid() >> 5, lane = tid() & 31;
  float* red = sm_red(p);  // [MAX_B][WARPS]: over the reduction ints too, unused here
  float wv[NORM_REGS];
  row_elements(w, n, tid(), wv);
  collect_x_rows(p, in, nb, n, xr, then);
  for (int b = 0; b < nb; b++) {
    float ss = 0.f;
    // (a thread's elements come in adjacent pairs, read as one: conflict-free)
#pragma unroll
    for (int j = 0; j < NORM_REGS; j += 2) {
      const int i = row_element(tid(), j);
      if (i < n) {
        const float2 x = *reinterpret_cast<const float2*>(xr + b * n + i);
        ss += x.x * x.x;
        ss += x.y * x.y;
      }
    }
    ss = warp_sum(ss);
    if (lane == 0) red[b * WARPS + warp] = ss;
  }
  __syncthreads();
  inputs_arrived(p);
  for (int b = 0; b < nb; b++) {
    float total = 0.f;
#pragma unroll
    for (int k = 0; k < WARPS; k += 4) {  // (red is 16-byte aligned: sm_red)
      const float4 r4 = *reinterpret_cast<const float4*>(red + b * WARPS + k);
      total += r4.x;
      total += r4.y;
      total += r4.z;
      total += r4.w;
    }
    const float r = rsqrtf(total / (float)n + eps);
    // (an even element and its successor are adjacent in the planes too: plane_index)
#pragma unroll
    for (int j = 0; j < NORM_REGS; j += 2) {
      const int i = row_element(tid(), j);
      if (i < n) {
        const float2 x = *reinterpret_cast<const float2*>(xr + b * n + i);
        *reinterpret_cast<float2*>(xs + b * n + plane_index(i, n)) =
            make_float2(wv[j] * (x.x * r), wv[j + 1] * (x.y * r));
      }
    }
  }
  __syncthreads();
}

// Task t of a matvec goes to block t % gridDim.x (every block streams an equal share of the
// weights): this warp's k-th task of `tasks`, or -1. With `split` 2, warps 2i and 2i + 1 share
// each of their tasks: each takes half of its K (a block has 8 tasks of the 1,024-row o and
// down products: without the split, half of its warps would idle and the others would walk
// twice the weights after their inputs arrive), or, for gate|up pairs, one row each (a warp
// then walks at most 3 rows instead of 4).
__device__ __forceinline__ int warp_task(int k, int tasks, int split) {
  const int t = bid() + gridDim.x * ((tid() >> 5) / split + WARPS / split * k);
  return t < tasks ? t : -1;
}

// The chunks [lo, hi) of a row of k8 chunks this warp takes under `split`.
__device__ __forceinline__ int2 warp_chunks(int k8, int split) {
  // (split is 1 or 2, at run time for gate|up: no integer division on the way to the products)
  const int per = split == 2 ? (k8 + 1) >> 1 : k8, part = split == 2 ? (tid() >> 5) & 1 : 0;
  const int lo = min(k8, part * per);
  return make_int2(lo, min(k8, lo + per));
}

// The two warps of a split pair meet here (named barriers 1..8; 0 is __syncthreads').
__device__ __forceinline__ void pair_barrier() {
  asm volatile("bar.sync %0, 64;" ::"r"(1 + (tid() >> 6)) : "memory");
}

// Whether this block computes any of `tasks` tasks.
__device__ __forceinline__ bool has_rows(int tasks) { return bid() < tasks; }

// The first MATVEC_DEPTH chunks (per lane) of a warp's first row of a matvec. Weights depend on
// nothing, so a phase loads them before it awaits its inputs: their memory round trip overlaps
// the wait instead of following it. Volatile keeps the loads there.
struct FirstChunks {
  uint4 w[MATVEC_DEPTH];
};

// The row a warp takes of task t: with split 2 and a pair, the odd warp takes the second row.
__device__ __forceinline__ int split_row(int t, int split, int pair) {
  return t < 0 || split == 1 ? t : t + ((tid() >> 5) & 1) * pair;
}

__device__ FirstChunks first_chunks(const bf16_t* W, int rows, int K, int split = 1,
                                    int pair = 0) {
  FirstChunks f;
  const int r = split_row(warp_task(0, rows, split), split, pair), lane = tid() & 31;
  const int2 c = warp_chunks(K >> 3, pair > 0 ? 1 : split);
  const uint4* wr = reinterpret_cast<const uint4*>(W + (size_t)(r < 0 ? 0 : r) * K);
#pragma unroll
  for (int j = 0; j < MATVEC_DEPTH; j++) {
    f.w[j] = make_uint4(0u, 0u, 0u, 0u);
    if (r >= 0 && c.x + lane + 32 * j < c.y)
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(f.w[j].x), "=r"(f.w[j].y), "=r"(f.w[j].z), "=r"(f.w[j].w)
                   : "l"(wr + c.x + lane + 32 * j));
  }
  return f;
}

// The lines of row r (none when r < 0) from chunk `from` to chunk `end` of a warp's part.
__device__ __forceinline__ Prefetch row_lines(const bf16_t* W, int r, int K, int from, int end) {
  const int lane = tid() & 31;
  Prefetch f;
  f.at = r < 0 || (lane & 7) != 0 ? nullptr
                                  : reinterpret_cast<const uint4*>(W + (size_t)r * K) + from + lane;
  f.n = end - from - lane;
  return f;
}

// A warp's part of first_chunks(W, rows, K, split, pair), to be asked of L2 at the tail of the
// product before (when the warp issues the last batch of its stream): a warp's loads are answered
// in the order it issued them (scripts/gpu/poll_bench.cu), so there the request stands behind
// nothing that waits for it, and the next phase's preload finds its bytes in L2, which holds the
// polls issued after it for an L2 round trip instead of an HBM burst.
__device__ Prefetch prefetch_of(const bf16_t* W, int rows, int K, int split = 1, int pair = 0) {
  const int r = split_row(warp_task(0, rows, split), split, pair);
  const int2 c = warp_chunks(K >> 3, pair > 0 ? 1 : split);
  return row_lines(W, r, K, c.x, c.y);
}

// A warp's second batch of the same product (the rest of its part of its first row, or its
// next row's first batch), to be asked of L2 behind the phase's first polls (collect's `then`):
// the load the product issues as its inputs arrive then finds L2 instead of HBM. In the solo
// build only: launches of 4 and 8 lost 5% with it (docs/kernel-notes.md, "Version 1.19").
__device__ Prefetch second_batch_of(const bf16_t* W, int rows, int K, int split = 1,
                                    int pair = 0) {
  if (!SOLO) return Prefetch{nullptr, 0};
  const int2 c = warp_chunks(K >> 3, pair > 0 ? 1 : split);
  const bool long_row = c.y - c.x > 32 * MATVEC_DEPTH;
  const int r = split_row(warp_task(long_row ? 0 : 1, rows, split), split, pair);
  return row_lines(W, r, K, c.x + (long_row ? 32 * MATVEC_DEPTH : 0), c.y);
}

// Every warp of the grid takes whole tasks: task t is output row t, y[b][t] = W[t] . xs[b] (xs
// in planes: plane_index), and with `pair` > 0 also row t + pair (gate and up rows of one
// SiLU * up output; pairs need SPLIT 2); tasks are dealt by warp_task. K must be a multiple of 8
// (16-byte weight loads). A warp walks the batches of MATVEC_DEPTH chunks per lane of all its
// rows as one stream and loads the next batch (of the same row or of its next row) before it
// uses the current one, so that a warp's rows do not each wait a memory round trip; the first
// batch is `first` (first_chunks of the same W, tasks, K, split and pair). Each row's sum runs
// over its chunks in order. `emit(b, t, y_t, y_t+pair)` (the second 0 without a pair) is called
// by lane 0. With SPLIT 2, warp_task's pairs of warps share each task (half of K each, or with
// a pair one row each): the odd warp hands its sum to the even one through `pair_sums` (2 *
// WARPS * MAX_B shared words; the host sizes the work area for them), which adds it to its own
// (or takes it as the pair's second row) and emits. The per-sequence loops are NB (>= nb) wide.
// `next` (prefetch_of the product that follows) is asked of L2 as the warp issues its last batch.
template <int SPLIT = 1, int NB = MAX_B, typename Emit>
__device__ void matvec_tasks(const bf16_t* W, int tasks, int pair, int K, const float* xs, int nb,
                             const FirstChunks& first, Emit emit, float* pair_sums = nullptr,
                             Prefetch next = Prefetch{nullptr, 0}) {
  const int lane = tid() & 31;
  const int2 c = warp_chunks(K >> 3, pair > 0 ? 1 : SPLIT);
  const int k8 = c.y;  // the warp's chunks of a row end here
  // the warp's q-th row, or -1
  auto row_of = [&](int q) { return split_row(warp_task(q, tasks, SPLIT), SPLIT, pair); };
  auto load = [&](uint4* w, int r, int b0) {
    const uint4* wr = reinterpret_cast<const uint4*>(W + (size_t)(r < 0 ? 0 : r) * K);
#pragma unroll
    for (int j = 0; j < MATVEC_DEPTH; j++) {
      const int i = b0 + lane + 32 * j;
      w[j] = r >= 0 && i < k8 ? ld_weights(wr + i) : make_uint4(0u, 0u, 0u, 0u);
    }
  };
  float acc[NB];
#pragma unroll
  for (int b = 0; b < NB; b++) acc[b] = 0.f;
  uint4 cur[MATVEC_DEPTH];
#pragma unroll
  for (int j = 0; j < MATVEC_DEPTH; j++) cur[j] = first.w[j];
  int q = 0, r = row_of(0), b0 = c.x;  // b0: the batch's first chunk, the same for the warp
  while (r >= 0) {
    int nq = q, nr = r, nb0 = b0 + 32 * MATVEC_DEPTH;
    if (nb0 >= k8) {
      nq = q + 1;
      nr = row_of(nq);
      nb0 = c.x;
    }
    uint4 nxt[MATVEC_DEPTH];
    load(nxt, nr, nb0);
    if (nr < 0) prefetch_l2(next);
#pragma unroll
    for (int j = 0; j < MATVEC_DEPTH; j++) {
      const int i = b0 + lane + 32 * j;
      if (i >= k8) continue;
      const float w0 = bf_lo(cur[j].x), w1 = bf_hi(cur[j].x), w2 = bf_lo(cur[j].y);
      const float w3 = bf_hi(cur[j].y), w4 = bf_lo(cur[j].z), w5 = bf_hi(cur[j].z);
      const float w6 = bf_lo(cur[j].w), w7 = bf_hi(cur[j].w);
#pragma unroll
      for (int b = 0; b < NB; b++) {
        if (b < nb) {
          const float4 a = *reinterpret_cast<const float4*>(xs + b * K + i * 4);
          const float4 c = *reinterpret_cast<const float4*>(xs + b * K + (K >> 1) + i * 4);
          acc[b] += w0 * a.x + w1 * a.y + w2 * a.z + w3 * a.w + w4 * c.x + w5 * c.y + w6 * c.z +
                    w7 * c.w;
        }
      }
    }
    if (nq != q) {  // the row is complete
#pragma unroll
      for (int b = 0; b < NB; b++)
        if (b < nb) acc[b] = warp_sum(acc[b]);
      const int t = warp_task(q, tasks, SPLIT);
      if (SPLIT > 1) {
        // two slots per pair, alternating by row: a slot is rewritten only after the pair has
        // met again, so after the even warp has read it
        float* slot = pair_sums + ((q & 1) * WARPS + (tid() >> 5) / 2) * MAX_B;
        if ((tid() >> 5) & 1) {
#pragma unroll
          for (int b = 0; b < NB; b++)
            if (lane == 0) slot[b] = acc[b];
        }
        pair_barrier();
        if (((tid() >> 5) & 1) == 0) {
#pragma unroll
          for (int b = 0; b < NB; b++)
            if (b < nb && lane == 0)
              emit(b, t, pair > 0 ? acc[b] : acc[b] + slot[b], pair > 0 ? slot[b] : 0.f);
        }
      } else {
#pragma unroll
        for (int b = 0; b < NB; b++)
          if (b < nb && lane == 0) emit(b, t, acc[b], 0.f);
      }
#pragma unroll
      for (int b = 0; b < NB; b++) acc[b] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < MATVEC_DEPTH; j++) cur[j] = nxt[j];
    q = nq;
    r = nr;
    b0 = nb0;
  }
}

template <int NB = MAX_B, typename Emit>
__device__ void matvec(const bf16_t* W, int rows, int K, const float* xs, int nb,
                       const FirstChunks& first, Emit emit, Prefetch next = Prefetch{nullptr, 0}) {
  matvec_tasks<1, NB>(
      W, rows, 0, K, xs, nb, first, [&](int b, int r, float v, float) { emit(b, r, v); }, nullptr,
      next);
}

// ---------------------------------------------------------------------------------------------
// transformer layer pieces

// Loads that skip L1: data other blocks wrote during this phase (L1 may hold an older copy).
__device__ __forceinline__ float ld_l2(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

// A warp's head vector (hd <= MAX_HEAD_DIM words; lane's elements lane + 32 j) once every word
// carries `tag`, all its loads in flight before the first wait. Every element is set (0 past
// hd): a conditionally set one would count as live from the kernel's entry.
__device__ __forceinline__ void await_head(const u64* src, int hd, u32 tag,
                                           float (&out)[HEAD_REGS]) {
  const int lane = tid() & 31;
  u64 w[HEAD_REGS];
#pragma unroll
  for (int j = 0; j < HEAD_REGS; j++)
    w[j] = lane + 32 * j < hd ? ld_word(src + lane + 32 * j) : 0ull;
#pragma unroll
  for (int j = 0; j < HEAD_REGS; j++) {
    const int i = lane + 32 * j;
    out[j] = 0.f;
    if (i < hd) {
      while ((u32)(w[j] >> 32) != tag) w[j] = ld_word(src + i);
      out[j] = word_value(w[j]);
    }
  }
}

// Attention runs in blocks of one (sequence, kv head, chunk of attention_chunk positions); with
// attention_chunk 0 a sequence's positions are one chunk. `chunks` is the same for every
// sequence of a phase: enough for the longest (the others' last chunks are empty). The code
// predictor's passes (at most 16 positions) always run one chunk, so that a (sequence, kv head)
// keeps one block and its cache rows never cross blocks within a launch.
// Per (sequence, kv head, chunk): q/k RMSNorm, RoPE, the KV append (by the chunk holding pos;
// warp 0 rotates and appends K, warps 1..group its q heads, the next warp appends V), then the
// group's q heads attend over the chunk's positions. Each warp takes every WARPS-th
// position for HEADS_PER_PASS q heads at once (one K and V load serves them all) and loads the
// next position's K and V before computing on the current one, so a warp's loads overlap instead
// of chaining. The warps' partial softmax states are merged in a fixed order; with several
// chunks, each writes its merged state to attn_part and the last of them to finish merges the
// chunks in chunk order.
// With `back` 1, sequence b's word rows are b + nb, at pos_of[b] - 1 (the fused first predictor
// pass's earlier rows).
__device__ void attention(const Params& p, const Stack& s, int layer, int nb, const int* cache_idx,
                          const int* pos_of, int back, float* work, int chunks, u32 t_qkv,
                          u32 t_attn) {
  const int hd = s.head_dim, half = hd / 2, gs = s.n_heads / s.n_kv;
  const int hd_log = 31 - __clz(hd);  // (head_dim is a power of two: src/weights.rs)
  const int q_width = s.n_heads * hd, kv_width = s.n_kv * hd;
  const int warp = tid() >> 5, lane = tid() & 31;
  float* vec = work;                             // [gs + 1][hd]: k, then the group's q heads
  float* wm = vec + (gs + 1) * hd;               // [HEADS_PER_PASS][WARPS]
  float* wl = wm + HEADS_PER_PASS * WARPS;       // [HEADS_PER_PASS][WARPS]
  float* wacc = wl + HEADS_PER_PASS * WARPS;     // [HEADS_PER_PASS][WARPS][hd]
  int* last = reinterpret_cast<int*>(wacc + HEADS_PER_PASS * WARPS * hd);  // [1]
  float* wf = reinterpret_cast<float*>(last + 1);  // [HEADS_PER_PASS][WARPS + 1] (SOLO)
  for (int task = bid(); task < nb * s.n_kv * chunks; task += gridDim.x) {
    const int b = task / (s.n_kv * chunks), g = task / chunks % s.n_kv, c = task % chunks;
    const int row = b + back * nb, pos = pos_of[b] - back;
    const int first = c * p.attention_chunk;  // 0 when attention_chunk is
    const int chunk_end = first + p.attention_chunk - 1;
    const int end = chunks > 1 && chunk_end < pos ? chunk_end : pos;
    const u64* qkv = p.qkv + (size_t)row * p.max_qkv;
    // the chunk holding pos appends its K and V (with one chunk, pos may lie past the chunk size)
    const int own_chunk = chunks == 1 ? 0 : pos / p.attention_chunk;
    const size_t head_base = (((size_t)cache_idx[b] * s.n_layers + layer) * s.n_kv + g) * s.max_len;
    float* kc = s.k_cache + head_base * hd;
    float* vc = s.v_cache + head_base * hd;
    const LayerW& lw = s.layers[layer];
    // A warp's first position: its K and V rows, when appended by an earlier phase, do not depend
    // on this one's words, so their round trip goes out before the wait and overlaps it.
    const int t0 = first + warp;
    float k_next[HEAD_REGS] = {}, v_next[HEAD_REGS] = {};
    auto load_kv = [&](int t) {
#pragma unroll
      for (int j = 0; j < HEAD_REGS; j++) {
        const int i = lane + 32 * j;
        if (i < hd) {
          k_next[j] = kc[(size_t)t * hd + i];
          v_next[j] = vc[(size_t)t * hd + i];
        }
      }
    };
    if (t0 < pos && t0 <= end) load_kv(t0);
    if (warp <= gs) {
      // the rotation's loads go out with the row's, not after it
      const float2* rope = s.rope + pos * half;
      float2 rot[HEAD_REGS / 2];
#pragma unroll
      for (int j = 0; j < HEAD_REGS / 2; j++) {
        const int i = lane + 32 * j;
        rot[j] = i < half ? rope[i] : make_float2(1.f, 0.f);
      }
      const u64* src = warp == 0 ? qkv + q_width + g * hd : qkv + (g * gs + warp - 1) * hd;
      const bf16_t* nw = warp == 0 ? lw.k_norm : lw.q_norm;
      float nwv[HEAD_REGS];  // the norm's weights: loaded before the wait, as the rotation
#pragma unroll
      for (int j = 0; j < HEAD_REGS; j++) {
        const int i = lane + 32 * j;
        nwv[j] = i < hd ? bf2f(nw[i]) : 0.f;
      }
      float xv[HEAD_REGS];
      await_head(src, hd, t_qkv, xv);
      float ss = 0.f;
#pragma unroll
      for (int j = 0; j < HEAD_REGS; j++) ss += xv[j] * xv[j];
      ss = warp_sum(ss);
      const float r = rsqrtf(ss / (float)hd + s.eps);
      float* v = vec + warp * hd;
#pragma unroll
      for (int j = 0; j < HEAD_REGS; j++) {
        const int i = lane + 32 * j;
        if (i < hd) v[i] = nwv[j] * (xv[j] * r);
      }
      __syncwarp();
#pragma unroll
      for (int j = 0; j < HEAD_REGS / 2; j++) {
        const int i = lane + 32 * j;
        if (i < half) {
          const float cs = rot[j].x, sn = rot[j].y;
          const float a = v[i], c = v[i + half];
          const float lo = a * cs - c * sn, hi = c * cs + a * sn;
          v[i] = lo;
          v[i + half] = hi;
        }
      }
      __syncwarp();
      if (warp == 0 && c == own_chunk)
        for (int i = lane; i < hd; i += 32) kc[(size_t)pos * hd + i] = v[i];
    } else if (warp == gs + 1 && c == own_chunk) {
      // the V append, straight from the words, on a warp of its own: its loads go out with the
      // k and q heads' instead of after k's (the host checks gs + 2 <= WARPS)
      float vv[HEAD_REGS];
      await_head(qkv + q_width + kv_width + g * hd, hd, t_qkv, vv);
#pragma unroll
      for (int j = 0; j < HEAD_REGS; j++)
        if (lane + 32 * j < hd) vc[(size_t)pos * hd + lane + 32 * j] = vv[j];
    }
    __syncthreads();
    if (task == bid()) inputs_arrived(p);
    for (int q0 = 0; q0 < gs; q0 += HEADS_PER_PASS) {
      const int nq = gs - q0 < HEADS_PER_PASS ? gs - q0 : HEADS_PER_PASS;
      float m[HEADS_PER_PASS], l[HEADS_PER_PASS], acc[HEADS_PER_PASS][HEAD_REGS];
#pragma unroll
      for (int qi = 0; qi < HEADS_PER_PASS; qi++) {
        m[qi] = NEG_INF;
        l[qi] = 0.f;
#pragma unroll
        for (int j = 0; j < HEAD_REGS; j++) acc[qi][j] = 0.f;
      }
      const float scale = rsqrtf((float)hd);
      if (t0 <= end && (t0 >= pos || q0 > 0)) load_kv(t0);
      for (int t = first + warp; t <= end; t += WARPS) {
        float kt[HEAD_REGS], vt[HEAD_REGS];
#pragma unroll
        for (int j = 0; j < HEAD_REGS; j++) {
          kt[j] = k_next[j];
          vt[j] = v_next[j];
        }
        if (t + WARPS <= end) load_kv(t + WARPS);
#pragma unroll
        for (int qi = 0; qi < HEADS_PER_PASS; qi++) {
          if (qi >= nq) continue;
          const float* q = vec + (q0 + qi + 1) * hd;
          float d = 0.f;
#pragma unroll
          for (int j = 0; j < HEAD_REGS; j++)
            if (lane + 32 * j < hd) d += q[lane + 32 * j] * kt[j];
          const float sc = warp_sum(d) * scale;
          const float m_new = fmaxf(m[qi], sc);
          const float corr = expf(m[qi] - m_new), pw = expf(sc - m_new);
          l[qi] = l[qi] * corr + pw;
#pragma unroll
          for (int j = 0; j < HEAD_REGS; j++)
            if (lane + 32 * j < hd) acc[qi][j] = acc[qi][j] * corr + pw * vt[j];
          m[qi] = m_new;
        }
      }
#pragma unroll
      for (int qi = 0; qi < HEADS_PER_PASS; qi++) {
        if (qi >= nq) continue;
        if (lane == 0) {
          wm[qi * WARPS + warp] = m[qi];
          wl[qi * WARPS + warp] = l[qi];
        }
#pragma unroll
        for (int j = 0; j < HEAD_REGS; j++) {
          const int i = lane + 32 * j;
          if (i < hd) wacc[(qi * WARPS + warp) * hd + i] = acc[qi][j];
        }
      }
      __syncthreads();
#if SOLO
      // The merge factors exp(m_w - max), once per (q head, warp state) instead of in every
      // output thread, behind one more barrier. A warp state without positions gets 0, which adds
      // exact zeros to the sums: the outputs are those of the full build's merge, bit for bit.
      // (In the full build this form made launches of 4 slower.)
      if (tid() < nq * WARPS) {
        const int qi = tid() / WARPS, w = tid() % WARPS;
        float big = NEG_INF;
        for (int k = 0; k < WARPS; k++) big = fmaxf(big, wm[qi * WARPS + k]);
        wf[qi * (WARPS + 1) + w] = wl[qi * WARPS + w] > 0.f ? expf(wm[qi * WARPS + w] - big) : 0.f;
        if (w == 0) wf[qi * (WARPS + 1) + WARPS] = big;
      }
      __syncthreads();
#endif
      for (int e = tid(); e < nq * hd; e += THREADS) {
        const int qi = e >> hd_log, i = e & (hd - 1);
        const float* ql = wl + qi * WARPS;
        float denom = 0.f, num = 0.f;
#if SOLO
        const float* qf = wf + qi * (WARPS + 1);
        const float big = qf[WARPS];
#pragma unroll 4  // (fully unrolled, its loads spill registers)
        for (int w = 0; w < WARPS; w++) {
          denom += ql[w] * qf[w];
          num += wacc[(qi * WARPS + w) * hd + i] * qf[w];
        }
#else
        const float* qm = wm + qi * WARPS;
        float big = NEG_INF;
        for (int w = 0; w < WARPS; w++) big = fmaxf(big, qm[w]);
        // (one exp per warp state, shared by both sums: the merge is on the attention's critical
        // path, and the exp calls were most of it)
        for (int w = 0; w < WARPS; w++) {
          if (ql[w] > 0.f) {
            const float f = expf(qm[w] - big);
            denom += ql[w] * f;
            num += wacc[(qi * WARPS + w) * hd + i] * f;
          }
        }
#endif
        const int head = g * gs + q0 + qi;
        if (chunks == 1) {
          publish(p.attn + (size_t)row * p.max_q + head * hd + i, num / denom, t_attn);
        } else {
          // [hd] unnormalised output, then the chunk's max score and softmax denominator
          float* part = p.attn_part + (size_t)b * p.attn_part_stride +
                        (size_t)(head * chunks + c) * (hd + 2);
          part[i] = num;
          if (i == 0) {
            part[hd] = big;
            part[hd + 1] = denom;
          }
        }
      }
      __syncthreads();
    }
    if (chunks > 1) {
      // publish this chunk's states; the last chunk of (b, g) to get here merges all of them. One
      // acquire-release count by thread 0 orders them: the barrier before it puts the block's
      // stores before its release, and the barrier after it puts its acquire of the other chunks'
      // states before the merge's loads (which skip L1). A fence in every thread would cost more.
      __syncthreads();
      if (tid() == 0) {
        u32* done = p.attn_count + b * s.n_kv + g;
        *last = count_acq_rel(done, (u32)chunks) == (u32)(chunks - 1);
      }
      __syncthreads();
      if (*last) {
        for (int e = tid(); e < gs * hd; e += THREADS) {
          const int head = g * gs + (e >> hd_log), i = e & (hd - 1);
          const float* part =
              p.attn_part + (size_t)b * p.attn_part_stride + (size_t)head * chunks * (hd + 2);
          float big = NEG_INF;
          for (int k = 0; k < chunks; k++) big = fmaxf(big, ld_l2(part + k * (hd + 2) + hd));
          float denom = 0.f, num = 0.f;
          for (int k = 0; k < chunks; k++) {
            const float f = expf(ld_l2(part + k * (hd + 2) + hd) - big);
            denom += ld_l2(part + k * (hd + 2) + hd + 1) * f;
            num += ld_l2(part + k * (hd + 2) + i) * f;
          }
          publish(p.attn + (size_t)row * p.max_q + head * hd + i, num / denom, t_attn);
        }
      }
      __syncthreads();
    }
  }
}

// A product added to the residual stream (o projection, down): the blocks owning residual rows
// collect the input words (K per sequence, row stride `stride`, tag `tag_in`) and publish
// x + W . input as the x words of buffer 0 at exchange `ex_out`.
template <int NB>
__device__ void residual_product(const Params& p, int H, const bf16_t* W, int K, const u64* in,
                                 int stride, u32 tag_in, int nb, const FirstChunks& first,
                                 int ex_out, Prefetch next) {
  float* xs = sm_xs();
  const float* xr = sm_xr(p);
  if (has_rows(H)) {
    collect<true>(in, stride, nb, K, tag_in, xs, second_batch_of(W, H, K, 2));
    __syncthreads();
    inputs_arrived(p);
  }
  matvec_tasks<2, NB>(
      W, H, 0, K, xs, nb, first,
      [&](int b, int r, float v, float) {
        publish(x_buffer(p, 0) + (size_t)b * p.max_hidden + r, xr[b * H + r] + v,
                tag_of(p, ex_out));
      },
      sm_work(p), next);
}

// Whether the first predictor pass also takes the second's rows (codebook 0's embedding at
// position 1 beside past_hidden at 0): one pass of 2 nb rows instead of two passes of nb, where
// the rows fit.
__device__ __forceinline__ bool fused_first_pass(const Params& p) { return 2 * p.batch <= MAX_B; }

// Predictor pass `step` is the fused first pass (pass 1, with pass 0's rows).
__device__ __forceinline__ bool is_fused_pass(const Params& p, int step) {
  return step == 1 && fused_first_pass(p);
}

// One decoder layer for nb single-token rows from the input x `in`; its exchanges are numbered
// from `ex` (LX_*), its output is the x words of buffer 0 at ex + LX_DOWN. `step` is the
// predictor pass, or -1 for the talker. Each matvec's first weights are loaded before its
// inputs are awaited (`first_qkv`: by the layer before; the next layer's are returned). `xr`
// ([nb][H], shared) holds the block's copy of the raw x rows: the blocks owning residual rows
// (those with o and down rows, the same rows) add their products to it.
template <int NB>
__device__ FirstChunks layer_step(const Params& p, const Stack& s, int step, int layer, int nb,
                                  const int* cache_idx, const int* pos_of, int in, int ex,
                                  FirstChunks first_qkv) {
  float* xs = sm_xs();
  float* xr = sm_xr(p);
  const int stack = step < 0 ? PH_TALKER : 0;  // profile tag
  const int chunks = step < 0 ? p.talker_chunks : 1;
  const LayerW& lw = s.layers[layer];
  const int H = s.hidden, qw = s.n_heads * s.head_dim, inter = s.inter, rows = s.qkv_rows();
  // (the blocks owning residual rows are among those with q|k|v and gate|up rows: the host
  // checks rows >= H and inter >= H, so they have xr for their residual products)

  // input norm, q|k|v
  if (has_rows(rows))
    collect_x_norm(p, in, nb, H, lw.in_norm, s.eps, xr, xs, second_batch_of(lw.qkv, rows, H));
  matvec<NB>(
      lw.qkv, rows, H, xs, nb, first_qkv,
      [&](int b, int r, float v) {
        publish(p.qkv + (size_t)b * p.max_qkv + r, v, tag_of(p, ex + LX_QKV));
      },
      prefetch_of(lw.o, H, qw, 2));
  end_phase(p, stack | PH_QKV);

  // The fused first pass: a (sequence, kv head) block appends and attends position 0, then 1,
  // which reads the K and V the block has just appended.
  const int seqs = is_fused_pass(p, step) ? nb / 2 : nb;
  for (int back = seqs < nb; back >= 0; back--)
    attention(p, s, layer, seqs, cache_idx, pos_of, back, sm_work(p), chunks,
              tag_of(p, ex + LX_QKV), tag_of(p, ex + LX_ATTN));
  end_phase(p, stack | PH_ATTENTION);

  FirstChunks first = first_chunks(lw.o, H, qw, 2);
  residual_product<NB>(p, H, lw.o, qw, p.attn, p.max_q, tag_of(p, ex + LX_ATTN), nb, first,
                       ex + LX_O, prefetch_of(lw.gate_up, inter, H, 2, inter));
  end_phase(p, stack | PH_O);

  // post-attention norm, gate and up rows in pairs: SiLU(gate) * up
  first = first_chunks(lw.gate_up, inter, H, 2, inter);
  if (has_rows(inter))
    collect_x_norm(p, x_words(0, ex + LX_O), nb, H, lw.post_norm, s.eps, xr, xs,
                   second_batch_of(lw.gate_up, inter, H, 2, inter));
  matvec_tasks<2, NB>(
      lw.gate_up, inter, inter, H, xs, nb, first,
      [&](int b, int t, float gt, float up) {
        publish(p.act + (size_t)b * p.max_inter + t, gt / (1.f + expf(-gt)) * up,
                tag_of(p, ex + LX_ACT));
      },
      sm_work(p), prefetch_of(lw.down, H, inter, 2));
  end_phase(p, stack | PH_GATE_UP);

  first = first_chunks(lw.down, H, inter, 2);
  residual_product<NB>(p, H, lw.down, inter, p.act, p.max_inter, tag_of(p, ex + LX_ACT), nb,
                       first, ex + LX_DOWN,
                       layer + 1 < s.n_layers ? prefetch_of(s.layers[layer + 1].qkv, rows, H)
                                              : Prefetch{nullptr, 0});
  end_phase(p, stack | PH_DOWN);
  if (layer + 1 < s.n_layers) first = first_chunks(s.layers[layer + 1].qkv, rows, H);
  return first;
}

// Every layer of a stack; the first reads `in`, the exchanges are numbered from `ex`.
template <int NB>
__device__ void stack_step(const Params& p, const Stack& s, int step, int nb, const int* cache_idx,
                           const int* pos_of, int in, int ex) {
  FirstChunks first_qkv = first_chunks(s.layers[0].qkv, s.qkv_rows(), s.hidden);
  for (int layer = 0; layer < s.n_layers; layer++) {
    const int lx = ex + LAYER_EXCHANGES * layer;
    first_qkv = layer_step<NB>(p, s, step, layer, nb, cache_idx, pos_of,
                               layer == 0 ? in : x_words(0, lx - LAYER_EXCHANGES + LX_DOWN), lx,
                               first_qkv);
  }
}

// ---------------------------------------------------------------------------------------------
// sampling (one block per sequence)

__device__ __forceinline__ u32 ordered_key(float v) {
  const u32 u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Philox4x32-10: a counter-based stream, so every (sequence, frame, group, index) has its own
// reproducible uniform.
__device__ uint4 philox(uint4 c, u32 k0, u32 k1) {
#pragma unroll
  for (int i = 0; i < 10; i++) {
    const u32 hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const u32 hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

// The block's largest value (lowest index on ties) from each thread's best candidate (`redf`
// holds WARPS words, `redi` WARPS + 1).
__device__ int block_argmax_of(float best, int bi, float* redf, int* redi) {
  const int warp = tid() >> 5, lane = tid() & 31;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (ob > best || (ob == best && oi < bi)) {
      best = ob;
      bi = oi;
    }
  }
  if (lane == 0) {
    redf[warp] = best;
    redi[warp] = bi;
  }
  __syncthreads();
  if (warp == 0) {
    // (largest, then lowest index: a total order, so the reduction's order does not matter)
    best = lane < WARPS ? redf[lane] : NEG_INF;
    bi = lane < WARPS ? redi[lane] : 0x7fffffff;
#pragma unroll
    for (int o = WARPS / 2; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ob > best || (ob == best && oi < bi)) {
        best = ob;
        bi = oi;
      }
    }
    if (lane == 0) redi[WARPS] = bi;
  }
  __syncthreads();
  bi = redi[WARPS];
  return bi == 0x7fffffff ? 0 : bi;
}

// Returns the index of the largest key (lowest index on ties), over n values in shared memory.
__device__ int block_argmax(const float* v, int n, float* redf, int* redi) {
  float best = NEG_INF;
  int bi = 0x7fffffff;
  for (int i = tid(); i < n; i += THREADS) {
    const float x = v[i];
    if (x > best || (x == best && i < bi)) {
      best = x;
      bi = i;
    }
  }
  return block_argmax_of(best, bi, redf, redi);
}

// The k-th largest value's ordered key (radix select, 8 bits per round). Logits mostly share
// their high bits, so one shared-memory atomic per element would serialise on a single bin:
// the lanes of a warp that fall in the same bin add once, with their count. Warp 0 then finds
// the digit holding the k-th key with a scan over the histogram from the highest digit down,
// and zeroes the bins it has read for the next round. Once at most 32 keys share the prefix
// found so far (after two rounds, mostly), one warp ranks them instead of the remaining rounds.
// `hist` is zero on entry (the caller clears it before the barrier that follows its logits);
// `state` holds 4 words.
__device__ u32 kth_largest_key(const float* v, int n, int k, u32* hist, u32* state) {
  const int lane = tid() & 31;
  u32 prefix = 0, mask = 0;
  int remaining = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int base = tid() - lane; base < n; base += THREADS) {
      const int i = base + lane;
      u32 bin = 256;  // not counted this round
      if (i < n) {
        const u32 key = ordered_key(v[i]);
        if ((key & mask) == prefix) bin = (key >> shift) & 255u;
      }
      const u32 same = __match_any_sync(0xffffffffu, bin);
      if (bin < 256 && lane == __ffs(same) - 1) atomicAdd(&hist[bin], (u32)__popc(same));
    }
    __syncthreads();
    if (tid() < 32) {
      // lane l owns the 8 digits from 255 - 8l down; lane 0 the highest
      const int top = 255 - 8 * lane;
      u32 own = 0;
#pragma unroll
      for (int d = 0; d < 8; d++) own += hist[top - d];
      u32 incl = own;  // keys in the digits of lanes 0..lane
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const u32 up = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += up;
      }
      const u32 above = incl - own;
      if (above < (u32)remaining && incl >= (u32)remaining) {
        u32 cum = above;
        int digit = top - 7;
        for (int d = 0; d < 8; d++) {
          if (cum + hist[top - d] >= (u32)remaining) {
            digit = top - d;
            break;
          }
          cum += hist[top - d];
        }
        state[0] = (u32)digit;
        state[1] = (u32)(remaining - (int)cum);
        state[2] = hist[digit];
      }
      if (lane == 0) state[3] = 0;
#pragma unroll
      for (int d = 0; d < 8; d++) hist[top - d] = 0;
    }
    __syncthreads();
    prefix |= state[0] << shift;
    mask |= 255u << shift;
    remaining = (int)state[1];
    const u32 in_bin = state[2];
    // the next round's state is written after the barrier that follows its histogram (or the
    // gather below), which every thread passes after these reads
    if (shift > 0 && in_bin <= 32) {
      // the keys with this prefix, gathered into the (now zero) first bins: the caller clears
      // them before the histogram's next use
      u32* cand = hist;
      for (int i = tid(); i < n; i += THREADS) {
        const u32 key = ordered_key(v[i]);
        if ((key & mask) == prefix) cand[atomicAdd(&state[3], 1u)] = key;
      }
      __syncthreads();
      if (tid() < 32) {
        // the remaining-th largest of them: the key with fewer larger ones than that, and
        // at least that many larger or equal
        const u32 key = lane < (int)in_bin ? cand[lane] : 0u;
        int larger = 0, equal = 0;
        for (int j = 0; j < (int)in_bin; j++) {
          const u32 other = __shfl_sync(0xffffffffu, key, j);
          larger += other > key;
          equal += other == key;
        }
        if (lane < (int)in_bin && larger < remaining && larger + equal >= remaining) state[0] = key;
      }
      __syncthreads();
      return state[0];
    }
  }
  return prefix;
}

// HF TopPLogitsWarper, computed as the CPU reference computes it (voxkernel-core sampling.rs
// `top_p_filter`): the candidates (finite, ordered key >= the top-k threshold) sorted by value,
// ties by index, ascending; their softmax in f32, exp(value - max) summed in that order; then a
// running sum of the probabilities in that order, and a candidate goes while the sum up to it is
// <= 1 - top_p, except the last (most likely) one. Both sums run on one thread, in the
// reference's order, so the f32 results are the reference's. exp is evaluated in double and
// rounded to f32 (what glibc's expf, which the reference calls, rounds to, bar rare last-bit
// cases). `scratch` holds 2n words; `counts` WARPS words.
__device__ void top_p_filter(float* v, int n, u32 threshold, float top_p, u32* counts,
                             float* scratch) {
  int* cand = reinterpret_cast<int*>(scratch);        // [n] candidates in index order
  int* sorted = reinterpret_cast<int*>(scratch + n);  // [n] candidate of each rank
  const int warp = tid() >> 5, lane = tid() & 31;
  auto kept = [&](int i) { return v[i] != NEG_INF && ordered_key(v[i]) >= threshold; };
  // compaction in index order: each thread owns a contiguous range of indices
  const int per = (n + THREADS - 1) / THREADS;
  const int lo = min(n, tid() * per), hi = min(n, lo + per);
  int cnt = 0;
  for (int i = lo; i < hi; i++) cnt += kept(i);
  int incl = cnt;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int up = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += up;
  }
  if (lane == 31) counts[warp] = (u32)incl;
  __syncthreads();
  int at = incl - cnt, total = 0;
  for (int w = 0; w < WARPS; w++) {
    if (w < warp) at += (int)counts[w];
    total += (int)counts[w];
  }
  if (total == 0) return;  // nothing to keep (the same for every thread)
  for (int i = lo; i < hi; i++)
    if (kept(i)) cand[at++] = i;
  __syncthreads();
  for (int j = tid(); j < total; j += THREADS) {
    const int ij = cand[j];
    const u32 kj = ordered_key(v[ij]);
    int rank = 0;
    for (int q = 0; q < total; q++) {
      const u32 kq = ordered_key(v[cand[q]]);
      rank += kq < kj || (kq == kj && cand[q] < ij);
    }
    sorted[rank] = ij;
  }
  __syncthreads();
  float* e = scratch;  // over `cand`, read for the last time above
  const float top = v[sorted[total - 1]];
  for (int r = tid(); r < total; r += THREADS)
    e[r] = (float)exp((double)(v[sorted[r]] - top));
  __syncthreads();
  if (tid() == 0) {
    float sum = 0.f;
    for (int r = 0; r < total; r++) sum += e[r];
    const float limit = 1.f - top_p;
    float cumulative = 0.f;
    for (int r = 0; r + 1 < total; r++) {
      cumulative += e[r] / sum;
      if (cumulative <= limit) v[sorted[r]] = NEG_INF;
    }
  }
  __syncthreads();
}

// Top-k, top-p, then a categorical draw (Gumbel-max over the kept logits: each has its own
// uniform per (index, stream)), or argmax. `v` holds the processed logits in shared memory,
// already divided by the temperature when sampling, and top-p overwrites it; `hist` has
// HIST_WORDS words, its 256 bins zero, and `scratch` 2n (top-p only).
__device__ int sample_logits(const Params& p, float* v, int n, const Sampler& sp, u32 seed_lo,
                             u32 seed_hi, u32 stream_a, u32 stream_b, float* redf, int* redi,
                             u32* hist, float* scratch) {
  // (a predictor pass's stream_b is its group, 1..15; the talker's is 0)
  const bool mark = stream_b != 0 && p.marks && bid() == 0 && tid() == 0;
  if (!sp.do_sample) return block_argmax(v, n, redf, redi);
  u32 threshold = 0;
  if (sp.top_k > 0 && sp.top_k < n) threshold = kth_largest_key(v, n, sp.top_k, hist, hist + 256);
  if (mark) record_mark(p.marks, p.max_marks, PH_SELECT);
  if (sp.top_p < 1.f) top_p_filter(v, n, threshold, sp.top_p, hist, scratch);
  float best = NEG_INF;
  int bi = 0x7fffffff;
  for (int i = tid(); i < n; i += THREADS) {
    const float x = v[i];
    // a dropped logit counts as -inf (a kept one plus its noise is finite); the noise is drawn
    // for the kept ones only
    float y = NEG_INF;
    if (ordered_key(x) >= threshold && x != NEG_INF) {
      const uint4 r = philox(make_uint4((u32)i, stream_a, stream_b, 0x766f78u), seed_lo, seed_hi);
      const float u = ((float)(r.x >> 8) + 0.5f) * (1.0f / 16777216.0f);
      y = x - logf(-logf(u));
    }
    if (y > best || (y == best && i < bi)) {
      best = y;
      bi = i;
    }
  }
  if (mark) record_mark(p.marks, p.max_marks, PH_DRAW);
  const int drawn = block_argmax_of(best, bi, redf, redi);
  if (mark) record_mark(p.marks, p.max_marks, PH_ARGMAX);
  return drawn;
}

// The sampling area of `work`: the logits (n), then the radix histogram, cleared here (before the
// barrier that follows the logits' arrival) for kth_largest_key.
__device__ __forceinline__ u32* clear_histogram(float* work, int n) {
  u32* hist = reinterpret_cast<u32*>(work + n);
  for (int i = tid(); i < 256; i += THREADS) hist[i] = 0;
  return hist;
}

// ---------------------------------------------------------------------------------------------
// phases

// Row stride of the logits words.
__device__ __forceinline__ int logits_stride(const Params& p) {
  return p.vocab > p.cp_vocab ? p.vocab : p.cp_vocab;
}

// Talker codebook-0 processors in the official order (repetition penalty over the previous
// codebook-0 ids, min 2 new tokens before EOS, suppression of 2048..3071 except EOS), then sample.
// In a frame launch the frame's codebook 0 joins the history first.
__device__ int sample_talker(const Params& p, int b, u32 t_logits, float* work, float* redf,
                             int* redi) {
  const int slot = p.slot[b], V = p.vocab;
  unsigned char* seen = p.seen + (size_t)slot * V;
  const Sampler& sp = p.talker_sampler[b];
  float* v = work;
  if (p.mode == MODE_FRAME && tid() == 0) seen[p.c0[b]] = 1;
  u32* hist = clear_histogram(work, V);
  collect_flat(p.logits + (size_t)b * logits_stride(p), V, 1, V, t_logits, v);
  __syncthreads();  // (also orders seen[c0] before its reader)
  inputs_arrived(p);
  for (int i = tid(); i < V; i += THREADS) {
    float x = v[i];
    if (seen[i]) x = x < 0.f ? x * sp.repetition_penalty : x / sp.repetition_penalty;
    if (i == p.eos_id && p.n_sampled[b] < 2) x = NEG_INF;
    if (i >= V - 1024 && i != p.eos_id) x = NEG_INF;
    v[i] = sp.do_sample ? x / sp.temperature : x;
  }
  __syncthreads();
  return sample_logits(p, v, V, sp, p.seed_lo[b], p.seed_hi[b], (u32)p.n_sampled[b], 0u, redf,
                       redi, hist, work + V + HIST_WORDS);
}

__device__ int sample_sub(const Params& p, int b, int group, u32 t_logits, float* work,
                          float* redf, int* redi) {
  const int V = p.cp_vocab;
  const Sampler& sp = p.sub_sampler[b];
  float* v = work;
  u32* hist = clear_histogram(work, V);
  collect_flat(p.logits + (size_t)b * logits_stride(p), V, 1, V, t_logits, v);
  // the temperature: each thread divides the logits it collected itself (collect's pairs), before
  // the barrier
  if (sp.do_sample)
    for (int k = tid(); 2 * k < V; k += THREADS) {
      v[2 * k] = v[2 * k] / sp.temperature;
      v[2 * k + 1] = v[2 * k + 1] / sp.temperature;
    }
  __syncthreads();
  inputs_arrived(p);
  return sample_logits(p, v, V, sp, p.seed_lo[b], p.seed_hi[b], (u32)p.n_sampled[b], (u32)group,
                       redf, redi, hist, work + V + HIST_WORDS);
}

// With a small_to_mtp_projection, the code predictor's input x is the projection of the
// (talker-width) input `in`, x words of buffer 1 at exchange `ex`; without one, `in` itself.
__device__ int cp_input(const Params& p, int nb, int in, int ex) {
  if (!p.proj_w) return in;
  const int H = p.talker.hidden, rows = p.cp.hidden;
  const bf16_t* bias = p.proj_b;
  const FirstChunks first = first_chunks(p.proj_w, rows, H);
  float* xs = sm_xs();
  if (has_rows(rows)) {
    collect_x(p, in, nb, H, xs);
    inputs_arrived(p);
  }
  matvec(p.proj_w, rows, H, xs, nb, first, [&](int b, int r, float v) {
    publish(x_buffer(p, 1) + (size_t)b * p.max_hidden + r, v + bf2f(bias[r]), tag_of(p, ex));
  });
  end_phase(p, PH_INPUT);
  return x_words(1, ex);
}

__device__ __forceinline__ const bf16_t* cp_embedding_row(const Params& p, int table, int code) {
  const int H = p.talker.hidden;
  return p.cp_embedding + ((size_t)table * p.cp_vocab + code) * H;
}

// Final RMSNorm of every sequence's x `in` (normed rows left in xs), then a head matvec into
// the logits words of exchange `ex`, and into copy_of[b] too when copy_of is given.
__device__ void norm_and_head(const Params& p, const Stack& s, const bf16_t* head, int vocab,
                              float* const* copy_of, int nb, int in, int ex) {
  const FirstChunks first = first_chunks(head, vocab, s.hidden);
  float* xs = sm_xs();
  if (has_rows(vocab)) collect_x_norm(p, in, nb, s.hidden, s.final_norm, s.eps, sm_xr(p), xs);
  const int stride = logits_stride(p);
  matvec<SEQ_B>(head, vocab, s.hidden, xs, nb, first, [&](int b, int r, float v) {
    publish(p.logits + (size_t)b * stride + r, v, tag_of(p, ex));
    if (copy_of) copy_of[b][r] = v;
  });
}

// x words of one sequence: a bf16 embedding row (the next predictor input).
__device__ void publish_row(u64* dst, const bf16_t* row, int n, u32 t) {
  for (int base = tid(); 2 * base < n; base += ROW_PAIRS_STEP) {
    float v[NORM_REGS];
    row_elements(row, n, base, v);
#pragma unroll
    for (int j = 0; j < NORM_REGS; j++)
      if (row_element(base, j) < n) publish(dst + row_element(base, j), v[j], t);
  }
}

// FRAME(codes) + the next trailing text row (the last trailing row is tts_pad): the talker's
// input x words of sequence b.
__device__ void frame_embedding(const Params& p, int b, u64* dst, u32 t) {
  const int H = p.talker.hidden;
  const int* codes = p.codes + b * CODE_WORDS;
  const int g = p.step[b];
  const int trow = g < p.trailing_len[b] - 1 ? g : p.trailing_len[b] - 1;
  const float* trailing = p.trailing + ((size_t)p.slot[b] * p.max_trailing + trow) * H;
  const bf16_t* c0row = p.codec_embedding + (size_t)codes[0] * H;
  for (int base = tid(); 2 * base < H; base += ROW_PAIRS_STEP) {
    float e[NORM_REGS], add[NORM_REGS];
    row_elements(c0row, H, base, e);
    for (int j = 1; j < p.groups; j++) {
      row_elements(cp_embedding_row(p, j - 1, codes[j]), H, base, add);
#pragma unroll
      for (int k = 0; k < NORM_REGS; k++) e[k] += add[k];
    }
    row_elements(trailing, H, base, add);
#pragma unroll
    for (int k = 0; k < NORM_REGS; k++)
      if (row_element(base, k) < H) publish(dst + row_element(base, k), e[k] + add[k], t);
  }
}

__device__ void code_predictor(const Params& p, int nb) {
  const Stack& s = p.cp;
  const int H = p.talker.hidden, max_hidden = p.max_hidden;
  const int layers_ex = LAYER_EXCHANGES * s.n_layers;
  int cache_idx[MAX_B], pos_of[MAX_B];
  for (int b = 0; b < MAX_B; b++) cache_idx[b] = b;
  // (a fused first pass is pass 1, with past_hidden's rows beside its own)
  for (int step = fused_first_pass(p) ? 1 : 0; step < p.groups; step++) {
    for (int b = 0; b < MAX_B; b++) pos_of[b] = step;
    const int ex = pass_exchange(p, step);
    const bool fused = is_fused_pass(p, step);
    const int in = step == 0 ? X_PAST
                   : fused   ? X_C0_PAST
                             : x_words(0, next_input_exchange(p, step - 1));
    const int rows = fused ? 2 * nb : nb;
    if (SOLO && !fused)  // (one call site in the full build: a second would be inlined too)
      stack_step<SEQ_B>(p, s, step, rows, cache_idx, pos_of, cp_input(p, rows, in, ex), ex + 1);
    else
      stack_step<MAX_B>(p, s, step, rows, cache_idx, pos_of, cp_input(p, rows, in, ex), ex + 1);
    const u32 t_out = tag_of(p, ex + layers_ex);  // the last layer's LX_DOWN
    const u32 t_next = tag_of(p, next_input_exchange(p, step));
    u64* next = x_buffer(p, 0);
    if (step == 0) {
      // The second input row is codebook 0's embedding. It still goes through the exchange,
      // written once the first pass's output is complete, so that no block starts the second
      // pass while another still reads the first's words.
      for (int b = bid(); b < nb; b += gridDim.x) {
        collect_flat(x_buffer(p, 0) + (size_t)b * max_hidden, max_hidden, 1, s.hidden, t_out,
                     sm_xr(p));
        __syncthreads();
        publish_row(next + (size_t)b * max_hidden, p.codec_embedding + (size_t)p.c0[b] * H, H,
                    t_next);
      }
      end_phase(p, PH_INPUT);
      continue;
    }
    norm_and_head(p, s, p.cp_heads + (size_t)(step - 1) * p.cp_vocab * s.hidden, p.cp_vocab,
                  nullptr, nb, x_words(0, ex + layers_ex), ex + 1 + layers_ex);
    end_phase(p, PH_HEAD);
    for (int b = bid(); b < nb; b += gridDim.x) {
      const int own = sample_sub(p, b, step, tag_of(p, ex + 1 + layers_ex), sm_work(p), sm_red(p),
                                 sm_redi(p));
      const int code = p.forced ? p.forced_codes[b][step] : own;
      if (tid() == 0) {
        p.codes[b * CODE_WORDS + step] = code;
        p.codes[b * CODE_WORDS + OWN + step] = own;
        if (step == 1) p.codes[b * CODE_WORDS] = p.c0[b];
      }
      // (every thread has the code: the sampler's shared memory is free once it returns)
      u64* dst = next + (size_t)b * max_hidden;
      if (step + 1 < p.groups) {
        publish_row(dst, cp_embedding_row(p, step - 1, code), H, t_next);
      } else {
        __syncthreads();  // frame_embedding reads the codes thread 0 wrote
        frame_embedding(p, b, dst, t_next);
      }
    }
    end_phase(p, PH_SAMPLE);
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) frame_kernel(const Params p) {
  if (p.marks && bid() == 0 && tid() == 0) record_mark(p.marks, p.max_marks, PH_START);
  const int nb = p.batch;
  const int H = p.talker.hidden;
  const int tx = talker_exchange(p), head_ex = tx + LAYER_EXCHANGES * p.talker.n_layers;

  int in = X_PLAIN;  // MODE_HEAD: Params::x holds each sequence's last talker row
  if (p.mode == MODE_FRAME) {
    code_predictor(p, nb);
    stack_step<SEQ_B>(p, p.talker, -1, nb, p.slot, p.pos,
                      x_words(0, next_input_exchange(p, p.groups - 1)), tx);
    in = x_words(0, head_ex - LAYER_EXCHANGES + LX_DOWN);
  }
  float* logits_of[MAX_B];
  for (int b = 0; b < MAX_B; b++)
    logits_of[b] = p.talker_logits + (size_t)(b < nb ? p.slot[b] : 0) * p.vocab;
  norm_and_head(p, p.talker, p.codec_head, p.vocab, logits_of, nb, in, head_ex);
  if (bid() == 0)
    for (int b = 0; b < nb; b++)
      for (int i = tid(); i < H; i += THREADS)
        p.past_hidden[(size_t)p.slot[b] * H + i] = sm_xs()[b * H + plane_index(i, H)];
  end_phase(p, PH_TALKER | PH_HEAD);
  for (int b = bid(); b < nb; b += gridDim.x) {
    const int own = sample_talker(p, b, tag_of(p, head_ex), sm_work(p), sm_red(p), sm_redi(p));
    const int c0 = p.forced ? p.forced_codes[b][16] : own;
    if (tid() == 0) {
      p.codes[b * CODE_WORDS + OWN + 16] = own;
      p.codes[b * CODE_WORDS + 16] = c0;
      p.codes[b * CODE_WORDS + 17] = c0 == p.eos_id;
    }
  }
  if (p.marks && bid() == 0 && tid() == 0) record_mark(p.marks, p.max_marks, PH_TALKER | PH_SAMPLE);
}
