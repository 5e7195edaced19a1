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

# The global norm written by the overflow pass, against sqrt(sumsq) in float64: IEEE sqrt is correctly
# rounded (sqrtf on the CPU, __fsqrt_rn on CUDA), so the FP32 norm is within half an FP32 ulp of the
# exact root of the FP32 sum of squares. (torch.sqrt on the CPU is not: 1 ulp off on AMD EPYC.)
NORM_ULP = 0.5

# Optimizer parity with torch.optim over many steps, FP32 weights of magnitude ~1 (absolute tolerance).
# Our kernels round every FP32 operation separately (core/optim/); torch's vectorised CPU kernels fuse
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

# GEMM on random normal inputs: our error against a float64 reference may be at most this factor times
# torch's own error on the same inputs (torch.matmul of the FP32-widened inputs, rounded once to the
# output dtype), per output dtype. Both accumulate exact FP16/BF16 products in FP32; only the order of
# the additions differs (ATen's GEMM on the CPU, WMMA tiles on CUDA), so the errors are of the same size.
GEMM_ERROR_FACTOR = {
    torch.float32: 2.0,  # FP32 accumulation error only; summation orders differ (the 2x)
    torch.float16: 2.0,  # dominated by the final rounding to FP16 (<= 1/2 ulp), plus the FP32 error above
    torch.bfloat16: 2.0,  # dominated by the final rounding to BF16 (<= 1/2 ulp), plus the FP32 error above
}

# The same GEMMs against a float64 reference, element by element, from the error bound itself rather than
# from another library's error (cuBLAS's FP32 GEMM can be far more accurate on a given input than its bound
# than ATen's CPU GEMM, so "twice torch's error" could fail a correct kernel there). Products of FP16/BF16
# values are exact in FP32; a sum of K of them accumulated in FP32 in any order is within
# gamma_K * (|A| |B|)_ij of the exact sum, gamma_K = K u / (1 - K u) with u = 2^-24 (Higham, Accuracy and
# Stability of Numerical Algorithms, 3.1); rounding that FP32 sum to the output dtype adds at most half an
# ulp of it (relative: 2^-24, 2^-11, 2^-8), and below the output's normal range half its smallest subnormal.
# A kernel that accumulated in FP16 (u = 2^-11) or rounded its products breaks this for K >= 64.
GEMM_ACCUM_U = 2.0**-24
GEMM_OUT_HALF_ULP = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
GEMM_OUT_SUBNORMAL_HALF = {torch.float32: 2.0**-150, torch.float16: 2.0**-25, torch.bfloat16: 2.0**-134}

# GELU epilogue against torch's F.gelu on the same FP32 pre-activation: the tanh/erf of the C library
# (CPU) or of CUDA differ from torch's vectorised ones by a few FP32 ulp, and where the tanh form cancels
# (large negative inputs: 1 + tanh(...) is ~1e-7) the absolute difference stays below ~1e-6. The output
# rounding can then land on the neighbouring FP16/BF16 value. (rtol, atol) per output dtype:
GELU_TOL = {
    torch.float32: (8 * 2.0**-24, 1e-5),  # a few FP32 ulp; atol for the cancellation region
    torch.float16: (2.0**-10, 1e-5),  # one FP16 ulp (2^-10 relative), same atol
    torch.bfloat16: (2.0**-7, 1e-5),  # one BF16 ulp (2^-7 relative), same atol
}

# FusedLinear against float64 autograd on the same low-precision values (forward and the three
# gradients), as max |error| / max |reference|: both sides round every GEMM result, the pre-activation
# and the activation's gradient to FP16/BF16 once or twice, so the error is a few units of the dtype's
# rounding (2^-11 FP16, 2^-8 BF16) relative to the largest value. Our error must also stay within this
# factor of torch's own (F.linear + activation in the same dtype) plus one unit of rounding.
LINEAR_REL_TOL = {
    torch.float16: 8 * 2.0**-11,  # a few FP16 roundings relative to the output's scale
    torch.bfloat16: 8 * 2.0**-8,  # a few BF16 roundings relative to the output's scale
}
LINEAR_VS_TORCH_FACTOR = 2.0  # our error <= 2x torch's + one rounding unit (same roundings, other order)

# amp O2 against O0 (tests/test_amp.py): a small MLP trained 100 AdamW steps on the same data, the loss
# compared at every step (absolute; the loss is 1-2.3). O2's forward rounds weights and activations to
# the low-precision dtype (unit roundoff u = 2^-11 FP16, 2^-8 BF16), so each step's loss differs from O0's
# by a fraction of u times the loss; the FP32 master weights keep those roundings from accumulating in
# the weights, so the gap does not grow with the steps. 2u leaves about 5x margin over what was measured
# on the CPU (1.7e-4 FP16, 1.2e-3 BF16), while O3 (no masters) measured 3.2e-3 / 2.8e-2, above the bound.
AMP_O2_VS_O0_LOSS_ATOL = {
    torch.float16: 2 * 2.0**-11,  # 2u of FP16
    torch.bfloat16: 2 * 2.0**-8,  # 2u of BF16
}

