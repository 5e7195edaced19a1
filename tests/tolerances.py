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
