// Small CUDA helpers shared by the kernels: error checks, block reductions, 16-byte vectors.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "../core/multi_tensor_plan.h"

namespace mpf {

inline void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("mpfused: ") + what + ": " + cudaGetErrorString(e));
}

// Before the first launch that passes more than 4 KB of kernel arguments: the driver must be new enough
// (core/multi_tensor_plan.h). Queried once per process; throws the same error on every call when too old.
inline void require_large_kernel_params() {
  static const std::string error = [] {
    int version = 0;
    if (cudaDriverGetVersion(&version) != cudaSuccess) version = 0;
    return large_kernel_params_driver_error(version);
  }();
  if (!error.empty()) throw std::runtime_error(error);
}

// Blocks of `threads` threads for a grid-stride loop over `items` work items: enough to cover them, but no
// more than 8 blocks per SM (beyond a few waves, the threads loop).
inline int grid_stride_blocks(uint64_t items, int threads) {
  int device = 0, sms = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  const uint64_t want = (items + threads - 1) / threads;
  const uint64_t cap = static_cast<uint64_t>(sms) * 8;
  return static_cast<int>(want < cap ? want : cap);
}

// Sum over the block; the result is valid in thread 0. Fixed shuffle tree: deterministic.
template <typename T, int kThreads>
__device__ __forceinline__ T block_sum(T v) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "block size must be a multiple of 32, at most 1024");
  __shared__ T warp_sums[kThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? warp_sums[lane] : T(0);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  }
  return v;
}

// The last-block-done handshake of a launch, called by thread 0 of every block after its results are
// written: true in the block that arrives last. The counter must be zero at the launch and used by this
// launch alone (the Python layer keys the counters it lends by device and stream, and a graph capture gets
// scratch counters of its own); the last block zeroes it again. A counter that passes gridDim means it was
// shared with a concurrent launch or not zeroed, which would make some block reduce partials that are not
// all written: the kernel traps instead (the launch fails with an error) rather than return a wrong result.
__device__ __forceinline__ bool arrive_last(unsigned int* counter) {
  __threadfence();  // publish this block's results before counting it as done
  const unsigned int arrived = atomicAdd(counter, 1u);
  if (arrived >= gridDim.x) __trap();
  return arrived == gridDim.x - 1;
}

// A 16-byte vector of N elements of T, for 128-bit global loads and stores.
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

}  // namespace mpf
