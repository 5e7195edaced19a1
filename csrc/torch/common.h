// The torch side's shared checks and helpers. Each file under csrc/torch/ defines one family of torch
// operators (torch.ops.mpfused.*): it registers their schemas (TORCH_LIBRARY_FRAGMENT, mutations marked),
// their CPU and CUDA kernels (TORCH_LIBRARY_IMPL), and validates every at::Tensor argument with these
// helpers before anything is written, so a message reads the same whichever op raises it. The fake
// (meta) kernels and the GEMM's autograd formula are registered in Python (mpfused/_ops.py); the roundings'
// autograd kernel, which refuses every derivative, is C++ (no_derivative.cpp). Header-only,
// inline, in namespace mpf_torch.
#pragma once

// ATen and the operator registry only: each op file compiles in a third of the time <torch/extension.h>
// (pybind11, the whole C++ API) costs. bindings.cpp, the Python module, includes that one.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "../kernels.h"

#ifdef MPFUSED_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace mpf_torch {

using mpf::DType;

// A bad argument: a ValueError in Python (through the dispatcher as through pybind11).
[[noreturn]] inline void fail(const std::string& msg) { TORCH_CHECK_VALUE(false, msg); }

// A Python int in [0, 2^64) travels through a schema's `int` (int64) as its two's-complement bit pattern:
// mpfused._ops.u64_arg maps it there, and this maps it back.
inline uint64_t u64_of(int64_t v) { return static_cast<uint64_t>(v); }
// A seed or offset the schema declares SymInt (torch.compile keeps an int that changes between calls symbolic
// instead of compiling once per value): concrete when a kernel runs.
inline uint64_t u64_of(const c10::SymInt& v) { return u64_of(v.expect_int()); }

inline std::string describe(const at::Tensor& t) {
  std::ostringstream s;
  s << t.scalar_type() << " tensor of shape " << t.sizes() << " on " << t.device();
  return s.str();
}

// The kernels' storage dtype of a torch dtype; false for every other dtype.
inline bool kernel_dtype(at::ScalarType s, DType* d) {
  switch (s) {
    case at::kFloat: *d = DType::kFloat32; return true;
    case at::kHalf: *d = DType::kFloat16; return true;
    case at::kBFloat16: *d = DType::kBFloat16; return true;
    default: return false;
  }
}

inline DType storage_dtype(const at::Tensor& t, const std::string& name) {
  DType d;
  if (!kernel_dtype(t.scalar_type(), &d)) fail(name + " must be a float32, float16 or bfloat16 tensor, got a " + describe(t));
  return d;
}

// A tensor whose operations Python intercepts (DTensor, wrapper subclasses, FakeTensor) has no memory of
// its own that a kernel could address: its data pointer is null or belongs to something else. Raised as
// a TypeError, before anything is written.
inline void check_plain(const at::Tensor& t, const std::string& name) {
  if (t.key_set().has(c10::DispatchKey::Python) || (t.layout() == at::kStrided && !t.has_storage()))
    TORCH_CHECK_TYPE(false, name + " is a tensor subclass that overrides __torch_dispatch__ (such as DTensor), "
                               "or has no storage; mpfused's kernels take plain dense tensors. Pass its local "
                               "data (for DTensor: .to_local()).");
}

// Whether every element of a plain strided tensor lies inside its storage. A tensor whose storage was freed
// (untyped_storage().resize_(0), as FSDP frees unsharded params) or shrunk after the tensor was made holds
// elements that the kernels, which take its untyped data pointer, would read or write out of bounds (torch's
// own kernels refuse the first: "its data is not allocated yet"). Views are bounds-checked when they are made
// (as_strided included) and strides are never negative, so the furthest element is the storage offset plus
// (size - 1) * stride over the dims.
inline bool in_storage(const at::Tensor& t) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (impl->numel() == 0) return true;
  if (impl->is_contiguous())  // (a cached flag: the optimizers' tensors take this path, without the loop)
    return static_cast<uint64_t>(impl->storage_offset() + impl->numel()) * impl->itemsize() <= impl->unsafe_storage().nbytes();
  uint64_t last = static_cast<uint64_t>(impl->storage_offset());
  const auto sizes = impl->sizes();
  const auto strides = impl->strides();
  for (size_t d = 0; d < sizes.size(); ++d) last += static_cast<uint64_t>(sizes[d] - 1) * static_cast<uint64_t>(strides[d]);
  return (last + 1) * impl->itemsize() <= impl->unsafe_storage().nbytes();
}

