// CPU backend of the fused optimizer step: any policy of core/optim/ applied by the generic driver of
// optim_impl.inc, parallel over chunks. A step with found_inf != 0 returns before anything is written.
// Each path (baseline, avx2, avx512) is compiled in its own unit (optim_clone.inc); this one calls the
// path isa.h selects.
#include "../kernels.h"
#include "isa.h"
#include "optim_paths.h"

namespace mpf {

void optim_step_cpu(const OptimArgs& args, int num_threads) {
  if (args.found_inf && *args.found_inf != 0.f) return;  // skipped: params, state and steps untouched
  switch (cpu_isa()) {
#if MPF_HAVE_AVX512_CLONES
    case CpuIsa::kAvx512: return optim_step_avx512(args, num_threads);
#endif
#if MPF_HAVE_AVX2_CLONES
    case CpuIsa::kAvx2: return optim_step_avx2(args, num_threads);
#endif
    default: return optim_step_baseline(args, num_threads);
  }
}

}  // namespace mpf
