// Tensor-core GEMM: FP16/BF16 inputs, FP32 accumulation (nvcuda::wmma 16x16x16), fused epilogue.
//
// One block computes a kGemmBlockM x kGemmBlockN tile of the output with 8 warps in a 2 x 4 grid, each
// warp a 64 x 32 tile (4 x 2 accumulator fragments). The K dimension is walked kGemmBlockK at a time
// through a kStages-deep ring of shared-memory stages:
//   - vector path (both operands 16-byte aligned along their contiguous dimension, core/gemm.h):
//     128-bit copies; on sm_80+ cp.async, so that the copies of the next stages overlap the MMAs of
//     this one; on sm_75 plain 128-bit loads and stores;
//   - element path (any leading dimension): 16-bit loads, still through the same stages.
// Tails in M, N and K are zero-filled on the way into shared memory, so the MMAs never branch: a vector
// that lies whole inside the operand is one 16-byte copy, a tail is read element by element (copy16). Each operand tile is staged in its own global layout (row- or column-major), padded by
// 8 elements per row against bank conflicts, and read with the matching wmma layout: a transposed view
// costs nothing.
//
// Epilogue: each warp moves its accumulators, two fragments (16 x 32) at a time, through its own slice
// of shared memory; each lane then owns 16 consecutive outputs of a row, applies core/gemm.h's
// epilogue (alpha, beta * C, bias, activation) in FP32, rounds once, and writes them with 128-bit
// stores when the row is complete and aligned, element by element otherwise.
//
// BF16 fragments exist on sm_80+ only: the BF16 kernels compile to a trap on sm_75, and the launcher
// refuses BF16 on such a GPU before launching.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>
#if defined(MPFUSED_HAVE_SM90A)
#include <cuda.h>  // CUtensorMap and its enums (the driver is reached through the runtime: no -lcuda)
#include <cudaTypedefs.h>
#endif

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common.cuh"
#include "wgmma.cuh"
#include "../kernels.h"

namespace mpf {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kThreads = 256;
constexpr int kWarpsM = 2, kWarpsN = 4;
constexpr int kWarpM = kGemmBlockM / kWarpsM;  // 64
constexpr int kWarpN = kGemmBlockN / kWarpsN;  // 32
constexpr int kFragsM = kWarpM / 16;           // 4
constexpr int kFragsN = kWarpN / 16;           // 2
constexpr int kStages = 3;
constexpr int kPad = 8;  // elements added to every shared-memory row: 16 bytes
static_assert(kWarpsM * kWarpsN * 32 == kThreads, "one warp per warp tile");
static_assert(kGemmBlockK % 16 == 0 && kGemmBlockK % 8 == 0, "K tile: whole fragments and whole vectors");

// A shared-memory tile of kRows x kCols elements, contiguous along kCols, rows padded.
template <int kRows, int kCols>
struct SmemTile {
  static constexpr int kLd = kCols + kPad;
  static constexpr int kElems = kRows * kLd;
};

// The operand tiles of one stage, in each operand's own layout.
//   A row-major (m, k): [BM][BK];  A col-major: [BK][BM]
//   B row-major (k, n): [BK][BN];  B col-major: [BN][BK]
template <bool kColMajor, int kOuter, int kInner>  // row-major: kOuter rows of kInner contiguous
using OperandTile = std::conditional_t<kColMajor, SmemTile<kInner, kOuter>, SmemTile<kOuter, kInner>>;
template <bool kACol>
using ATile = OperandTile<kACol, kGemmBlockM, kGemmBlockK>;
template <bool kBCol>
using BTile = OperandTile<!kBCol, kGemmBlockN, kGemmBlockK>;  // B row-major is (k, n): [BK][BN]

template <bool kACol, bool kBCol>
constexpr int kStageElems = ATile<kACol>::kElems + BTile<kBCol>::kElems;

// Epilogue staging: per warp, 16 rows x (2 fragments + 4 floats of padding).
constexpr int kEpiLd = kWarpN + 4;
constexpr int kEpiFloatsPerWarp = 16 * kEpiLd;

template <bool kACol, bool kBCol>
constexpr size_t smem_bytes() {
  const size_t pipeline = size_t{kStages} * kStageElems<kACol, kBCol> * 2;
  const size_t epilogue = size_t{kThreads / 32} * kEpiFloatsPerWarp * sizeof(float);
  return pipeline > epilogue ? pipeline : epilogue;
}
static_assert(smem_bytes<false, false>() <= 64 * 1024 && smem_bytes<true, true>() <= 64 * 1024 &&
                  smem_bytes<true, false>() <= 64 * 1024 && smem_bytes<false, true>() <= 64 * 1024,
              "the stages must fit sm_75's 64 KB of shared memory per block");

// ---- global -> shared copies ----------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes, of which the first `bytes` (0 to 16, even) come from src and the rest are zero; src is not read
// when bytes is 0. A whole vector is one 16-byte copy (cp.async on sm_80+). A tail is read element by element
// and stored at once, never through cp.async's src-size: compute-sanitizer's memcheck takes a 16-byte cp.async
// for a 16-byte read whatever its src-size, and on an H200 it reported the tail of an operand's last row as a
// read past its allocation. Tails lie at the operand's edges only, and a plain store into a stage is at least
// as ordered as a copy into it (a stage is refilled only after every warp is done reading it).
__device__ __forceinline__ void copy16(uint16_t* dst, const uint16_t* src, int bytes) {
  if (bytes == 16) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src) : "memory");
#else
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#endif
    return;
  }
  uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
  for (int i = 0; i < 8; ++i)
    if (2 * i < bytes) w[i / 2] |= static_cast<uint32_t>(src[i]) << (16 * (i % 2));
  *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Copies one operand's tiles, stage after stage, into shared memory. The tile is kRows x kCols,
// contiguous along columns in global memory (row stride ld) as in shared memory; the K dimension runs
// along the rows (kKRows: A column-major, B row-major) or along the columns (A row-major, B
// column-major). Elements past the operand's edge are zero-filled. Per thread, the state is one pointer
// that advances by one K tile per stage and the bounds of the fixed (M or N) dimension, so that the
// main loop keeps its registers for the accumulators.
template <int kRows, int kCols, bool kKRows, bool kVector>
struct TileCopier {
  static constexpr int kLd = SmemTile<kRows, kCols>::kLd;
  static constexpr int kPerThread = kVector ? 8 : 1;  // elements per copy
  static constexpr int kPerRow = kCols / kPerThread;  // copies per row
  static constexpr int kRowStep = kThreads / kPerRow;  // rows between one thread's copies
  static constexpr int kCopies = kRows / kRowStep;
  static_assert(kThreads % kPerRow == 0 && kRows % kRowStep == 0, "the copies tile the tile exactly");

  const uint16_t* src;  // this thread's first copy in the current tile
  int64_t ld;
  int64_t k_step;       // elements src advances per K tile
  int64_t fixed_left;   // kKRows: columns left in the fixed dimension (from this thread's column);
                        // else: rows left (from this thread's first row)
  int row, col;         // of this thread's first copy, in the tile

