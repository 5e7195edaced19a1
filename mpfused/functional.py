"""Functional API: :func:`gemm`, the FP16/BF16 GEMM with FP32 accumulation and a fused epilogue."""

from __future__ import annotations

from typing import Optional

import torch

from . import _ops

__all__ = ["gemm"]


def gemm(a: torch.Tensor, b: torch.Tensor, *, bias: Optional[torch.Tensor] = None, activation: Optional[str] = None,
         alpha: float = 1.0, beta: float = 0.0, c: Optional[torch.Tensor] = None,
         out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``act(alpha * (a @ b) + beta * c + bias)``: FP16/BF16 products accumulated in FP32, with the epilogue
    fused into the same kernel, rounded once to ``out_dtype``. Returns a new tensor.

    Shapes (the output is ``(M, N)``, or ``(B, M, N)`` when an operand is batched):

    - ``a`` ``(M, K)`` or ``(B, M, K)``; ``b`` ``(K, N)`` or ``(B, K, N)``. When both are 3-D their batch
      sizes must be equal. When one is 3-D and the other 2-D, the 2-D one is used for every batch (no
      copy), e.g. ``gemm(x, w.t())`` for activations ``x`` of shape ``(B, T, in)``; an expanded operand
      (``b.expand(B, -1, -1)``, batch stride 0) works the same way.
    - ``bias``: ``(N,)``, added to every row. ``c``: ``(M, N)`` (shared by every batch) or ``(B, M, N)``.

    Dtypes: ``a`` and ``b`` float16, or both bfloat16 (float32, integer and complex inputs are
    rejected: this is a low-precision GEMM; use ``torch.matmul`` for FP32). ``bias`` and ``c`` may be
    float32, float16 or bfloat16, independently. ``out_dtype``: float16, bfloat16 or float32; default
    the inputs' dtype.

    The epilogue, in FP32 on the FP32 accumulator, each operation rounded once:
    ``y = alpha * acc``, ``y = y + beta * c`` (only when ``beta != 0``: with ``beta == 0`` ``c`` is not read
    at all, so NaN or inf in it do not propagate, as in ``torch.addmm``; note that ``beta`` defaults to
    0, so pass ``beta=1.0`` to add ``c``), ``y = y + bias``, then ``activation``:

    - ``None``: the identity;
    - ``"relu"``: ``max(y, 0)`` (NaN stays NaN);
    - ``"gelu"``: GELU with the tanh approximation, ``torch.nn.functional.gelu(y, approximate="tanh")``;
    - ``"gelu_erf"``: the exact GELU, ``torch.nn.functional.gelu(y)``.

    Layout: an operand (or ``c``) whose last dim has stride 1 is read row-major, and one whose second-to-last
    dim has stride 1 (a transposed view such as ``w.t()``) column-major; both without a copy, also when
    the leading dimension is not a multiple of 8 (e.g. a slice ``x[:, :k]`` of a wider tensor; on CUDA such
    operands take a slower correct path instead of 16-byte vector loads). Any other layout (e.g.
    ``x[:, ::2]``) is first copied with ``.contiguous()``.

    Numerics: every product of two FP16/BF16 values is exact in FP32 and the sums are FP32 (tensor cores
    on CUDA; on the CPU the exactly widened inputs go through ATen's FP32 GEMM). The epilogue is the same
    code on both backends (``csrc/core/gemm.h``). Products of small integers are therefore exact.

    Errors: every invalid argument (dtype, device, shape, activation, out_dtype) raises a ``ValueError``
    naming it (a ``TypeError`` for an argument of the wrong type), before anything is allocated or
    launched. CUDA tensors need a build of mpfused with CUDA
    kernels; BF16 on CUDA needs sm_80 or newer.

    Differentiable in every input but ``out_dtype`` and the numbers: the backward runs on the same GEMM
    where the gradient has the operands' dtype (``alpha * grad @ b^T``, ``alpha * a^T @ grad``, each
    accumulated in FP32 and rounded once), and in FP32 otherwise; the bias gradient is an FP32 sum. An
    operand expanded over the batch (``b.expand(B, -1, -1)``) gets one gradient per batch, each rounded,
    which autograd's expand backward then adds up (a 2-D operand shared by every batch is rounded once). With a
    GELU the backward computes the value before it again (one more GEMM; ``mpfused.nn.FusedLinear`` keeps
    it from the forward instead). Never synchronises the host with the device; traced by torch.compile
    without a graph break (it is the operator ``torch.ops.mpfused.gemm``).
    """
    return _ops.gemm(a, b, bias, activation, alpha, beta, c, out_dtype)
