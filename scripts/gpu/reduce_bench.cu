// Reduction-exchange microbenchmark (kernel notes, "Session 10"): every block adds its contribution
// to n accumulators with red.add.u64 (a count in the top byte, fixed point below) and readers poll
// until the count is complete; compare with exchange_bench.cu's tagged words. On the GPU machine:
// nvcc -O3 -arch=sm_90a -o /tmp/reduce_bench scripts/gpu/reduce_bench.cu && /tmp/reduce_bench
#include <cstdio>
#include "bench_words.cuh"
__device__ __forceinline__ void redw(u64* p,u64 v){asm volatile("red.relaxed.gpu.global.add.u64 [%0],%1;"::"l"(p),"l"(v):"memory");}
__device__ __forceinline__ bool complete(u64 v, u32 nblk){ long long d=(long long)(v-((u64)nblk<<56)); return d> -(1ll<<55) && d < (1ll<<55);}
template<int D>
__global__ void __launch_bounds__(512,1) chain(u64* accs, int n, int stride, int iters, const uint4* W, size_t wchunks, int loads, float* sink){
  __shared__ float xs[1024];
  const int t=threadIdx.x, lane=t&31, warp=t>>5;
  float acc=0.f;
  const size_t per_it=(size_t)gridDim.x*16*D*32;
  for(int it=0;it<iters;it++){
    u64* cur=accs+(size_t)it*n*stride; u64* prev=accs+(size_t)(it-1)*n*stride;
    size_t base=((size_t)it*per_it + ((size_t)blockIdx.x*16+warp)*D*32)%wchunks;
    uint4 w[D];
#pragma unroll
    for(int j=0;j<D;j++) w[j]= loads? ldnc(W+(base+lane+32*j)%wchunks) : make_uint4(0,0,0,0);
    if(it>0){
      for(int i=t;i<n;i+=512){
        u64 v=ldw(prev+(size_t)i*stride);
        while(!complete(v,gridDim.x)) v=ldw(prev+(size_t)i*stride);
        xs[i&1023]=(float)(long long)(v-((u64)gridDim.x<<56))*(1.f/16777216.f);
      }
    }
    __syncthreads();
#pragma unroll
    for(int j=0;j<D;j++) acc+=__uint_as_float(w[j].x)*xs[lane+32*(j&7)]+__uint_as_float(w[j].w);
    // every block adds a contribution to each of the n accumulators
    for(int i=t;i<n;i+=512){
      const long long q=(long long)((acc+xs[i&1023])*1e-3f*16777216.f) + (blockIdx.x&1 ? 1 : -1);
      redw(cur+(size_t)i*stride, (1ull<<56)+(u64)q);
    }
    __syncthreads();
  }
  if(acc==12345.f) sink[0]=acc;
}
template<int D> void run(const char* what,u64* accs,int n,int stride,int sms,const uint4* W,size_t wchunks,int loads,float* sink){
  int iters=1000;
  cudaEvent_t a,b; cudaEventCreate(&a); cudaEventCreate(&b);
  float ms=0;
  for(int rep=0;rep<3;rep++){
    cudaMemset(accs,0,(size_t)iters*n*stride*8);
    cudaDeviceSynchronize();
    cudaEventRecord(a);
    chain<D><<<sms,512>>>(accs,n,stride,iters,W,wchunks,loads,sink);
    cudaEventRecord(b); cudaEventSynchronize(b);
    cudaEventElapsedTime(&ms,a,b);
    cudaError_t e=cudaGetLastError(); if(e){printf("%s: error %s\n",what,cudaGetErrorString(e));return;}
  }
  double us=ms*1000.0/iters, mb=loads?(double)sms*16*D*512/1e6:0;
  printf("%-52s %6.3f us/exchange  %5.2f MB  %6.2f TB/s\n", what, us, mb, mb/us);
}
int main(){
  int sms; cudaDeviceGetAttribute(&sms,cudaDevAttrMultiProcessorCount,0);
  u64* accs; cudaMalloc(&accs, (size_t)1000*3072*4*8);
  size_t wbytes=(size_t)2<<30; uint4* W; cudaMalloc(&W,wbytes); cudaMemset(W,0,wbytes);
  size_t wchunks=wbytes/16;
  float* sink; cudaMalloc(&sink,4);
  printf("SMs %d\n", sms);
  run<1>("red exchange 1024, no weights",accs,1024,1,sms,W,wchunks,0,sink);
  run<1>("red exchange 1024 stride 32B, no weights",accs,1024,4,sms,W,wchunks,0,sink);
  run<1>("red exchange 512, no weights",accs,512,1,sms,W,wchunks,0,sink);
  run<1>("red exchange 2048, no weights",accs,2048,1,sms,W,wchunks,0,sink);
  run<4>("red exchange 1024 + 2 KB/warp preloaded",accs,1024,1,sms,W,wchunks,1,sink);
  run<8>("red exchange 1024 + 4 KB/warp preloaded",accs,1024,1,sms,W,wchunks,1,sink);
  run<16>("red exchange 1024 + 8 KB/warp preloaded",accs,1024,1,sms,W,wchunks,1,sink);
  run<8>("red exchange 1024 stride 32B + 4 KB/warp",accs,1024,4,sms,W,wchunks,1,sink);
  return 0;
}
