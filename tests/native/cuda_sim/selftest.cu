// Kernels with known defects, for the simulator's own tests (test_cuda_sim.cpp, part "self"): each must be caught.
// Compiled like csrc/cuda's sources (rewrite.py), never part of the extension.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../core/numeric.h"  // as csrc/cuda/ includes it (rewrite.py resolves it against csrc/)
#include "wgmma.cuh"          // csrc/cuda's, as rewritten for the simulator (beside this file's rewrite)

namespace mpf_sim_selftest {
namespace {

// Thread t writes slot t and, with no barrier between, reads slot t + 1: a missing __syncthreads.
__global__ void missing_barrier(float* out) {
  __shared__ float slots[64];
  const unsigned t = threadIdx.x;
  slots[t] = static_cast<float>(t);
  out[t] = slots[(t + 1) % 64];
}

// The same with the barrier: every read sees its neighbour's value.
__global__ void with_barrier(float* out) {
  __shared__ float slots[64];
  const unsigned t = threadIdx.x;
  slots[t] = static_cast<float>(t);
  __syncthreads();
  out[t] = slots[(t + 1) % 64];
}

// Half of warp 0 waits at the block barrier, the other half at the warp barrier: neither can complete.
__global__ void split_barriers(int* out) {
  if (threadIdx.x < 16) __syncthreads();
  else __syncwarp();
  out[threadIdx.x] = 1;
}

// Uses 64 KB of dynamic shared memory: needs cudaFuncSetAttribute beyond 48 KB.
__global__ void big_dynamic(int* out) {
  extern __shared__ __align__(16) unsigned char smem[];
  smem[65535 - threadIdx.x] = static_cast<unsigned char>(threadIdx.x);
  __syncthreads();
  if (threadIdx.x == 0) *out = smem[65535] + 7;  // thread 0's byte, 0, plus 7
}

__global__ void traps(int* out) {
  if (threadIdx.x == 3) __trap();
  __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void grid_y(int* out) { out[blockIdx.y] = 1; }

// Reads past a 32-element shared array, through a pointer (UBSan's bound check sees only array indexing).
__global__ void shared_overrun(int* out, int index) {
  __shared__ int a[32];
  int* p = a;
  p[threadIdx.x] = 1;
  __syncthreads();
  if (threadIdx.x == 0) *out = p[index];
}

// The device side of core/numeric.h's narrowings (not a defect: the conversions the kernels store with),
// one element a thread.
__global__ void narrow(const float* in, uint16_t* bf16, uint16_t* f16, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) {
    bf16[i] = mpf::float_to_bf16_bits(in[i]);
    f16[i] = mpf::float_to_f16_bits(in[i]);
  }
}

// One TMA copy of a 64 x 8 box at (8, 1) of `map` into 1024-byte aligned shared memory, completing on an mbarrier;
// with `wait`, every thread waits on its phase before reading; each thread then copies part of the raw (swizzled)
// box to out (512 16-bit values).
__global__ void tma_box(const __grid_constant__ CUtensorMap map, uint16_t* out, int wait) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t pad = (1024 - raw % 1024) % 1024;
  const uint32_t box = raw + pad, bar = box + 1024;
  if (threadIdx.x == 0) {
    mpf::sm90::mbar_init(bar, 1);
    mpf::sm90::fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    mpf::sm90::mbar_arrive_expect_tx(bar, 1024);
    mpf::sm90::tma_load_3d(box, &map, 8, 1, 0, bar);
  }
  if (wait) mpf::sm90::mbar_wait(bar, 0);
  const uint16_t* tile = reinterpret_cast<const uint16_t*>(smem_raw + pad);
  for (unsigned i = threadIdx.x; i < 512; i += blockDim.x) out[i] = tile[i];
}

// Warpgroup 0 multiplies a 64 x 16 A by a 16 x 256 B (zeros, K-major, 128-byte swizzle) with one wgmma; with
// `racy`, thread 128 (warpgroup 1) writes B's first element meanwhile, with no barrier between: the MMA's
// shared-memory reads are its issuing threads', so ThreadSanitizer must report the race.
__global__ void wgmma_race(float* out, int racy) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t pad = (1024 - raw % 1024) % 1024;
  const uint32_t a = raw + pad, b = a + 8 * mpf::sm90::kAtomBytes;  // A: 64 rows, B: 256 rows of 128 bytes
  unsigned char* tiles = smem_raw + pad;
  for (unsigned i = threadIdx.x; i < 40 * mpf::sm90::kAtomBytes; i += blockDim.x) tiles[i] = 0;
  mpf::sm90::fence_proxy_async();
  __syncthreads();
  if (threadIdx.x < 128) {
    float d[128];
    for (float& v : d) v = 1.0f;
    mpf::sm90::wgmma_fence();
    mpf::sm90::wgmma_m64n256k16<false, 0, 0>(d, mpf::sm90::smem_desc128(a, 16, mpf::sm90::kAtomBytes),
                                             mpf::sm90::smem_desc128(b, 16, mpf::sm90::kAtomBytes));
    mpf::sm90::wgmma_commit();
    mpf::sm90::wgmma_wait<0>();
    float sum = 0.0f;
    for (float v : d) sum += v;
    out[threadIdx.x] = sum;
  } else if (racy && threadIdx.x == 128) {
    tiles[8 * mpf::sm90::kAtomBytes] = 0x3c;  // B's first element
  }
}

