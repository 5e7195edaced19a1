// CUDA backend of fixed point <IL, FL> (core/fixed_point.h). Convert: where element 0 starts a Philox block
// and the buffers are 16-byte aligned, a warp converts 256 consecutive elements at a time, four a lane an
// access, with the Philox blocks (the random bits of eight consecutive element indices) computed one a lane
// and shared through shared memory; elsewhere, and for the last elements, a thread computes one block and
// converts its eight elements (as round_stochastic does). The MACC of int16 codes: on the integer tensor cores,
// which multiply the codes' 8-bit digits (matmul_tc_kernel below); of int32 codes (or with
// MPFUSED_FIXED_MATMUL_KERNEL=cuda-cores): 64 x 64 output tiles, 256 threads of 4 x 4 outputs each, the k dimension
// staged through shared memory 16 at a time, exact int64 sums. Both round once at the end with each output
// element's word: the same core functions and words as the CPU backend, so all give the same codes.
#include <mma.h>

#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

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

// ---- The MACC of int16 codes on the integer tensor cores --------------------------------------------------------
// Each code is biased and split into two 8-bit digits (core/fixed_point.h: fixed_biased .. fixed_unbias_sum), the
// WMMA units (u8 x u8 -> int32, compute capability 7.2 and newer) sum the digit products of a 64 x 64 output tile
// into three int32 accumulators an output (hi*hi, hi*lo + lo*hi, lo*lo), and every kFixedDigitSpan steps of k (before
// they could pass 2^31) a warp moves them through shared memory into the tile's 64-bit sums; the sums of each
// row of a and column of b (of the biased codes) complete the exact int64 sum, which is rounded as the CUDA-core
// kernel above rounds it. Four MMAs a digit step where one 16-bit product is wanted, on units that run 8-bit ones
// at many times the rate of the 64-bit integer adds of the CUDA-core loop.
//
// A block: 4 warps, each 32 x 32 outputs (2 x 2 fragments of 16 x 16); k staged 32 at a time. Shared memory holds
// the digits in the layouts the fragments load with a leading dimension of 16 bytes and 32-byte aligned pointers:
// a's as [digit][16-k slab][64 rows][16 k] (row-major A fragments), b's as [digit][16-column block][16-k slab][16
// columns][16 k] (column-major B fragments, which the MMA reads as they lie: a row-major one took a byte load an
// element, 64 a warp and stage). Steps k >= K and rows or columns past the matrices hold the digits 0 (the
// biased code of -2^15; with both operands' steps past K zero, they add nothing).
constexpr int kTcThreads = 128;
constexpr int kTcTile = 64;
constexpr int kTcStageK = 32;
constexpr int kTcFlushStages = static_cast<int>(kFixedDigitSpan / kTcStageK);  // stages between moves to 64 bits
// Bytes of a 16-k slab of a's digits: 64 bytes of padding put the two slabs' rows 16 banks apart, so that a warp's
// 8-byte stores (two slabs, eight rows) take the two wavefronts of 256 bytes (32 bytes of padding took four).
constexpr int kTcASlab = kTcTile * 16 + 64;
constexpr int kTcBBlock = 16 * 16 + 32;        // bytes of 16 columns by 16 k of b's digits
static_assert(kTcTile == kTile, "the launcher's grid is the CUDA-core kernel's, of kTile x kTile tiles");
static_assert(kTcASlab % 32 == 0 && kTcBBlock % 32 == 0, "fragment pointers are 32-byte aligned");
static_assert(kFixedDigitSpan % kTcStageK == 0, "whole stages between moves");

