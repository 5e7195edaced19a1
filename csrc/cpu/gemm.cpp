// CPU backend of the GEMM around its FP32 product: the exact widening of the FP16/BF16 operands, and
// the epilogue. The product itself is an FP32 GEMM of the widened operands (bindings.cpp uses ATen's,
// as the issue allows: FP32 accumulation of exact products); from the FP32 accumulator on, this runs
// core/gemm.h's epilogue, the same math as the CUDA kernel, in parallel over row segments.
#include <algorithm>
#include <cstring>
#include <vector>

#include "../kernels.h"
#include "isa.h"

namespace mpf {
namespace {

#define MPF_CPU_IMPL_FILE "gemm_impl.inc"
#include "isa_clones.inc"

constexpr int64_t kGrain = int64_t{1} << 15;  // output elements per thread before another one is worth it

// Nothing to do: FP32 out in place of the accumulator, and out = 1 * acc exactly.
bool identity_in_place(const float* acc, const GemmArgs& g) {
  const EpilogueScalars s = epilogue_scalars(g);
  return g.out == static_cast<const void*>(acc) && g.out_dtype == DType::kFloat32 && g.pre_activation == nullptr &&
         s.alpha == 1.0f && !s.has_c && !s.has_bias && s.act == Activation::kNone;
}

}  // namespace

void gemm_epilogue_cpu(const float* acc, const GemmArgs& g, int num_threads) {
  if (g.batch <= 0 || g.m <= 0 || g.n <= 0 || identity_in_place(acc, g)) return;
  // The bias widened once, rather than once per row.
  std::vector<float> widened;
  const float* bias = nullptr;
  if (g.bias != nullptr) {
    if (g.bias_dtype == DType::kFloat32) {
      bias = static_cast<const float*>(g.bias);
    } else {
      widened.resize(static_cast<size_t>(g.n));
      for (int64_t j = 0; j < g.n; ++j) widened[j] = load_any(g.bias, j, g.bias_dtype);
      bias = widened.data();
    }
  }
  const int64_t total = g.batch * g.m * g.n;
  const int threads = cpu_threads(num_threads, total, kGrain);
  MPF_CPU_DISPATCH(run(acc, g, bias, threads));
}

void widen_operand_cpu(const MatrixRef& src, int64_t batch, int64_t rows, int64_t cols, float* dst, int num_threads) {
  if (batch <= 0 || rows <= 0 || cols <= 0) return;
  // Lines along the contiguous dimension: rows of a row-major operand, columns of a col-major one.
  const int64_t lines = src.col_major ? cols : rows;
  const int64_t len = src.col_major ? rows : cols;
  const int64_t total = batch * rows * cols;
  const int threads = cpu_threads(num_threads, total, kGrain);
  MPF_CPU_DISPATCH(widen(src, batch, lines, len, dst, threads));
}

}  // namespace mpf