  // tile_origin: the operand's element at (row 0, column 0) of the first K tile.
  __device__ __forceinline__ TileCopier(const uint16_t* tile_origin, int64_t ld_, int64_t rows_total_fixed_left,
                                        int64_t cols_total_fixed_left)
      : ld(ld_), k_step(kKRows ? int64_t{kGemmBlockK} * ld_ : kGemmBlockK) {
    row = static_cast<int>(threadIdx.x) / kPerRow;
    col = static_cast<int>(threadIdx.x) % kPerRow * kPerThread;
    src = tile_origin + row * ld + col;
    fixed_left = kKRows ? cols_total_fixed_left - col : rows_total_fixed_left - row;
  }

  // Copies the tile whose K extent left is k_left (K - k0) into dst, then advances to the next K tile.
  __device__ __forceinline__ void copy(uint16_t* dst, int64_t k_left) {
    // The extent of this thread's copies along K: rows (kKRows) or columns.
    const int64_t k_here = kKRows ? k_left - row : k_left - col;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int64_t rows_in = kKRows ? k_here - i * kRowStep : fixed_left - i * kRowStep;  // > 0: row exists
      const int64_t cols_in = kKRows ? fixed_left : k_here;                                // columns from col
      const uint16_t* s = src + i * kRowStep * ld;
      uint16_t* d = dst + (row + i * kRowStep) * kLd + col;
      if constexpr (kVector) {
        const int bytes = rows_in <= 0 ? 0 : cols_in >= 8 ? 16 : cols_in > 0 ? static_cast<int>(cols_in) * 2 : 0;
        copy16(d, s, bytes);
      } else {
        *d = rows_in > 0 && cols_in > 0 ? *s : uint16_t{0};
      }
    }
    src += k_step;
  }
};

// ---- fragments per layout --------------------------------------------------------------------------
template <typename T, bool kCol>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, std::conditional_t<kCol, wmma::col_major, wmma::row_major>>;
template <typename T, bool kCol>
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, std::conditional_t<kCol, wmma::col_major, wmma::row_major>>;
using FragAcc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

struct KernelParams {
  GemmArgs g;
  int64_t tiles_m, tiles_n;
  bool out_vector;  // rows of out (and pre_activation) start 16-byte aligned
};

__device__ __forceinline__ uint32_t pack2(DType d, float lo, float hi) {
  const uint32_t l = d == DType::kFloat16 ? float_to_f16_bits(lo) : float_to_bf16_bits(lo);
  const uint32_t h = d == DType::kFloat16 ? float_to_f16_bits(hi) : float_to_bf16_bits(hi);
  return l | (h << 16);
}

