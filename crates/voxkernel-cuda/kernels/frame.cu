// voxkernel frame megakernel (version 1: phases separated by grid-wide barriers).
//
// One cooperative launch advances up to MAX_B sequences by one audio frame:
//   code predictor (16 single-token passes: past_hidden, CE(c0), then 14 group embeddings),
//   sub-talker sampling, frame embedding + trailing text row, one talker step, codec head,
//   codebook-0 sampling. In HEAD mode it only finishes a prefill (prefill.cu leaves each
//   sequence's last talker row in x): final norm, codec head, past_hidden, codebook-0 sampling.
// Activations stay f32 (global scratch + shared memory); weights are bf16, streamed once.
// No toolkit headers: NVRTC compiles this file with nothing but its own builtins.

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned long long u64;

#define MAX_B 4
#define WARPS 16
#define THREADS (WARPS * 32)
#define MAX_HEAD_DIM 256
#define MODE_FRAME 0
#define MODE_HEAD 1
#define NEG_INF (-__int_as_float(0x7f800000))
// Per-sequence words of `codes`: [0,16) the frame's codes, 16 the next codebook 0, 17 the EOS
// flag, [18,34) the kernel's own choice for each group and 34 for the next codebook 0 (they
// differ from the used ones only under teacher forcing).
#define CODE_WORDS 36
#define OWN 18

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
  const float* inv_freq;  // [head_dim / 2]
  float* k_cache;         // [cache_slots][layers][n_kv][max_len][head_dim]
  float* v_cache;
  int hidden, inter, n_heads, n_kv, head_dim, n_layers, max_len;
  float eps;
};

struct Sampler {
  int do_sample;
  int top_k;
  float temperature;
  float repetition_penalty;
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
  float* x;                       // [MAX_B][max_hidden]
  float* qkv;                     // [MAX_B][max_qkv]
  float* attn;                    // [MAX_B][max_q]
  float* gate_up;                 // [MAX_B][2 * max_inter]
  float* cp_logits;               // [MAX_B][cp_vocab]
  int* codes;                     // [MAX_B][CODE_WORDS]
  u32* barrier;                   // zeroed by the host before every launch
  int vocab, cp_vocab, groups, eos_id, max_trailing;
  int max_hidden, max_qkv, max_q, max_inter;
  int smem_x_floats;              // MAX_B * widest matvec input
  int mode, batch, forced;
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
static_assert(sizeof(Params) == 864, "Params layout changed: update src/layout.rs");

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

// Monotonic counter barrier: barrier n completes when the counter reaches n * gridDim.x.
// Co-residency of all blocks is guaranteed by the cooperative launch.
struct GridBarrier {
  u32* counter;
  u32 target;
  __device__ void sync() {
    target += gridDim.x;
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(counter, 1u);
      while (ld_acquire(counter) < target) {
      }
      __threadfence();
    }
    __syncthreads();
  }
};

__device__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
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
    for (int i = threadIdx.x; i < n; i += THREADS) ss += s[i] * s[i];
    const float total = block_sum(ss, red);
    const float r = rsqrtf(total / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += THREADS) out[b * n + i] = bf2f(w[i]) * (s[i] * r);
  }
  __syncthreads();
}

__device__ void load_rows(const float* src, int src_stride, int n, int nb, float* out) {
  for (int b = 0; b < nb; b++)
    for (int i = threadIdx.x; i < n; i += THREADS) out[b * n + i] = src[(size_t)b * src_stride + i];
  __syncthreads();
}

