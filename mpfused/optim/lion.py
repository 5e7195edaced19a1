"""FusedLion: Lion (Chen et al. 2023) as one fused kernel per device and param group."""

from __future__ import annotations

from typing import Optional, Union

from ._base import FusedOptimizer, check_betas, check_common_kwargs, check_flags, check_lr, check_number, switch


class FusedLion(FusedOptimizer):
    """Lion, "EvoLved Sign Momentum" (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"):

        c = beta1 * m + (1 - beta1) * g;   p = p * (1 - lr * weight_decay) - lr * sign(c);
        m = beta2 * m + (1 - beta2) * g

    One FP32 state tensor per param (``exp_avg``): 4 bytes of optimizer state per param against Adam's 8.
    The update has the same size for every element, so Lion wants a smaller lr than AdamW (3-10x) and a
    larger weight decay. With a GradScaler the unscale and the skip on inf/NaN are fused in as in
    FusedAdam; FP16/BF16 params get FP32 masters (``master_weights``).
    """

    _policy = "lion"
    _state_float_keys = ("exp_avg", "master_param")

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize: bool = False,
                 foreach: Optional[bool] = None, fused: Optional[bool] = None,
                 master_weights: Union[bool, str, None] = None, rounding: str = "nearest",
                 seed: Optional[int] = None) -> None:
        check_common_kwargs(foreach, fused, False, False)
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=switch("maximize", maximize), foreach=foreach,
                        fused=fused, master_weights=master_weights,
                        rounding=rounding, seed=seed)
        self._check_group(defaults, "")
        super().__init__(params, defaults)

    def _check_group(self, group, where, in_step=False) -> None:
        check_lr(group["lr"], where, read_device=not in_step, read_cpu=not (in_step and group.get("capturable")))
        check_betas(group["betas"], where, hi_open=False)
        check_number("weight_decay value", group["weight_decay"], where=where)
        check_flags(group, ("maximize",), where)

    def _init_state(self, group, p, state) -> None:
        self._complete_state(group, p, state)

    def _complete_state(self, group, p, state) -> None:
        if "exp_avg" not in state:
            state["exp_avg"] = self._fp32_zeros(p)

    def _hyper(self, group, device) -> dict:
        beta1, beta2 = group["betas"]
        return dict(beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], maximize=group["maximize"])
