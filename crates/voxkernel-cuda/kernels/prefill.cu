// voxkernel batched prefill: the prompt rows of many sequences through the text projection and
// the talker's layers at once (src/prefill.rs drives it; docs/kernel-notes.md, "Prefill v2").
//
// Matrix products run on the tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulate). The
// weights are bf16 already; every f32 activation is stored as three bf16 "pieces" (hi, mid, lo:
// x == hi + mid + lo to 24 bits) and the product sums the three, so the result keeps f32
// accuracy. A product may split its depth over blockIdx.z: each split writes its own partial
// sums, and the kernel that consumes the product adds them in a fixed order (deterministic).
// The codec head and the sampling of each sequence's last row stay in frame.cu (MODE_HEAD).
// No toolkit headers: NVRTC compiles this file with nothing but its own builtins.

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef long long i64;

#define PIECES 3
#define GEMM_THREADS 128
#define TILE_F 128  // output features per block (4 warps: 2 x 64 features by 2 x 32 rows)
#define TILE_R 64   // rows per block
#define TILE_K 32
#define STAGES 4
#define SROW (TILE_K + 8)  // shared row of 80 bytes: ldmatrix reads 8 rows without bank conflicts
#define ROW_THREADS 1024   // row kernels: a whole talker row per block, one element per thread
#define ROPE_WARPS 8
#define ATTN_WARPS 8
#define ATTN_TASKS_PER_WARP 2  // (row, q head) tasks: one per warp unless a kv group is wider
#define KEY_CHUNK 32
#define MAX_HEAD_DIM 256
#define NEG_INF (-__int_as_float(0x7f800000))

#define CODEC_NONE 0
#define CODEC_ID 1
#define CODEC_SPEAKER 2
#define CODEC_REFERENCE 3

// Per-segment words of the segment table: a segment is a run of one sequence's rows in a pass.
#define SEG_SLOT 0
#define SEG_POS0 1   // talker position of its first row
#define SEG_ROW0 2   // its first row within the pass
#define SEG_ROWS 3
#define SEG_WORDS 4

__device__ __forceinline__ float bf2f(bf16_t v) { return __uint_as_float(((u32)v) << 16); }

__device__ __forceinline__ bf16_t f2bf(float x) {
  bf16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}

// x == hi + mid + lo, each rounded to nearest: every subtraction is exact, so the pieces carry
// all 24 significant bits of x.
__device__ __forceinline__ void store_pieces(bf16_t* planes, i64 plane, i64 at, float x) {
  const bf16_t hi = f2bf(x);
  const float r1 = x - bf2f(hi);
  const bf16_t mid = f2bf(r1);
  const bf16_t lo = f2bf(r1 - bf2f(mid));
  planes[at] = hi;
  planes[plane + at] = mid;
  planes[2 * plane + at] = lo;
}

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

__device__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = 0.f;
  for (int i = 0; i < (int)(blockDim.x >> 5); i++) t += red[i];
  __syncthreads();
  return t;
}

#define GATHER 16      // partial sums loaded at once
#define ROPE_GATHER 8  // per dim of a lane, in qk_rope

