"""Tolerances for comparisons against float64 references, one entry per dtype, each with its reason.

Sum of squares (relative error of an FP32 accumulation against float64): the kernels square each
element in FP32 (exact to 2^-24 relative) and add in FP32 lanes over chunks of 65536 elements, then
add the chunk partials in FP64. With at most ~4096 sequential FP32 additions per lane the worst-case
relative error bound is about 4096 * 2^-24 = 2.4e-4; all terms are positive, so errors do not cancel
badly, and the observed error is far below the bound. The element's dtype does not matter: FP16/BF16
values widen to FP32 exactly, so the same bound holds for every dtype.
"""

import torch

SUMSQ_RTOL = {
    torch.float32: 2.5e-4,  # FP32 lane accumulation: <= ~4096 sequential adds * 2^-24 (see above)
    torch.float16: 2.5e-4,  # values widen exactly to FP32, then the same FP32 accumulation
    torch.bfloat16: 2.5e-4,  # values widen exactly to FP32, then the same FP32 accumulation
}

# Optimizer parity with torch.optim over many steps, FP32 weights of magnitude ~1 (absolute tolerance).
# Our kernels round every FP32 operation separately (core/optim.h); torch's vectorised CPU kernels fuse
# some multiply-adds (FMA) and its for-loop reference orders a few operations differently, so each step's
# update can differ by a few ulp of an lr-sized value (lr 1e-3: ~1e-10), and the moments by a few ulp.
# Over 50-100 steps this drift stays far below 1e-6 absolute; a wrong formula (a missing bias correction,
# decay applied twice, a momentum off by one step) moves the weights by 1e-4 or more.
OPTIM_FP32_ATOL = 2e-6
# Losses of a small model trained 100 steps by us and by torch: the weight drift above, propagated
# through the model; relative, since losses are O(1).
OPTIM_LOSS_RTOL = 1e-4
# Low-precision params written from an FP32 master: equal to the reference master cast to the dtype,
# except where the two FP32 masters (within OPTIM_FP32_ATOL) round to neighbouring values: at most one
# ulp of the low-precision dtype, on a small fraction of the elements.
OPTIM_LOWP_MAX_ULP = 1
OPTIM_LOWP_MISMATCH_FRACTION = 1e-3
