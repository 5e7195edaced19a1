// CPU backend of the loss-scale update: the core/loss_scale.h rule on the scaler's CPU tensors.
#include "../kernels.h"

namespace mpf {

void loss_scale_update_cpu(const LossScaleArgs& a) {
  loss_scale_update(*a.scale, *a.growth_tracker, *a.hysteresis_left, *a.skipped_steps, *a.found_inf, a.config);
  if (a.inv_scale) *a.inv_scale = static_cast<float>(1.0 / static_cast<double>(*a.scale));
}

}  // namespace mpf
