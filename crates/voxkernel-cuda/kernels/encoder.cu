// voxkernel voice-clone encoders (reference audio -> x-vector and reference codes), f32.
//
// Appended to codec.cu and compiled with it (runtime::CODEC_SOURCE), so the encoders' matrix
// products are the decoder's `conv_gemm` kernels, here over one clip: a Batch with one frame of
// `rate = m` rows, whose tables are all zero, makes segment row t of a buffer `hist + t`. This
// file holds what the decoder does not need: padding by reflection or replication, LayerNorm,
// full causal attention, the squeeze-excitation gate, the attentive statistics pooling and the
// nearest-codeword search. The CPU counterparts are in crates/voxkernel-core/src/reference/
// (speaker_encoder.rs, codec_encoder.rs and codec_encoder/).

#define PAD_REFLECT 0
#define PAD_REPLICATE 1

// ---------------------------------------------------------------------------------------------
// Rows of `dst` from rows of `a` (plus the same rows of `b`, when given): mirrors `pad_rows`
// (conv1d.rs) and the `chunk + outputs[i - 1]` of a Res2Net block. Destination row r is source
// row i = r - left, mapped into 0..rows at the ends: reflect (`x[-i] = x[i]`, the edge row not
// repeated) or replicate. With `pad_only` only the `left` and `right` edge rows are written,
// which lets a buffer pad itself in place (`a` = its first valid row). `a_ld` = 0 repeats one
// row on every row (a broadcast).

struct GatherParams {
  float* dst;
  const float* a;
  const float* b;
  int dst_ld, a_ld, b_ld;
  int rows, cols, left, right;
  int mode, pad_only;
};

extern "C" __global__ void __launch_bounds__(256) gather_rows(const GatherParams p) {
  const int written = p.pad_only ? p.left + p.right : p.left + p.rows + p.right;
  const i64 total = (i64)written * p.cols;
  for (i64 n = (i64)blockIdx.x * blockDim.x + threadIdx.x; n < total;
       n += (i64)gridDim.x * blockDim.x) {
    int r = (int)(n / p.cols);
    const int c = (int)(n - (i64)r * p.cols);
    if (p.pad_only && r >= p.left) r += p.rows;
    const int i = r - p.left;
    int src = i;
    if (i < 0) src = p.mode == PAD_REFLECT ? -i : 0;
    else if (i >= p.rows) src = p.mode == PAD_REFLECT ? 2 * (p.rows - 1) - i : p.rows - 1;
    float v = p.a[(i64)src * p.a_ld + c];
    if (p.b) v = __fadd_rn(v, p.b[(i64)src * p.b_ld + c]);
    p.dst[(i64)r * p.dst_ld + c] = v;
  }
}

// ---------------------------------------------------------------------------------------------
// LayerNorm with bias, one block per row: candle's `layer_norm` as its CPU kernel computes it
// (mean and mean square in one pass, var = E[x^2] - mean^2, times 1 / sqrt(var + eps)).

struct LayerNormParams {
  const float* in;
  float* out;
  const float* w;
  const float* b;
  int width;
  float eps;
};

extern "C" __global__ void __launch_bounds__(256) layer_norm(const LayerNormParams p) {
  __shared__ float scratch[32];
  const float* x = p.in + (i64)blockIdx.x * p.width;
  float sum = 0.0f, sum2 = 0.0f;
  for (int c = threadIdx.x; c < p.width; c += blockDim.x) {
    sum += x[c];
    sum2 += x[c] * x[c];
  }
  const float mean = block_sum(sum, scratch) / (float)p.width;
  const float var = block_sum(sum2, scratch) / (float)p.width - mean * mean;
  const float inv_std = 1.0f / sqrtf(var + p.eps);
  float* out = p.out + (i64)blockIdx.x * p.width;
  for (int c = threadIdx.x; c < p.width; c += blockDim.x)
    out[c] = __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(x[c], mean), inv_std), p.w[c]), p.b[c]);
}

// ---------------------------------------------------------------------------------------------
// Causal self-attention over a whole clip: mirrors `EncoderTransformer::attention`
// (codec_encoder/transformer.rs) between the q/k/v and the o projections. `rope_qk` rotates
// the queries and keys in place (x * cos + rotate_half(x) * sin, products rounded like the CPU),
// then one block per (head, query) scores every key up to the query (no sliding window: the
// official mask ignores it), softmax as candle's (max, exp(s - max), sum, divide), and sums the
// values.

struct RopeParams {
  float* qkv;         // [rows][3 * width]: q | k | v
  const float* cos;   // [rows][head_dim / 2]
  const float* sin;
  int rows, width, head_dim;
};