inline void check_in_storage(const at::Tensor& t, const std::string& name) {
  if (!in_storage(t))
    fail(name + " reaches past the end of its storage (a " + describe(t) + " at storage offset " +
         std::to_string(t.storage_offset()) + " with strides " + c10::str(t.strides()) + ", over a storage of " +
         std::to_string(t.unsafeGetTensorImpl()->unsafe_storage().nbytes()) + " bytes): its storage was freed or "
         "shrunk after the tensor was made (untyped_storage().resize_(), as FSDP frees unsharded params)");
}

inline void check_dense(const at::Tensor& t, const std::string& name) {
  if (!t.defined()) fail(name + " must be a tensor, got None");
  check_plain(t, name);
  if (t.layout() != at::kStrided) fail(name + " must be a dense (strided) tensor, got a sparse " + describe(t));
  check_in_storage(t, name);
}

// What check_dense takes, as one test without its messages (a per-tensor check on a hot path tests this
// first, and makes its messages only for a tensor that fails).
inline bool plain_dense(const at::Tensor& t) {
  return t.defined() && t.layout() == at::kStrided && t.has_storage() && !t.key_set().has(c10::DispatchKey::Python) &&
         in_storage(t);
}

// The optimizer's kernels read a param, its grad, master and state as flat arrays, so each must lay its
// elements out in memory as the param does: same shape, and the same stride in every dim of size > 1
// (the stride of a size-1 dim never addresses memory). The param itself must be non-overlapping and dense
// (contiguous, channels_last, any permutation of a contiguous tensor); then so is every tensor with its layout.
inline bool same_layout(const at::Tensor& t, const at::Tensor& ref) {
  if (t.sizes() != ref.sizes()) return false;
  for (int64_t d = 0; d < ref.dim(); ++d)
    if (ref.size(d) > 1 && t.stride(d) != ref.stride(d)) return false;
  return true;
}

// Whether grad g goes with param p in an optimizer step: both plain dense tensors with storage, p of a
// kernel dtype, non-overlapping and dense, g of p's dtype, shape, device and memory layout. optim_step_'s
// checks of a param and its grad say why not, one by one; FusedOptimizer.step()'s planned path asks this
// of every pair before its first kernel call (mpfused._C.step_layout).
inline bool grad_pairs(const at::Tensor& p, const at::Tensor& g) {
  DType d;
  return plain_dense(p) && plain_dense(g) && kernel_dtype(p.scalar_type(), &d) && g.scalar_type() == p.scalar_type() &&
         g.device() == p.device() && p.is_non_overlapping_and_dense() && same_layout(g, p);
}

// The output of an elementwise op written into a caller's tensor: a contiguous `dtype` tensor of x's shape
// on x's device (the kernels write it as a flat array in x's row-major order).
inline void check_output(const at::Tensor& out, const std::string& name, const at::Tensor& x, at::ScalarType dtype) {
  check_dense(out, name);
  if (out.scalar_type() != dtype || out.sizes() != x.sizes() || out.device() != x.device() || !out.is_contiguous())
    fail(name + " must be a contiguous " + std::string(c10::toString(dtype)) + " tensor of x's shape " +
         c10::str(x.sizes()) + " on " + x.device().str() + ", got a " + describe(out) +
         (out.is_contiguous() ? "" : " (not contiguous)"));
}

// A kernel that reads `src` while it writes `dst` (both contiguous) needs them apart in memory.
inline void check_disjoint(const at::Tensor& src, const std::string& src_name, const at::Tensor& dst,
                           const std::string& dst_name) {
  if (src.numel() == 0 || dst.numel() == 0) return;
  const auto* sb = static_cast<const char*>(src.data_ptr());
  const auto* db = static_cast<const char*>(dst.data_ptr());
  if (sb < db + dst.numel() * dst.element_size() && db < sb + src.numel() * src.element_size())
    fail(dst_name + " must not overlap " + src_name);
}

// A float32 tensor of exactly one element on `device`: found_inf, inv_scale, sumsq.
inline void check_scalar(const at::Tensor& t, const std::string& name, const at::Device& device) {
  check_dense(t, name);
  if (t.scalar_type() != at::kFloat || t.numel() != 1)
    fail(name + " must be a float32 tensor with one element, got a " + describe(t));
  if (t.device() != device)
    fail(name + " must be on " + device.str() + " like the tensors it goes with, got a " + describe(t));
}