// The sum over the splits of a product's partials at `at`, in split order. All loads of a chunk
// are issued before the first add: with few rows this is latency, one round trip per chunk
// rather than per split. Adding the zeros of absent splits changes no bit.
__device__ __forceinline__ float gathered(const float* part, int splits, i64 split_stride, i64 at) {
  float s = 0.f;
  for (int z0 = 0; z0 < splits; z0 += GATHER) {
    float v[GATHER];
#pragma unroll
    for (int j = 0; j < GATHER; j++)
      v[j] = z0 + j < splits ? part[(i64)(z0 + j) * split_stride + at] : 0.f;
#pragma unroll
    for (int j = 0; j < GATHER; j++) s += v[j];
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// the matrix product: out[z][r][f] = sum over k in split z of W[f][k] * (sum of pieces of X[r][k])

struct Gemm {
  const bf16_t* w;  // [n][k], 16-byte aligned rows (k % 8 == 0)
  const bf16_t* x;  // [pieces][rows][k]
  float* out;       // [splits][rows][n]
  i64 plane;        // elements between two pieces of x
  int n, k, rows, pieces;
  int k_split;      // depth of one split, a multiple of TILE_K
};

static_assert(sizeof(Gemm) == 56, "Gemm layout changed: update src/layout.rs");

__device__ __forceinline__ void cp_async_wait_pending() {
  asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2));
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ void mma_bf16(float* c, const u32* a, const u32* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Weights are the mma's A operand (16 features x 16 depth), activation rows its B operand
// (16 depth x 8 rows): each weight fragment is loaded once and used for all three pieces.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS) gemm(const Gemm p) {
  extern __shared__ __align__(16) bf16_t gsm[];
  bf16_t* sa = gsm;                           // [STAGES][TILE_F][SROW]
  bf16_t* sb = gsm + STAGES * TILE_F * SROW;  // [STAGES][PIECES][TILE_R][SROW]
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int f0 = blockIdx.x * TILE_F, r0 = blockIdx.y * TILE_R;
  const int kbeg = blockIdx.z * p.k_split;
  const int kend = min(p.k, kbeg + p.k_split);
  const int steps = (kend - kbeg + TILE_K - 1) / TILE_K;
  const int wf = (warp & 1) * 64, wr = (warp >> 1) * 32;
  const u32 sa0 = smem_addr(sa), sb0 = smem_addr(sb);

  auto load = [&](int stage, int step) {
    const int k0 = kbeg + step * TILE_K;
    for (int c = tid; c < TILE_F * 4; c += GEMM_THREADS) {
      const int row = c >> 2, k = k0 + (c & 3) * 8, f = f0 + row;
      const bool ok = f < p.n && k < kend;
      const u32 dst = sa0 + 2 * ((stage * TILE_F + row) * SROW + (c & 3) * 8);
      cp_async16(dst, ok ? p.w + (i64)f * p.k + k : p.w, ok);
    }
    for (int c = tid; c < p.pieces * TILE_R * 4; c += GEMM_THREADS) {
      const int piece = c / (TILE_R * 4), rem = c % (TILE_R * 4);
      const int row = rem >> 2, k = k0 + (rem & 3) * 8, r = r0 + row;
      const bool ok = r < p.rows && k < kend;
      const u32 dst = sb0 + 2 * (((stage * PIECES + piece) * TILE_R + row) * SROW + (rem & 3) * 8);
      cp_async16(dst, ok ? p.x + piece * p.plane + (i64)r * p.k + k : p.x, ok);
    }
  };

  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; i++)
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; s++) {
    if (s < steps) load(s, s);
    cp_async_commit();
  }
  for (int step = 0; step < steps; step++) {
    cp_async_wait_pending();
    __syncthreads();
    // The stage refilled here was read in the previous step, which every warp has finished.
    const int next = step + STAGES - 1;
    if (next < steps) load(next % STAGES, next);
    cp_async_commit();
    const int stage = step % STAGES;
#pragma unroll
    for (int kk = 0; kk < TILE_K; kk += 16) {
      u32 a[4][4];
#pragma unroll
      for (int mi = 0; mi < 4; mi++) {
        const int row = wf + mi * 16 + (lane & 15), col = kk + (lane >> 4) * 8;
        ldsm_x4(sa0 + 2 * ((stage * TILE_F + row) * SROW + col), a[mi][0], a[mi][1], a[mi][2],
                a[mi][3]);
      }
      for (int piece = 0; piece < p.pieces; piece++) {
        u32 b[4][2];
#pragma unroll
        for (int nj = 0; nj < 4; nj += 2) {
          const int row = wr + nj * 8 + (lane >> 4) * 8 + (lane & 7);
          const int col = kk + ((lane >> 3) & 1) * 8;
          ldsm_x4(sb0 + 2 * (((stage * PIECES + piece) * TILE_R + row) * SROW + col), b[nj][0],
                  b[nj][1], b[nj + 1][0], b[nj + 1][1]);
        }
#pragma unroll
        for (int mi = 0; mi < 4; mi++)
#pragma unroll
          for (int nj = 0; nj < 4; nj++) mma_bf16(acc[mi][nj], a[mi], b[nj]);
      }
    }
  }
  asm volatile("cp.async.wait_group 0;");

  float* out = p.out + (i64)blockIdx.z * p.rows * p.n;
#pragma unroll
  for (int mi = 0; mi < 4; mi++)
#pragma unroll
    for (int nj = 0; nj < 4; nj++) {
      const int f = f0 + wf + mi * 16 + (lane >> 2);
      const int r = r0 + wr + nj * 8 + (lane & 3) * 2;
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int fe = f + (e >> 1) * 8, re = r + (e & 1);
        if (fe < p.n && re < p.rows) out[(i64)re * p.n + fe] = acc[mi][nj][e];
      }
    }
}

