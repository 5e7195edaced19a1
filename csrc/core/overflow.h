// The multi-tensor overflow reduction, element by element, shared by the CPU and CUDA backends.
//
// For every element x of every tensor:
//   - found_inf: set when x (as stored, before any scaling) is inf or NaN, as torch's
//     _amp_foreach_non_finite_check_and_unscale_ does;
//   - v = float(x) * inv_scale (when an inv_scale is given), all in FP32;
//   - sum of squares: acc += v * v (FP32; the norm of the *unscaled* gradients, so that large scaled
//     gradients cannot overflow the sum);
//   - unscale: x = round_to_storage(v), in place.
#pragma once

#include "numeric.h"

namespace mpf {

// Which parts of the pass run. kUnscale implies kScale; kScale alone only affects the sum.
template <bool kScale_, bool kUnscale_, bool kSumsq_>
struct OverflowMode {
  static constexpr bool kScale = kScale_;
  static constexpr bool kUnscale = kUnscale_;
  static constexpr bool kSumsq = kSumsq_;
  static_assert(!kUnscale_ || kScale_, "unscaling needs an inv_scale");
};

// `bad` is any unsigned integer: it is OR-ed with 1 when x is non-finite (the CPU keeps it as wide
// as the data so that vector loops need no widening).
template <DType D, class Mode, class Flag>
MPF_HD void overflow_step(typename Storage<D>::type& x, float inv_scale, Flag& bad, float& acc) {
  using S = Storage<D>;
  bad |= static_cast<Flag>(S::nonfinite_bits(x) == S::kExpMask);
  if (Mode::kSumsq || Mode::kUnscale) {
    float v = S::load(x);
    if (Mode::kScale) v *= inv_scale;
    if (Mode::kSumsq) acc += v * v;
    if (Mode::kUnscale) x = S::store(v);
  }
}

// Dispatches a runtime (scale?, unscale?, sumsq?) triple to a compile-time mode. A scale that feeds
// neither the sum nor a write-back is dropped: it cannot change the result.
template <class F>
inline void dispatch_overflow_mode(bool scale, bool unscale, bool sumsq, F&& f) {
  if (unscale) {
    if (sumsq) f(OverflowMode<true, true, true>{});
    else f(OverflowMode<true, true, false>{});
  } else if (sumsq) {
    if (scale) f(OverflowMode<true, false, true>{});
    else f(OverflowMode<false, false, true>{});
  } else {
    f(OverflowMode<false, false, false>{});
  }
}

}  // namespace mpf
