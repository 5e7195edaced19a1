// The Python module mpfused._C: what the extension was built with, and the kernels' static facts (optimizer
// policies, overflow-plan limits) for mpfused._ops. The kernels themselves are torch operators
// (torch.ops.mpfused.*), one family per file under csrc/torch/, registered when this module is loaded.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "cpu/isa.h"
#include "torch/common.h"

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

using namespace mpf_torch;
using mpf::DType;

// The policies' names, states and hyperparameters (core/optim/registry.h), for mpfused._ops.
pybind11::dict optim_policies() {
  pybind11::dict out;
  mpf::dispatch_optim_all([&](auto policy) {
    using P = decltype(policy);
    pybind11::list states, hyper, tensor_hyper;
    for (int k = 0; k < P::kNumStates; ++k) states.append(P::kStates[k]);
    for (int i = 0; i < P::kNumHyper; ++i) {
      hyper.append(P::kHyper[i].name);
      if (P::kHyper[i].tensor_ok) tensor_hyper.append(P::kHyper[i].name);
    }
    pybind11::dict d;
    d["states"] = states;
    d["hyper"] = hyper;
    d["tensor_hyper"] = tensor_hyper;  // those the update may read from a tensor
    out[P::kName] = d;
  });
  return out;
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

// What the calling thread's last CUDA GEMM launched: (kernel, passed_over), the kernel 'wgmma', 'wgmma-cluster' or
// 'wmma' (None before any call and for an empty output), passed_over why the Hopper kernel, selected, did not run
// (None where it ran or was not selected). Host state: no sync.
pybind11::tuple gemm_last_cuda_launch() {
#ifdef MPFUSED_WITH_CUDA
  const mpf::GemmLaunch l = mpf::gemm_last_launch();
  pybind11::object kernel = pybind11::none();
  if (l.launched)
    kernel = pybind11::str(l.kernel == mpf::GemmKernelChoice::kWgmmaCluster ? "wgmma-cluster"
                           : l.kernel == mpf::GemmKernelChoice::kWgmma      ? "wgmma"
                                                                             : "wmma");
  pybind11::object why = l.passed_over ? pybind11::object(pybind11::str(l.passed_over)) : pybind11::none();
  return pybind11::make_tuple(kernel, why);
#else
  fail("this mpfused build has no CUDA kernels (built CPU-only)");
#endif
}

#ifdef MPFUSED_WITH_CUDA
// `index` names a visible CUDA device, else a ValueError that says which exist.
void check_device_index(int64_t index) {
  const int64_t count = c10::cuda::device_count();
  if (count == 0) fail("no CUDA device is visible");
  if (index < 0 || index >= count)
    fail("index must name a visible CUDA device (0 to " + std::to_string(count - 1) + "), got " + std::to_string(index));
}
#endif

// The CUDA GEMM kernel that aligned FP16/BF16 operands take on CUDA device `index` under the current
// MPFUSED_GEMM_KERNEL: "wgmma" (the Hopper kernel), "wgmma-cluster" (the same in clusters of two CTAs) or "wmma".
std::string gemm_cuda_kernel(int64_t index) {
#ifdef MPFUSED_WITH_CUDA
  check_device_index(index);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index));
  if (!mpf::gemm_sm90_selected(true, static_cast<int>(index))) return "wmma";
  return mpf::gemm_kernel_choice() == mpf::GemmKernelChoice::kWgmmaCluster ? "wgmma-cluster" : "wgmma";
#else
  (void)index;
  fail("this mpfused build has no CUDA kernels (built CPU-only)");
#endif
}

// The CUDA MACC kernel that int16 x int16 fixed-point codes take on CUDA device `index` under the current
// MPFUSED_FIXED_MATMUL_KERNEL: "tensor-cores" or "cuda-cores".
std::string fixed_matmul_cuda_kernel(int64_t index) {
#ifdef MPFUSED_WITH_CUDA
  check_device_index(index);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index));
  return mpf::fixed_matmul_kernel(static_cast<int>(index)) == mpf::FixedMatmulKernel::kTensorCores ? "tensor-cores"
                                                                                                    : "cuda-cores";
#else
  (void)index;
  fail("this mpfused build has no CUDA kernels (built CPU-only)");
#endif
}

// Empty when mpfused's GEMM runs `dtype` ("float16" or "bfloat16") inputs on CUDA device `index`, else
// the reason (FusedLinear then falls back to torch's matmul, with a warning).
std::string gemm_unsupported(const std::string& dtype, int64_t index) {
  if (dtype != "float16" && dtype != "bfloat16") fail("dtype must be 'float16' or 'bfloat16', got '" + dtype + "'");
#ifdef MPFUSED_WITH_CUDA
  const int64_t count = c10::cuda::device_count();
  if (index < 0 || index >= count)
    fail("index must name a visible CUDA device (0 to " + std::to_string(count - 1) + "), got " + std::to_string(index));
  // torch's guard: restoring the previous device creates no CUDA context on a device that had none
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index));
  return mpf::gemm_unsupported(dtype == "float16" ? DType::kFloat16 : DType::kBFloat16, static_cast<int>(index));