// A number in [lo, hi] (or open at either end), finite.
inline void check_hyper(double v, const char* name, double lo, bool lo_open, double hi, bool hi_open) {
  if (!std::isfinite(v) || v < lo || (lo_open && v == lo) || v > hi || (hi_open && v == hi)) {
    std::ostringstream s;
    s << "invalid " << name << ": " << v << " (expected a finite value in " << (lo_open ? "(" : "[") << lo << ", " << hi
      << (hi_open ? ")" : "]") << ")";
    fail(s.str());
  }
}

inline void check_backend(const at::Device& device, const std::string& name) {
  if (device.is_cpu()) return;
  if (device.is_cuda()) {
#ifdef MPFUSED_WITH_CUDA
    return;
#else
    fail(name + " is on " + device.str() + ", but this mpfused build has no CUDA kernels (built CPU-only). "
         "Rebuild on a machine with nvcc and a CUDA-enabled torch: "
         "pip install --no-build-isolation --force-reinstall --no-deps mpfused (from the source tree: "
         "pip install --no-build-isolation .), without MPFUSED_FORCE_CPU set.");
#endif
  }
  fail(name + " must be on a cpu or cuda device, got " + device.str());
}

#ifdef MPFUSED_WITH_CUDA
// Scratch memory from torch's caching allocator; the blocks are held by `keep` until the launcher
// returns, after which the allocator may reuse them for later work on the same stream (safe).
struct TorchScratch {
  std::vector<at::Tensor> keep;
  at::Device device;
  static void* alloc(void* ctx, int64_t bytes) {
    auto* self = static_cast<TorchScratch*>(ctx);
    self->keep.push_back(at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(self->device)));
    return self->keep.back().data_ptr();
  }
};
#endif

// A caller-owned int32 tensor of one element on `device`, zero between calls: the kernels' counter.
inline unsigned int* counter_ptr(const std::optional<at::Tensor>& t, const std::string& name, const at::Device& device) {
  if (!t) return nullptr;
  check_dense(*t, name);
  if (t->scalar_type() != at::kInt || t->numel() != 1 || t->device() != device)
    fail(name + " must be a zeroed int32 tensor with one element on " + device.str() + ", got a " + describe(*t));
  return reinterpret_cast<unsigned int*>(t->data_ptr<int32_t>());
}

// The kernels of one op run on the CPU or CUDA backend by the tensors' device, with the same checks;
// each op file registers one function for both dispatch keys. The same function is also the op's
// CompositeExplicitAutograd kernel, which the dispatcher picks for every other backend (sparse tensors,
// other devices) and for a call with no tensor at all (an optimizer step over no params still checks its
// hyperparameters): each then gets the function's own clear error (a CUDA tensor in a CPU-only build:
// how to rebuild) instead of the dispatcher's. Meta is the Python fake kernel's (mpfused/_ops.py).
#define MPF_TORCH_IMPL_CPU_CUDA(op, fn)                                              \
  TORCH_LIBRARY_IMPL(mpfused, CPU, m) { m.impl(op, fn); }                            \
  TORCH_LIBRARY_IMPL(mpfused, CUDA, m) { m.impl(op, fn); }                           \
  TORCH_LIBRARY_IMPL(mpfused, CompositeExplicitAutograd, m) { m.impl(op, fn); }

// An operator that returns nothing and only writes its arguments in place (an optimizer step, the overflow
// check, the loss-scale update): autograd has nothing to record for it, so its Autograd keys fall through to
// the backend kernel, called unboxed. Without this, torch's autograd fallback takes the call boxed: every
// argument into an IValue and back, every tensor list copied (0.55 us a tensor, a third of a step's host
// time on many small params), to do nothing (it bumps no version counter, as torch's fused optimizers bump
// none). Not for an op with outputs: those need a real autograd kernel (no_derivative.cpp, the GEMM's).
#define MPF_TORCH_NO_AUTOGRAD(op) \
  TORCH_LIBRARY_IMPL(mpfused, Autograd, m) { m.impl(op, torch::CppFunction::makeFallthrough()); }

}  // namespace mpf_torch
