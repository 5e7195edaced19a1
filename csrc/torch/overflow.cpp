// torch.ops.mpfused.non_finite_check_ and unscale_check_: the multi-tensor inf/NaN check, with the
// optional unscale in place, sum of squares and norm, in one pass (csrc/core/overflow.h).
//
// Two schemas, so that each says exactly what it writes: the check reads the tensors, the unscale writes
// them back. Every argument is checked before the backend runs, so a call that raises has modified nothing.
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "common.h"

namespace mpf_torch {
namespace {

void check_impl(at::TensorList tensors, const at::Tensor& found_inf, const std::optional<at::Tensor>& inv_scale,
                bool unscale, const std::optional<at::Tensor>& sumsq, bool overwrite,
                const std::optional<at::Tensor>& norm, const std::optional<at::Tensor>& counter) {
  // ---- validate everything first ----
  check_dense(found_inf, "found_inf");
  const at::Device device = found_inf.device();
  check_backend(device, "found_inf");
  check_scalar(found_inf, "found_inf", device);
  if (inv_scale) check_scalar(*inv_scale, "inv_scale", device);
  if (sumsq) check_scalar(*sumsq, "sumsq", device);
  if (unscale && !inv_scale) fail("unscale=True needs inv_scale (a float32 tensor with one element)");
  if (norm) {
    check_scalar(*norm, "norm", device);
    if (!sumsq) fail("norm needs sumsq (the norm is the square root of the sum of squares)");
  }
  unsigned int* counter_data = counter_ptr(counter, "counter", device);

  std::vector<mpf::TensorRef> refs;
  refs.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    DType d;
    if (!(plain_dense(t) && kernel_dtype(t.scalar_type(), &d) && t.device() == device && t.is_contiguous())) {
      const std::string name = "tensors[" + std::to_string(i) + "]";  // (the message of the first check that fails)
      check_dense(t, name);
      storage_dtype(t, name);
      if (t.device() != device)
        fail(name + " is on " + t.device().str() + " but found_inf is on " + device.str() +
             "; all tensors of one call must be on one device");
      fail(name + " must be contiguous, got a strided view " + describe(t) + "; pass t.contiguous()");
    }
    if (t.numel() == 0) continue;
    refs.push_back({t.data_ptr(), t.numel(), d});
  }
  // The outputs are written while the tensors and inv_scale are read (and found_inf, sumsq and norm are
  // read back): none may share memory with another, or the flag would hold a sum (every step then looks
  // like an overflow) and a grad a partial sum. A test of addresses per tensor and output: no allocation on
  // the hot path of the check.
  const auto overlaps = [](const at::Tensor& a, const at::Tensor& b) {
    const auto* ab = static_cast<const char*>(a.data_ptr());
    const auto* bb = static_cast<const char*>(b.data_ptr());
    return a.numel() > 0 && b.numel() > 0 && ab < bb + b.numel() * b.element_size() &&
           bb < ab + a.numel() * a.element_size();
  };
  if (unscale) {
    // The unscale writes the tensors while it reads inv_scale and them: a tensor over inv_scale's memory
    // would change the factor mid-call (on CUDA, as the blocks happen to run), and two tensors over the same
    // memory would have it unscaled twice, or, on CUDA, once or twice as the blocks race. Both are refused.
    // (torch's op unscales an overlap twice on the CPU and races on CUDA.) The spans in order of address: a
    // sort of the tensors' spans, only where they are written.
    for (size_t i = 0; i < tensors.size(); ++i)
      if (overlaps(tensors[i], *inv_scale))
        fail("tensors[" + std::to_string(i) + "] must not overlap inv_scale (the tensors are unscaled in place "
             "while inv_scale is read)");
    struct Span {
      uintptr_t lo, hi;
      size_t index;
    };
    std::vector<Span> spans;
    spans.reserve(tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      const at::Tensor& t = tensors[i];
      if (t.numel() == 0) continue;
      const auto lo = reinterpret_cast<uintptr_t>(t.data_ptr());
      spans.push_back({lo, lo + static_cast<uintptr_t>(t.numel() * t.element_size()), i});
    }
    std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.lo < b.lo; });
    const Span* reach = nullptr;  // the span that ends furthest among those before
    for (const Span& s : spans) {
      if (reach && s.lo < reach->hi) {
        const size_t a = std::min(reach->index, s.index), b = std::max(reach->index, s.index);
        fail("tensors[" + std::to_string(b) + "] and tensors[" + std::to_string(a) + "] share memory; an unscale in "
             "place would unscale it twice (give each tensor once, or views that do not overlap)");
      }
      if (!reach || s.hi > reach->hi) reach = &s;
    }
  }
  const at::Tensor* outs[4] = {&found_inf, sumsq ? &*sumsq : nullptr, norm ? &*norm : nullptr,
                               counter ? &*counter : nullptr};
  const char* out_names[4] = {"found_inf", "sumsq", "norm", "counter"};
  for (int a = 0; a < 4; ++a) {
    if (!outs[a]) continue;
    for (int b = a + 1; b < 4; ++b)
      if (outs[b] && overlaps(*outs[a], *outs[b]))
        fail(std::string(out_names[b]) + " must not overlap " + out_names[a] + " (each is written)");
    if (inv_scale && overlaps(*inv_scale, *outs[a]))
      fail(std::string(out_names[a]) + " must not overlap inv_scale (it is written while inv_scale is read)");
    for (size_t i = 0; i < tensors.size(); ++i)
      if (overlaps(tensors[i], *outs[a]))
        fail(std::string(out_names[a]) + " must not overlap tensors[" + std::to_string(i) +
             "] (it is written while the tensors are read)");
  }

  mpf::OverflowArgs args{refs.data(),
                         static_cast<int64_t>(refs.size()),
                         found_inf.data_ptr<float>(),
                         inv_scale ? inv_scale->data_ptr<float>() : nullptr,
                         unscale,
                         sumsq ? sumsq->data_ptr<float>() : nullptr,
                         overwrite,
                         norm ? norm->data_ptr<float>() : nullptr,
                         counter_data};
  // Nothing to check and nothing to write: overwrite writes found_inf = 0 (and sumsq, norm), and a norm is
  // sqrt of the sum as it stands.
  if (refs.empty() && !overwrite && !norm) return;

  // ---- run ----
  if (device.is_cpu()) {
    mpf::overflow_check_cpu(args, at::get_num_threads());
    return;
  }