#else
  (void)index;
  return "this mpfused build has no CUDA kernels (built CPU-only)";
#endif
}

// A torch.Tensor or torch.nn.Parameter itself, not a subclass (one that may override __torch_function__).
bool plain_tensor(PyObject* o) {
  static PyObject* const parameter = pybind11::object(pybind11::module_::import("torch.nn").attr("Parameter")).release().ptr();
  return Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(THPVariableClass) ||
         Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(parameter);
}

// FusedOptimizer.step()'s planned path (mpfused/optim/_base.py): None unless every grads[i] is a plain
// torch.Tensor (or Parameter) that goes with params[i], a plain one too, as optim_step_ takes them
// (grad_pairs), and every state entry given goes with its param as optim_step_ checks it: `beside` holds
// lists (one entry per param, or None) of float32 tensors in the param's layout (moments, masters),
// `remainders` int16 ones, `steps` one-element float32 counters on the param's device. Else the params'
// dtypes, devices, memory addresses, shapes and strides, and their entries' memory addresses, as bytes, which the plan compares with those of the step it was
// made in (their version counters: step_versions). One pass in C++ (tens of ns a tensor), before any kernel
// call writes.
pybind11::object step_layout(const pybind11::list& params, const pybind11::list& grads, const pybind11::list& beside,
                             const pybind11::list& remainders, const pybind11::list& steps) {
  const auto plain_type = plain_tensor;
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  const auto per_param = [n](PyObject* list) { return PyList_Check(list) && PyList_GET_SIZE(list) == n; };
  if (!per_param(grads.ptr()) || !per_param(remainders.ptr()) || !per_param(steps.ptr())) return pybind11::none();
  for (const pybind11::handle list : beside)
    if (!per_param(list.ptr())) return pybind11::none();
  // entry i of `list`: None, or a plain tensor that `ok` accepts beside param p
  const auto entry_ok = [&](PyObject* list, Py_ssize_t i, const at::Tensor& p, auto&& ok) {
    PyObject* const o = PyList_GET_ITEM(list, i);
    if (o == Py_None) return true;
    if (!plain_type(o)) return false;
    const at::Tensor& t = THPVariable_Unpack(o);
    return t.defined() && t.layout() == at::kStrided && t.has_storage() && !t.key_set().has(c10::DispatchKey::Python) &&
           t.device() == p.device() && ok(t);
  };
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(n) * 9);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* const po = PyList_GET_ITEM(params.ptr(), i);
    PyObject* const go = PyList_GET_ITEM(grads.ptr(), i);
    if (!plain_type(po) || !plain_type(go)) return pybind11::none();
    const at::Tensor& p = THPVariable_Unpack(po);
    // (an inference grad: the full path, which refuses one the step would write back before any group is written)
    if (!grad_pairs(p, THPVariable_Unpack(go)) || THPVariable_Unpack(go).is_inference()) return pybind11::none();
    for (const pybind11::handle list : beside)
      if (!entry_ok(list.ptr(), i, p, [&](const at::Tensor& t) { return t.scalar_type() == at::kFloat && same_layout(t, p); }))
        return pybind11::none();
    if (!entry_ok(remainders.ptr(), i, p, [&](const at::Tensor& t) {
          return t.scalar_type() == at::kShort && p.scalar_type() == at::kBFloat16 && same_layout(t, p);
        }) ||
        !entry_ok(steps.ptr(), i, p, [](const at::Tensor& t) { return t.scalar_type() == at::kFloat && t.numel() == 1; }))
      return pybind11::none();
    out.push_back(static_cast<int64_t>(p.scalar_type()));
    out.push_back(static_cast<int64_t>(p.device().type()));
    out.push_back(p.device().index());
    // and its memory: a param given other memory (`p.data = other.data`) may now overlap another param,
    // which the full path checks (FusedOptimizer._check_memory_disjoint)
    out.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(p.data_ptr())));
    out.push_back(p.dim());
    for (int64_t d = 0; d < p.dim(); ++d) {
      out.push_back(p.size(d));
      out.push_back(p.stride(d));
    }
    // and the entries' memory: one pointed at another's by `.data = ...` (the same object, so the plan's identity
    // checks pass) takes the full path, whose check over every group refuses it (state_overlap)
    const auto memory = [&out, i](PyObject* list) {
      PyObject* const o = PyList_GET_ITEM(list, i);
      out.push_back(o == Py_None ? 0 : static_cast<int64_t>(reinterpret_cast<uintptr_t>(THPVariable_Unpack(o).data_ptr())));
    };
    for (const pybind11::handle list : beside) memory(list.ptr());
    memory(remainders.ptr());
    memory(steps.ptr());
  }
  return pybind11::bytes(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(int64_t));
}

