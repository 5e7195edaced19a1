// torch.ops.mpfused.optim_step_: one fused step of an optimizer policy (csrc/core/optim/) over one device's
// params, with the unscale, clip and skip of a gradient scaler in the same pass. Every argument is checked
// before the backend runs, so a call that raises has modified nothing.
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "common.h"

namespace mpf_torch {
namespace {

using OptTensorList = std::vector<std::optional<at::Tensor>>;
// Per param, its tensor in an optional per-param list (master, remainder, state, step counter) or null: views
// of the operator's arguments, which outlive the call (no reference counts to move per tensor).
using TensorRefs = std::vector<const at::Tensor*>;

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

// Whether check_beside_param would take t: its checks as one test, without their messages (which are
// made only for a tensor that fails: a step checks a few tensors per param).
bool beside_ok(const at::Tensor& t, at::ScalarType dtype, const at::Device& device, const at::Tensor& param) {
  return plain_dense(t) && t.scalar_type() == dtype && t.device() == device && same_layout(t, param);
}

// A param's name in messages, made when one is needed: `list`[`i`].
std::string item(const char* list, size_t i) { return std::string(list) + "[" + std::to_string(i) + "]"; }

// A float32 tensor beside its param (optimizer state, master weights): `list`[`i`].
float* state_ptr(const at::Tensor& t, const char* list, size_t i, const at::Device& device, const at::Tensor& param) {
  if (!beside_ok(t, at::kFloat, device, param)) check_beside_param(t, item(list, i), at::kFloat, "float32", device, param);
  return static_cast<float*>(t.data_ptr());
}

// An int16 remainder beside a BF16 param (master_weights="remainder", core/master_split.h): remainders[`i`].
int16_t* remainder_ptr(const at::Tensor& t, size_t i, const at::Device& device, const at::Tensor& param) {
  if (param.scalar_type() != at::kBFloat16)
    fail(item("remainders", i) + " is given for a " + describe(param) + " param; remainders (master_weights='remainder') "
         "are for bfloat16 params only");
  if (!beside_ok(t, at::kShort, device, param)) check_beside_param(t, item("remainders", i), at::kShort, "int16", device, param);
  return static_cast<int16_t*>(t.data_ptr());
}

// A tensor hyperparameter (core/optim/common.h HyperRef): float32 or float64, one element, on the update's device.
mpf::HyperRef hyper_ref(const at::Tensor* t, const mpf::HyperSpec& spec, const at::Device& device) {
  if (!t) return {nullptr, false};
  const std::string name = spec.name;
  check_dense(*t, name);
  if ((t->scalar_type() != at::kFloat && t->scalar_type() != at::kDouble) || t->numel() != 1)
    fail(name + " must be a float32 or float64 tensor with one element, got a " + describe(*t));
  if (t->device() != device) fail(name + " must be on " + device.str() + " like the params, got a " + describe(*t));
  // On the CPU the value is checked like a number's (reading it costs no sync); a device tensor's value
  // was checked when it was set (mpfused.optim reads it there, as torch does), never in a step.
  if (device.is_cpu())
    check_hyper(t->scalar_type() == at::kDouble ? *t->data_ptr<double>() : *t->data_ptr<float>(), spec.name, spec.lo,
                spec.lo_open, spec.hi, spec.hi_open);
  return {t->data_ptr(), t->scalar_type() == at::kDouble};
}

const at::Tensor* opt(const TensorRefs& list, size_t i, const char* list_name, size_t n) {
  if (list.empty()) return nullptr;
  if (list.size() != n) fail(std::string(list_name) + " must be empty or have one entry per param (" + std::to_string(n) + "), got " + std::to_string(list.size()));
  return list[i];
}

// Validates one device's params with their grads, masters or remainders, states (the policy's kStates, of
// which the step uses those in state_mask), step counters (required where need_step, and for the 16-bit
// params that a stochastic step rounds: its stream is the step number) and the stochastic rounding's
// element offsets; raises before anything is written.
std::vector<mpf::OptimTensor> optim_tensors(at::TensorList params, at::TensorList grads, const TensorRefs& masters,
                                            const TensorRefs& remainders, const std::vector<TensorRefs>& states,
                                            const char* const* state_names, uint32_t state_mask,
                                            const TensorRefs& steps, bool need_step, bool stochastic,
                                            const std::vector<uint64_t>& sr_offsets, at::Device& device) {
  const size_t n = params.size();
  if (grads.size() != n) fail("grads must have one entry per param (" + std::to_string(n) + "), got " + std::to_string(grads.size()));
  if (!sr_offsets.empty() && sr_offsets.size() != n)
    fail("sr_offsets must be empty or have one entry per param (" + std::to_string(n) + "), got " +
         std::to_string(sr_offsets.size()));
  std::vector<mpf::OptimTensor> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const auto idx = [i] { return "[" + std::to_string(i) + "]"; };  // (for messages only)
    const at::Tensor& p = params[i];
    const at::Tensor& g = grads[i];
    const bool paired = grad_pairs(p, g);  // else the checks below say why, in this order
    if (!paired) {
      check_dense(p, "params" + idx());
      storage_dtype(p, "params" + idx());
    }
    if (i == 0) {
      device = p.device();
      check_backend(device, "params[0]");
    }
    if (p.device() != device) fail("params" + idx() + " is on " + p.device().str() + " but params[0] is on " + device.str() + "; group params by device");
    if (!paired) {
      if (!p.is_non_overlapping_and_dense())
        fail("params" + idx() + " must be dense (contiguous, channels_last or another permutation of a contiguous "
             "tensor), got a strided view " + describe_layout(p));
      if (!g.defined()) fail("grads" + idx() + " must be a tensor, got None");
      check_plain(g, "grads" + idx());
      if (g.layout() != at::kStrided) fail("grads" + idx() + " is sparse; the fused optimizers need dense gradients");
      if (g.scalar_type() != p.scalar_type()) fail("grads" + idx() + " must have its param's dtype " + std::string(c10::toString(p.scalar_type())) + ", got a " + describe(g));
      if (g.sizes() != p.sizes()) fail("grads" + idx() + " must have its param's shape " + c10::str(p.sizes()) + ", got a " + describe(g));
      if (g.device() != device) fail("grads" + idx() + " must be on its param's device " + device.str() + ", got a " + describe(g));
      if (!same_layout(g, p))
        fail("grads" + idx() + " must have its param's memory layout (strides " + c10::str(p.strides()) + "), got a " +
             describe_layout(g));
      check_in_storage(g, "grads" + idx());
      TORCH_INTERNAL_ASSERT(false, "grad_pairs refused params", idx(), " and its grad for no reason the checks give");
    }
    DType d = DType::kFloat32;
    kernel_dtype(p.scalar_type(), &d);  // true: grad_pairs said so
    mpf::OptimTensor t{};
    t.param = p.data_ptr();
    t.grad = g.data_ptr();
    t.numel = p.numel();
    t.dtype = d;
    if (const at::Tensor* m = opt(masters, i, "masters", n)) t.master = state_ptr(*m, "masters", i, device, p);
    if (const at::Tensor* r = opt(remainders, i, "remainders", n)) {
      if (t.master) fail("params" + idx() + " has a master and a remainder; give one of the two");
      t.remainder = remainder_ptr(*r, i, device, p);
    }
    const bool rounds_sr = stochastic && d != DType::kFloat32 && !t.remainder;
    if (!sr_offsets.empty()) {
      t.sr_offset = sr_offsets[i];
      if (t.numel > 0 && t.sr_offset > UINT64_MAX - static_cast<uint64_t>(t.numel - 1))  // the last index fits
        fail("sr_offsets" + idx() + " + the param's numel must be at most 2**64, got " + std::to_string(t.sr_offset));
    } else if (rounds_sr) {
      fail("sr_offsets is required with rounding='stochastic' (the Philox index of each param's first element)");
    }
    for (size_t k = 0; k < states.size(); ++k) {
      const at::Tensor* s = opt(states[k], i, state_names[k], n);
      if (!((state_mask >> k) & 1u)) continue;  // a state this step does not use is not touched
      if (!s) fail(std::string(state_names[k]) + idx() + " is required");
      t.state[k] = state_ptr(*s, state_names[k], i, device, p);
    }
    const at::Tensor* st = opt(steps, i, "steps", n);
    if (need_step || rounds_sr) {
      if (!st) fail("steps" + idx() + " is required" + std::string(need_step ? "" : " (rounding='stochastic': the step number is its random stream)"));
      if (!(beside_ok(*st, at::kFloat, device, *st) && st->numel() == 1)) check_scalar(*st, "steps" + idx(), device);
      t.step = static_cast<float*>(st->data_ptr());
    }
    out.push_back(t);
  }
  return out;
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
    // float32 (torch's tensor lr) or float64 (what a compiled step makes of a float lr: its exact value); on
    // the CPU its value is checked as a number's
    constexpr mpf::HyperSpec kLr{"lr", 0.0, mpf::kInf, false, false, true};
    a.lr_ref = hyper_ref(&*lr_tensor, kLr, device);
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

// Every tensor a step writes apart in memory from every other it writes: a grad shared by two params (with
// write_grad: unscaled twice), a param listed twice (one update lost), a state pointed at another state or at
// its param by `.data = ...` (each update read the other's writes). The spans sorted by start, each compared
// with the furthest-reaching span before it. (The grads it only reads may be anything: a grad that is its
// param's own memory reads each element before the element is written, as in torch's update.)
void check_written_apart(const std::vector<mpf::OptimTensor>& tensors, bool write_grad, const char* const* state_names,
                         int num_states) {
  struct Span {
    uintptr_t begin, end;
    uint32_t index;
    int32_t role;  // -1 param, -2 grad, -3 master, -4 remainder, -5 step, s >= 0 state s
  };
  std::vector<Span> spans;
  spans.reserve(tensors.size() * static_cast<size_t>(4 + num_states));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const mpf::OptimTensor& t = tensors[i];
    const int64_t n = t.numel;
    const auto add = [&](const void* ptr, int64_t bytes, int32_t role) {
      if (ptr && bytes > 0) {
        const auto b = reinterpret_cast<uintptr_t>(ptr);
        spans.push_back({b, b + static_cast<uintptr_t>(bytes), static_cast<uint32_t>(i), role});
      }
    };
    const int64_t param_bytes = n * (t.dtype == mpf::DType::kFloat32 ? 4 : 2);
    add(t.param, param_bytes, -1);
    if (write_grad) add(t.grad, param_bytes, -2);
    add(t.master, n * 4, -3);
    add(t.remainder, n * 2, -4);
    for (int s = 0; s < num_states; ++s) add(t.state[s], n * 4, s);
    add(t.step, 4, -5);
  }
  std::sort(spans.begin(), spans.end(), [](const Span& x, const Span& y) { return x.begin < y.begin; });
  const auto name = [&](const Span& x) {
    static const char* const kRoles[] = {"params", "grads", "masters", "remainders", "steps"};
    return item(x.role >= 0 ? state_names[x.role] : kRoles[-x.role - 1], x.index);
  };
  size_t reach = 0;  // the span before the current one that ends last
  for (size_t k = 1; k < spans.size(); ++k) {
    const Span& prev = spans[reach];
    const Span& cur = spans[k];
    if (cur.begin < prev.end)
      fail(name(prev) + " and " + name(cur) + " share memory, and the step writes both" +
           (prev.role == -2 || cur.role == -2 ? " (a grad shared by two params would be unscaled twice)" : "") +
           "; give each its own memory");
    if (cur.end > prev.end) reach = k;
  }
}

template <class P>
void optim_step_with(at::TensorList params, at::TensorList grads, const TensorRefs& masters,
                     const TensorRefs& remainders, const std::vector<TensorRefs>& states, const TensorRefs& steps, double lr,
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
  check_written_apart(tensors, write_grad, P::kStates, P::kNumStates);
  mpf::OptimArgs a{};
  mpf::optim_kind(P::kName, &a.kind);
  a.tensors = tensors.data();
  a.num_tensors = static_cast<int64_t>(tensors.size());
  for (int i = 0; i < P::kNumHyper; ++i) {
    a.hyper[i] = values[i];
    if (!hyper_tensors.empty())
      a.hyper_ref[i] = hyper_ref(hyper_tensors[i] ? &*hyper_tensors[i] : nullptr, P::kHyper[i], device);
  }
  fill_common(a, lr, lr_tensor, inv_scale, clip_sumsq, max_norm, found_inf, grad_scale, device);
  a.counter = counter_ptr(counter, "counter", device);
  a.write_grad = write_grad;
  a.rounding = rounding;
  a.seed = seed;
  run_optim(a, device);
}

// One bump of every version counter among `tensors`: views of one buffer (nn.Parameter(buf[a:b]), DDP's
// bucket-view grads) share their base's counter, and a bump per tensor would move it once per view. A
// counter moves by one a step whatever shares it, which the planned step compares (csrc/bindings.cpp,
// step_layout's `taken`): a tensor whose counter moved since the pass began was bumped through another.
// (An inference tensor has no counter: inside inference mode, where the step may write one, nothing to count.)
void bump_each_counter_once(at::TensorList tensors) {
  std::vector<uint32_t> before(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i)
    if (!tensors[i].is_inference()) before[i] = tensors[i].unsafeGetTensorImpl()->version_counter().current_version();
  for (size_t i = 0; i < tensors.size(); ++i)
    if (!tensors[i].is_inference() &&
        tensors[i].unsafeGetTensorImpl()->version_counter().current_version() == before[i])
      torch::autograd::impl::bump_version(tensors[i]);
}

// A schema cannot hold a list of optional mutable tensors (nor a list of lists), so each optional
// per-param tensor list travels as the tensors given plus an index: index[i] is the position in `given`
// of param i's tensor, or -1 for none; an empty index gives none at all.
TensorRefs indexed(at::TensorList given, at::IntArrayRef index, size_t n, const char* name) {
  TensorRefs out;
  if (index.empty()) {
    if (!given.empty()) fail(std::string(name) + " has " + std::to_string(given.size()) + " tensors but no index");
    return out;
  }
  if (index.size() != n)
    fail(std::string(name) + "'s index must have one entry per param (" + std::to_string(n) + "), got " + std::to_string(index.size()));
  std::vector<bool> used(given.size(), false);
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t at_ = index[i];
    if (at_ < -1 || at_ >= static_cast<int64_t>(given.size()))
      fail(std::string(name) + "'s index[" + std::to_string(i) + "] must be -1 or a position in its " + std::to_string(given.size()) +
           " tensors, got " + std::to_string(at_));
    if (at_ < 0) {
      out.push_back(nullptr);
      continue;
    }
    if (used[at_]) fail(std::string(name) + "'s index names tensor " + std::to_string(at_) + " twice");
    used[at_] = true;
    out.push_back(&given[at_]);
  }
  return out;
}

