// voxkernel streaming codec decoder (codes -> 24 kHz waveform), f32 (the pipelined products
// optionally on the tensor cores in TF32: `conv_gemm_pipe`).
//
// The GPU counterpart of crates/voxkernel-core/src/reference/codec_decoder.rs: the same causal
// layers, fed the new frames of many streams at once (see src/codec.rs and docs/codec.md).
//
// Batched "segment" layout. Every layer input that needs earlier rows lives in a buffer where
// each entry of the pass (one stream) owns `hist` history rows followed by its new rows (`rate`
// rows per frame). Entry e's segment starts at row frame0[e] * rate + e * hist, so a causal
// conv reads tap j of new row t at segment row t + j * dilation with no bounds logic at all. The
// `history` kernel fills the history rows from the stream's saved state before the pass and
// saves the last `hist` rows of every segment after it. Buffers with hist = 0 are plain
// `[rows, width]` matrices.
//
// No toolkit headers: NVRTC compiles this file with nothing but its own builtins.

typedef unsigned int u32;
typedef long long i64;

#define NUM_CODEBOOKS 16
#define GEMM_THREADS 256
#define BN 64
#define BK 16
#define ATTN_THREADS 128
#define MAX_HEAD_DIM 128
#define MAX_WINDOW 128

#define ACT_NONE 0
#define ACT_RMS 1
#define ACT_ELU 2   // the encoders' (kernels/encoder.cu)
#define ACT_TANH 3

#define EPI_NONE 0
#define EPI_GELU 1
#define EPI_SILU_GATE 2
#define EPI_RESIDUAL 3
#define EPI_RELU 4

// Per-pass tables (uploaded once per pass; see `PassTables` in codec.rs). Frames of one entry
// are consecutive, entries in pass order.
struct Batch {
  const int* frame_entry;   // [frames]: the entry each frame belongs to
  const int* entry_frame0;  // [entries]: its first frame within the pass
  const int* entry_frames;  // [entries]: its frame count in this pass
  const int* entry_slot;    // [entries]: its stream slot
  const int* entry_pos0;    // [entries]: the absolute position of its first frame
  const int* codes;         // [frames][16]
  const float* rope_cos;    // [frames][head_dim / 2], computed on the host like the CPU reference
  const float* rope_sin;
  int frames, entries;
};

// GEMM row g (rate rows per frame) -> its entry and its index among that entry's new rows.
__device__ __forceinline__ void locate(const Batch& b, int g, int rate, int& e, int& t) {
  e = b.frame_entry[g / rate];
  t = g - b.entry_frame0[e] * rate;
}

// Row of new row t of entry e in a segment buffer with `hist` history rows.
__device__ __forceinline__ i64 segment_row(const Batch& b, int e, int t, int rate, int hist) {
  return (i64)b.entry_frame0[e] * rate + (i64)(e + 1) * hist + t;
}

// ---------------------------------------------------------------------------------------------
// History: mirrors `History::extend` (conv.rs) for every causal layer at once. Before a pass,
// copies each entry's saved rows into the history rows of its segments; after it, saves the
// last `hist` rows of each segment (history + new rows), which is exactly what the CPU keeps.

struct HistLayer {
  float* buf;        // segment buffer of the layer input
  int channels, hist, rate;
  int state_offset;  // floats into a slot's state
};

struct HistParams {
  const HistLayer* layers;
  float* state;      // [slots][state_stride]
  int state_stride;
  int save;
};

// Grid: (layers, entries, chunks); the chunks of a layer split its rows between blocks, since the
// widest history (54 rows x 768 channels) is far too much copying for one block.
extern "C" __global__ void __launch_bounds__(256) history(const HistParams p, const Batch b) {
  const HistLayer l = p.layers[blockIdx.x];
  const int e = blockIdx.y;
  const i64 seg = (i64)b.entry_frame0[e] * l.rate + (i64)e * l.hist;
  const i64 kept = p.save ? seg + (i64)b.entry_frames[e] * l.rate : seg;
  float* rows = l.buf + kept * l.channels;
  float* state = p.state + (i64)b.entry_slot[e] * p.state_stride + l.state_offset;
  const int n = l.hist * l.channels;
#pragma unroll 4
  for (int i = blockIdx.z * blockDim.x + threadIdx.x; i < n; i += gridDim.z * blockDim.x) {
    if (p.save) state[i] = rows[i];
    else rows[i] = state[i];
  }
}

// ---------------------------------------------------------------------------------------------
// RVQ lookup: mirrors `Quantizer::decode` up to the projections. Row f gets
// [table_0[c0] | table_1[c1] + ... + table_15[c15]] (summed in codebook order like the CPU);
// the two projections then run as one GEMM over the concatenation.

struct RvqParams {
  const float* tables;  // [16][codebook_size][dim], embedding_sum / clamp(cluster_usage)
  float* out;           // [frames][2 * dim]
  int codebook_size, dim;
};

extern "C" __global__ void __launch_bounds__(256) rvq_lookup(const RvqParams p, const Batch b) {
  const int f = blockIdx.x;
  const int* codes = b.codes + f * NUM_CODEBOOKS;
  const i64 table = (i64)p.codebook_size * p.dim;
  for (int i = threadIdx.x; i < p.dim; i += blockDim.x) {
    const float first = p.tables[(i64)codes[0] * p.dim + i];
    float rest = p.tables[table + (i64)codes[1] * p.dim + i];
    for (int g = 2; g < NUM_CODEBOOKS; ++g)
      rest = __fadd_rn(rest, p.tables[g * table + (i64)codes[g] * p.dim + i]);
    p.out[(i64)f * 2 * p.dim + i] = first;
    p.out[(i64)f * 2 * p.dim + p.dim + i] = rest;
  }
}