// The version counters and data pointers, as bytes, of the params (plain tensors, as step_layout accepted them) that have an
// FP32 master (masters[i] not None) or a remainder: the planned step compares them with those its last step
// left (each step moves a param's counter, csrc/torch/optim.cpp, by a count that views of one buffer in
// several groups make larger than one), and where a param was written from outside the step its master
// follows the write first (16 bytes a param, in order: _StepPlan._moved finds which). Empty bytes for a list
// that does not match. With `memory` (DTensor params: their local shards, one per param), the counters are
// the params' own (a write through a DTensor moves the DTensor's counter, not its shard's: the shard is
// written below autograd) and the memory the shards'.
pybind11::bytes step_versions(const pybind11::list& params, const pybind11::list& masters, const pybind11::list& remainders,
                              const std::optional<pybind11::list>& memory) {
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  if (PyList_GET_SIZE(masters.ptr()) != n || PyList_GET_SIZE(remainders.ptr()) != n) return pybind11::bytes();
  if (memory && PyList_GET_SIZE(memory->ptr()) != n) return pybind11::bytes();
  std::vector<int64_t> out;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (PyList_GET_ITEM(masters.ptr(), i) == Py_None && PyList_GET_ITEM(remainders.ptr(), i) == Py_None) continue;
    PyObject* const po = PyList_GET_ITEM(params.ptr(), i);
    PyObject* const mo = memory ? PyList_GET_ITEM(memory->ptr(), i) : po;
    if (!(memory ? THPVariable_Check(po) : plain_tensor(po)) || !plain_tensor(mo)) return pybind11::bytes();
    const at::Tensor& p = THPVariable_Unpack(po);
    const at::Tensor& m = THPVariable_Unpack(mo);
    if (p.is_inference() || m.is_inference()) return pybind11::bytes();
    out.push_back(static_cast<int64_t>(p.unsafeGetTensorImpl()->version_counter().current_version()));
    // and its memory: after a swap_tensors or a `p.data = t` the counter is another tensor's, of any count
    out.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(m.data_ptr())));
  }
  return pybind11::bytes(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(int64_t));
}

// Which of the policy's states (bit k: state k in optim_policies() order) a step with these hyperparameter
// values reads and writes (a tensor hyperparameter's number is ignored: no state depends on one). The
// operator checks and touches only those; the planned path checks only those too.
int64_t optim_state_mask(const std::string& policy, const std::vector<double>& hyper) {
  mpf::OptimKind kind;
  if (!mpf::optim_kind(policy.c_str(), &kind)) fail("unknown optimizer policy '" + policy + "'");
  int64_t mask = 0;
  mpf::dispatch_optim(kind, [&](auto p) {
    using P = decltype(p);
    if (hyper.size() != static_cast<size_t>(P::kNumHyper))
      fail("hyper must have " + std::to_string(P::kNumHyper) + " values, got " + std::to_string(hyper.size()));
    double values[mpf::kMaxHyper] = {};
    std::copy(hyper.begin(), hyper.end(), values);
    mask = P::state_mask(P::flags(P::make(values)));
  });
  return mask;
}

// FusedOptimizer.step()'s planned path (_StepPlan.match): whether each state dict in `states` (or None: a
// param without state) still holds under each of `names` the very object that `expected[j][i]` holds (None:
// no entry), as it did when the plan was made. Identity only; no object is compared by value.
bool same_entries(const pybind11::list& states, const pybind11::tuple& names, const pybind11::list& expected) {
  const Py_ssize_t n = PyList_GET_SIZE(states.ptr()), k = PyTuple_GET_SIZE(names.ptr());
  if (PyList_GET_SIZE(expected.ptr()) != k) return false;
  for (Py_ssize_t j = 0; j < k; ++j) {
    PyObject* const column = PyList_GET_ITEM(expected.ptr(), j);
    if (!PyList_Check(column) || PyList_GET_SIZE(column) != n) return false;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* const state = PyList_GET_ITEM(states.ptr(), i);
    if (state != Py_None && !PyDict_Check(state)) return false;
    for (Py_ssize_t j = 0; j < k; ++j) {
      PyObject* entry = nullptr;
      if (state != Py_None) {
        entry = PyDict_GetItemWithError(state, PyTuple_GET_ITEM(names.ptr(), j));  // borrowed
        if (!entry && PyErr_Occurred()) throw pybind11::error_already_set();
      }
      if ((entry ? entry : Py_None) != PyList_GET_ITEM(PyList_GET_ITEM(expected.ptr(), j), i)) return false;
    }
  }
  return true;
}

