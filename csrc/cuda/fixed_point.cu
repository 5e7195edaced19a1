// CUDA backend of fixed point <IL, FL> (core/fixed_point.h). Convert: where element 0 starts a Philox block
// and the buffers are 16-byte aligned, a warp converts 256 consecutive elements at a time, four a lane an
// access, with the Philox blocks (the random bits of eight consecutive element indices) computed one a lane
// and shared through shared memory; elsewhere, and for the last elements, a thread computes one block and
// converts its eight elements (as round_stochastic does). The MACC: 64 x 64 output tiles, 256 threads of 4 x 4 outputs each, the k dimension staged through
// shared memory 16 at a time, exact int64 sums, and the final rounding with each output element's word:
// the same core functions and words as the CPU backend, so both give the same codes.
#include <cstdint>

#include "../kernels.h"
#include "common.cuh"

namespace mpf {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kGroup = 256;  // elements of a warp's group in Convert's aligned path: 32 Philox blocks

// Four consecutive elements, one access (two 16-byte ones for 8-byte elements).
template <typename T>
struct alignas(4 * sizeof(T) < 16 ? 4 * sizeof(T) : 16) Quad {
  T v[4];
};

// The Philox blocks that cover elements [0, numel) of a call whose element 0 has index `offset`.
__host__ __device__ inline uint64_t blocks_for(uint64_t offset, int64_t numel) {
  return ((offset & 7u) + static_cast<uint64_t>(numel) + 7) / 8;
}

// kF: FP32 arithmetic (fixed_code_f; FP32 inputs, WL <= 24), the same codes as the FP64 path.
template <FixedType S, FixedType D, bool kF>
__global__ void __launch_bounds__(kThreads) quantize_kernel(FixedQuantizeArgs a, FixedQuant q, FixedQuantF qf) {
  const auto* __restrict__ src = static_cast<const typename FixedElem<S>::type*>(a.src);
  auto* __restrict__ dst = static_cast<typename FixedElem<D>::type*>(a.dst);
  const uint64_t nblocks = blocks_for(a.offset, a.numel);
  const int64_t lead = static_cast<int64_t>(a.offset & 7u);
  const bool stochastic = a.rounding == Rounding::kStochastic;
  const Rounding mode = stochastic ? Rounding::kStochastic : Rounding::kNearest;
  // One element, with its random word r.
  const auto convert = [&](typename FixedElem<S>::type x, uint32_t r) {
    if constexpr (kF) return fixed_store<D>(fixed_code_f(fixed_load_f<S>(x), qf, mode, r), qf);
    else return fixed_store<D>(fixed_code(FixedElem<S>::load(x), q, mode, r), q);
  };
  // Aligned fast path: element 0 starts a Philox block and both pointers allow 16-byte accesses. Warps take
  // groups of 256 consecutive elements (32 Philox blocks); lane l converts elements 4l .. 4l + 3 and
  // 128 + 4l .. 128 + 4l + 3 of its group, so that each load and store of the warp covers one contiguous
  // span (for elements of up to 4 bytes; a lane's four FP64 values are two 16-byte accesses 32 bytes apart,
  // the pattern this path replaced for FP32, kept for that rare type), and computes the group's Philox block l, which the lanes share through shared memory (two buffers
  // a warp: a lane writes the next group's while a slower one may still read this one's). Before, a thread
  // converted the eight elements of its own Philox block, in 16-byte accesses 32 bytes apart across the warp
  // for FP32 (each covering half of every 32-byte sector it touched): an H200 measured Convert into FP32 at
  // 73% (nearest) / 79% (stochastic) of the copy of the same bytes, where encode into int16, one 16-byte
  // store a thread, reached 95% / 83%. (With element accesses only, 8 elements apart across a warp, Convert
  // had run at ~20%.)
  __shared__ __align__(16) uint32_t shared_words[kWarps * 2 * 128];
  const bool aligned = lead == 0 && (reinterpret_cast<uintptr_t>(src) & 15u) == 0 &&
                       (reinterpret_cast<uintptr_t>(dst) & 15u) == 0;
  uint64_t first_block = 0;  // the Philox blocks before it are the groups'
  if (aligned) {
    const uint64_t groups = static_cast<uint64_t>(a.numel) / kGroup;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    uint32_t* const words = shared_words + (threadIdx.x / 32) * 2 * 128;
    int buffer = 0;
    for (uint64_t g = blockIdx.x * uint64_t{kWarps} + threadIdx.x / 32; g < groups; g += uint64_t{gridDim.x} * kWarps) {
      const int64_t i0 = static_cast<int64_t>(g * kGroup) + 4 * lane;
      const Quad<typename FixedElem<S>::type> in0 = *reinterpret_cast<const Quad<typename FixedElem<S>::type>*>(src + i0);
      const Quad<typename FixedElem<S>::type> in1 =
          *reinterpret_cast<const Quad<typename FixedElem<S>::type>*>(src + i0 + kGroup / 2);
      uint32_t r[8] = {};
      if (stochastic) {  // the same for the warp's lanes
        const Philox4 p = philox_block(a.seed, (a.offset >> 3) + g * 32 + static_cast<uint64_t>(lane), kStreamRound, 0);
        uint32_t* const buf = words + buffer * 128;
        *reinterpret_cast<uint4*>(buf + 4 * lane) = make_uint4(p.v[0], p.v[1], p.v[2], p.v[3]);
        __syncwarp();
        // Element e of the group is half-word e of the 32 blocks' words: 4l .. 4l + 3 are words 2l and 2l + 1.
        const uint2 w0 = *reinterpret_cast<const uint2*>(buf + 2 * lane);
        const uint2 w1 = *reinterpret_cast<const uint2*>(buf + 64 + 2 * lane);
        const uint32_t w[4] = {w0.x, w0.y, w1.x, w1.y};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          r[2 * k] = w[k] << 16;
          r[2 * k + 1] = w[k] & 0xFFFF0000u;
        }
        buffer ^= 1;
      }
      Quad<typename FixedElem<D>::type> out0, out1;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        out0.v[k] = convert(in0.v[k], r[k]);
        out1.v[k] = convert(in1.v[k], r[4 + k]);
      }
      *reinterpret_cast<Quad<typename FixedElem<D>::type>*>(dst + i0) = out0;
      *reinterpret_cast<Quad<typename FixedElem<D>::type>*>(dst + i0 + kGroup / 2) = out1;
    }
    first_block = groups * (kGroup / 8);
  }
  // The rest (the last group's elements, or every element of an unaligned call): a thread converts the
  // eight elements of one Philox block, in 16-byte vectors where the block is whole and aligned.
  using SV = Vec16<typename FixedElem<S>::type>;
  using DV = Vec16<typename FixedElem<D>::type>;
  static_assert(8 % SV::N == 0 && 8 % DV::N == 0, "eight elements are whole 16-byte vectors");
  for (uint64_t b = first_block + blockIdx.x * uint64_t{kThreads} + threadIdx.x; b < nblocks;
       b += uint64_t{gridDim.x} * kThreads) {
    const int64_t i0 = static_cast<int64_t>(b * 8);
    const bool vec = aligned && i0 + 8 <= a.numel;
    // The loads before the Philox rounds, so that the rounds run while they are in flight (random.cu).
    SV in[8 / SV::N] = {};
    if (vec) {
#pragma unroll
      for (int j = 0; j < 8 / SV::N; ++j) in[j] = reinterpret_cast<const SV*>(src + i0)[j];
    }
    Philox4 p{{0u, 0u, 0u, 0u}};
    if (stochastic) p = philox_block(a.seed, (a.offset >> 3) + b, kStreamRound, 0);
    if (vec) {
      DV out[8 / DV::N];
#pragma unroll
      for (int k = 0; k < 8; ++k)
        out[k / DV::N].v[k % DV::N] = convert(in[k / SV::N].v[k % SV::N], stochastic ? philox_bits(p, k) : 0u);
#pragma unroll
      for (int j = 0; j < 8 / DV::N; ++j) reinterpret_cast<DV*>(dst + i0)[j] = out[j];
      continue;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int64_t i = static_cast<int64_t>(b * 8 + static_cast<uint64_t>(k)) - lead;
      if (i < 0 || i >= a.numel) continue;
      dst[i] = convert(src[i], stochastic ? philox_bits(p, k) : 0u);
    }
  }
}