// ---------------------------------------------------------------------------------------------
// the prompt rows: text_projection(text_embedding[id]) + codec track

struct Project {
  const bf16_t* text_embedding;   // [text_vocab][text_hidden]
  const bf16_t* bias;             // fc1 bias (bias_silu) or fc2 bias (project_out)
  const bf16_t* codec_embedding;  // [vocab][hidden]
  const bf16_t* cp_embedding;     // [groups - 1][cp_vocab][hidden]
  const float* speakers;          // [sequences][hidden]
  const int* rows;                // [rows][4]: text id, codec kind, codec value, destination row
  const int* ref_codes;           // [rows][groups]: a CODEC_REFERENCE row's frame, at its own row
  const float* part;              // the product to finish
  bf16_t* planes;                 // [pieces][rows][width]
  float* out;                     // destination rows, [*][hidden]
  int n_rows, splits, width;      // width: the padded row width of `planes` (a multiple of 8)
  int text_hidden, inter, hidden, cp_vocab, groups;
};

static_assert(sizeof(Project) == 112, "Project layout changed: update src/layout.rs");

// Text embeddings are bf16, so one piece holds them exactly; the padding columns are zero.
extern "C" __global__ void __launch_bounds__(ROW_THREADS) gather_text(const Project p) {
  const int r = blockIdx.x;
  const int id = p.rows[r * 4];
  const bf16_t* src = p.text_embedding + (i64)id * p.text_hidden;
  for (int i = threadIdx.x; i < p.width; i += ROW_THREADS)
    p.planes[(i64)r * p.width + i] = i < p.text_hidden ? src[i] : (bf16_t)0;
}

// silu(fc1 . t + b1), the input of fc2, in three pieces.
extern "C" __global__ void __launch_bounds__(ROW_THREADS) bias_silu(const Project p) {
  const int r = blockIdx.x;
  const i64 plane = (i64)p.n_rows * p.width, split = (i64)p.n_rows * p.inter;
  for (int i = threadIdx.x; i < p.width; i += ROW_THREADS) {
    float v = 0.f;
    if (i < p.inter) {
      const float d = gathered(p.part, p.splits, split, (i64)r * p.inter + i) + bf2f(p.bias[i]);
      v = d / (1.f + expf(-d));
    }
    store_pieces(p.planes, plane, (i64)r * p.width + i, v);
  }
}

// fc2 . h + b2 + the row's codec track, into its destination row.
extern "C" __global__ void __launch_bounds__(ROW_THREADS) project_out(const Project p) {
  const int r = blockIdx.x;
  const int kind = p.rows[r * 4 + 1], value = p.rows[r * 4 + 2], dest = p.rows[r * 4 + 3];
  const i64 split = (i64)p.n_rows * p.hidden;
  const int* codes = p.ref_codes + (i64)r * p.groups;
  for (int i = threadIdx.x; i < p.hidden; i += ROW_THREADS) {
    const float d = gathered(p.part, p.splits, split, (i64)r * p.hidden + i) + bf2f(p.bias[i]);
    float c = 0.f;
    if (kind == CODEC_ID) {
      c = bf2f(p.codec_embedding[(i64)value * p.hidden + i]);
    } else if (kind == CODEC_SPEAKER) {
      c = p.speakers[(i64)value * p.hidden + i];
    } else if (kind == CODEC_REFERENCE) {
      c = bf2f(p.codec_embedding[(i64)codes[0] * p.hidden + i]);
      for (int j = 1; j < p.groups; j++)
        c += bf2f(p.cp_embedding[((i64)(j - 1) * p.cp_vocab + codes[j]) * p.hidden + i]);
    }
    p.out[(i64)dest * p.hidden + i] = d + c;
  }
}

// ---------------------------------------------------------------------------------------------
// talker layer pieces

