// How long one load of a word already in L2 takes when it is issued right behind a weight
// preload, by the path of each (kernel notes, "Session 30"). The frame kernel issues each warp's
// first 2 KB of weights, then polls its exchange words; sessions 7-28 found the words arrive
// later by about the preload's bytes / bandwidth. If that delay comes from the order in which an
// SM (or a warp) gets its loads back, a preload by another path, or by other warps, would leave
// the poll fast; if it comes from the memory system as a whole, nothing here helps.
//
// One block of 16 warps per SM, all blocks in step (a grid barrier before each iteration). Each
// iteration, every warp of the measured blocks: clock; the variant's preload of `depth` x 512
// bytes per warp (fresh HBM lines each iteration); one load of a word of its own that holds 1
// (spun on until it reads 1, so the clock after it waits for the answer); clock; then the
// preload is consumed and the clock read once more. Printed per variant: the poll's latency and
// the preload's (issue to last byte used), in ns, means over the measured warps and 200
// iterations.
//   0 none      no preload
//   1 ldg       every warp loads its preload into registers (the frame kernel's way)
//   2 ldg-w15   warps 0-14 as ldg; warp 15 loads nothing and its poll is the one measured
//   3 ldgsts    the preload by cp.async (16 bytes per lane per chunk) into shared memory
//   4 atom      as ldg, the poll an atomic or of 0 (answered by L2)
//   5 tma       lane 0 of each warp copies the preload by one bulk copy (TMA) into shared memory
//   6 l2pf      the preload asked of L2 only (prefetch.global.L2), loaded into registers after
//               the poll
//   7 poll1st   as ldg, the poll issued before the preload
//   8 other-sm  the even blocks preload as ldg; the odd blocks load nothing and are measured
//   9 tmapoll   as ldg, the poll a bulk copy (TMA) of the warp's 32 words into shared memory,
//               awaited on an mbarrier (lane 0 issues it)
//  10 tma-w15   warps 0-14 preload as tma; warp 15 loads nothing and its poll (ldg) is measured
//  11 store     no preload; lane 0 stores a word of its own (st.relaxed.gpu, as the kernel
//               publishes) just before the poll
//  12 store-w15 warps 0-14 preload as ldg; warp 15 stores, then polls (measured)
//  13 tma-store lane 0 stores, then the warp preloads as tma, then polls (the kernel's order with a
//               bulk-copied preload)
// "others" is the preload's latency in the warps not measured (variants 2, 8, 10).
// On the GPU machine: nvcc -O3 -arch=sm_90a -o /tmp/poll_bench scripts/gpu/poll_bench.cu
// && /tmp/poll_bench [depth]   (depth: 16-byte chunks per lane, 4 as in the frame kernel)
#include <cstdio>
#include <cstdlib>
#include "bench_words.cuh"

extern __shared__ __align__(128) unsigned char dsm[];
constexpr int WARPS = 16;
constexpr int ITERS = 220, WARMUP = 20;