constexpr int kTile = 64;              // output rows and columns per block
constexpr int kTileK = 16;             // k per shared-memory stage
constexpr int kSide = 16;              // threads per side: 16 x 16 = kThreads
constexpr int kPer = kTile / kSide;    // outputs per thread per side (4 x 4)
static_assert(kSide * kSide == kThreads, "one thread per 4 x 4 outputs");

// Output (i, j) of the tile at (m0, n0) for thread (ty, tx): rows m0 + ty + 16 r, columns n0 + tx + 16 c,
// so that a warp reads 16 consecutive columns of the B stage (no bank conflicts) and 2 rows of A (broadcast).
template <FixedType A, FixedType B, FixedType O>
__global__ void __launch_bounds__(kThreads) matmul_kernel(FixedMatmulArgs g) {
  __shared__ int32_t as[kTileK][kTile];  // as[p][r]: a[m0 + r, k0 + p]
  __shared__ int32_t bs[kTileK][kTile];  // bs[p][c]: b[k0 + p, n0 + c]
  const auto* __restrict__ a = static_cast<const typename FixedElem<A>::type*>(g.a);
  const auto* __restrict__ b = static_cast<const typename FixedElem<B>::type*>(g.b);
  auto* __restrict__ out = static_cast<typename FixedElem<O>::type*>(g.out);
  const int tx = threadIdx.x % kSide, ty = threadIdx.x / kSide;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTile, n0 = static_cast<int64_t>(blockIdx.x) * kTile;
  int64_t acc[kPer][kPer];
#pragma unroll
  for (int r = 0; r < kPer; ++r)
#pragma unroll
    for (int c = 0; c < kPer; ++c) acc[r][c] = 0;

  for (int64_t k0 = 0; k0 < g.k; k0 += kTileK) {
    // Stage a[m0 .. m0 + 63, k0 .. k0 + 15] and b[k0 .. k0 + 15, n0 .. n0 + 63]: 1024 values each, 4 per thread,
    // zero outside the matrices (a zero adds nothing to the sums).
#pragma unroll
    for (int e = threadIdx.x; e < kTile * kTileK; e += kThreads) {
      const int ar = e / kTileK, ap = e % kTileK;  // consecutive threads read along a's rows
      const int64_t ai = m0 + ar, ak = k0 + ap;
      as[ap][ar] = ai < g.m && ak < g.k ? static_cast<int32_t>(a[ai * g.k + ak]) : 0;
      const int bp = e / kTile, bc = e % kTile;  // and along b's rows
      const int64_t bk = k0 + bp, bj = n0 + bc;
      bs[bp][bc] = bk < g.k && bj < g.n ? static_cast<int32_t>(b[bk * g.n + bj]) : 0;
    }
    __syncthreads();
#pragma unroll
    for (int p = 0; p < kTileK; ++p) {
      int32_t av[kPer], bv[kPer];
#pragma unroll
      for (int r = 0; r < kPer; ++r) av[r] = as[p][ty + kSide * r];
#pragma unroll
      for (int c = 0; c < kPer; ++c) bv[c] = bs[p][tx + kSide * c];
#pragma unroll
      for (int r = 0; r < kPer; ++r)
#pragma unroll
        for (int c = 0; c < kPer; ++c) acc[r][c] += static_cast<int64_t>(av[r]) * bv[c];  // mul.wide.s32
    }
    __syncthreads();
  }

  const bool stochastic = g.rounding == Rounding::kStochastic;
#pragma unroll
  for (int r = 0; r < kPer; ++r) {
    const int64_t i = m0 + ty + kSide * r;
#pragma unroll
    for (int c = 0; c < kPer; ++c) {
      const int64_t j = n0 + tx + kSide * c;
      if (i >= g.m || j >= g.n) continue;
      const int64_t e = i * g.n + j;
      const int32_t code =
          stochastic ? fixed_round_shift(acc[r][c], g.shift, Rounding::kStochastic,
                                         philox_word(g.seed, g.offset + static_cast<uint64_t>(e), kStreamRound, 0))
                     : fixed_round_shift(acc[r][c], g.shift, Rounding::kNearest, 0u);
      out[e] = static_cast<typename FixedElem<O>::type>(code);
    }
  }
}

}  // namespace

