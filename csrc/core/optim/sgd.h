// SGD with momentum, dampening, Nesterov and weight decay (torch.optim.SGD), in torch's order.
#pragma once

#include "common.h"

namespace mpf {

struct SgdPolicy : PolicyBase {
  static constexpr const char* kName = "sgd";
  static constexpr int kNumStates = 1;
  static constexpr const char* kStates[kNumStates] = {"momentum_buffer"};
  static constexpr int kNumHyper = 5;
  static constexpr HyperSpec kHyper[kNumHyper] = {
      {"momentum", 0.0, kInf, false, false}, {"dampening", -kInf, kInf, false, false},
      {"weight_decay", 0.0, kInf, false, false, true}, flag_spec("nesterov"), flag_spec("maximize")};

  struct Hyper {
    double momentum, dampening, weight_decay;
    bool nesterov, maximize;
  };
  static MPF_HD Hyper make(const double* v) { return Hyper{v[0], v[1], v[2], v[3] != 0, v[4] != 0}; }
  // No rule between the values at a step: torch.optim.SGD checks Nesterov's (a momentum, no dampening) at
  // construction only (the Python layer does too), and its step takes any values, Nesterov applying only with a
  // momentum, as update() does.

  enum Flag : int { kWeightDecay = 0, kMomentum = 1, kNesterov = 2 };
  static constexpr int kNumFlags = 3;
  static MPF_HD uint32_t flags(const Hyper& h) {
    return uint32_t{h.weight_decay != 0.0} << kWeightDecay | uint32_t{h.momentum != 0.0} << kMomentum |
           uint32_t{h.nesterov} << kNesterov;
  }
  // With momentum: the buffer, and the step count (0 steps taken: the buffer is not set yet).
  static constexpr MPF_HD uint32_t state_mask(uint32_t f) { return (f >> kMomentum) & 1u; }
  static constexpr MPF_HD bool needs_step(uint32_t f) { return ((f >> kMomentum) & 1u) != 0; }

  struct Scalars {
    float grad_sign, momentum, one_minus_dampening, weight_decay, neg_lr;
    bool first;  // the buffer has never been written: torch then sets it to the gradient itself
  };
  static MPF_HD Scalars scalars(const Hyper& h, const StepContext& s) {
    return Scalars{h.maximize ? -1.f : 1.f, static_cast<float>(h.momentum), static_cast<float>(1.0 - h.dampening),
                   static_cast<float>(h.weight_decay), static_cast<float>(-s.lr), s.step == 1.0};
  }

  template <class F>
  static MPF_HD void update(float& p, float* s, float g, const F& f, const Scalars& c) {
    g = fmul(g, c.grad_sign);
    if (f.has(kWeightDecay)) g = fadd(g, fmul(c.weight_decay, p));
    if (f.has(kMomentum)) {
      const float b = c.first ? g : fadd(fmul(s[0], c.momentum), fmul(c.one_minus_dampening, g));
      s[0] = b;
      g = f.has(kNesterov) ? fadd(g, fmul(c.momentum, b)) : b;
    }
    p = fadd(p, fmul(c.neg_lr, g));
  }
};

}  // namespace mpf
