// voxkernel frame megakernel (version 1.1: phases separated by grid-wide barriers).
//
// One cooperative launch advances up to MAX_B sequences by one audio frame:
//   code predictor (16 single-token passes: past_hidden, CE(c0), then 14 group embeddings),
//   sub-talker sampling, frame embedding + trailing text row, one talker step, codec head,
//   codebook-0 sampling. The same kernel in PREFILL mode runs one talker row per launch.
// Activations stay f32 (global scratch + shared memory); weights are bf16, streamed once.
// No toolkit headers: NVRTC compiles this file with nothing but its own builtins.

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned long long u64;

#define MAX_B 4
#define WARPS 16
#define THREADS (WARPS * 32)
#define MAX_HEAD_DIM 128
#define MODE_FRAME 0
#define MODE_PREFILL 1
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
#define PH_TALKER 16

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
  float* talker_logits;           // [slots][vocab]
  float* prefill_rows;            // [rows][H]
  float* x;                       // [MAX_B][max_hidden]
  float* qkv;                     // [MAX_B][max_qkv]
  float* attn;                    // [MAX_B][max_q]
  float* attn_part;               // [MAX_B][attn_part_stride]: partial attention of each chunk
  u32* attn_count;                // [MAX_B][max kv heads]: chunks done; zero between phases
  float* gate_up;                 // [MAX_B][2 * max_inter]
  float* cp_logits;               // [MAX_B][cp_vocab]
  int* codes;                     // [MAX_B][CODE_WORDS]
  u32* barrier;                   // zeroed by the host before every launch
  u64* marks;                     // null, or [max_marks][2]: profile marks (clock64, phase tag)
  int vocab, cp_vocab, groups, eos_id, max_trailing;
  int max_hidden, max_qkv, max_q, max_inter;
  int smem_x_floats;              // MAX_B * widest matvec input
  int mode, batch, prefill_row, prefill_last, forced;
  int max_marks;
  int attention_chunk;            // positions per attention block; 0 = all of a sequence's
  int attn_part_stride;           // floats of attn_part per sequence
  int talker_chunks;              // attention chunks of the talker step (its longest sequence)
  int slot[MAX_B];
  int pos[MAX_B];
  int step[MAX_B];
  int c0[MAX_B];
  int n_sampled[MAX_B];
  int trailing_len[MAX_B];
  u32 seed_lo[MAX_B];
  u32 seed_hi[MAX_B];
  Sampler talker_sampler[MAX_B];
  Sampler sub_sampler[MAX_B];
  int forced_codes[MAX_B][17];
};

// The host mirrors these structs (src/layout.rs); a size mismatch fails the compile.
static_assert(sizeof(Stack) == 72, "Stack layout changed: update src/layout.rs");
static_assert(sizeof(Params) == 952, "Params layout changed: update src/layout.rs");

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

__device__ __forceinline__ u32 ld_acquire(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
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

// Monotonic counter barrier: barrier n completes when the counter reaches n * gridDim.x.
// Co-residency of all blocks is guaranteed by the cooperative launch. The arrival is a release
// (it publishes the block's writes, ordered before it by __syncthreads) and the spin an acquire,
// which is all the ordering the phases need: no full fences. The counter is Params::barrier.
struct GridBarrier {
  u32 target;
  __device__ void sync(const Params& p, int phase) {
    arrive(p);
    wait(p, phase);
  }
  // sync() in two halves: between them a block may do work that reads nothing another block
  // writes in the phase (loading weights), which then overlaps the wait.
  __device__ void arrive(const Params& p) {
    target += gridDim.x;
    __syncthreads();
    if (tid() == 0)
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p.barrier) : "memory");
  }
  __device__ void wait(const Params& p, int phase) {
    if (tid() == 0)
      while (ld_acquire(p.barrier) < target) {
      }
    mark(p, phase);
    __syncthreads();
  }
  __device__ void mark(const Params& p, int phase) {
    if (p.marks && bid() == 0 && tid() == 0) record_mark(p.marks, p.max_marks, phase);
  }
};

__device__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  const int warp = tid() >> 5, lane = tid() & 31;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = 0.f;
#pragma unroll
  for (int i = 0; i < WARPS; i++) t += red[i];
  __syncthreads();
  return t;
}

