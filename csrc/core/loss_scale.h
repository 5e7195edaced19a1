// Dynamic loss-scale update, shared by the CPU and CUDA backends (one thread on the device: no sync).
//
// torch.amp.GradScaler's rule (torch._amp_update_scale_), plus:
//   - hysteresis (DeepSpeed): back off only after `hysteresis` consecutive overflows; a clean step
//     restores the allowance;
//   - opt-in clamps: growth stops at max_scale and backoff at min_scale (the defaults, 0 and inf, are
//     torch's rule: no clamp, and growth skipped when the product is not finite);
//   - static mode: the scale never changes;
//   - a count of skipped steps (found_inf != 0), kept on the device, in every mode.
// The products are computed in double and rounded to FP32 once, as torch does.
#pragma once

#include <cstdint>

#include "numeric.h"

namespace mpf {

struct LossScaleConfig {
  double growth_factor, backoff_factor;
  int32_t growth_interval, hysteresis;
  double min_scale, max_scale;
  bool dynamic;
};

// State, all on the device: scale, growth_tracker (clean steps since the last change), the overflows
// still tolerated before a backoff, and the number of skipped steps so far.
MPF_HD void loss_scale_update(float& scale, int32_t& growth_tracker, int32_t& hysteresis_left, int64_t& skipped,
                              float found_inf, const LossScaleConfig& c) {
  // (The counts saturate, never wrap: a state dict may load any value up to their types' maxima.)
  if (found_inf != 0.f && skipped < INT64_MAX) skipped += 1;
  if (!c.dynamic) return;
  if (found_inf != 0.f) {
    growth_tracker = 0;
    if (hysteresis_left <= 1) {  // this overflow uses up the allowance: back off
      const double s = static_cast<double>(scale) * c.backoff_factor;
      scale = static_cast<float>(s < c.min_scale ? c.min_scale : s);
      hysteresis_left = c.hysteresis;
    } else {
      hysteresis_left -= 1;
    }
    return;
  }
  hysteresis_left = c.hysteresis;
  const int64_t successful = static_cast<int64_t>(growth_tracker) + 1;  // (2^31 - 1 + 1 in 64 bits)
  if (successful >= c.growth_interval) {
    const double s = static_cast<double>(scale) * c.growth_factor;
    const float grown = static_cast<float>(s > c.max_scale ? c.max_scale : s);
    if (is_finite(grown)) scale = grown;
    growth_tracker = 0;
  } else {
    growth_tracker = static_cast<int32_t>(successful);  // (< growth_interval, an int32)
  }
}

}  // namespace mpf
