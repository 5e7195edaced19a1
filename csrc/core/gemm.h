// The GEMM's epilogue math and its host-side launch plan, shared by the CPU and CUDA backends.
//
// out = act(alpha * (A @ B) + beta * C + bias), all in FP32, rounded once to the output dtype. The
// accumulator comes from FP32 accumulation of exactly widened FP16/BF16 products (tensor cores on CUDA,
// an FP32 GEMM on the CPU); from there on both backends run this same code, so an epilogue gives the
// same bits on both for the same accumulator, except through expf/erff (GELU), whose CUDA and glibc
// implementations may differ in the last ulp.
#pragma once

#include <cmath>
#include <cstdint>

#include "numeric.h"
#include "rounding.h"

namespace mpf {

// The numbering is part of the kernel ABI (kernels.h, bindings.cpp).
enum class Activation : int32_t { kNone = 0, kRelu = 1, kGelu = 2 /* tanh approximation */, kGeluErf = 3 };

MPF_HD float relu(float x) { return x < 0.0f ? 0.0f : x; }  // NaN stays NaN, like torch.relu

// torch.nn.functional.gelu(x, approximate="tanh"): 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3),
// computed as x / (1 + exp(-2u)), the same function: one expf instead of tanhf (about 5x cheaper in
// glibc), and no cancellation in 1 + tanh(u) for negative u. exp overflows to inf for u < -44: then
// x / inf = -0, the limit.
MPF_HD float gelu_tanh(float x) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  constexpr float kKappa = 0.044715f;
  const float x3 = fmul(fmul(x, x), x);
  const float inner = fmul(kSqrt2OverPi, fadd(x, fmul(kKappa, x3)));
  return fdiv(x, fadd(1.0f, expf(fmul(-2.0f, inner))));
}

// torch.nn.functional.gelu(x): 0.5 x (1 + erf(x / sqrt(2))).
MPF_HD float gelu_erf(float x) {
  constexpr float kInvSqrt2 = 0.7071067811865476f;
  return fmul(fmul(0.5f, x), fadd(1.0f, erff(fmul(x, kInvSqrt2))));
}

MPF_HD float activate(float x, Activation a) {
  switch (a) {
    case Activation::kRelu: return relu(x);
    case Activation::kGelu: return gelu_tanh(x);
    case Activation::kGeluErf: return gelu_erf(x);
    default: return x;
  }
}

// The scalars of one epilogue. has_c is false when beta == 0: then C is not read at all (torch's addmm
// ignores C, NaN and inf included, when beta is 0).
struct EpilogueScalars {
  float alpha;
  float beta;
  bool has_c;
  bool has_bias;
  Activation act;
};

// The value before the activation: alpha * acc + beta * c + bias, each operation rounded once.
MPF_HD float epilogue_pre(float acc, float c, float bias, const EpilogueScalars& s) {
  float y = fmul(s.alpha, acc);
  if (s.has_c) y = fadd(y, fmul(s.beta, c));
  if (s.has_bias) y = fadd(y, bias);
  return y;
}

// Load one element of any storage dtype (epilogue operands C and bias may be FP32, FP16 or BF16).
MPF_HD float load_any(const void* p, int64_t i, DType d) {
  switch (d) {
    case DType::kFloat16: return f16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kBFloat16: return bf16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

MPF_HD void store_any(void* p, int64_t i, DType d, float v) {
  switch (d) {
    case DType::kFloat16: static_cast<uint16_t*>(p)[i] = float_to_f16_bits(v); break;
    case DType::kBFloat16: static_cast<uint16_t*>(p)[i] = float_to_bf16_bits(v); break;
    default: static_cast<float*>(p)[i] = v;
  }
}

// ---- operands ---------------------------------------------------------------------------------------
// A matrix operand: element (r, c) of batch b is at data[b * batch_stride + (col_major ? c * ld + r :
// r * ld + c)]. A transposed view of a row-major matrix is a col_major operand, used without a copy.
struct MatrixRef {
  const void* data;
  int64_t ld;            // elements between consecutive rows (row-major) or columns (col-major)
  int64_t batch_stride;  // elements between consecutive batches; 0 = one matrix shared by all batches
  bool col_major;
  DType dtype;
};

MPF_HD int64_t matrix_offset(const MatrixRef& m, int64_t b, int64_t r, int64_t c) {
  return b * m.batch_stride + (m.col_major ? c * m.ld + r : r * m.ld + c);
}

// True when every 16-byte vector along the operand's contiguous dimension starts 16-byte aligned, so
// the kernel may use 128-bit loads (and cp.async) of 8 FP16/BF16 elements; false takes the slower
// element-wise path. `batch` matters only when there is more than one batch.
inline bool operand_vector_aligned(const MatrixRef& m, int64_t batch) {
  const int64_t elems = 16 / dtype_size(m.dtype);
  const bool ptr_ok = reinterpret_cast<uintptr_t>(m.data) % 16 == 0;
  const bool ld_ok = m.ld % elems == 0;
  const bool batch_ok = batch <= 1 || m.batch_stride % elems == 0;
  return ptr_ok && ld_ok && batch_ok;
}

// ---- the CUDA launch plan, plain host code so that it is unit-tested without a GPU --------------
// Block tiles of kGemmBlockM x kGemmBlockN outputs, kGemmBlockK deep per pipeline stage, walked in
// groups of kGemmGroupM tile rows so that consecutive blocks share A and B tiles in L2.
constexpr int kGemmBlockM = 128;
constexpr int kGemmBlockN = 128;
constexpr int kGemmBlockK = 32;
constexpr int kGemmGroupM = 8;

struct GemmPlan {
  int64_t tiles_m;
  int64_t tiles_n;
  int64_t blocks;       // tiles_m * tiles_n: the grid's x dimension (batches go to y, then loop)
  int64_t grid_y;       // min(batch, max_grid_y); blocks loop over the remaining batches
  bool vector_path;     // both operands vector-aligned: 128-bit loads (cp.async on sm_80+)
};

// max_grid_y: the device's limit on grid.y (65535 on every GPU so far; the launcher asks the device).
inline GemmPlan plan_gemm(int64_t batch, int64_t m, int64_t n, const MatrixRef& a, const MatrixRef& b,
                          int64_t max_grid_y = 65535) {
  GemmPlan p{};
  p.tiles_m = (m + kGemmBlockM - 1) / kGemmBlockM;
  p.tiles_n = (n + kGemmBlockN - 1) / kGemmBlockN;
  p.blocks = p.tiles_m * p.tiles_n;
  p.grid_y = batch < max_grid_y ? batch : max_grid_y;
  p.vector_path = operand_vector_aligned(a, batch) && operand_vector_aligned(b, batch);
  return p;
}

// Block `block` of the plan -> its (tile_m, tile_n): tile rows are taken kGemmGroupM at a time, the
// tiles of one group column-major, so that a wave of blocks covers a compact square of the output.
MPF_HD void gemm_tile_of_block(int64_t block, int64_t tiles_m, int64_t tiles_n, int64_t* tile_m, int64_t* tile_n) {
  const int64_t per_group = static_cast<int64_t>(kGemmGroupM) * tiles_n;
  const int64_t group = block / per_group;
  const int64_t first_m = group * kGemmGroupM;
  const int64_t rows = tiles_m - first_m < kGemmGroupM ? tiles_m - first_m : kGemmGroupM;
  const int64_t in_group = block - group * per_group;
  *tile_m = first_m + in_group % rows;
  *tile_n = in_group / rows;
}

}  // namespace mpf
