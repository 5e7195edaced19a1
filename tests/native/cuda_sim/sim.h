// mpfused's CUDA simulator: csrc/cuda's kernels compiled as C++ and run on the CPU, one fiber (a stack of its
// own, switched cooperatively on one OS thread) per CUDA thread, so that their indexing, synchronisation and
// launch configurations are tested on machines without a GPU (and under AddressSanitizer/UBSan for
// out-of-bounds and misaligned accesses, ThreadSanitizer for shared-memory races and missing barriers).
//
// What it models, and how strictly:
//   - a block's threads each run to their next barrier in turn (in thread order, then in reverse order in
//     the next block); __syncthreads, __syncthreads_or, __syncwarp and __shfl_down_sync are real barriers
//     among them (a thread that has returned leaves them, as on the GPU). Threads that all wait at barriers
//     that cannot complete (a barrier inside a branch some threads skip) are reported as a deadlock. Under
//     ThreadSanitizer each thread is a fiber of its own and only the barriers order them, so an access to
//     shared or global memory that no barrier separates from another thread's write is reported;
//   - blocks run one after another, in a shuffled order (any order is legal on a GPU);
//   - __shared__ memory is per block and filled with 0xFF bytes (NaN, -1, an invalid bool) when the block
//     starts, so reading what no thread wrote shows; static shared memory is limited to 48 KB, dynamic
//     shared memory to 48 KB unless cudaFuncSetAttribute raised the limit (at most the arch's opt-in limit);
//   - launch limits: grid.x < 2^31, grid.y and grid.z <= 65535, at most 1024 threads a block, kernel
//     arguments of at most 4 KB (32764 bytes with a driver of CUDA 12.1 or newer);
//   - cp.async copies land only when a cp.async.wait_group lets them (their source and destination must be
//     16-byte aligned); wmma fragments check the 32-byte alignment of their pointers and the leading
//     dimension, and each lane owns a share of an accumulator (stores write only the lane's share, as on
//     the GPU, where the lanes of a warp together hold a fragment);
//   - __trap() ends the block's threads and the launch, with an error that cudaGetLastError reports at once
//     (cudaErrorLaunchFailure). On a GPU the launch itself succeeds: the next synchronising call fails, and
//     the context (the process's CUDA state) is lost;
//   - a cp.async destination holds garbage (0xFF bytes, written by the issuing thread) from the copy's issue to
//     the wait_group that lands it;
//   - under AddressSanitizer, shared memory outside the launch's dynamic size and the static arrays is
//     poisoned, so an access out of a shared array is reported.
// What it does not model: concurrency between blocks and between streams (everything runs synchronously,
// on the calling thread's "stream"; the kernels' last-block handshakes are checked by reading them), the memory
// model's weak orderings, timing, warp-synchronous execution (which the kernels must not rely on), the tensor
// cores' own rounding (products are summed in FP32 in k order), the device's libm (expf, erff, pow: the host's
// here), nvcc's contraction of a * b + c into FMAs, partial warp masks (they trap here), and __launch_bounds__.
// Device memory is host memory.
//
// The .cu files are compiled as C++ after tests/native/cuda_sim/rewrite.py has turned launches
// (kernel<<<grid, block, smem, stream>>>(args)), __shared__ declarations and the cp.async assembly into
// calls of this header.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "sim_config.h"

// ---- qualifiers ---------------------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) alignas(n)

