"""Stochastic rounding that gives the same bits anywhere.

``round_stochastic(x, dtype, seed=s, offset=k)`` rounds FP32 to FP16 or BF16 so that a value between two
neighbours ``a < b`` of the target format becomes ``b`` with probability ``(x - a) / (b - a)``: unbiased,
``E[round(x)] = x``, which is what lets updates far smaller than a format's step accumulate (Gupta et al.,
"Deep Learning with Limited Numerical Precision", 2015).

The random bits come from Philox4x32-10 (a counter-based generator): element ``i`` uses the bits of index
``offset + i`` under ``seed``. So the result depends on nothing but (seed, offset + i, x[i]): not on
threads, chunking, launch shape or device (CPU and CUDA give the same bits), and
``round_stochastic(x[k:], dt, seed=s, offset=k)`` equals ``round_stochastic(x, dt, seed=s)[k:]``.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _ops

__all__ = ["round_stochastic", "philox_words", "philox4x32_10"]

philox_words = _ops.philox_words
philox4x32_10 = _ops.philox4x32_10


def round_stochastic(x: torch.Tensor, dtype: torch.dtype, *, seed: int, offset: int = 0,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` (a float32 tensor on the CPU or a CUDA device) rounded stochastically to ``dtype``
    (``torch.float16`` or ``torch.bfloat16``). Returns a new tensor of ``x``'s shape; elements are indexed
    in ``x``'s row-major order.

    - Values of the target format (zeros included) are returned unchanged.
    - Probabilities: exact for BF16 (its 16 dropped bits against 16 random bits) and in FP16's normal
      range (13 dropped bits); on FP16's subnormal grid only the first 16 dropped bits count, so the
      probability is exact to 2^-16 there.
    - Subnormal results are rounded on the subnormal grid like any other.
    - Overflow: the grid continues one step past the largest finite value, to 2^16 (FP16) or 2^128
      (BF16), and that step is infinity: ``x`` above the largest finite value ``m`` becomes ``inf`` with
      probability ``(|x| - m) / (2^16 - m)`` (FP16), and ``|x| >= 2^16`` always does. We do not saturate:
      a loss scaler must still see the overflow (round-to-nearest sends these inputs to inf as well).
    - ``inf`` stays ``inf`` and NaN stays NaN.

    ``seed``: an int in [0, 2^64). ``offset``: the index of element 0 (``offset + x.numel() <= 2^64``).
    ``out``: a contiguous ``dtype`` tensor of ``x``'s shape on its device, not overlapping ``x``, to write
    into (returned); by default a new tensor.

    The random bits: element ``i`` takes 16 bits of Philox4x32-10 (key = ``seed``, counter =
    ``((offset + i) // 8`` as two words, 0, 0``), word ``(offset + i) // 2 % 4``, its low half for even
    ``offset + i``): :func:`philox_words` returns them.
    """
    return _ops.round_stochastic(x, dtype, seed, offset, out)