// The high (H = 1) or low (H = 0) digits of the four 32-bit words of eight biased codes (in
// order, already biased), as eight bytes.
template <int H>
__device__ inline uint2 digits8(const uint32_t (&v)[4]) {
  constexpr unsigned sel = H ? 0x7531u : 0x6420u;  // bytes 1, 3 (high) or 0, 2 (low) of each pair of codes
  return make_uint2(__byte_perm(v[0], v[1], sel), __byte_perm(v[2], v[3], sel));
}
// N consecutive codes p[0 .. N - 1] (N = 8 or 4) as N / 2 words; count < N reads only the first `count` (the rest
// are -2^15, whose biased code and digits are 0).
template <int N>
__device__ inline void load_codes(uint32_t (&w)[N / 2], const int16_t* p, int count, bool vector) {
  if (vector) {
    if constexpr (N == 8) {
      const uint4 v = *reinterpret_cast<const uint4*>(p);
      w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else {
      const uint2 v = *reinterpret_cast<const uint2*>(p);
      w[0] = v.x, w[1] = v.y;
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const uint32_t lo = 2 * i < count ? static_cast<uint16_t>(p[2 * i]) : 0x8000u;
    const uint32_t hi = 2 * i + 1 < count ? static_cast<uint16_t>(p[2 * i + 1]) : 0x8000u;
    w[i] = lo | (hi << 16);
  }
}

template <FixedType O>
__global__ void __launch_bounds__(kTcThreads) matmul_tc_kernel(FixedMatmulArgs g) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 720
  namespace wmma = nvcuda::wmma;
  using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, unsigned char, wmma::row_major>;
  using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, unsigned char, wmma::col_major>;
  using FragAcc = wmma::fragment<wmma::accumulator, 16, 16, 16, int>;
  __shared__ __align__(128) unsigned char a_digits[2 * 2 * kTcASlab];  // [digit: 0 low, 1 high][slab][...]
  __shared__ __align__(128) unsigned char b_digits[2 * 8 * kTcBBlock];  // [digit][column block][slab][...]
  __shared__ __align__(128) int32_t scratch[4 * 256];                  // a warp's 16 x 16 accumulator on its way
  __shared__ __align__(16) unsigned long long total[kTcTile * kTcTile];  // the tile's S, modulo 2^64
  __shared__ __align__(16) unsigned long long row_sums[kTcTile];         // sum over k of a's biased codes
  __shared__ __align__(16) unsigned long long col_parts[2][kTcTile];     // the same of b's, per 16-k slab
  const auto* __restrict__ a = static_cast<const int16_t*>(g.a);
  const auto* __restrict__ b = static_cast<const int16_t*>(g.b);
  auto* __restrict__ out = static_cast<typename FixedElem<O>::type*>(g.out);
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTcTile, n0 = static_cast<int64_t>(blockIdx.x) * kTcTile;
  const int wr = warp / 2, wc = warp % 2;  // the warp's 32 x 32 outputs: rows 32 wr.., columns 32 wc..
  // Whole vector loads where every row of the operand starts aligned for them.
  const bool a_vec = g.k % 8 == 0 && (reinterpret_cast<uintptr_t>(a) & 15u) == 0;
  const bool b_vec = g.n % 4 == 0 && (reinterpret_cast<uintptr_t>(b) & 7u) == 0;  // (8-byte loads)

  FragAcc acc[3][2][2];  // [0: hi*hi, 1: hi*lo + lo*hi, 2: lo*lo][fragment row][fragment column]
#pragma unroll
  for (int d = 0; d < 3; ++d)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[d][i][j], 0);
  // A thread stages a's rows tid / 4 and tid / 4 + 32 (eight k at 8 (tid % 4)), and four k rows by four columns of
  // b: warp w takes slab b_slab = w % 2 and columns 32 (w / 2) .. + 31, lane l k rows 16 b_slab + 4 (l % 4) .. + 3
  // and columns 32 (w / 2) + 4 (l / 4) .. + 3, which it turns into a word of four k digits a column. It sums the
  // biased codes it stages: 32-bit sums between moves (at most 8 * 65535 a row or column and stage, 2^28 between
  // moves), 64-bit ones across them.
  const int a_row = tid / 4, a_kq = tid % 4;
  const int b_slab = warp % 2, b_kq = lane % 4, b_q = lane / 4, b_col = 32 * (warp / 2) + 4 * b_q;
  uint32_t a_sum[2] = {0, 0}, b_sum[4] = {0, 0, 0, 0};
  unsigned long long a_total[2] = {0, 0}, b_total[4] = {0, 0, 0, 0};
  // Moves the warp's three accumulators into the tile's 64-bit sums, through the warp's 1 KB of scratch (the
  // fragments' element order is the GPU's own: a lane reads back 8 consecutive elements of the stored tile).
  // The first move writes the tile's sums (no zeroing before), the later ones add. A lane takes column lane % 16 of
  // rows lane / 16, lane / 16 + 2, ...: each read of the scratch is one contiguous 128 bytes, each access of the sums
  // two rows of 128 bytes.
  const auto flush = [&](bool first) {
    int32_t* const sc = scratch + warp * 256;
    const int cl = lane % 16, r0 = lane / 16;
#pragma unroll
    for (int d = 0; d < 3; ++d)
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          wmma::store_matrix_sync(sc, acc[d][i][j], 16, wmma::mem_row_major);
          __syncwarp();
          unsigned long long* const t = total + (32 * wr + 16 * i) * kTcTile + 32 * wc + 16 * j + cl;
#pragma unroll
          for (int r = r0; r < 16; r += 2) {
            const unsigned long long v = static_cast<uint32_t>(sc[r * 16 + cl]);
            const unsigned long long w = d == 0 ? v << 16 : d == 1 ? v << 8 : v;  // core/fixed_point.h: fixed_digit_sum
            t[r * kTcTile] = first && d == 0 ? w : t[r * kTcTile] + w;
          }
          __syncwarp();
          wmma::fill_fragment(acc[d][i][j], 0);
        }
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      a_total[q] += a_sum[q];
      a_sum[q] = 0;
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      b_total[c] += b_sum[c];
      b_sum[c] = 0;
    }
  };

  // The codes of the stage at k0 into registers (raw: biased and summed when they are stored), issued before the
  // previous stage's MMAs so that those hide the loads' latency.
  uint32_t aw[2][4], bw[4][2];
  const auto load_stage = [&](int64_t k0) {
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int64_t row = m0 + a_row + 32 * q, k = k0 + 8 * a_kq;
      const int64_t count = row < g.m ? (g.k - k < 8 ? g.k - k : 8) : 0;
      load_codes<8>(aw[q], a + row * g.k + k, count > 0 ? static_cast<int>(count) : 0, a_vec && count == 8);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int64_t kb = k0 + 16 * b_slab + 4 * b_kq + r, col = n0 + b_col;
      const int64_t count = kb < g.k ? (g.n - col < 4 ? g.n - col : 4) : 0;
      load_codes<4>(bw[r], b + kb * g.n + col, count > 0 ? static_cast<int>(count) : 0, b_vec && count == 4);
    }
  };
  if (g.k > 0) load_stage(0);
  int stages = 0;
  bool first_flush = true;
  for (int64_t k0 = 0; k0 < g.k; k0 += kTcStageK) {
#pragma unroll
    for (int q = 0; q < 2; ++q)
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        aw[q][w] ^= 0x80008000u;  // biased
        a_sum[q] += (aw[q][w] & 0xffffu) + (aw[q][w] >> 16);
      }
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        bw[r][w] ^= 0x80008000u;
        b_sum[2 * w] += bw[r][w] & 0xffffu;
        b_sum[2 * w + 1] += bw[r][w] >> 16;
      }
    __syncthreads();  // the last stage's fragments are loaded
