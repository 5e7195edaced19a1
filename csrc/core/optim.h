// Adam(W) and SGD update math, shared by the CPU and CUDA backends.
//
// Every operation is an explicitly rounded FP32 operation (fmul/fadd/fdiv, no contraction into FMA),
// in the order torch.optim's single-tensor implementations use, so the two backends produce the same
// bits and stay within rounding distance of torch. Per-step scalars that torch computes in Python
// (double) are computed here in double too, once per tensor, from the device-side step count.
#pragma once

#include <cmath>

#include "numeric.h"

namespace mpf {

// IEEE single-precision operations that the compiler may not fuse into an FMA.
MPF_HD float fmul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;  // host code is built with -ffp-contract=off
#endif
}
MPF_HD float fadd(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
MPF_HD float fsub(float a, float b) { return fadd(a, -b); }
MPF_HD float fdiv(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
MPF_HD float fsqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// torch.nn.utils.clip_grad_norm_'s coefficient from the sum of squares of the unscaled gradients:
// min(1, max_norm / (norm + 1e-6)), in FP32 as torch computes it.
MPF_HD float clip_coefficient(float sumsq, float max_norm) {
  const float coef = fdiv(max_norm, fadd(fsqrt(sumsq), 1e-6f));
  return coef < 1.f ? coef : 1.f;
}

// torch's lerp: the formula depends on which side of 0.5 the weight is, for accuracy at both ends.
MPF_HD float lerp(float self, float end, float weight) {
  return std::fabs(weight) < 0.5f ? fadd(self, fmul(weight, fsub(end, self)))
                                  : fsub(end, fmul(fsub(end, self), fsub(1.f, weight)));
}

// Hyperparameters travel as doubles, as Python floats do in torch.optim: scalars derived from them
// (1 - beta1, bias corrections, step size) are computed in double and rounded to FP32 once, where
// torch rounds them (when a Python float meets an FP32 tensor).

// ---- Adam / AdamW ----------------------------------------------------------------------------------
struct AdamHyper {
  double beta1, beta2, eps, weight_decay;
  bool amsgrad, maximize, decoupled;  // decoupled: AdamW's decay of the weights, else L2 on the grad
};

// What one step of one tensor needs, derived from the hyperparameters, lr and the step number.
struct AdamScalars {
  float one_minus_beta1;  // lerp weight of the first moment
  float beta2, one_minus_beta2;
  float neg_step_size;    // -lr / (1 - beta1^step)
  float bc2_sqrt;         // sqrt(1 - beta2^step)
  float eps;
  float weight_decay;     // L2 (Adam)
  float decay;            // 1 - lr * weight_decay (AdamW)
};

MPF_HD AdamScalars adam_scalars(const AdamHyper& h, double lr, double step) {
  const double bc1 = 1.0 - pow(h.beta1, step);
  const double bc2 = 1.0 - pow(h.beta2, step);
  AdamScalars c;
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.neg_step_size = static_cast<float>(-(lr / bc1));
  c.bc2_sqrt = static_cast<float>(sqrt(bc2));
  c.eps = static_cast<float>(h.eps);
  c.weight_decay = static_cast<float>(h.weight_decay);
  c.decay = static_cast<float>(1.0 - lr * h.weight_decay);
  return c;
}

// One element. p is the FP32 weight (the master copy when there is one), g the unscaled gradient.
// vmax is read and written only with amsgrad. References, not pointers: kernels keep all in registers.
MPF_HD void adam_update(float& p, float& m, float& v, float& vmax, float g, const AdamHyper& h, const AdamScalars& c) {
  if (h.maximize) g = -g;
  if (h.weight_decay != 0.0) {
    if (h.decoupled) p = fmul(p, c.decay);
    else g = fadd(g, fmul(c.weight_decay, p));
  }
  m = lerp(m, g, c.one_minus_beta1);
  v = fadd(fmul(v, c.beta2), fmul(fmul(c.one_minus_beta2, g), g));
  float second = v;
  if (h.amsgrad) {
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

struct SgdScalars {
  float momentum, one_minus_dampening, weight_decay, neg_lr;
};

MPF_HD SgdScalars sgd_scalars(const SgdHyper& h, double lr) {
  return SgdScalars{static_cast<float>(h.momentum), static_cast<float>(1.0 - h.dampening),
                    static_cast<float>(h.weight_decay), static_cast<float>(-lr)};
}

// first_step: the momentum buffer has never been written (torch then sets it to the gradient itself).
// buf is read and written only with momentum.
MPF_HD void sgd_update(float& p, float& buf, float g, const SgdHyper& h, const SgdScalars& c, bool first_step) {
  if (h.maximize) g = -g;
  if (h.weight_decay != 0.0) g = fadd(g, fmul(c.weight_decay, p));
  if (h.momentum != 0.0) {
    const float b = first_step ? g : fadd(fmul(buf, c.momentum), fmul(c.one_minus_dampening, g));
    buf = b;
    g = h.nesterov ? fadd(g, fmul(c.momentum, b)) : b;
  }
  p = fadd(p, fmul(c.neg_lr, g));
}

}  // namespace mpf
