// The only C++ file that knows torch: it validates at::Tensor arguments, turns them into the plain
// structs of kernels.h, picks the CPU or CUDA backend by device, and defines the pybind11 module.
//
// Every check runs before any backend is called, so a call that raises has modified nothing.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "kernels.h"

#ifdef MPFUSED_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#ifndef MPFUSED_VERSION
#define MPFUSED_VERSION "0+unknown"
#endif
#ifndef MPFUSED_TORCH_VERSION
#define MPFUSED_TORCH_VERSION "unknown"
#endif
#ifndef MPFUSED_CUDA_ARCH_LIST
#define MPFUSED_CUDA_ARCH_LIST ""
#endif

namespace {

using mpf::DType;

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

std::string describe(const at::Tensor& t) {
  std::ostringstream s;
  s << t.scalar_type() << " tensor of shape " << t.sizes() << " on " << t.device();
  return s.str();
}

DType storage_dtype(const at::Tensor& t, const std::string& name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default:
      fail(name + " must be a float32, float16 or bfloat16 tensor, got a " + describe(t));
  }
}

void check_dense(const at::Tensor& t, const std::string& name) {
  if (!t.defined()) fail(name + " must be a tensor, got None");
  if (t.layout() != at::kStrided) fail(name + " must be a dense (strided) tensor, got a sparse " + describe(t));
}

// A float32 tensor of exactly one element on `device`: found_inf, inv_scale, sumsq.
void check_scalar(const at::Tensor& t, const std::string& name, const at::Device& device) {
  check_dense(t, name);
  if (t.scalar_type() != at::kFloat || t.numel() != 1)
    fail(name + " must be a float32 tensor with one element, got a " + describe(t));
  if (t.device() != device)
    fail(name + " must be on " + device.str() + " like the tensors it goes with, got a " + describe(t));
}

void check_backend(const at::Device& device, const std::string& name) {
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

void non_finite_check_(const std::vector<at::Tensor>& tensors, const at::Tensor& found_inf,
                       const std::optional<at::Tensor>& inv_scale, bool unscale,
                       const std::optional<at::Tensor>& sumsq) {
  // ---- validate everything first ----
  check_dense(found_inf, "found_inf");
  const at::Device device = found_inf.device();
  check_backend(device, "found_inf");
  check_scalar(found_inf, "found_inf", device);
  if (inv_scale) check_scalar(*inv_scale, "inv_scale", device);
  if (sumsq) check_scalar(*sumsq, "sumsq", device);
  if (unscale && !inv_scale) fail("unscale=True needs inv_scale (a float32 tensor with one element)");

  std::vector<mpf::TensorRef> refs;
  refs.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const std::string name = "tensors[" + std::to_string(i) + "]";
    check_dense(t, name);
    const DType d = storage_dtype(t, name);
    if (t.device() != device)
      fail(name + " is on " + t.device().str() + " but found_inf is on " + device.str() +
           "; all tensors of one call must be on one device");
    if (!t.is_contiguous()) fail(name + " must be contiguous, got a strided view " + describe(t) + "; pass t.contiguous()");
    if (t.numel() == 0) continue;
    refs.push_back({t.data_ptr(), t.numel(), d});
  }

  mpf::OverflowArgs args{refs.data(),
                         static_cast<int64_t>(refs.size()),
                         found_inf.data_ptr<float>(),
                         inv_scale ? inv_scale->data_ptr<float>() : nullptr,
                         unscale,
                         sumsq ? sumsq->data_ptr<float>() : nullptr};
  if (refs.empty()) return;

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

pybind11::dict limits_dict(const mpf::PlanLimits& l) {
  pybind11::dict d;
  d["chunk_size"] = l.chunk_size;
  d["max_tensors"] = l.max_tensors;
  d["max_items"] = l.max_items;
  return d;
}

// How the overflow reduction splits work, per backend (for tests and benchmarks).
pybind11::dict overflow_limits() {
  pybind11::dict d;
  d["cpu"] = limits_dict(mpf::kCpuOverflowLimits);
  d["cuda"] = limits_dict(mpf::kCudaOverflowLimits);
  return d;
}

// How many launches the overflow reduction makes for tensors of these sizes on `device_type`.
int64_t overflow_planned_launches(const std::vector<int64_t>& numel, const std::string& device_type) {
  if (device_type != "cpu" && device_type != "cuda") fail("device_type must be 'cpu' or 'cuda', got '" + device_type + "'");
  const mpf::PlanLimits& lim = device_type == "cpu" ? mpf::kCpuOverflowLimits : mpf::kCudaOverflowLimits;
  return static_cast<int64_t>(mpf::plan_multi_tensor(numel.data(), static_cast<int64_t>(numel.size()), lim).size());
}

pybind11::dict build_info() {
  pybind11::dict d;
  d["version"] = MPFUSED_VERSION;
  d["torch_version"] = MPFUSED_TORCH_VERSION;
#ifdef MPFUSED_WITH_CUDA
  const int v = mpf::cuda_runtime_version_compiled();
  d["cuda_version"] = std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
  d["cuda_arch_list"] = std::string(MPFUSED_CUDA_ARCH_LIST);
#else
  d["cuda_version"] = pybind11::none();
  d["cuda_arch_list"] = pybind11::none();
#endif
#ifdef _OPENMP
  d["openmp"] = true;
#else
  d["openmp"] = false;
#endif
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mpfused native kernels (see mpfused._ops for the typed Python wrappers)";
  m.def("build_info", &build_info, "What this extension was compiled with.");
  m.def("overflow_limits", &overflow_limits, "Chunk size and per-launch capacities of the overflow reduction.");
  m.def("overflow_planned_launches", &overflow_planned_launches, pybind11::arg("numel"), pybind11::arg("device_type"),
        "Launches the overflow reduction makes for tensors of these sizes.");
  m.def("non_finite_check_", &non_finite_check_, pybind11::arg("tensors"), pybind11::arg("found_inf"),
        pybind11::arg("inv_scale") = pybind11::none(), pybind11::arg("unscale") = false,
        pybind11::arg("sumsq") = pybind11::none(),
        "Multi-tensor inf/NaN check, optional unscale in place and sum of squares, in one pass.");
}