// 8 consecutive outputs of one row, of which the first `count` exist: 128-bit stores when the segment
// is complete and aligned, element stores otherwise.
__device__ __forceinline__ void store_row8(void* base, DType d, int64_t offset, const float (&v)[8], int count,
                                           bool vector) {
  if (vector && count == 8) {
    if (d == DType::kFloat32) {
      float4* p = reinterpret_cast<float4*>(static_cast<float*>(base) + offset);
      p[0] = make_float4(v[0], v[1], v[2], v[3]);
      p[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
      *reinterpret_cast<uint4*>(static_cast<uint16_t*>(base) + offset) =
          make_uint4(pack2(d, v[0], v[1]), pack2(d, v[2], v[3]), pack2(d, v[4], v[5]), pack2(d, v[6], v[7]));
    }
    return;
  }
#pragma unroll
  for (int e = 0; e < 8; ++e)
    if (e < count) store_any(base, offset + e, d, v[e]);
}

// The epilogue of the outputs (row, col8 .. col8 + 7) of one batch, those below n, from their FP32
// accumulators acc8: core/gemm.h's alpha, beta * C, bias and activation, written to out (and
// pre_activation) at `offset` by store_row8.
__device__ __forceinline__ void epilogue_row8(const GemmArgs& g, const EpilogueScalars& es, int64_t batch, int64_t row,
                                              int64_t col8, int64_t offset, const float* acc8, bool out_vector) {
  const int count = g.n - col8 >= 8 ? 8 : static_cast<int>(g.n - col8);
  float pre[8], out[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const bool in = e < count;
    const float cv = es.has_c && in ? load_any(g.c.data, matrix_offset(g.c, batch, row, col8 + e), g.c.dtype) : 0.0f;
    const float bv = es.has_bias && in ? load_any(g.bias, col8 + e, g.bias_dtype) : 0.0f;
    pre[e] = epilogue_pre(acc8[e], cv, bv, es);
    out[e] = activate(pre[e], es.act);
  }
  store_row8(g.out, g.out_dtype, offset, out, count, out_vector);
  if (g.pre_activation) store_row8(g.pre_activation, g.out_dtype, offset, pre, count, out_vector);
}

template <typename T, bool kACol, bool kBCol, bool kVector>
__device__ __forceinline__ void gemm_body(const KernelParams& kp) {
  using ATileT = ATile<kACol>;
  using BTileT = BTile<kBCol>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  uint16_t* smem = reinterpret_cast<uint16_t*>(smem_raw);
  const GemmArgs& g = kp.g;
  const EpilogueScalars es = epilogue_scalars(g);

  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
  int64_t tile_m, tile_n;
  gemm_tile_of_block(blockIdx.x, kp.tiles_m, kp.tiles_n, &tile_m, &tile_n);
  const int64_t m0 = tile_m * kGemmBlockM, n0 = tile_n * kGemmBlockN;
  const int64_t k_tiles = (g.k + kGemmBlockK - 1) / kGemmBlockK;

  for (int64_t batch = blockIdx.y; batch < g.batch; batch += gridDim.y) {
    const uint16_t* a = static_cast<const uint16_t*>(g.a.data) + batch * g.a.batch_stride;
    const uint16_t* b = static_cast<const uint16_t*>(g.b.data) + batch * g.b.batch_stride;

    // A is (m, k): column-major means stored (k, m), K along the rows. B is (k, n): row-major means
    // stored (k, n), K along the rows.
    using ACopier = std::conditional_t<kACol, TileCopier<kGemmBlockK, kGemmBlockM, true, kVector>,
                                       TileCopier<kGemmBlockM, kGemmBlockK, false, kVector>>;
    using BCopier = std::conditional_t<kBCol, TileCopier<kGemmBlockN, kGemmBlockK, false, kVector>,
                                       TileCopier<kGemmBlockK, kGemmBlockN, true, kVector>>;
    ACopier copy_a(kACol ? a + m0 : a + m0 * g.a.ld, g.a.ld, g.m - m0, g.m - m0);
    BCopier copy_b(kBCol ? b + n0 * g.b.ld : b + n0, g.b.ld, g.n - n0, g.n - n0);
    // Stage s of the ring: A tile, then B tile; k tiles are loaded in order.
    int64_t k_loaded = 0;
    auto load_stage = [&](int stage) {
      uint16_t* sa = smem + stage * kStageElems<kACol, kBCol>;
      copy_a.copy(sa, g.k - k_loaded);
      copy_b.copy(sa + ATileT::kElems, g.k - k_loaded);
      k_loaded += kGemmBlockK;
    };

    FragAcc acc[kFragsM][kFragsN];
#pragma unroll
    for (int i = 0; i < kFragsM; ++i)
#pragma unroll
      for (int j = 0; j < kFragsN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_tiles) load_stage(s);
      cp_async_commit();  // an empty group keeps the count of groups in step with the stages
    }

    for (int64_t kt = 0; kt < k_tiles; ++kt) {
      cp_async_wait<kStages - 2>();  // stage kt has landed (for this thread) ...
      __syncthreads();               // ... for every thread, and stage kt-1 is no longer being read
      const int64_t next = kt + kStages - 1;
      if (next < k_tiles) load_stage(static_cast<int>(next % kStages));
      cp_async_commit();

      const uint16_t* sa = smem + static_cast<int>(kt % kStages) * kStageElems<kACol, kBCol>;
      const uint16_t* sb = sa + ATileT::kElems;
#pragma unroll
      for (int kk = 0; kk < kGemmBlockK; kk += 16) {
        // B fragments for the whole warp tile, then one A fragment at a time: fewer fragment registers
        // live next to the 64 accumulator registers than loading every A fragment first.
        FragB<T, kBCol> fb[kFragsN];
#pragma unroll
        for (int j = 0; j < kFragsN; ++j) {
          const int col = warp_n * kWarpN + j * 16;
          const uint16_t* p = kBCol ? sb + col * BTileT::kLd + kk : sb + kk * BTileT::kLd + col;
          wmma::load_matrix_sync(fb[j], reinterpret_cast<const T*>(p), BTileT::kLd);
        }
#pragma unroll
        for (int i = 0; i < kFragsM; ++i) {
          FragA<T, kACol> fa;
          const int row = warp_m * kWarpM + i * 16;
          const uint16_t* p = kACol ? sa + kk * ATileT::kLd + row : sa + row * ATileT::kLd + kk;
          wmma::load_matrix_sync(fa, reinterpret_cast<const T*>(p), ATileT::kLd);
#pragma unroll
          for (int j = 0; j < kFragsN; ++j) wmma::mma_sync(acc[i][j], fa, fb[j], acc[i][j]);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // the pipeline's shared memory becomes the epilogue's

    // ---- epilogue ----
    float* stage_out = reinterpret_cast<float*>(smem_raw) + warp * kEpiFloatsPerWarp;
    const int r = lane >> 1, c0 = (lane & 1) * 16;
    const int64_t out_base = batch * g.m * g.n;
#pragma unroll 1  // the epilogue's code is emitted once, not once per fragment row
    for (int i = 0; i < kFragsM; ++i) {
#pragma unroll  // constant indices keep acc in registers; the predicate selects row i
      for (int ii = 0; ii < kFragsM; ++ii)
        if (ii == i)
#pragma unroll
          for (int j = 0; j < kFragsN; ++j)
            wmma::store_matrix_sync(stage_out + j * 16, acc[ii][j], kEpiLd, wmma::mem_row_major);
      __syncwarp();
      const int64_t row = m0 + warp_m * kWarpM + i * 16 + r;
      const int64_t col = n0 + warp_n * kWarpN + c0;
      if (row < g.m && col < g.n) {
        const int64_t offset = out_base + row * g.n + col;
#pragma unroll 1
        for (int h = 0; h < 2; ++h) {  // 8 outputs at a time: 16 bytes of FP16/BF16
          const int64_t col8 = col + 8 * h;
          if (col8 >= g.n) break;
          epilogue_row8(g, es, batch, row, col8, offset + 8 * h, stage_out + r * kEpiLd + c0 + 8 * h, kp.out_vector);
        }
      }
      __syncwarp();  // the slice is rewritten by the next fragment row
    }
    __syncthreads();  // the next batch's stages overwrite the epilogue's slices
  }
}

// One block per SM: the kernel needs 141-187 registers per thread (ptxas, sm_75-sm_90); capping it at
// 128 for two blocks per SM made ptxas spill the copy addresses inside the main loop.
template <typename T, bool kACol, bool kBCol, bool kVector>
__global__ void __launch_bounds__(kThreads, 1) gemm_kernel(const __grid_constant__ KernelParams kp) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __trap();  // unreachable: the launcher refuses BF16 below sm_80
  } else {
    gemm_body<T, kACol, kBCol, kVector>(kp);
  }
#else
  gemm_body<T, kACol, kBCol, kVector>(kp);
#endif
}

template <typename T, bool kACol, bool kBCol, bool kVector>
void launch(const KernelParams& kp, const GemmPlan& plan, cudaStream_t stream) {
  auto kernel = gemm_kernel<T, kACol, kBCol, kVector>;
  constexpr size_t bytes = smem_bytes<kACol, kBCol>();
  cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
             "gemm: setting the shared-memory size");
  const dim3 grid(static_cast<unsigned>(plan.blocks), static_cast<unsigned>(plan.grid_y));
  kernel<<<grid, kThreads, bytes, stream>>>(kp);
  cuda_check(cudaGetLastError(), "gemm kernel launch");
}

// Whether the Hopper kernel launched: `why` nullptr where it did, else the reason it could not take the operands
// (the WMMA kernel then runs), and whether that reason is the device's or driver's rather than the operands'
// (GemmLaunch::unexpected).
struct Sm90Outcome {
  const char* why = nullptr;
  bool unexpected = false;
  bool no_cluster = false;  // only the cluster did not fit: the kernel without clusters may still run
};

// The calling thread's last gemm_cuda call (gemm_last_launch).
thread_local GemmLaunch last_launch;