// ---- vector types -------------------------------------------------------------------------------------------
struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned int x, y;
};
struct alignas(8) float2 {
  float x, y;
};
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return uint4{x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline uint2 make_uint2(unsigned int x, unsigned int y) { return uint2{x, y}; }
inline float2 make_float2(float x, float y) { return float2{x, y}; }

extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;

namespace mpf_sim {

struct Trap {
  std::string what;
};
[[noreturn]] void trap(const std::string& why);

// ---- the executing thread ---------------------------------------------------------------------------------
struct BlockState;
struct Fiber;
struct ThreadCtx {
  BlockState* block;
  Fiber* fiber;
  unsigned linear;  // the thread's index in its block
};
extern thread_local ThreadCtx* tctx;
inline unsigned lane_id() { return tctx->linear & 31u; }

void sync_block();
unsigned sync_block_or(unsigned v);
void sync_warp(unsigned mask);
uint64_t shfl_exchange(uint64_t bits, unsigned src_lane_offset, int width);  // the value of lane + offset
void* shared_slot(const void* site, size_t size, size_t align);
void* dynamic_shared(size_t align);

// cp.async: 16 bytes, of which the first src_bytes come from src, the rest zero.
void cp_async_cg16(void* dst, const void* src, int src_bytes);
void cp_async_commit();
void cp_async_wait(int pending);
void land_copy16(void* dst, const void* src, int src_bytes);  // sim_land.cpp
void land_poison16(void* dst);

// Statically allocated __shared__ variables: one per declaration (and per instantiation of the enclosing
// template, which the lambda's type tells apart) and per block, aligned as the type and an __align__(Align)
// of the declaration require.
template <class T, size_t Align, class Site>
T& shared(Site) {
  static const char site = 0;
  return *static_cast<T*>(shared_slot(&site, sizeof(T), Align > alignof(T) ? Align : alignof(T)));
}
template <class T>
T* dynamic_shared_as(size_t align) {
  return static_cast<T*>(dynamic_shared(align));
}

// ---- launches -----------------------------------------------------------------------------------------------
struct LaunchShape {
  dim3 grid, block;
  size_t dynamic_smem;
  size_t param_bytes;
  const void* kernel;
  dim3 cluster;  // thread block clusters (cudaLaunchKernelEx's attribute): their blocks run together
};
// Checks the shape; runs body(linear thread index) for every thread of every block. False (with the
// thread's last CUDA error set) when the launch is refused or trapped.
void run(const LaunchShape& shape, const std::function<void()>& body);

template <class T>
constexpr size_t param_size_step(size_t at) {
  return (at + alignof(T) - 1) / alignof(T) * alignof(T) + sizeof(T);
}
template <class... P>
constexpr size_t param_bytes() {
  size_t at = 0;
  ((at = param_size_step<std::decay_t<P>>(at)), ...);
  return at;
}

template <class... P>
struct Launcher {
  void (*kernel)(P...);
  LaunchShape shape;
  template <class... A>
  void operator()(A&&... args) const {
    static_assert(sizeof...(A) == sizeof...(P), "a launch passes every kernel argument");
    // Converted as for a call, once, like the launch's copy into the parameter space.
    const std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
    run(shape, [&] { std::apply(kernel, params); });
  }
};

template <class... P>
Launcher<P...> launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t dynamic_smem = 0, void* stream = nullptr,
                      dim3 cluster = dim3(1, 1, 1)) {
  (void)stream;
  return Launcher<P...>{kernel, LaunchShape{grid, block, dynamic_smem, param_bytes<P...>(), reinterpret_cast<const void*>(kernel),
                                            cluster}};
}
// The outcome of the last launch that ran (cudaLaunchKernelEx returns it).
int last_launch_status();

size_t& func_max_dynamic_smem(const void* kernel);

// ---- Hopper: shared-memory addresses and the warpgroup MMA (csrc/cuda/wgmma.cuh) -------------------------------------
// A shared-memory address (__cvta_generic_to_shared) is the offset in the block's shared arena plus
// kSharedWindowStart: the dynamic shared memory starts off a 1024-byte boundary, as it may on a GPU after static
// variables, so that a kernel relying on alignment it did not make shows.
constexpr uint32_t kSharedWindowStart = 0x300;
uint32_t shared_address(const void* p);
// The bytes at shared address addr (traps outside the block's dynamic shared memory).
const unsigned char* shared_at(uint32_t addr, size_t bytes);
// wgmma.mma_async m64nNk16 with FP32 accumulators d and both operands in shared memory (128-byte swizzle only):
// done when issued, its operands' bytes remembered and checked unchanged when a wgmma.wait_group retires it; the
// thread must have run wgmma.fence since it last waited (or since it started), and every thread of the block
// that had cp.async copies land must have run fence.proxy.async since (the copies write through the generic
// proxy, wgmma reads through the async one). The results reach the accumulator registers when the wait_group
// that retires the last MMA issued on them runs: until then they hold a NaN, so a read before it shows in the
// results, and a write to them traps at the next MMA on them (which takes the earlier MMA's result as input).
void wgmma_m64nNk16(float* d, int n, uint64_t desc_a, uint64_t desc_b, int trans_a, int trans_b, bool bf16);
void wgmma_fence();
void wgmma_commit();
void wgmma_wait(int pending);
void fence_proxy_async();
// sim_land.cpp: the instruction's reads of shared memory (instrumented, so that ThreadSanitizer sees them as the
// issuing thread's) and its arithmetic for thread `t` of the warpgroup, products summed in FP32 in k order; with
// d == nullptr only the hash of the operands it reads. Returns that hash.
uint64_t wgmma_operands(float* d, int n, uint64_t desc_a, uint64_t desc_b, int trans_a, int trans_b, bool bf16, unsigned t);

// ---- Hopper: mbarriers and TMA copies (wgmma.cuh) -----------------------------------------------------------
// An mbarrier is kept beside its 8 bytes of dynamic shared memory (the kernel never reads them): its count, the
// arrivals and transaction bytes its current phase still awaits, the phase number, and the TMA copies in flight
// on it. A phase completes when every expected arrival has come and the copies issued on it cover the bytes that
// expect_tx announced (more bytes than announced traps). Its copies land only then, in the first thread that
// waits on the phase (or arrives on the next one): until then their destination holds garbage (0xFF bytes, the
// issuing thread's writes), so a read that no wait orders after the copy shows. try_wait.parity blocks the
// thread until the phase of that parity has completed; threads that all wait on phases that cannot complete are
// reported as a deadlock. Under ThreadSanitizer an arrival or a copy's issue releases the barrier, and a wait
// that returns acquires it: the kernels' hand-overs through mbarriers are their only ordering.
void mbar_init(uint32_t bar, uint32_t count);
void fence_mbarrier_init();
void mbar_arrive(uint32_t bar, bool expect_tx, uint32_t bytes);
bool mbar_try_wait_parity(uint32_t bar, uint32_t parity);
// cp.async.bulk.tensor.3d (tile mode) of the box at (c0, c1, c2) of a map from cuTensorMapEncodeTiled into shared
// memory at dst, completing on mbarrier bar: out-of-bounds elements land as zeros; the 128-byte swizzle (the only
// mode simulated) XORs a 16-byte chunk's index with its 128-byte line's index mod 8, from address bits, so dst
// must be 1024-byte aligned.
void tma_load_3d(uint32_t dst, const void* map, int c0, int c1, int c2, uint32_t bar);
// setmaxnreg: no registers to move here; checks that the block is made of whole warpgroups.
void setmaxnreg(unsigned regs);
// ---- thread block clusters: the blocks of a cluster run together, each with its own shared memory ----
// This block's rank in its cluster (x fastest); 0 without clusters.
unsigned cluster_rank();
// barrier.cluster: an arrival (release), then a wait (acquire) for every thread of the cluster's blocks. A thread
// that has exited never arrives: threads waiting for it are reported as a deadlock.
void cluster_arrive();
void cluster_wait();
// mapa + mbarrier.arrive.shared::cluster: one arrival on the mbarrier at shared address bar of the cluster's block
// `rank` (traps where that block has exited: its shared memory is gone).
void mbar_arrive_cluster(uint32_t bar, uint32_t rank);
// tma_load_3d's copy into shared address dst of every block of the cluster whose rank is a bit of `mask`, completing
// on each one's mbarrier at bar.
void tma_load_3d_multicast(uint32_t dst, const void* map, int c0, int c1, int c2, uint32_t bar, uint16_t mask);
// sim_land.cpp: a TMA copy's garbage, and its landing (global reads and shared writes as the calling thread's).
struct TmaBox {
  const unsigned char* base;
  uint64_t dims[3];
  uint64_t strides[3];  // bytes; strides[0] is the element size
  uint32_t box[3];
  int coord[3];
};
void land_tma_box(unsigned char* dst, const TmaBox& box);
void land_poison(unsigned char* dst, size_t bytes);

}  // namespace mpf_sim

