// torch.ops.mpfused.loss_scale_update_: the dynamic loss-scale update (csrc/core/loss_scale.h) on a
// scaler's device tensors, in place; one tiny launch on CUDA, no host sync.
#include <cmath>

#include "common.h"

namespace mpf_torch {
namespace {

void loss_scale_update_(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& hysteresis_left,
                        const at::Tensor& skipped_steps, const at::Tensor& found_inf,
                        const std::optional<at::Tensor>& inv_scale, double growth_factor, double backoff_factor,
                        int64_t growth_interval, int64_t hysteresis, double min_scale, double max_scale, bool dynamic) {
  check_dense(scale, "scale");
  const at::Device device = scale.device();
  check_backend(device, "scale");
  check_scalar(scale, "scale", device);
  check_scalar(found_inf, "found_inf", device);
  if (inv_scale) check_scalar(*inv_scale, "inv_scale", device);
  const auto check_int = [&device](const at::Tensor& t, const std::string& name, at::ScalarType type) {
    check_dense(t, name);
    if (t.scalar_type() != type || t.numel() != 1 || t.device() != device)
      fail(name + " must be an " + c10::toString(type) + " tensor with one element on " + device.str() + ", got a " +
           describe(t));
  };
  check_int(growth_tracker, "growth_tracker", at::kInt);
  check_int(hysteresis_left, "hysteresis_left", at::kInt);
  check_int(skipped_steps, "skipped_steps", at::kLong);
  // torch's rule: growth_factor > 1, backoff_factor < 1 (an infinite growth factor never grows: the
  // product is not finite); NaN is refused.
  if (!(growth_factor > 1.0)) fail("growth_factor must be > 1, got " + std::to_string(growth_factor));
  if (!(backoff_factor < 1.0)) fail("backoff_factor must be < 1, got " + std::to_string(backoff_factor));
  // (and > 0, mpfused.GradScaler's rule: 0 takes the scale to 0 at the first overflow, every gradient after it
  // to 0 * inf = NaN; a negative one makes the scale negative)
  if (!(backoff_factor > 0.0)) fail("backoff_factor must be > 0, got " + std::to_string(backoff_factor));
  check_hyper(min_scale, "min_scale", 0.0, false, 3.4e38, false);
  if (!(max_scale >= min_scale)) fail("max_scale must be >= min_scale (inf for no clamp)");
  if (growth_interval < 1 || growth_interval > INT32_MAX) fail("growth_interval must be a positive int32");
  if (hysteresis < 1 || hysteresis > INT32_MAX) fail("hysteresis must be a positive int32");
  // Each written tensor apart from the others and from found_inf, which the update reads after writing some
  // of them (the same tensor as scale and inv_scale made the scale 1 / scale; found_inf as scale read the new
  // scale as the flag).
  const at::Tensor* written[5] = {&scale, &growth_tracker, &hysteresis_left, &skipped_steps, inv_scale ? &*inv_scale : nullptr};
  const char* names[5] = {"scale", "growth_tracker", "hysteresis_left", "skipped_steps", "inv_scale"};
  for (int i = 0; i < 5; ++i) {
    if (!written[i]) continue;
    check_disjoint(found_inf, "found_inf", *written[i], names[i]);
    for (int j = 0; j < i; ++j)
      if (written[j]) check_disjoint(*written[j], names[j], *written[i], names[i]);
  }
  mpf::LossScaleArgs a{scale.data_ptr<float>(), inv_scale ? inv_scale->data_ptr<float>() : nullptr,
                       growth_tracker.data_ptr<int32_t>(), hysteresis_left.data_ptr<int32_t>(),
                       skipped_steps.data_ptr<int64_t>(), found_inf.data_ptr<float>(),
                       mpf::LossScaleConfig{growth_factor, backoff_factor, static_cast<int32_t>(growth_interval),
                                            static_cast<int32_t>(hysteresis), min_scale, max_scale, dynamic}};
  if (device.is_cpu()) {
    mpf::loss_scale_update_cpu(a);
    return;
  }
#ifdef MPFUSED_WITH_CUDA
  const c10::cuda::CUDAGuard guard(device);
  mpf::loss_scale_update_cuda(a, c10::cuda::getCurrentCUDAStream(device.index()).stream());
#endif
}

}  // namespace
}  // namespace mpf_torch

using namespace mpf_torch;

TORCH_LIBRARY_FRAGMENT(mpfused, m) {
  m.def("loss_scale_update_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor(c!) hysteresis_left, "
        "Tensor(d!) skipped_steps, Tensor found_inf, Tensor(e!)? inv_scale, float growth_factor, float backoff_factor, "
        "int growth_interval, int hysteresis, float min_scale, float max_scale, bool dynamic) -> ()");
}
MPF_TORCH_IMPL_CPU_CUDA("loss_scale_update_", &loss_scale_update_)
MPF_TORCH_NO_AUTOGRAD("loss_scale_update_")