// out[b][i] = rmsnorm(src[b]) * w, for every batch row, into shared memory (every block does
// this redundantly: cheaper than a barrier).
__device__ void rmsnorm_rows(const float* src, int src_stride, int n, const bf16_t* w, float eps,
                             int nb, float* out, float* red) {
  for (int b = 0; b < nb; b++) {
    const float* s = src + (size_t)b * src_stride;
    float ss = 0.f;
    for (int i = tid(); i < n; i += THREADS) ss += s[i] * s[i];
    const float total = block_sum(ss, red);
    const float r = rsqrtf(total / (float)n + eps);
    for (int i = tid(); i < n; i += THREADS) out[b * n + i] = bf2f(w[i]) * (s[i] * r);
  }
  __syncthreads();
}

__device__ void load_rows(const float* src, int src_stride, int n, int nb, float* out) {
  for (int b = 0; b < nb; b++)
    for (int i = tid(); i < n; i += THREADS) out[b * n + i] = src[(size_t)b * src_stride + i];
  __syncthreads();
}

// 16-byte weight chunks a lane loads before it uses the first.
#define MATVEC_DEPTH 4

// The first MATVEC_DEPTH chunks (per lane) of a warp's first row of a matvec. Weights depend on
// nothing, so a phase loads them between the arrival at the previous barrier and the wait for
// it: their memory round trip overlaps the wait instead of following it. Volatile keeps the
// loads there.
struct FirstChunks {
  uint4 w[MATVEC_DEPTH];
};

__device__ FirstChunks first_chunks(const bf16_t* W, int rows, int K) {
  FirstChunks f;
  const int r = bid() * WARPS + (tid() >> 5), lane = tid() & 31, k8 = K >> 3;
  const uint4* wr = reinterpret_cast<const uint4*>(W + (size_t)(r < rows ? r : 0) * K);
#pragma unroll
  for (int j = 0; j < MATVEC_DEPTH; j++) {
    f.w[j] = make_uint4(0u, 0u, 0u, 0u);
    if (r < rows && lane + 32 * j < k8)
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(f.w[j].x), "=r"(f.w[j].y), "=r"(f.w[j].z), "=r"(f.w[j].w)
                   : "l"(wr + lane + 32 * j));
  }
  return f;
}

// Every warp of the grid takes whole output rows: y[b][r] = W[r] . xs[b]. K must be a multiple
// of 8 (16-byte weight loads). A lane issues the loads of MATVEC_DEPTH chunks before it uses the
// first; the first batch of the warp's first row is `first` (first_chunks of the same W, rows,
// K). The sum runs over the chunks in order. `emit(b, r, value)` is called by lane 0.
template <typename Emit>
__device__ void matvec(const bf16_t* W, int rows, int K, const float* xs, int nb,
                       const FirstChunks& first, Emit emit) {
  const int warp = tid() >> 5, lane = tid() & 31;
  const int total_warps = gridDim.x * WARPS;
  const int k8 = K >> 3;
  float acc[MAX_B];
  // adds the chunks i0, i0 + 32, ... of one batch to acc
  auto consume = [&](const uint4* w, int i0) {
#pragma unroll
    for (int j = 0; j < MATVEC_DEPTH; j++) {
      const int i = i0 + 32 * j;
      if (i >= k8) continue;
      const float w0 = bf_lo(w[j].x), w1 = bf_hi(w[j].x), w2 = bf_lo(w[j].y), w3 = bf_hi(w[j].y);
      const float w4 = bf_lo(w[j].z), w5 = bf_hi(w[j].z), w6 = bf_lo(w[j].w), w7 = bf_hi(w[j].w);
#pragma unroll
      for (int b = 0; b < MAX_B; b++) {
        if (b < nb) {
          const float4* xv = reinterpret_cast<const float4*>(xs + b * K + i * 8);
          const float4 a = xv[0], c = xv[1];
          acc[b] += w0 * a.x + w1 * a.y + w2 * a.z + w3 * a.w + w4 * c.x + w5 * c.y + w6 * c.z +
                    w7 * c.w;
        }
      }
    }
  };
  // one row; its first batch is `first` for the warp's first row
  auto row = [&](int r, bool first_row) {
    const uint4* wr = reinterpret_cast<const uint4*>(W + (size_t)r * K);
#pragma unroll
    for (int b = 0; b < MAX_B; b++) acc[b] = 0.f;
    int i0 = lane;
    if (first_row) {
      consume(first.w, i0);
      i0 += 32 * MATVEC_DEPTH;
    }
    for (; i0 < k8; i0 += 32 * MATVEC_DEPTH) {
      uint4 w[MATVEC_DEPTH];
#pragma unroll
      for (int j = 0; j < MATVEC_DEPTH; j++)
        if (i0 + 32 * j < k8) w[j] = ld_weights(wr + i0 + 32 * j);
      consume(w, i0);
    }
#pragma unroll
    for (int b = 0; b < MAX_B; b++) {
      if (b < nb) {
        const float v = warp_sum(acc[b]);
        if (lane == 0) emit(b, r, v);
      }
    }
  };
  int r = bid() * WARPS + warp;
  if (r < rows) row(r, true);
  for (r += total_warps; r < rows; r += total_warps) row(r, false);
}

