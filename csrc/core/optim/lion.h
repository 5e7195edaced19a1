// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the sign of an interpolation
// of momentum and gradient, one state tensor (half of Adam's optimizer memory):
//   c = beta1 * m + (1 - beta1) * g;  p = p * (1 - lr * weight_decay) - lr * sign(c);
//   m = beta2 * m + (1 - beta2) * g.
// sign(0) is 0 and a NaN stays NaN, as torch.sign.
#pragma once

#include "common.h"

namespace mpf {

struct LionPolicy : PolicyBase {
  static constexpr const char* kName = "lion";
  static constexpr int kNumStates = 1;
  static constexpr const char* kStates[kNumStates] = {"exp_avg"};
  static constexpr int kNumHyper = 4;
  static constexpr HyperSpec kHyper[kNumHyper] = {{"beta1", 0.0, 1.0, false, false, true},
                                                  {"beta2", 0.0, 1.0, false, false, true},
                                                  {"weight_decay", 0.0, kInf, false, false},
                                                  flag_spec("maximize")};

  struct Hyper {
    double beta1, beta2, weight_decay;
    bool maximize;
  };
  static MPF_HD Hyper make(const double* v) { return Hyper{v[0], v[1], v[2], v[3] != 0}; }
  static MPF_HD uint32_t flags(const Hyper&) { return 0; }
  static constexpr MPF_HD uint32_t state_mask(uint32_t) { return 1u; }
  static constexpr MPF_HD bool needs_step(uint32_t) { return false; }

  struct Scalars {
    float grad_sign, beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr, decay;
  };
  static MPF_HD Scalars scalars(const Hyper& h, const StepContext& s) {
    return Scalars{h.maximize ? -1.f : 1.f,           static_cast<float>(h.beta1), static_cast<float>(1.0 - h.beta1),
                   static_cast<float>(h.beta2),       static_cast<float>(1.0 - h.beta2), static_cast<float>(-s.lr),
                   decay_factor(s.lr, h.weight_decay)};
  }

  template <class F>
  static MPF_HD void update(float& p, float* s, float g, const F&, const Scalars& c) {
    g = fmul(g, c.grad_sign);
    const float dir = fadd(fmul(s[0], c.beta1), fmul(c.one_minus_beta1, g));
    // +-0 gives 0 and a NaN stays NaN. Written as selects between constants: GCC vectorises those on every
    // ISA path, not a chain of conditions around arithmetic (without AVX-512's masks, "control flow").
    const float pos = dir > 0.f ? 1.f : 0.f, neg = dir < 0.f ? 1.f : 0.f;
    const float sign = dir != dir ? dir : fsub(pos, neg);
    p = fadd(fmul(p, c.decay), fmul(c.neg_lr, sign));
    s[0] = fadd(fmul(s[0], c.beta2), fmul(c.one_minus_beta2, g));
  }
};

}  // namespace mpf