void fixed_quantize_cuda(const FixedQuantizeArgs& a, void* stream) {
  if (a.numel == 0) return;
  const int grid = grid_stride_blocks(blocks_for(a.offset, a.numel), kThreads);
  const FixedQuant q = fixed_quant(a.fmt);
  const FixedQuantF qf = fixed_quant_f(a.fmt);
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_value_type(a.src_type, [&](auto st) {
    dispatch_out_type(a.dst_type, [&](auto dt) {
      constexpr FixedType S = decltype(st)::value, D = decltype(dt)::value;
      if constexpr (S != FixedType::kFloat64) {
        if (fixed_float_math(a.fmt)) {
          quantize_kernel<S, D, true><<<grid, kThreads, 0, s>>>(a, q, qf);
          return;
        }
      }
      quantize_kernel<S, D, false><<<grid, kThreads, 0, s>>>(a, q, qf);
    });
  });
  cuda_check(cudaGetLastError(), "fixed_point quantize launch");
}

void fixed_matmul_cuda(const FixedMatmulArgs& g, void* stream) {
  if (g.m == 0 || g.n == 0) return;
  // The torch layer limits m and n so that the grid fits (rows of tiles <= 65535).
  const dim3 grid(static_cast<unsigned>((g.n + kTile - 1) / kTile), static_cast<unsigned>((g.m + kTile - 1) / kTile));
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_code_type(g.a_type, [&](auto at) {
    dispatch_code_type(g.b_type, [&](auto bt) {
      dispatch_code_type(g.out_type, [&](auto ot) {
        matmul_kernel<decltype(at)::value, decltype(bt)::value, decltype(ot)::value><<<grid, kThreads, 0, s>>>(g);
      });
    });
  });
  cuda_check(cudaGetLastError(), "fixed_point matmul launch");
}

}  // namespace mpf
