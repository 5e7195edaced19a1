"""FusedAdamW: torch.optim.AdamW (decoupled weight decay) as one fused kernel."""

from __future__ import annotations

from typing import Optional, Union

from .adam import FusedAdam


class FusedAdamW(FusedAdam):
    """Drop-in for ``torch.optim.AdamW``: FusedAdam with decoupled weight decay, default 1e-2."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 foreach: Optional[bool] = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None,
                 master_weights: Union[bool, str, None] = None, rounding: str = "nearest",
                 seed: Optional[int] = None) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         foreach=foreach, maximize=maximize, capturable=capturable, differentiable=differentiable,
                         fused=fused, master_weights=master_weights, decoupled_weight_decay=True,
                         rounding=rounding, seed=seed)