// ---------------------------------------------------------------------------------------------
// The one matrix kernel: a causal conv as an implicit GEMM. Mirrors `CausalConv::forward`,
// `CausalTransConv::forward` and candle `Linear::forward` (conv.rs, transformer.rs), with
// rms_norm applied as the input is loaded and what follows applied as the result is stored:
// bias, GELU, SiLU gate, layer scale + residual, and the SnakeBeta (`SnakeBeta::forward`) of
// the layer that reads this output next, so each activation is computed once rather than once
// per tap and column tile. An output read both activated (by a conv) and plain (as a residual)
// is stored twice: `out` plain, `out2` activated.
//
//   out[g, c] = epilogue(sum_{tap, ch} act(in[row(g) + tap * dilation, ch]) * w[tap * cin + ch, c])
//
// A transposed conv (kernel = m * stride) is the same with m taps over its input rows and
// n = stride * out_width columns: GEMM row t fills output rows t * stride .. t * stride +
// stride - 1, which is exactly the row-major layout of `[t, stride * out_width]`.
//
// Tiles of BM x 64 outputs, 256 threads, each TM x 4 (rows TM ty .. TM ty + TM - 1, columns
// 4 tx .. 4 tx + 3, so both operands come out of shared memory as float4 where TM allows), depth
// chunks of 16 double-buffered in shared memory. With gridDim.z > 1 the depth is split;
// each split writes its partial tile to `workspace`, and the last to arrive (counted per tile)
// sums the partials in split order, so the result does not depend on timing. The folded
// kernel (`conv_gemm_fold_64`) walks every split of the depth in one block and adds the
// splits' sums in the same order: bit for bit what the split launch gives, without its partial
// tiles, so a pass of many rows keeps one frame's splits (batch invariance) in fewer blocks.

struct Gemm {
  const float* in;
  const float* w;          // [k, n], row tap * cin + ch, tap 0 the oldest input row
  const float* bias;       // column c adds bias[c % bias_len]; null for none
  float* out;
  const float* res;        // EPI_RESIDUAL: residual segments (out_width wide, res_hist rows)
  const float* col_scale;  // EPI_RESIDUAL: per-column scale of the branch, or null
  const float* act_w;      // ACT_RMS: norm weight per input channel
  const float* out_freq;   // SnakeBeta stored into `out`: exp(alpha) per channel, or null
  const float* out_inv;    //   and 1 / (exp(beta) + 1e-9)
  float* out2;             // a second, activated copy of the output (same width), or null
  const float* out2_freq;
  const float* out2_inv;
  float* workspace;        // split partial tiles
  u32* counters;           // per-tile split arrival counts, zero between launches
  int m, n, k;             // rows (frames * rate), columns, depth (taps * cin)
  int rate;                // GEMM rows per frame
  int cin, taps, dilation, in_hist;
  int out_width, out_hist, out_stride, out2_hist;
  int res_hist;
  int bias_len;
  int act, epi;
  float eps;
  int k_split;             // depth per split, a multiple of BK
};

__device__ __forceinline__ float gelu_erf(float v) {
  // candle's f32 gelu_erf: (erf(v / sqrt 2) + 1) * 0.5 * v
  return __fmul_rn(__fmul_rn(__fadd_rn(erff(__fmul_rn(v, 0.70710678118654752f)), 1.0f), 0.5f), v);
}

__device__ __forceinline__ float silu(float v) { return __fdiv_rn(v, __fadd_rn(1.0f, expf(-v))); }

// SnakeBeta: x + inv_magnitude * sin(x * frequency)^2, rounded step by step like the CPU.
__device__ __forceinline__ float snake(float x, float frequency, float inv_magnitude) {
  const float s = sinf(__fmul_rn(x, frequency));
  return __fadd_rn(x, __fmul_rn(__fmul_rn(s, s), inv_magnitude));
}

// Where GEMM row g is stored: its entry and new-row index, and the offsets of its rows in `out`
// and `out2`.
// A row is its entry (-1: past m) and its first output row ignoring history rows; each
// segment's offset follows from those without another memory access.
struct OutRow {
  i64 row0;  // frame0[e] * rate * out_stride + t * out_stride
  int e;
  __device__ i64 out(const Gemm& p) const {
    return (row0 + (i64)(e + 1) * p.out_hist) * p.out_width;
  }
  __device__ i64 out2(const Gemm& p) const {
    return (row0 + (i64)(e + 1) * p.out2_hist) * p.out_width;
  }
  // Residuals go with stride-1 outputs, whose row0 is the GEMM row's own index.
  __device__ i64 res(const Gemm& p) const {
    return (row0 + (i64)(e + 1) * p.res_hist) * p.out_width;
  }
};

__device__ __forceinline__ OutRow out_row(const Gemm& p, const Batch& b, int g) {
  OutRow r = {0, -1};
  if (g >= p.m) return r;
  int t;
  locate(b, g, p.rate, r.e, t);
  r.row0 = ((i64)b.entry_frame0[r.e] * p.rate + t) * p.out_stride;
  return r;
}

__device__ __forceinline__ float residual(const Gemm& p, const OutRow& row, int c) {
  return p.epi == EPI_RESIDUAL && row.e >= 0 && c < p.n ? p.res[row.res(p) + c] : 0.0f;
}