// FusedOptimizer.step()'s full path (_check_state_entries, which makes the message): the index of the first
// param of `params` whose state dict (`states[i]`) holds an entry the operator would refuse, else -1. `checks`
// holds (key, int16, kind) per entry the operator may take: none may be other than a tensor; kind 0 a tensor
// of the param's shape, 1 a step count (one element), 2 a state the step leaves alone (its type only), 3 the
// FP32 master (checked for a 16-bit param where `masters` says the group keeps one); int16 for the
// remainder, else float32; on the param's device. One pass in C++: the Python checks took about 1 us a param.
int64_t state_entries_check(const pybind11::list& params, const pybind11::list& states, const pybind11::tuple& checks,
                            bool masters) {
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr()), k = PyTuple_GET_SIZE(checks.ptr());
  if (PyList_GET_SIZE(states.ptr()) != n) fail("states must have one entry per param");
  std::vector<PyObject*> keys(static_cast<size_t>(k));
  std::vector<at::ScalarType> dtypes(static_cast<size_t>(k));
  std::vector<long> kinds(static_cast<size_t>(k));
  for (Py_ssize_t j = 0; j < k; ++j) {
    const pybind11::tuple c = pybind11::reinterpret_borrow<pybind11::tuple>(PyTuple_GET_ITEM(checks.ptr(), j));
    keys[j] = c[0].ptr();
    dtypes[j] = c[1].cast<bool>() ? at::kShort : at::kFloat;
    kinds[j] = c[2].cast<long>();
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* const po = PyList_GET_ITEM(params.ptr(), i);
    PyObject* const state = PyList_GET_ITEM(states.ptr(), i);
    if (!THPVariable_Check(po) || !PyDict_Check(state)) return i;
    const at::Tensor& p = THPVariable_Unpack(po);
    for (Py_ssize_t j = 0; j < k; ++j) {
      PyObject* const entry = PyDict_GetItemWithError(state, keys[j]);  // borrowed
      if (!entry) {
        if (PyErr_Occurred()) throw pybind11::error_already_set();
        continue;
      }
      if (entry == Py_None) continue;
      if (!THPVariable_Check(entry)) return i;
      if (kinds[j] == 2 || (kinds[j] == 3 && (!masters || p.scalar_type() == at::kFloat))) continue;
      const at::Tensor& t = THPVariable_Unpack(entry);
      if (t.scalar_type() != dtypes[j] || t.device() != p.device() ||
          (kinds[j] == 1 ? t.numel() != 1 : t.sizes() != p.sizes()))
        return i;
    }
  }
  return -1;
}

// The memory a tensor's elements occupy, as byte spans [lo, hi) on a device (key: type << 16 | index + 1): one
// span for a dense tensor (no gaps, no element twice); else one per run of elements adjacent in memory (along
// the dimension of stride 1, if any, else one element a run), so that two tensors that interleave (buf[:, :2]
// and buf[:, 2:]) share none. Past kMaxRuns runs, the tensor's whole extent (conservative). Nothing for a
// tensor without elements or memory.
struct MemSpan {
  int64_t device;
  uintptr_t lo, hi;
  int64_t owner;
  PyObject* key;  // borrowed; what the owner's span is (state_overlap: None for the param, Ellipsis for its grad)
};
constexpr int64_t kMaxRuns = int64_t{1} << 20;

void add_spans(std::vector<MemSpan>& out, const at::Tensor& t, int64_t owner, PyObject* key) {
  if (t.numel() == 0 || !t.has_storage() || t.is_meta() || t.layout() != at::kStrided) return;
  const auto base = reinterpret_cast<uintptr_t>(t.data_ptr());
  if (base == 0) return;  // (no memory: nothing to share)
  const int64_t device = static_cast<int64_t>(t.device().type()) << 16 | (t.device().index() + 1);
  const auto es = static_cast<uintptr_t>(t.element_size());
  if (t.is_non_overlapping_and_dense()) {
    out.push_back({device, base, base + static_cast<uintptr_t>(t.numel()) * es, owner, key});
    return;
  }
  std::vector<int64_t> sizes, strides;  // the dimensions of more than one element
  int64_t run = 1, last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) == 1) continue;
    last += (t.size(d) - 1) * t.stride(d);
    if (t.stride(d) == 1 && run == 1) {
      run = t.size(d);  // the run's dimension
    } else {
      sizes.push_back(t.size(d));
      strides.push_back(t.stride(d));
    }
  }
  if (t.numel() / run > kMaxRuns) {
    out.push_back({device, base, base + static_cast<uintptr_t>(last + 1) * es, owner, key});
    return;
  }
  std::vector<int64_t> index(sizes.size(), 0);
  int64_t offset = 0;
  for (;;) {
    const uintptr_t lo = base + static_cast<uintptr_t>(offset) * es;
    out.push_back({device, lo, lo + static_cast<uintptr_t>(run) * es, owner, key});
    size_t d = sizes.size();
    for (; d > 0; --d) {  // the next run: an odometer over the other dimensions
      if (++index[d - 1] < sizes[d - 1]) {
        offset += strides[d - 1];
        break;
      }
      offset -= (sizes[d - 1] - 1) * strides[d - 1];
      index[d - 1] = 0;
    }
    if (d == 0) return;
  }
}

void sort_spans(std::vector<MemSpan>& spans) {
  std::sort(spans.begin(), spans.end(), [](const MemSpan& a, const MemSpan& b) {
    return a.device != b.device ? a.device < b.device : a.lo < b.lo;
  });
}

