// The optimizer policies the backends compile and the bindings expose. Registering one is one line here
// (and its #include): both backends instantiate their generic drivers for it, and the bindings take its
// state and hyperparameter names from the policy itself.
#pragma once

#include <cstdint>
#include <cstring>

#include "adam.h"
#include "lamb.h"
#include "lion.h"
#include "sgd.h"

#define MPF_OPTIMIZERS(X) \
  X(Adam, AdamPolicy)     \
  X(Sgd, SgdPolicy)       \
  X(Lamb, LambPolicy)     \
  X(Lion, LionPolicy)

namespace mpf {

#define MPF_OPTIM_ENUM(name, policy) k##name,
enum class OptimKind : int32_t { MPF_OPTIMIZERS(MPF_OPTIM_ENUM) kCount };
#undef MPF_OPTIM_ENUM

// f(Policy{}) for a kind; false for an unknown kind.
template <class F>
bool dispatch_optim(OptimKind kind, F&& f) {
#define MPF_OPTIM_CASE(name, policy) \
  case OptimKind::k##name: f(policy{}); return true;
  switch (kind) { MPF_OPTIMIZERS(MPF_OPTIM_CASE) default: return false; }
#undef MPF_OPTIM_CASE
}

// f(Policy{}) for every policy, in registration order.
template <class F>
void dispatch_optim_all(F&& f) {
#define MPF_OPTIM_EACH(name, policy) f(policy{});
  MPF_OPTIMIZERS(MPF_OPTIM_EACH)
#undef MPF_OPTIM_EACH
}

// The kind of a policy name ("adam"); false for an unknown name.
inline bool optim_kind(const char* name, OptimKind* kind) {
#define MPF_OPTIM_NAME(n, policy)                \
  if (std::strcmp(name, policy::kName) == 0) { \
    *kind = OptimKind::k##n;                     \
    return true;                                 \
  }
  MPF_OPTIMIZERS(MPF_OPTIM_NAME)
#undef MPF_OPTIM_NAME
  return false;
}

// Every policy fits the kernels' fixed-size arguments.
#define MPF_OPTIM_FITS(name, policy)                                                         \
  static_assert(policy::kNumStates <= kMaxStates && policy::kNumHyper <= kMaxHyper, #policy \
                " exceeds kMaxStates or kMaxHyper (core/optim/common.h)");
MPF_OPTIMIZERS(MPF_OPTIM_FITS)
#undef MPF_OPTIM_FITS

}  // namespace mpf