// ---- device functions ---------------------------------------------------------------------------------------
inline void __syncthreads() { mpf_sim::sync_block(); }
inline unsigned __clusterRelativeBlockRank() { return mpf_sim::cluster_rank(); }
inline int __syncthreads_or(int v) { return static_cast<int>(mpf_sim::sync_block_or(v != 0 ? 1u : 0u)); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { mpf_sim::sync_warp(mask); }
// Blocks run in turn, so a fence orders nothing the simulator does not already order (ThreadSanitizer does not
// model standalone fences: there it is a compiler barrier).
#if defined(__SANITIZE_THREAD__)
inline void __threadfence() { asm volatile("" ::: "memory"); }
#else
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
#endif
[[noreturn]] inline void __trap() { mpf_sim::trap("__trap() in a kernel"); }
// A clock that advances by one a read (the kernels use it only to bound waits).
inline long long clock64() {
  static thread_local long long ticks = 0;
  return ++ticks;
}
inline size_t __cvta_generic_to_shared(const void* p) { return mpf_sim::shared_address(p); }

template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffles move up to 8 bytes");
  if (mask != 0xffffffffu) mpf_sim::trap("__shfl_down_sync: the simulator supports only the full mask");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = mpf_sim::shfl_exchange(bits, delta, width);
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}

