// The only C++ file that knows torch: it validates at::Tensor arguments, turns them into the plain
// structs of kernels.h, picks the CPU or CUDA backend by device, and defines the pybind11 module.
//
// Every check runs before any backend is called, so a call that raises has modified nothing.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <optional>
#include <sstream>
#include <string>
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

void non_finite_check_(const std::vector<at::Tensor>& tensors, const at::Tensor& found_inf,
                       const std::optional<at::Tensor>& inv_scale, bool unscale,
                       const std::optional<at::Tensor>& sumsq, bool overwrite,
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
                         sumsq ? sumsq->data_ptr<float>() : nullptr,
                         overwrite,
                         norm ? norm->data_ptr<float>() : nullptr,
                         counter_data};
  if (refs.empty() && !overwrite) return;  // overwrite still writes found_inf = 0 (and sumsq, norm)

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

// ---- fused optimizer step -------------------------------------------------------------------------
using TensorList = std::vector<at::Tensor>;
using OptTensorList = std::vector<std::optional<at::Tensor>>;

// The optimizer's kernels read a param, its grad, master and state as flat arrays, so each must lay its
// elements out in memory as the param does: same shape, and the same stride in every dim of size > 1
// (the stride of a size-1 dim never addresses memory). The param itself must be non-overlapping and dense
// (contiguous, channels_last, any permutation of a contiguous tensor); then so is every tensor with its layout.
bool same_layout(const at::Tensor& t, const at::Tensor& ref) {
  if (t.sizes() != ref.sizes()) return false;
  for (int64_t d = 0; d < ref.dim(); ++d)
    if (ref.size(d) > 1 && t.stride(d) != ref.stride(d)) return false;
  return true;
}

std::string describe_layout(const at::Tensor& t) {
  std::ostringstream s;
  s << describe(t) << " with strides " << t.strides();
  return s.str();
}

// A tensor that goes with a param (optimizer state, master weight, remainder): dtype `dtype` (`dtype_name` in
// messages), on `device`, with the param's shape and memory layout.
void check_beside_param(const at::Tensor& t, const std::string& name, at::ScalarType dtype, const char* dtype_name,
                        const at::Device& device, const at::Tensor& param) {
  check_dense(t, name);
  if (t.scalar_type() != dtype) fail(name + " must be " + dtype_name + ", got a " + describe(t));
  if (t.device() != device) fail(name + " must be on " + device.str() + " like its param, got a " + describe(t));
  if (t.sizes() != param.sizes()) fail(name + " must have its param's shape " + c10::str(param.sizes()) + ", got a " + describe(t));
  if (!same_layout(t, param))
    fail(name + " must have its param's memory layout (strides " + c10::str(param.strides()) + "), got a " +
         describe_layout(t));
}

// A float32 tensor beside its param (optimizer state, master weights).
float* state_ptr(const at::Tensor& t, const std::string& name, const at::Device& device, const at::Tensor& param) {
  check_beside_param(t, name, at::kFloat, "float32", device, param);
  return t.data_ptr<float>();
}

// An int16 remainder beside a BF16 param (master_weights="remainder", core/master_split.h).
int16_t* remainder_ptr(const at::Tensor& t, const std::string& name, const at::Device& device, const at::Tensor& param) {
  if (param.scalar_type() != at::kBFloat16)
    fail(name + " is given for a " + describe(param) + " param; remainders (master_weights='remainder') are for "
         "bfloat16 params only");
  check_beside_param(t, name, at::kShort, "int16", device, param);
  return t.data_ptr<int16_t>();
}

// A tensor hyperparameter (core/optim/common.h HyperRef): float32 or float64, one element, on the update's device.
mpf::HyperRef hyper_ref(const at::Tensor* t, const std::string& name, const at::Device& device) {
  if (!t) return {nullptr, false};
  check_dense(*t, name);
  if ((t->scalar_type() != at::kFloat && t->scalar_type() != at::kDouble) || t->numel() != 1)
    fail(name + " must be a float32 or float64 tensor with one element, got a " + describe(*t));
  if (t->device() != device) fail(name + " must be on " + device.str() + " like the params, got a " + describe(*t));
  return {t->data_ptr(), t->scalar_type() == at::kDouble};
}

