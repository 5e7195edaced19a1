// LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning"), with the semantics of apex's
// FusedLAMB: Adam moments (with bias correction, and grad averaging: the gradient's weight in the first
// moment is 1 - beta1, else 1), weight decay decoupled (adam_w_mode, the default) or as L2 on the
// gradient, optional clipping by the global gradient norm (max_grad_norm), and a per-tensor trust ratio
//   p -= lr * (||p|| / ||u||) * u,   u = m_hat / (sqrt(v_hat) + eps) (+ weight_decay * p when decoupled),
// the ratio being 1 where either norm is 0, and applied only where weight_decay != 0 unless use_nvlamb
// (so param groups without weight decay, such as biases and norms, take plain Adam-like steps).
//
// The ratio needs both norms of the whole tensor, so LAMB is two passes: the first updates the moments
// and sums p^2 and u^2 per tensor, the second recomputes u from the stored moments (the same bits) and
// updates p. The norms are taken of the FP32 weight (the master when there is one).
#pragma once

#include "common.h"

namespace mpf {

struct LambPolicy : PolicyBase {
  static constexpr const char* kName = "lamb";
  static constexpr int kNumStates = 2;
  static constexpr const char* kStates[kNumStates] = {"exp_avg", "exp_avg_sq"};
  static constexpr int kNumHyper = 9;
  static constexpr HyperSpec kHyper[kNumHyper] = {
      {"beta1", 0.0, 1.0, false, true, true}, {"beta2", 0.0, 1.0, false, true, true}, {"eps", 0.0, kInf, false, false},
      {"weight_decay", 0.0, kInf, false, false}, flag_spec("bias_correction"), flag_spec("grad_averaging"),
      flag_spec("decoupled"), {"max_grad_norm", 0.0, kInf, false, false}, flag_spec("use_nvlamb")};

  struct Hyper {
    double beta1, beta2, eps, weight_decay;
    bool bias_correction, grad_averaging, decoupled;
    double max_grad_norm;  // 0: no clipping
    bool use_nvlamb;
  };
  static MPF_HD Hyper make(const double* v) {
    return Hyper{v[0], v[1], v[2], v[3], v[4] != 0, v[5] != 0, v[6] != 0, v[7], v[8] != 0};
  }

  enum Flag : int { kL2 = 0, kDecoupledDecay = 1 };
  static constexpr int kNumFlags = 2;
  static MPF_HD uint32_t flags(const Hyper& h) {
    const bool wd = h.weight_decay != 0.0;
    return uint32_t{wd && !h.decoupled} << kL2 | uint32_t{wd && h.decoupled} << kDecoupledDecay;
  }
  static constexpr MPF_HD uint32_t state_mask(uint32_t) { return 3u; }
  static constexpr MPF_HD bool needs_step(uint32_t) { return true; }
  static constexpr int kNumSums = 2;  // ||p||^2, ||u||^2

  struct Scalars {
    float grad_mul;  // the global-norm clip: max_grad_norm / norm where the norm exceeds it, else 1
    float beta1, beta3, beta2, one_minus_beta2;
    float bc1, bc2;  // bias corrections (1 without)
    float eps, weight_decay;
    double lr;
    bool adaptive;   // the trust ratio applies
  };
  static MPF_HD Scalars scalars(const Hyper& h, const StepContext& s) {
    Scalars c;
    c.grad_mul = h.max_grad_norm > 0.0 && s.grad_norm > h.max_grad_norm ? static_cast<float>(h.max_grad_norm / s.grad_norm)
                                                                         : 1.f;
    c.beta1 = static_cast<float>(h.beta1);
    c.beta3 = h.grad_averaging ? static_cast<float>(1.0 - h.beta1) : 1.f;
    c.beta2 = static_cast<float>(h.beta2);
    c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
    c.bc1 = h.bias_correction ? static_cast<float>(1.0 - pow(h.beta1, s.step)) : 1.f;
    c.bc2 = h.bias_correction ? static_cast<float>(1.0 - pow(h.beta2, s.step)) : 1.f;
    c.eps = static_cast<float>(h.eps);
    c.weight_decay = static_cast<float>(h.weight_decay);
    c.lr = s.lr;
    c.adaptive = h.use_nvlamb || h.weight_decay != 0.0;
    return c;
  }

  // The update direction from the new moments.
  template <class F>
  static MPF_HD float direction(float p, const float* s, const F& f, const Scalars& c) {
    const float denom = fadd(fsqrt(fdiv(s[1], c.bc2)), c.eps);
    const float u = fdiv(fdiv(s[0], c.bc1), denom);
    return f.has(kDecoupledDecay) ? fadd(u, fmul(c.weight_decay, p)) : u;
  }

  // Pass 1. s: exp_avg, exp_avg_sq (updated); terms: p^2 and u^2.
  template <class F>
  static MPF_HD void reduce(float p, float* s, float g, const F& f, const Scalars& c, float* terms) {
    g = fmul(g, c.grad_mul);
    if (f.has(kL2)) g = fadd(g, fmul(c.weight_decay, p));
    s[0] = fadd(fmul(s[0], c.beta1), fmul(c.beta3, g));
    s[1] = fadd(fmul(s[1], c.beta2), fmul(fmul(c.one_minus_beta2, g), g));
    const float u = direction(p, s, f, c);
    terms[0] = fmul(p, p);
    terms[1] = fmul(u, u);
  }

  // Between the passes: -lr * trust ratio, from the tensor's sums.
  static MPF_HD float finish(const Scalars& c, const double* sums) {
    const double w = sqrt(sums[0]), u = sqrt(sums[1]);
    return static_cast<float>(-(c.adaptive && w != 0.0 && u != 0.0 ? c.lr * (w / u) : c.lr));
  }

  // Pass 2.
  template <class F>
  static MPF_HD void apply(float& p, const float* s, const F& f, const Scalars& c, float neg_ratio) {
    p = fadd(p, fmul(neg_ratio, direction(p, s, f, c)));
  }
};

}  // namespace mpf