void optim_step_(c10::string_view kind, at::TensorList params, at::TensorList grads, at::TensorList masters,
                 at::IntArrayRef master_index, at::TensorList remainders, at::IntArrayRef remainder_index,
                 at::TensorList states, at::IntArrayRef state_index, at::TensorList steps, at::IntArrayRef step_index,
                 double lr, const std::optional<at::Tensor>& lr_tensor, at::ArrayRef<double> hyper,
                 const c10::List<std::optional<at::Tensor>>& hyper_tensors, const std::optional<at::Tensor>& inv_scale,
                 const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& clip_sumsq,
                 double max_norm, const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& counter,
                 bool write_grad, c10::string_view rounding, int64_t seed, at::IntArrayRef sr_offsets) {
  const std::string kind_s(kind), rounding_s(rounding);
  mpf::OptimKind k;
  if (!mpf::optim_kind(kind_s.c_str(), &k)) fail("unknown optimizer policy '" + kind_s + "'");
  mpf::Rounding r;
  if (rounding_s == "nearest") r = mpf::Rounding::kNearest;
  else if (rounding_s == "stochastic") r = mpf::Rounding::kStochastic;
  else fail("rounding must be 'nearest' or 'stochastic', got '" + rounding_s + "'");
  const size_t n = params.size();
  // The writes are counted below (bump_version), which an inference tensor refuses outside inference mode,
  // as torch's in-place ops do: refused here, before anything is written.
  if (!c10::InferenceMode::is_enabled()) {
    for (size_t i = 0; i < n; ++i)
      for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&params[i], "params"},
                                    {write_grad && i < grads.size() ? &grads[i] : nullptr, "grads"}})
        if (t && t->is_inference())
          fail(std::string(name) + "[" + std::to_string(i) + "] is an inference tensor (made under "
               "torch.inference_mode()), which cannot be updated in place outside inference mode");
  }
  const TensorRefs masters_v = indexed(masters, master_index, n, "masters");
  const TensorRefs remainders_v = indexed(remainders, remainder_index, n, "remainders");
  const TensorRefs steps_v = indexed(steps, step_index, n, "steps");
  OptTensorList hyper_v;
  hyper_v.reserve(hyper_tensors.size());
  for (size_t i = 0; i < hyper_tensors.size(); ++i) hyper_v.push_back(hyper_tensors.get(i));
  std::vector<uint64_t> offsets;
  offsets.reserve(sr_offsets.size());
  for (int64_t o : sr_offsets) offsets.push_back(u64_of(o));
  mpf::dispatch_optim(k, [&](auto policy) {
    using P = decltype(policy);
    // states: the policy's kNumStates lists, one index of n entries each, back to back
    if (!state_index.empty() && state_index.size() != static_cast<size_t>(P::kNumStates) * n)
      fail("states' index must have one entry per state and param (" + std::to_string(P::kNumStates) + " x " +
           std::to_string(n) + "), got " + std::to_string(state_index.size()));
    std::vector<TensorRefs> states_v(P::kNumStates);
    std::vector<bool> used(states.size(), false);
    for (int s = 0; s < P::kNumStates && !state_index.empty(); ++s) {
      const at::IntArrayRef idx = state_index.slice(s * n, n);
      if (std::all_of(idx.begin(), idx.end(), [](int64_t v) { return v == -1; })) continue;  // not given
      states_v[s] = indexed(states, idx, n, P::kStates[s]);
      for (int64_t v : idx)
        if (v >= 0) {
          if (used[v]) fail("states' index names tensor " + std::to_string(v) + " twice");
          used[v] = true;
        }
    }
    if (state_index.empty() && !states.empty()) fail("states has " + std::to_string(states.size()) + " tensors but no index");
    optim_step_with<P>(params, grads, masters_v, remainders_v, states_v, steps_v, lr, lr_tensor,
                       std::vector<double>(hyper.begin(), hyper.end()), hyper_v, inv_scale, grad_scale, clip_sumsq,
                       max_norm, found_inf, counter, write_grad, r, u64_of(seed), offsets);
  });
  // The params were written in place (and the grads, with write_grad), past ADInplaceOrView (the autograd
  // keys fall through, MPF_TORCH_NO_AUTOGRAD): count the writes in their version counters, as torch's
  // in-place ops do, and with them its default (foreach) and for-loop optimizers. A graph that saved a param
  // for its backward then refuses to run on the updated values ("modified by an inplace operation") instead
  // of computing a wrong gradient, and another optimizer over the same param sees that it was written
  // (mpfused/optim/_base.py, _follow_writes). (Counted when the device skips the step on an inf too: the host
  // cannot know, and torch's ops count a call, not a change.)
  bump_each_counter_once(params);
  if (write_grad) bump_each_counter_once(grads);
}