// The first two spans of different (owner, key) that overlap, sorted spans (sort_spans) in, else nullptrs. A sweep
// that keeps the span reaching furthest and the one reaching furthest among the other (owner, key)s: a span that
// overlaps any before it overlaps one of those two, and one tensor's own runs are never reported.
std::pair<const MemSpan*, const MemSpan*> first_overlap(const std::vector<MemSpan>& spans) {
  const MemSpan* reach = nullptr;  // the span before, on this device, that ends furthest
  const MemSpan* other = nullptr;  // the same among the spans of another (owner, key) than reach's
  const auto same = [](const MemSpan* a, const MemSpan* b) { return a->owner == b->owner && a->key == b->key; };
  for (const MemSpan& s : spans) {
    if (reach && reach->device != s.device) reach = other = nullptr;
    if (reach) {
      const MemSpan* before = same(reach, &s) ? other : reach;
      if (before && s.lo < before->hi) return {before, &s};
    }
    if (!reach || s.hi > reach->hi) {
      if (reach && !same(reach, &s)) other = reach;
      reach = &s;
    } else if (!same(reach, &s) && (!other || s.hi > other->hi)) {
      other = &s;
    }
  }
  return {nullptr, nullptr};
}

// FusedOptimizer.step()'s full path, after state_entries_check: the first two tensors that a step writes in
// place and that share memory, as (i, key_i, j, key_j): positions in `params` and what each is (None: the param
// itself; Ellipsis: its grad; else a state entry's key); else None. Written in place are the params and the
// state entries the step takes as they are: `checks_list[group_of[i]]` holds (checks, masters, remainder) for
// param i's group, with state_entries_check's checks; kind 2 (a state the step leaves alone) is not taken, nor a
// master or a remainder the group does not keep; and with `grads` (one per param, a scaled or clipped step,
// which writes each grad back), the grads. An entry set by hand over another's memory (state['exp_avg'] =
// state['exp_avg_sq'], or a param's own tensor) was updated twice from the same old values, one write lost, in
// silence; a grad shared by two params, or over another param or state, was unscaled twice or wrote its unscaled
// values there. Over every group at once: the operator checks only its own call's tensors. (A strided state
// entry is moved to its param's layout by the step, so it shares nothing; its spans are exact anyway.)
pybind11::object state_overlap(const pybind11::list& params, const pybind11::list& states,
                               const std::vector<int64_t>& group_of, const pybind11::list& checks_list,
                               const std::optional<pybind11::list>& grads) {
  const Py_ssize_t n = PyList_GET_SIZE(params.ptr());
  if (PyList_GET_SIZE(states.ptr()) != n || static_cast<Py_ssize_t>(group_of.size()) != n ||
      (grads && PyList_GET_SIZE(grads->ptr()) != n))
    fail("states, group_of and grads must have one entry per param");
  struct Checks {
    std::vector<PyObject*> keys;
    std::vector<long> kinds;
    std::vector<bool> int16;
    bool masters, remainder;
  };
  std::vector<Checks> groups;
  for (const pybind11::handle g : checks_list) {
    const auto t = g.cast<pybind11::tuple>();
    Checks c;
    for (const pybind11::handle e : t[0].cast<pybind11::tuple>()) {
      const auto entry = e.cast<pybind11::tuple>();
      c.keys.push_back(entry[0].ptr());
      c.int16.push_back(entry[1].cast<bool>());
      c.kinds.push_back(entry[2].cast<long>());
    }
    c.masters = t[1].cast<bool>();
    c.remainder = t[2].cast<bool>();
    groups.push_back(std::move(c));
  }
  std::vector<MemSpan> spans;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* const po = PyList_GET_ITEM(params.ptr(), i);
    PyObject* const state = PyList_GET_ITEM(states.ptr(), i);
    const int64_t gi = group_of[static_cast<size_t>(i)];
    if (!THPVariable_Check(po) || gi < 0 || gi >= static_cast<int64_t>(groups.size())) fail("bad params or group_of");
    const at::Tensor& p = THPVariable_Unpack(po);
    add_spans(spans, p, i, Py_None);
    if (grads) {
      PyObject* const go = PyList_GET_ITEM(grads->ptr(), i);
      if (THPVariable_Check(go)) add_spans(spans, THPVariable_Unpack(go), i, Py_Ellipsis);
    }
    if (!PyDict_Check(state)) continue;
    const Checks& c = groups[static_cast<size_t>(gi)];
    for (size_t j = 0; j < c.keys.size(); ++j) {
      const long kind = c.kinds[j];
      if (kind == 2 || (kind == 3 && (!c.masters || p.scalar_type() == at::kFloat)) || (c.int16[j] && !c.remainder))
        continue;
      PyObject* const entry = PyDict_GetItemWithError(state, c.keys[j]);  // borrowed
      if (!entry) {
        if (PyErr_Occurred()) throw pybind11::error_already_set();
        continue;
      }
      if (THPVariable_Check(entry)) add_spans(spans, THPVariable_Unpack(entry), i, c.keys[j]);
    }
  }
  sort_spans(spans);
  const auto [a, b] = first_overlap(spans);
  if (!a) return pybind11::none();
  const auto key = [](PyObject* k) { return pybind11::reinterpret_borrow<pybind11::object>(k); };
  return pybind11::make_tuple(a->owner, key(a->key), b->owner, key(b->key));
}