#pragma unroll
    for (int q = 0; q < 2; ++q) {  // a: slab a_kq / 2, row a_row + 32 q, bytes 8 (a_kq % 2) ..
      const int ao = (a_kq / 2) * kTcASlab + (a_row + 32 * q) * 16 + (a_kq % 2) * 8;
      *reinterpret_cast<uint2*>(a_digits + ao) = digits8<0>(aw[q]);
      *reinterpret_cast<uint2*>(a_digits + 2 * kTcASlab + ao) = digits8<1>(aw[q]);
    }
    {
      // b: column c of the lane's four is the word of its four k digits, at column b_col + c of the tile: block
      // (b_col + c) / 16 of slab b_slab, bytes 16 ((b_col + c) % 16) + 4 b_kq. Lane groups start at different
      // columns of their four (rotation (b_q / 2) % 4), so that each store of the warp hits 32 banks.
      uint32_t lo[4], hi[4];
#pragma unroll
      for (int w = 0; w < 2; ++w) {  // columns 2 w and 2 w + 1
        // [row 0 col 2w, row 1 col 2w, row 0 col 2w+1, row 1 col 2w+1] of a digit, then rows 2 and 3 the same
        const uint32_t h01 = __byte_perm(bw[0][w], bw[1][w], 0x7351u), h23 = __byte_perm(bw[2][w], bw[3][w], 0x7351u);
        const uint32_t l01 = __byte_perm(bw[0][w], bw[1][w], 0x6240u), l23 = __byte_perm(bw[2][w], bw[3][w], 0x6240u);
        lo[2 * w] = __byte_perm(l01, l23, 0x5410u);
        lo[2 * w + 1] = __byte_perm(l01, l23, 0x7632u);
        hi[2 * w] = __byte_perm(h01, h23, 0x5410u);
        hi[2 * w + 1] = __byte_perm(h01, h23, 0x7632u);
      }
      const int rot = (b_q / 2) % 4;
#pragma unroll
      for (int step = 0; step < 4; ++step) {
        const int c = (step + rot) % 4;  // selected, not indexed: the words stay in registers
        const uint32_t l = c == 0 ? lo[0] : c == 1 ? lo[1] : c == 2 ? lo[2] : lo[3];
        const uint32_t h = c == 0 ? hi[0] : c == 1 ? hi[1] : c == 2 ? hi[2] : hi[3];
        const int col = b_col + c;
        unsigned char* const bb = b_digits + ((col / 16) * 2 + b_slab) * kTcBBlock + (col % 16) * 16 + 4 * b_kq;
        *reinterpret_cast<uint32_t*>(bb) = l;
        *reinterpret_cast<uint32_t*>(bb + 8 * kTcBBlock) = h;
      }
    }
    __syncthreads();
    if (k0 + kTcStageK < g.k) load_stage(k0 + kTcStageK);