#if defined(MPFUSED_HAVE_SM90A)  // a build with sm_90a code (CUDA 12+: TMA, tensor maps, setmaxnreg)
// ---- Hopper: TMA copies and warpgroup MMAs (sm_90a) ----------------------------------------------------
// A block computes 128 x 256 tiles of the output with three warpgroups, specialised, and stays on its SM for
// as many tiles as it is given (a persistent grid: one block per SM; block b takes work items b, b + grid,
// b + 2 grid, ... of the batches' tiles, batch-major, the tiles of a batch in gemm_tile_of_block's order):
//   - the producer (warpgroup 0; one thread issues): per K step of 64, two or more TMA copies (wgmma.cuh's
//     tma_load_3d) of A's and B's tiles into a ring of kSm90Stages stages, in the 128-byte swizzle that the
//     MMAs' descriptors name. The tensor maps (built on the host, kernel parameters) give the operands' extents,
//     so the MN edges and the K tail land as zeros without a test in the kernel;
//   - two consumers (warpgroups 1, 2), each 64 x 256 of the tile with one wgmma.mma_async m64n256k16 per 16 of
//     K (128 FP32 accumulators per thread), both operands read from shared memory through descriptors.
// Two mbarriers per stage hand it over, with no block-wide barrier after the mbarriers' initialisation:
//   full[s]: the producer's arrive.expect_tx (48 KB) and the copies' bytes complete it; consumers wait on it;
//   empty[s]: each consumer warp arrives once its MMAs of the stage are retired (wgmma.wait_group); the
//   producer waits on it before copying into the stage again.
// Stage s of step it (steps counted over all of the block's tiles) waits on phase parity (it / kSm90Stages) & 1 of
// full[s]; the producer on the opposite parity of empty[s], which passes at once in the first round (the phase
// before the first is complete). A consumer keeps one group of MMAs in flight: at step it it issues stage it's
// four MMAs, then waits for those of step it - 1 and releases that stage. The producer runs up to kSm90Stages
// steps ahead of the MMAs, into the next tile too: while the consumers apply the epilogue of one tile, the first
// stages of the next are already being copied.
// Registers: the producer hands most of its own back (setmaxnreg.dec) and the consumers take them (inc).
// The epilogue needs none of the pipeline's shared memory: each consumer warp moves its accumulators, 32 columns
// of its 16 rows at a time, through a 2 KB slice of its own (__syncwarp on either side), then each lane applies
// core/gemm.h's epilogue to 8 consecutive outputs of a row at a time, as the WMMA kernel does, and stores them
// with 128-bit stores where it can.
constexpr int kSm90BlockM = 128, kSm90BlockN = 256, kSm90BlockK = 64;
static_assert(kSm90BlockM == 128, "gemm_cuda pairs tile rows of 128 (clusters only where M > 128)");
constexpr int kSm90Stages = 4;
constexpr int kSm90Consumers = 2;                                       // warpgroups of MMAs, 64 rows each
constexpr int kSm90Threads = 128 * (1 + kSm90Consumers);                // the producer warpgroup first
constexpr int kSm90ProducerRegs = 40, kSm90ConsumerRegs = 232;          // 128 x 40 + 256 x 232 <= 64K
constexpr int kSm90PanelBytes = kSm90BlockK * sm90::kLineBytes;         // an MN-major tile's 64-wide panel: 8 KB
constexpr int kSm90ATileBytes = kSm90BlockM * kSm90BlockK * 2;          // 16 KB
constexpr int kSm90BTileBytes = kSm90BlockN * kSm90BlockK * 2;          // 32 KB
constexpr int kSm90StageBytes = kSm90ATileBytes + kSm90BTileBytes;
constexpr int kSm90EpiCols = 32;                                        // columns a consumer warp stages at once
constexpr int kSm90EpiBytes = 16 * kSm90EpiCols * 4;                    // a consumer warp's slice: 16 rows, 2 KB
constexpr int kSm90BarrierBytes = 2 * kSm90Stages * 8;                  // full[], then empty[]
// The ring, the consumer warps' epilogue slices, the mbarriers, and slack to align the ring on 1024 bytes.
constexpr size_t kSm90SmemBytes = size_t{kSm90Stages} * kSm90StageBytes + size_t{kSm90Consumers} * 4 * kSm90EpiBytes +
                                  kSm90BarrierBytes + sm90::kAtomBytes;
static_assert(kSm90SmemBytes <= 227 * 1024, "sm_90's 227 KB of shared memory per block");
static_assert(kSm90BlockK * 2 == sm90::kLineBytes, "one 128-byte line of K per row of a K-major tile");
// setmaxnreg moves registers within the block's own allocation (65536 / kSm90Threads a thread at launch, rounded
// down to a multiple of 8): asking for more leaves the consumers' increase waiting forever.
constexpr int kSm90RegsNeeded = 128 * kSm90ProducerRegs + 128 * kSm90Consumers * kSm90ConsumerRegs;
static_assert(kSm90RegsNeeded <= kSm90Threads * ((65536 / kSm90Threads) & ~7),
              "setmaxnreg's counts fit the block's registers at launch");

// The epilogue slice's layout: row r's 16-byte chunk c (columns 4c .. 4c + 3) at chunk c ^ slice_swizzle(r) of
// the row's 128 bytes. The accumulators' 8-byte stores (rows lane / 4 of a half-warp's 4 rows, chunks 2 j and
// 2 j + 1) and the 16-byte reads of 8 consecutive columns (two rows a quarter-warp) then each touch every
// bank at most once: bits 1-2 differ between any 4 consecutive rows, bit 0 between neighbours.
__device__ __forceinline__ int slice_swizzle(int r) { return ((r & 3) << 1) | (r & 1); }
// Two floats as one 64-bit value, the first in the low half (its place in memory).
__device__ __forceinline__ uint64_t pack_floats(float lo, float hi) {
  return static_cast<uint64_t>(__float_as_uint(lo)) | (static_cast<uint64_t>(__float_as_uint(hi)) << 32);
}

// The Hopper kernel's arguments: the WMMA kernel's, and a TMA tensor map per operand (3-D: the contiguous
// dimension, the other one, batches). *_batched: 0 where one matrix serves every batch (the map's third
// extent is then 1, and the kernel asks for coordinate 0).
struct Sm90Params {
  CUtensorMap a, b;
  KernelParams kp;
  int a_batched, b_batched;
};

