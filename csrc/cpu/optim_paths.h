// The CPU optimizer step of each path: optim_<path>.cpp defines one (optim_clone.inc) where the build
// has that path (isa.h's MPF_HAVE_*_CLONES), and optim.cpp calls the one isa.h selects.
#pragma once

#include "../kernels.h"

namespace mpf {

void optim_step_baseline(const OptimArgs& args, int num_threads);
void optim_step_avx2(const OptimArgs& args, int num_threads);
void optim_step_avx512(const OptimArgs& args, int num_threads);

}  // namespace mpf