#pragma unroll
    for (int slab = 0; slab < 2; ++slab) {
      FragA fa[2][2];  // [digit][fragment row]
      FragB fb[2][2];  // [digit][fragment column]
#pragma unroll
      for (int d = 0; d < 2; ++d)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          wmma::load_matrix_sync(fa[d][i], a_digits + d * 2 * kTcASlab + slab * kTcASlab + (32 * wr + 16 * i) * 16, 16);
          wmma::load_matrix_sync(fb[d][i], b_digits + d * 8 * kTcBBlock + ((2 * wc + i) * 2 + slab) * kTcBBlock, 16);
        }
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          wmma::mma_sync(acc[0][i][j], fa[1][i], fb[1][j], acc[0][i][j]);
          wmma::mma_sync(acc[1][i][j], fa[1][i], fb[0][j], acc[1][i][j]);
          wmma::mma_sync(acc[1][i][j], fa[0][i], fb[1][j], acc[1][i][j]);
          wmma::mma_sync(acc[2][i][j], fa[0][i], fb[0][j], acc[2][i][j]);
        }
    }
    if (++stages == kTcFlushStages) {
      flush(first_flush);
      first_flush = false;
      stages = 0;
    }
  }
  flush(first_flush);
  // The sums of a's rows: the four lanes tid = 4 r .. 4 r + 3 share a row; those of b's columns: the four lanes
  // 4 b_q .. 4 b_q + 3 share four columns, then the two slabs' warps' in the epilogue.
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    unsigned long long s = a_total[q];
    s += __shfl_down_sync(0xffffffffu, s, 2, 4);
    s += __shfl_down_sync(0xffffffffu, s, 1, 4);
    if (a_kq == 0) row_sums[a_row + 32 * q] = s;
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    unsigned long long s = b_total[c];
    s += __shfl_down_sync(0xffffffffu, s, 2, 4);
    s += __shfl_down_sync(0xffffffffu, s, 1, 4);
    if (b_kq == 0) col_parts[b_slab][b_col + c] = s;
  }
  __syncthreads();

  const bool stochastic = g.rounding == Rounding::kStochastic;
  for (int e = tid; e < kTcTile * kTcTile; e += kTcThreads) {
    const int r = e / kTcTile, c = e % kTcTile;
    const int64_t i = m0 + r, j = n0 + c;
    if (i >= g.m || j >= g.n) continue;
    const unsigned long long col = col_parts[0][c] + col_parts[1][c];
    const int64_t sum = fixed_unbias_sum(total[e], row_sums[r], col, static_cast<uint64_t>(g.k));
    const int64_t o = i * g.n + j;
    const int32_t code =
        stochastic ? fixed_round_shift(sum, g.shift, Rounding::kStochastic,
                                       philox_word(g.seed, g.offset + static_cast<uint64_t>(o), kStreamRound, 0))
                   : fixed_round_shift(sum, g.shift, Rounding::kNearest, 0u);
    out[o] = static_cast<typename FixedElem<O>::type>(code);
  }
