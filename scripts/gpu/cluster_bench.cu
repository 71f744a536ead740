// Cluster exchange microbenchmark (kernel notes, "Session 14"): is an exchange between the blocks of
// one thread-block cluster, through distributed shared memory and the cluster barrier, cheaper than
// the frame kernel's grid-wide exchange through tagged words in L2, with weight streams in flight?
// Chains of dependent exchanges between 512-thread blocks (one per SM was not enforced: 100 KB of
// shared memory leaves room for two), each warp's weight batches loaded before the wait (the
// frame kernel's register preload). Prints microseconds per exchange.
// Session 14 (NVIDIA H100 80GB HBM3): launched with the cluster attribute, the grid-wide rows at
// 132 blocks with 2 and 4 KB per warp never finished (not investigated; the 128-block rows are the
// comparison), nor did mode 4 at cluster size 8; every other row ran. Results: kernel notes.
// On the GPU machine: nvcc -O3 -arch=sm_90a -o /tmp/cluster_bench scripts/gpu/cluster_bench.cu
// && /tmp/cluster_bench && for i in $(seq 0 30); do timeout 20 /tmp/cluster_bench $i || echo "run $i: $?"; done
#include <cstdio>
#include "bench_words.cuh"
#include <cstdlib>
__device__ __forceinline__ u32 rank(){u32 r;asm volatile("mov.u32 %0, %%cluster_ctarank;":"=r"(r));return r;}
__device__ __forceinline__ u32 peer_addr(u32 a,u32 r){u32 d;asm volatile("mapa.shared::cluster.u32 %0, %1, %2;":"=r"(d):"r"(a),"r"(r));return d;}
__device__ __forceinline__ void st_peer(u32 a,float v){asm volatile("st.shared::cluster.f32 [%0], %1;"::"r"(a),"f"(v):"memory");}
__device__ __forceinline__ void arrive(){asm volatile("barrier.cluster.arrive.release.aligned;":::"memory");}
__device__ __forceinline__ void cwait(){asm volatile("barrier.cluster.wait.acquire.aligned;":::"memory");}
__device__ __forceinline__ void st_async(u32 a,float v,u32 bar){asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"::"r"(a),"r"(__float_as_uint(v)),"r"(bar):"memory");}
__device__ __forceinline__ void expect(u32 bar,u32 bytes){asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"::"r"(bar),"r"(bytes):"memory");}
__device__ __forceinline__ void bar_wait(u32 bar,u32 parity){u32 ok=0;while(!ok) asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }":"=r"(ok):"r"(bar),"r"(parity):"memory");}
extern __shared__ __align__(128) unsigned char dsm[];
// mode 0: grid-wide exchange of 1,024 tagged words (each block publishes its share, reads all)
// mode 1: cluster exchange: each block writes 32 values into every peer's shared memory, then
//         the cluster barrier (32 x S values per exchange)
// mode 2: grid-wide sum of partials: each cluster publishes 1,024 partial words (64 per block at
//         S = 16), each block sums its share of every cluster's partials, then writes the sums into
//         every peer (the cluster barrier): every block ends with 1,024 sums
// mode 3: no exchange (weights only)
// mode 4: mode 1's exchange by st.async into every peer, each value completing bytes on the
//         receiver's mbarrier (no cluster barrier, so no release of the weight loads in flight)
template<int D>
__global__ void __launch_bounds__(512,1) chain(u64* words, int iters, u32 epoch, const uint4* W, size_t wchunks, int mode, int S, float* sink){
  float* buf=(float*)dsm;                // two buffers of 1,024 floats
  float* tmp=buf+2048;                   // up to 2,048 floats (mode 2)
  const int t=threadIdx.x, lane=t&31, warp=t>>5;
  const int clusters=gridDim.x/S, c=blockIdx.x/S;
  const u32 r=mode==1||mode==2||mode==4?rank():0;
  u64* bars=(u64*)(buf+4096);            // mode 4: one mbarrier per buffer
  if(mode==4){
    if(t<2) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;"::"r"(sa(&bars[t])):"memory");
    asm volatile("fence.mbarrier_init.release.cluster;":::"memory");
    arrive(); cwait();
  }
  float acc=0.f;
  const size_t per_it=(size_t)gridDim.x*16*D*32;
  for(int i=t;i<2048;i+=512) buf[i]=0.f;
  __syncthreads();
  if(mode==1||mode==2) arrive();
  for(int it=0;it<iters;it++){
    const u32 tag=(epoch<<16)|(u32)(it+1), ptag=(epoch<<16)|(u32)it;
    const size_t base=((size_t)it*per_it + ((size_t)blockIdx.x*16+warp)*D*32)%wchunks;
    uint4 w[D];
#pragma unroll
    for(int j=0;j<D;j++) w[j]=ldnc(W+(base+lane+32*j)%wchunks);
    float* xs=buf+((it+1)&1)*1024;
    float* out=buf+(it&1)*1024;
    if(mode==0 && it>0){
      const u64* prev=words+(size_t)((it+1)&1)*4096;
      u64 v0=ldw(prev+t), v1=ldw(prev+t+512);
      while((u32)(v0>>32)!=ptag) v0=ldw(prev+t);
      while((u32)(v1>>32)!=ptag) v1=ldw(prev+t+512);
      xs[t]=__uint_as_float((u32)v0); xs[t+512]=__uint_as_float((u32)v1);
    }
    if(mode==4){
      if(t==0) expect(sa(&bars[it&1]),32*S*4);
      if(it>0) bar_wait(sa(&bars[(it+1)&1]),((it-1)>>1)&1);
    }
    else if(mode==1||mode==2) cwait(); else __syncthreads();
#pragma unroll
    for(int j=0;j<D;j++) acc+=__uint_as_float(w[j].x)*xs[lane+32*(j&7)]+__uint_as_float(w[j].w);
    if(mode==0 && t<8){
      u64* cur=words+(size_t)(it&1)*4096;
      for(int i=blockIdx.x*8;i<1024;i+=gridDim.x*8) stw(cur+i+t,((u64)tag<<32)|__float_as_uint(acc+xs[t]));
    }
    if(mode==0) __syncthreads();
    if(mode==1){
      if(t<32*S){ const u32 p=t>>5; st_peer(peer_addr(sa(out+r*32+lane),p), acc+xs[t]); }
      arrive();
    }
    if(mode==4 && t<32*S){
      const u32 p=t>>5;
      st_async(peer_addr(sa(out+r*32+lane),p), acc+xs[t], peer_addr(sa(&bars[it&1]),p));
    }
    if(mode==2){
      const int E=1024/S;
      u64* part=words+(size_t)(it&1)*(16*1024);
      if(t<E) stw(part+(size_t)c*1024+r*E+t,((u64)tag<<32)|__float_as_uint(acc+xs[t]));
      for(int k=t;k<E*clusters;k+=512){
        const int cc=k/E, e=k%E;
        const u64* src=part+(size_t)cc*1024+r*E+e;
        u64 v=ldw(src);
        while((u32)(v>>32)!=tag) v=ldw(src);
        tmp[cc*E+e]=__uint_as_float((u32)v);
      }
      __syncthreads();
      for(int k=t;k<E*S;k+=512){
        const int p=k/E, e=k%E;
        float s=0.f;
        for(int cc=0;cc<clusters;cc++) s+=tmp[cc*E+e];
        st_peer(peer_addr(sa(out+r*E+e),p), s);
      }
      arrive();
    }
  }
  if(mode==1||mode==2) cwait();
  if(mode==4){ bar_wait(sa(&bars[(iters+1)&1]),((iters-1)>>1)&1); arrive(); cwait(); }
  if(acc==12345.f) sink[0]=acc;
}
template<int D> void run(const char* what,int mode,int S,int grid,u64* words,u32& epoch,const uint4* W,size_t wchunks,float* sink){
  int iters=2000; size_t smem=100*1024;
  cudaFuncSetAttribute(chain<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  cudaFuncSetAttribute(chain<D>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  cudaLaunchConfig_t cfg={}; cfg.gridDim=dim3(grid); cfg.blockDim=dim3(512); cfg.dynamicSmemBytes=smem;
  cudaLaunchAttribute at[1]; at[0].id=cudaLaunchAttributeClusterDimension; at[0].val.clusterDim.x=S; at[0].val.clusterDim.y=1; at[0].val.clusterDim.z=1;
  cfg.attrs=at; cfg.numAttrs=1;
  cudaEvent_t a,b; cudaEventCreate(&a); cudaEventCreate(&b);
  float ms=0;
  for(int rep=0;rep<3;rep++){
    cudaEventRecord(a);
    cudaError_t e=cudaLaunchKernelEx(&cfg,chain<D>,words,iters,epoch++,W,wchunks,mode,S,sink);
    if(e){printf("%-52s launch error %s\n",what,cudaGetErrorString(e));cudaGetLastError();return;}
    cudaEventRecord(b); cudaEventSynchronize(b);
    cudaEventElapsedTime(&ms,a,b);
    e=cudaGetLastError(); if(e){printf("%s: error %s\n",what,cudaGetErrorString(e));return;}
  }
  double us=ms*1000.0/iters, mb=(double)grid*16*D*512/1e6;
  printf("%-52s grid %3d S %2d  %6.3f us/step  %5.2f MB  %5.2f TB/s\n", what, grid, S, us, mb, mb/us);
}
int max_clusters(int S,int grid){
  cudaLaunchConfig_t cfg={}; cfg.gridDim=dim3(grid); cfg.blockDim=dim3(512); cfg.dynamicSmemBytes=100*1024;
  cudaLaunchAttribute at[1]; at[0].id=cudaLaunchAttributeClusterDimension; at[0].val.clusterDim.x=S; at[0].val.clusterDim.y=1; at[0].val.clusterDim.z=1;
  cfg.attrs=at; cfg.numAttrs=1;
  int n=0; cudaOccupancyMaxActiveClusters(&n,chain<4>,&cfg);
  return n;
}
int main(int argc,char** argv){
  setvbuf(stdout,NULL,_IONBF,0);
  int sms; cudaDeviceGetAttribute(&sms,cudaDevAttrMultiProcessorCount,0);
  cudaDeviceProp prop; cudaGetDeviceProperties(&prop,0);
  if(argc<2) printf("%s, %d SMs\n", prop.name, sms);
  cudaFuncSetAttribute(chain<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 100*1024);
  cudaFuncSetAttribute(chain<4>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if(argc<2) for(int S=2;S<=16;S*=2){ const int n=max_clusters(S,128); printf("cluster size %2d: at most %d active clusters (%d blocks)\n",S,n,n*S); }
  u64* words; cudaMalloc(&words, 2*16*1024*8); cudaMemset(words,0,2*16*1024*8);
  size_t wbytes=(size_t)2<<30; uint4* W; cudaMalloc(&W,wbytes); cudaMemset(W,0,wbytes);
  size_t wchunks=wbytes/16;
  float* sink; cudaMalloc(&sink,4);
  u32 epoch=1;
  // one run per process (argv[1]), so that a chain that never completes stops only itself
  const int which=argc>1?atoi(argv[1]):-1;
  int k=0;
#define RUN(D,what,mode,S,grid) if(which==k++) run<D>(what,mode,S,grid,words,epoch,W,wchunks,sink);
  RUN(1,"grid exchange, 0.5 KB/warp preloaded",0,1,sms)
  RUN(4,"grid exchange, 2 KB/warp preloaded",0,1,sms)
  RUN(8,"grid exchange, 4 KB/warp preloaded",0,1,sms)
  RUN(1,"grid exchange, 0.5 KB/warp preloaded",0,1,128)
  RUN(4,"grid exchange, 2 KB/warp preloaded",0,1,128)
  RUN(8,"grid exchange, 4 KB/warp preloaded",0,1,128)
  for(int S=8;S<=16;S*=2){
    RUN(1,"cluster exchange, 0.5 KB/warp preloaded",1,S,128)
    RUN(4,"cluster exchange, 2 KB/warp preloaded",1,S,128)
    RUN(8,"cluster exchange, 4 KB/warp preloaded",1,S,128)
    RUN(16,"cluster exchange, 8 KB/warp preloaded",1,S,128)
    RUN(1,"cluster st.async, 0.5 KB/warp preloaded",4,S,128)
    RUN(4,"cluster st.async, 2 KB/warp preloaded",4,S,128)
    RUN(8,"cluster st.async, 4 KB/warp preloaded",4,S,128)
    RUN(16,"cluster st.async, 8 KB/warp preloaded",4,S,128)
    RUN(1,"grid sum of partials, 0.5 KB/warp preloaded",2,S,128)
    RUN(4,"grid sum of partials, 2 KB/warp preloaded",2,S,128)
    RUN(8,"grid sum of partials, 4 KB/warp preloaded",2,S,128)
  }
  RUN(4,"no exchange, 2 KB/warp",3,1,128)
  RUN(8,"no exchange, 4 KB/warp",3,1,128)
  RUN(16,"no exchange, 8 KB/warp",3,1,128)
  if(which<0) printf("%d runs: pass an index\n",k);
  return 0;
}