#ifdef MPFUSED_WITH_CUDA
  const c10::cuda::CUDAGuard guard(device);
  TorchScratch scratch{{}, device};
  mpf::overflow_check_cuda(args, mpf::ScratchAllocator{&scratch, &TorchScratch::alloc},
                           c10::cuda::getCurrentCUDAStream(device.index()).stream());
#endif
}

void non_finite_check_(at::TensorList tensors, const at::Tensor& found_inf, const std::optional<at::Tensor>& inv_scale,
                       const std::optional<at::Tensor>& sumsq, bool overwrite, const std::optional<at::Tensor>& norm,
                       const std::optional<at::Tensor>& counter) {
  check_impl(tensors, found_inf, inv_scale, false, sumsq, overwrite, norm, counter);
}

void unscale_check_(at::TensorList tensors, const at::Tensor& found_inf, const at::Tensor& inv_scale,
                    const std::optional<at::Tensor>& sumsq, bool overwrite, const std::optional<at::Tensor>& norm,
                    const std::optional<at::Tensor>& counter) {
  check_impl(tensors, found_inf, inv_scale, true, sumsq, overwrite, norm, counter);
}

}  // namespace
}  // namespace mpf_torch

using namespace mpf_torch;

TORCH_LIBRARY_FRAGMENT(mpfused, m) {
  m.def("non_finite_check_(Tensor[] tensors, Tensor(a!) found_inf, Tensor? inv_scale, Tensor(b!)? sumsq, "
        "bool overwrite, Tensor(c!)? norm, Tensor(d!)? counter) -> ()");
  m.def("unscale_check_(Tensor(a!)[] tensors, Tensor(b!) found_inf, Tensor inv_scale, Tensor(c!)? sumsq, "
        "bool overwrite, Tensor(d!)? norm, Tensor(e!)? counter) -> ()");
}
MPF_TORCH_IMPL_CPU_CUDA("non_finite_check_", &non_finite_check_)
MPF_TORCH_NO_AUTOGRAD("non_finite_check_")
MPF_TORCH_IMPL_CPU_CUDA("unscale_check_", &unscale_check_)
MPF_TORCH_NO_AUTOGRAD("unscale_check_")