// kCluster: 1, or 2 for clusters of two CTAs along M that share B's tile: each CTA copies half of it (128 of its 256
// columns) with a multicast copy that lands in both CTAs' shared memory, so that L2 sends each B tile once per pair
// (48 KB a step per CTA become 32). A stage then goes back to the producers when the consumers of both CTAs are
// done with it: empty[s] counts the arrivals of both CTAs' consumer warps, each warp arriving on its own CTA's
// barrier and on its peer's. The two CTAs walk the same work items (pairs of M tiles), and every thread of both
// meets at a cluster barrier after the mbarriers' initialisation (a peer's copies and arrivals may come as soon as
// it passes it) and at the end (a CTA must not exit while its peer may still arrive on its barriers). Where the
// output has an odd number of tile rows, the second CTA of the last pair copies the first CTA's A tile (so that
// every copy lies inside A) and stores nothing.
template <typename T, bool kACol, bool kBCol, int kCluster>
__device__ __forceinline__ void gemm_body_sm90(const Sm90Params& p) {
  static_assert(kCluster == 1 || kCluster == 2, "clusters of one or two CTAs along M");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // The swizzle is taken from address bits: the tiles start on a 1024-byte boundary of the shared window.
  const uint32_t raw_addr = smem_addr(smem_raw);
  const uint32_t pad = (sm90::kAtomBytes - raw_addr % sm90::kAtomBytes) % sm90::kAtomBytes;
  unsigned char* smem = smem_raw + pad;
  const uint32_t smem0 = raw_addr + pad;
  constexpr uint32_t kEpiOffset = kSm90Stages * kSm90StageBytes;  // the consumer warps' slices, after the ring
  const uint32_t full0 = smem0 + kEpiOffset + kSm90Consumers * 4 * kSm90EpiBytes;  // full[s]: full0 + 8 s
  const uint32_t empty0 = full0 + 8 * kSm90Stages;
  const KernelParams& kp = p.kp;
  const GemmArgs& g = kp.g;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  constexpr int kTransA = kACol ? 1 : 0;  // A column-major is M-major
  constexpr int kTransB = kBCol ? 0 : 1;  // B row-major is N-major
  const int k_tiles = static_cast<int>((g.k + kSm90BlockK - 1) / kSm90BlockK);
  if (k_tiles == 0) return;  // the launcher takes K = 0 to the WMMA kernel; the pipeline needs a step a tile

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kSm90Stages; ++s) {
      sm90::mbar_init(full0 + 8 * s, 1);
      sm90::mbar_init(empty0 + 8 * s, kSm90Consumers * 4 * kCluster);
    }
    sm90::fence_mbarrier_init();
  }
  if constexpr (kCluster > 1) sm90::cluster_sync();
  else __syncthreads();

  const int wg = static_cast<int>(threadIdx.x) / 128;
  // Work items: (batch, a cluster's tiles), batch-major; this CTA's cluster takes items first, first + stride, ...
  // Everything here is computed from the parameters (constant memory) where it is used, so that nothing of it stays
  // live across the role split: the producer has 40 registers.
  auto tiles_mc = [&] { return (kp.tiles_m + kCluster - 1) / kCluster; };  // tile rows of clusters
  auto work = [&] { return tiles_mc() * kp.tiles_n * g.batch; };
  auto first = [] { return static_cast<int64_t>(blockIdx.x / kCluster); };
  auto stride = [] { return static_cast<int64_t>(gridDim.x / kCluster); };
  // Work item w -> its batch and the origin of this CTA's tile; a_m0: the rows of A it copies (m0, except past the
  // last tile row, where it is a copy of the first CTA's, whose outputs only that one stores).
  auto locate = [&](int64_t w, int64_t* batch, int* m0, int* a_m0, int* n0) {
    const int64_t tiles = tiles_mc() * kp.tiles_n;
    *batch = w / tiles;
    int64_t tile_mc, tile_n;
    gemm_tile_of_block(w - *batch * tiles, tiles_mc(), kp.tiles_n, &tile_mc, &tile_n);
    const int64_t tile_m = tile_mc * kCluster + (kCluster > 1 ? sm90::cluster_ctarank() : 0u);
    *m0 = static_cast<int>(tile_m * kSm90BlockM);
    *a_m0 = static_cast<int>((tile_m < kp.tiles_m ? tile_m : tile_mc * kCluster) * kSm90BlockM);
    *n0 = static_cast<int>(tile_n * kSm90BlockN);
  };

  if (wg == 0) {
    // ---- producer ----
    sm90::setmaxnreg_dec<kSm90ProducerRegs>();  // warpgroup-wide: before the other 127 threads leave
    if (threadIdx.x != 0) return;  // nothing to do (in a cluster, the kernel's final barrier waits for them)
    uint32_t it = 0;  // steps issued over all of this block's tiles
    for (int64_t w = first(); w < work(); w += stride()) {
      int64_t batch;
      int m0, a_m0, n0;
      locate(w, &batch, &m0, &a_m0, &n0);
      (void)m0;
      const int ba = p.a_batched ? static_cast<int>(batch) : 0, bb = p.b_batched ? static_cast<int>(batch) : 0;
      for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        const uint32_t s = it % kSm90Stages, parity = (it / kSm90Stages) & 1u;
        const uint32_t full = full0 + 8 * s;
        sm90::mbar_wait(empty0 + 8 * s, parity ^ 1u);  // every consumer is done with the stage's last round
        sm90::mbar_arrive_expect_tx(full, kSm90StageBytes);
        const uint32_t sa = smem0 + s * kSm90StageBytes, sb = sa + kSm90ATileBytes;
        const int k0 = kt * kSm90BlockK;
        // A is (m, k): row-major is K-major (a box of 64 K x 128 rows), column-major two 64-wide M panels.
        if constexpr (kACol) {
#pragma unroll
          for (int panel = 0; panel < kSm90BlockM / 64; ++panel)
            sm90::tma_load_3d(sa + panel * kSm90PanelBytes, &p.a, a_m0 + 64 * panel, k0, ba, full);
        } else {
          sm90::tma_load_3d(sa, &p.a, k0, a_m0, ba, full);
        }
        // B is (k, n): column-major is K-major (64 K x 256 rows), row-major four 64-wide N panels. In a cluster,
        // this CTA's part (its 1 / kCluster of the rows or panels) goes to every CTA of it.
        if constexpr (kCluster == 1) {
          if constexpr (kBCol) {
            sm90::tma_load_3d(sb, &p.b, k0, n0, bb, full);
          } else {
#pragma unroll
            for (int panel = 0; panel < kSm90BlockN / 64; ++panel)
              sm90::tma_load_3d(sb + panel * kSm90PanelBytes, &p.b, n0 + 64 * panel, k0, bb, full);
          }
        } else {
          constexpr uint16_t kAll = (1u << kCluster) - 1;
          constexpr int kRows = kSm90BlockN / kCluster;  // of B's tile, this CTA's part
          const uint32_t rank = sm90::cluster_ctarank();
          if constexpr (kBCol) {
            sm90::tma_load_3d_multicast(sb + rank * kRows * sm90::kLineBytes, &p.b, k0, n0 + kRows * static_cast<int>(rank),
                                        bb, full, kAll);
          } else {
#pragma unroll
            for (int i = 0; i < kRows / 64; ++i) {
              const int panel = static_cast<int>(rank) * (kRows / 64) + i;
              sm90::tma_load_3d_multicast(sb + panel * kSm90PanelBytes, &p.b, n0 + 64 * panel, k0, bb, full, kAll);
            }
          }
        }
      }
    }
    return;
  }

  // ---- consumers ----
  sm90::setmaxnreg_inc<kSm90ConsumerRegs>();
  const int cw = wg - 1;  // this consumer's 64 rows of the tile
  const int t = static_cast<int>(threadIdx.x) % 128, w16 = t / 32;
  const EpilogueScalars es = epilogue_scalars(g);
  // This warp's epilogue slice: 16 rows of kSm90EpiCols floats (its addresses are computed in the epilogue, from a
  // copy of the lane the compiler cannot see through: hoisted out of the tile loop, they stayed live through the K
  // loop and made the 2-CTA kernel spill).
  unsigned char* const slices = smem + kEpiOffset;
  // After wgmma.wait_group has retired a stage's MMAs in this warp, the warp gives the stage back: one arrival
  // a warp, on every CTA of the cluster. (__syncwarp first: every lane has passed its wait before lane 0 speaks for
  // the warp.)
  auto release = [&](uint32_t step) {
    __syncwarp();
    if (t % 32 == 0) {
      const uint32_t bar = empty0 + 8 * (step % kSm90Stages);
      if constexpr (kCluster == 1) {
        sm90::mbar_arrive(bar);
      } else {
#pragma unroll
        for (uint32_t r = 0; r < kCluster; ++r) sm90::mbar_arrive_cluster(bar, r);
      }
    }
  };
  uint32_t it = 0;
  for (int64_t w = first(); w < work(); w += stride()) {
    int64_t batch;
    int m0, a_m0, n0;
    locate(w, &batch, &m0, &a_m0, &n0);
    (void)a_m0;
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;

    for (int kt = 0; kt < k_tiles; ++kt, ++it) {
      const uint32_t s = it % kSm90Stages;
      sm90::mbar_wait(full0 + 8 * s, (it / kSm90Stages) & 1u);  // the stage's copies have landed
      const uint32_t sa = smem0 + s * kSm90StageBytes;
      const uint32_t sb = sa + kSm90ATileBytes;
#pragma unroll
      for (int i = 0; i < 128; ++i) sm90::fence_operand(acc[i]);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kSm90BlockK / 16; ++kk) {
        // A: this consumer's 64 rows; K-major: 32 bytes further per 16 K inside the line, MN-major: 16 K lines.
        const uint64_t da = kACol ? sm90::smem_desc128(sa + cw * kSm90PanelBytes + kk * 16 * sm90::kLineBytes,
                                                       kSm90PanelBytes, sm90::kAtomBytes)
                                  : sm90::smem_desc128(sa + cw * 64 * sm90::kLineBytes + kk * 32, 16, sm90::kAtomBytes);
        const uint64_t db = kBCol ? sm90::smem_desc128(sb + kk * 32, 16, sm90::kAtomBytes)
                                  : sm90::smem_desc128(sb + kk * 16 * sm90::kLineBytes, kSm90PanelBytes,
                                                       sm90::kAtomBytes);
        sm90::wgmma_m64n256k16<kBf16, kTransA, kTransB>(acc, da, db);
      }
      sm90::wgmma_commit();
      sm90::wgmma_wait<1>();  // the MMAs of step it - 1 are retired ...
#pragma unroll
      for (int i = 0; i < 128; ++i) sm90::fence_operand(acc[i]);
      if (kt > 0) release(it - 1);  // ... and their stage goes back to the producer
    }
    sm90::wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < 128; ++i) sm90::fence_operand(acc[i]);
    release(it - 1);  // (k_tiles >= 1) the producer goes on to the next tile

    // ---- epilogue: through this warp's slice, 32 columns at a time, then 8 outputs of a row per step ----
    // The accumulators: acc[4 j + h] (h < 2) is row lane / 4, acc[4 j + 2 + h] row lane / 4 + 8, both of column
    // 8 j + 2 (lane % 4) + h of the warp's 16 rows (j < 32).
    const int64_t out_base = batch * g.m * g.n;
    const int64_t row0 = m0 + cw * 64 + w16 * 16;  // the warp's first row
    float* const slice = reinterpret_cast<float*>(slices + (cw * 4 + w16) * kSm90EpiBytes);
