// L2 latency by (SM, line), and one word handed back and forth between block 0 and every other
// block (docs/kernel-notes.md, "Version 1.14"). On the GPU machine:
//   nvcc -O3 -arch=sm_90a -o /tmp/l2_probe scripts/gpu/l2_probe.cu && /tmp/l2_probe
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
typedef unsigned long long u64;
__device__ unsigned smid() { unsigned s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s)); return s; }
__device__ __forceinline__ u64 ld_gpu(const u64* p) {
  u64 v; asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ void st_gpu(u64* p, u64 v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// lines[i*16] holds its own address: a chase of 32 loads per line, min of 4 chases
__global__ void latency(u64* lines, int nlines, unsigned* lat, unsigned* sm_of) {
  extern __shared__ char pad[];
  if (threadIdx.x) return;
  sm_of[blockIdx.x] = smid();
  for (int i = 0; i < nlines; i++) {
    const u64* p = lines + (size_t)i * 16;
    unsigned best = ~0u;
    for (int r = 0; r < 4; r++) {
      const u64* q = p;
      long long t0 = clock64();
      for (int j = 0; j < 32; j++) q = (const u64*)ld_gpu(q);
      long long t1 = clock64();
      if (q != p) best = 0;  // never: keeps the chase
      best = min(best, (unsigned)((t1 - t0) / 32));
    }
    lat[blockIdx.x * nlines + i] = best;
  }
  pad[0] = 0;
}
// block 0 and block `peer` ping-pong on `flag` (one line): round trip in ns per exchange
__global__ void pingpong(u64* flag, int peer, int iters, double* out) {
  extern __shared__ char pad[];
  if (threadIdx.x) return;
  if (blockIdx.x != 0 && blockIdx.x != peer) return;
  const bool a = blockIdx.x == 0;
  u64 t0, t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (u64 k = 1; k <= (u64)iters; k++) {
    if (a) { st_gpu(flag, 2 * k - 1); while (ld_gpu(flag) != 2 * k) {} }
    else { while (ld_gpu(flag) != 2 * k - 1) {} st_gpu(flag, 2 * k); }
  }
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  if (a) *out = (double)(t1 - t0) / iters;
  pad[0] = 0;
}
int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int nlines = 256, smem = 150 * 1024;
  cudaFuncSetAttribute(latency, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaFuncSetAttribute(pingpong, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  u64* lines; cudaMalloc(&lines, (size_t)nlines * 128 * 64);
  std::vector<u64> h(nlines * 16);
  for (int i = 0; i < nlines; i++) h[i * 16] = (u64)(lines + (size_t)i * 16);
  cudaMemcpy(lines, h.data(), h.size() * 8, cudaMemcpyHostToDevice);
  unsigned *lat, *sm_of; cudaMalloc(&lat, sms * nlines * 4); cudaMalloc(&sm_of, sms * 4);
  latency<<<sms, 32, smem>>>(lines, nlines, lat, sm_of);
  latency<<<sms, 32, smem>>>(lines, nlines, lat, sm_of);
  if (cudaDeviceSynchronize() != cudaSuccess) { printf("latency failed\n"); return 1; }
  std::vector<unsigned> L(sms * nlines), S(sms);
  cudaMemcpy(L.data(), lat, L.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(S.data(), sm_of, S.size() * 4, cudaMemcpyDeviceToHost);
  // histogram of all latencies
  int hist[64] = {0};
  for (unsigned v : L) hist[std::min(63u, v / 20)]++;
  printf("L2 load latency (cycles) over %d SMs x %d lines, bins of 20:\n", sms, nlines);
  for (int i = 0; i < 64; i++) if (hist[i]) printf("  %4d-%4d: %d\n", i * 20, i * 20 + 19, hist[i]);
  // per line: spread over SMs; per SM: its mean over lines
  std::vector<double> line_min(nlines, 1e9), line_max(nlines, 0);
  for (int b = 0; b < sms; b++) for (int i = 0; i < nlines; i++) {
    line_min[i] = std::min(line_min[i], (double)L[b * nlines + i]);
    line_max[i] = std::max(line_max[i], (double)L[b * nlines + i]);
  }
  double spread = 0; for (int i = 0; i < nlines; i++) spread += line_max[i] - line_min[i];
  printf("mean (max - min over SMs) per line: %.1f cycles\n", spread / nlines);
  // near/far: for SM b and line i, near if within 40 cycles of the line's min
  std::vector<int> near_sig(sms, 0);
  printf("SM: mean latency, lines near (<= min+40) of %d, first 16 lines' near bits\n", nlines);
  for (int b = 0; b < sms; b++) {
    double m = 0; int nn = 0, bits = 0;
    for (int i = 0; i < nlines; i++) { m += L[b * nlines + i]; bool nr = L[b * nlines + i] <= line_min[i] + 40; nn += nr; if (i < 16 && nr) bits |= 1 << i; }
    near_sig[b] = bits;
    if (b < 12 || b % 11 == 0) printf("  block %3d sm %3u: %.1f, %3d, %04x\n", b, S[b], m / nlines, nn, bits);
  }
  // groups of SMs by their near set over all lines
  std::vector<std::vector<int>> groups; std::vector<std::vector<char>> keys;
  for (int b = 0; b < sms; b++) {
    std::vector<char> k(nlines); for (int i = 0; i < nlines; i++) k[i] = L[b * nlines + i] <= line_min[i] + 40;
    int g = -1;
    for (size_t j = 0; j < keys.size(); j++) { int diff = 0; for (int i = 0; i < nlines; i++) diff += k[i] != keys[j][i]; if (diff < nlines / 8) { g = j; break; } }
    if (g < 0) { keys.push_back(k); groups.push_back({}); g = groups.size() - 1; }
    groups[g].push_back(S[b]);
  }
  printf("SM groups by near-line set: %zu\n", groups.size());
  for (auto& g : groups) { std::sort(g.begin(), g.end()); printf("  %zu SMs:", g.size()); for (int s : g) printf(" %d", s); printf("\n"); }
  // ping-pong between block 0 and every other block, on lines 0..3
  double* out; cudaMalloc(&out, 8);
  printf("ping-pong round trip (ns) block 0 (sm %u) with block b, lines 0-3: [min, median, max over b]\n", S[0]);
  for (int li = 0; li < 4; li++) {
    std::vector<double> rt;
    for (int b = 1; b < sms; b++) {
      cudaMemset(lines + (size_t)li * 16 + 8, 0, 8);
      pingpong<<<sms, 32, smem>>>(lines + (size_t)li * 16 + 8, b, 200, out);
      double v; cudaMemcpy(&v, out, 8, cudaMemcpyDeviceToHost); rt.push_back(v);
    }
    std::vector<double> s = rt; std::sort(s.begin(), s.end());
    printf("  line %d (lat from block 0: %u): %.0f %.0f %.0f;", li, L[li], s[0], s[s.size() / 2], s.back());
    // by group of the peer
    for (size_t g = 0; g < groups.size() && g < 4; g++) {
      double m = 0; int n = 0;
      for (int b = 1; b < sms; b++) if (std::find(groups[g].begin(), groups[g].end(), (int)S[b]) != groups[g].end()) { m += rt[b - 1]; n++; }
      if (n) printf(" group %zu: %.0f (%d)", g, m / n, n);
    }
    printf("\n");
  }
  return 0;
}
