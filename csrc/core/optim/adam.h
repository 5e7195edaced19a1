// Adam and AdamW (torch.optim.Adam / AdamW): every operation in the order of torch's single-tensor
// implementation, so the result is within rounding distance of torch's, and bit-identical between the
// backends. Scalars that torch computes in Python (double) are computed in double here too, once per
// tensor, from the device-side step count.
#pragma once

#include "common.h"

namespace mpf {

struct AdamPolicy : PolicyBase {
  static constexpr const char* kName = "adam";
  static constexpr int kNumStates = 3;
  static constexpr const char* kStates[kNumStates] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  static constexpr int kNumHyper = 7;
  static constexpr HyperSpec kHyper[kNumHyper] = {
      {"beta1", 0.0, 1.0, false, true, true}, {"beta2", 0.0, 1.0, false, true, true},
      {"eps", 0.0, kInf, false, false},
      {"weight_decay", 0.0, kInf, false, false}, flag_spec("amsgrad"), flag_spec("maximize"),
      flag_spec("decoupled")};  // decoupled: AdamW's decay of the weights, else L2 on the gradient

  struct Hyper {
    double beta1, beta2, eps, weight_decay;
    bool amsgrad, maximize, decoupled;
  };
  static MPF_HD Hyper make(const double* v) { return Hyper{v[0], v[1], v[2], v[3], v[4] != 0, v[5] != 0, v[6] != 0}; }

  // kLerpSmall: |1 - beta1| < 0.5, torch's lerp then takes its first formula.
  enum Flag : int { kL2 = 0, kLerpSmall = 1, kAmsgrad = 2 };
  static constexpr int kNumFlags = 3;
  static MPF_HD uint32_t flags(const Hyper& h) {
    const bool l2 = !h.decoupled && h.weight_decay != 0.0;
    const bool small = std::fabs(static_cast<float>(1.0 - h.beta1)) < 0.5f;
    return uint32_t{l2} << kL2 | uint32_t{small} << kLerpSmall | uint32_t{h.amsgrad} << kAmsgrad;
  }
  static constexpr MPF_HD uint32_t state_mask(uint32_t f) { return 3u | ((f >> kAmsgrad) & 1u) << 2; }
  static constexpr MPF_HD bool needs_step(uint32_t) { return true; }

  struct Scalars {
    float grad_sign;  // -1 with maximize: an exact sign flip
    float lerp_weight, one_minus_lerp_weight;  // 1 - beta1, the weight of the first moment's lerp
    float beta2, one_minus_beta2;
    float neg_step_size;  // -lr / (1 - beta1^step)
    float bc2_sqrt;       // sqrt(1 - beta2^step)
    float eps;
    float weight_decay;   // L2 (Adam)
    float decay;          // 1 - lr * weight_decay (AdamW); exactly 1 without weight decay
  };
  // CUDA's double pow() is within 2 ulp, glibc's (and CPython's) correctly rounded: on rare steps the
  // bias-correction scalars can differ by one FP32 ulp between the backends.
  static MPF_HD Scalars scalars(const Hyper& h, const StepContext& s) {
    const double bc1 = 1.0 - pow(h.beta1, s.step);
    const double bc2 = 1.0 - pow(h.beta2, s.step);
    Scalars c;
    c.grad_sign = h.maximize ? -1.f : 1.f;
    c.lerp_weight = static_cast<float>(1.0 - h.beta1);
    c.one_minus_lerp_weight = fsub(1.f, c.lerp_weight);
    c.beta2 = static_cast<float>(h.beta2);
    c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
    c.neg_step_size = static_cast<float>(-(s.lr / bc1));
    c.bc2_sqrt = static_cast<float>(sqrt(bc2));
    c.eps = static_cast<float>(h.eps);
    c.weight_decay = static_cast<float>(h.weight_decay);
    c.decay = h.decoupled ? decay_factor(s.lr, h.weight_decay) : 1.f;
    return c;
  }

  // s: exp_avg, exp_avg_sq, max_exp_avg_sq (read and written only with amsgrad).
  template <class F>
  static MPF_HD void update(float& p, float* s, float g, const F& f, const Scalars& c) {
    float& m = s[0];
    float& v = s[1];
    g = fmul(g, c.grad_sign);
    if (f.has(kL2)) g = fadd(g, fmul(c.weight_decay, p));
    else p = fmul(p, c.decay);  // AdamW's decoupled decay; x * 1 == x exactly without weight decay
    // torch's lerp, formula chosen by the weight for accuracy at both ends
    m = f.has(kLerpSmall) ? fadd(m, fmul(c.lerp_weight, fsub(g, m))) : fsub(g, fmul(fsub(g, m), c.one_minus_lerp_weight));
    v = fadd(fmul(v, c.beta2), fmul(fmul(c.one_minus_beta2, g), g));
    float second = v;
    if (f.has(kAmsgrad)) {
      s[2] = s[2] > v ? s[2] : v;  // torch.maximum; NaN handling is moot: a NaN step is skipped
      second = s[2];
    }
    const float denom = fadd(fdiv(fsqrt(second), c.bc2_sqrt), c.eps);
    p = fadd(p, fdiv(fmul(c.neg_step_size, m), denom));
  }
};

}  // namespace mpf