#pragma unroll 1  // the epilogue's code is emitted once, not once per group of columns
    for (int cc = 0; cc < kSm90BlockN / kSm90EpiCols; ++cc) {
      int lane = t % 32;
      asm volatile("" : "+r"(lane));  // the slice's addresses computed here, once a group (see `slices`)
#pragma unroll  // constant indices keep acc in registers; the predicate selects group cc
      for (int c2 = 0; c2 < kSm90BlockN / kSm90EpiCols; ++c2)
        if (c2 == cc)
#pragma unroll
          for (int jj = 0; jj < kSm90EpiCols / 8; ++jj) {
            // columns 8 jj + 2 (lane % 4) and the next: chunk 2 jj + (lane % 4) / 2, at float 2 (lane % 2) in it
            const int i = 4 * (c2 * (kSm90EpiCols / 8) + jj), chunk = 2 * jj + (lane % 4) / 2, r = lane / 4;
            // (one 64-bit value: stored as a float2, half of these became two 32-bit stores)
            *reinterpret_cast<uint64_t*>(slice + r * kSm90EpiCols + 4 * (chunk ^ slice_swizzle(r)) + 2 * (lane % 2)) =
                pack_floats(acc[i], acc[i + 1]);
            *reinterpret_cast<uint64_t*>(slice + (r + 8) * kSm90EpiCols + 4 * (chunk ^ slice_swizzle(r + 8)) + 2 * (lane % 2)) =
                pack_floats(acc[i + 2], acc[i + 3]);
          }
      __syncwarp();
#pragma unroll 1
      for (int h = 0; h < 2; ++h) {  // lane's segments: rows lane / 4 and lane / 4 + 8, 8 columns at 8 (lane % 4)
        const int r = lane / 4 + 8 * h, c = 8 * (lane % 4);
        const int64_t row = row0 + r, col8 = n0 + cc * kSm90EpiCols + c;
        if (row < g.m && col8 < g.n) {
          const float* line = slice + r * kSm90EpiCols;
          const float4 lo = *reinterpret_cast<const float4*>(line + 4 * ((c / 4) ^ slice_swizzle(r)));
          const float4 hi = *reinterpret_cast<const float4*>(line + 4 * ((c / 4 + 1) ^ slice_swizzle(r)));
          const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
          epilogue_row8(g, es, batch, row, col8, out_base + row * g.n + col8, v, kp.out_vector);
        }
      }
      __syncwarp();  // the slice is rewritten by the next group of columns
    }
  }
}

template <typename T, bool kACol, bool kBCol, int kCluster>
__global__ void __launch_bounds__(kSm90Threads, 1) gemm_sm90_kernel(const __grid_constant__ Sm90Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  gemm_body_sm90<T, kACol, kBCol, kCluster>(p);
  // Every thread of both CTAs, from either role: a CTA must not exit while its peer may still arrive on its barriers.
  if constexpr (kCluster > 1) sm90::cluster_sync();
#else
  (void)p;
  __trap();  // unreachable: the launcher takes this kernel only where the sm_90a image runs
#endif
}

// cuTensorMapEncodeTiled, from the driver through the runtime (no link against libcuda); nullptr where the
// driver has none.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &f, cudaEnableDefault, &found);
#endif
    if (e != cudaSuccess) (void)cudaGetLastError();  // this call's error, not sticky: clear it
    if (e != cudaSuccess || found != cudaDriverEntryPointSuccess) f = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// The tensor map of one operand: dimensions (contiguous, other, batch) with boxes of 64 x `rows` (K-major: 64 K