// Byte n of the result is byte (s >> 4 n) & 7 of the eight bytes x (0-3), y (4-7) (the form without sign
// replication: the kernels use selectors below 8).
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
  const uint64_t bytes = uint64_t{x} | (uint64_t{y} << 32);
  unsigned int r = 0;
  for (int n = 0; n < 4; ++n) {
    const unsigned sel = (s >> (4 * n)) & 0xfu;
    if (sel > 7) mpf_sim::trap("__byte_perm: the simulator models selectors 0-7 only");
    r |= static_cast<unsigned int>((bytes >> (8 * sel)) & 0xffu) << (8 * n);
  }
  return r;
}

inline unsigned int atomicAdd(unsigned int* p, unsigned int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }

template <class T>
inline T __ldcg(const T* p) {
  return *p;
}

inline float __uint_as_float(unsigned int u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned int __float_as_uint(float f) {
  unsigned int u;
  std::memcpy(&u, &f, 4);
  return u;
}
// IEEE operations, each rounded to nearest even (the simulator is compiled with -ffp-contract=off).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
  return static_cast<unsigned int>((static_cast<uint64_t>(a) * b) >> 32);
}
// The low 32 bits of (hi:lo) >> (shift & 31) (CUDA's definition: the shift wraps; __funnelshift_rc clamps).
inline unsigned int __funnelshift_r(unsigned int lo, unsigned int hi, unsigned int shift) {
  return static_cast<unsigned int>(((static_cast<uint64_t>(hi) << 32) | lo) >> (shift & 31u));
}

// ---- FP16 and BF16: conversions by the CPU's F16C unit (IEEE round to nearest even) --------------------------
struct __half {
  unsigned short __x;
};
struct __nv_bfloat16 {
  unsigned short __x;
};
inline float __half2float(__half h) { return _cvtsh_ss(h.__x); }
// A NaN becomes the canonical 0x7FFF, as cvt.rn.f16.f32 gives on the GPU (F16C would keep the payload).
inline __half __float2half_rn(float f) {
  if (std::isnan(f)) return __half{0x7fff};
  return __half{static_cast<unsigned short>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT))};
}
// cvt.rn.f16x2.f32: a to the low half, b to the high half (each as __float2half_rn).
struct __half2 {
  __half x, y;
};
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__float2half_rn(a), __float2half_rn(b)}; }
inline __half __low2half(__half2 h) { return h.x; }
inline __half __high2half(__half2 h) { return h.y; }
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float(static_cast<unsigned int>(h.__x) << 16); }
// cvt.rn.bf16.f32 (sm_80+), modelled from its definition rather than the kernels' integer rounding: of the two
// BF16 values around f (truncation toward zero, and the next one away from zero, 2^128 standing for inf), the
// nearer in double precision, the one with an even last bit on a tie; subnormals kept; a NaN becomes the
// canonical 0x7FFF.
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  if (std::isnan(f)) return __nv_bfloat16{0x7fff};
  const unsigned int u = __float_as_uint(f);
  const unsigned short lo = static_cast<unsigned short>(u >> 16);
  if ((u & 0xffffu) == 0) return __nv_bfloat16{lo};  // on the grid (zeros and infinities included)
  const unsigned short hi = static_cast<unsigned short>(lo + 1);
  auto magnitude = [](unsigned short b) {
    return (b & 0x7fffu) == 0x7f80u ? std::ldexp(1.0, 128) : std::fabs(static_cast<double>(__uint_as_float(static_cast<unsigned int>(b) << 16)));
  };
  const double a = std::fabs(static_cast<double>(f)), below = magnitude(lo), above = magnitude(hi);
  const bool up = a - below > above - a || (a - below == above - a && (lo & 1u));
  return __nv_bfloat16{up ? hi : lo};
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }

// ---- nvcuda::wmma for 16 x 16 x 16 tiles of FP16/BF16 with an FP32 accumulator --------------------------------
namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment;

