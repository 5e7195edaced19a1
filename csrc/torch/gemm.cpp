// torch.ops.mpfused.gemm and gemm_with_pre: act(alpha * a @ b + beta * c + bias) from FP16/BF16 operands
// with FP32 accumulation and a fused epilogue (csrc/core/gemm.h); the CUDA kernel is a WMMA tensor-core
// GEMM, the CPU path widens exactly and uses ATen's FP32 GEMM. Every argument is checked before anything
// is allocated or launched. Autograd and fake kernels: mpfused/_ops.py.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <tuple>

#include "common.h"

namespace mpf_torch {
namespace {

// None or a name (the Activation codes are the kernel ABI, core/gemm.h).
mpf::Activation parse_activation(const std::optional<c10::string_view>& act) {
  if (!act) return mpf::Activation::kNone;
  const std::string s(*act);
  if (s == "relu") return mpf::Activation::kRelu;
  if (s == "gelu") return mpf::Activation::kGelu;
  if (s == "gelu_erf") return mpf::Activation::kGeluErf;
  fail("activation must be None, 'relu', 'gelu' (tanh approximation) or 'gelu_erf', got '" + s + "'");
}

// a or b: an FP16/BF16 matrix, or a batch of them.
void check_operand(const at::Tensor& t, const std::string& name) {
  check_dense(t, name);
  if (t.scalar_type() != at::kHalf && t.scalar_type() != at::kBFloat16)
    fail(name + " must be a float16 or bfloat16 tensor (the GEMM multiplies FP16/BF16 values with FP32 "
         "accumulation; convert float32 inputs with .half() or .bfloat16()), got a " + describe(t));
  if (t.dim() != 2 && t.dim() != 3)
    fail(name + " must be 2-D (rows, cols) or 3-D (batch, rows, cols), got a " + std::to_string(t.dim()) + "-D " +
         describe(t));
}

// How the kernels read the last two dims of t without a copy: row-major when the last dim has stride 1
// (ld = the row stride), col-major (a transposed view) when the second-to-last has (ld = the column
// stride). A dim of size 1 has an arbitrary stride in torch, so it never rules a layout out; its ld is
// then never used to address memory and is chosen as the other dim's size rounded up to 16 bytes,
// which keeps the kernel's vector path open. A single column (rows > 1) is read col-major when it
// can be, along its contiguous dim. Returns false when neither layout fits (e.g. t[:, ::2]).
bool matrix_layout(const at::Tensor& t, bool* col_major, int64_t* ld) {
  const int64_t rows = t.size(-2), cols = t.size(-1);
  const int64_t elems = 16 / static_cast<int64_t>(t.element_size());
  const auto padded = [elems](int64_t x) { return (std::max<int64_t>(x, 1) + elems - 1) / elems * elems; };
  const bool row_ok = cols == 1 || t.stride(-1) == 1;
  const bool col_ok = rows == 1 || t.stride(-2) == 1;
  if (row_ok && !(col_ok && cols == 1 && rows > 1)) {
    *col_major = false;
    *ld = rows > 1 ? t.stride(-2) : padded(cols);
    return true;
  }
  if (col_ok) {
    *col_major = true;
    *ld = cols > 1 ? t.stride(-1) : padded(rows);
    return true;
  }
  return false;
}

// A matrix operand as the kernels read it. `storage` is t itself, or its contiguous copy when neither
// layout fits; a 2-D operand of a batched product is shared by every batch (batch_stride 0).
struct Matrix {
  at::Tensor storage;
  mpf::MatrixRef ref;
};

Matrix matrix_of(const at::Tensor& t, int64_t batch, DType dtype) {
  Matrix m{t, {}};
  bool col_major = false;
  int64_t ld = 0;
  if (!matrix_layout(t, &col_major, &ld)) {
    m.storage = t.contiguous();
    matrix_layout(m.storage, &col_major, &ld);
  }
  const int64_t batch_stride = m.storage.dim() == 3 && batch > 1 ? m.storage.stride(0) : 0;
  m.ref = mpf::MatrixRef{m.storage.data_ptr(), ld, batch_stride, col_major, dtype};
  return m;
}

// CPU: the exact FP32 copy of a or b for ATen's FP32 GEMM, in the operand's own orientation: a
// transposed view stays one, and reaches the BLAS as a transposed operand.
at::Tensor widened(const at::Tensor& t, DType dtype) {
  const int64_t batch = t.dim() == 3 ? t.size(0) : 1;
  const int64_t rows = t.size(-2), cols = t.size(-1);
  const Matrix m = matrix_of(t, batch, dtype);
  const std::vector<int64_t> shape = m.ref.col_major ? std::vector<int64_t>{batch, cols, rows}
                                                     : std::vector<int64_t>{batch, rows, cols};
  at::Tensor w = at::empty(shape, t.options().dtype(at::kFloat));
  mpf::widen_operand_cpu(m.ref, batch, rows, cols, w.data_ptr<float>(), at::get_num_threads());
  if (m.ref.col_major) w = w.transpose(1, 2);
  return t.dim() == 3 ? w : w.select(0, 0);
}

float finite_float(double v, const char* name) {
  const float f = static_cast<float>(v);
  if (!std::isfinite(f)) {
    std::ostringstream s;
    s << name << " must be a finite number in float32 range, got " << v;
    fail(s.str());
  }
  return f;
}

// out = act(alpha * a @ b + beta * c + bias), a new tensor; with return_pre_activation and an activation
// also the value before the activation (else an undefined tensor). See mpfused.functional.gemm.
std::tuple<at::Tensor, at::Tensor> gemm_impl(const at::Tensor& a, const at::Tensor& b,
                                             const std::optional<at::Tensor>& bias,
                                             const std::optional<c10::string_view>& activation, double alpha,
                                             double beta, const std::optional<at::Tensor>& c,
                                             std::optional<at::ScalarType> out_dtype, bool return_pre_activation) {
  // ---- validate everything first ----
  check_operand(a, "a");
  check_operand(b, "b");
  if (b.scalar_type() != a.scalar_type())
    fail("b must have a's dtype " + std::string(c10::toString(a.scalar_type())) + ", got a " + describe(b));
  const at::Device device = a.device();
  if (b.device() != device)
    fail("b is on " + b.device().str() + " but a is on " + device.str() + "; both operands must be on one device");
  check_backend(device, "a");
  const int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  if (b.size(-2) != k)
    fail("b must have " + std::to_string(k) + " rows, the inner dim of a " + describe(a) + ", got a " + describe(b));
  const bool batched = a.dim() == 3 || b.dim() == 3;
  const int64_t batch = a.dim() == 3 ? a.size(0) : b.dim() == 3 ? b.size(0) : 1;
  if (a.dim() == 3 && b.dim() == 3 && b.size(0) != batch)
    fail("b must have a's batch size " + std::to_string(batch) + ", got a " + describe(b) +
         " (a 2-D b is shared by every batch of a; so is an expanded b, e.g. b.expand(" + std::to_string(batch) +
         ", -1, -1))");
  std::vector<int64_t> shape = batched ? std::vector<int64_t>{batch, m, n} : std::vector<int64_t>{m, n};
  const std::string shape_str = c10::str(at::IntArrayRef(shape));

  DType bias_dtype = DType::kFloat32;
  if (bias) {
    check_dense(*bias, "bias");
    bias_dtype = storage_dtype(*bias, "bias");
    if (bias->dim() != 1 || bias->size(0) != n)
      fail("bias must be 1-D with " + std::to_string(n) + " elements (the output's columns), got a " + describe(*bias));
    if (bias->device() != device) fail("bias must be on " + device.str() + " like a and b, got a " + describe(*bias));
  }
  DType c_dtype = DType::kFloat32;
  if (c) {
    check_dense(*c, "c");
    c_dtype = storage_dtype(*c, "c");
    const bool c_ok = (c->dim() == 2 && c->size(0) == m && c->size(1) == n) ||
                      (c->dim() == 3 && batched && c->size(0) == batch && c->size(1) == m && c->size(2) == n);
    if (!c_ok)
      fail("c must have the output's shape " + shape_str + (batched ? " or its last two dims (shared by every batch)" : "") +
           ", got a " + describe(*c));
    if (c->device() != device) fail("c must be on " + device.str() + " like a and b, got a " + describe(*c));
  }
  const mpf::Activation act = parse_activation(activation);
  const at::ScalarType out_type = out_dtype ? *out_dtype : a.scalar_type();
  DType out_kernel_dtype;
  if (!kernel_dtype(out_type, &out_kernel_dtype))
    fail("out_dtype must be torch.float16, torch.bfloat16 or torch.float32, got " + std::string(c10::toString(out_type)));
  const float alpha_f = finite_float(alpha, "alpha");
  const float beta_f = finite_float(beta, "beta");
  if (beta_f != 0.0f && !c) fail("beta != 0 needs c, the matrix it scales; pass c, or leave beta at 0");

  // ---- run ----
  const at::TensorOptions out_options = a.options().dtype(out_type);
  const bool want_pre = return_pre_activation && act != mpf::Activation::kNone;
  if (batch == 0 || m == 0 || n == 0) {
#ifdef MPFUSED_WITH_CUDA
    if (device.is_cuda()) mpf::gemm_clear_last_launch();  // this call launched nothing
#endif
    at::Tensor out = at::empty(shape, out_options);
    return {out, want_pre ? at::empty(shape, out_options) : at::Tensor()};
  }
  // ATen ops below are implementation details: no autograd graph, and no autocast of the FP32 product.
  const at::NoGradGuard no_grad;
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);

