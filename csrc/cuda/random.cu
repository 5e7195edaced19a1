// CUDA backend of the random bits and of stochastic rounding. A thread computes one Philox block, the
// bits of eight consecutive element indices, and rounds those eight elements: the same words and the
// same core/stochastic.h functions as the CPU backend, so both give the same bits.
#include <cstdint>

#include "../core/dispatch.h"
#include "../kernels.h"
#include "common.cuh"

namespace mpf {
namespace {

constexpr int kThreads = 256;

// The Philox blocks that cover elements [0, n) of a call whose element 0 has index `offset`.
__host__ __device__ inline uint64_t blocks_of(const RandomArgs& r) {
  const uint64_t lead = r.offset & 7u;
  return (lead + static_cast<uint64_t>(r.numel) + 7) / 8;
}

// Element i of the call for element k of block b (b counted from the block of element 0), or -1.
__device__ __forceinline__ int64_t element_of(const RandomArgs& r, uint64_t b, int k) {
  const int64_t i = static_cast<int64_t>(b * 8 + static_cast<uint64_t>(k)) - static_cast<int64_t>(r.offset & 7u);
  return i >= 0 && i < r.numel ? i : -1;
}

__global__ void __launch_bounds__(kThreads) words_kernel(RandomArgs r, uint32_t* __restrict__ out) {
  const uint64_t nblocks = blocks_of(r);
  for (uint64_t b = blockIdx.x * uint64_t{kThreads} + threadIdx.x; b < nblocks; b += uint64_t{gridDim.x} * kThreads) {
    const Philox4 p = philox_block(r.seed, (r.offset >> 3) + b, r.s0, r.s1);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int64_t i = element_of(r, b, k);
      if (i >= 0) out[i] = philox_bits(p, k);
    }
  }
}

template <DType D>
__global__ void __launch_bounds__(kThreads) round_kernel(RandomArgs r, const float* __restrict__ src,
                                                         uint16_t* __restrict__ dst) {
  const uint64_t nblocks = blocks_of(r);
  // Aligned fast path: element 0 starts a block and both pointers allow 16-byte accesses.
  const bool aligned = (r.offset & 7u) == 0 && (reinterpret_cast<uintptr_t>(src) & 15u) == 0 &&
                       (reinterpret_cast<uintptr_t>(dst) & 15u) == 0;
  for (uint64_t b = blockIdx.x * uint64_t{kThreads} + threadIdx.x; b < nblocks; b += uint64_t{gridDim.x} * kThreads) {
    const int64_t i0 = static_cast<int64_t>(b * 8);
    const bool vec = aligned && i0 + 8 <= r.numel;
    // The loads first, so that the Philox rounds (a chain of ~10 multiplies) run while they are in flight;
    // issued after the rounds, under the branch, they could not start before the rounds were done.
    float4 x0 = make_float4(0.f, 0.f, 0.f, 0.f), x1 = x0;
    if (vec) {
      x0 = *reinterpret_cast<const float4*>(src + i0);
      x1 = *reinterpret_cast<const float4*>(src + i0 + 4);
    }
    const Philox4 p = philox_block(r.seed, (r.offset >> 3) + b, r.s0, r.s1);
    if (vec) {
      const float x[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
      uint32_t packed[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        packed[k] = static_cast<uint32_t>(float_to_bits_sr<D>(x[2 * k], philox_bits(p, 2 * k))) |
                    (static_cast<uint32_t>(float_to_bits_sr<D>(x[2 * k + 1], philox_bits(p, 2 * k + 1))) << 16);
      *reinterpret_cast<uint4*>(dst + i0) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      continue;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int64_t i = element_of(r, b, k);
      if (i >= 0) dst[i] = float_to_bits_sr<D>(src[i], philox_bits(p, k));
    }
  }
}

__global__ void raw_kernel(const uint32_t* __restrict__ ctr, uint32_t* __restrict__ out, int64_t n, uint32_t k0,
                           uint32_t k1) {
  const int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x;
  if (i >= n) return;
  const Philox4 p = philox4x32_10(ctr[4 * i], ctr[4 * i + 1], ctr[4 * i + 2], ctr[4 * i + 3], k0, k1);
  for (int k = 0; k < 4; ++k) out[4 * i + k] = p.v[k];
}

int grid_for(uint64_t nblocks) { return grid_stride_blocks(nblocks, kThreads); }

}  // namespace

void philox_raw_cuda(const uint32_t* ctr, uint32_t* out, int64_t n, uint32_t k0, uint32_t k1, void* stream) {
  if (n == 0) return;
  raw_kernel<<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      ctr, out, n, k0, k1);
  cuda_check(cudaGetLastError(), "philox launch");
}

void philox_words_cuda(const RandomArgs& r, uint32_t* words, void* stream) {
  if (r.numel == 0) return;
  words_kernel<<<grid_for(blocks_of(r)), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(r, words);
  cuda_check(cudaGetLastError(), "philox_words launch");
}

void round_stochastic_cuda(const RandomArgs& r, const float* src, void* dst, DType dst_dtype, void* stream) {
  if (r.numel == 0) return;
  const int grid = grid_for(blocks_of(r));
  auto s = static_cast<cudaStream_t>(stream);
  if (dst_dtype == DType::kFloat16)
    round_kernel<DType::kFloat16><<<grid, kThreads, 0, s>>>(r, src, static_cast<uint16_t*>(dst));
  else
    round_kernel<DType::kBFloat16><<<grid, kThreads, 0, s>>>(r, src, static_cast<uint16_t*>(dst));
  cuda_check(cudaGetLastError(), "round_stochastic launch");
}

}  // namespace mpf