// The epilogue of output (row, c) = v: bias, then GELU, or ReLU (the encoders'), or the SiLU
// gate (for even c; `pair` is column c + 1, up_proj's output), or layer scale + residual (`res`,
// loaded by `residual`); then the next layer's SnakeBeta.
__device__ __forceinline__ void store(const Gemm& p, const OutRow& row, int c, float v, float pair,
                                      float res) {
  if (p.bias) v = __fadd_rn(v, p.bias[c % p.bias_len]);
  if (p.epi == EPI_GELU) {
    p.out[row.out(p) + c] = gelu_erf(v);
  } else if (p.epi == EPI_RELU) {
    p.out[row.out(p) + c] = fmaxf(v, 0.0f);
  } else if (p.epi == EPI_SILU_GATE) {
    // Columns 2c and 2c + 1 are gate_proj and up_proj output c: silu(gate) * up.
    if (c % 2 == 0) p.out[row.out(p) + c / 2] = __fmul_rn(silu(v), pair);
  } else {
    if (p.epi == EPI_RESIDUAL) {
      const float branch = p.col_scale ? __fmul_rn(v, p.col_scale[c]) : v;
      v = __fadd_rn(res, branch);
    }
    const int ch = c % p.out_width;  // transposed convs store `out_stride` rows per GEMM row
    if (p.out2) p.out2[row.out2(p) + c] = snake(v, p.out2_freq[ch], p.out2_inv[ch]);
    p.out[row.out(p) + c] = p.out_freq ? snake(v, p.out_freq[ch], p.out_inv[ch]) : v;
  }
}

// Depth split across gridDim.z blocks: each writes its N partial sums per thread to the
// workspace; the last block of the tile to arrive (counted per tile) adds all of them in split
// order into `acc` and returns true, so the result does not depend on timing. Every thread of
// the block must call it.
template <int N>
__device__ __forceinline__ bool last_of_splits(const Gemm& p, float* acc, int* last) {
  const int tile = blockIdx.y * gridDim.x + blockIdx.x, tid = threadIdx.x;
  float* parts = p.workspace + (i64)tile * gridDim.z * (N * GEMM_THREADS);
  float* mine = parts + (i64)blockIdx.z * (N * GEMM_THREADS);
#pragma unroll
  for (int i = 0; i < N; ++i) mine[i * GEMM_THREADS + tid] = acc[i];
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    const u32 arrived = atomicAdd(p.counters + tile, 1u);
    *last = arrived == gridDim.z - 1;
    if (*last) p.counters[tile] = 0;  // ready for the next launch
  }
  __syncthreads();
  if (!*last) return false;
  __threadfence();
  // Split-major, so each split's N loads are in flight together.
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i] = 0.0f;
  for (int z = 0; z < (int)gridDim.z; ++z) {
    const float* part = parts + (i64)z * (N * GEMM_THREADS) + tid;
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i] += __ldcg(part + i * GEMM_THREADS);
  }
  return true;
}

// Per tile row: its segment row of tap 0 (-1 past m) and, for ACT_RMS, its
// sqrt(mean(x^2) + eps) (candle rms_norm: x / sqrt(sum(x^2) / dim + eps) * weight; taps == 1).
template <int ROWS>
__device__ __forceinline__ void tile_rows(const Gemm& p, const Batch& b, int m0, i64* a_row,
                                          float* a_rms) {
  for (int r = threadIdx.x; r < ROWS; r += blockDim.x) {
    const int g = m0 + r;
    i64 row = -1;
    if (g < p.m) {
      int e, t;
      locate(b, g, p.rate, e, t);
      row = segment_row(b, e, t, p.rate, p.in_hist) - p.in_hist;
    }
    a_row[r] = row;
  }
  __syncthreads();
  if (p.act == ACT_RMS) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r = warp; r < ROWS; r += blockDim.x / 32) {
      float ss = 0.0f;
      if (a_row[r] >= 0) {
        const float* x = p.in + a_row[r] * p.cin;
#pragma unroll 8
        for (int c = lane; c < p.cin; c += 32) ss += x[c] * x[c];
      }
      for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      if (lane == 0) a_rms[r] = sqrtf(ss / (float)p.cin + p.eps);
    }
    __syncthreads();
  }
}

// Input element of tile row r at depth tap * cin + ch, rms-normed or activated if asked (ELU
// as candle's: exp(v) - 1 below zero).
__device__ __forceinline__ float load_a(const Gemm& p, const i64* a_row, const float* a_rms, int r,
                                        int tap, int ch) {
  if (a_row[r] < 0) return 0.0f;
  const float v = p.in[(a_row[r] + (i64)tap * p.dilation) * p.cin + ch];
  switch (p.act) {
    case ACT_RMS: return __fmul_rn(__fdiv_rn(v, a_rms[r]), p.act_w[ch]);
    case ACT_ELU: return v > 0.0f ? v : __fsub_rn(expf(v), 1.0f);
    case ACT_TANH: return tanhf(v);
    default: return v;
  }
}

// The tiled kernels' per-thread sums: TM rows x 4 columns, and for a folded launch the sums of
// the splits already walked.
template <int TM>
struct TileSums {
  float acc[TM][4], total[TM][4];
  __device__ void zero() {
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = total[i][j] = 0.0f;
  }
  // A folded launch at the end of a split: its sums join the earlier splits' (from zero, in
  // split order, as last_of_splits adds them) and restart from zero.
  __device__ void end_split() {
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        total[i][j] += acc[i][j];
        acc[i][j] = 0.0f;
      }
  }
  // Once the depth is walked: the tile's sums in `acc`. A folded launch takes its total; in a
  // split launch the last block of the tile to arrive adds the splits and the others return
  // false. Every thread of the block must call it.
  template <bool FOLD>
  __device__ bool finish(const Gemm& p, int* last_split) {
    if constexpr (FOLD) {
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = total[i][j];
      return true;
    }
    return gridDim.z == 1 || last_of_splits<TM * 4>(p, &acc[0][0], last_split);
  }
};

