// Exchange microbenchmark (kernel notes, "Version 1.5"): a chain of dependent all-to-all exchanges
// between one block per SM through tagged 64-bit words (the frame kernel's scheme), with weight
// streams of several shapes in flight. Prints microseconds per exchange and the weight bandwidth.
// On the GPU machine: nvcc -O3 -arch=sm_90a -o /tmp/exchange_bench scripts/gpu/exchange_bench.cu
// && /tmp/exchange_bench
#include <cstdio>
#include "bench_words.cuh"
extern __shared__ __align__(128) unsigned char dsm[];
// kind 0: D uint4 per lane loaded before the wait (register preload)
// kind 1: D uint4 per lane loaded after the wait (no preload)
// kind 2: TMA: one bulk copy of D*512 bytes per warp into shared memory before the wait
// kind 3: like 0, rows scattered (row r of a warp at stride 132 rows)
// kind 4: like 0 without any exchange (pure streaming)
template<int D>
__global__ void __launch_bounds__(512,1) chain(u64* words, int n, int iters, u32 epoch, const uint4* W, size_t wchunks, int kind, float* sink){
  float* xs=(float*)dsm;                 // 1024 floats
  u64* bars=(u64*)(dsm+4096);            // 16 mbarriers
  unsigned char* stage=dsm+4096+128;     // 16 warps x D*512 bytes
  const int t=threadIdx.x, lane=t&31, warp=t>>5;
  float acc=0.f;
  const size_t per_it=(size_t)gridDim.x*16*D*32;   // chunks per iteration, all warps
  if(kind==2 && lane==0){ asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;"::"r"(sa(&bars[warp])):"memory"); asm volatile("fence.mbarrier_init.release.cluster;":::"memory"); }
  __syncthreads();
  for(int it=0;it<iters;it++){
    const u32 tag=(epoch<<16)|(u32)(it+1), ptag=(epoch<<16)|(u32)it;
    u64* buf=words+(size_t)(it&1)*4096; u64* prev=words+(size_t)((it+1)&1)*4096;
    size_t base=((size_t)it*per_it + ((size_t)blockIdx.x*16+warp)*D*32)%wchunks;
    if(kind==3) base=((size_t)it*per_it + ((size_t)warp*gridDim.x+blockIdx.x)*128)%wchunks;
    uint4 w[D];
    if(kind==0||kind==3||kind==4){
#pragma unroll
      for(int j=0;j<D;j++){ size_t c = kind==3 ? base + (size_t)(j/4)*gridDim.x*16*128 + lane+32*(j%4) : base+lane+32*j; w[j]=ldnc(W+c%wchunks);} }
    if(kind==2 && lane==0){
      u32 bytes=D*512; u32 bar=sa(&bars[warp]);
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"::"r"(bar),"r"(bytes):"memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"::"r"(sa(stage+warp*D*512)),"l"(W+base),"r"(bytes),"r"(bar):"memory");
    }
    if(it>0 && kind!=4){
      u64 v0=ldw(prev+t), v1=ldw(prev+t+512);
      while((u32)(v0>>32)!=ptag) v0=ldw(prev+t);
      while((u32)(v1>>32)!=ptag) v1=ldw(prev+t+512);
      xs[t]=__uint_as_float((u32)v0); xs[t+512]=__uint_as_float((u32)v1);
    }
    __syncthreads();
    if(kind==1){
#pragma unroll
      for(int j=0;j<D;j++) w[j]=ldnc(W+(base+lane+32*j)%wchunks);
    }
    if(kind==2){
      u32 ok=0, bar=sa(&bars[warp]);
      while(!ok) asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }":"=r"(ok):"r"(bar),"r"((u32)(it&1)):"memory");
      const uint4* s=(const uint4*)(stage+warp*D*512);
#pragma unroll
      for(int j=0;j<D;j++) w[j]=s[lane+32*j];
      __syncwarp();
    }
#pragma unroll
    for(int j=0;j<D;j++) acc+=__uint_as_float(w[j].x)*xs[lane+32*(j&7)]+__uint_as_float(w[j].w);
    if(kind!=4 && t<8){ for(int i=blockIdx.x*8; i<n; i+=gridDim.x*8) if(i+t<n) stw(buf+i+t, ((u64)tag<<32)|__float_as_uint(acc+xs[t])); }
    if(kind!=4) __syncthreads();
  }
  if(acc==12345.f) sink[0]=acc;
}
template<int D> void run(const char* what,int kind,u64* words,int sms,u32& epoch,const uint4* W,size_t wchunks,float* sink){
  int iters=1000; size_t smem=4096+128+16*D*512;
  cudaFuncSetAttribute(chain<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  cudaEvent_t a,b; cudaEventCreate(&a); cudaEventCreate(&b);
  float ms=0;
  for(int rep=0;rep<3;rep++){
    cudaEventRecord(a);
    chain<D><<<sms,512,smem>>>(words,1024,iters,epoch++,W,wchunks,kind,sink);
    cudaEventRecord(b); cudaEventSynchronize(b);
    cudaEventElapsedTime(&ms,a,b);
    cudaError_t e=cudaGetLastError(); if(e){printf("%s: error %s\n",what,cudaGetErrorString(e));return;}
  }
  double us=ms*1000.0/iters, mb=(double)sms*16*D*512/1e6;
  printf("%-44s %6.3f us/exchange  %5.2f MB  %6.2f TB/s\n", what, us, mb, mb/us);
}
int main(){
  int sms; cudaDeviceGetAttribute(&sms,cudaDevAttrMultiProcessorCount,0);
  u64* words; cudaMalloc(&words, 2*4096*8); cudaMemset(words,0,2*4096*8);
  size_t wbytes=(size_t)2<<30; uint4* W; cudaMalloc(&W,wbytes); cudaMemset(W,0,wbytes);
  size_t wchunks=wbytes/16;
  float* sink; cudaMalloc(&sink,4);
  u32 epoch=1;
  printf("SMs %d\n", sms);
  run<1>("exchange + 0.5 KB/warp preloaded",0,words,sms,epoch,W,wchunks,sink);
  run<4>("exchange + 2 KB/warp preloaded",0,words,sms,epoch,W,wchunks,sink);
  run<8>("exchange + 4 KB/warp preloaded",0,words,sms,epoch,W,wchunks,sink);
  run<16>("exchange + 8 KB/warp preloaded",0,words,sms,epoch,W,wchunks,sink);
  run<4>("exchange + 2 KB/warp after the wait",1,words,sms,epoch,W,wchunks,sink);
  run<8>("exchange + 4 KB/warp after the wait",1,words,sms,epoch,W,wchunks,sink);
  run<4>("exchange + 2 KB/warp TMA before",2,words,sms,epoch,W,wchunks,sink);
  run<8>("exchange + 4 KB/warp TMA before",2,words,sms,epoch,W,wchunks,sink);
  run<16>("exchange + 8 KB/warp TMA before",2,words,sms,epoch,W,wchunks,sink);
  run<8>("exchange + 4 KB/warp preloaded, scattered rows",3,words,sms,epoch,W,wchunks,sink);
  run<4>("no exchange, 2 KB/warp per step",4,words,sms,epoch,W,wchunks,sink);
  run<8>("no exchange, 4 KB/warp per step",4,words,sms,epoch,W,wchunks,sink);
  run<16>("no exchange, 8 KB/warp per step",4,words,sms,epoch,W,wchunks,sink);
  return 0;
}