const at::Tensor* opt(const OptTensorList& list, size_t i, const std::string& list_name, size_t n) {
  if (list.empty()) return nullptr;
  if (list.size() != n) fail(list_name + " must be empty or have one entry per param (" + std::to_string(n) + "), got " + std::to_string(list.size()));
  return list[i] ? &*list[i] : nullptr;
}

// Validates one device's params with their grads, masters or remainders, states (the policy's kStates, of
// which the step uses those in state_mask), step counters (required where need_step, and for the 16-bit
// params that a stochastic step rounds: its stream is the step number) and the stochastic rounding's
// element offsets; raises before anything is written.
std::vector<mpf::OptimTensor> optim_tensors(const TensorList& params, const TensorList& grads, const OptTensorList& masters,
                                            const OptTensorList& remainders, const std::vector<OptTensorList>& states,
                                            const char* const* state_names, uint32_t state_mask,
                                            const OptTensorList& steps, bool need_step, bool stochastic,
                                            const std::vector<uint64_t>& sr_offsets, at::Device& device) {
  const size_t n = params.size();
  if (grads.size() != n) fail("grads must have one entry per param (" + std::to_string(n) + "), got " + std::to_string(grads.size()));
  if (!sr_offsets.empty() && sr_offsets.size() != n)
    fail("sr_offsets must be empty or have one entry per param (" + std::to_string(n) + "), got " +
         std::to_string(sr_offsets.size()));
  std::vector<mpf::OptimTensor> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string idx = "[" + std::to_string(i) + "]";
    const at::Tensor& p = params[i];
    const at::Tensor& g = grads[i];
    check_dense(p, "params" + idx);
    const DType d = storage_dtype(p, "params" + idx);
    if (i == 0) {
      device = p.device();
      check_backend(device, "params[0]");
    }
    if (p.device() != device) fail("params" + idx + " is on " + p.device().str() + " but params[0] is on " + device.str() + "; group params by device");
    if (!p.is_non_overlapping_and_dense())
      fail("params" + idx + " must be dense (contiguous, channels_last or another permutation of a contiguous "
           "tensor), got a strided view " + describe_layout(p));
    if (!g.defined()) fail("grads" + idx + " must be a tensor, got None");
    check_plain(g, "grads" + idx);
    if (g.layout() != at::kStrided) fail("grads" + idx + " is sparse; the fused optimizers need dense gradients");
    if (g.scalar_type() != p.scalar_type()) fail("grads" + idx + " must have its param's dtype " + std::string(c10::toString(p.scalar_type())) + ", got a " + describe(g));
    if (g.sizes() != p.sizes()) fail("grads" + idx + " must have its param's shape " + c10::str(p.sizes()) + ", got a " + describe(g));
    if (g.device() != device) fail("grads" + idx + " must be on its param's device " + device.str() + ", got a " + describe(g));
    if (!same_layout(g, p))
      fail("grads" + idx + " must have its param's memory layout (strides " + c10::str(p.strides()) + "), got a " +
           describe_layout(g));
    mpf::OptimTensor t{};
    t.param = p.data_ptr();
    t.grad = g.data_ptr();
    t.numel = p.numel();
    t.dtype = d;
    if (const at::Tensor* m = opt(masters, i, "masters", n)) t.master = state_ptr(*m, "masters" + idx, device, p);
    if (const at::Tensor* r = opt(remainders, i, "remainders", n)) {
      if (t.master) fail("params" + idx + " has a master and a remainder; give one of the two");
      t.remainder = remainder_ptr(*r, "remainders" + idx, device, p);
    }
    const bool rounds_sr = stochastic && d != DType::kFloat32 && !t.remainder;
    if (!sr_offsets.empty()) {
      t.sr_offset = sr_offsets[i];
      if (t.numel > 0 && t.sr_offset > UINT64_MAX - static_cast<uint64_t>(t.numel - 1))  // the last index fits
        fail("sr_offsets" + idx + " + the param's numel must be at most 2**64, got " + std::to_string(t.sr_offset));
    } else if (rounds_sr) {
      fail("sr_offsets is required with rounding='stochastic' (the Philox index of each param's first element)");
    }
    for (size_t k = 0; k < states.size(); ++k) {
      const at::Tensor* s = opt(states[k], i, state_names[k], n);
      if (!((state_mask >> k) & 1u)) continue;  // a state this step does not use is not touched
      if (!s) fail(std::string(state_names[k]) + idx + " is required");
      t.state[k] = state_ptr(*s, state_names[k] + idx, device, p);
    }
    const at::Tensor* st = opt(steps, i, "steps", n);
    if (need_step || rounds_sr) {
      if (!st) fail("steps" + idx + " is required" + std::string(need_step ? "" : " (rounding='stochastic': the step number is its random stream)"));
      check_scalar(*st, "steps" + idx, device);
      t.step = st->data_ptr<float>();
    }
    out.push_back(t);
  }
  return out;
}