// GEMM row g's N adjacent outputs from column c0 (even) on, through the epilogue.
template <int N>
__device__ __forceinline__ void store_cols(const Gemm& p, const Batch& b, int g, int c0,
                                           const float (&acc)[N]) {
  const OutRow row = out_row(p, b, g);
  if (row.e < 0) return;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const int c = c0 + j;
    if (c >= p.n) break;
    store(p, row, c, acc[j], j % 2 == 0 ? acc[j + 1] : 0.0f, residual(p, row, c));
  }
}

template <int BM, bool FOLD>
__device__ __forceinline__ void conv_gemm(const Gemm& p, const Batch& b) {
  constexpr int TM = BM / 16;
  // Rows padded by 4 floats: keeps float4 alignment, and the transposing stores of a warp
  // (16 depths x 2 rows) meet at most 2 to a bank.
  __shared__ __align__(16) float as[2][BK][BM + 4];
  __shared__ __align__(16) float bs[2][BK][BN];
  __shared__ i64 a_row[BM];     // segment row of tap 0 for each tile row; -1 past m
  __shared__ float a_rms[BM];   // ACT_RMS: sqrt(mean(x^2) + eps) of each tile row
  __shared__ int last_split;

  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
  const int k_begin = FOLD ? 0 : blockIdx.z * p.k_split;
  const int k_end = FOLD ? p.k : min(p.k, k_begin + p.k_split);

  tile_rows<BM>(p, b, m0, a_row, a_rms);

  // Each thread loads A column tid % BK of rows tid / BK + 16 i, and one float4 of B.
  float ra[TM];
  float4 rb;
  auto load = [&](int k0) {
    // One depth per thread, so the division is done once per chunk.
    const int kk = k0 + tid % BK, tap = kk / p.cin, ch = kk - tap * p.cin;
#pragma unroll
    for (int i = 0; i < TM; ++i)
      ra[i] = kk < k_end ? load_a(p, a_row, a_rms, tid / BK + 16 * i, tap, ch) : 0.0f;
    const int bk = k0 + tid / 16, bn = n0 + (tid % 16) * 4;
    rb = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (bk < k_end) {
      const float* src = p.w + (i64)bk * p.n + bn;
      if (p.n % 4 == 0) {
        if (bn < p.n) rb = *reinterpret_cast<const float4*>(src);
      } else {
        if (bn < p.n) rb.x = src[0];
        if (bn + 1 < p.n) rb.y = src[1];
        if (bn + 2 < p.n) rb.z = src[2];
        if (bn + 3 < p.n) rb.w = src[3];
      }
    }
  };
  auto stage = [&](int buf) {
#pragma unroll
    for (int i = 0; i < TM; ++i) as[buf][tid % BK][tid / BK + 16 * i] = ra[i];
    *reinterpret_cast<float4*>(&bs[buf][tid / 16][(tid % 16) * 4]) = rb;
  };

  TileSums<TM> sums;
  sums.zero();
  auto& acc = sums.acc;
  int split_left = p.k_split;  // FOLD: depth left in the current split

  if (k_begin < k_end) {
    load(k_begin);
    stage(0);
  }
  __syncthreads();
  int buf = 0;
  for (int k0 = k_begin; k0 < k_end; k0 += BK) {
    const bool more = k0 + BK < k_end;
    if (more) load(k0 + BK);  // in flight while this chunk is multiplied
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      const float4 w = *reinterpret_cast<const float4*>(&bs[buf][kk][tx * 4]);
      float a[TM];
      if constexpr (TM % 4 == 0) {
#pragma unroll
        for (int i = 0; i < TM; i += 4)
          *reinterpret_cast<float4*>(&a[i]) =
              *reinterpret_cast<const float4*>(&as[buf][kk][ty * TM + i]);
      } else {
#pragma unroll
        for (int i = 0; i < TM; ++i) a[i] = as[buf][kk][ty * TM + i];
      }
#pragma unroll
      for (int i = 0; i < TM; ++i) {
        acc[i][0] += a[i] * w.x;
        acc[i][1] += a[i] * w.y;
        acc[i][2] += a[i] * w.z;
        acc[i][3] += a[i] * w.w;
      }
    }
    if constexpr (FOLD) {
      split_left -= BK;
      if (split_left == 0 || !more) {
        sums.end_split();
        split_left = p.k_split;
      }
    }
    if (more) stage(buf ^ 1);
    __syncthreads();
    buf ^= 1;
  }

  if (!sums.template finish<FOLD>(p, &last_split)) return;

  // Row by row: gathering every row's residuals before the first store measured no faster here
  // and its registers cost a resident block per SM.
#pragma unroll
  for (int i = 0; i < TM; ++i) store_cols(p, b, m0 + ty * TM + i, n0 + tx * 4, acc[i]);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
    conv_gemm_16(const Gemm p, const Batch b) {
  conv_gemm<16, false>(p, b);
}
extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
    conv_gemm_32(const Gemm p, const Batch b) {
  conv_gemm<32, false>(p, b);
}
extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
    conv_gemm_64(const Gemm p, const Batch b) {
  conv_gemm<64, false>(p, b);
}
extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
    conv_gemm_128(const Gemm p, const Batch b) {
  conv_gemm<128, false>(p, b);
}
extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
    conv_gemm_fold_64(const Gemm p, const Batch b) {
  conv_gemm<64, true>(p, b);
}