// Every warp of the grid takes whole output rows: y[b][r] = W[r] . xs[b]. K must be a multiple
// of 8 (16-byte weight loads). `emit(b, r, value)` is called by lane 0.
template <typename Emit>
__device__ void matvec(const bf16_t* W, int rows, int K, const float* xs, int nb, Emit emit) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int total_warps = gridDim.x * WARPS;
  const int k8 = K >> 3;
  for (int r = blockIdx.x * WARPS + warp; r < rows; r += total_warps) {
    const uint4* wr = reinterpret_cast<const uint4*>(W + (size_t)r * K);
    float acc[MAX_B];
#pragma unroll
    for (int b = 0; b < MAX_B; b++) acc[b] = 0.f;
#pragma unroll 4
    for (int i = lane; i < k8; i += 32) {
      const uint4 w = ld_weights(wr + i);
      const float w0 = bf_lo(w.x), w1 = bf_hi(w.x), w2 = bf_lo(w.y), w3 = bf_hi(w.y);
      const float w4 = bf_lo(w.z), w5 = bf_hi(w.z), w6 = bf_lo(w.w), w7 = bf_hi(w.w);
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
#pragma unroll
    for (int b = 0; b < MAX_B; b++) {
      if (b < nb) {
        const float v = warp_sum(acc[b]);
        if (lane == 0) emit(b, r, v);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// transformer layer pieces

// Per (sequence, kv head): q/k RMSNorm, RoPE, KV append, attention over positions 0..pos.
__device__ void attention(const Params& p, const Stack& s, int layer, int nb, const int* cache_idx,
                          const int* pos_of, float* work) {
  const int hd = s.head_dim, half = hd / 2, gs = s.n_heads / s.n_kv;
  const int q_width = s.n_heads * hd, kv_width = s.n_kv * hd;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float scale = rsqrtf((float)hd);
  float* vec = work;                          // [gs + 1][hd]: k, then the group's q heads
  float* wm = vec + (gs + 1) * hd;            // [WARPS]
  float* wl = wm + WARPS;                     // [WARPS]
  float* wacc = wl + WARPS;                   // [WARPS][hd]
  for (int task = blockIdx.x; task < nb * s.n_kv; task += gridDim.x) {
    const int b = task / s.n_kv, g = task % s.n_kv;
    const int pos = pos_of[b];
    const float* qkv = p.qkv + (size_t)b * p.max_qkv;
    const size_t head_base = (((size_t)cache_idx[b] * s.n_layers + layer) * s.n_kv + g) * s.max_len;
    float* kc = s.k_cache + head_base * hd;
    float* vc = s.v_cache + head_base * hd;
    const LayerW& lw = s.layers[layer];
    if (warp <= gs) {
      const float* src = warp == 0 ? qkv + q_width + g * hd : qkv + (g * gs + warp - 1) * hd;
      const bf16_t* nw = warp == 0 ? lw.k_norm : lw.q_norm;
      float ss = 0.f;
      for (int i = lane; i < hd; i += 32) ss += src[i] * src[i];
      ss = warp_sum(ss);
      const float r = rsqrtf(ss / (float)hd + s.eps);
      float* v = vec + warp * hd;
      for (int i = lane; i < hd; i += 32) v[i] = bf2f(nw[i]) * (src[i] * r);
      __syncwarp();
      for (int i = lane; i < half; i += 32) {
        const float f = (float)pos * s.inv_freq[i];
        float sn, cs;
        sincosf(f, &sn, &cs);
        const float a = v[i], c = v[i + half];
        const float lo = a * cs - c * sn, hi = c * cs + a * sn;
        v[i] = lo;
        v[i + half] = hi;
      }
      __syncwarp();
      if (warp == 0) {
        const float* vsrc = qkv + q_width + kv_width + g * hd;
        for (int i = lane; i < hd; i += 32) {
          kc[(size_t)pos * hd + i] = v[i];
          vc[(size_t)pos * hd + i] = vsrc[i];
        }
      }
    }
    __syncthreads();
    for (int qi = 0; qi < gs; qi++) {
      const float* q = vec + (qi + 1) * hd;
      float m = NEG_INF, l = 0.f;
      float acc[MAX_HEAD_DIM / 32];
#pragma unroll
      for (int j = 0; j < MAX_HEAD_DIM / 32; j++) acc[j] = 0.f;
      for (int t = warp; t <= pos; t += WARPS) {
        const float* kt = kc + (size_t)t * hd;
        float d = 0.f;
        for (int i = lane; i < hd; i += 32) d += q[i] * kt[i];
        const float sc = warp_sum(d) * scale;
        const float m_new = fmaxf(m, sc);
        const float corr = expf(m - m_new), pw = expf(sc - m_new);
        l = l * corr + pw;
        const float* vt = vc + (size_t)t * hd;
#pragma unroll
        for (int j = 0; j < MAX_HEAD_DIM / 32; j++) {
          const int i = lane + 32 * j;
          if (i < hd) acc[j] = acc[j] * corr + pw * vt[i];
        }
        m = m_new;
      }
      if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
      }
#pragma unroll
      for (int j = 0; j < MAX_HEAD_DIM / 32; j++) {
        const int i = lane + 32 * j;
        if (i < hd) wacc[warp * hd + i] = acc[j];
      }
      __syncthreads();
      float big = NEG_INF;
      for (int w = 0; w < WARPS; w++) big = fmaxf(big, wm[w]);
      float denom = 0.f;
      for (int w = 0; w < WARPS; w++)
        if (wl[w] > 0.f) denom += wl[w] * expf(wm[w] - big);
      for (int i = threadIdx.x; i < hd; i += THREADS) {
        float num = 0.f;
        for (int w = 0; w < WARPS; w++)
          if (wl[w] > 0.f) num += wacc[w * hd + i] * expf(wm[w] - big);
        p.attn[(size_t)b * p.max_q + (g * gs + qi) * hd + i] = num / denom;
      }
      __syncthreads();
    }
  }
}

// One decoder layer for nb single-token rows held in `x` (global, stride max_hidden).
__device__ void layer_step(const Params& p, const Stack& s, int layer, int nb, const int* cache_idx,
                           const int* pos_of, float* xs, float* red, float* work, GridBarrier& bar) {
  const LayerW& lw = s.layers[layer];
  const int H = s.hidden, qw = s.n_heads * s.head_dim, kvw = s.n_kv * s.head_dim;
  float* x = p.x;
  rmsnorm_rows(x, p.max_hidden, H, lw.in_norm, s.eps, nb, xs, red);
  float* qkv = p.qkv;
  const int max_qkv = p.max_qkv;
  matvec(lw.qkv, qw + 2 * kvw, H, xs, nb,
         [&](int b, int r, float v) { qkv[(size_t)b * max_qkv + r] = v; });
  bar.sync();
  attention(p, s, layer, nb, cache_idx, pos_of, work);
  bar.sync();
  load_rows(p.attn, p.max_q, qw, nb, xs);
  const int max_hidden = p.max_hidden;
  matvec(lw.o, H, qw, xs, nb, [&](int b, int r, float v) { x[(size_t)b * max_hidden + r] += v; });
  bar.sync();
  rmsnorm_rows(x, p.max_hidden, H, lw.post_norm, s.eps, nb, xs, red);
  float* gu = p.gate_up;
  const int gu_stride = 2 * p.max_inter;
  matvec(lw.gate_up, 2 * s.inter, H, xs, nb,
         [&](int b, int r, float v) { gu[(size_t)b * gu_stride + r] = v; });
  bar.sync();
  for (int b = 0; b < nb; b++)
    for (int i = threadIdx.x; i < s.inter; i += THREADS) {
      const float gt = gu[(size_t)b * gu_stride + i], up = gu[(size_t)b * gu_stride + s.inter + i];
      xs[b * s.inter + i] = gt / (1.f + expf(-gt)) * up;
    }
  __syncthreads();
  matvec(lw.down, H, s.inter, xs, nb,
         [&](int b, int r, float v) { x[(size_t)b * max_hidden + r] += v; });
  bar.sync();
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
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float best = NEG_INF;
  int bi = 0x7fffffff;
  for (int i = threadIdx.x; i < n; i += THREADS) {
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

// The k-th largest value's ordered key (radix select, 8 bits per round).
__device__ u32 kth_largest_key(const float* v, int n, int k, u32* hist, u32* shared_state) {
  u32 prefix = 0, mask = 0;
  int remaining = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += THREADS) hist[i] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += THREADS) {
      const u32 key = ordered_key(v[i]);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      u32 cum = 0;
      int digit = 0;
      for (int d = 255; d >= 0; d--) {
        if (cum + hist[d] >= (u32)remaining) {
          digit = d;
          break;
        }
        cum += hist[d];
      }
      shared_state[0] = (u32)digit;
      shared_state[1] = (u32)(remaining - (int)cum);
    }
    __syncthreads();
    prefix |= shared_state[0] << shift;
    mask |= 255u << shift;
    remaining = (int)shared_state[1];
    __syncthreads();
  }
  return prefix;
}

// Temperature, top-k, then a categorical draw (Gumbel-max over the kept logits), or argmax.
// `v` holds the processed logits in shared memory and is overwritten.
__device__ int sample_logits(float* v, int n, const Sampler& sp, u32 seed_lo, u32 seed_hi,
                             u32 stream_a, u32 stream_b, float* redf, int* redi, u32* hist) {
  if (!sp.do_sample) return block_argmax(v, n, redf, redi);
  for (int i = threadIdx.x; i < n; i += THREADS) v[i] = v[i] / sp.temperature;
  __syncthreads();
  u32 threshold = 0;
  if (sp.top_k > 0 && sp.top_k < n) threshold = kth_largest_key(v, n, sp.top_k, hist, hist + 256);
  for (int i = threadIdx.x; i < n; i += THREADS) {
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
  for (int i = threadIdx.x; i < V; i += THREADS) {
    float x = logits[i];
    if (seen[i]) x = x < 0.f ? x * sp.repetition_penalty : x / sp.repetition_penalty;
    if (i == p.eos_id && p.n_sampled[b] < 2) x = NEG_INF;
    if (i >= V - 1024 && i != p.eos_id) x = NEG_INF;
    v[i] = x;
  }
  __syncthreads();
  return sample_logits(v, V, sp, p.seed_lo[b], p.seed_hi[b], (u32)p.n_sampled[b], 0u, redf, redi,
                       hist);
}

__device__ int sample_sub(const Params& p, int b, int group, float* work, float* redf, int* redi) {
  const int V = p.cp_vocab;
  float* v = work;
  u32* hist = reinterpret_cast<u32*>(work + V);
  for (int i = threadIdx.x; i < V; i += THREADS) v[i] = p.cp_logits[(size_t)b * V + i];
  __syncthreads();
  return sample_logits(v, V, p.sub_sampler[b], p.seed_lo[b], p.seed_hi[b], (u32)p.n_sampled[b],
                       (u32)group, redf, redi, hist);
}

// The code predictor's input row for every sequence: small_to_mtp_projection(src) when the
// checkpoint has one, else src itself. `src(b, i)` gives element i of sequence b's talker-width row.
template <typename Src>
__device__ void cp_input(const Params& p, int nb, Src src, float* xs, GridBarrier& bar) {
  const int H = p.talker.hidden, max_hidden = p.max_hidden;
  float* x = p.x;
  if (p.proj_w) {
    for (int b = 0; b < nb; b++)
      for (int i = threadIdx.x; i < H; i += THREADS) xs[b * H + i] = src(b, i);
    __syncthreads();
    const bf16_t* bias = p.proj_b;
    matvec(p.proj_w, p.cp.hidden, H, xs, nb,
           [&](int b, int r, float v) { x[(size_t)b * max_hidden + r] = v + bf2f(bias[r]); });
  } else if (blockIdx.x == 0) {
    for (int b = 0; b < nb; b++)
      for (int i = threadIdx.x; i < H; i += THREADS) x[(size_t)b * max_hidden + i] = src(b, i);
  }
  bar.sync();
}

__device__ __forceinline__ const bf16_t* cp_embedding_row(const Params& p, int table, int code) {
  const int H = p.talker.hidden;
  return p.cp_embedding + ((size_t)table * p.cp_vocab + code) * H;
}

// Final RMSNorm of every row of x into xs, then a head matvec into `out` (row stride `vocab`).
__device__ void norm_and_head(const Params& p, const Stack& s, const bf16_t* head, int vocab,
                              float* out_of_b[MAX_B], int nb, float* xs, float* red) {
  rmsnorm_rows(p.x, p.max_hidden, s.hidden, s.final_norm, s.eps, nb, xs, red);
  matvec(head, vocab, s.hidden, xs, nb, [&](int b, int r, float v) { out_of_b[b][r] = v; });
}

// FRAME(codes) + the next trailing text row (the last trailing row is tts_pad), into x[b].
__device__ void frame_embedding(const Params& p, int b) {
  const int H = p.talker.hidden;
  const int* codes = p.codes + b * CODE_WORDS;
  const int g = p.step[b];
  const int trow = g < p.trailing_len[b] - 1 ? g : p.trailing_len[b] - 1;
  const float* trailing = p.trailing + ((size_t)p.slot[b] * p.max_trailing + trow) * H;
  const bf16_t* c0row = p.codec_embedding + (size_t)codes[0] * H;
  for (int i = threadIdx.x; i < H; i += THREADS) {
    float e = bf2f(c0row[i]);
    for (int j = 1; j < p.groups; j++) e += bf2f(cp_embedding_row(p, j - 1, codes[j])[i]);
    p.x[(size_t)b * p.max_hidden + i] = e + trailing[i];
  }
}

__device__ void code_predictor(const Params& p, int nb, float* xs, float* red, int* redi,
                               float* work, GridBarrier& bar) {
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
               bar);
    } else if (step == 1) {
      cp_input(p, nb,
               [&](int b, int i) { return bf2f(p.codec_embedding[(size_t)p.c0[b] * H + i]); }, xs,
               bar);
    } else if (p.proj_w) {
      cp_input(p, nb,
               [&](int b, int i) {
                 return bf2f(cp_embedding_row(p, step - 2, p.codes[b * CODE_WORDS + step - 1])[i]);
               },
               xs, bar);
    }
    for (int layer = 0; layer < s.n_layers; layer++)
      layer_step(p, s, layer, nb, cache_idx, pos_of, xs, red, work, bar);
    if (step == 0) continue;
    norm_and_head(p, s, p.cp_heads + (size_t)(step - 1) * p.cp_vocab * s.hidden, p.cp_vocab,
                  logits_of, nb, xs, red);
    bar.sync();
    for (int b = blockIdx.x; b < nb; b += gridDim.x) {
      const int own = sample_sub(p, b, step, work, red, redi);
      const int code = p.forced ? p.forced_codes[b][step] : own;
      if (threadIdx.x == 0) {
        p.codes[b * CODE_WORDS + step] = code;
        p.codes[b * CODE_WORDS + OWN + step] = own;
      }
      __syncthreads();
      if (step + 1 < p.groups) {
        if (!p.proj_w) {
          const bf16_t* row = cp_embedding_row(p, step - 1, code);
          for (int i = threadIdx.x; i < H; i += THREADS)
            p.x[(size_t)b * p.max_hidden + i] = bf2f(row[i]);
        }
      } else {
        frame_embedding(p, b);
      }
      __syncthreads();
    }
    bar.sync();
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) frame_kernel(const Params p) {
  extern __shared__ float smem[];
  float* xs = smem;
  float* red = xs + p.smem_x_floats;
  int* redi = reinterpret_cast<int*>(red + 32);
  float* work = red + 64;
  GridBarrier bar{p.barrier, 0u};
  const int nb = p.batch;
  const int H = p.talker.hidden;

  if (p.mode == MODE_FRAME) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      for (int b = 0; b < nb; b++) {
        p.codes[b * CODE_WORDS] = p.c0[b];
        p.seen[(size_t)p.slot[b] * p.vocab + p.c0[b]] = 1;
      }
    }
    code_predictor(p, nb, xs, red, redi, work, bar);
    for (int layer = 0; layer < p.talker.n_layers; layer++)
      layer_step(p, p.talker, layer, nb, p.slot, p.pos, xs, red, work, bar);
  }

  float* logits_of[MAX_B];
  for (int b = 0; b < MAX_B; b++)
    logits_of[b] = p.talker_logits + (size_t)(b < nb ? p.slot[b] : 0) * p.vocab;
  norm_and_head(p, p.talker, p.codec_head, p.vocab, logits_of, nb, xs, red);
  if (blockIdx.x == 0)
    for (int b = 0; b < nb; b++)
      for (int i = threadIdx.x; i < H; i += THREADS)
        p.past_hidden[(size_t)p.slot[b] * H + i] = xs[b * H + i];
  bar.sync();
  for (int b = blockIdx.x; b < nb; b += gridDim.x) {
    const int own = sample_talker(p, b, work, red, redi);
    const int c0 = p.forced ? p.forced_codes[b][16] : own;
    if (threadIdx.x == 0) {
      p.codes[b * CODE_WORDS + OWN + 16] = own;
      p.codes[b * CODE_WORDS + 16] = c0;
      p.codes[b * CODE_WORDS + 17] = c0 == p.eos_id;
    }
  }
}