// by the tile's M or N extent) or 64 x 64 (MN-major: a 64-wide panel by 64 K), the 128-byte swizzle,
// out-of-bounds elements read as zeros. False where the driver refuses it (the caller takes the WMMA kernel, and
// gemm_last_launch says why).
bool encode_operand_map(CUtensorMap* map, const MatrixRef& m, int64_t rows, int64_t cols, int64_t batch, bool k_major,
                        int box_rows, bool* batched) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (!encode) return false;
  // Element (r, c) of the (rows x cols) matrix is at r * ld + c (row-major) or c * ld + r (column-major).
  const int64_t inner = m.col_major ? rows : cols, outer = m.col_major ? cols : rows;
  *batched = batch > 1 && m.batch_stride != 0;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(outer),
                              static_cast<cuuint64_t>(*batched ? batch : 1)};
  const int64_t ld_bytes = m.ld * 2;
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(ld_bytes),
                                 static_cast<cuuint64_t>(*batched ? m.batch_stride * 2 : ld_bytes * outer)};
  const cuuint32_t box[3] = {64, static_cast<cuuint32_t>(k_major ? box_rows : 64), 1};
  const cuuint32_t unit[3] = {1, 1, 1};
  const CUtensorMapDataType type =
      m.dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r = encode(map, type, 3, const_cast<void*>(m.data), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

// Launches the kernel over `work` items; a reason (nothing launched) where the registers ptxas gave it cannot cover
// setmaxnreg's counts (the consumers' increase would then wait forever: the static_assert above assumes 65536 / 384 a
// thread, which a flag such as -maxrregcount or another ptxas could lower), or where no cluster fits the device.
// A persistent grid: one CTA per SM (the kernel's shared memory allows no second), as many clusters as can run at
// once (cudaOccupancyMaxActiveClusters: a pair needs two free SMs of one GPC), fewer where there is less work.
template <typename T, bool kACol, bool kBCol, int kCluster>
Sm90Outcome launch_sm90(const Sm90Params& p, int64_t work, int sms, cudaStream_t stream) {
  auto kernel = gemm_sm90_kernel<T, kACol, kBCol, kCluster>;
  cudaFuncAttributes attr{};  // (a host-side query of the loaded module, as cheap as the attribute set below)
  cuda_check(cudaFuncGetAttributes(&attr, kernel), "gemm: kernel query");
  if (attr.numRegs * kSm90Threads < kSm90RegsNeeded)
    return {"ptxas gave the Hopper kernel too few registers for its setmaxnreg counts", true};
  cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSm90SmemBytes)),
             "gemm: setting the shared-memory size");
  if constexpr (kCluster == 1) {
    const int64_t blocks = work < sms ? work : sms;
    kernel<<<static_cast<unsigned>(blocks), kSm90Threads, kSm90SmemBytes, stream>>>(p);
    cuda_check(cudaGetLastError(), "gemm kernel launch");
  } else {
    cudaLaunchAttribute cluster[1] = {};
    cluster[0].id = cudaLaunchAttributeClusterDimension;
    cluster[0].val.clusterDim.x = kCluster;
    cluster[0].val.clusterDim.y = 1;
    cluster[0].val.clusterDim.z = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(static_cast<unsigned>(kCluster * (sms / kCluster > 0 ? sms / kCluster : 1)));
    config.blockDim = dim3(kSm90Threads);
    config.dynamicSmemBytes = kSm90SmemBytes;
    config.stream = stream;
    config.attrs = cluster;
    config.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {  // e.g. no cluster launch here
      (void)cudaGetLastError();  // this call's error, not sticky: clear it
      clusters = 0;
    }
    if (clusters <= 0) return {"no cluster of two CTAs fits this device (cudaOccupancyMaxActiveClusters)", true, true};
    const int64_t n = work < clusters ? work : clusters;
    config.gridDim = dim3(static_cast<unsigned>(n * kCluster));
    cuda_check(cudaLaunchKernelEx(&config, kernel, p), "gemm kernel launch");
  }
  return {};
}

// Launches the Hopper kernel (kCluster CTAs a cluster); a reason (nothing launched) where it cannot take these operands:
// K = 0 (no copies to make), coordinates past int32, a tensor map the driver refuses, registers short of
// setmaxnreg's counts, or no cluster that fits.
template <typename T, int kCluster>
Sm90Outcome dispatch_layout_sm90(const KernelParams& kp_in, int device, cudaStream_t stream) {
  const GemmArgs& g = kp_in.g;
  constexpr int64_t kMaxCoord = 0x7fffffff - 256;  // TMA coordinates are int32; a box may start past the extent
  if (g.k <= 0) return {"K is 0 (no copies to make)", false};
  if (g.m > kMaxCoord || g.n > kMaxCoord || g.k > kMaxCoord || g.batch > kMaxCoord)
    return {"a dimension passes the int32 coordinates of TMA copies", false};
  // An operand whose rows overlap (a stride below its row's length: an expand()ed tensor, stride 0) is not a
  // tensor map's layout; the WMMA kernel reads it element by element address.
  const auto rows_overlap = [](const MatrixRef& m, int64_t rows, int64_t cols) {
    const int64_t inner = m.col_major ? rows : cols, outer = m.col_major ? cols : rows;
    return outer > 1 && m.ld < inner;
  };
  if (rows_overlap(g.a, g.m, g.k) || rows_overlap(g.b, g.k, g.n))
    return {"an operand's rows overlap in memory (a stride below the row's length, e.g. an expand()ed tensor)", false};
  Sm90Params p{};
  p.kp = kp_in;
  bool a_batched = false, b_batched = false;
  // B's K-major box: the rows of this CTA's part of the tile (all of them without a cluster).
  if (!encode_operand_map(&p.a, g.a, g.m, g.k, g.batch, !g.a.col_major, kSm90BlockM, &a_batched) ||
      !encode_operand_map(&p.b, g.b, g.k, g.n, g.batch, g.b.col_major, kSm90BlockN / kCluster, &b_batched))
    return {"the driver refused an operand's tensor map (cuTensorMapEncodeTiled)", true};
  p.a_batched = a_batched ? 1 : 0;
  p.b_batched = b_batched ? 1 : 0;
  p.kp.tiles_m = (g.m + kSm90BlockM - 1) / kSm90BlockM;
  p.kp.tiles_n = (g.n + kSm90BlockN - 1) / kSm90BlockN;
  const int64_t tiles = p.kp.tiles_m * p.kp.tiles_n;
  if (tiles > 0x7fffffff) throw std::runtime_error("mpfused.gemm: the output has more than 2^31 - 1 tiles");
  int sms = 0;
  cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "gemm: device query");
  // work items: (batch, a cluster's tiles); <= 2^31 * 2^31, no overflow
  const int64_t work = (p.kp.tiles_m + kCluster - 1) / kCluster * p.kp.tiles_n * g.batch;
  const bool ac = g.a.col_major, bc = g.b.col_major;
  if (!ac && !bc) return launch_sm90<T, false, false, kCluster>(p, work, sms, stream);
  if (!ac && bc) return launch_sm90<T, false, true, kCluster>(p, work, sms, stream);
  if (ac && !bc) return launch_sm90<T, true, false, kCluster>(p, work, sms, stream);
  return launch_sm90<T, true, true, kCluster>(p, work, sms, stream);
}
#else
// No sm_90a code in this build: aligned operands take the WMMA kernel.
template <typename T, int kCluster>
Sm90Outcome dispatch_layout_sm90(const KernelParams&, int, cudaStream_t) {
  return {"this build has no sm_90a code", true};
}
#endif  // MPFUSED_HAVE_SM90A