// The tiled GEMM for products whose input is read as stored (no norm or activation on load)
// and whose rows and columns can be copied 16 bytes at a time (cin a multiple of BK, so a depth
// chunk never straddles two taps, and n a multiple of 4): 128 x 64 tiles, both operands copied
// into shared memory by cp.async PIPE_STAGES - 1 chunks ahead of the one being multiplied.
// conv_gemm stages one chunk at a time through registers, with two barriers per chunk, and
// measured bound by that staging, not by its multiply-adds (docs/codec.md).
// - f32 (TF32 false): each thread 8 rows (ty + 16 i) x 4 columns. Every output is still one
//   multiply-add chain over its depth in order from zero, and the splits are added as conv_gemm
//   adds them, so for the same splits the result is conv_gemm's bit for bit (a GPU unit test in
//   src/encoder/mod.rs compares them).
// - TF32 (the codec's tensor-core mode): each warp a 32 x 32 block of the tile as 2 x 4
//   mma.sync m16n8k8 tiles, operands rounded to TF32 (10-bit mantissa) and f32 sums. The
//   hardware adds each 8-deep step in its own fixed order, so a row's outputs still do not
//   depend on the other rows of the pass, and splits are added as in the f32 kernel.
// The host only plans it where k and every split's depth are multiples of BK (no partial chunk).
#define PIPE_BM 128
#define PIPE_STAGES 3
#define PIPE_AK (BK + 4)  // A rows padded: 16-byte aligned, a warp's two rows in other banks

// One depth step of a row's 4 sums, in conv_gemm's form (each a fused multiply-add).
__device__ __forceinline__ void fma_row(float (&acc)[4], float a, float4 w) {
  acc[0] += a * w.x;
  acc[1] += a * w.y;
  acc[2] += a * w.z;
  acc[3] += a * w.w;
}

__device__ __forceinline__ u32 to_tf32(float v) {
  u32 r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
  return r;
}

// d += a (16 x 8, row-major) * b (8 x 8, column-major), TF32 in, f32 sums.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <bool FOLD, bool TF32>
__device__ __forceinline__ void conv_gemm_pipe(const Gemm& p, const Batch& b) {
  constexpr int TM = 8;
  // B rows padded by 8 floats for TF32: an mma fragment reads 4 depths x 8 columns, which then
  // fall in 32 different banks.
  constexpr int BS_N = TF32 ? BN + 8 : BN;
  __shared__ __align__(16) float as[PIPE_STAGES][PIPE_BM][PIPE_AK];
  __shared__ __align__(16) float bs[PIPE_STAGES][BK][BS_N];
  __shared__ i64 a_row[PIPE_BM];
  __shared__ float a_rms[PIPE_BM];  // unused: no norm on load
  __shared__ int last_split;

  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  // TF32: warp w owns tile rows 32 (w % 4).. and columns 32 (w / 4)..; lane = 4 group + quad.
  const int warp = tid / 32, group = (tid % 32) / 4, quad = tid % 4;
  const int wm = 32 * (warp % 4), wn = 32 * (warp / 4);
  const int n0 = blockIdx.x * BN, m0 = blockIdx.y * PIPE_BM;
  const int k_begin = FOLD ? 0 : blockIdx.z * p.k_split;
  const int k_end = FOLD ? p.k : min(p.k, k_begin + p.k_split);

  tile_rows<PIPE_BM>(p, b, m0, a_row, a_rms);

  // Chunk k0 into stage s: each thread copies a quarter row of A for two rows and a float4 of B.
  // Every call commits a group, empty past the end, so the waits below count the same.
  auto issue = [&](int k0, int s) {
    if (k0 < k_end) {
      const int tap = k0 / p.cin, ch = k0 - tap * p.cin + (tid % 4) * 4;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int r = tid / 4 + 64 * j;
        const i64 row = a_row[r];
        const float* src = row >= 0 ? p.in + (row + (i64)tap * p.dilation) * p.cin + ch : p.in;
        cp_async16(smem_addr(&as[s][r][(tid % 4) * 4]), src, row >= 0);
      }
      const int kr = tid / 16, c = n0 + tx * 4;
      const bool ok = c < p.n;
      cp_async16(smem_addr(&bs[s][kr][tx * 4]), ok ? p.w + (i64)(k0 + kr) * p.n + c : p.w, ok);
    }
    cp_async_commit();
  };

  // f32: acc[i] is row ty + 16 i, columns tx * 4... TF32: acc[4 mi + nj] is mma tile (mi, nj)'s
  // fragment: rows wm + 16 mi + group (+ 8 for the last two), columns wn + 8 nj + 2 quad (+ 1).
  TileSums<TM> sums;
  sums.zero();
  auto& acc = sums.acc;
  int split_left = p.k_split;  // FOLD: depth left in the current split

