// Kernels with known defects, for the simulator's own tests (test_cuda_sim.cpp, part "self"): each must be caught.
// Compiled like csrc/cuda's sources (rewrite.py), never part of the extension.
#include <cuda_runtime.h>

#include <cstdint>

#include "../core/numeric.h"  // as csrc/cuda/ includes it (rewrite.py resolves it against csrc/)

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

}  // namespace

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
