// Helpers shared by the microbenchmarks (exchange_bench.cu, cluster_bench.cu, paced_bench.cu,
// reduce_bench.cu, poll_bench.cu, icache_bench.cu): the frame kernel's tagged-word loads and
// stores, its weight loads, a shared-memory address for PTX, an mbarrier phase wait, and the SM
// clock.
#pragma once
#include <cstdint>
typedef unsigned long long u64;
typedef unsigned int u32;
__device__ __forceinline__ u64 ldw(const u64* p){u64 v;asm volatile("ld.relaxed.gpu.global.u64 %0,[%1];":"=l"(v):"l"(p):"memory");return v;}
__device__ __forceinline__ void stw(u64* p,u64 v){asm volatile("st.relaxed.gpu.global.u64 [%0],%1;"::"l"(p),"l"(v):"memory");}
__device__ __forceinline__ uint4 ldnc(const void* p){uint4 r;asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3},[%4];":"=r"(r.x),"=r"(r.y),"=r"(r.z),"=r"(r.w):"l"(p));return r;}
__device__ __forceinline__ u32 sa(const void* p){return (u32)__cvta_generic_to_shared(p);}
__device__ __forceinline__ bool try_wait(u32 bar, u32 parity){u32 ok;asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }":"=r"(ok):"r"(bar),"r"(parity):"memory");return ok;}
__device__ __forceinline__ void wait_bar(u32 bar, u32 parity){while(!try_wait(bar,parity)){}}
__device__ __forceinline__ long long now(){long long c;asm volatile("mov.u64 %0, %%clock64;":"=l"(c));return c;}