  mpf::GemmArgs g{};
  g.batch = batch;
  g.m = m;
  g.n = n;
  g.k = k;
  g.alpha = alpha_f;
  g.beta = beta_f;
  g.activation = act;
  g.out_dtype = out_kernel_dtype;
  Matrix c_matrix;
  if (c && beta_f != 0.0f) {  // with beta == 0, c is not read (and not copied)
    c_matrix = matrix_of(*c, batch, c_dtype);
    g.c = c_matrix.ref;
  }
  at::Tensor bias_storage;
  if (bias) {
    bias_storage = bias->stride(0) == 1 ? *bias : bias->contiguous();
    g.bias = bias_storage.data_ptr();
    g.bias_dtype = bias_dtype;
  }
  at::Tensor pre = want_pre ? at::empty(shape, out_options) : at::Tensor();
  g.pre_activation = want_pre ? pre.data_ptr() : nullptr;

  at::Tensor out;
  if (device.is_cpu()) {
    // The exact FP32 widening of both operands (ours: vectorised, parallel), then ATen's FP32 GEMM
    // (FP32 accumulation).
    const DType in_dtype = storage_dtype(a, "a");
    at::Tensor acc = k == 0 ? at::zeros(shape, a.options().dtype(at::kFloat))
                            : at::matmul(widened(a, in_dtype), widened(b, in_dtype)).contiguous();
    out = out_type == at::kFloat ? acc : at::empty(shape, out_options);  // FP32: the epilogue runs in place
    g.out = out.data_ptr();
    mpf::gemm_epilogue_cpu(acc.data_ptr<float>(), g, at::get_num_threads());
  } else {
#ifdef MPFUSED_WITH_CUDA
    const c10::cuda::CUDAGuard guard(device);
    const DType in_dtype = storage_dtype(a, "a");
    const Matrix a_matrix = matrix_of(a, batch, in_dtype);
    const Matrix b_matrix = matrix_of(b, batch, in_dtype);
    g.a = a_matrix.ref;
    g.b = b_matrix.ref;
    out = at::empty(shape, out_options);
    g.out = out.data_ptr();
    mpf::gemm_cuda(g, c10::cuda::getCurrentCUDAStream(device.index()).stream());
    // MPFUSED_GEMM_KERNEL asked for the Hopper kernel (or its clusters) and the device or driver refused it: the WMMA
    // kernel (or the Hopper kernel without clusters) ran, with the same results, which a user measuring the Hopper
    // kernel must know. Once a process.
    if (const mpf::GemmLaunch l = mpf::gemm_last_launch(); l.unexpected) {
      const char* choice = std::getenv("MPFUSED_GEMM_KERNEL");
      TORCH_WARN_ONCE("MPFUSED_GEMM_KERNEL asks for the Hopper GEMM kernel (", choice ? choice : "", "), but it cannot ",
                      "run here: ", l.passed_over, ". The ",
                      l.kernel == mpf::GemmKernelChoice::kWgmma ? "Hopper kernel without clusters" : "WMMA kernel",
                      " runs instead (the same results); mpfused._C.gemm_last_cuda_launch() says which kernel the last "
                      "call took.");
    }
#endif
  }
  return {out, pre};
}

at::Tensor gemm(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                const std::optional<c10::string_view>& activation, double alpha, double beta,
                const std::optional<at::Tensor>& c, std::optional<at::ScalarType> out_dtype) {
  return std::get<0>(gemm_impl(a, b, bias, activation, alpha, beta, c, out_dtype, false));
}

// (out, pre): pre is the value before the activation, a tensor of its own (a copy of out when there is no
// activation: an operator's outputs never alias each other).
std::tuple<at::Tensor, at::Tensor> gemm_with_pre(const at::Tensor& a, const at::Tensor& b,
                                                 const std::optional<at::Tensor>& bias,
                                                 const std::optional<c10::string_view>& activation, double alpha,
                                                 double beta, const std::optional<at::Tensor>& c,
                                                 std::optional<at::ScalarType> out_dtype) {
  auto [out, pre] = gemm_impl(a, b, bias, activation, alpha, beta, c, out_dtype, true);
  if (!pre.defined()) pre = out.clone();
  return {out, pre};
}

}  // namespace
}  // namespace mpf_torch

using namespace mpf_torch;

TORCH_LIBRARY_FRAGMENT(mpfused, m) {
  m.def("gemm(Tensor a, Tensor b, Tensor? bias=None, str? activation=None, float alpha=1., float beta=0., "
        "Tensor? c=None, ScalarType? out_dtype=None) -> Tensor");
  m.def("gemm_with_pre(Tensor a, Tensor b, Tensor? bias=None, str? activation=None, float alpha=1., float beta=0., "
        "Tensor? c=None, ScalarType? out_dtype=None) -> (Tensor, Tensor)");
}
MPF_TORCH_IMPL_CPU_CUDA("gemm", &gemm)
MPF_TORCH_IMPL_CPU_CUDA("gemm_with_pre", &gemm_with_pre)