// What every phase function needs to synchronise with the rest of the grid.
struct Launch {
  GridBarrier bar;
};

// ---------------------------------------------------------------------------------------------
// transformer layer pieces

// Loads that skip L1: data other blocks wrote during this phase (L1 may hold an older copy).
__device__ __forceinline__ float ld_l2(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

// Attention runs in blocks of one (sequence, kv head, chunk of attention_chunk positions); with
// attention_chunk 0 a sequence's positions are one chunk. `chunks` is the same for every
// sequence of a phase: enough for the longest (the others' last chunks are empty).
__device__ __forceinline__ int attention_chunks(const Params& p, int pos) {
  return p.attention_chunk > 0 ? pos / p.attention_chunk + 1 : 1;
}

// Per (sequence, kv head, chunk): q/k RMSNorm, RoPE, the KV append (by the chunk holding pos),
// then the group's q heads attend over the chunk's positions. Each warp takes every WARPS-th
// position for HEADS_PER_PASS q heads at once (one K and V load serves them all) and loads the
// next position's K and V before computing on the current one, so a warp's loads overlap instead
// of chaining. The warps' partial softmax states are merged in a fixed order; with several
// chunks, each writes its merged state to attn_part and the last of them to finish merges the
// chunks in chunk order.
__device__ void attention(const Params& p, const Stack& s, int layer, int nb, const int* cache_idx,
                          const int* pos_of, float* work, int chunks) {
  const int hd = s.head_dim, half = hd / 2, gs = s.n_heads / s.n_kv;
  const int q_width = s.n_heads * hd, kv_width = s.n_kv * hd;
  const int warp = tid() >> 5, lane = tid() & 31;
  float* vec = work;                             // [gs + 1][hd]: k, then the group's q heads
  float* wm = vec + (gs + 1) * hd;               // [HEADS_PER_PASS][WARPS]
  float* wl = wm + HEADS_PER_PASS * WARPS;       // [HEADS_PER_PASS][WARPS]
  float* wacc = wl + HEADS_PER_PASS * WARPS;     // [HEADS_PER_PASS][WARPS][hd]
  int* last = reinterpret_cast<int*>(wacc + HEADS_PER_PASS * WARPS * hd);  // [1]
  for (int task = bid(); task < nb * s.n_kv * chunks; task += gridDim.x) {
    const int b = task / (s.n_kv * chunks), g = task / chunks % s.n_kv, c = task % chunks;
    const int pos = pos_of[b];
    const int first = c * p.attention_chunk;  // 0 when attention_chunk is
    const int end = chunks > 1 && first + p.attention_chunk - 1 < pos ? first + p.attention_chunk - 1 : pos;
    const float* qkv = p.qkv + (size_t)b * p.max_qkv;
    const size_t head_base = (((size_t)cache_idx[b] * s.n_layers + layer) * s.n_kv + g) * s.max_len;
    float* kc = s.k_cache + head_base * hd;
    float* vc = s.v_cache + head_base * hd;
    const LayerW& lw = s.layers[layer];
    if (warp <= gs) {
      // the rotation's loads go out with the row's, not after it
      const float2* rope = s.rope + pos * half;
      float2 rot[HEAD_REGS / 2];
#pragma unroll
      for (int j = 0; j < HEAD_REGS / 2; j++) {
        const int i = lane + 32 * j;
        rot[j] = i < half ? rope[i] : make_float2(1.f, 0.f);
      }
      const float* src = warp == 0 ? qkv + q_width + g * hd : qkv + (g * gs + warp - 1) * hd;
      const bf16_t* nw = warp == 0 ? lw.k_norm : lw.q_norm;
      float ss = 0.f;
      for (int i = lane; i < hd; i += 32) ss += src[i] * src[i];
      ss = warp_sum(ss);
      const float r = rsqrtf(ss / (float)hd + s.eps);
      float* v = vec + warp * hd;
      for (int i = lane; i < hd; i += 32) v[i] = bf2f(nw[i]) * (src[i] * r);
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
      if (warp == 0 && c + 1 == attention_chunks(p, pos)) {
        const float* vsrc = qkv + q_width + kv_width + g * hd;
        for (int i = lane; i < hd; i += 32) {
          kc[(size_t)pos * hd + i] = v[i];
          vc[(size_t)pos * hd + i] = vsrc[i];
        }
      }
    }
    __syncthreads();
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
      float k_next[HEAD_REGS], v_next[HEAD_REGS];
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
      const float scale = rsqrtf((float)hd);
      if (first + warp <= end) load_kv(first + warp);
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
      for (int e = tid(); e < nq * hd; e += THREADS) {
        const int qi = e / hd, i = e % hd;
        const float* qm = wm + qi * WARPS;
        const float* ql = wl + qi * WARPS;
        float big = NEG_INF;
        for (int w = 0; w < WARPS; w++) big = fmaxf(big, qm[w]);
        float denom = 0.f;
        for (int w = 0; w < WARPS; w++)
          if (ql[w] > 0.f) denom += ql[w] * expf(qm[w] - big);
        float num = 0.f;
        for (int w = 0; w < WARPS; w++)
          if (ql[w] > 0.f) num += wacc[(qi * WARPS + w) * hd + i] * expf(qm[w] - big);
        const int head = g * gs + q0 + qi;
        if (chunks == 1) {
          p.attn[(size_t)b * p.max_q + head * hd + i] = num / denom;
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
      // publish this chunk's states; the last chunk of (b, g) to get here merges all of them
      __threadfence();
      __syncthreads();
      if (tid() == 0) {
        u32* done = p.attn_count + b * s.n_kv + g;
        *last = atomicAdd(done, 1u) == (u32)(chunks - 1);
        if (*last) *done = 0;  // ready for the next phase (all chunks have counted)
      }
      __syncthreads();
      if (*last) {
        __threadfence();
        for (int e = tid(); e < gs * hd; e += THREADS) {
          const int head = g * gs + e / hd, i = e % hd;
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
          p.attn[(size_t)b * p.max_q + head * hd + i] = num / denom;
        }
      }
      __syncthreads();
    }
  }
}

// One decoder layer for nb single-token rows held in `x` (global, stride max_hidden): `step` is
// the predictor pass, or -1 for the talker. Each matvec's first weights are loaded while the
// barrier before it is waited for (`first_qkv`: by the layer before; the next layer's are
// returned).
__device__ FirstChunks layer_step(const Params& p, const Stack& s, int step, int layer, int nb,
                                  const int* cache_idx, const int* pos_of, float* xs, float* red,
                                  float* work, Launch& L, FirstChunks first_qkv) {
  const int stack = step < 0 ? PH_TALKER : 0;  // profile tag
  const int chunks = step < 0 ? p.talker_chunks : attention_chunks(p, step);
  const LayerW& lw = s.layers[layer];
  const int H = s.hidden, qw = s.n_heads * s.head_dim;
  float* x = p.x;
  rmsnorm_rows(x, p.max_hidden, H, lw.in_norm, s.eps, nb, xs, red);
  float* qkv = p.qkv;
  const int max_qkv = p.max_qkv;
  matvec(lw.qkv, s.qkv_rows(), H, xs, nb, first_qkv,
         [&](int b, int r, float v) { qkv[(size_t)b * max_qkv + r] = v; });
  L.bar.sync(p, stack | PH_QKV);
  attention(p, s, layer, nb, cache_idx, pos_of, work, chunks);
  L.bar.arrive(p);
  FirstChunks first = first_chunks(lw.o, H, qw);
  L.bar.wait(p, stack | PH_ATTENTION);
  load_rows(p.attn, p.max_q, qw, nb, xs);
  const int max_hidden = p.max_hidden;
  matvec(lw.o, H, qw, xs, nb, first,
         [&](int b, int r, float v) { x[(size_t)b * max_hidden + r] += v; });
  L.bar.arrive(p);
  first = first_chunks(lw.gate_up, 2 * s.inter, H);
  L.bar.wait(p, stack | PH_O);
  rmsnorm_rows(x, p.max_hidden, H, lw.post_norm, s.eps, nb, xs, red);
  float* gu = p.gate_up;
  const int gu_stride = 2 * p.max_inter;
  matvec(lw.gate_up, 2 * s.inter, H, xs, nb, first,
         [&](int b, int r, float v) { gu[(size_t)b * gu_stride + r] = v; });
  L.bar.arrive(p);
  first = first_chunks(lw.down, H, s.inter);
  L.bar.wait(p, stack | PH_GATE_UP);
  for (int b = 0; b < nb; b++)
    for (int i = tid(); i < s.inter; i += THREADS) {
      const float gt = gu[(size_t)b * gu_stride + i], up = gu[(size_t)b * gu_stride + s.inter + i];
      xs[b * s.inter + i] = gt / (1.f + expf(-gt)) * up;
    }
  __syncthreads();
  matvec(lw.down, H, s.inter, xs, nb, first,
         [&](int b, int r, float v) { x[(size_t)b * max_hidden + r] += v; });
  L.bar.arrive(p);
  if (layer + 1 < s.n_layers) first = first_chunks(s.layers[layer + 1].qkv, s.qkv_rows(), H);
  L.bar.wait(p, stack | PH_DOWN);
  return first;
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

// Returns the index of the largest key (lowest index on ties), over n values in shared memory.
__device__ int block_argmax(const float* v, int n, float* redf, int* redi) {
  const int warp = tid() >> 5, lane = tid() & 31;
  float best = NEG_INF;
  int bi = 0x7fffffff;
  for (int i = tid(); i < n; i += THREADS) {
    const float x = v[i];
    if (x > best || (x == best && i < bi)) {
      best = x;
      bi = i;
    }
  }
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
  best = redf[0];
  bi = redi[0];
  for (int w = 1; w < WARPS; w++)
    if (redf[w] > best || (redf[w] == best && redi[w] < bi)) {
      best = redf[w];
      bi = redi[w];
    }
  __syncthreads();
  return bi == 0x7fffffff ? 0 : bi;
}

// The k-th largest value's ordered key (radix select, 8 bits per round). Logits mostly share
// their high bits, so one shared-memory atomic per element would serialise on a single bin:
// the lanes of a warp that fall in the same bin add once, with their count. Warp 0 then finds
// the digit holding the k-th key with a scan over the histogram from the highest digit down.
// `state` holds 2 words.
__device__ u32 kth_largest_key(const float* v, int n, int k, u32* hist, u32* state) {
  const int lane = tid() & 31;
  u32 prefix = 0, mask = 0;
  int remaining = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid(); i < 256; i += THREADS) hist[i] = 0;
    __syncthreads();
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
      }
    }
    __syncthreads();
    prefix |= state[0] << shift;
    mask |= 255u << shift;
    remaining = (int)state[1];
    // the next round's histogram writes come after a barrier every thread passes after this read
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

// Temperature, top-k, top-p, then a categorical draw (Gumbel-max over the kept logits), or
// argmax. `v` holds the processed logits in shared memory and is overwritten; `hist` has
// HIST_WORDS words and `scratch` 2n (top-p only).
__device__ int sample_logits(float* v, int n, const Sampler& sp, u32 seed_lo, u32 seed_hi,
                             u32 stream_a, u32 stream_b, float* redf, int* redi, u32* hist,
                             float* scratch) {
  if (!sp.do_sample) return block_argmax(v, n, redf, redi);
  for (int i = tid(); i < n; i += THREADS) v[i] = v[i] / sp.temperature;
  __syncthreads();
  u32 threshold = 0;
  if (sp.top_k > 0 && sp.top_k < n) threshold = kth_largest_key(v, n, sp.top_k, hist, hist + 256);
  if (sp.top_p < 1.f) top_p_filter(v, n, threshold, sp.top_p, hist, scratch);
  for (int i = tid(); i < n; i += THREADS) {
    const float x = v[i];
    if (ordered_key(x) < threshold || x == NEG_INF) {
      v[i] = NEG_INF;
    } else {
      const uint4 r = philox(make_uint4((u32)i, stream_a, stream_b, 0x766f78u), seed_lo, seed_hi);
      const float u = ((float)(r.x >> 8) + 0.5f) * (1.0f / 16777216.0f);
      v[i] = x - logf(-logf(u));
    }
  }
  __syncthreads();
  return block_argmax(v, n, redf, redi);
}

// ---------------------------------------------------------------------------------------------
// phases

// Talker codebook-0 processors in the official order (repetition penalty over the previous
// codebook-0 ids, min 2 new tokens before EOS, suppression of 2048..3071 except EOS), then sample.
__device__ int sample_talker(const Params& p, int b, float* work, float* redf, int* redi) {
  const int slot = p.slot[b], V = p.vocab;
  const float* logits = p.talker_logits + (size_t)slot * V;
  const unsigned char* seen = p.seen + (size_t)slot * V;
  const Sampler& sp = p.talker_sampler[b];
  float* v = work;
  u32* hist = reinterpret_cast<u32*>(work + V);
  for (int i = tid(); i < V; i += THREADS) {
    float x = logits[i];
    if (seen[i]) x = x < 0.f ? x * sp.repetition_penalty : x / sp.repetition_penalty;
    if (i == p.eos_id && p.n_sampled[b] < 2) x = NEG_INF;
    if (i >= V - 1024 && i != p.eos_id) x = NEG_INF;
    v[i] = x;
  }
  __syncthreads();
  return sample_logits(v, V, sp, p.seed_lo[b], p.seed_hi[b], (u32)p.n_sampled[b], 0u, redf, redi,
                       hist, work + V + HIST_WORDS);
}

__device__ int sample_sub(const Params& p, int b, int group, float* work, float* redf, int* redi) {
  const int V = p.cp_vocab;
  float* v = work;
  u32* hist = reinterpret_cast<u32*>(work + V);
  for (int i = tid(); i < V; i += THREADS) v[i] = p.cp_logits[(size_t)b * V + i];
  __syncthreads();
  return sample_logits(v, V, p.sub_sampler[b], p.seed_lo[b], p.seed_hi[b], (u32)p.n_sampled[b],
                       (u32)group, redf, redi, hist, work + V + HIST_WORDS);
}

// The code predictor's input row for every sequence: small_to_mtp_projection(src) when the
// checkpoint has one, else src itself. `src(b, i)` gives element i of sequence b's talker-width row.
template <typename Src>
__device__ void cp_input(const Params& p, int nb, Src src, float* xs, Launch& L) {
  const int H = p.talker.hidden, max_hidden = p.max_hidden;
  float* x = p.x;
  if (p.proj_w) {
    for (int b = 0; b < nb; b++)
      for (int i = tid(); i < H; i += THREADS) xs[b * H + i] = src(b, i);
    __syncthreads();
    const bf16_t* bias = p.proj_b;
    matvec(p.proj_w, p.cp.hidden, H, xs, nb, first_chunks(p.proj_w, p.cp.hidden, H),
           [&](int b, int r, float v) { x[(size_t)b * max_hidden + r] = v + bf2f(bias[r]); });
  } else if (bid() == 0) {
    for (int b = 0; b < nb; b++)
      for (int i = tid(); i < H; i += THREADS) x[(size_t)b * max_hidden + i] = src(b, i);
  }
  L.bar.sync(p, PH_INPUT);
}

__device__ __forceinline__ const bf16_t* cp_embedding_row(const Params& p, int table, int code) {
  const int H = p.talker.hidden;
  return p.cp_embedding + ((size_t)table * p.cp_vocab + code) * H;
}

// Final RMSNorm of every row of x into xs, then a head matvec into `out` (row stride `vocab`).
__device__ void norm_and_head(const Params& p, const Stack& s, const bf16_t* head, int vocab,
                              float* out_of_b[MAX_B], int nb, float* xs, float* red, Launch& L) {
  rmsnorm_rows(p.x, p.max_hidden, s.hidden, s.final_norm, s.eps, nb, xs, red);
  matvec(head, vocab, s.hidden, xs, nb, first_chunks(head, vocab, s.hidden),
         [&](int b, int r, float v) { out_of_b[b][r] = v; });
}

// FRAME(codes) + the next trailing text row (the last trailing row is tts_pad), into x[b].
__device__ void frame_embedding(const Params& p, int b) {
  const int H = p.talker.hidden;
  const int* codes = p.codes + b * CODE_WORDS;
  const int g = p.step[b];
  const int trow = g < p.trailing_len[b] - 1 ? g : p.trailing_len[b] - 1;
  const float* trailing = p.trailing + ((size_t)p.slot[b] * p.max_trailing + trow) * H;
  const bf16_t* c0row = p.codec_embedding + (size_t)codes[0] * H;
  for (int i = tid(); i < H; i += THREADS) {
    float e = bf2f(c0row[i]);
    for (int j = 1; j < p.groups; j++) e += bf2f(cp_embedding_row(p, j - 1, codes[j])[i]);
    p.x[(size_t)b * p.max_hidden + i] = e + trailing[i];
  }
}

__device__ void code_predictor(const Params& p, int nb, float* xs, float* red, int* redi,
                               float* work, Launch& L) {
  const Stack& s = p.cp;
  const int H = p.talker.hidden;
  int cache_idx[MAX_B], pos_of[MAX_B];
  float* logits_of[MAX_B];
  for (int b = 0; b < MAX_B; b++) {
    cache_idx[b] = b;
    logits_of[b] = p.cp_logits + (size_t)b * p.cp_vocab;
  }
  for (int step = 0; step < p.groups; step++) {
    for (int b = 0; b < MAX_B; b++) pos_of[b] = step;
    if (step == 0) {
      cp_input(p, nb, [&](int b, int i) { return p.past_hidden[(size_t)p.slot[b] * H + i]; }, xs,
               L);
    } else if (step == 1) {
      cp_input(p, nb,
               [&](int b, int i) { return bf2f(p.codec_embedding[(size_t)p.c0[b] * H + i]); }, xs,
               L);
    } else if (p.proj_w) {
      cp_input(p, nb,
               [&](int b, int i) {
                 return bf2f(cp_embedding_row(p, step - 2, p.codes[b * CODE_WORDS + step - 1])[i]);
               },
               xs, L);
    }
    FirstChunks first_qkv = first_chunks(s.layers[0].qkv, s.qkv_rows(), s.hidden);
    for (int layer = 0; layer < s.n_layers; layer++)
      first_qkv =
          layer_step(p, s, step, layer, nb, cache_idx, pos_of, xs, red, work, L, first_qkv);
    if (step == 0) continue;
    norm_and_head(p, s, p.cp_heads + (size_t)(step - 1) * p.cp_vocab * s.hidden, p.cp_vocab,
                  logits_of, nb, xs, red, L);
    L.bar.sync(p, PH_HEAD);
    for (int b = bid(); b < nb; b += gridDim.x) {
      const int own = sample_sub(p, b, step, work, red, redi);
      const int code = p.forced ? p.forced_codes[b][step] : own;
      if (tid() == 0) {
        p.codes[b * CODE_WORDS + step] = code;
        p.codes[b * CODE_WORDS + OWN + step] = own;
      }
      __syncthreads();
      if (step + 1 < p.groups) {
        if (!p.proj_w) {
          const bf16_t* row = cp_embedding_row(p, step - 1, code);
          for (int i = tid(); i < H; i += THREADS)
            p.x[(size_t)b * p.max_hidden + i] = bf2f(row[i]);
        }
      } else {
        frame_embedding(p, b);
      }
      __syncthreads();
    }
    L.bar.sync(p, PH_SAMPLE);
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) frame_kernel(const Params p) {
  extern __shared__ float smem[];
  float* xs = smem;
  float* red = xs + p.smem_x_floats;
  int* redi = reinterpret_cast<int*>(red + 32);
  float* work = red + 64;
  Launch L{GridBarrier{0u}};
  L.bar.mark(p, PH_START);
  const int nb = p.batch;
  const int H = p.talker.hidden;

  if (p.mode == MODE_FRAME) {
    if (bid() == 0 && tid() == 0) {
      for (int b = 0; b < nb; b++) {
        p.codes[b * CODE_WORDS] = p.c0[b];
        p.seen[(size_t)p.slot[b] * p.vocab + p.c0[b]] = 1;
      }
    }
    code_predictor(p, nb, xs, red, redi, work, L);
  } else {
    if (bid() == 0)
      for (int i = tid(); i < H; i += THREADS)
        p.x[i] = p.prefill_rows[(size_t)p.prefill_row * H + i];
    L.bar.sync(p, PH_TALKER | PH_INPUT);
  }

  FirstChunks first_qkv = first_chunks(p.talker.layers[0].qkv, p.talker.qkv_rows(), H);
  for (int layer = 0; layer < p.talker.n_layers; layer++)
    first_qkv =
        layer_step(p, p.talker, -1, layer, nb, p.slot, p.pos, xs, red, work, L, first_qkv);

  if (p.mode == MODE_PREFILL && !p.prefill_last) return;
  float* logits_of[MAX_B];
  for (int b = 0; b < MAX_B; b++)
    logits_of[b] = p.talker_logits + (size_t)(b < nb ? p.slot[b] : 0) * p.vocab;
  norm_and_head(p, p.talker, p.codec_head, p.vocab, logits_of, nb, xs, red, L);
  if (bid() == 0)
    for (int b = 0; b < nb; b++)
      for (int i = tid(); i < H; i += THREADS)
        p.past_hidden[(size_t)p.slot[b] * H + i] = xs[b * H + i];
  L.bar.sync(p, PH_TALKER | PH_HEAD);
  for (int b = bid(); b < nb; b += gridDim.x) {
    const int own = sample_talker(p, b, work, red, redi);
    const int c0 = p.forced ? p.forced_codes[b][16] : own;
    if (tid() == 0) {
      p.codes[b * CODE_WORDS + OWN + 16] = own;
      p.codes[b * CODE_WORDS + 16] = c0;
      p.codes[b * CODE_WORDS + 17] = c0 == p.eos_id;
    }
  }
  L.bar.mark(p, PH_TALKER | PH_SAMPLE);
}

// ---------------------------------------------------------------------------------------------
// prompt rows: text_projection(text_embedding[id]) + codec track, one block per row

struct EmbedParams {
  const bf16_t* text_embedding;  // [text_vocab, T]
  const bf16_t* fc1_w;           // [T1, T]
  const bf16_t* fc1_b;
  const bf16_t* fc2_w;           // [H, T1]
  const bf16_t* fc2_b;
  const bf16_t* codec_embedding; // [vocab, H]
  const bf16_t* cp_embedding;    // [groups - 1][cp_vocab][H]
  const float* speaker;          // [H]
  const int* ref_codes;          // [n_ref][groups]
  const int* rows;               // [n_rows][3]: text id, codec kind, codec value
  float* out;                    // [n_rows][H]
  int n_rows, text_hidden, text_inter, hidden, cp_vocab, groups;
};

static_assert(sizeof(EmbedParams) == 112, "EmbedParams layout changed: update src/layout.rs");

#define CODEC_NONE 0
#define CODEC_ID 1
#define CODEC_SPEAKER 2
#define CODEC_REFERENCE 3

extern "C" __global__ void __launch_bounds__(THREADS) embed_rows(const EmbedParams p) {
  extern __shared__ float sm[];
  float* t = sm;
  float* h = sm + p.text_hidden;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int row = blockIdx.x; row < p.n_rows; row += gridDim.x) {
    const int text_id = p.rows[row * 3], kind = p.rows[row * 3 + 1], value = p.rows[row * 3 + 2];
    for (int i = threadIdx.x; i < p.text_hidden; i += THREADS)
      t[i] = bf2f(p.text_embedding[(size_t)text_id * p.text_hidden + i]);
    __syncthreads();
    for (int j = warp; j < p.text_inter; j += WARPS) {
      float d = 0.f;
      for (int k = lane; k < p.text_hidden; k += 32)
        d += bf2f(p.fc1_w[(size_t)j * p.text_hidden + k]) * t[k];
      d = warp_sum(d) + bf2f(p.fc1_b[j]);
      if (lane == 0) h[j] = d / (1.f + expf(-d));
    }
    __syncthreads();
    for (int i = warp; i < p.hidden; i += WARPS) {
      float d = 0.f;
      for (int k = lane; k < p.text_inter; k += 32)
        d += bf2f(p.fc2_w[(size_t)i * p.text_inter + k]) * h[k];
      d = warp_sum(d) + bf2f(p.fc2_b[i]);
      if (lane == 0) {
        float c = 0.f;
        if (kind == CODEC_ID) {
          c = bf2f(p.codec_embedding[(size_t)value * p.hidden + i]);
        } else if (kind == CODEC_SPEAKER) {
          c = p.speaker[i];
        } else if (kind == CODEC_REFERENCE) {
          const int* codes = p.ref_codes + (size_t)value * p.groups;
          c = bf2f(p.codec_embedding[(size_t)codes[0] * p.hidden + i]);
          for (int j = 1; j < p.groups; j++)
            c += bf2f(p.cp_embedding[((size_t)(j - 1) * p.cp_vocab + codes[j]) * p.hidden + i]);
        }
        p.out[(size_t)row * p.hidden + i] = d + c;
      }
    }
    __syncthreads();
  }
}