extern "C" __global__ void __launch_bounds__(256) rope_qk(const RopeParams p) {
  const int half = p.head_dim / 2, pairs = p.width / 2;  // per q or k row
  const i64 total = (i64)p.rows * 2 * pairs;
  for (i64 n = (i64)blockIdx.x * blockDim.x + threadIdx.x; n < total;
       n += (i64)gridDim.x * blockDim.x) {
    const int t = (int)(n / (2 * pairs));
    const int rest = (int)(n - (i64)t * 2 * pairs);
    const int which = rest / pairs, pair = rest - which * pairs;  // which: 0 q, 1 k
    const int head = pair / half, d = pair - head * half;
    float* x = p.qkv + (i64)t * 3 * p.width + which * p.width + head * p.head_dim;
    const float c = p.cos[t * half + d], s = p.sin[t * half + d];
    const float lo = x[d], hi = x[d + half];
    x[d] = __fadd_rn(__fmul_rn(lo, c), __fmul_rn(-hi, s));
    x[d + half] = __fadd_rn(__fmul_rn(hi, c), __fmul_rn(lo, s));
  }
}

struct CausalAttnParams {
  const float* qkv;  // [rows][3 * width], queries and keys rotated
  float* out;        // [rows][width]
  int rows, width, head_dim;
  float scale;
};

#define ENC_ATTN_THREADS 128

extern "C" __global__ void __launch_bounds__(ENC_ATTN_THREADS)
    causal_attention(const CausalAttnParams p) {
  extern __shared__ float prob[];  // [rows]
  __shared__ float q[MAX_HEAD_DIM];
  __shared__ float scratch[ENC_ATTN_THREADS / 32];
  const int head = blockIdx.x, t = blockIdx.y, col0 = head * p.head_dim;
  const i64 ld = 3 * (i64)p.width;
  for (int d = threadIdx.x; d < p.head_dim; d += blockDim.x) q[d] = p.qkv[t * ld + col0 + d];
  __syncthreads();
  const int keys = t + 1;
  float mx = -__int_as_float(0x7f800000);
  for (int j = threadIdx.x; j < keys; j += blockDim.x) {
    const float* k = p.qkv + j * ld + p.width + col0;
    float dot = 0.0f;
    for (int d = 0; d < p.head_dim; ++d) dot += q[d] * k[d];
    const float score = __fmul_rn(dot, p.scale);
    prob[j] = score;
    mx = fmaxf(mx, score);
  }
  mx = block_max(mx, scratch);
  float sum = 0.0f;
  for (int j = threadIdx.x; j < keys; j += blockDim.x) {
    const float e = expf(prob[j] - mx);
    prob[j] = e;
    sum += e;
  }
  sum = block_sum(sum, scratch);
  for (int j = threadIdx.x; j < keys; j += blockDim.x) prob[j] = __fdiv_rn(prob[j], sum);
  __syncthreads();
  for (int d = threadIdx.x; d < p.head_dim; d += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < keys; ++j) acc += prob[j] * p.qkv[j * ld + 2 * p.width + col0 + d];
    p.out[(i64)t * p.width + col0 + d] = acc;
  }
}

// ---------------------------------------------------------------------------------------------
// Squeeze-excitation of an SE-Res2Net block: mirrors `SeRes2NetBlock::forward` after tdnn2
// (speaker_encoder.rs). `se_gate` (one block) makes the per-channel gate from the time average,
// sigmoid(conv2(relu(conv1(mean)))); `se_apply` computes h * gate + x into `out`, and into a
// column slice of the multi-layer aggregation's input (`out2`, `out2_ld` wide).

struct SeGateParams {
  const float* h;      // [rows][channels]
  float* gate;         // [channels]
  const float* w1;     // [channels][se]
  const float* b1;
  const float* w2;     // [se][channels]
  const float* b2;
  int rows, channels, se;
};

extern "C" __global__ void __launch_bounds__(256) se_gate(const SeGateParams p) {
  extern __shared__ float smem[];  // mean [channels], then squeezed [se]
  float* mean = smem;
  float* squeezed = smem + p.channels;
  for (int c = threadIdx.x; c < p.channels; c += blockDim.x) {
    float sum = 0.0f;
    for (int t = 0; t < p.rows; ++t) sum += p.h[(i64)t * p.channels + c];
    mean[c] = sum / (float)p.rows;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < p.se; j += blockDim.x) {
    float acc = 0.0f;
    for (int c = 0; c < p.channels; ++c) acc += mean[c] * p.w1[c * p.se + j];
    squeezed[j] = fmaxf(__fadd_rn(acc, p.b1[j]), 0.0f);
  }
  __syncthreads();
  for (int c = threadIdx.x; c < p.channels; c += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < p.se; ++j) acc += squeezed[j] * p.w2[j * p.channels + c];
    p.gate[c] = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-__fadd_rn(acc, p.b2[c]))));
  }
}

struct SeApplyParams {
  const float* h;
  const float* gate;
  const float* res;
  float* out;
  float* out2;
  int rows, channels, out2_ld;
};

extern "C" __global__ void __launch_bounds__(256) se_apply(const SeApplyParams p) {
  const i64 total = (i64)p.rows * p.channels;
  for (i64 n = (i64)blockIdx.x * blockDim.x + threadIdx.x; n < total;
       n += (i64)gridDim.x * blockDim.x) {
    const int t = (int)(n / p.channels), c = (int)(n - (i64)t * p.channels);
    const float v = __fadd_rn(__fmul_rn(p.h[n], p.gate[c]), p.res[n]);
    p.out[n] = v;
    p.out2[(i64)t * p.out2_ld + c] = v;
  }
}