void check_hyper(double v, const char* name, double lo, bool lo_open, double hi, bool hi_open) {
  if (!std::isfinite(v) || v < lo || (lo_open && v == lo) || v > hi || (hi_open && v == hi)) {
    std::ostringstream s;
    s << "invalid " << name << ": " << v << " (expected a finite value in " << (lo_open ? "(" : "[") << lo << ", " << hi
      << (hi_open ? ")" : "]") << ")";
    fail(s.str());
  }
}

void fill_common(mpf::OptimArgs& a, double lr, const std::optional<at::Tensor>& lr_tensor,
                 const std::optional<at::Tensor>& inv_scale, const std::optional<at::Tensor>& clip_sumsq, double max_norm,
                 const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& grad_scale,
                 const at::Device& device) {
  if (grad_scale) {
    if (inv_scale) fail("pass inv_scale or grad_scale, not both");
    check_scalar(*grad_scale, "grad_scale", device);
    a.grad_scale = grad_scale->data_ptr<float>();
  }
  if (clip_sumsq) {
    check_scalar(*clip_sumsq, "clip_sumsq", device);
    if (!(max_norm >= 0.0)) fail("max_norm must be >= 0 (infinite: no clipping), got " + std::to_string(max_norm));
    a.clip_sumsq = clip_sumsq->data_ptr<float>();
    a.max_norm = static_cast<float>(max_norm);
  }
  a.lr = lr;
  if (lr_tensor) {
    check_scalar(*lr_tensor, "lr", device);
    a.lr_ptr = lr_tensor->data_ptr<float>();
  } else {
    check_hyper(lr, "lr", 0.0, false, INFINITY, false);
  }
  if (inv_scale) check_scalar(*inv_scale, "inv_scale", device);
  if (found_inf) check_scalar(*found_inf, "found_inf", device);
  a.inv_scale = inv_scale ? inv_scale->data_ptr<float>() : nullptr;
  a.found_inf = found_inf ? found_inf->data_ptr<float>() : nullptr;
}

void run_optim(const mpf::OptimArgs& a, const at::Device& device) {
  if (device.is_cpu()) {
    mpf::optim_step_cpu(a, at::get_num_threads());
    return;
  }
#ifdef MPFUSED_WITH_CUDA
  const c10::cuda::CUDAGuard guard(device);
  TorchScratch scratch{{}, device};
  mpf::optim_step_cuda(a, mpf::ScratchAllocator{&scratch, &TorchScratch::alloc},
                       c10::cuda::getCurrentCUDAStream(device.index()).stream());
#endif
}

// The policies' names, states and hyperparameters (core/optim/registry.h), for mpfused._ops.
pybind11::dict optim_policies() {
  pybind11::dict out;
  mpf::dispatch_optim_all([&](auto policy) {
    using P = decltype(policy);
    pybind11::list states, hyper;
    for (int k = 0; k < P::kNumStates; ++k) states.append(P::kStates[k]);
    for (int i = 0; i < P::kNumHyper; ++i) hyper.append(P::kHyper[i].name);
    pybind11::dict d;
    d["states"] = states;
    d["hyper"] = hyper;
    out[P::kName] = d;
  });
  return out;
}