__device__ __forceinline__ u64 gtimer() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ u64 atom_or0(u64* p) {
  u64 v;
  asm volatile("atom.relaxed.gpu.global.or.b64 %0, [%1], 0;" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// The words polled (one per thread), then the stored ones (one per warp).
__host__ __device__ inline size_t nwords_total(int blocks) { return (size_t)blocks * 512; }

__global__ void __launch_bounds__(512, 1)
    poll(const unsigned char* W, size_t wbytes, u64* words, u32* bar, int variant, int depth,
         unsigned long long* sums, float* sink, long long* clocks) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const size_t per_warp = (size_t)depth * 512;
  u64* mb = reinterpret_cast<u64*>(dsm);                 // one mbarrier per warp (tma)
  unsigned char* stage = dsm + 1024 + warp * per_warp;  // a warp's staging area
  const bool other_sm = variant == 8;
  const bool w15 = variant == 2 || variant == 10 || variant == 12;
  const bool stores = variant >= 11;
  const bool preloads =
      !((w15 && warp == 15) || (other_sm && (blockIdx.x & 1)) || variant == 0 || variant == 11);
  const bool measured = w15 ? warp == 15 : other_sm ? (blockIdx.x & 1) : true;
  const bool tma = variant == 5 || variant == 10 || variant == 13;
  u64* polled = reinterpret_cast<u64*>(dsm + 512) + warp * 32;  // a warp's polled words (tmapoll)
  if ((tma || variant == 9) && lane == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(mb + warp)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  u64* mine = words + (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  long long poll_sum = 0, drain_sum = 0, other_sum = 0;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    clocks[0] = now();
    clocks[1] = (long long)gtimer();
  }
  for (int it = 0; it < ITERS; it++) {
    // grid barrier: every block starts the iteration together
    __syncthreads();
    if (threadIdx.x == 0) {
      atomicAdd(bar, 1u);
      const u32 target = (u32)(it + 1) * gridDim.x;
      while (true) {
        u32 v;
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(bar) : "memory");
        if (v >= target) break;
      }
    }
    __syncthreads();
    const size_t base =
        ((size_t)it * gridDim.x * WARPS * per_warp + ((size_t)blockIdx.x * WARPS + warp) * per_warp) %
        (wbytes - per_warp);
    const unsigned char* wp = W + (base & ~(size_t)511);
    const long long t0 = now();
    if (stores && lane == 0 && (variant != 12 || warp == 15))
      stw(words + nwords_total(gridDim.x) + (size_t)blockIdx.x * WARPS + warp, (u64)it);
    uint4 r[8];
    u64 first = 0;
    if (variant == 7) first = ldw(mine);
    if (preloads) {
      if (variant == 1 || variant == 2 || variant == 4 || variant == 7 || variant == 8 || variant == 9 ||
          variant == 12) {
#pragma unroll
        for (int j = 0; j < 8; j++)
          if (j < depth) r[j] = ldnc(wp + j * 512 + lane * 16);
      } else if (variant == 3) {
        for (int j = 0; j < depth; j++)
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa(stage + j * 512 + lane * 16)),
                       "l"(wp + j * 512 + lane * 16)
                       : "memory");
        asm volatile("cp.async.commit_group;" ::: "memory");
      } else if (tma) {
        if (lane == 0) {
          asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(mb + warp)),
                       "r"((u32)per_warp)
                       : "memory");
          asm volatile(
              "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                  sa(stage)),
              "l"(wp), "r"((u32)per_warp), "r"(sa(mb + warp))
              : "memory");
        }
      } else if (variant == 6) {
        for (int j = 0; j < depth; j++)
          asm volatile("prefetch.global.L2 [%0];" ::"l"(wp + j * 512 + lane * 16) : "memory");
      }
    }
    // the poll: the word holds 1 already, so one answer ends it
    if (variant == 4) {
      while (atom_or0(mine) != 1ull) {}
    } else if (variant == 7) {
      while (first != 1ull) first = ldw(mine);
    } else if (variant == 9) {
      // the warp's 32 words (256 bytes), one bulk copy, completing the warp's mbarrier
      const u64* src = words + (size_t)blockIdx.x * blockDim.x + warp * 32;
      if (lane == 0) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], 256;" ::"r"(sa(mb + warp)) : "memory");
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 256, [%2];" ::"r"(
                sa(polled)),
            "l"(src), "r"(sa(mb + warp))
            : "memory");
      }
      wait_bar(sa(mb + warp), (u32)(it & 1));
      while (polled[lane] != 1ull) {}
    } else {
      while (ldw(mine) != 1ull) {}
    }
    const long long t1 = now();
    float acc = 0.f;
    if (preloads) {
      if (variant == 1 || variant == 2 || variant == 4 || variant == 7 || variant == 8 || variant == 9 ||
          variant == 12) {
#pragma unroll
        for (int j = 0; j < 8; j++)
          if (j < depth) acc += __uint_as_float(r[j].x) + __uint_as_float(r[j].w);
      } else if (variant == 3) {
        asm volatile("cp.async.wait_all;" ::: "memory");
        for (int j = 0; j < depth; j++) acc += *reinterpret_cast<const float*>(stage + j * 512 + lane * 16);
      } else if (tma) {
        wait_bar(sa(mb + warp), (u32)(it & 1));
        for (int j = 0; j < depth; j++) acc += *reinterpret_cast<const float*>(stage + j * 512 + lane * 16);
      } else if (variant == 6) {
        for (int j = 0; j < depth; j++) r[j & 7] = ldnc(wp + j * 512 + lane * 16);
        for (int j = 0; j < depth; j++) acc += __uint_as_float(r[j & 7].x);
      }
    }
    if (acc == 1234.5f) sink[threadIdx.x] = acc;  // keeps the preload's loads and orders the clock
    const long long t2 = now();
    if (it >= WARMUP && lane == 0) {
      if (measured) {
        poll_sum += t1 - t0;
        drain_sum += t2 - t0;
      } else {
        other_sum += t2 - t0;
      }
    }
    __syncwarp();
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    clocks[2] = now();
    clocks[3] = (long long)gtimer();
  }
  if (lane == 0) {
    if (measured) {
      atomicAdd(sums + 0, (unsigned long long)poll_sum);
      atomicAdd(sums + 1, (unsigned long long)drain_sum);
      atomicAdd(sums + 2, (unsigned long long)(ITERS - WARMUP));
    } else {
      atomicAdd(sums + 3, (unsigned long long)other_sum);
      atomicAdd(sums + 4, (unsigned long long)(ITERS - WARMUP));
    }
  }
}

