// Weight streams beside a chain of exchanges (kernel notes, "Session 25", with the answers): does a
// stream issued by a warp of its own, into shared-memory rings or at a fixed rate, run under the
// chain, where the frame kernel's loads (each phase's weights asked for at its start, by the
// compute warps) add to it?
//
// One block per SM, 16 compute warps and one loader warp. A "layer" is five dependent
// all-to-all exchanges of 1,024 tagged words with the code predictor's shape: per warp
// 4 / 0 / 2 / 6 / 4 KB of weights (q|k|v, attention, o, gate|up, down: 34.6 MB per layer on 132
// SMs); in the attention step 8 blocks work 1.4 us and publish every word, as the frame kernel's
// attention blocks do.
//   mode 0: the frame kernel's way: each warp's first 2 KB loaded into registers before the
//           wait, the rest after it (with a nonzero interval: no weights, the exchanges alone);
//   mode 1: the loader warp's lane w streams warp w's weights in 2 KB bulk copies (TMA) into a
//           ring of `slots` pieces per warp, as far ahead as the ring allows, one copy per
//           `interval` cycles at most (0: unpaced); the compute warps wait for their pieces'
//           mbarriers and free them;
//   mode 2: mode 1's stream without exchanges (the ring's bandwidth alone);
//   mode 3: no loader warp: each warp asks for the piece `slots` ahead as soon as it has read one
//           (the shape of session 6's ring);
//   mode 4: mode 3's stream without exchanges;
//   mode 5: the exchanges alone beside a background stream at the pace, which nothing reads (how
//           the exchanges' latency depends on the memory system's load);
//   mode 6: mode 1 with block-wide slots: slot i holds a piece for every warp; the loader warp
//           waits for one barrier per slot and its lanes 0-15 copy the 16 pieces;
//   mode 7: mode 0's loads, with the loader warp asking L2 for each warp's pieces (bulk prefetch)
//           up to `slots` steps ahead of the compute warps;
//   mode 8: mode 0's loads, each warp asking L2 for its own pieces `slots` steps ahead.
// poll 0: every thread spins on its words; 1: with 100 ns between polls; 2: one thread per block
// waits for a count of the producing blocks (a release add each), then the words are read once.
// On the GPU machine: nvcc -O3 -arch=sm_90a -o /tmp/paced_bench scripts/gpu/paced_bench.cu
// && for i in $(seq 0 26); do timeout 12 /tmp/paced_bench $i; done   (one configuration each)
#include <cstdio>
#include <cstdlib>
#include "bench_words.cuh"
extern __shared__ __align__(128) unsigned char dsm[];
constexpr int PIECE = 2048;                      // bytes per bulk copy
__constant__ int KB2[5] = {2, 0, 1, 3, 2};       // 2 KB pieces per warp in each step of a layer
__device__ __forceinline__ void issue_piece(u32 bar, unsigned char* dst, const unsigned char* src) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(PIECE) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(sa(dst)), "l"(src), "r"(PIECE), "r"(bar) : "memory");
}
__device__ __forceinline__ void prefetch_l2(const unsigned char* src, u32 bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}