// An operand: every lane holds the whole tile (a lane's share on the GPU is unspecified; the MMA needs all).
// FP16/BF16 operands feed an FP32 accumulator, unsigned 8-bit ones (compute capability 7.2+) an int32 one.
template <class T>
using operand_value = std::conditional_t<std::is_same_v<T, unsigned char>, int, float>;
template <class Use, class T, class Layout>
struct operand_fragment {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, unsigned char>,
                "FP16/BF16 or unsigned 8-bit operands");
  operand_value<T> v[16 * 16];  // (row, col) of the 16 x 16 tile, row-major; exact widenings
};
template <class T, class Layout>
struct fragment<matrix_a, 16, 16, 16, T, Layout> : operand_fragment<matrix_a, T, Layout> {};
template <class T, class Layout>
struct fragment<matrix_b, 16, 16, 16, T, Layout> : operand_fragment<matrix_b, T, Layout> {};
// The accumulator: lane l owns the elements e = l, l + 32, ... of the row-major tile.
template <>
struct fragment<accumulator, 16, 16, 16, float, void> {
  float v[16 * 16];
};
template <>
struct fragment<accumulator, 16, 16, 16, int, void> {
  int v[16 * 16];
};

inline void check_fragment_pointer(const void* p, unsigned ldm, unsigned elem_bytes, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0) mpf_sim::trap(std::string(what) + ": pointer not 32-byte aligned");
  if ((ldm * elem_bytes) % 16 != 0) mpf_sim::trap(std::string(what) + ": ldm not a multiple of 16 bytes");
}

// What touches only the calling thread's fragments (its registers on the device) is not watched by ThreadSanitizer:
// nothing else can access them, and watching them took most of the tensor-core kernels' time there.
#define MPF_SIM_REGISTERS_ONLY __attribute__((no_sanitize("thread")))

inline int widen(unsigned char u) { return u; }
inline float widen(__half h) { return __half2float(h); }
inline float widen(__nv_bfloat16 h) { return __bfloat162float(h); }

template <class Use, class T, class Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm) {
  static_assert(std::is_same_v<Use, matrix_a> || std::is_same_v<Use, matrix_b>, "operands only");
  check_fragment_pointer(p, ldm, sizeof(T), "wmma::load_matrix_sync");
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c)
      f.v[r * 16 + c] = widen(std::is_same_v<Layout, row_major> ? p[r * ldm + c] : p[c * ldm + r]);
}

MPF_SIM_REGISTERS_ONLY inline void fill_fragment(fragment<accumulator, 16, 16, 16, float, void>& f, float value) {
  for (float& x : f.v) x = value;
}
MPF_SIM_REGISTERS_ONLY inline void fill_fragment(fragment<accumulator, 16, 16, 16, int, void>& f, int value) {
  for (int& x : f.v) x = value;
}

template <class T, class LA, class LB>
MPF_SIM_REGISTERS_ONLY void mma_sync(fragment<accumulator, 16, 16, 16, float, void>& d, const fragment<matrix_a, 16, 16, 16, T, LA>& a,
              const fragment<matrix_b, 16, 16, 16, T, LB>& b, const fragment<accumulator, 16, 16, 16, float, void>& c) {
  for (unsigned e = mpf_sim::lane_id(); e < 256; e += 32) {
    const int r = static_cast<int>(e / 16), col = static_cast<int>(e % 16);
    float s = c.v[e];
    for (int k = 0; k < 16; ++k) s += a.v[r * 16 + k] * b.v[k * 16 + col];  // products of 16-bit values: exact
    d.v[e] = s;
  }
}

// Unsigned 8-bit operands, int32 sums: a sum past int32 traps (the hardware would wrap it silently; mpfused's
// kernels move their sums to 64 bits before that can happen, and this checks it).
template <class LA, class LB>
MPF_SIM_REGISTERS_ONLY void mma_sync(fragment<accumulator, 16, 16, 16, int, void>& d, const fragment<matrix_a, 16, 16, 16, unsigned char, LA>& a,
              const fragment<matrix_b, 16, 16, 16, unsigned char, LB>& b, const fragment<accumulator, 16, 16, 16, int, void>& c) {
  for (unsigned e = mpf_sim::lane_id(); e < 256; e += 32) {
    const int r = static_cast<int>(e / 16), col = static_cast<int>(e % 16);
    int64_t s = c.v[e];
    for (int k = 0; k < 16; ++k) s += int64_t{a.v[r * 16 + k]} * b.v[k * 16 + col];
    if (s > INT32_MAX || s < INT32_MIN) mpf_sim::trap("wmma::mma_sync: an int32 accumulator overflowed");
    d.v[e] = static_cast<int>(s);
  }
}