struct Rows {
  float* x;              // [rows][hidden]: the residual stream
  const float* part;     // the product to finish
  bf16_t* planes;        // [pieces][rows][width]: the next product's input
  const bf16_t* weight;  // a norm's weight
  const bf16_t* q_norm;
  const bf16_t* k_norm;
  const float2* rope;     // [max_len][head_dim / 2]: cos and sin of pos * inv_freq[i]
  float* q;               // [rows][n_heads * head_dim], normed and rotated
  float* k_cache;         // [slots][layers][n_kv][max_len][head_dim]
  float* v_cache;
  float* head;            // [sequences][head_stride]: a sequence's last row after the last layer
  const int* segments;    // [segments][SEG_WORDS]
  const int* row_segment; // [rows]
  const int* row_head;    // [rows]: the sequence index of a sequence's last row, else -1
  const int* tiles;       // [tiles][2]: segment, first row of the tile within the segment
  int rows, splits, hidden, inter, n_heads, n_kv, head_dim, layer, n_layers, max_len;
  int tile_rows, head_stride;
  float eps;
};

static_assert(sizeof(Rows) == 176, "Rows layout changed: update src/layout.rs");

// x += the product (when given); then, with a weight, RMSNorm(x) * weight in three pieces;
// with `head`, a sequence's last row is also copied there.
extern "C" __global__ void __launch_bounds__(ROW_THREADS) residual_norm(const Rows p) {
  __shared__ float red[ROW_THREADS / 32];
  const int r = blockIdx.x, H = p.hidden;
  float* x = p.x + (i64)r * H;
  const i64 split = (i64)p.rows * H;
  float ss = 0.f;
  for (int i = threadIdx.x; i < H; i += ROW_THREADS) {
    float v = x[i];
    if (p.part) {
      v += gathered(p.part, p.splits, split, (i64)r * H + i);
      x[i] = v;
    }
    ss += v * v;
  }
  if (p.head && p.row_head[r] >= 0) {
    float* dst = p.head + (i64)p.row_head[r] * p.head_stride;
    for (int i = threadIdx.x; i < H; i += ROW_THREADS) dst[i] = x[i];
  }
  if (!p.weight) return;
  const float rs = rsqrtf(block_sum(ss, red) / (float)H + p.eps);
  const i64 plane = (i64)p.rows * H;
  for (int i = threadIdx.x; i < H; i += ROW_THREADS)
    store_pieces(p.planes, plane, (i64)r * H + i, bf2f(p.weight[i]) * (x[i] * rs));
}

// One warp per (row, head), heads spread over blockIdx.y: q/k RMSNorm and RoPE at the row's
// position; q to `q`, k and v to the caches.
extern "C" __global__ void __launch_bounds__(ROPE_WARPS * 32) qk_rope(const Rows p) {
  __shared__ float vec[ROPE_WARPS][MAX_HEAD_DIM];
  const int r = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int hd = p.head_dim, half = hd / 2, qw = p.n_heads * hd, kvw = p.n_kv * hd;
  const int width = qw + 2 * kvw;
  const int* seg = p.segments + p.row_segment[r] * SEG_WORDS;
  const int pos = seg[SEG_POS0] + r - seg[SEG_ROW0];
  const i64 split = (i64)p.rows * width;
  const i64 at = (i64)r * width;
  float* v = vec[warp];
  const int h = blockIdx.y * ROPE_WARPS + warp;
  if (h < p.n_heads + p.n_kv) {
    const bool is_q = h < p.n_heads;
    const int g = h - p.n_heads;
    const int col = is_q ? h * hd : qw + g * hd;
    const bf16_t* nw = is_q ? p.q_norm : p.k_norm;
    // The head's (and for a kv head its v's) partial sums, all of a chunk of splits in flight at
    // once, each element summed in split order like `gathered`.
    float sums[MAX_HEAD_DIM / 32], values[MAX_HEAD_DIM / 32];
#pragma unroll
    for (int j = 0; j < MAX_HEAD_DIM / 32; j++) sums[j] = values[j] = 0.f;
    const i64 vcol = qw + kvw + g * hd;
    for (int z0 = 0; z0 < p.splits; z0 += ROPE_GATHER) {
      float a[MAX_HEAD_DIM / 32][ROPE_GATHER], b[MAX_HEAD_DIM / 32][ROPE_GATHER];
#pragma unroll
      for (int j = 0; j < MAX_HEAD_DIM / 32; j++)
#pragma unroll
        for (int z = 0; z < ROPE_GATHER; z++) {
          const int i = lane + 32 * j;
          const bool ok = i < hd && z0 + z < p.splits;
          const float* pz = p.part + (i64)(z0 + z) * split + at;
          a[j][z] = ok ? pz[col + i] : 0.f;
          b[j][z] = ok && !is_q ? pz[vcol + i] : 0.f;
        }
#pragma unroll
      for (int j = 0; j < MAX_HEAD_DIM / 32; j++)
#pragma unroll
        for (int z = 0; z < ROPE_GATHER; z++) {
          sums[j] += a[j][z];
          values[j] += b[j][z];
        }
    }
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < MAX_HEAD_DIM / 32; j++) {
      const int i = lane + 32 * j;
      if (i < hd) {
        v[i] = sums[j];
        ss += sums[j] * sums[j];
      }
    }
    const float rs = rsqrtf(warp_sum(ss) / (float)hd + p.eps);
    __syncwarp();
    for (int i = lane; i < hd; i += 32) v[i] = bf2f(nw[i]) * (v[i] * rs);
    __syncwarp();
    float* dst;
    if (is_q) {
      dst = p.q + (i64)r * qw + h * hd;
    } else {
      const i64 head_base =
          (((i64)seg[SEG_SLOT] * p.n_layers + p.layer) * p.n_kv + g) * p.max_len + pos;
      dst = p.k_cache + head_base * hd;
      float* vdst = p.v_cache + head_base * hd;
#pragma unroll
      for (int j = 0; j < MAX_HEAD_DIM / 32; j++)
        if (lane + 32 * j < hd) vdst[lane + 32 * j] = values[j];
    }
    // The frame kernel's table, so that the prefill's keys are rotated exactly as its queries.
    const float2* rot = p.rope + (i64)pos * half;
    for (int i = lane; i < half; i += 32) {
      const float cs = rot[i].x, sn = rot[i].y;
      const float a = v[i], c = v[i + half];
      dst[i] = a * cs - c * sn;
      dst[i + half] = c * cs + a * sn;
    }
  }
}

