// The GEMM's host-side plan (core/gemm.h) and the CPU backend (cpu/gemm.cpp), without torch: every
// output tile is visited exactly once by the block walk, the plan's sizes and vector-path decision,
// gemm_epilogue_cpu against a scalar loop over core/gemm.h for every activation, C and bias dtype and
// layout, output dtype, thread count, and in place, and the operand widening for both layouts.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "check.h"
#include "kernels.h"

using namespace mpf;

namespace {

// ---- the launch plan -----------------------------------------------------------------------------------
void check_tile_walk(int64_t tiles_m, int64_t tiles_n) {
  std::vector<int> seen(static_cast<size_t>(tiles_m * tiles_n), 0);
  bool in_range = true;
  for (int64_t block = 0; block < tiles_m * tiles_n; ++block) {
    int64_t tm = -1, tn = -1;
    gemm_tile_of_block(block, tiles_m, tiles_n, &tm, &tn);
    if (tm < 0 || tm >= tiles_m || tn < 0 || tn >= tiles_n) {
      in_range = false;
      continue;
    }
    ++seen[static_cast<size_t>(tm * tiles_n + tn)];
    // Blocks go kGemmGroupM tile rows at a time: block b lies in group b / (kGemmGroupM * tiles_n).
    const int64_t group = block / (kGemmGroupM * tiles_n);
    CHECK(tm / kGemmGroupM == group, "tiles %lldx%lld: block %lld in tile row %lld, not in group %lld",
          (long long)tiles_m, (long long)tiles_n, (long long)block, (long long)tm, (long long)group);
  }
  CHECK(in_range, "tiles %lldx%lld: a block maps outside the grid", (long long)tiles_m, (long long)tiles_n);
  int64_t once = 0;
  for (int v : seen) once += v == 1;
  CHECK(once == tiles_m * tiles_n, "tiles %lldx%lld: %lld of %lld tiles visited exactly once", (long long)tiles_m,
        (long long)tiles_n, (long long)once, (long long)(tiles_m * tiles_n));
}

MatrixRef ref_at(uintptr_t address, int64_t ld, int64_t batch_stride, DType d) {
  return MatrixRef{reinterpret_cast<const void*>(address), ld, batch_stride, false, d};
}

void test_plan() {
  for (int64_t tm = 1; tm <= 3 * kGemmGroupM + 3; ++tm)
    for (int64_t tn = 1; tn <= 13; ++tn) check_tile_walk(tm, tn);
  check_tile_walk(64, 64);    // 8192^2 outputs in 128^2 tiles
  check_tile_walk(86, 32);    // 11008 x 4096: 86 tile rows, not a multiple of kGemmGroupM
  check_tile_walk(1, 1000);

  const uintptr_t aligned = 4096;
  const MatrixRef a = ref_at(aligned, 64, 64 * 64, DType::kFloat16);
  GemmPlan p = plan_gemm(3, 300, 129, a, a);
  CHECK(p.tiles_m == 3 && p.tiles_n == 2 && p.blocks == 6 && p.grid_y == 3 && p.vector_path,
        "plan(3, 300, 129): %lld x %lld tiles, %lld blocks, grid_y %lld", (long long)p.tiles_m, (long long)p.tiles_n,
        (long long)p.blocks, (long long)p.grid_y);
  p = plan_gemm(1, 128, 128, a, a);
  CHECK(p.tiles_m == 1 && p.tiles_n == 1 && p.blocks == 1, "plan(1, 128, 128)");
  p = plan_gemm(70000, 1, 1, a, a);
  CHECK(p.grid_y == 65535, "grid_y must be capped at 65535, got %lld", (long long)p.grid_y);
  p = plan_gemm(65535, 1, 1, a, a);
  CHECK(p.grid_y == 65535, "grid_y for 65535 batches");

  struct Case {
    MatrixRef m;
    int64_t batch;
    bool aligned;
    const char* what;
  };
  const Case cases[] = {
      {ref_at(aligned, 64, 4096, DType::kFloat16), 4, true, "aligned FP16"},
      {ref_at(aligned, 8, 0, DType::kBFloat16), 4, true, "ld 8, shared by every batch"},
      {ref_at(aligned + 2, 64, 4096, DType::kFloat16), 1, false, "pointer 2 bytes off"},
      {ref_at(aligned + 16, 64, 4096, DType::kFloat16), 1, true, "pointer 16 bytes on"},
      {ref_at(aligned, 63, 63 * 64, DType::kFloat16), 1, false, "odd ld"},
      {ref_at(aligned, 12, 4096, DType::kBFloat16), 1, false, "ld 12 (24 bytes)"},
      {ref_at(aligned, 64, 4100, DType::kFloat16), 2, false, "batch stride not a multiple of 8"},
      {ref_at(aligned, 64, 4100, DType::kFloat16), 1, true, "batch stride unused with one batch"},
      {ref_at(aligned, 4, 12, DType::kFloat32), 3, true, "FP32: 4 elements per vector"},
      {ref_at(aligned, 6, 12, DType::kFloat32), 3, false, "FP32 ld 6"},
  };
  for (const Case& c : cases)
    CHECK(operand_vector_aligned(c.m, c.batch) == c.aligned, "operand_vector_aligned: %s", c.what);
  const MatrixRef odd = ref_at(aligned, 63, 0, DType::kFloat16);
  CHECK(!plan_gemm(1, 64, 64, a, odd).vector_path && !plan_gemm(1, 64, 64, odd, a).vector_path,
        "one unaligned operand must take the element-wise path");
}

// ---- the CPU epilogue ----------------------------------------------------------------------------------
struct Buffer {
  DType dtype;
  std::vector<float> f32;
  std::vector<uint16_t> u16;
  Buffer(DType d, int64_t n) : dtype(d) {
    if (d == DType::kFloat32) f32.assign(static_cast<size_t>(n), 0.f);
    else u16.assign(static_cast<size_t>(n), 0);
  }
  void* data() { return dtype == DType::kFloat32 ? static_cast<void*>(f32.data()) : u16.data(); }
  float get(int64_t i) const { return load_any(data_const(), i, dtype); }
  const void* data_const() const {
    return dtype == DType::kFloat32 ? static_cast<const void*>(f32.data()) : u16.data();
  }
  uint32_t bits(int64_t i) const {
    return dtype == DType::kFloat32 ? float_as_bits(f32[static_cast<size_t>(i)]) : u16[static_cast<size_t>(i)];
  }
};

Buffer random_buffer(DType d, int64_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> dist(0.f, scale);
  Buffer b(d, n);
  for (int64_t i = 0; i < n; ++i) store_any(b.data(), i, d, dist(rng));
  return b;
}

bool same(const Buffer& x, const Buffer& y, int64_t i) {
  const float a = x.get(i), b = y.get(i);
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return x.bits(i) == y.bits(i);
}

struct EpilogueCase {
  Activation act;
  int c_mode;  // 0 none, 1 row-major per batch, 2 col-major shared by every batch
  DType c_dtype;
  int bias_mode;  // 0 none, else the bias dtype is bias_dtype
  DType bias_dtype;
  DType out_dtype;
  bool pre;
  float alpha, beta;
};

void test_epilogue_case(const EpilogueCase& e, std::mt19937& rng) {
  const int64_t batch = 2, m = 5, n = 1500;  // n spans more than one 1024-column segment
  const int64_t total = batch * m * n;
  std::vector<float> acc = random_buffer(DType::kFloat32, total, rng, 3.f).f32;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  acc[3] = nan;
  acc[4] = inf;
  acc[5] = -inf;
  acc[6] = -0.0f;
  acc[7] = 1e6f;  // past FP16's range
  acc[n + 1] = -3e38f;
  Buffer c_buf = random_buffer(e.c_dtype, e.c_mode == 1 ? total : m * n, rng, 2.f);
  MatrixRef c{nullptr, 0, 0, false, e.c_dtype};
  if (e.c_mode == 1) c = MatrixRef{c_buf.data(), n, m * n, false, e.c_dtype};
  if (e.c_mode == 2) c = MatrixRef{c_buf.data(), m, 0, true, e.c_dtype};
  if (e.c_mode != 0 && e.beta == 0.f)
    for (int64_t i = 0; i < (e.c_mode == 1 ? total : m * n); ++i) store_any(c_buf.data(), i, e.c_dtype, nan);
  Buffer bias = random_buffer(e.bias_dtype, n, rng, 1.f);

  GemmArgs g{};
  g.batch = batch;
  g.m = m;
  g.n = n;
  g.k = 7;
  g.c = c;
  g.bias = e.bias_mode ? bias.data() : nullptr;
  g.bias_dtype = e.bias_dtype;
  g.alpha = e.alpha;
  g.beta = e.beta;
  g.activation = e.act;
  g.out_dtype = e.out_dtype;

  // The scalar reference: core/gemm.h element by element.
  const EpilogueScalars s = epilogue_scalars(g);
  Buffer want_out(e.out_dtype, total), want_pre(e.out_dtype, total);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        const int64_t at = (b * m + i) * n + j;
        const float cv = s.has_c ? load_any(c.data, matrix_offset(c, b, i, j), c.dtype) : 0.f;
        const float bv = s.has_bias ? load_any(g.bias, j, g.bias_dtype) : 0.f;
        const float pre = epilogue_pre(acc[static_cast<size_t>(at)], cv, bv, s);
        store_any(want_pre.data(), at, e.out_dtype, pre);
        store_any(want_out.data(), at, e.out_dtype, activate(pre, e.act));
      }