template <class P>
void optim_step_with(const TensorList& params, const TensorList& grads, const OptTensorList& masters,
                     const OptTensorList& remainders, const std::vector<OptTensorList>& states, const OptTensorList& steps, double lr,
                     const std::optional<at::Tensor>& lr_tensor, const std::vector<double>& hyper,
                     const OptTensorList& hyper_tensors, const std::optional<at::Tensor>& inv_scale,
                     const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& clip_sumsq,
                     double max_norm, const std::optional<at::Tensor>& found_inf,
                     const std::optional<at::Tensor>& counter, bool write_grad, mpf::Rounding rounding,
                     uint64_t seed, const std::vector<uint64_t>& sr_offsets) {
  const std::string where = std::string(" (") + P::kName + ")";
  if (hyper.size() != static_cast<size_t>(P::kNumHyper))
    fail("hyper must have " + std::to_string(P::kNumHyper) + " values" + where + ", got " + std::to_string(hyper.size()));
  if (!hyper_tensors.empty() && hyper_tensors.size() != static_cast<size_t>(P::kNumHyper))
    fail("hyper_tensors must be empty or have " + std::to_string(P::kNumHyper) + " entries" + where + ", got " +
         std::to_string(hyper_tensors.size()));
  if (states.size() != static_cast<size_t>(P::kNumStates))
    fail("states must have " + std::to_string(P::kNumStates) + " lists" + where + ", got " + std::to_string(states.size()));
  // A value given as a tensor (only where the policy allows one) is read by the update itself, on the
  // device (mpfused.optim checks it when the optimizer is built); its number here is ignored.
  double values[mpf::kMaxHyper] = {};
  for (int i = 0; i < P::kNumHyper; ++i) {
    const mpf::HyperSpec& spec = P::kHyper[i];
    values[i] = hyper[i];
    if (!hyper_tensors.empty() && hyper_tensors[i]) {
      if (!spec.tensor_ok) fail(std::string(spec.name) + " must be a number, not a tensor" + where);
      continue;
    }
    check_hyper(values[i], spec.name, spec.lo, spec.lo_open, spec.hi, spec.hi_open);
    if (spec.flag && values[i] != 0.0 && values[i] != 1.0)
      fail(std::string(spec.name) + " must be 0 or 1 (a flag)" + where + ", got " + std::to_string(values[i]));
  }
  const typename P::Hyper h = P::make(values);
  if (const char* e = P::check(h)) fail(e);
  if (params.empty()) {
    if (!lr_tensor) check_hyper(lr, "lr", 0.0, false, INFINITY, false);
    return;
  }
  // The states and the step count a step uses depend only on values that are never tensors.
  const uint32_t flags = P::flags(h);
  at::Device device(at::kCPU);
  const bool stochastic = rounding == mpf::Rounding::kStochastic;
  auto tensors = optim_tensors(params, grads, masters, remainders, states, P::kStates, P::state_mask(flags), steps,
                               P::needs_step(flags), stochastic, sr_offsets, device);
  mpf::OptimArgs a{};
  mpf::optim_kind(P::kName, &a.kind);
  a.tensors = tensors.data();
  a.num_tensors = static_cast<int64_t>(tensors.size());
  for (int i = 0; i < P::kNumHyper; ++i) {
    a.hyper[i] = values[i];
    if (!hyper_tensors.empty())
      a.hyper_ref[i] = hyper_ref(hyper_tensors[i] ? &*hyper_tensors[i] : nullptr, P::kHyper[i].name, device);
  }
  fill_common(a, lr, lr_tensor, inv_scale, clip_sumsq, max_norm, found_inf, grad_scale, device);
  a.counter = counter_ptr(counter, "counter", device);
  a.write_grad = write_grad;
  a.rounding = rounding;
  a.seed = seed;
  run_optim(a, device);
}