static void check(cudaError_t e, int line) {
  if (e == cudaSuccess) return;
  printf("poll_bench.cu:%d %s\n", line, cudaGetErrorString(e));
  exit(1);
}
#define CK(x) check((x), __LINE__)

int main(int argc, char** argv) {
  const int depth = argc > 1 ? atoi(argv[1]) : 4;
  if (depth < 1 || depth > 8) {
    printf("depth: 1..8\n");
    return 1;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int blocks = prop.multiProcessorCount;
  const size_t wbytes = (size_t)2 << 30;
  unsigned char* W;
  u64* words;
  u32* bar;
  unsigned long long* sums;
  float* sink;
  long long* clocks;
  CK(cudaMalloc(&W, wbytes));
  CK(cudaMemset(W, 1, wbytes));
  const size_t nwords = nwords_total(blocks);
  CK(cudaMalloc(&words, (nwords + (size_t)blocks * WARPS) * 8));
  u64* ones = (u64*)malloc(nwords * 8);
  for (size_t i = 0; i < nwords; i++) ones[i] = 1;
  CK(cudaMemcpy(words, ones, nwords * 8, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&bar, 4));
  CK(cudaMalloc(&sums, 40));
  CK(cudaMalloc(&sink, 4096));
  CK(cudaMalloc(&clocks, 32));
  const int smem = 1024 + WARPS * 8 * 512 + 4096;  // mbarriers + staging; one block per SM
  CK(cudaFuncSetAttribute(poll, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const char* names[] = {"none", "ldg",     "ldg-w15",  "ldgsts",  "atom",   "tma",
                         "l2pf", "poll1st", "other-sm", "tmapoll", "tma-w15",
                         "store", "store-w15", "tma-store"};
  printf("%s, %d SMs, depth %d (%d bytes per warp, %.1f MB per iteration on the GPU)\n", prop.name, blocks,
         depth, depth * 512, blocks * WARPS * depth * 512 / 1e6);
  for (int round = 0; round < 2; round++)
    for (int variant = 0; variant < 14; variant++) {
      CK(cudaMemset(bar, 0, 4));
      CK(cudaMemset(sums, 0, 40));
      int v = variant, d = depth;
      size_t wb = wbytes;
      void* args[] = {&W, &wb, &words, &bar, &v, &d, &sums, &sink, &clocks};
      CK(cudaLaunchCooperativeKernel((void*)poll, blocks, 512, args, smem, 0));
      CK(cudaDeviceSynchronize());
      unsigned long long s[5];
      long long c[4];
      CK(cudaMemcpy(s, sums, 40, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(c, clocks, 32, cudaMemcpyDeviceToHost));
      const double ghz = (double)(c[2] - c[0]) / (double)(c[3] - c[1]);
      printf("round %d  %-9s poll %6.0f ns  preload used %6.0f ns  others' preload %6.0f ns  (%.2f GHz)\n",
             round, names[variant], s[0] / (double)s[2] / ghz, s[1] / (double)s[2] / ghz,
             s[4] ? s[3] / (double)s[4] / ghz : 0.0, ghz);
    }
  return 0;
}