  for (int threads : {1, 2}) {
    Buffer out(e.out_dtype, total), pre(e.out_dtype, total);
    g.out = out.data();
    g.pre_activation = e.pre ? pre.data() : nullptr;
    gemm_epilogue_cpu(acc.data(), g, threads);
    int64_t bad_out = 0, bad_pre = 0, first = -1;
    for (int64_t i = 0; i < total; ++i) {
      if (!same(out, want_out, i)) {
        ++bad_out;
        if (first < 0) first = i;
      }
      if (e.pre && !same(pre, want_pre, i)) ++bad_pre;
    }
    CHECK(bad_out == 0 && bad_pre == 0,
          "act %d c_mode %d c %s bias %d %s out %s alpha %g beta %g threads %d: %lld out, %lld pre differ (first %lld: "
          "%g vs %g)",
          static_cast<int>(e.act), e.c_mode, dtype_name(e.c_dtype), e.bias_mode, dtype_name(e.bias_dtype),
          dtype_name(e.out_dtype), e.alpha, e.beta, threads, (long long)bad_out, (long long)bad_pre, (long long)first,
          first >= 0 ? out.get(first) : 0.0, first >= 0 ? want_out.get(first) : 0.0);
  }

  // FP32 out in place of the accumulator
  if (e.out_dtype == DType::kFloat32 && !e.pre) {
    std::vector<float> in_place = acc;
    g.out = in_place.data();
    g.pre_activation = nullptr;
    gemm_epilogue_cpu(in_place.data(), g, 2);
    int64_t bad = 0;
    for (int64_t i = 0; i < total; ++i) {
      const float a = in_place[static_cast<size_t>(i)], w = want_out.f32[static_cast<size_t>(i)];
      bad += !(std::isnan(a) ? std::isnan(w) : float_as_bits(a) == float_as_bits(w));
    }
    CHECK(bad == 0, "in place: %lld elements differ (act %d)", (long long)bad, static_cast<int>(e.act));
  }
}

