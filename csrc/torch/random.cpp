// torch.ops.mpfused.philox_words_, philox4x32_10, round_stochastic and round_stochastic_out_: the random
// bits (csrc/core/philox.h) and stochastic rounding (csrc/core/stochastic.h). Checks, then the CPU or CUDA
// backend.
#include <ATen/Parallel.h>

#include "common.h"

namespace mpf_torch {
namespace {

mpf::RandomArgs random_args(int64_t numel, uint64_t seed, uint64_t offset, uint32_t s0, uint32_t s1) {
  if (numel > 0 && offset > UINT64_MAX - static_cast<uint64_t>(numel - 1))  // the last index fits
    fail("offset + numel must be at most 2^64 (the element indices of one stream), got offset " +
         std::to_string(offset) + " with " + std::to_string(numel) + " elements");
  return mpf::RandomArgs{seed, offset, s0, s1, numel};
}

// The random bits of elements offset .. offset + out.numel() - 1 of stream (s0, s1), as int32 bit patterns,
// into out (int32, contiguous; its device runs the generator).
void philox_words_(c10::SymInt seed, c10::SymInt offset, int64_t s0, int64_t s1, const at::Tensor& out) {
  check_dense(out, "out");
  check_backend(out.device(), "out");
  if (out.scalar_type() != at::kInt || !out.is_contiguous())
    fail("out must be a contiguous int32 tensor, got a " + describe(out));
  if (s0 < 0 || s0 > UINT32_MAX || s1 < 0 || s1 > UINT32_MAX)
    fail("stream words must be in [0, 2^32), got (" + std::to_string(s0) + ", " + std::to_string(s1) + ")");
  const at::Device device = out.device();
  const mpf::RandomArgs r = random_args(out.numel(), u64_of(seed), u64_of(offset), static_cast<uint32_t>(s0),
                                        static_cast<uint32_t>(s1));
  auto* words = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  if (device.is_cpu()) {
    mpf::philox_words_cpu(r, words, at::get_num_threads());
  } else {
#ifdef MPFUSED_WITH_CUDA
    const c10::cuda::CUDAGuard guard(device);
    mpf::philox_words_cuda(r, words, c10::cuda::getCurrentCUDAStream(device.index()).stream());
#endif
  }
}

// Philox4x32-10 of each row of `counters` ((n, 4) int32 bit patterns) under key (k0, k1).
at::Tensor philox4x32_10(const at::Tensor& counters, int64_t k0, int64_t k1) {
  check_dense(counters, "counters");
  if (k0 < 0 || k0 > UINT32_MAX || k1 < 0 || k1 > UINT32_MAX)
    fail("key words must be in [0, 2^32), got (" + std::to_string(k0) + ", " + std::to_string(k1) + ")");
  check_backend(counters.device(), "counters");
  if (counters.scalar_type() != at::kInt || counters.dim() != 2 || counters.size(1) != 4)
    fail("counters must be an int32 tensor of shape (n, 4), got a " + describe(counters));
  const at::Tensor ctr = counters.contiguous();
  at::Tensor out = at::empty_like(ctr);
  const auto* c = reinterpret_cast<const uint32_t*>(ctr.data_ptr<int32_t>());
  auto* o = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  if (ctr.device().is_cpu()) {
    mpf::philox_raw_cpu(c, o, ctr.size(0), static_cast<uint32_t>(k0), static_cast<uint32_t>(k1));
  } else {
#ifdef MPFUSED_WITH_CUDA
    const c10::cuda::CUDAGuard guard(ctr.device());
    mpf::philox_raw_cuda(c, o, ctr.size(0), static_cast<uint32_t>(k0), static_cast<uint32_t>(k1),
                         c10::cuda::getCurrentCUDAStream(ctr.device().index()).stream());
#endif
  }
  return out;
}

at::Tensor round_stochastic_impl(const at::Tensor& x, at::ScalarType dtype, uint64_t seed, uint64_t offset,
                                 const std::optional<at::Tensor>& out) {
  check_dense(x, "x");
  check_backend(x.device(), "x");
  if (x.scalar_type() != at::kFloat) fail("x must be a float32 tensor, got a " + describe(x));
  if (dtype != at::kHalf && dtype != at::kBFloat16)
    fail(std::string("dtype must be torch.float16 or torch.bfloat16, got ") + c10::toString(dtype));
  if (out) check_output(*out, "out", x, dtype);
  const at::Tensor src = x.contiguous();
  if (out) check_disjoint(src, "x", *out, "out");
  const mpf::RandomArgs r = random_args(src.numel(), seed, offset, mpf::kStreamRound, 0);
  at::Tensor dst = out ? *out : at::empty(src.sizes(), src.options().dtype(dtype));
  const mpf::DType d = dtype == at::kHalf ? mpf::DType::kFloat16 : mpf::DType::kBFloat16;
  if (x.device().is_cpu()) {
    mpf::round_stochastic_cpu(r, src.data_ptr<float>(), dst.data_ptr(), d, at::get_num_threads());
  } else {
#ifdef MPFUSED_WITH_CUDA
    const c10::cuda::CUDAGuard guard(x.device());
    mpf::round_stochastic_cuda(r, src.data_ptr<float>(), dst.data_ptr(), d,
                               c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
#endif
  }
  return dst;
}

at::Tensor round_stochastic(const at::Tensor& x, at::ScalarType dtype, c10::SymInt seed, c10::SymInt offset) {
  return round_stochastic_impl(x, dtype, u64_of(seed), u64_of(offset), std::nullopt);
}

void round_stochastic_out_(const at::Tensor& x, c10::SymInt seed, c10::SymInt offset, const at::Tensor& out) {
  check_dense(out, "out");
  const at::ScalarType dtype = out.scalar_type();
  if (dtype != at::kHalf && dtype != at::kBFloat16) fail("out must be a float16 or bfloat16 tensor, got a " + describe(out));
  round_stochastic_impl(x, dtype, u64_of(seed), u64_of(offset), out);
}

}  // namespace
}  // namespace mpf_torch

using namespace mpf_torch;

TORCH_LIBRARY_FRAGMENT(mpfused, m) {
  m.def("philox_words_(SymInt seed, SymInt offset, int s0, int s1, Tensor(a!) out) -> ()");
  m.def("philox4x32_10(Tensor counters, int k0, int k1) -> Tensor");
  m.def("round_stochastic(Tensor x, ScalarType dtype, SymInt seed, SymInt offset) -> Tensor");
  m.def("round_stochastic_out_(Tensor x, SymInt seed, SymInt offset, Tensor(a!) out) -> ()");
}
MPF_TORCH_IMPL_CPU_CUDA("philox_words_", &philox_words_)
MPF_TORCH_IMPL_CPU_CUDA("philox4x32_10", &philox4x32_10)
MPF_TORCH_IMPL_CPU_CUDA("round_stochastic", &round_stochastic)
MPF_TORCH_IMPL_CPU_CUDA("round_stochastic_out_", &round_stochastic_out_)
