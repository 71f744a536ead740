// Sampler microbenchmark: the frame kernel's sampling (sample_logits) on one block, on logits
// already in shared memory, timed with the SM clock. Prints cycles per call of the threshold
// search alone and of the whole sampler, and a hash of the drawn codes (variants must agree).
// On the GPU machine: nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/sampler_bench
//   scripts/gpu/sampler_bench.cu && /tmp/sampler_bench
// (-DFRAME_CU='"path/to/variant.cu"' benches another version of the kernel source.)
#ifndef FRAME_CU
#define FRAME_CU "../../crates/voxkernel-cuda/kernels/frame.cu"
#endif
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
#include FRAME_CU

// mode 0: the whole sampler; 1: the threshold search alone
extern "C" __global__ void __launch_bounds__(THREADS, 1)
    sampler_bench(const float* logits, int n, int sets, int iters, int top_k, int mode,
                  long long* cycles, int* codes) {
  float* v = smem;
  float* scratch = smem + n + HIST_WORDS;
  float* redf = scratch + 2 * n;
  int* redi = reinterpret_cast<int*>(redf + 32);
  Sampler sp;
  sp.do_sample = 1;
  sp.top_k = top_k;
  sp.temperature = 0.9f;
  sp.repetition_penalty = 1.f;
  sp.top_p = 1.f;
  long long total = 0;
  for (int it = 0; it < iters; it++) {
    const float* src = logits + (size_t)(it % sets) * n;
    u32* hist = clear_histogram(smem, n);
    for (int i = tid(); i < n; i += THREADS) v[i] = src[i] / sp.temperature;
    __syncthreads();
    const long long t0 = clock64();
    int code;
    if (mode == 0)
      code = sample_logits(v, n, sp, 7u, 11u, (u32)it, 3u, redf, redi, hist, scratch);
    else
      code = (int)kth_largest_key(v, n, top_k, hist, hist + 256);
    __syncthreads();
    total += clock64() - t0;
    if (tid() == 0) codes[it] = code;
    __syncthreads();
  }
  if (tid() == 0) *cycles = total;
}

#define CK(x)                                                              \
  do {                                                                     \
    cudaError_t e = (x);                                                   \
    if (e != cudaSuccess) {                                                \
      printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));     \
      exit(1);                                                             \
    }                                                                      \
  } while (0)

int main() {
  const int sets = 64, iters = 2048;
  unsigned long long s = 0x9e3779b97f4a7c15ull;
  auto uni = [&]() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return ((s >> 11) + 0.5) / 9007199254740992.0;
  };
  printf("%-26s %12s %12s %18s\n", "logits", "select cyc", "sampler cyc", "codes hash");
  struct Case { const char* name; int n; float sigma; int masked; };
  const Case cases[] = {{"2048 N(0,1)", 2048, 1.f, 0},     {"2048 N(0,4)", 2048, 4.f, 0},
                        {"2048 N(0,0.25)", 2048, 0.25f, 0}, {"3072 N(0,1) 1023 -inf", 3072, 1.f, 1023},
                        {"3072 N(0,4) 1023 -inf", 3072, 4.f, 1023}};
  for (const Case& c : cases) {
    std::vector<float> h((size_t)sets * c.n);
    for (int k = 0; k < sets; k++)
      for (int i = 0; i < c.n; i++) {
        const double g = sqrt(-2 * log(uni())) * cos(6.283185307179586 * uni());
        h[(size_t)k * c.n + i] = i >= c.n - c.masked ? -INFINITY : (float)(g * c.sigma);
      }
    float* d;
    long long* cyc;
    int* codes;
    CK(cudaMalloc(&d, h.size() * 4));
    CK(cudaMalloc(&cyc, 8));
    CK(cudaMalloc(&codes, iters * 4));
    CK(cudaMemcpy(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    const int smem_bytes = (3 * c.n + HIST_WORDS + 64) * 4;
    CK(cudaFuncSetAttribute(sampler_bench, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    long long out[2];
    unsigned long long hash = 1469598103934665603ull;
    for (int mode = 1; mode >= 0; mode--) {
      sampler_bench<<<1, THREADS, smem_bytes>>>(d, c.n, sets, iters, 50, mode, cyc, codes);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(&out[mode], cyc, 8, cudaMemcpyDeviceToHost));
      if (mode == 0) {
        std::vector<int> hc(iters);
        CK(cudaMemcpy(hc.data(), codes, iters * 4, cudaMemcpyDeviceToHost));
        for (int x : hc) hash = (hash ^ (unsigned)x) * 1099511628211ull;
      }
    }
    printf("%-26s %12.0f %12.0f %18llx\n", c.name, out[1] / (double)iters, out[0] / (double)iters,
           hash);
    CK(cudaFree(d));
    CK(cudaFree(cyc));
    CK(cudaFree(codes));
  }
  int clk;
  CK(cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0));
  printf("SM clock %d MHz (cycles / MHz = us)\n", clk / 1000);
  return 0;
}