void optim_step_(const std::string& kind, const TensorList& params, const TensorList& grads,
                 const OptTensorList& masters, const OptTensorList& remainders,
                 const std::vector<OptTensorList>& states, const OptTensorList& steps,
                 double lr, const std::optional<at::Tensor>& lr_tensor, const std::vector<double>& hyper,
                 const OptTensorList& hyper_tensors, const std::optional<at::Tensor>& inv_scale,
                 const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& clip_sumsq,
                 double max_norm, const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& counter,
                 bool write_grad, const std::string& rounding, uint64_t seed, const std::vector<uint64_t>& sr_offsets) {
  mpf::OptimKind k;
  if (!mpf::optim_kind(kind.c_str(), &k)) fail("unknown optimizer policy '" + kind + "'");
  mpf::Rounding r;
  if (rounding == "nearest") r = mpf::Rounding::kNearest;
  else if (rounding == "stochastic") r = mpf::Rounding::kStochastic;
  else fail("rounding must be 'nearest' or 'stochastic', got '" + rounding + "'");
  mpf::dispatch_optim(k, [&](auto policy) {
    optim_step_with<decltype(policy)>(params, grads, masters, remainders, states, steps, lr, lr_tensor, hyper,
                                      hyper_tensors, inv_scale, grad_scale, clip_sumsq, max_norm, found_inf, counter,
                                      write_grad, r, seed, sr_offsets);
  });
}

// ---- loss scaling --------------------------------------------------------------------------------------
void loss_scale_update_(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& hysteresis_left,
                        const at::Tensor& skipped_steps, const at::Tensor& found_inf,
                        const std::optional<at::Tensor>& inv_scale, double growth_factor, double backoff_factor,
                        int64_t growth_interval, int64_t hysteresis, double min_scale, double max_scale, bool dynamic) {
  check_dense(scale, "scale");
  const at::Device device = scale.device();
  check_backend(device, "scale");
  check_scalar(scale, "scale", device);
  check_scalar(found_inf, "found_inf", device);
  if (inv_scale) check_scalar(*inv_scale, "inv_scale", device);
  const auto check_int = [&device](const at::Tensor& t, const std::string& name, at::ScalarType type) {
    check_dense(t, name);
    if (t.scalar_type() != type || t.numel() != 1 || t.device() != device)
      fail(name + " must be an " + c10::toString(type) + " tensor with one element on " + device.str() + ", got a " +
           describe(t));
  };
  check_int(growth_tracker, "growth_tracker", at::kInt);
  check_int(hysteresis_left, "hysteresis_left", at::kInt);
  check_int(skipped_steps, "skipped_steps", at::kLong);
  // torch's rule: growth_factor > 1, backoff_factor < 1 (an infinite growth factor never grows: the
  // product is not finite); NaN is refused.
  if (!(growth_factor > 1.0)) fail("growth_factor must be > 1, got " + std::to_string(growth_factor));
  if (!(backoff_factor < 1.0)) fail("backoff_factor must be < 1, got " + std::to_string(backoff_factor));
  check_hyper(min_scale, "min_scale", 0.0, false, 3.4e38, false);
  if (!(max_scale >= min_scale)) fail("max_scale must be >= min_scale (inf for no clamp)");
  if (growth_interval < 1 || growth_interval > INT32_MAX) fail("growth_interval must be a positive int32");
  if (hysteresis < 1 || hysteresis > INT32_MAX) fail("hysteresis must be a positive int32");
  mpf::LossScaleArgs a{scale.data_ptr<float>(), inv_scale ? inv_scale->data_ptr<float>() : nullptr,
                       growth_tracker.data_ptr<int32_t>(), hysteresis_left.data_ptr<int32_t>(),
                       skipped_steps.data_ptr<int64_t>(), found_inf.data_ptr<float>(),
                       mpf::LossScaleConfig{growth_factor, backoff_factor, static_cast<int32_t>(growth_interval),
                                            static_cast<int32_t>(hysteresis), min_scale, max_scale, dynamic}};
  if (device.is_cpu()) {
    mpf::loss_scale_update_cpu(a);
    return;
  }
#ifdef MPFUSED_WITH_CUDA
  const c10::cuda::CUDAGuard guard(device);
  mpf::loss_scale_update_cuda(a, c10::cuda::getCurrentCUDAStream(device.index()).stream());
#endif
}

