// What an optimizer policy is, and what every policy shares.
//
// An optimizer algorithm is a policy: a struct of static members, header-only and shared by the CPU and
// CUDA backends. One generic multi-tensor driver per backend (cpu/optim_impl.inc, cuda/optim.cu) applies
// any policy to a list of tensors: it reads each gradient (unscaled, clipped; nothing at all happens when
// found_inf is set), hands the element to the policy in FP32, and writes the FP32 master, the states and
// the param in its own dtype, in one pass. A policy defines:
//
//   kName                              its name for the bindings and Python ("adam")
//   kNumStates, kStates[]              its FP32 state tensors, in kernel order (at most kMaxStates)
//   kNumHyper, kHyper[]                its hyperparameters: name and valid range; flags travel as 0 or 1
//   struct Hyper; make(const double*)  the hyperparameters from their values in kHyper's order
//   check(const Hyper&)                host: an error about a combination of values, or nullptr
//   kNumFlags, flags(const Hyper&)     bits choosing branches of the update: the CPU instantiates every
//                                      combination (branch-free, vectorised loops), CUDA branches uniformly
//   state_mask(flags), needs_step(flags)   the states it reads and writes, and whether it counts steps
//   struct Scalars; scalars(Hyper, StepContext)   per-tensor values, once per tensor (per block on CUDA)
//   update(p, s, g, flags, scalars)    one element: p the FP32 weight, s[] its states, g its gradient
//
// A policy that needs a per-tensor reduction (LAMB's norms) sets kNumSums > 0 and defines instead of
// update: reduce(p, s, g, flags, scalars, terms[]) for the first pass (it updates the states and gives
// the element's terms of the tensor's sums), finish(scalars, sums) -> the tensor's factor, from the sums
// in double, and apply(p, s, flags, scalars, factor) for the second pass. No host sync between passes.
//
// Every FP32 operation is explicitly rounded (core/rounding.h): no contraction into FMA, so the backends
// give the same bits. Registering a policy is one line in registry.h.
#pragma once

#include <cmath>
#include <cstdint>

#include "../dispatch.h"
#include "../numeric.h"
#include "../rounding.h"

namespace mpf {

constexpr int kMaxStates = 3;  // state tensors per param
constexpr int kMaxHyper = 12;  // hyperparameters per policy

// A hyperparameter's name and the values it may take (checked by the bindings, before anything runs).
// tensor_ok: it may be a one-element tensor on the device that the update reads itself (see HyperRef); the
// bindings cannot check such a value, so state_mask and needs_step must never depend on one. flag: 0 or 1.
struct HyperSpec {
  const char* name;
  double lo, hi;
  bool lo_open, hi_open;
  bool tensor_ok = false;
  bool flag = false;
};
constexpr double kInf = HUGE_VAL;
constexpr HyperSpec flag_spec(const char* name) { return HyperSpec{name, 0.0, 1.0, false, false, false, true}; }

// A hyperparameter that may be a one-element tensor (the betas of Adam, Lion and LAMB, SGD's weight_decay). When the tensor
// lives on the device of the update, the update reads it there, so a step with tensor hyperparameters
// needs no host sync. float32 and float64 tensors are read as they are: the value is the double torch's
// .item() would give.
struct HyperRef {
  const void* ptr;  // nullptr: the plain value is used
  bool is_double;   // float64, else float32
};

MPF_HD double read_hyper(const HyperRef& r, double value) {
  if (!r.ptr) return value;
  return r.is_double ? *static_cast<const double*>(r.ptr) : static_cast<double>(*static_cast<const float*>(r.ptr));
}

// What a policy's per-tensor scalars may depend on.
struct StepContext {
  double lr;
  double step;       // this step's number: 1 for the first step the tensor takes
  double grad_norm;  // the 2-norm of all gradients of the step (unscaled and clipped), or -1 when the
                     //   caller gave no sum of squares
};

// The Philox stream word s0 of a step's stochastic write-back (OptimArgs::rounding): the tensor's step number
// after this step, from its step count before it (as uint32; counts beyond 2^32 - 1 saturate, and a count
// below zero, which only an edited state could hold, reads as 0: a conversion out of range would differ
// between the host and the GPU).
MPF_HD uint32_t sr_step_word(float taken) {
  const double next = static_cast<double>(taken) + 1.0;
  return next >= 4294967295.0 ? 0xFFFFFFFFu : next > 0.0 ? static_cast<uint32_t>(next) : 0u;
}

// The factor that unscales the gradients: inv_scale itself, or 1 / grad_scale rounded once from double
// (exact for the power-of-two scales of dynamic loss scaling).
MPF_HD float unscale_factor(const float* inv_scale, const float* grad_scale) {
  if (inv_scale) return *inv_scale;
  if (grad_scale) return static_cast<float>(1.0 / static_cast<double>(*grad_scale));
  return 1.f;
}

// torch.nn.utils.clip_grad_norm_'s coefficient from the sum of squares of the unscaled gradients:
// min(1, max_norm / (norm + 1e-6)) in FP32 (torch multiplies by a reciprocal: within 1 ulp of it).
// A NaN norm gives a NaN coefficient, as torch's clamp does; an infinite max_norm gives 1.
MPF_HD float clip_coefficient(float sumsq, float max_norm) {
  if (std::isinf(max_norm)) return 1.f;  // no clip: even an FP32 sum of squares that overflowed to inf
  const float coef = fdiv(max_norm, fadd(fsqrt(sumsq), 1e-6f));
  return !(coef >= 1.f) ? coef : 1.f;
}

// 1 - lr * weight_decay in double, rounded once to FP32: decoupled weight decay as torch computes it
// (a separately rounded multiply and subtract; nvcc would fuse them).
MPF_HD float decay_factor(double lr, double weight_decay) {
#if defined(__CUDA_ARCH__)
  return static_cast<float>(__dadd_rn(1.0, -__dmul_rn(lr, weight_decay)));
#else
  return static_cast<float>(1.0 - lr * weight_decay);
#endif
}

// Defaults for the optional members of a policy.
struct PolicyBase {
  static constexpr int kNumFlags = 0;
  static constexpr int kNumSums = 0;
  template <class H>
  static const char* check(const H&) { return nullptr; }
};

}  // namespace mpf