// Waits on the first phase of an mbarrier that nothing arrives on: a deadlock.
__global__ void mbar_never(int* out) {
  extern __shared__ __align__(16) unsigned char smem[];
  const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if (threadIdx.x == 0) mpf::sm90::mbar_init(bar, 1);
  __syncthreads();
  mpf::sm90::mbar_wait(bar, 0);
  out[threadIdx.x] = 1;
}

}  // namespace

// The tensor map of a rows x cols matrix of 16-bit values with `ld` elements between rows: boxes of box0 x 8 x 1,
// the 128-byte swizzle. Returns cuTensorMapEncodeTiled's CUresult.
int encode_map(CUtensorMap* map, const uint16_t* data, int rows, int cols, int ld, int box0) {
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows), 1};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(ld) * 2, static_cast<cuuint64_t>(ld) * 2 * rows};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(box0), 8, 1}, unit[3] = {1, 1, 1};
  return static_cast<int>(cuTensorMapEncodeTiled(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, const_cast<uint16_t*>(data), dims,
                                                 strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                                 CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
}

int run_tma_encode(const uint16_t* data, int rows, int cols, int ld, int box0) {
  CUtensorMap map;
  return encode_map(&map, data, rows, cols, ld, box0);
}
int run_tma_box(const uint16_t* data, int rows, int cols, int ld, uint16_t* out, bool wait) {
  CUtensorMap map;
  if (encode_map(&map, data, rows, cols, ld, 64) != 0) return -1;
  cudaFuncSetAttribute(tma_box, cudaFuncAttributeMaxDynamicSharedMemorySize, 4096);
  tma_box<<<1, 128, 4096>>>(map, out, wait ? 1 : 0);
  return static_cast<int>(cudaGetLastError());
}
int run_wgmma_race(float* out, bool racy) {
  const int bytes = 41 * 1024;
  cudaFuncSetAttribute(wgmma_race, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  wgmma_race<<<1, 256, bytes>>>(out, racy ? 1 : 0);
  return static_cast<int>(cudaGetLastError());
}
int run_mbar_never(int* out) {
  mbar_never<<<1, 32, 64>>>(out);
  return static_cast<int>(cudaGetLastError());
}

int run_narrow(const float* in, uint16_t* bf16, uint16_t* f16, int n) {
  narrow<<<(n + 255) / 256, 256>>>(in, bf16, f16, n);
  return static_cast<int>(cudaGetLastError());
}

// Each returns the launch's cudaError_t (as int).
int run_missing_barrier(float* out, bool barrier) {
  if (barrier) with_barrier<<<1, 64>>>(out);
  else missing_barrier<<<1, 64>>>(out);
  return static_cast<int>(cudaGetLastError());
}
int run_split_barriers(int* out) {
  split_barriers<<<1, 64>>>(out);
  return static_cast<int>(cudaGetLastError());
}
int run_big_dynamic(int* out, bool set_attribute) {
  if (set_attribute) cudaFuncSetAttribute(big_dynamic, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536);
  big_dynamic<<<1, 32, 65536>>>(out);
  return static_cast<int>(cudaGetLastError());
}
int run_traps(int* out) {
  traps<<<2, 32>>>(out);
  return static_cast<int>(cudaGetLastError());
}
int run_grid_y(int* out, unsigned blocks_y) {
  grid_y<<<dim3(1, blocks_y), 1>>>(out);
  return static_cast<int>(cudaGetLastError());
}

int run_shared_overrun(int* out, int index) {
  shared_overrun<<<1, 32>>>(out, index);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace mpf_sim_selftest