void test_epilogue() {
  std::mt19937 rng(11);
  const DType dtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  const Activation acts[] = {Activation::kNone, Activation::kRelu, Activation::kGelu, Activation::kGeluErf};
  int i = 0;
  for (Activation act : acts)
    for (DType out : dtypes)
      for (int c_mode = 0; c_mode < 3; ++c_mode)
        for (DType c_dtype : dtypes)
          for (DType bias_dtype : dtypes) {
            if (c_mode == 0 && c_dtype != DType::kFloat32) continue;
            ++i;
            // Rotate the rest: bias present or not, pre-activation written or not, the scalars
            const float alphas[] = {1.f, 0.37f, -2.f};
            const float betas[] = {1.f, -0.61f, 0.f};  // beta 0 with a NaN-filled C: C is not read
            test_epilogue_case(EpilogueCase{act, c_mode, c_dtype, i % 4 != 0, bias_dtype, out, i % 3 == 0,
                                            alphas[i % 3], betas[(i / 3) % 3]},
                               rng);
          }
  // Empty problems write nothing (and must not touch out)
  GemmArgs g{};
  g.batch = 1;
  g.m = 0;
  g.n = 4;
  g.out_dtype = DType::kFloat32;
  gemm_epilogue_cpu(nullptr, g, 2);
  CHECK(true, "an empty epilogue returns without touching memory");
}

// widen_operand_cpu: every element of a strided operand lands, exactly widened, at its place in the
// dense FP32 copy, for both orientations, a batch stride and a shared (batch stride 0) operand.
void test_widen() {
  std::mt19937 rng(5);
  for (DType d : {DType::kFloat16, DType::kBFloat16, DType::kFloat32})
    for (bool col_major : {false, true})
      for (int64_t batch_stride_mode : {0, 1}) {
        const int64_t batch = 3, rows = 37, cols = 1100, ld = (col_major ? rows : cols) + 5;
        const int64_t lines = col_major ? cols : rows;
        const int64_t bstride = batch_stride_mode ? ld * lines + 3 : 0;
        Buffer src = random_buffer(d, bstride * (batch - 1) + ld * lines + 1, rng, 5.f);
        const MatrixRef m{src.data(), ld, bstride, col_major, d};
        for (int threads : {1, 2}) {
          std::vector<float> dst(static_cast<size_t>(batch * rows * cols), -1.f);
          widen_operand_cpu(m, batch, rows, cols, dst.data(), threads);
          int64_t bad = 0;
          for (int64_t b = 0; b < batch; ++b)
            for (int64_t r = 0; r < rows; ++r)
              for (int64_t c = 0; c < cols; ++c) {
                const int64_t at = b * rows * cols + (col_major ? c * rows + r : r * cols + c);
                const float want = src.get(matrix_offset(m, b, r, c));
                bad += float_as_bits(dst[static_cast<size_t>(at)]) != float_as_bits(want);
              }
          CHECK(bad == 0, "widen %s col_major %d batch_stride %lld threads %d: %lld elements wrong", dtype_name(d),
                col_major, (long long)bstride, threads, (long long)bad);
        }
      }
}

}  // namespace

int main() {
  test_plan();
  test_epilogue();
  test_widen();
  return native_test::finish("test_gemm");
}
