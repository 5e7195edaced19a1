"""FusedLAMB: LAMB (You et al. 2019) with the semantics of apex's FusedLAMB, as two fused passes per device
and param group."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Optional, Union

import torch

from .. import _dist, _ops
from .._layout import dense_grad, flat
from ._base import (FusedOptimizer, StepScaling, check_betas, check_common_kwargs, check_flags, check_lr, check_number,
                    copy_to, switch)


class FusedLAMB(FusedOptimizer):
    """Drop-in for apex's ``FusedLAMB``: Adam moments with bias correction, weight decay decoupled
    (``adam_w_mode=True``) or as L2 on the gradient, and per tensor the trust ratio ``||w|| / ||u||`` (1
    where either norm is 0) scaling the update ``u``; the ratio applies where ``weight_decay != 0`` or
    with ``use_nvlamb=True``, so a param group with ``weight_decay=0`` (biases, norms) takes plain
    Adam-like steps, as in apex. ``grad_averaging``: the gradient's weight in the first moment is
    ``1 - beta1`` (else 1). ``max_grad_norm`` > 0: the gradients are scaled by ``max_grad_norm / norm``
    where their global norm (over every param of the step) exceeds it.

    The step is two passes over each group (the ratio needs both norms of the whole tensor): the first
    updates the moments and sums ``w^2`` and ``u^2`` per tensor, the second updates the weights; nothing
    syncs the host between them. The global gradient norm comes from one multi-tensor reduction (or from
    mpfused.GradScaler's clip_grad_norm_, which already has it). With a GradScaler the unscale and the
    skip on inf/NaN are fused in as in FusedAdam; FP16/BF16 params get FP32 masters
    (``master_weights``). The norms are taken of the FP32 weight (the master when there is one).
    """

    _policy = "lamb"
    _elementwise = False  # the trust ratio reads whole-param norms
    _state_float_keys = ("exp_avg", "exp_avg_sq", "master_param")

    def __init__(self, params, lr=1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.01, amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True,
                 set_grad_none: bool = True, max_grad_norm=1.0, use_nvlamb: bool = False, *,
                 master_weights: Union[bool, str, None] = None, rounding: str = "nearest",
                 seed: Optional[int] = None) -> None:
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant (amsgrad=True).")
        check_common_kwargs(None, None, False, False)
        set_grad_none = switch("set_grad_none", set_grad_none)
        defaults = dict(lr=lr, bias_correction=switch("bias_correction", bias_correction), betas=betas, eps=eps,
                        weight_decay=weight_decay, adam_w_mode=switch("adam_w_mode", adam_w_mode),
                        grad_averaging=switch("grad_averaging", grad_averaging), max_grad_norm=max_grad_norm,
                        use_nvlamb=switch("use_nvlamb", use_nvlamb), master_weights=master_weights,
                        rounding=rounding, seed=seed)
        self._check_group(defaults, "")
        super().__init__(params, defaults)
        self.set_grad_none = set_grad_none

    def _check_group(self, group, where, in_step=False) -> None:
        check_lr(group["lr"], where, read_device=not in_step, read_cpu=not (in_step and group.get("capturable")))
        check_number("epsilon value", group["eps"], where=where)
        check_betas(group["betas"], where)
        check_number("weight_decay value", group["weight_decay"], where=where)
        check_number("max_grad_norm value", group["max_grad_norm"], where=where)
        check_flags(group, ("bias_correction", "grad_averaging", "adam_w_mode", "use_nvlamb"), where)

    _copied_attrs = FusedOptimizer._copied_attrs + ("set_grad_none",)  # (kept by deepcopy, pickle, torch.save)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("set_grad_none", True)  # (a copy made before it was kept: apex's default)

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """apex's: grads are set to None when ``set_grad_none`` (the default), else zeroed."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def _init_state(self, group, p, state) -> None:
        self._complete_state(group, p, state)

    def _complete_state(self, group, p, state) -> None:
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                state[key] = self._fp32_zeros(p)

    def _hyper(self, group, device) -> dict:
        beta1, beta2 = group["betas"]
        return dict(beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                    bias_correction=group["bias_correction"], grad_averaging=group["grad_averaging"],
                    decoupled=group["adam_w_mode"], max_grad_norm=group["max_grad_norm"],
                    use_nvlamb=group["use_nvlamb"])

    def _own_clip(self, work: list, scaling: StepScaling) -> Optional[tuple]:
        """The global norm max_grad_norm needs: the sum of squares of every unscaled gradient of the step, in
        one multi-tensor pass per device (found_inf is the scaler's business; the flag here is scratch)."""
        params = [p for _, ps, _ in work for p in ps]
        if not params or not any(g["max_grad_norm"] > 0 for g in self.param_groups):
            return None
        by_device: dict[torch.device, list] = defaultdict(list)
        for p in params:
            g = _dist.local(p.grad)  # a DTensor here is replicated (_check_kinds): its shard is the whole grad
            by_device[p.device].append(flat(g) if dense_grad(g) else g.contiguous())
        if len(by_device) > 1 and any(d.type == "meta" for d in by_device):
            raise ValueError("FusedLAMB's max_grad_norm clips by the global norm of every param's gradient, and "
                             "params on the meta device hold no values to add to the others' (devices: "
                             f"{sorted(map(str, by_device))}); step the meta params apart, or set max_grad_norm=0")
        for name in ("inv_scale", "grad_scale"):  # (as the step's own scalars are checked: this pass comes first)
            t = getattr(scaling, name)
            # (a meta scale holds no value for params that hold values; meta params take it as it is)
            if t is not None and ((t.is_meta and any(d.type != "meta" for d in by_device)) or t.layout != torch.strided):
                what = "is on the meta device, which holds no value" if t.is_meta else f"must be a dense tensor, got a {t.layout}"
                raise ValueError(f"StepScaling.{name} {what}: give a one-element float32 tensor on the params' device "
                                 "or the CPU")
        total = None
        for device, grads in by_device.items():
            inv = None
            if scaling.inv_scale is not None:
                inv = copy_to(scaling.inv_scale, device, torch.float32).reshape(1)
            elif scaling.grad_scale is not None:  # float(1 / S) from double, as the kernel computes it
                inv = (1.0 / copy_to(scaling.grad_scale, device, torch.float64)).to(torch.float32).reshape(1)
            sumsq = torch.empty(1, dtype=torch.float32, device=device)
            scratch = torch.empty(1, dtype=torch.float32, device=device)
            _ops.non_finite_check_(grads, scratch, inv, sumsq=sumsq, overwrite=True)
            total = sumsq if total is None else total + copy_to(sumsq, total.device)
        return total, math.inf
