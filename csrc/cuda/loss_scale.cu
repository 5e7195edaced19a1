// CUDA backend of the loss-scale update: one thread applies the core/loss_scale.h rule to the scaler's
// device tensors and refreshes 1/scale for the next iteration's unscale. Nothing reaches the host.
#include "../kernels.h"
#include "common.cuh"

namespace mpf {
namespace {

__global__ void loss_scale_update_kernel(LossScaleArgs a) {
  loss_scale_update(*a.scale, *a.growth_tracker, *a.hysteresis_left, *a.skipped_steps, *a.found_inf, a.config);
  if (a.inv_scale) *a.inv_scale = static_cast<float>(1.0 / static_cast<double>(*a.scale));
}

}  // namespace

void loss_scale_update_cuda(const LossScaleArgs& a, void* stream) {
  loss_scale_update_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(a);
  cuda_check(cudaGetLastError(), "launching the loss-scale update");
}

}  // namespace mpf
