"""FusedAdam: torch.optim.Adam's algorithm as one fused kernel per device and param group."""

from __future__ import annotations

from typing import Optional, Union

import torch

from ._base import (FusedOptimizer, check_betas, check_common_kwargs, check_flags, check_lr, check_number,
                    device_hyper, switch)


class FusedAdam(FusedOptimizer):
    """Drop-in for ``torch.optim.Adam`` (and, with ``decoupled_weight_decay=True``, ``AdamW``).

    Per element, in one pass: the gradient is unscaled (when a GradScaler hands over its scale), the step
    is skipped on the device when found_inf != 0, the FP32 weight and moments are updated, and the param
    is written in its own dtype. FP16/BF16 params get an FP32 master copy in ``state['master_param']``
    (``master_weights=None``/True) so that small updates are not lost to rounding; ``master_weights=
    "remainder"`` (BF16) keeps that master in the param plus an int16 remainder, and ``rounding=
    "stochastic"`` writes 16-bit params with unbiased stochastic rounding (see FusedOptimizer). ``lr`` may
    be a float or a one-element tensor (then no part of step() needs the host; capturable in a CUDA graph).
    """

    _policy = "adam"
    _state_float_keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")
    _class_keys = ("decoupled_weight_decay",)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 foreach: Optional[bool] = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None,
                 master_weights: Union[bool, str, None] = None, decoupled_weight_decay: bool = False,
                 rounding: str = "nearest", seed: Optional[int] = None) -> None:
        check_common_kwargs(foreach, fused, capturable, differentiable)
        if isinstance(betas, (tuple, list)) and len(betas) == 2:
            betas = tuple(b.squeeze() if isinstance(b, torch.Tensor) and b.dim() else b for b in betas)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=switch("amsgrad", amsgrad),
                        maximize=switch("maximize", maximize), foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=switch("decoupled_weight_decay", decoupled_weight_decay),
                        master_weights=master_weights, rounding=rounding, seed=seed)
        self._check_group(defaults, "")
        super().__init__(params, defaults)

    def state_dict(self) -> dict:
        """FusedOptimizer's, where an entry without a step count (a param that has not stepped yet, a frozen one
        or any before the first step, holds only its master or remainder) gets ``step`` 0, a float32 CPU tensor
        as torch's own: torch.optim.Adam(W).load_state_dict reads the step of every entry that is not empty,
        and amp's resume into the fresh FP32 model and optimizer loads a checkpoint there. A fused load treats
        the entry as a fresh one (the first step counts from 0 and starts the moments at zero). The live state
        is left as it is."""
        sd = super().state_dict()
        for k, st in sd["state"].items():
            if isinstance(st, dict) and st and "step" not in st:
                sd["state"][k] = {**st, "step": torch.zeros((), dtype=torch.float32)}  # (st is the live state)
        return sd

    def _check_group(self, group, where, in_step=False) -> None:
        read_cpu = not (in_step and group.get("capturable"))
        check_lr(group["lr"], where, read_device=not in_step, read_cpu=read_cpu)
        check_number("epsilon value", group["eps"], where=where)
        check_betas(group["betas"], where, tensors=True, read_device=not in_step, read_cpu=read_cpu,
                    pair_rule=not in_step)
        check_number("weight_decay value", group["weight_decay"], where=where)
        check_flags(group, ("amsgrad", "maximize", "decoupled_weight_decay"), where)

    def _init_state(self, group, p, state) -> None:
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = self._fp32_zeros(p)
        state["exp_avg_sq"] = self._fp32_zeros(p)

    def _complete_state(self, group, p, state) -> None:
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                state[key] = self._fp32_zeros(p)
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = self._fp32_zeros(p)

    def _hyper(self, group, device) -> dict:
        beta1, beta2 = (device_hyper(b, device) for b in group["betas"])
        return dict(beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                    amsgrad=group["amsgrad"], maximize=group["maximize"], decoupled=group["decoupled_weight_decay"])