// The planned step's side of the same check (FusedOptimizer.step): memory_spans packs, when a plan is made, the
// spans of the tensors every group's step writes in place (params and state entries, which the full path found
// apart and whose memory the plan's layouts hold), sorted; shared_grads then finds, at each scaled or clipped
// step, the first grad over another grad, as (i, j, 0) (i < j), or over one of those tensors, as (i, owner, 1),
// else None.
pybind11::bytes memory_spans(const pybind11::list& tensors, const std::vector<int64_t>& owners) {
  const Py_ssize_t n = PyList_GET_SIZE(tensors.ptr());
  if (static_cast<Py_ssize_t>(owners.size()) != n) fail("owners must have one entry per tensor");
  std::vector<MemSpan> spans;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* const o = PyList_GET_ITEM(tensors.ptr(), i);
    if (THPVariable_Check(o)) add_spans(spans, THPVariable_Unpack(o), owners[static_cast<size_t>(i)], nullptr);
  }
  sort_spans(spans);
  std::vector<int64_t> out;
  out.reserve(spans.size() * 4);
  for (const MemSpan& m : spans) {
    out.push_back(m.device);
    out.push_back(static_cast<int64_t>(m.lo));
    out.push_back(static_cast<int64_t>(m.hi));
    out.push_back(m.owner);
  }
  return pybind11::bytes(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(int64_t));
}

pybind11::object shared_grads(const pybind11::list& grads, const pybind11::bytes& written) {
  std::vector<MemSpan> spans;
  const Py_ssize_t n = PyList_GET_SIZE(grads.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* const go = PyList_GET_ITEM(grads.ptr(), i);
    if (THPVariable_Check(go)) add_spans(spans, THPVariable_Unpack(go), i, nullptr);
  }
  sort_spans(spans);
  if (const auto [a, b] = first_overlap(spans); a)
    return pybind11::make_tuple(std::min(a->owner, b->owner), std::max(a->owner, b->owner), 0);
  // Each grad span against the written spans (apart from each other, sorted): only the last that starts before
  // the grad's end can reach into it.
  const std::string_view w = written;
  const auto* const packed = reinterpret_cast<const int64_t*>(w.data());
  const size_t m = w.size() / (4 * sizeof(int64_t));
  const auto before = [](const int64_t* e, int64_t device, uintptr_t hi) {  // e starts before (device, hi)
    return e[0] != device ? e[0] < device : static_cast<uintptr_t>(e[1]) < hi;
  };
  for (const MemSpan& g : spans) {
    size_t lo = 0, hi = m;  // the first written span not before (device, g.hi)
    while (lo < hi) {
      const size_t mid = (lo + hi) / 2;
      if (before(packed + 4 * mid, g.device, g.hi)) lo = mid + 1;
      else hi = mid;
    }
    if (lo > 0) {
      const int64_t* e = packed + 4 * (lo - 1);
      if (e[0] == g.device && static_cast<uintptr_t>(e[2]) > g.lo) return pybind11::make_tuple(g.owner, e[3], 1);
    }
  }
  return pybind11::none();
}


// The Python arguments of a direct operator call (below) as the schema's tensors: each a plain tensor (see
// plain_tensor) or None where optional; anything else clears `ok`, and the caller then returns false having
// called nothing (Python goes through torch.ops, which hands a subclass its __torch_function__, or raises
// the wrapper's clear error for a wrong type).
struct PlainArgs {
  bool ok = true;
  std::optional<at::Tensor> optional(pybind11::handle o) {
    if (o.is_none()) return std::nullopt;
    return tensor(o);
  }
  at::Tensor tensor(pybind11::handle o) {
    if (!plain_tensor(o.ptr())) {
      ok = false;
      return {};
    }
    at::Tensor t = THPVariable_Unpack(o.ptr());
    if (t.layout() != at::kStrided || t.is_nested()) ok = false;  // (the Python path names the argument)
    return t;
  }
  std::vector<at::Tensor> list(pybind11::handle o) {
    std::vector<at::Tensor> out;
    if (!PyList_Check(o.ptr())) {
      ok = false;
      return out;
    }
    out.reserve(PyList_GET_SIZE(o.ptr()));
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(o.ptr()); ++i) out.push_back(tensor(PyList_GET_ITEM(o.ptr(), i)));
    return out;
  }
};