// ---- GEMM ----------------------------------------------------------------------------------------------
// None, a name, or the Activation code (its numbering is the kernel ABI, core/gemm.h).
mpf::Activation parse_activation(const pybind11::handle& act) {
  if (act.is_none()) return mpf::Activation::kNone;
  if (pybind11::isinstance<pybind11::str>(act)) {
    const std::string s = act.cast<std::string>();
    if (s == "relu") return mpf::Activation::kRelu;
    if (s == "gelu") return mpf::Activation::kGelu;
    if (s == "gelu_erf") return mpf::Activation::kGeluErf;
  } else if (pybind11::isinstance<pybind11::int_>(act) && !pybind11::isinstance<pybind11::bool_>(act)) {
    const int64_t code = act.cast<int64_t>();
    if (code >= 0 && code <= 3) return static_cast<mpf::Activation>(code);
  }
  fail("activation must be None, 'relu', 'gelu' (tanh approximation) or 'gelu_erf' (or its code 0 to 3), got " +
       std::string(pybind11::repr(act)));
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

// out = act(alpha * a @ b + beta * c + bias), a new tensor; with return_pre_activation also the value
// before the activation (out itself when there is no activation). See mpfused.functional.gemm.
std::tuple<at::Tensor, std::optional<at::Tensor>> gemm(const at::Tensor& a, const at::Tensor& b,
                                                       const std::optional<at::Tensor>& bias,
                                                       const pybind11::object& activation, double alpha, double beta,
                                                       const std::optional<at::Tensor>& c,
                                                       std::optional<at::ScalarType> out_dtype,
                                                       bool return_pre_activation) {
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
    at::Tensor out = at::empty(shape, out_options);
    return {out, return_pre_activation ? std::optional<at::Tensor>(want_pre ? at::empty(shape, out_options) : out)
                                       : std::nullopt};
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
#endif
  }
  if (!return_pre_activation) return {out, std::nullopt};
  return {out, want_pre ? pre : out};
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
  m.doc() = "mpfused native kernels (see mpfused._ops for the typed Python wrappers)";
  m.def("build_info", &build_info, "What this extension was compiled with.");
  mpf_torch::bind_random(m);
  mpf_torch::bind_fixed_point(m);
  m.def("overflow_limits", &overflow_limits, "Chunk size and per-launch capacities of the overflow reduction.");
  m.def("overflow_planned_launches", &overflow_planned_launches, pybind11::arg("numel"), pybind11::arg("device_type"),
        "Launches the overflow reduction makes for tensors of these sizes.");
  m.def("optim_policies", &optim_policies, "The optimizer policies: their state and hyperparameter names, in kernel order.");
  m.def("optim_step_", &optim_step_, "Fused optimizer step of one policy over one device's params (see mpfused._ops).");
  m.def("loss_scale_update_", &loss_scale_update_, "Dynamic loss-scale update on the scaler's device tensors.");
  m.def("gemm", &gemm, pybind11::arg("a"), pybind11::arg("b"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("activation") = pybind11::none(), pybind11::arg("alpha") = 1.0, pybind11::arg("beta") = 0.0,
        pybind11::arg("c") = pybind11::none(), pybind11::arg("out_dtype") = pybind11::none(),
        pybind11::arg("return_pre_activation") = false,
        "FP16/BF16 GEMM with FP32 accumulation and a fused epilogue; returns (out, pre_activation or None).");
  m.def("non_finite_check_", &non_finite_check_, pybind11::arg("tensors"), pybind11::arg("found_inf"),
        pybind11::arg("inv_scale") = pybind11::none(), pybind11::arg("unscale") = false,
        pybind11::arg("sumsq") = pybind11::none(), pybind11::arg("overwrite") = false,
        pybind11::arg("norm") = pybind11::none(), pybind11::arg("counter") = pybind11::none(),
        "Multi-tensor inf/NaN check, optional unscale in place and sum of squares, in one pass.");
}
