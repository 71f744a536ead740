// How fast a warp runs straight-line code that the SM's instruction caches do not hold
// (kernel notes, "Version 1.17"). A one-warp poller in the frame kernel spent ~3 us on ~600
// unrolled instructions after its words had arrived, and sessions 12-20 found that where code
// sits moves the frame with no memory-side cause. If a lone warp's cost per instruction grows
// with the size of the code a loop walks, instruction fetch is on the frame's critical path.
//
// One block of 16 warps per SM. A loop walks `regions` distinct blocks of 256 independent FMAs
// (eight accumulators, 4 KB of code each, so `regions` x 4 KB in all) `iters` times, either in
// every warp or in warp 15 alone (the other warps wait at the loop's barrier). Printed per size:
// SM cycles per instruction of the walked code, in the first pass (code not yet in the SM's
// caches) and in the later passes, for one warp and for sixteen. Means over the blocks.
// On the GPU machine: nvcc -O3 -arch=sm_90a -o /tmp/icache_bench scripts/gpu/icache_bench.cu
// && /tmp/icache_bench
#include <cstdio>
#include "bench_words.cuh"

constexpr int WARPS = 16, FMAS = 256, ITERS = 6;

template <int R>
__device__ __forceinline__ void region(float (&a)[8]) {
  // the region number as an operand: every region is its own code
#pragma unroll
  for (int i = 0; i < FMAS; i++)
    asm volatile("fma.rn.f32 %0, %0, %1, %2;" : "+f"(a[i & 7]) : "f"(1.0001f), "f"((float)R));
}

template <int R, int N>
struct Walk {
  __device__ __forceinline__ static void run(float (&a)[8]) {
    region<R>(a);
    Walk<R + 1, N>::run(a);
  }
};
template <int N>
struct Walk<N, N> {
  __device__ __forceinline__ static void run(float (&)[8]) {}
};

// out[block * ITERS + i]: cycles of pass i, measured by the walking warp (warp 15's lane 0).
template <int REGIONS>
__global__ void __launch_bounds__(WARPS * 32, 1) walk(int lone, long long* out, float* sink) {
  float a[8];
#pragma unroll
  for (int j = 0; j < 8; j++) a[j] = threadIdx.x * 1e-3f + j;
  const bool walks = !lone || threadIdx.x / 32 == WARPS - 1;
  for (int i = 0; i < ITERS; i++) {
    __syncthreads();
    const long long t0 = now();
    if (walks) Walk<0, REGIONS>::run(a);
    const long long t1 = now();
    if (threadIdx.x == WARPS * 32 - 32) out[blockIdx.x * ITERS + i] = t1 - t0;
  }
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < 8; j++) s += a[j];
  if (s == 12345.f) sink[threadIdx.x] = s;  // keeps the FMAs
}

template <int REGIONS>
void measure(int sms, long long* d_out, float* d_sink, long long* h_out) {
  double first[2], later[2];
  for (int lone = 0; lone < 2; lone++) {
    walk<REGIONS><<<sms, WARPS * 32>>>(lone, d_out, d_sink);
    cudaMemcpy(h_out, d_out, sizeof(long long) * sms * ITERS, cudaMemcpyDeviceToHost);
    double f = 0, l = 0;
    for (int b = 0; b < sms; b++) {
      f += h_out[b * ITERS];
      for (int i = 1; i < ITERS; i++) l += h_out[b * ITERS + i];
    }
    const double instr = (double)REGIONS * FMAS;
    first[lone] = f / sms / instr;
    later[lone] = l / sms / (ITERS - 1) / instr;
  }
  printf("%4d KB | %6.2f %6.2f | %6.2f %6.2f\n", REGIONS * FMAS * 16 / 1024, first[1], later[1],
         first[0], later[0]);
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  long long *d_out, *h_out = new long long[sms * ITERS];
  float* d_sink;
  cudaMalloc(&d_out, sizeof(long long) * sms * ITERS);
  cudaMalloc(&d_sink, sizeof(float) * WARPS * 32);
  printf("code    | one warp: first later | 16 warps: first later   (SM cycles per instruction)\n");
  measure<1>(sms, d_out, d_sink, h_out);
  measure<4>(sms, d_out, d_sink, h_out);
  measure<8>(sms, d_out, d_sink, h_out);
  measure<16>(sms, d_out, d_sink, h_out);
  measure<32>(sms, d_out, d_sink, h_out);
  measure<64>(sms, d_out, d_sink, h_out);
  measure<128>(sms, d_out, d_sink, h_out);
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) printf("error: %s\n", cudaGetErrorString(e));
  return 0;
}