// FusedOptimizer.step()'s planned path in eager mode (mpfused._ops.optim_step_direct): torch.ops.mpfused.optim_step_
// with OptimCall.args, called through the dispatcher from here (autograd's version counters, the profiler,
// dispatch modes, the CPU or CUDA kernel: as through torch.ops), without torch.ops' generic conversion of each
// Python argument to its schema type, which costs ~11 us a call for this schema's 25 arguments, more than the
// rest of a one-tensor step (torch's own operators have generated bindings for the same reason). That
// conversion also hands a tensor subclass's __torch_function__ the call: so where a scalar argument is not
// a plain tensor, this returns false having done nothing, and the caller goes through torch.ops (the params,
// grads and state of a plan are plain: step_layout checks them; the caller checks for torch function modes).
bool optim_step_call(const std::string& policy, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                     const std::vector<at::Tensor>& masters, const std::vector<int64_t>& master_index,
                     const std::vector<at::Tensor>& remainders, const std::vector<int64_t>& remainder_index,
                     const std::vector<at::Tensor>& states, const std::vector<int64_t>& state_index,
                     const std::vector<at::Tensor>& steps, const std::vector<int64_t>& step_index, double lr,
                     pybind11::handle lr_tensor, const std::vector<double>& hyper, const pybind11::list& hyper_tensors,
                     pybind11::handle inv_scale, pybind11::handle grad_scale, pybind11::handle clip_sumsq, double max_norm,
                     pybind11::handle found_inf, pybind11::handle counter, bool write_grad, const std::string& rounding,
                     int64_t seed, const std::vector<int64_t>& sr_offsets) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mpfused::optim_step_", "")
          .typed<void(c10::string_view, at::TensorList, at::TensorList, at::TensorList, at::IntArrayRef, at::TensorList,
                      at::IntArrayRef, at::TensorList, at::IntArrayRef, at::TensorList, at::IntArrayRef, double,
                      const std::optional<at::Tensor>&, at::ArrayRef<double>, const c10::List<std::optional<at::Tensor>>&,
                      const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                      double, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, bool, c10::string_view,
                      int64_t, at::IntArrayRef)>();
  PlainArgs in;
  c10::List<std::optional<at::Tensor>> hyper_list;
  hyper_list.reserve(hyper_tensors.size());
  for (const pybind11::handle t : hyper_tensors) hyper_list.push_back(in.optional(t));
  const std::optional<at::Tensor> lr_t = in.optional(lr_tensor), inv_t = in.optional(inv_scale),
                                  scale_t = in.optional(grad_scale), clip_t = in.optional(clip_sumsq),
                                  found_t = in.optional(found_inf), counter_t = in.optional(counter);
  if (!in.ok) return false;
  const pybind11::gil_scoped_release no_gil;
  op.call(policy, params, grads, masters, master_index, remainders, remainder_index, states, state_index, steps, step_index,
          lr, lr_t, hyper, hyper_list, inv_t, scale_t, clip_t, max_norm, found_t, counter_t, write_grad, rounding, seed,
          sr_offsets);
  return true;
}

// mpfused._ops.non_finite_check_ in eager mode, as optim_step_call: torch.ops.mpfused.non_finite_check_ (or
// unscale_check_ with `unscale`) through the dispatcher, without torch.ops' per-argument conversion; false,
// having called nothing, where an argument is not a plain tensor (or None where optional) or `tensors` not a list.
bool overflow_call(bool unscale, pybind11::handle tensors, pybind11::handle found_inf, pybind11::handle inv_scale,
                   pybind11::handle sumsq, bool overwrite, pybind11::handle norm, pybind11::handle counter) {
  using Opt = const std::optional<at::Tensor>&;
  static const auto check = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("mpfused::non_finite_check_", "")
                                .typed<void(at::TensorList, const at::Tensor&, Opt, Opt, bool, Opt, Opt)>();
  static const auto unscale_check =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mpfused::unscale_check_", "")
          .typed<void(at::TensorList, const at::Tensor&, const at::Tensor&, Opt, bool, Opt, Opt)>();
  PlainArgs in;
  const std::vector<at::Tensor> list = in.list(tensors);
  const at::Tensor found = in.tensor(found_inf);
  const std::optional<at::Tensor> inv = in.optional(inv_scale), sums = in.optional(sumsq), n = in.optional(norm),
                                  c = in.optional(counter);
  if (!in.ok || (unscale && !inv)) return false;
  const pybind11::gil_scoped_release no_gil;
  if (unscale) unscale_check.call(list, found, *inv, sums, overwrite, n, c);
  else check.call(list, found, inv, sums, overwrite, n, c);
  return true;
}