# GradScaler runs (tests/test_torch_grad_scaling.py, torch's _run_scaling_case): a model trained through
# the scaler against a control trained without scaling, lr 1.0, 4 iterations. The scales are powers of
# two, so scaling and unscaling are exact and the plain runs agree to torch's own atol (1e-7, with its
# rtol 1e-5): only the fused optimizers' different operation order remains, which is far below it.
SCALED_RUN_ATOL = 1e-7
# ... with torch's own rtol for these cases: a few FP32 ulp (2^-24 each) of relative difference from the
# fused optimizers' operation order, compounded over the 4 iterations at lr 1.0.
SCALED_RUN_RTOL = 1e-5
# Clipping, penalty and autocast runs: the clip coefficient (max_norm / (norm + 1e-6)) or the penalty's
# square root is computed from scaled and from unscaled values, which round differently (the 1e-6 in the
# denominator is not scaled), and lr 1.0 carries that into the weights: torch's clipping cases use 1e-5.
SCALED_CLIP_RUN_ATOL = 1e-5
# Distributed clipping (tests/test_scaler_distributed.py) against torch's clip_grad_norm_ on the whole
# model in one process, relative: DDP's gradient is the mean of per-rank gradients (gloo adds them in its
# own order), the whole-batch gradient is one mean; the norms add the same squares in other orders (our
# FP32 lanes and FP64 partials vs torch's per-tensor norms). A few FP32 ulp (2^-24 each) of a sum of
# ~60 terms; the bug this catches (a norm sqrt(world) too large) is off by 41% or more.
DIST_NORM_RTOL = 1e-5
# The params after the distributed clipped step, against the whole-model reference: SGD with lr 1 moves
# them by coef * grad, whose norm is at most max_norm, so the norm's relative error above reaches them
# scaled by the update: DIST_NORM_RTOL relative, and this much absolute for params near zero (a few FP32
# ulp of the O(1) update).
DIST_PARAM_ATOL = 1e-6
# Gradients after clip_grad_norm_ + unscale_ (ours: each value times (1/scale * clip coefficient), one
# rounding, the coefficient from our FP32 sum of squares) against torch's unscale_ then clip_grad_norm_
# (two roundings, its own norm): a few FP32 ulp apart, (rtol, atol); atol for values near zero.
CLIPPED_GRAD_TOL = (1e-5, 1e-7)

# An FP16 value rounded from an FP32 result against the FP16 rounding of a reference computed in another
# order: the two FP32 values differ by a few FP32 ulp, which can tip the rounding to the neighbouring FP16
# value: one FP16 ulp, at most 2^-10 of the value.
FP16_ROUNDING_RTOL = 2.0**-10

# FusedLAMB (tests/test_lamb.py) against a float64 reference: the error a step adds to an FP32 weight (or
# FP32 master), as a fraction of the tensor's largest |weight| W; the steps' errors add up. Two sources:
# - the weight's own rounding when the update is added: <= 1 unit u = 2^-24 of W;
# - the update's relative error times its size. The update moves an element by at most ~3*lr*W (lr * ratio
#   * |u_i| with ratio * ||u|| = ||w||; |u_i| <~ 3 where no ratio applies, for weights of O(1)), and is
#   computed to within ~100u: the FP32 constants (betas, bias corrections, eps, weight decay: <= 8u); the
#   moments (each step rounds m 5 times and v 6 times: <= ~8u per step in m / sqrt(v), <= 64u after 8
#   steps); the division, sqrt and add (<= 4u); the trust ratio's two norms, summed in a different order
#   (FP32 lane sums, <= 12 adds per lane for tensors of <= 192 elements: <= 12u, halved by the square
#   roots); and the global clip factor (an FP32 sum of the step's ~320 squares in 32 lanes: <= ~40u, halved
#   by its square root; it changes m / sqrt(v) only through the steps' relative weights).
# With lr <= 0.05 (the tests assert it): 1 + 3 * 0.05 * 100 = 16u per step. A wrong formula (a bias
# correction, the clip, the trust ratio, the decay) moves the weights by more than 1e5 u.
LAMB_WEIGHT_RTOL_PER_STEP = 16 * 2.0**-24

