"""FusedSGD: torch.optim.SGD as one fused kernel per device and param group."""

from __future__ import annotations

from typing import Optional, Union

import math

import torch

from ._base import (FusedOptimizer, check_common_kwargs, check_flags, check_lr, check_number, check_scalar_or_tensor,
                    device_hyper, switch)


class FusedSGD(FusedOptimizer):
    """Drop-in for ``torch.optim.SGD`` (momentum, dampening, Nesterov, weight decay, maximize), with the
    unscale, the inf-skip and FP32 master weights of FusedAdam. With momentum, ``state['step']`` (a device
    tensor) counts the steps taken: 0 means the momentum buffer has not been set yet, which a skipped first
    step must leave so without the host knowing."""

    _policy = "sgd"
    _state_float_keys = ("momentum_buffer", "master_param")

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize: bool = False, foreach: Optional[bool] = None, differentiable: bool = False,
                 fused: Optional[bool] = None, master_weights: Union[bool, str, None] = None,
                 rounding: str = "nearest", seed: Optional[int] = None) -> None:
        check_common_kwargs(foreach, fused, False, differentiable)
        if isinstance(weight_decay, torch.Tensor) and weight_decay.dim():
            weight_decay = weight_decay.squeeze()
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=switch("nesterov", nesterov), maximize=switch("maximize", maximize), foreach=foreach,
                        differentiable=differentiable, fused=fused, master_weights=master_weights,
                        rounding=rounding, seed=seed)
        self._check_group(defaults, "")
        # As torch.optim.SGD does, at construction only: a schedule may later take momentum to 0 (the step is then
        # plain SGD, Nesterov or not) or a group may set dampening, as torch's step allows.
        if defaults["nesterov"] and (defaults["momentum"] <= 0 or defaults["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, defaults)

    def _check_group(self, group, where, in_step=False) -> None:
        read_cpu = not (in_step and group.get("capturable"))
        check_lr(group["lr"], where, read_device=not in_step, read_cpu=read_cpu)
        check_number("momentum value", group["momentum"], where=where)
        check_number("dampening value", group["dampening"], -math.inf, where=where)
        check_scalar_or_tensor("weight_decay", group["weight_decay"], where=where, read_device=not in_step,
                               read_cpu=read_cpu)
        check_flags(group, ("nesterov", "maximize"), where)
        if in_step and group["momentum"] != 0 and group["dampening"] != 0 and group.get("rounding") == "stochastic":
            # Momentum turned on mid-run (or a buffer set to None) in a stochastic group: the step count goes on
            # (it is the write-back's random stream: _complete_state) and the buffer starts from zeros, whose
            # first momentum step is torch's (the grad itself) only without dampening.
            for i, p in enumerate(group["params"]):
                st = self.state.get(p)
                if p.grad is not None and st and "step" in st and st.get("momentum_buffer") is None:
                    raise ValueError(
                        f"param {i}{where} starts a momentum buffer after its first steps in a rounding='stochastic' "
                        f"group with dampening={group['dampening']}: torch's first buffer is the grad itself, which "
                        "this step gives only with dampening=0 (its step count, the stochastic rounding's random "
                        "stream, cannot start again); set dampening=0 for that step, or turn momentum on from the "
                        "first step")

    def state_dict(self) -> dict:
        """A momentum buffer that no step has written yet (``step`` 0: the first steps were skipped) is
        saved as None, which is how torch.optim.SGD reads "unset"; our zeros would be read as a buffer."""
        sd = super().state_dict()
        for k, st in list(sd["state"].items()):
            if st.get("momentum_buffer") is not None and "step" in st and float(st["step"]) == 0:
                st = dict(st)
                st["momentum_buffer"] = None
                sd["state"][k] = st
        return sd

    def _init_state(self, group, p, state) -> None:
        self._complete_state(group, p, state)

    def _complete_state(self, group, p, state) -> None:
        if group["momentum"] != 0:
            if "momentum_buffer" not in state or state["momentum_buffer"] is None:
                state["momentum_buffer"] = self._fp32_zeros(p)
                if group.get("rounding") != "stochastic" or "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                # else: momentum turned on (or a buffer set to None) in a stochastic group, whose step count is
                # its write-back's random stream: counting again from 0 would round with the bits of steps
                # already taken. The count goes on, and the buffer starts from zeros: the first momentum step
                # then takes (1 - dampening) * grad, which is torch's first buffer, the grad, when dampening is 0.
            elif "step" not in state:
                # A buffer loaded from torch.optim.SGD has been written: the next step is not the first.
                state["step"] = torch.ones((), dtype=torch.float32, device=p.device)

    def _hyper(self, group, device) -> dict:
        return dict(momentum=group["momentum"], dampening=group["dampening"],
                    weight_decay=device_hyper(group["weight_decay"], device), nesterov=group["nesterov"],
                    maximize=group["maximize"])