// mpfused._ops.loss_scale_update_ in eager mode, as optim_step_call.
bool loss_scale_update_call(pybind11::handle scale, pybind11::handle growth_tracker, pybind11::handle hysteresis_left,
                            pybind11::handle skipped_steps, pybind11::handle found_inf, pybind11::handle inv_scale,
                            double growth_factor, double backoff_factor, int64_t growth_interval, int64_t hysteresis,
                            double min_scale, double max_scale, bool dynamic) {
  using T = const at::Tensor&;
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mpfused::loss_scale_update_", "")
                             .typed<void(T, T, T, T, T, const std::optional<at::Tensor>&, double, double, int64_t,
                                         int64_t, double, double, bool)>();
  PlainArgs in;
  const at::Tensor s = in.tensor(scale), g = in.tensor(growth_tracker), h = in.tensor(hysteresis_left),
                   k = in.tensor(skipped_steps), f = in.tensor(found_inf);
  const std::optional<at::Tensor> inv = in.optional(inv_scale);
  if (!in.ok) return false;
  const pybind11::gil_scoped_release no_gil;
  op.call(s, g, h, k, f, inv, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale, dynamic);
  return true;
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
  d["cpu_isa"] = mpf::cpu_isa_name(mpf::cpu_isa());  // throws on a bad MPFUSED_CPU_ISA
  d["cpu_isa_supported"] = mpf::cpu_supported_isas();
#ifdef _OPENMP
  d["openmp"] = true;
#else
  d["openmp"] = false;
#endif
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mpfused's native extension: build facts; the kernels are torch.ops.mpfused.* (see mpfused._ops)";
  m.def("build_info", &build_info, "What this extension was compiled with.");
  m.def("overflow_limits", &overflow_limits, "Chunk size and per-launch capacities of the overflow reduction.");
  m.def("overflow_planned_launches", &overflow_planned_launches, pybind11::arg("numel"), pybind11::arg("device_type"),
        "Launches the overflow reduction makes for tensors of these sizes.");
  m.def("gemm_cuda_kernel", &gemm_cuda_kernel, pybind11::arg("index"),
        "The CUDA GEMM kernel aligned operands take on this device: 'wgmma', 'wgmma-cluster' or 'wmma' (MPFUSED_GEMM_KERNEL).");
  m.def("fixed_matmul_cuda_kernel", &fixed_matmul_cuda_kernel, pybind11::arg("index"),
        "The CUDA kernel of fixed_point.matmul for int16 codes on this device: 'tensor-cores' or 'cuda-cores' "
        "(MPFUSED_FIXED_MATMUL_KERNEL).");
  m.def("gemm_last_cuda_launch", &gemm_last_cuda_launch,
        "(kernel, passed_over) of this thread's last CUDA GEMM: the kernel that ran ('wgmma', 'wgmma-cluster', 'wmma' "
        "or None), and why the Hopper kernel, selected, did not run (or None).");
  m.def("gemm_unsupported", &gemm_unsupported, pybind11::arg("dtype"), pybind11::arg("index"),
        "Empty when the CUDA GEMM runs these inputs on this device, else why not.");
  m.def("step_layout", &step_layout, pybind11::arg("params"), pybind11::arg("grads"), pybind11::arg("beside"),
        pybind11::arg("remainders"), pybind11::arg("steps"),
        "None unless each grad and state entry goes with its param in an optimizer step; else the params' "
        "layouts as bytes.");
  m.def("step_versions", &step_versions, pybind11::arg("params"), pybind11::arg("masters"), pybind11::arg("remainders"),
        pybind11::arg("memory") = pybind11::none(),
        "The version counters of the params with a master or a remainder, as bytes (empty where the lists do not match).");
  m.def("optim_state_mask", &optim_state_mask, pybind11::arg("policy"), pybind11::arg("hyper"),
        "Which of the policy's states a step with these hyperparameter values uses (bit k: state k).");
  m.def("state_overlap", &state_overlap, pybind11::arg("params"), pybind11::arg("states"), pybind11::arg("group_of"),
        pybind11::arg("checks_list"), pybind11::arg("grads") = pybind11::none(),
        "The first two tensors a step writes in place (params, state entries) that share memory, else None.");
  m.def("memory_spans", &memory_spans, pybind11::arg("tensors"), pybind11::arg("owners"),
        "The memory of tensors that a step writes, sorted, for shared_grads.");
  m.def("shared_grads", &shared_grads, pybind11::arg("grads"), pybind11::arg("written"),
        "The first grad over another grad, (i, j, 0), or over memory_spans' memory, (i, owner, 1); else None.");
  m.def("state_entries_check", &state_entries_check, pybind11::arg("params"), pybind11::arg("states"),
        pybind11::arg("checks"), pybind11::arg("masters"),
        "The index of the first param whose state holds an entry the optimizer's operator would refuse, else -1.");
  m.def("same_entries", &same_entries, pybind11::arg("states"), pybind11::arg("names"), pybind11::arg("expected"),
        "Whether each state dict holds under each name the object expected (identity).");
  m.def("optim_step_call", &optim_step_call,
        "torch.ops.mpfused.optim_step_ through the dispatcher, positional arguments; False (nothing done) where a "
        "scalar argument is a tensor subclass.");
  m.def("overflow_call", &overflow_call,
        "torch.ops.mpfused.non_finite_check_ (unscale_check_ with unscale) through the dispatcher; False (nothing "
        "done) where an argument is not a plain tensor.");
  m.def("loss_scale_update_call", &loss_scale_update_call,
        "torch.ops.mpfused.loss_scale_update_ through the dispatcher; False (nothing done) where an argument is not "
        "a plain tensor.");
  m.def("optim_policies", &optim_policies, "The optimizer policies: their state and hyperparameter names, in kernel order.");
}