#else
  __trap();  // unreachable: the launcher takes this kernel on compute capability 7.2 and newer only
#endif
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

FixedMatmulKernel fixed_matmul_kernel(int device) {
  // The setting first: a value that is neither kernel is an error on every GPU.
  const char* v = std::getenv("MPFUSED_FIXED_MATMUL_KERNEL");
  const std::string s = v ? v : "";
  if (!s.empty() && s != "tensor-cores" && s != "cuda-cores")
    throw std::invalid_argument("MPFUSED_FIXED_MATMUL_KERNEL must be 'tensor-cores' or 'cuda-cores' (unset: the tensor "
                                "cores where the GPU has integer ones), got '" + s + "'");
  if (s == "cuda-cores") return FixedMatmulKernel::kCudaCores;
  int major = 0, minor = 0;
  cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "fixed_point matmul: device query");
  cuda_check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "fixed_point matmul: device query");
  if (major * 10 + minor < 72) {
    if (s == "tensor-cores")
      throw std::invalid_argument("MPFUSED_FIXED_MATMUL_KERNEL=tensor-cores needs integer tensor cores (compute capability "
                                  "7.2 or newer); this GPU is sm_" + std::to_string(major) + std::to_string(minor));
    return FixedMatmulKernel::kCudaCores;
  }
  // The image that runs must have been compiled for 7.2+ too (a TORCH_CUDA_ARCH_LIST naming 7.0 gives a 7.5 GPU the
  // sm_70 code, whose kernel is a trap). Queried on the current device, which the callers made `device`.
  cudaFuncAttributes attr{};
  cuda_check(cudaFuncGetAttributes(&attr, matmul_tc_kernel<FixedType::kInt32>), "fixed_point matmul: kernel query");
  if (attr.ptxVersion < 72) {
    if (s == "tensor-cores")
      throw std::invalid_argument("MPFUSED_FIXED_MATMUL_KERNEL=tensor-cores: this build's code for this GPU was compiled "
                                  "for compute_" + std::to_string(attr.ptxVersion) + ", without integer MMAs (7.2+)");
    return FixedMatmulKernel::kCudaCores;
  }
  return FixedMatmulKernel::kTensorCores;
}

void fixed_matmul_cuda(const FixedMatmulArgs& g, void* stream) {
  if (g.m == 0 || g.n == 0) return;
  // The torch layer limits m and n so that the grid fits (rows of tiles <= 65535).
  const dim3 grid(static_cast<unsigned>((g.n + kTile - 1) / kTile), static_cast<unsigned>((g.m + kTile - 1) / kTile));
  auto s = static_cast<cudaStream_t>(stream);
  int device = 0;
  cuda_check(cudaGetDevice(&device), "fixed_point matmul: cudaGetDevice");
  if (g.a_type == FixedType::kInt16 && g.b_type == FixedType::kInt16 &&
      fixed_matmul_kernel(device) == FixedMatmulKernel::kTensorCores) {
    dispatch_code_type(g.out_type, [&](auto ot) { matmul_tc_kernel<decltype(ot)::value><<<grid, kTcThreads, 0, s>>>(g); });
    cuda_check(cudaGetLastError(), "fixed_point matmul launch");
    return;
  }
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
