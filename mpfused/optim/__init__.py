"""Fused optimizers: drop-in replacements for torch.optim.Adam, AdamW and SGD, and LAMB and Lion, that
unscale, skip on inf/NaN and update FP32 master weights in one pass per device and param group.

``FusedOptimizer`` is their base (subclass it to add an optimizer over a kernel policy), and
``StepScaling`` is what a gradient scaler hands to their ``step(scaling=...)``."""

from ._base import FusedOptimizer, StepScaling
from .adam import FusedAdam
from .adamw import FusedAdamW
from .lamb import FusedLAMB
from .lion import FusedLion
from .sgd import FusedSGD

__all__ = ["FusedOptimizer", "StepScaling", "FusedAdam", "FusedAdamW", "FusedSGD", "FusedLAMB", "FusedLion"]