#pragma unroll
  for (int s = 0; s < PIPE_STAGES - 1; ++s) issue(k_begin + s * BK, s);
  int stage = 0;
  for (int k0 = k_begin; k0 < k_end; k0 += BK) {
    asm volatile("cp.async.wait_group %0;" ::"n"(PIPE_STAGES - 2) : "memory");
    // Chunk k0 has landed for every thread, and all are done with the stage refilled next.
    __syncthreads();
    issue(k0 + (PIPE_STAGES - 1) * BK, stage == 0 ? PIPE_STAGES - 1 : stage - 1);
    if constexpr (TF32) {
#pragma unroll
      for (int k8 = 0; k8 < BK; k8 += 8) {
        u32 fa[2][4], fb[4][2];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          const float* r0 = &as[stage][wm + 16 * mi + group][k8 + quad];
          const float* r8 = r0 + 8 * PIPE_AK;
          fa[mi][0] = to_tf32(r0[0]);
          fa[mi][1] = to_tf32(r8[0]);
          fa[mi][2] = to_tf32(r0[4]);
          fa[mi][3] = to_tf32(r8[4]);
        }
#pragma unroll
        for (int nj = 0; nj < 4; ++nj) {
          const float* c = &bs[stage][k8 + quad][wn + 8 * nj + group];
          fb[nj][0] = to_tf32(c[0]);
          fb[nj][1] = to_tf32(c[4 * BS_N]);
        }
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
          for (int nj = 0; nj < 4; ++nj) mma_tf32(acc[4 * mi + nj], fa[mi], fb[nj]);
      }
    } else {
#pragma unroll
      for (int k4 = 0; k4 < BK; k4 += 4) {
        const float4 w0 = *reinterpret_cast<const float4*>(&bs[stage][k4][tx * 4]);
        const float4 w1 = *reinterpret_cast<const float4*>(&bs[stage][k4 + 1][tx * 4]);
        const float4 w2 = *reinterpret_cast<const float4*>(&bs[stage][k4 + 2][tx * 4]);
        const float4 w3 = *reinterpret_cast<const float4*>(&bs[stage][k4 + 3][tx * 4]);
#pragma unroll
        for (int i = 0; i < TM; ++i) {
          const float4 a = *reinterpret_cast<const float4*>(&as[stage][ty + 16 * i][k4]);
          fma_row(acc[i], a.x, w0);
          fma_row(acc[i], a.y, w1);
          fma_row(acc[i], a.z, w2);
          fma_row(acc[i], a.w, w3);
        }
      }
    }
    if constexpr (FOLD) {
      split_left -= BK;
      if (split_left == 0 || k0 + BK >= k_end) {
        sums.end_split();
        split_left = p.k_split;
      }
    }
    stage = stage == PIPE_STAGES - 1 ? 0 : stage + 1;
  }

  if (!sums.template finish<FOLD>(p, &last_split)) return;

  if constexpr (TF32) {
#pragma unroll
    for (int t = 0; t < TM; ++t) {
      const int g = m0 + wm + 16 * (t / 4) + group, c = n0 + wn + 8 * (t % 4) + 2 * quad;
      const float top[2] = {acc[t][0], acc[t][1]}, bottom[2] = {acc[t][2], acc[t][3]};
      store_cols(p, b, g, c, top);
      store_cols(p, b, g + 8, c, bottom);
    }
  } else {
#pragma unroll
    for (int i = 0; i < TM; ++i) store_cols(p, b, m0 + ty + 16 * i, n0 + tx * 4, acc[i]);
  }
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
    conv_gemm_pipe_128(const Gemm p, const Batch b) {
  conv_gemm_pipe<false, false>(p, b);
}
extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
    conv_gemm_pipe_fold_128(const Gemm p, const Batch b) {
  conv_gemm_pipe<true, false>(p, b);
}
extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
    conv_gemm_pipe_tf32_128(const Gemm p, const Batch b) {
  conv_gemm_pipe<false, true>(p, b);
}
extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
    conv_gemm_pipe_tf32_fold_128(const Gemm p, const Batch b) {
  conv_gemm_pipe<true, true>(p, b);
}

// The same GEMM for few rows (the transformer at small batches), where the tiled kernel's tile
// is mostly empty rows. A block owns MT rows x 32 columns over a depth range (the depth split
// across gridDim.z blocks as in the tiled kernel): the rows' inputs are staged in shared memory
// SK_KC deep at a time, each warp streams every 8th group of 4 weight rows straight from global
// memory (lane: one row of the 4, four adjacent columns), and the partial sums are added in a
// fixed order (row groups, splits, warps). Same epilogue as the tiled kernel.
#define SK_COLS 32
#define SK_KC 256
#define SK_WARPS (GEMM_THREADS / 32)

template <int MT>
__device__ __forceinline__ void skinny_gemm(const Gemm& p, const Batch& b) {
  __shared__ __align__(16) float xa[SK_KC][MT];  // inputs, depth-major
  __shared__ float red[SK_WARPS][MT][SK_COLS];
  __shared__ i64 a_row[MT];
  __shared__ float a_rms[MT];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int group = lane / 8, col = (lane % 8) * 4;
  __shared__ int last_split;
  const int n0 = blockIdx.x * SK_COLS, m0 = blockIdx.y * MT;
  const int k_begin = blockIdx.z * p.k_split, k_end = min(p.k, k_begin + p.k_split);
  const bool vector = p.n % 4 == 0;
  tile_rows<MT>(p, b, m0, a_row, a_rms);

  float acc[MT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  for (int k0 = k_begin; k0 < k_end; k0 += SK_KC) {
    const int kc = min(SK_KC, k_end - k0);
    __syncthreads();  // the previous chunk is consumed
#pragma unroll 4
    for (int i = tid; i < kc * MT; i += GEMM_THREADS) {
      const int r = i / kc, kk = i - r * kc;  // consecutive threads: consecutive depths of a row
      const int tap = (k0 + kk) / p.cin;
      xa[kk][r] = load_a(p, a_row, a_rms, r, tap, k0 + kk - tap * p.cin);
    }
    __syncthreads();
    const int c = n0 + col;
#pragma unroll 4
    for (int kk = warp * 4 + group; kk < kc; kk += 4 * SK_WARPS) {
      const float* src = p.w + (i64)(k0 + kk) * p.n + c;
      float4 w = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (vector) {
        if (c < p.n) w = *reinterpret_cast<const float4*>(src);
      } else {
        if (c < p.n) w.x = src[0];
        if (c + 1 < p.n) w.y = src[1];
        if (c + 2 < p.n) w.z = src[2];
        if (c + 3 < p.n) w.w = src[3];
      }
      float a[MT];
#pragma unroll
      for (int i = 0; i < MT; i += 4)
        *reinterpret_cast<float4*>(&a[i]) = *reinterpret_cast<const float4*>(&xa[kk][i]);
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        acc[i][0] += a[i] * w.x;
        acc[i][1] += a[i] * w.y;
        acc[i][2] += a[i] * w.z;
        acc[i][3] += a[i] * w.w;
      }
    }
  }
  // The 4 row groups of a warp (lane bits 3 and 4), the splits, then the warps.
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      acc[i][j] += __shfl_xor_sync(0xffffffffu, acc[i][j], 8);
      acc[i][j] += __shfl_xor_sync(0xffffffffu, acc[i][j], 16);
    }
  if (gridDim.z > 1 && !last_of_splits<MT * 4>(p, &acc[0][0], &last_split)) return;
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (group == 0) red[warp][i][col + j] = acc[i][j];
  __syncthreads();
  for (int o = tid; o < MT * SK_COLS / 2; o += GEMM_THREADS) {
    const int r = o / (SK_COLS / 2), c = n0 + (o % (SK_COLS / 2)) * 2;
    const OutRow row = out_row(p, b, m0 + r);
    if (row.e < 0 || c >= p.n) continue;
    const float res0 = residual(p, row, c), res1 = residual(p, row, c + 1);
    float v0 = 0.0f, v1 = 0.0f;
    for (int w = 0; w < SK_WARPS; ++w) {
      v0 += red[w][r][c - n0];
      v1 += red[w][r][c - n0 + 1];
    }
    store(p, row, c, v0, v1, res0);
    if (c + 1 < p.n) store(p, row, c + 1, v1, 0.0f, res1);
  }
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
    skinny_gemm_4(const Gemm p, const Batch b) {
  skinny_gemm<4>(p, b);
}
extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
    skinny_gemm_16(const Gemm p, const Batch b) {
  skinny_gemm<16>(p, b);
}