__global__ void __launch_bounds__(544, 1) layers(u64* words, int steps, u32 epoch, const unsigned char* W,
                                                 size_t wbytes, int mode, int slots, long long interval,
                                                 float* sink, int poll, u32* counts) {
  float* xs = (float*)dsm;                                  // 1,024 inputs
  u64* full = (u64*)(dsm + 4096);                           // 16 x slots
  u64* empty = full + 16 * slots;                           // 16 x slots
  volatile int* done = (volatile int*)(empty + 16 * slots);  // set when the compute warps finish
  volatile int* cur_step = done + 1;                          // the compute warps' step (mode 7)
  unsigned char* ring = (unsigned char*)(((size_t)(empty + 16 * slots) + 128) & ~(size_t)127);  // 16 x slots x PIECE
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5, b = blockIdx.x, nb = gridDim.x;
  // each block reads its own region of W for every step; it advances so that nothing repeats in L2
  const size_t per_step_block = 16 * 6 * 1024;
  if (t < 16 * slots) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(&full[t])) : "memory");
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sa(&empty[t])), "r"(mode == 6 ? 16 : 1) : "memory");
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
  const bool self_refill = mode == 3 || mode == 4;
  if (t == 0) { *done = 0; *cur_step = 0; }
  __syncthreads();
  if (warp == 16 && mode == 5) {
    // background load: lane w streams pieces into its own slots at the pace, overwriting them,
    // until the compute warps are done; nobody reads them
    if (lane >= 16) return;
    const int w = lane;
    long long next = now() + w * interval;
    u32 q = 0;
    for (; !*done; q++) {
      const u32 idx = q % slots, use = q / slots;
      if (use > 0) wait_bar(sa(&full[w * slots + idx]), (use - 1) & 1);
      if (interval > 0) { while (now() < next) {} next += 16 * interval; }
      issue_piece(sa(&full[w * slots + idx]), ring + (w * slots + idx) * PIECE,
                  W + ((size_t)(q * 132 + b) * 16 + w) * PIECE % wbytes);
    }
    // no copy may still be writing when the block exits
    for (u32 i = q > (u32)slots ? q - slots : 0; i < q; i++) wait_bar(sa(&full[w * slots + i % slots]), (i / slots) & 1);
    return;
  }
  if (warp == 16 && mode == 7) {
    // L2 prefetch: lane w asks L2 for compute warp w's pieces of step s once the compute warps are
    // at most `slots` steps behind it, one piece per interval at most
    if (lane >= 16) return;
    const int w = lane;
    long long next = now() + w * interval;
    for (int s = 1; s < steps; s++) {
      const int k = KB2[s % 5];
      while (*cur_step < s - slots && !*done) {}
      const size_t base = ((size_t)s * nb + b) * per_step_block;
      for (int p = 0; p < k; p++) {
        if (interval > 0) { while (now() < next) {} next += 16 * interval; }
        prefetch_l2(W + (base + (size_t)(w * 6 + p * 2) * 1024) % wbytes, PIECE);
      }
    }
    return;
  }
  if (warp == 16 && mode == 6) {
    // block slots: slot i holds one piece for each of the 16 warps; lane 0 waits for the slot to
    // be free and counts its bytes, then lanes 0-15 each copy one warp's piece
    u32 q = 0;
    long long next = now();
    for (int s = 0; s < steps; s++) {
      const int k = KB2[s % 5];
      const size_t base = ((size_t)s * nb + b) * per_step_block;
      for (int p = 0; p < k; p++, q++) {
        const u32 idx = q % slots, use = q / slots;
        if (lane == 0) {
          if (use > 0) wait_bar(sa(&empty[idx]), (use - 1) & 1);
          if (interval > 0) { while (now() < next) {} next += 16 * interval; }
          asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(&full[idx])), "r"(16 * PIECE) : "memory");
        }
        __syncwarp();
        if (lane < 16)
          asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                       ::"r"(sa(ring + (idx * 16 + lane) * PIECE)), "l"(W + (base + (size_t)(lane * 6 + p * 2) * 1024) % wbytes),
                       "r"(PIECE), "r"(sa(&full[idx])) : "memory");
      }
    }
    return;
  }
  if (warp == 16) {
    // lane w streams compute warp w's pieces, each lane at 1/16 of the block's rate
    if ((mode != 1 && mode != 2) || lane >= 16) return;
    const int w = lane;
    long long next = now() + w * interval;
    u32 q = 0;  // pieces issued for warp w so far
    for (int s = 0; s < steps; s++) {
      const int k = KB2[s % 5];
      const size_t base = ((size_t)s * nb + b) * per_step_block;
      for (int p = 0; p < k; p++, q++) {
        const u32 idx = q % slots, use = q / slots;
        if (use > 0) wait_bar(sa(&empty[w * slots + idx]), (use - 1) & 1);
        if (interval > 0) { while (now() < next) {} next += 16 * interval; }
        issue_piece(sa(&full[w * slots + idx]), ring + (w * slots + idx) * PIECE,
                    W + (base + (size_t)(w * 6 + p * 2) * 1024) % wbytes);
      }
    }
    return;
  }
  // self refill: each compute warp's lane 0 asks for its first `slots` pieces now, and for piece
  // q + slots as soon as it has read piece q, into the same slot
  int fs = 0, fp = 0;  // the step and piece of the next piece to ask for
  u32 fq = 0;
  auto refill = [&](u32 upto) {
    while (fq < upto && fs < steps) {
      const int k = KB2[fs % 5];
      if (fp >= k) { fs++; fp = 0; continue; }
      const size_t base = ((size_t)fs * nb + b) * per_step_block;
      const u32 idx = fq % slots;
      issue_piece(sa(&full[warp * slots + idx]), ring + (warp * slots + idx) * PIECE,
                  W + (base + (size_t)(warp * 6 + fp * 2) * 1024) % wbytes);
      fp++; fq++;
    }
  };
  if (self_refill && lane == 0) refill(slots);
  float acc = 0.f;
  u32 q = 0;
  for (int s = 0; s < steps; s++) {
    const int k = KB2[s % 5];
    const u32 tag = (epoch << 16) | (u32)(s + 1), ptag = (epoch << 16) | (u32)s;
    u64* buf = words + (size_t)(s & 1) * 4096;
    const u64* prev = words + (size_t)((s + 1) & 1) * 4096;
    const uint4* wreg = (const uint4*)(W + (((size_t)s * nb + b) * per_step_block + (size_t)warp * 6 * 1024) % wbytes);
    uint4 w[12];
    if (mode == 7 && t == 0) *cur_step = s;
    if (mode == 8 && lane == 0 && s + slots < steps) {
      const int k2 = KB2[(s + slots) % 5];
      const size_t base2 = ((size_t)(s + slots) * nb + b) * per_step_block + (size_t)warp * 6 * 1024;
      for (int p = 0; p < k2; p++) prefetch_l2(W + (base2 + (size_t)p * 2048) % wbytes, PIECE);
    }
    const bool regs = mode == 0 || mode == 7 || mode == 8;
    if (regs) {
#pragma unroll
      for (int j = 0; j < 4; j++) w[j] = k > 0 && (interval == 0 || mode != 0) ? ldnc(wreg + lane + 32 * j) : make_uint4(0, 0, 0, 0);
    }
    if (mode != 2 && mode != 4 && s > 0) {
      if (poll == 2) {
        // one thread per block waits for the producers' count, then every word is current
        if (t == 0) {
          const u32 want = KB2[(s - 1) % 5] == 0 ? 8 : nb;
          u32 c;
          do { asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(c) : "l"(counts + s - 1) : "memory"); } while (c < want);
        }
        asm volatile("bar.sync 1, 512;" ::: "memory");
      }
      u64 v0 = ldw(prev + t), v1 = ldw(prev + t + 512);
      while ((u32)(v0 >> 32) != ptag) { if (poll == 1) __nanosleep(100); v0 = ldw(prev + t); }
      while ((u32)(v1 >> 32) != ptag) { if (poll == 1) __nanosleep(100); v1 = ldw(prev + t + 512); }
      xs[t] = __uint_as_float((u32)v0);
      xs[t + 512] = __uint_as_float((u32)v1);
    }
    asm volatile("bar.sync 1, 512;" ::: "memory");
    if (mode == 5) {
      acc += xs[lane];
    } else if (regs) {
#pragma unroll
      for (int j = 4; j < 12; j++) w[j] = j < 4 * k && (interval == 0 || mode != 0) ? ldnc(wreg + lane + 32 * j) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int j = 0; j < 12; j++)
        acc += __uint_as_float(w[j].x) * xs[lane + 32 * (j & 7)] + __uint_as_float(w[j].w);
    } else {
      for (int p = 0; p < k; p++, q++) {
        const u32 idx = q % slots, use = q / slots;
        const u32 slot = mode == 6 ? idx : warp * slots + idx;
        wait_bar(sa(&full[slot]), use & 1);
        const uint4* piece = (const uint4*)(ring + (mode == 6 ? idx * 16 + warp : warp * slots + idx) * PIECE);
#pragma unroll
        for (int j = 0; j < 4; j++) {
          const uint4 v = piece[lane + 32 * j];
          acc += __uint_as_float(v.x) * xs[lane + 32 * j] + __uint_as_float(v.w);
        }
        __syncwarp();
        if (self_refill) {
          if (lane == 0) refill(q + 1 + slots);
        } else if (lane == 0) {
          asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sa(&empty[slot])) : "memory");
        }
      }
    }
    if (mode != 2 && mode != 4) {
      if (k == 0) {
        // attention: 8 blocks work ~1.4 us, then publish every word
        if (b < 8) {
          const long long until = now() + 2800;
          while (now() < until) {}
          if (t < 128) stw(buf + b * 128 + t, ((u64)tag << 32) | __float_as_uint(acc + xs[t]));
        }
      } else {
        // rows dealt round-robin: word i from block i % nb, warp i / nb
        for (int i = warp * nb + b; i < 1024 && warp < 8; i += 8 * nb) {
          const float r = __shfl_xor_sync(0xffffffff, acc, 1) + acc;
          if (lane == 0) stw(buf + i, ((u64)tag << 32) | __float_as_uint(r + xs[i & 1023]));
        }
      }
      asm volatile("bar.sync 1, 512;" ::: "memory");
      if (poll == 2 && t == 0 && (k > 0 || b < 8))
        asm volatile("fence.acq_rel.gpu; red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counts + s) : "memory");
    }
  }
  if (acc == 12345.f) sink[0] = acc;
  asm volatile("bar.sync 1, 512;" ::: "memory");
  if (t == 0) *done = 1;
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IONBF, 0);
  const int only = argc > 1 ? atoi(argv[1]) : -1;
  int index = 0;
  int sms, khz;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0);
  u64* words; cudaMalloc(&words, 2 * 4096 * 8); cudaMemset(words, 0, 2 * 4096 * 8);
  // a whole number of steps' regions, so that no piece runs past the end
  const size_t wbytes = (size_t)16 * 6 * 1024 * sms * 256;
  unsigned char* W; cudaMalloc(&W, wbytes); cudaMemset(W, 0, wbytes);
  float* sink; cudaMalloc(&sink, 4);
  u32 epoch = 1;
  const int layers_n = 400, steps = 5 * layers_n;
  const double mb_layer = (double)sms * 16 * 16 * 1024 / 1e6;
  printf("SMs %d, clock %d MHz, %.1f MB per layer\n", sms, khz / 1000, mb_layer);
  u32* counts; cudaMalloc(&counts, steps * 4);
  int poll = 0;
  auto run = [&](const char* what, int mode, int slots, double tbps) {
    if (only >= 0 && index++ != only) return;
    // one copy of PIECE bytes per warp per interval: 16 warps' pieces at tbps / sms per SM
    long long interval = tbps > 0 ? (long long)(PIECE / (tbps * 1e12 / sms) * khz * 1e3) : 0;
    size_t smem = 4096 + 2 * 16 * slots * 8 + 128 + (mode >= 1 && mode <= 6 ? 16 * slots * PIECE : 0) + 128;
    cudaFuncSetAttribute(layers, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    cudaEvent_t a, e; cudaEventCreate(&a); cudaEventCreate(&e);
    float best = 1e30f;
    for (int rep = 0; rep < 3; rep++) {
      float ms;
      cudaMemset(counts, 0, steps * 4);
      cudaEventRecord(a);
      layers<<<sms, 544, smem>>>(words, steps, epoch++, W, wbytes, mode, slots, interval, sink, poll, counts);
      cudaEventRecord(e); cudaEventSynchronize(e);
      cudaEventElapsedTime(&ms, a, e);
      cudaError_t err = cudaGetLastError();
      if (err) { printf("%s: error %s\n", what, cudaGetErrorString(err)); exit(1); }
      if (epoch >= 0xffff) { cudaMemset(words, 0, 2 * 4096 * 8); epoch = 1; }
      best = ms < best ? ms : best;
    }
    double us = best * 1000.0 / layers_n;
    printf("poll %d %-34s slots %d pace %4.2f TB/s (%5lld cycles): %6.2f us per layer, %5.2f TB/s, smem %3zu KB\n",
           poll, what, slots, tbps, interval, us, mb_layer / us, smem / 1024);
  };
  for (poll = 0; poll < 3; poll++) {
    run("registers, 2 KB before the wait", 0, 1, 0);
    run("exchanges alone", 0, 1, 1.0);
    run("loader lanes + exchanges", 1, 2, 0);
    if (poll > 0) continue;
    // (an unpaced background stream starved the exchanges: not run)
    for (double tb : {0.5, 1.0, 1.5, 2.0, 2.5}) run("exchanges beside a stream", 5, 4, tb);
    run("loader lanes, stream only", 2, 3, 0);
    for (int slots : {3, 4}) run("loader lanes + exchanges", 1, slots, 0);
    for (double tb : {2.5, 2.0}) run("loader lanes + exchanges", 1, 2, tb);
    run("self refill + exchanges", 3, 3, 0);
    for (int slots : {3, 6}) run("block slots + exchanges", 6, slots, 0);
    for (int ahead : {1, 2, 3}) run("registers + loader L2 prefetch", 7, ahead, 0);
    for (int ahead : {1, 2}) run("registers + own L2 prefetch", 8, ahead, 0);
  }
  return 0;
}
