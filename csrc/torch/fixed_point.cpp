// torch.ops.mpfused.fixed_point_quantize, fixed_point_quantize_out_ and fixed_point_matmul: fixed point
// <IL, FL> Convert (quantize/encode, into a new tensor or into out) and the MACC (matmul),
// csrc/core/fixed_point.h. Every argument is checked before anything is allocated, written or launched;
// then the CPU or CUDA backend runs.
#include <ATen/Parallel.h>

#include <algorithm>

#include "common.h"

namespace mpf_torch {
namespace {

using mpf::FixedType;

mpf::FixedFormat fixed_format(int64_t il, int64_t fl, const std::string& name) {
  if (il < 1 || fl < 0 || il > mpf::kFixedMaxWordLength || fl > mpf::kFixedMaxWordLength ||
      il + fl > mpf::kFixedMaxWordLength)  // each bounded first: il + fl of two huge ints would overflow
    fail(name + " must have il >= 1, fl >= 0 and il + fl <= 32, got il=" + std::to_string(il) + ", fl=" +
         std::to_string(fl));
  return mpf::FixedFormat{static_cast<int32_t>(il), static_cast<int32_t>(fl)};
}

mpf::Rounding rounding_of(bool stochastic) { return stochastic ? mpf::Rounding::kStochastic : mpf::Rounding::kNearest; }

// offset + numel <= 2^64: the element indices of one stream.
void check_offset(uint64_t offset, int64_t numel) {
  if (numel > 0 && offset > UINT64_MAX - static_cast<uint64_t>(numel - 1))  // the last index fits
    fail("offset + numel must be at most 2^64 (the element indices of one stream), got offset " +
         std::to_string(offset) + " with " + std::to_string(numel) + " elements");
}

bool code_type(at::ScalarType s, FixedType* t) {
  if (s == at::kShort) *t = FixedType::kInt16;
  else if (s == at::kInt) *t = FixedType::kInt32;
  else return false;
  return true;
}

int code_bits(FixedType t) { return t == FixedType::kInt16 ? 16 : 32; }

// Convert(x, <il, fl>) into `out` when given (its dtype is the output's), else into a new tensor of dtype
// out_dtype: int16/int32 codes, or float32/float64 values. `what` names the output's dtype in messages.
at::Tensor quantize_impl(const at::Tensor& x, int64_t il, int64_t fl, bool stochastic, int64_t seed_bits,
                         int64_t offset_bits, at::ScalarType out_dtype, const std::optional<at::Tensor>& out,
                         const std::string& what) {
  const uint64_t seed = u64_of(seed_bits), offset = u64_of(offset_bits);
  check_dense(x, "x");
  check_backend(x.device(), "x");
  FixedType src_type;
  switch (x.scalar_type()) {
    case at::kFloat: src_type = FixedType::kFloat32; break;
    case at::kDouble: src_type = FixedType::kFloat64; break;
    case at::kHalf: src_type = FixedType::kFloat16; break;
    case at::kBFloat16: src_type = FixedType::kBFloat16; break;
    default: fail("x must be a float32, float64, float16 or bfloat16 tensor, got a " + describe(x));
  }
  const mpf::FixedFormat fmt = fixed_format(il, fl, "the format");
  const int wl = mpf::fixed_wl(fmt);
  FixedType dst_type;
  if (code_type(out_dtype, &dst_type)) {
    if (wl > code_bits(dst_type))
      fail(what + " torch.int" + std::to_string(code_bits(dst_type)) + " cannot hold codes of " +
           std::to_string(wl) + " bits; use torch.int32");
  } else if (out_dtype == at::kFloat) {
    if (wl > 24)
      fail(what + " float32 cannot hold the values of a format with il + fl = " + std::to_string(wl) +
           " > 24 exactly; use torch.float64");
    dst_type = FixedType::kFloat32;
  } else if (out_dtype == at::kDouble) {
    dst_type = FixedType::kFloat64;
  } else {
    fail(what + " must be torch.int16, torch.int32, torch.float32 or torch.float64, got " +
         std::string(c10::toString(out_dtype)));
  }
  check_offset(offset, x.numel());
  if (out) check_output(*out, "out", x, out_dtype);

  const at::Tensor src = x.contiguous();
  if (out) check_disjoint(src, "x", *out, "out");
  at::Tensor dst = out ? *out : at::empty(src.sizes(), src.options().dtype(out_dtype));
  const mpf::FixedQuantizeArgs a{src.data_ptr(), src_type, dst.data_ptr(), dst_type, src.numel(), fmt,
                                 rounding_of(stochastic), seed, offset};
  if (x.device().is_cpu()) {
    mpf::fixed_quantize_cpu(a, at::get_num_threads());
  } else {
#ifdef MPFUSED_WITH_CUDA
    const c10::cuda::CUDAGuard guard(x.device());
    mpf::fixed_quantize_cuda(a, c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
#endif
  }
  return dst;
}

at::Tensor fixed_point_quantize(const at::Tensor& x, int64_t il, int64_t fl, bool stochastic, c10::SymInt seed,
                                c10::SymInt offset, at::ScalarType out_dtype) {
  return quantize_impl(x, il, fl, stochastic, seed.expect_int(), offset.expect_int(), out_dtype, std::nullopt, "out_dtype");
}

// The same into `out`, a contiguous tensor of x's shape on its device whose dtype is the output's.
void fixed_point_quantize_out_(const at::Tensor& x, int64_t il, int64_t fl, bool stochastic, c10::SymInt seed,
                               c10::SymInt offset, const at::Tensor& out) {
  check_dense(out, "out");
  quantize_impl(x, il, fl, stochastic, seed.expect_int(), offset.expect_int(), out.scalar_type(), out, "out's dtype");
}

void check_codes(const at::Tensor& t, const std::string& name, FixedType* type) {
  check_dense(t, name);
  if (!code_type(t.scalar_type(), type))
    fail(name + " must be an int16 or int32 tensor of fixed-point codes, got a " + describe(t));
  if (t.dim() != 2) fail(name + " must be 2-D, got a " + describe(t));
}

// The codes of fmt_out of a @ b: exact int64 sums rounded once. Formats as (il, fl) pairs.
at::Tensor fixed_point_matmul(const at::Tensor& a, const at::Tensor& b, int64_t il_a, int64_t fl_a, int64_t il_b,
                              int64_t fl_b, int64_t il_out, int64_t fl_out, bool stochastic, c10::SymInt seed_bits,
                              c10::SymInt offset_bits, at::ScalarType out_dtype) {
  const uint64_t seed = u64_of(seed_bits), offset = u64_of(offset_bits);
  FixedType a_type, b_type, out_type;
  check_codes(a, "a_codes", &a_type);
  check_codes(b, "b_codes", &b_type);
  const at::Device device = a.device();
  check_backend(device, "a_codes");
  if (b.device() != device)
    fail("b_codes is on " + b.device().str() + " but a_codes is on " + device.str() + "; both must be on one device");
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  if (b.size(0) != k)
    fail("b_codes must have " + std::to_string(k) + " rows, the inner dim of a_codes " + describe(a) + ", got a " +
         describe(b));
  const mpf::FixedFormat fa = fixed_format(il_a, fl_a, "fmt_a");
  const mpf::FixedFormat fb = fixed_format(il_b, fl_b, "fmt_b");
  const mpf::FixedFormat fo = fixed_format(il_out, fl_out, "fmt_out");
  if (mpf::fixed_wl(fa) > code_bits(a_type)) fail("a_codes' dtype cannot hold codes of fmt_a; got a " + describe(a));
  if (mpf::fixed_wl(fb) > code_bits(b_type)) fail("b_codes' dtype cannot hold codes of fmt_b; got a " + describe(b));
  if (!code_type(out_dtype, &out_type) || mpf::fixed_wl(fo) > code_bits(out_type))
    fail(std::string("out_dtype must be torch.int16 or torch.int32 and hold codes of fmt_out, got ") +
         c10::toString(out_dtype));
  if (!mpf::fixed_macc_fits(mpf::fixed_wl(fa), mpf::fixed_wl(fb), k))
    fail("the MACC's int64 sum could overflow: WL_a + WL_b + ceil(log2 K) must be at most 64 (the sum of K products "
         "of at most 2^(WL_a + WL_b - 2) stays within 2^62), got WL_a=" + std::to_string(mpf::fixed_wl(fa)) +
         ", WL_b=" + std::to_string(mpf::fixed_wl(fb)) + ", K=" + std::to_string(k));
  if (device.is_cuda() && m > int64_t{65535} * 64)  // (the CPU loops have no such limit)
    fail("on CUDA, a_codes may have at most 4194240 rows (the grid's 65535 rows of 64-row tiles), got " + describe(a));
  check_offset(offset, m * n);

  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  if (device.is_cpu() && m > 0 && n > 0 && k > 0) {
    // The bound above holds for codes in their formats' ranges, which mpfused.fixed_point.matmul checks
    // (one flag read on CUDA). The operator itself takes codes beyond them (FixedPointLinear's bias column
    // holds 1.0, which a format with il = 1 cannot), so it bounds the sum by the codes themselves: where
    // max|a| * max|b| * K could pass 2^62 the int64 sum could overflow, and it raises. On the CPU that costs
    // one pass over the operands, reading no device; on CUDA it would cost a host sync, and the codes are
    // taken as they are (the Python function's check covers them in eager mode).
    const auto largest = [](const at::Tensor& t) {
      const auto mm = at::aminmax(t);
      const int64_t lo = std::get<0>(mm).item<int64_t>(), hi = std::get<1>(mm).item<int64_t>();
      return std::max(hi, -lo);  // (int16/int32 codes: no overflow in int64)
    };
    const int64_t ma = largest(ac), mb = largest(bc);
    const unsigned __int128 bound = static_cast<unsigned __int128>(ma) * static_cast<unsigned __int128>(mb) *
                                    static_cast<unsigned __int128>(k);
    if (bound > (static_cast<unsigned __int128>(1) << 62))
      fail("the MACC's int64 sum could overflow: codes up to |a| = " + std::to_string(ma) + " and |b| = " +
           std::to_string(mb) + " over K = " + std::to_string(k) + " pass 2^62 (max|a| * max|b| * K); codes in "
           "fmt_a's and fmt_b's ranges never do (mpfused.fixed_point.matmul checks them)");
  }
  at::Tensor out = at::empty({m, n}, a.options().dtype(out_dtype));
  const mpf::FixedShift shift{fa.fl + fb.fl - fo.fl, mpf::fixed_code_min(fo), mpf::fixed_code_max(fo)};
  const mpf::FixedMatmulArgs g{ac.data_ptr(), a_type, bc.data_ptr(), b_type, out.data_ptr(), out_type, m, n, k,
                               shift, rounding_of(stochastic), seed, offset};
  if (device.is_cpu()) {
    mpf::fixed_matmul_cpu(g, at::get_num_threads());
  } else {
#ifdef MPFUSED_WITH_CUDA
    const c10::cuda::CUDAGuard guard(device);
    mpf::fixed_matmul_cuda(g, c10::cuda::getCurrentCUDAStream(device.index()).stream());
#endif
  }
  return out;
}

}  // namespace
}  // namespace mpf_torch

using namespace mpf_torch;

TORCH_LIBRARY_FRAGMENT(mpfused, m) {
  m.def("fixed_point_quantize(Tensor x, int il, int fl, bool stochastic, SymInt seed, SymInt offset, ScalarType out_dtype) "
        "-> Tensor");
  m.def("fixed_point_quantize_out_(Tensor x, int il, int fl, bool stochastic, SymInt seed, SymInt offset, Tensor(a!) out) "
        "-> ()");
  m.def("fixed_point_matmul(Tensor a, Tensor b, int il_a, int fl_a, int il_b, int fl_b, int il_out, int fl_out, "
        "bool stochastic, SymInt seed, SymInt offset, ScalarType out_dtype) -> Tensor");
}
MPF_TORCH_IMPL_CPU_CUDA("fixed_point_quantize", &fixed_point_quantize)
MPF_TORCH_IMPL_CPU_CUDA("fixed_point_quantize_out_", &fixed_point_quantize_out_)
MPF_TORCH_IMPL_CPU_CUDA("fixed_point_matmul", &fixed_point_matmul)