# FusedLAMB on CUDA against the CPU backend, one step from the same state, no global clip
# (tests/test_optim_precision.py): the CPU adds a tensor's sums of squares for the trust ratio in FP64
# lanes, the GPU in FP32 per thread (at most 256 terms: relative error <= 256 * 2^-24 ~ 1.5e-5) and then
# in FP64, so the ratio, and the step with it, may differ by ~1.5e-5 of the step. Allowed: 1e-4 of the step
# (margin for the square root and the division that follow), plus one unit of the stored weight's dtype
# (the rounding may then go the other way). The same rule as the CUDA simulator's (tests/native/cuda_sim).
# A wrong ratio moves the step by far more.
LAMB_SUM_ORDER_STEP_RTOL = 1e-4

# FusedLion (tests/test_lion.py) against a float64 reference. The direction c = beta1 * m + (1 - beta1) * g
# in FP32: |m| <= G (the largest |g| of the run: m is a convex combination of gradients), each step rounds m
# 5 times (beta2 and 1 - beta2 to FP32, two products, the sum: <= 5u * G, u = 2^-24; beta2 < 1 damps the
# earlier errors) and c takes 5 more. After s steps |c - c_ref| <= 5 * s * u * G, so where |c_ref| exceeds
# that, sign(c) is the reference's. The tests assert this margin for every element of every step (a sign
# that flips moves the weight by 2 * lr, not by a rounding), times the step count and G:
LION_DIRECTION_ERROR_PER_STEP = 5 * 2.0**-24
# The weight p * (1 - lr * wd) - lr * sign(c): the decay factor and -lr rounded to FP32 (1u of |p|, 1u of
# lr), the product and the sum rounded (1u of |p| each): <= 3u * |p| + u * lr <= 4u * P per step, P = the
# largest |p| of the run (<= max |p0| + steps * lr, which is >= lr); the decay factor <= 1 does not amplify
# earlier errors. Per step, times P:
LION_WEIGHT_RTOL_PER_STEP = 4 * 2.0**-24

# Stochastic rounding, checked statistically (tests/test_random.py, tests/test_fixed_point.py, the
# optimizers' stochastic write-back): the fraction of N samples of x that
# round up is binomial with mean p = (x - a) / (b - a); it must lie within this many standard deviations
# sqrt(p (1 - p) / N) of p. 5 sigma: a false failure has probability ~6e-7 per check (the bits are fixed
# by the seeds, so a passing run passes every time); a rounding that is off by 1/64 of a step (N = 2^16:
# sigma <= 0.002) fails.
SR_SIGMAS = 5.0
# ... plus the generator's resolution where the dropped part is longer than the 16 random bits (FP16's
# subnormal grid): the probability is then rounded down to a multiple of 2^-16 (core/stochastic.h).
SR_FP16_SUBNORMAL_RESOLUTION = 2.0**-16

# Training runs through a framework (tests/integrations: Lightning, accelerate) against the same run written
# by hand with torch.optim and torch.amp.GradScaler, absolute, over a few steps of SGD (lr 0.1, momentum)
# on weights of O(1). The forward, backward and (power-of-two) unscale are the same operations; what
# differs is the clip coefficient (ours from an FP32 sum of squares, torch's from its own norm: a few FP32
# ulp apart, CLIPPED_GRAD_TOL) and the fused update's operation order (OPTIM_FP32_ATOL's few ulp per step).
# Both stay far below 1e-5; a clip that did not happen, or happened twice, moves the weights by 1e-3 or more
# (the tests assert that gap too).
FRAMEWORK_RUN_ATOL = 1e-5

# FSDP2 with MixedPrecisionPolicy(param_dtype=bf16): both runs compute the forward and backward in BF16
# from FP32 sharded params that the two optimizers keep a few FP32 ulp apart (OPTIM_FP32_ATOL). Where such
# a pair straddles a BF16 rounding boundary, the two forwards see params one BF16 ulp (2^-8 relative)
# apart: the losses may then differ by about that much in relative terms (2^-7 leaves a factor 2), and the
# next Adam steps (each moves a param by about lr times a normalised gradient) by lr * 2^-7 per step. A
# step that did not happen, or happened unscaled, moves losses and params by far more (lr 1e-2 per step).
# The same holds for a BF16-param run resumed from a checkpoint on another number of ranks
# (tests/test_dcp.py): the gradients are reduced in FP32 in another order, then cast to the params' BF16,
# so a gradient may land one BF16 ulp away, and each Adam step moves its FP32 master by at most about
# lr * 2^-8 more (measured: 1.2e-4 after 3 steps at lr 1e-2; the bound below allows 8 such steps).
DIST_BF16_LOSS_RTOL = 2.0**-7
DIST_BF16_PARAM_ATOL = 4 * 1e-2 * 2.0**-7
