"""Fused optimizers: drop-in replacements for torch.optim.Adam, AdamW and SGD that unscale, skip on
inf/NaN and update FP32 master weights in one pass per device and param group."""

from .adam import FusedAdam
from .adamw import FusedAdamW
from .sgd import FusedSGD

__all__ = ["FusedAdam", "FusedAdamW", "FusedSGD"]