inline void store_matrix_sync(int* p, const fragment<accumulator, 16, 16, 16, int, void>& f, unsigned ldm, layout_t layout) {
  check_fragment_pointer(p, ldm, 4, "wmma::store_matrix_sync");
  for (unsigned e = mpf_sim::lane_id(); e < 256; e += 32) {
    const unsigned r = e / 16, c = e % 16;
    p[layout == mem_row_major ? r * ldm + c : c * ldm + r] = f.v[e];
  }
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float, void>& f, unsigned ldm,
                              layout_t layout) {
  check_fragment_pointer(p, ldm, 4, "wmma::store_matrix_sync");
  for (unsigned e = mpf_sim::lane_id(); e < 256; e += 32) {
    const unsigned r = e / 16, c = e % 16;
    p[layout == mem_row_major ? r * ldm + c : c * ldm + r] = f.v[e];
  }
}

}  // namespace wmma
}  // namespace nvcuda

// ---- the runtime API ------------------------------------------------------------------------------------------
#define CUDART_VERSION 13000

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorLaunchFailure = 719,
};
using cudaError = cudaError_t;
struct CUstream_st;
using cudaStream_t = CUstream_st*;

enum cudaDeviceAttr {
  cudaDevAttrMaxGridDimY = 6,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
};
enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
};
struct cudaFuncAttributes {
  size_t sharedSizeBytes;
  int maxThreadsPerBlock;
  int numRegs;
  int ptxVersion;
  int binaryVersion;
};

// cudaLaunchKernelEx with a cluster dimension attribute (the only one simulated).
enum cudaLaunchAttributeID { cudaLaunchAttributeClusterDimension = 4 };
union cudaLaunchAttributeValue {
  char pad[64];
  struct {
    unsigned int x, y, z;
  } clusterDim;
};
struct cudaLaunchAttribute {
  cudaLaunchAttributeID id;
  char pad[8 - sizeof(cudaLaunchAttributeID)];
  cudaLaunchAttributeValue val;
};
struct cudaLaunchConfig_t {
  dim3 gridDim;
  dim3 blockDim;
  size_t dynamicSmemBytes;
  cudaStream_t stream;
  cudaLaunchAttribute* attrs;
  unsigned int numAttrs;
};
inline dim3 sim_cluster_of(const cudaLaunchConfig_t* c) {
  for (unsigned i = 0; i < c->numAttrs; ++i)
    if (c->attrs[i].id == cudaLaunchAttributeClusterDimension)
      return dim3(c->attrs[i].val.clusterDim.x, c->attrs[i].val.clusterDim.y, c->attrs[i].val.clusterDim.z);
  return dim3(1, 1, 1);
}
template <class... P, class... A>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* c, void (*kernel)(P...), A&&... args) {
  mpf_sim::launch(kernel, c->gridDim, c->blockDim, c->dynamicSmemBytes, c->stream, sim_cluster_of(c))(std::forward<A>(args)...);
  return static_cast<cudaError_t>(mpf_sim::last_launch_status());
}
// The clusters that fit at once: one block per SM (the simulated device's `sms`), whole clusters.
template <class... P>
cudaError_t cudaOccupancyMaxActiveClusters(int* clusters, void (*)(P...), const cudaLaunchConfig_t* c) {
  const dim3 d = sim_cluster_of(c);
  *clusters = mpf_sim::config().sms / static_cast<int>(d.x * d.y * d.z);
  return cudaSuccess;
}

const char* cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaDriverGetVersion(int* version);
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream = nullptr);

// The driver's entry points through the runtime: cuTensorMapEncodeTiled (include/cuda.h) only.
enum cudaDriverEntryPointQueryResult {
  cudaDriverEntryPointSuccess = 0,
  cudaDriverEntryPointSymbolNotFound = 1,
  cudaDriverEntryPointVersionNotSufficent = 2,
};
constexpr unsigned long long cudaEnableDefault = 0;
cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned int version, unsigned long long flags,
                                             cudaDriverEntryPointQueryResult* status);

template <class... P>
cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      static_cast<size_t>(value) > mpf_sim::config().smem_optin_limit)
    return cudaErrorInvalidValue;
  mpf_sim::func_max_dynamic_smem(reinterpret_cast<const void*>(kernel)) = static_cast<size_t>(value);
  return cudaSuccess;
}
template <class... P>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, void (*)(P...)) {
  *attr = cudaFuncAttributes{0, 1024, mpf_sim::config().func_regs, __CUDA_ARCH__ / 10, __CUDA_ARCH__ / 10};
  return cudaSuccess;
}