// Causal attention of each row over its sequence's cache (positions 0..pos). One block per
// (tile of a segment's rows, kv head), one (row, q head) task per warp; keys come through shared
// memory KEY_CHUNK at a time, each lane scores one key (float4 reads, rows padded by 4 floats so
// the 8 lanes of a phase hit distinct banks), then the warp accumulates 4 dims per lane.
extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) attention(const Rows p) {
  extern __shared__ __align__(16) float asm_[];
  const int hd = p.head_dim, hd4 = hd / 4, gs = p.n_heads / p.n_kv, qw = p.n_heads * hd;
  const int kstride = hd + 4;
  float* ks = asm_;                       // [KEY_CHUNK][hd + 4]
  float* vs = ks + KEY_CHUNK * kstride;   // [KEY_CHUNK][hd]
  float* qs = vs + KEY_CHUNK * hd;        // [ATTN_WARPS * ATTN_TASKS_PER_WARP][hd]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = blockIdx.y;
  const int* tile = p.tiles + blockIdx.x * 2;
  const int* seg = p.segments + tile[0] * SEG_WORDS;
  const int t0 = tile[1];
  const int n_rows = min(p.tile_rows, seg[SEG_ROWS] - t0);
  const int n_tasks = n_rows * gs;
  const int row0 = seg[SEG_ROW0] + t0, pos0 = seg[SEG_POS0] + t0;
  const int last_pos = pos0 + n_rows - 1;
  const i64 head_base = (((i64)seg[SEG_SLOT] * p.n_layers + p.layer) * p.n_kv + g) * p.max_len;
  const float4* kc = reinterpret_cast<const float4*>(p.k_cache + head_base * hd);
  const float4* vc = reinterpret_cast<const float4*>(p.v_cache + head_base * hd);
  const float scale = rsqrtf((float)hd);

  for (int i = threadIdx.x; i < n_tasks * hd4; i += ATTN_WARPS * 32) {
    const int t = i / hd4, d4 = i % hd4;
    reinterpret_cast<float4*>(qs + t * hd)[d4] = reinterpret_cast<const float4*>(
        p.q + (i64)(row0 + t / gs) * qw + (g * gs + t % gs) * hd)[d4];
  }
  float m[ATTN_TASKS_PER_WARP], l[ATTN_TASKS_PER_WARP];
  float4 acc[ATTN_TASKS_PER_WARP][MAX_HEAD_DIM / 128];
#pragma unroll
  for (int j = 0; j < ATTN_TASKS_PER_WARP; j++) {
    m[j] = NEG_INF;
    l[j] = 0.f;
#pragma unroll
    for (int c = 0; c < MAX_HEAD_DIM / 128; c++) acc[j][c] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  for (int c0 = 0; c0 <= last_pos; c0 += KEY_CHUNK) {
    const int n_keys = min(KEY_CHUNK, last_pos + 1 - c0);
    __syncthreads();
    for (int i = threadIdx.x; i < n_keys * hd4; i += ATTN_WARPS * 32) {
      const int j = i / hd4, d4 = i % hd4;
      reinterpret_cast<float4*>(ks + j * kstride)[d4] = kc[(i64)(c0 + j) * hd4 + d4];
      reinterpret_cast<float4*>(vs)[i] = vc[(i64)c0 * hd4 + i];
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < ATTN_TASKS_PER_WARP; j++) {
      const int t = warp + j * ATTN_WARPS;
      if (t >= n_tasks) continue;
      const int pos = pos0 + t / gs;
      if (c0 > pos) continue;
      const int valid = min(n_keys, pos + 1 - c0);
      float s = NEG_INF;
      if (lane < valid) {
        const float4* q = reinterpret_cast<const float4*>(qs + t * hd);
        const float4* k = reinterpret_cast<const float4*>(ks + lane * kstride);
        float d0 = 0.f, d1 = 0.f;
#pragma unroll 8
        for (int i = 0; i < hd4; i++) {
          const float4 a = q[i], b = k[i];
          d0 += a.x * b.x + a.y * b.y;
          d1 += a.z * b.z + a.w * b.w;
        }
        s = (d0 + d1) * scale;
      }
      const float m_new = fmaxf(m[j], warp_max(s));
      const float corr = expf(m[j] - m_new);
      const float pw = expf(s - m_new);
      l[j] = l[j] * corr + warp_sum(pw);
#pragma unroll
      for (int c = 0; c < MAX_HEAD_DIM / 128; c++) {
        acc[j][c].x *= corr;
        acc[j][c].y *= corr;
        acc[j][c].z *= corr;
        acc[j][c].w *= corr;
      }
#pragma unroll 4
      for (int key = 0; key < valid; key++) {
        const float pk = __shfl_sync(0xffffffffu, pw, key);
#pragma unroll
        for (int c = 0; c < MAX_HEAD_DIM / 128; c++) {
          const int d4 = lane + 32 * c;
          if (d4 < hd4) {
            const float4 v = reinterpret_cast<const float4*>(vs + key * hd)[d4];
            acc[j][c].x += pk * v.x;
            acc[j][c].y += pk * v.y;
            acc[j][c].z += pk * v.z;
            acc[j][c].w += pk * v.w;
          }
        }
      }
      m[j] = m_new;
    }
  }
  const i64 plane = (i64)p.rows * qw;
#pragma unroll
  for (int j = 0; j < ATTN_TASKS_PER_WARP; j++) {
    const int t = warp + j * ATTN_WARPS;
    if (t >= n_tasks) continue;
    const i64 at = (i64)(row0 + t / gs) * qw + (g * gs + t % gs) * hd;
    const float inv = 1.f / l[j];
#pragma unroll
    for (int c = 0; c < MAX_HEAD_DIM / 128; c++) {
      const int d4 = lane + 32 * c;
      if (d4 < hd4) {
        store_pieces(p.planes, plane, at + 4 * d4, acc[j][c].x * inv);
        store_pieces(p.planes, plane, at + 4 * d4 + 1, acc[j][c].y * inv);
        store_pieces(p.planes, plane, at + 4 * d4 + 2, acc[j][c].z * inv);
        store_pieces(p.planes, plane, at + 4 * d4 + 3, acc[j][c].w * inv);
      }
    }
  }
}

// silu(gate) * up from the gate|up product, in three pieces (the down projection's input).
// Blocks (row, ROW_THREADS columns of it): one element per thread.
extern "C" __global__ void __launch_bounds__(ROW_THREADS) silu_mul(const Rows p) {
  const int r = blockIdx.x, I = p.inter;
  const i64 split = (i64)p.rows * 2 * I, at = (i64)r * 2 * I;
  const i64 plane = (i64)p.rows * I;
  const int i = blockIdx.y * ROW_THREADS + threadIdx.x;
  if (i < I) {
    const float gt = gathered(p.part, p.splits, split, at + i);
    const float up = gathered(p.part, p.splits, split, at + I + i);
    store_pieces(p.planes, plane, (i64)r * I + i, gt / (1.f + expf(-gt)) * up);
  }
}