// Block-wide sum and max for 1-D blocks (`scratch`: one float per warp).
__device__ float block_sum(float v, float* scratch) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();  // scratch may still be read from the previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int i = 0; i < warps; ++i) total += scratch[i];
  return total;
}

__device__ float block_max(float v, float* scratch) {
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float m = scratch[0];
  for (int i = 1; i < warps; ++i) m = fmaxf(m, scratch[i]);
  return m;
}

// ---------------------------------------------------------------------------------------------
// Attention of one transformer layer: mirrors `PreTransformer::attention` (transformer.rs)
// between the q/k/v and the o projections. One block per (head, entry, new query): it rotates
// its query, appends its own frame's key and value to the stream's ring (RoPE on absolute
// positions), and stages every key and value row its query can see in shared memory (one round
// trip to memory instead of one per key): earlier passes' rows from the ring, this pass's rows
// rotated again from q|k|v, since the blocks of one launch do not wait for each other's ring
// rows. Then the query attends to positions q - window < k <= q, k >= 0. A block per query, so
// that a pass's queries do not run one after another (16 frames would take 16 times one
// query's barriers). The ring holds `ring` >= window + 15 rows
// (position p at row p % ring), so a pass of up to 16 frames never overwrites a key one of its
// own queries needs.

struct AttnParams {
  const float* qkv;  // [frames][3 * width]: q | k | v, before RoPE
  float* out;        // [frames][width]
  float* k_ring;     // this layer's [slots][layers][ring][width] block starts at layer offset
  float* v_ring;
  int slot_stride;   // floats per slot (all layers)
  int ring, width, head_dim, window;
  float scale;
};

extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
    attention(const AttnParams p, const Batch b) {
  __shared__ float q[MAX_HEAD_DIM];
  __shared__ float prob[MAX_WINDOW];
  __shared__ float scratch[ATTN_THREADS / 32];
  // Keys then values of the visible positions, rows padded by 4 floats so that threads reading
  // different rows at the same depth hit different banks.
  extern __shared__ __align__(16) float kv[];
  const int head = blockIdx.x, e = blockIdx.y, t = blockIdx.z;
  // (the grid's depth is the most frames an entry of the pass can have)
  if (t >= b.entry_frames[e]) return;
  const int f0 = b.entry_frame0[e], pos0 = b.entry_pos0[e], pos = pos0 + t;
  const int hd = p.head_dim, half = hd / 2, col0 = head * hd, stride = hd + 4;
  float* k_ring = p.k_ring + (i64)b.entry_slot[e] * p.slot_stride;
  float* v_ring = p.v_ring + (i64)b.entry_slot[e] * p.slot_stride;
  const int first = max(0, pos - p.window + 1), keys = pos - first + 1;
  float* ks = kv;
  float* vs = kv + keys * stride;

  // This pass's rows up to the query's: x * cos + rotate_half(x) * sin, rotate_half(x) =
  // [-x2, x1]; products rounded like the CPU.
  for (int i = threadIdx.x; i < (t + 1) * hd; i += blockDim.x) {
    const int u = i / hd, d = i % hd, f = f0 + u, r = pos0 + u - first;
    const float* row = p.qkv + (i64)f * 3 * p.width + col0;
    const float c = b.rope_cos[f * half + d % half], s = b.rope_sin[f * half + d % half];
    const int other = d < half ? d + half : d - half;
    const float sign = d < half ? -1.0f : 1.0f;
    const float* k_row = row + p.width;
    const float key = __fadd_rn(__fmul_rn(k_row[d], c), __fmul_rn(sign * k_row[other], s));
    const float value = row[2 * p.width + d];
    if (r >= 0) {
      ks[r * stride + d] = key;
      vs[r * stride + d] = value;
    }
    if (u == t) {
      q[d] = __fadd_rn(__fmul_rn(row[d], c), __fmul_rn(sign * row[other], s));
      const i64 slot_row = (i64)(pos % p.ring) * p.width + col0 + d;
      k_ring[slot_row] = key;
      v_ring[slot_row] = value;
    }
  }
  // Earlier passes' rows: positions first .. pos0 - 1.
  const int quads = hd / 4, old = max(0, pos0 - first);
#pragma unroll 4
  for (int i = threadIdx.x; i < old * quads; i += blockDim.x) {
    const int r = i / quads, d = 4 * (i % quads);
    const i64 src = (i64)((first + r) % p.ring) * p.width + col0 + d;
    *reinterpret_cast<float4*>(&ks[r * stride + d]) =
        *reinterpret_cast<const float4*>(&k_ring[src]);
    *reinterpret_cast<float4*>(&vs[r * stride + d]) =
        *reinterpret_cast<const float4*>(&v_ring[src]);
  }
  __syncthreads();

  // Thread j scores key j (window <= ATTN_THREADS); softmax as candle's softmax_last_dim:
  // max, exp(s - max), sum, divide.
  const int j = threadIdx.x;
  float score = -__int_as_float(0x7f800000);
  if (j < keys) {
    float dot = 0.0f;
    for (int d = 0; d < hd; d += 4) {
      const float4 k4 = *reinterpret_cast<const float4*>(&ks[j * stride + d]);
      dot += q[d] * k4.x + q[d + 1] * k4.y + q[d + 2] * k4.z + q[d + 3] * k4.w;
    }
    score = __fmul_rn(dot, p.scale);
  }
  const float mx = block_max(score, scratch);
  const float ex = j < keys ? expf(score - mx) : 0.0f;
  const float sum = block_sum(ex, scratch);
  if (j < keys) prob[j] = __fdiv_rn(ex, sum);
  __syncthreads();
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.0f;
    for (int k = 0; k < keys; ++k) acc += prob[k] * vs[k * stride + d];
    p.out[(i64)(f0 + t) * p.width + col0 + d] = acc;
  }
}

