// Adam(W) and SGD update math, shared by the CPU and CUDA backends.
//
// Every operation is an explicitly rounded FP32 operation (fmul/fadd/fdiv, no contraction into FMA),
// in the order torch.optim's single-tensor implementations use, so the two backends produce the same
// bits and stay within rounding distance of torch. Per-step scalars that torch computes in Python
// (double) are computed here in double too, once per tensor, from the device-side step count.
#pragma once

#include <cmath>

#include "numeric.h"
#include "rounding.h"

namespace mpf {

// The factor that unscales the gradients: inv_scale itself, or 1 / grad_scale rounded once from double
// (exact for the power-of-two scales of dynamic loss scaling).
MPF_HD float unscale_factor(const float* inv_scale, const float* grad_scale) {
  if (inv_scale) return *inv_scale;
  if (grad_scale) return static_cast<float>(1.0 / static_cast<double>(*grad_scale));
  return 1.f;
}

// torch.nn.utils.clip_grad_norm_'s coefficient from the sum of squares of the unscaled gradients:
// min(1, max_norm / (norm + 1e-6)) in FP32 (torch multiplies by a reciprocal: within 1 ulp of it).
// A NaN norm gives a NaN coefficient, as torch's clamp does.
MPF_HD float clip_coefficient(float sumsq, float max_norm) {
  const float coef = fdiv(max_norm, fadd(fsqrt(sumsq), 1e-6f));
  return !(coef >= 1.f) ? coef : 1.f;
}

// Hyperparameters travel as doubles, as Python floats do in torch.optim: scalars derived from them
// (1 - beta1, bias corrections, step size) are computed in double and rounded to FP32 once, where
// torch rounds them (when a Python float meets an FP32 tensor).

// A hyperparameter that torch lets be a one-element tensor (Adam's betas, SGD's weight_decay). When the
// tensor lives on the device of the update, the update reads it there, so a step with tensor
// hyperparameters needs no host sync (torch's fused optimizers read such tensors on the host). float32
// and float64 tensors are read as they are: the value is the double torch's .item() would give.
struct HyperRef {
  const void* ptr;  // nullptr: the plain value in the Hyper struct is used
  bool is_double;   // float64, else float32
};

MPF_HD double read_hyper(const HyperRef& r, double value) {
  if (!r.ptr) return value;
  return r.is_double ? *static_cast<const double*>(r.ptr) : static_cast<double>(*static_cast<const float*>(r.ptr));
}

// The tensor hyperparameters of one step (each may be absent).
struct HyperRefs {
  HyperRef beta1, beta2, weight_decay;
};

// ---- Adam / AdamW ----------------------------------------------------------------------------------
struct AdamHyper {
  double beta1, beta2, eps, weight_decay;
  bool amsgrad, maximize, decoupled;  // decoupled: AdamW's decay of the weights, else L2 on the grad
};

// h with its tensor hyperparameters read (betas; Adam's weight_decay is a number in torch).
MPF_HD AdamHyper resolve_hyper(AdamHyper h, const HyperRefs& r) {
  h.beta1 = read_hyper(r.beta1, h.beta1);
  h.beta2 = read_hyper(r.beta2, h.beta2);
  return h;
}

// What one step of one tensor needs, derived from the hyperparameters, lr and the step number.
struct AdamScalars {
  float grad_sign;        // -1 with maximize: an exact sign flip
  float lerp_weight;      // 1 - beta1, the weight of the first moment's lerp
  float one_minus_lerp_weight;
  bool lerp_small;        // |weight| < 0.5: torch's lerp takes its first formula
  float beta2, one_minus_beta2;
  float neg_step_size;    // -lr / (1 - beta1^step)
  float bc2_sqrt;         // sqrt(1 - beta2^step)
  float eps;
  float weight_decay;     // L2 (Adam)
  float decay;            // 1 - lr * weight_decay (AdamW); exactly 1 without weight decay
};

// CUDA's double pow() is within 2 ulp, glibc's (and CPython's) correctly rounded: on rare steps the
// bias-correction scalars can differ by one FP32 ulp between the backends.
MPF_HD AdamScalars adam_scalars(const AdamHyper& h, double lr, double step) {
  const double bc1 = 1.0 - pow(h.beta1, step);
  const double bc2 = 1.0 - pow(h.beta2, step);
  AdamScalars c;
  c.grad_sign = h.maximize ? -1.f : 1.f;
  c.lerp_weight = static_cast<float>(1.0 - h.beta1);
  c.one_minus_lerp_weight = fsub(1.f, c.lerp_weight);
  c.lerp_small = std::fabs(c.lerp_weight) < 0.5f;
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.neg_step_size = static_cast<float>(-(lr / bc1));
  c.bc2_sqrt = static_cast<float>(sqrt(bc2));
  c.eps = static_cast<float>(h.eps);
  c.weight_decay = static_cast<float>(h.weight_decay);
#if defined(__CUDA_ARCH__)
  // A separately rounded multiply and subtract, as on the host and in Python (nvcc would fuse them).
  c.decay = h.decoupled ? static_cast<float>(__dadd_rn(1.0, -__dmul_rn(lr, h.weight_decay))) : 1.f;
#else
  c.decay = h.decoupled ? static_cast<float>(1.0 - lr * h.weight_decay) : 1.f;
#endif
  return c;
}

// Which branches of the update apply. The CPU instantiates them at compile time (its loops then
// vectorise); CUDA passes AdamRuntimeVariant, whose branches are uniform across a launch.
template <bool kL2, bool kLerpSmall, bool kAmsgrad>
struct AdamStaticVariant {
  static constexpr bool l2 = kL2, lerp_small = kLerpSmall, amsgrad = kAmsgrad;
};
struct AdamRuntimeVariant {
  bool l2, lerp_small, amsgrad;
};
MPF_HD AdamRuntimeVariant adam_variant(const AdamHyper& h, const AdamScalars& c) {
  return AdamRuntimeVariant{!h.decoupled && h.weight_decay != 0.0, c.lerp_small, h.amsgrad};
}

// One element. p is the FP32 weight (the master copy when there is one), g the unscaled gradient.
// vmax is read and written only with amsgrad. References, not pointers: kernels keep all in registers.
template <class V>
MPF_HD void adam_update(float& p, float& m, float& v, float& vmax, float g, const V& var, const AdamScalars& c) {
  g = fmul(g, c.grad_sign);
  if (var.l2) g = fadd(g, fmul(c.weight_decay, p));
  else p = fmul(p, c.decay);  // AdamW's decoupled decay; x * 1 == x exactly without weight decay
  // torch's lerp, formula chosen by the weight for accuracy at both ends
  m = var.lerp_small ? fadd(m, fmul(c.lerp_weight, fsub(g, m))) : fsub(g, fmul(fsub(g, m), c.one_minus_lerp_weight));
  v = fadd(fmul(v, c.beta2), fmul(fmul(c.one_minus_beta2, g), g));
  float second = v;
  if (var.amsgrad) {
    vmax = vmax > v ? vmax : v;  // torch.maximum; NaN handling is moot: a NaN step is skipped
    second = vmax;
  }
  const float denom = fadd(fdiv(fsqrt(second), c.bc2_sqrt), c.eps);
  p = fadd(p, fdiv(fmul(c.neg_step_size, m), denom));
}

// ---- SGD -----------------------------------------------------------------------------------------
struct SgdHyper {
  double momentum, dampening, weight_decay;
  bool nesterov, maximize;
};

MPF_HD SgdHyper resolve_hyper(SgdHyper h, const HyperRefs& r) {
  h.weight_decay = read_hyper(r.weight_decay, h.weight_decay);
  return h;
}

struct SgdScalars {
  float grad_sign, momentum, one_minus_dampening, weight_decay, neg_lr;
};

MPF_HD SgdScalars sgd_scalars(const SgdHyper& h, double lr) {
  return SgdScalars{h.maximize ? -1.f : 1.f, static_cast<float>(h.momentum), static_cast<float>(1.0 - h.dampening),
                    static_cast<float>(h.weight_decay), static_cast<float>(-lr)};
}

template <bool kWeightDecay, bool kMomentum, bool kNesterov>
struct SgdStaticVariant {
  static constexpr bool weight_decay = kWeightDecay, momentum = kMomentum, nesterov = kNesterov;
};
struct SgdRuntimeVariant {
  bool weight_decay, momentum, nesterov;
};
MPF_HD SgdRuntimeVariant sgd_variant(const SgdHyper& h) {
  return SgdRuntimeVariant{h.weight_decay != 0.0, h.momentum != 0.0, h.nesterov};
}

// first_step: the momentum buffer has never been written (torch then sets it to the gradient itself).
// buf is read and written only with momentum.
template <class V>
MPF_HD void sgd_update(float& p, float& buf, float g, const V& var, const SgdScalars& c, bool first_step) {
  g = fmul(g, c.grad_sign);
  if (var.weight_decay) g = fadd(g, fmul(c.weight_decay, p));
  if (var.momentum) {
    const float b = first_step ? g : fadd(fmul(buf, c.momentum), fmul(c.one_minus_dampening, g));
    buf = b;
    g = var.nesterov ? fadd(g, fmul(c.momentum, b)) : b;
  }
  p = fadd(p, fmul(c.neg_lr, g));
}

}  // namespace mpf