// torch.ops.mpfused.follow_writes_: where code outside the step wrote 16-bit params kept with FP32 masters
// or BF16 remainders, their masters take the written values and the remainders that would make a NaN
// become 0 (core/follow.h). targets[i]: params[i]'s master (float32) or remainder (int16; bfloat16 params
// only), with the param's shape and memory layout. mpfused/optim/_base.py (_follow_writes) says which params.
void follow_writes_(at::TensorList params, at::TensorList targets, bool stochastic) {
  const size_t n = params.size();
  if (targets.size() != n)
    fail("targets must have one entry per param (" + std::to_string(n) + "), got " + std::to_string(targets.size()));
  std::vector<mpf::FollowTensor> tensors;
  tensors.reserve(n);
  at::Device device(at::kCPU);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& t = targets[i];
    check_dense(p, item("params", i));
    if (p.scalar_type() != at::kHalf && p.scalar_type() != at::kBFloat16)
      fail(item("params", i) + " must be a float16 or bfloat16 tensor (a param kept with a master or a remainder), got a " +
           describe(p));
    if (i == 0) {
      device = p.device();
      check_backend(device, "params[0]");
    }
    if (p.device() != device)
      fail(item("params", i) + " is on " + p.device().str() + " but params[0] is on " + device.str() + "; group params by device");
    if (!p.is_non_overlapping_and_dense())
      fail(item("params", i) + " must be dense (contiguous, channels_last or another permutation of a contiguous tensor), "
           "got a strided view " + describe_layout(p));
    mpf::FollowTensor x{p.data_ptr(), nullptr, nullptr, p.numel(),
                        p.scalar_type() == at::kHalf ? mpf::DType::kFloat16 : mpf::DType::kBFloat16};
    check_dense(t, item("targets", i));
    if (t.scalar_type() == at::kShort) {
      if (p.scalar_type() != at::kBFloat16)
        fail(item("targets", i) + " is an int16 remainder for a " + describe(p) + " param; remainders are for bfloat16 params only");
      check_beside_param(t, item("targets", i), at::kShort, "int16", device, p);
      x.remainder = static_cast<int16_t*>(t.data_ptr());
    } else {
      if (t.scalar_type() != at::kFloat)
        fail(item("targets", i) + " must be its param's float32 master or int16 remainder, got a " + describe(t));
      check_beside_param(t, item("targets", i), at::kFloat, "float32", device, p);
      x.master = static_cast<float*>(t.data_ptr());
    }
    tensors.push_back(x);
  }
  // No target over the memory of a param or of another target (each would be judged from values the pass
  // writes): the spans sorted by start, each compared with the furthest-reaching span before it.
  struct Span {
    uintptr_t begin, end;
    size_t index;
    bool target;
  };
  std::vector<Span> spans;
  spans.reserve(2 * n);
  for (size_t i = 0; i < n; ++i)
    for (const at::Tensor* t : {&params[i], &targets[i]})
      if (t->numel() > 0) {
        const auto b = reinterpret_cast<uintptr_t>(t->data_ptr());
        spans.push_back({b, b + static_cast<uintptr_t>(t->numel() * t->element_size()), i, t == &targets[i]});
      }
  std::stable_sort(spans.begin(), spans.end(), [](const Span& x, const Span& y) { return x.begin < y.begin; });
  size_t reach = 0;  // the span before the current one that ends last
  for (size_t k = 1; k < spans.size(); ++k) {
    const Span& prev = spans[reach];
    const Span& cur = spans[k];
    if (cur.begin < prev.end && (cur.target || prev.target))
      fail((prev.target ? item("targets", prev.index) : item("params", prev.index)) + " and " +
           (cur.target ? item("targets", cur.index) : item("params", cur.index)) +
           " share memory; each master or remainder must have memory of its own");
    if (cur.end > prev.end) reach = k;
  }
  if (tensors.empty()) return;
  const mpf::FollowArgs args{tensors.data(), static_cast<int64_t>(tensors.size()), stochastic};
  if (device.is_cpu()) {
    mpf::follow_writes_cpu(args, at::get_num_threads());
  } else {
#ifdef MPFUSED_WITH_CUDA
    const c10::cuda::CUDAGuard guard(device);
    mpf::follow_writes_cuda(args, c10::cuda::getCurrentCUDAStream(device.index()).stream());
#endif
  }
}

}  // namespace
}  // namespace mpf_torch

using namespace mpf_torch;

TORCH_LIBRARY_FRAGMENT(mpfused, m) {
  m.def("optim_step_(str policy, Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] masters, int[] master_index, "
        "Tensor(d!)[] remainders, int[] remainder_index, Tensor(e!)[] states, int[] state_index, Tensor(f!)[] steps, "
        "int[] step_index, float lr, Tensor? lr_tensor, float[] hyper, Tensor?[] hyper_tensors, Tensor? inv_scale, "
        "Tensor? grad_scale, Tensor? clip_sumsq, float max_norm, Tensor? found_inf, Tensor(g!)? counter, "
        "bool write_grad, str rounding, int seed, int[] sr_offsets) -> ()");
  m.def("follow_writes_(Tensor[] params, Tensor(a!)[] targets, bool stochastic) -> ()");
}
MPF_TORCH_IMPL_CPU_CUDA("optim_step_", &optim_step_)
MPF_TORCH_NO_AUTOGRAD("optim_step_")
MPF_TORCH_IMPL_CPU_CUDA("follow_writes_", &follow_writes_)
MPF_TORCH_NO_AUTOGRAD("follow_writes_")