// ---------------------------------------------------------------------------------------------
// ConvNeXt depthwise conv + LayerNorm: mirrors `DepthwiseCausalConv::forward` and
// `LayerNorm::forward` (conv.rs) as used by `UpsampleStage::convnext`. One block per row.

struct DwNormParams {
  const float* in;     // segments, hist = taps - 1
  float* out;          // [rows][channels]
  const float* w;      // [taps][channels]
  const float* bias;
  const float* norm_w;
  const float* norm_b;
  int channels, taps, rate;
  float eps;
};

extern "C" __global__ void __launch_bounds__(256) dwconv_norm(const DwNormParams p, const Batch b) {
  extern __shared__ float h[];  // [channels]
  __shared__ float scratch[32];
  const int g = blockIdx.x, hist = p.taps - 1;
  int e, t;
  locate(b, g, p.rate, e, t);
  const float* x = p.in + (segment_row(b, e, t, p.rate, hist) - hist) * p.channels;
  float sum = 0.0f;
  for (int c = threadIdx.x; c < p.channels; c += blockDim.x) {
    float acc = p.bias[c];
    for (int j = 0; j < p.taps; ++j)
      acc = __fadd_rn(acc, __fmul_rn(x[(i64)j * p.channels + c], p.w[j * p.channels + c]));
    h[c] = acc;
    sum += acc;
  }
  const float mean = block_sum(sum, scratch) / (float)p.channels;
  float sq = 0.0f;
  for (int c = threadIdx.x; c < p.channels; c += blockDim.x) {
    const float d = __fsub_rn(h[c], mean);
    sq += d * d;
  }
  const float denom = sqrtf(block_sum(sq, scratch) / (float)p.channels + p.eps);
  float* out = p.out + (i64)g * p.channels;
  for (int c = threadIdx.x; c < p.channels; c += blockDim.x)
    out[c] =
        __fadd_rn(__fmul_rn(__fdiv_rn(__fsub_rn(h[c], mean), denom), p.norm_w[c]), p.norm_b[c]);
}

// ---------------------------------------------------------------------------------------------
// The last layer: mirrors `conv_out` (causal k=7 conv to one channel) and the clamp at the end
// of `CodecDecoder::forward`; its input arrives through `final_act` already (applied by the
// producer's epilogue). A block computes FINAL_ROWS consecutive samples of one entry (rate is a
// multiple of FINAL_ROWS, checked on the host), staging the input rows, history included, in
// shared memory. Four threads per sample.

#define FINAL_ROWS 64

struct FinalParams {
  const float* in;          // segments, hist = taps - 1
  float* out;               // [frames * rate] samples in pass order
  const float* w;           // [taps][channels]
  float bias;
  int channels, taps, rate, rows;
};

extern "C" __global__ void __launch_bounds__(256) final_conv(const FinalParams p, const Batch b) {
  extern __shared__ float x[];  // [FINAL_ROWS + taps - 1][channels]
  const int g0 = blockIdx.x * FINAL_ROWS, hist = p.taps - 1;
  int e, t0;
  locate(b, g0, p.rate, e, t0);
  const float* src = p.in + (segment_row(b, e, t0, p.rate, hist) - hist) * p.channels;
  const int n = (FINAL_ROWS + hist) * p.channels;
  for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] = src[i];
  __syncthreads();
  const int r = threadIdx.x / 4, part = threadIdx.x % 4, k = p.taps * p.channels;
  float acc = 0.0f;
  for (int i = part; i < k; i += 4) acc += x[r * p.channels + i] * p.w[i];
  acc += __shfl_xor_sync(0xffffffffu, acc, 1);
  acc += __shfl_xor_sync(0xffffffffu, acc, 2);
  if (part == 0 && g0 + r < p.rows) p.out[g0 + r] = fminf(fmaxf(acc + p.bias, -1.0f), 1.0f);
}