template <typename T>
void dispatch_layout(const KernelParams& kp, const GemmPlan& plan, cudaStream_t stream) {
  const bool ac = kp.g.a.col_major, bc = kp.g.b.col_major;
  if (plan.vector_path) {
    if (!ac && !bc) return launch<T, false, false, true>(kp, plan, stream);
    if (!ac && bc) return launch<T, false, true, true>(kp, plan, stream);
    if (ac && !bc) return launch<T, true, false, true>(kp, plan, stream);
    return launch<T, true, true, true>(kp, plan, stream);
  }
  if (!ac && !bc) return launch<T, false, false, false>(kp, plan, stream);
  if (!ac && bc) return launch<T, false, true, false>(kp, plan, stream);
  if (ac && !bc) return launch<T, true, false, false>(kp, plan, stream);
  return launch<T, true, true, false>(kp, plan, stream);
}

}  // namespace

std::string gemm_unsupported(DType input_dtype, int device) {
  if (input_dtype != DType::kBFloat16) return {};
  int major = 0, minor = 0;
  cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "gemm: device query");
  cuda_check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "gemm: device query");
  if (major < 8)
    return "mpfused.gemm: bfloat16 inputs need tensor cores of compute capability 8.0 or newer; this GPU is sm_" +
           std::to_string(major) + std::to_string(minor) + ". Use float16 inputs on it.";
  // The image that runs must have been built for sm_80+ too: on a newer GPU a build that only holds
  // compute_75 PTX would JIT the sm_75 trap. (Queried on the current device, which the caller made
  // `device`.)
  cudaFuncAttributes attr{};
  cuda_check(cudaFuncGetAttributes(&attr, gemm_kernel<__nv_bfloat16, false, false, true>), "gemm: kernel query");
  if (attr.ptxVersion < 80)
    return "mpfused.gemm: this build has no bfloat16 GEMM for this GPU (its kernels were compiled for compute_" +
           std::to_string(attr.ptxVersion) + "); rebuild with TORCH_CUDA_ARCH_LIST including 8.0 or newer, or use "
           "float16 inputs.";
  return {};
}

GemmKernelChoice gemm_kernel_choice() {
  const char* v = std::getenv("MPFUSED_GEMM_KERNEL");
  const std::string s = v ? v : "";
  if (s.empty() || s == "wmma") return GemmKernelChoice::kWmma;
  if (s == "wgmma") return GemmKernelChoice::kWgmma;
  if (s == "wgmma-cluster") return GemmKernelChoice::kWgmmaCluster;
  throw std::invalid_argument("MPFUSED_GEMM_KERNEL must be 'wmma' (the default), 'wgmma' (the Hopper kernel) or "
                              "'wgmma-cluster' (the Hopper kernel in clusters of two CTAs; neither run on a GPU yet), got '" +
                              s + "'");
}

bool gemm_sm90_built() {
#if defined(MPFUSED_HAVE_SM90A)
  return true;
#else
  return false;
#endif
}

bool gemm_sm90_selected(bool vector_path, int device) {
  // The setting first: a value that is neither kernel is an error on every build and GPU.
  if (gemm_kernel_choice() == GemmKernelChoice::kWmma || !vector_path || !gemm_sm90_built()) return false;
  int major = 0, minor = 0;
  cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "gemm: device query");
  cuda_check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "gemm: device query");
  return major == 9 && minor == 0;  // sm_90a code runs on compute capability 9.0 only
}

GemmLaunch gemm_last_launch() { return last_launch; }
void gemm_clear_last_launch() { last_launch = GemmLaunch{}; }

void gemm_cuda(const GemmArgs& args, void* stream_ptr) {
  last_launch = GemmLaunch{};
  if (args.batch <= 0 || args.m <= 0 || args.n <= 0) return;
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  int device = 0;
  cuda_check(cudaGetDevice(&device), "gemm: cudaGetDevice");
  const std::string unsupported = gemm_unsupported(args.a.dtype, device);
  if (!unsupported.empty()) throw std::runtime_error(unsupported);
  int max_grid_y = 0;
  cuda_check(cudaDeviceGetAttribute(&max_grid_y, cudaDevAttrMaxGridDimY, device), "gemm: device query");
  const GemmPlan plan = plan_gemm(args.batch, args.m, args.n, args.a, args.b, max_grid_y);
  if (plan.blocks > 0x7fffffff) throw std::runtime_error("mpfused.gemm: the output has more than 2^31 - 1 tiles");
  const int64_t out_elems = 16 / dtype_size(args.out_dtype);
  const bool out_vector = args.n % out_elems == 0 && reinterpret_cast<uintptr_t>(args.out) % 16 == 0 &&
                          (!args.pre_activation || reinterpret_cast<uintptr_t>(args.pre_activation) % 16 == 0);
  const KernelParams kp{args, plan.tiles_m, plan.tiles_n, out_vector};
  const bool bf16 = args.a.dtype == DType::kBFloat16;
  if (gemm_sm90_selected(plan.vector_path, device)) {
    // Where it cannot take the operands (K = 0, a tensor map the driver refuses), the WMMA kernel runs.
    // In clusters only where there are two tile rows to pair: with one, the second CTA would only repeat the first's
    // MMAs.
    const bool pairs = gemm_kernel_choice() == GemmKernelChoice::kWgmmaCluster && args.m > 128;  // kSm90BlockM
    const auto unclustered = [&] {
      return bf16 ? dispatch_layout_sm90<__nv_bfloat16, 1>(kp, device, stream) : dispatch_layout_sm90<__half, 1>(kp, device, stream);
    };
    const Sm90Outcome out = pairs ? (bf16 ? dispatch_layout_sm90<__nv_bfloat16, 2>(kp, device, stream)
                                          : dispatch_layout_sm90<__half, 2>(kp, device, stream))
                                  : unclustered();
    if (!out.why) {
      last_launch = {true, pairs ? GemmKernelChoice::kWgmmaCluster : GemmKernelChoice::kWgmma, nullptr, false};
      return;
    }
    // No cluster of two fits (a device or partition with too few free SMs in a GPC): the Hopper kernel without
    // clusters, which gives the same results; the record keeps why the clusters were passed over.
    if (out.no_cluster && !unclustered().why) {
      last_launch = {true, GemmKernelChoice::kWgmma, out.why, out.unexpected};
      return;
    }
    last_launch.passed_over = out.why;
    last_launch.unexpected = out.unexpected;
  }
  if (bf16) dispatch_layout<__nv_bfloat16>(kp, plan, stream);
  else dispatch_layout<__half>(kp, plan, stream);
  last_launch.launched = true;
  last_launch.kernel = GemmKernelChoice::kWmma;
}

}  // namespace mpf
