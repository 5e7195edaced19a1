// Hopper (sm_90a) warpgroup MMA for the GEMM (gemm.cu): shared-memory tiles in the 128-byte swizzle, their
// matrix descriptors, and wgmma.mma_async m64n256k16 with FP32 accumulators (PTX ISA, "Asynchronous
// Warpgroup Level Matrix Multiply-Accumulate").
//
// A tile is stored in atoms of 8 lines of 128 bytes (64 FP16/BF16 elements), 1024 bytes each, the 16-byte
// chunk c of line l of an atom at chunk c ^ (l % 8): swizzle128 of the unswizzled offset. The hardware
// applies the same XOR to the shared-memory address bits [4, 7) from bits [7, 10), so tiles start on
// 1024-byte boundaries (the descriptors' base offset is then 0).
//   - K-major operand (A row-major, B column-major): a line is one row (M or N) of 64 K elements; atoms of
//     8 rows follow each other (stride dimension byte offset, SBO = 1024). One wgmma reads 16 K: the
//     descriptor's start moves 32 bytes per step of 16 inside the 128-byte line, the swizzle still taken
//     from the address.
//   - MN-major operand (A column-major, B row-major): a line is one K index of 64 M or N elements; 8 K lines
//     make an atom (SBO = 1024 between groups of 8 K), and the 64-element panels along M or N follow each
//     other every kPanelBytes (leading dimension byte offset, LBO). One wgmma's 16 K are 2048 bytes further
//     per step.
//
// The CUDA simulator (tests/native/cuda_sim) models these descriptors and the instruction from the same
// reading of the PTX ISA; a GPU run is what checks that reading.
#pragma once

#include <cstdint>

namespace mpf {
namespace sm90 {

constexpr int kLineBytes = 128;   // one line of a 128-byte-swizzled atom
constexpr int kAtomBytes = 1024;  // 8 lines

// The stored position of the unswizzled byte offset `off` of a tile that starts 1024-byte aligned.
__host__ __device__ constexpr uint32_t swizzle128(uint32_t off) { return off ^ (((off >> 7) & 7u) << 4); }

// A shared-memory matrix descriptor with the 128-byte swizzle: start address, leading and stride dimension
// byte offsets (each encoded as (x & 0x3FFFF) >> 4), base offset 0, swizzle mode 1 in bits [62, 64).
__device__ __forceinline__ uint64_t smem_desc128(uint32_t start, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((start & 0x3FFFFu) >> 4) | (static_cast<uint64_t>((lbo & 0x3FFFFu) >> 4) << 16) |
         (static_cast<uint64_t>((sbo & 0x3FFFFu) >> 4) << 32) | (uint64_t{1} << 62);
}

// Orders this thread's earlier accesses of the accumulators before the next wgmma.mma_async.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
// The wgmma.mma_async issued since the last commit become one group.
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most kPending groups of this thread's warpgroup are in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Makes this thread's generic-proxy writes of shared memory (cp.async's included) visible to the async
// proxy that wgmma reads shared memory through; a barrier after it makes every thread's visible.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---- mbarriers and TMA copies (the Hopper GEMM's producer/consumer pipeline) ----
// An mbarrier (8 bytes of shared memory, at a shared-window address) completes a phase when its expected
// arrivals have arrived and the bytes announced with expect_tx have landed; the phase count's parity is what
// threads wait on. Initialised by one thread; fence_mbarrier_init and a barrier publish the initialisation.
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// One arrival that also announces `bytes` of copies that complete on this barrier's current phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Whether the phase of parity `parity` has completed (the current phase, or the one before it).
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(done)
               : "r"(bar), "r"(parity)
               : "memory");
  return done != 0;
}
// Waits for that phase. A wait in the GEMM's pipeline lasts microseconds; one past 2^37 clock cycles (about 70
// seconds at 2 GHz) means a phase that will never complete, and the kernel traps: the launch fails instead of
// hanging. (2^32, two seconds, was too close: compute-sanitizer's racecheck and synccheck slow a kernel by
// orders of magnitude, a debugger stops warps, and clock64 counts while an SM is switched to other work; a
// trap there leaves the context unusable for every later call.)
constexpr long long kMbarWaitLimitCycles = 1ll << 37;
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  if (mbar_try_wait(bar, parity)) return;
  const long long start = clock64();
  while (!mbar_try_wait(bar, parity))
    if (clock64() - start > kMbarWaitLimitCycles) __trap();
}

// A TMA copy of one box of a 3-D tensor map (innermost coordinate first) into shared memory at dst, in the
// map's swizzle; its bytes complete on mbarrier `bar`. Out-of-bounds elements land as zeros. `map` is the
// generic address of a kernel parameter (declared grid-constant).
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* map, int c0, int c1, int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// ---- thread block clusters (the Hopper GEMM's 2-CTA variant) ----
// This CTA's rank in its cluster (x fastest).
__device__ __forceinline__ uint32_t cluster_ctarank() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  return __clusterRelativeBlockRank();
#else
  return 0;  // no clusters below sm_90 (the Hopper kernel's image there is a trap)
#endif
}
// A barrier of every thread of the cluster (none may have exited): each thread's earlier memory accesses, remote
// mbarrier arrivals included, are ordered before the accesses of every thread after it (release, then acquire).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory");
}
// One arrival on the mbarrier at shared address `bar` of the cluster's CTA `rank` (the same offset in that CTA's
// shared memory; rank may be this CTA's own). Default semantics (release at CTA scope): the GEMM's consumers arrive
// once wgmma.wait_group has retired their reads of the stage, so nothing of theirs is left to order before the
// peer's copies; a cluster-scope release would put a GPU-wide memory barrier before every arrival.
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank) {
  asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\nmbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
               "r"(rank)
               : "memory");
}
// tma_load_3d into the same shared address of every CTA of the cluster whose rank is a bit of `mask`, each copy
// completing its bytes on that CTA's mbarrier at `bar`.
__device__ __forceinline__ void tma_load_3d_multicast(uint32_t dst, const void* map, int c0, int c1, int c2, uint32_t bar,
                                                      uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(mask)
      : "memory");
}

// Hands registers back (dec) or takes more (inc) for the executing warpgroup: every warp of it runs the same one.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// Keeps the compiler from moving accesses of an accumulator across the asynchronous MMAs.
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// The operands of m64n256k16's 128 accumulators: "%0, ..., %127" and "+f"(d[0]), ..., "+f"(d[127]).
#define MPF_WGMMA_N256_ACC_REGS \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define MPF_WGMMA_N256_ACC_OPERANDS(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
  "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// d (64 x 256, this thread's 128 of it) += A (64 x 16) B (16 x 256), both from shared memory through their
// descriptors; kTransA / kTransB: 0 for a K-major operand, 1 for an MN-major one. Thread t of the
// warpgroup (warp w = t / 32, lane l = t % 32) holds d[i] = D(16 w + l / 4 + 8 ((i / 2) % 2),
// 8 (i / 4) + 2 (l % 4) + i % 2).
template <bool kBf16, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
  if constexpr (kBf16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" MPF_WGMMA_N256_ACC_REGS
                 "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
                 : MPF_WGMMA_N256_ACC_OPERANDS(d)
                 : "l"(desc_a), "l"(desc_b), "r"(1), "n"(kTransA), "n"(kTransB));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {" MPF_WGMMA_N256_ACC_REGS
                 "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
                 : MPF_WGMMA_N256_ACC_OPERANDS(d)
                 : "l"(desc_a), "l"(desc_b), "r"(1), "n"(kTransA), "n"(kTransB));
  }
}

}  // namespace sm90
}  // namespace mpf