// ---------------------------------------------------------------------------------------------
// Attentive statistics pooling: mirrors `weighted_statistics` (speaker_encoder.rs), one thread
// per channel. Without `scores` the weights are the official uniform 1 / rows (multiplied in
// first); with them, the softmax over time of each channel's scores. Writes mean then
// std = sqrt(max(var, 1e-12)), `[2 * channels]`.

struct PoolParams {
  const float* x;       // [rows][channels]
  const float* scores;  // [rows][channels] or null
  float* out;           // [2 * channels]
  int rows, channels;
};

extern "C" __global__ void __launch_bounds__(256) pool_stats(const PoolParams p) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= p.channels) return;
  const float uniform = 1.0f / (float)p.rows;
  float mx = 0.0f, denom = 1.0f;
  if (p.scores) {
    mx = -__int_as_float(0x7f800000);
    for (int t = 0; t < p.rows; ++t) mx = fmaxf(mx, p.scores[(i64)t * p.channels + c]);
    denom = 0.0f;
    for (int t = 0; t < p.rows; ++t) denom += expf(p.scores[(i64)t * p.channels + c] - mx);
  }
  // The weight of row t, as the CPU rounds it.
  auto weight = [&](int t) {
    return p.scores ? __fdiv_rn(expf(p.scores[(i64)t * p.channels + c] - mx), denom) : uniform;
  };
  float mean = 0.0f;
  for (int t = 0; t < p.rows; ++t) mean += __fmul_rn(p.x[(i64)t * p.channels + c], weight(t));
  float var = 0.0f;
  for (int t = 0; t < p.rows; ++t) {
    const float d = __fsub_rn(p.x[(i64)t * p.channels + c], mean);
    var += __fmul_rn(__fmul_rn(d, d), weight(t));
  }
  p.out[c] = mean;
  p.out[p.channels + c] = sqrtf(fmaxf(var, 1e-12f));
}

// ---------------------------------------------------------------------------------------------
// Residual vector quantization: mirrors `ResidualQuantizer::encode` and `Codebook::nearest`
// (codec_encoder.rs). One block per frame runs the quantizer's layers in order on its residual
// (kept in shared memory): the distance to every codeword as torch's cdist computes it,
// sqrt(max(|x|^2 - 2 x.e + |e|^2, 0)), the first index of the smallest, then the residual minus
// that codeword. Codebooks are stored transposed, `[dim][size]`, so that the threads (one
// codeword each) read consecutive addresses.

#define RVQ_THREADS 256
#define RVQ_MAX_DIM 1024

struct RvqEncodeParams {
  const float* in;           // [frames][in_ld], the projected latent at column 0
  const float* codebooks;    // [layers][dim][size]
  const float* norms;        // [layers][size]: |e|^2
  u32* codes;                // [frames][NUM_CODEBOOKS]
  int in_ld, layers, size, dim, first_code;
};

extern "C" __global__ void __launch_bounds__(RVQ_THREADS) rvq_encode(const RvqEncodeParams p) {
  __shared__ float x[RVQ_MAX_DIM];
  __shared__ float scratch[RVQ_THREADS / 32];
  __shared__ float best_d[RVQ_THREADS];
  __shared__ int best_i[RVQ_THREADS];
  const int f = blockIdx.x, tid = threadIdx.x;
  for (int i = tid; i < p.dim; i += blockDim.x) x[i] = p.in[(i64)f * p.in_ld + i];
  for (int layer = 0; layer < p.layers; ++layer) {
    const float* et = p.codebooks + (i64)layer * p.dim * p.size;
    float sq = 0.0f;
    for (int i = tid; i < p.dim; i += blockDim.x) sq += x[i] * x[i];
    const float xx = block_sum(sq, scratch);  // its barriers also publish x
    float bd = __int_as_float(0x7f800000);
    int bi = 0;
    for (int j = tid; j < p.size; j += blockDim.x) {
      float dot = 0.0f;
      for (int i = 0; i < p.dim; ++i) dot += x[i] * et[(i64)i * p.size + j];
      const float d2 = __fadd_rn(__fadd_rn(__fmul_rn(-2.0f, dot), xx), p.norms[layer * p.size + j]);
      const float d = sqrtf(fmaxf(d2, 0.0f));
      if (d < bd) {  // j rises: the first of equals stays
        bd = d;
        bi = j;
      }
    }
    best_d[tid] = bd;
    best_i[tid] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s /= 2) {
      if (tid < s) {
        const float od = best_d[tid + s];
        const int oi = best_i[tid + s];
        if (od < best_d[tid] || (od == best_d[tid] && oi < best_i[tid])) {
          best_d[tid] = od;
          best_i[tid] = oi;
        }
      }
      __syncthreads();
    }
    const int best = best_i[0];
    if (tid == 0) p.codes[f * NUM_CODEBOOKS + p.first_code + layer] = (u32)best;
    for (int i = tid; i < p.dim; i += blockDim.x)
      x[i] = __fsub_rn(x[i], et[(i64)i * p.size + best]);
    __syncthreads();
  }
}
