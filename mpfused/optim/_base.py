"""The shared base of the fused optimizers: param bucketing by device and dtype, lazy state with FP32
master weights, torch.amp.GradScaler integration, and a state-dict loader that keeps FP32 state FP32."""

from __future__ import annotations

import math
from collections import defaultdict
from copy import deepcopy
from itertools import chain
from typing import Any, Callable, Optional

import torch
from torch.optim import Optimizer

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_lr(lr) -> None:
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or not lr.is_floating_point():
            raise ValueError(f"Invalid learning rate: a tensor lr must be one floating-point element, got {tuple(lr.shape)} {lr.dtype}")
        return
    check_number("learning rate", lr, 0.0)


def check_number(name: str, value, lo: float, hi: float = math.inf, hi_open: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"Invalid {name}: expected a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < lo or value > hi or (hi_open and value == hi):
        bound = f"[{lo}, {hi})" if hi_open else f"[{lo}, {hi}]"
        raise ValueError(f"Invalid {name}: {value} (expected a finite value in {bound})")


class FusedOptimizer(Optimizer):
    """Base of FusedAdam, FusedAdamW and FusedSGD. Subclasses define ``_init_state`` and ``_fused_step``.

    ``master_weights``: None keeps an FP32 master copy for FP16/BF16 params (never for FP32 ones), True the
    same, False updates low-precision params directly (the math is still FP32).
    """

    # torch.amp.GradScaler then hands the scale and found_inf to step() instead of unscaling the grads.
    _step_supports_amp_scaling = True
    _state_float_keys: tuple[str, ...] = ()

    def __init__(self, params, defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)

    # ---- state --------------------------------------------------------------------------------------
    def _wants_master(self, group: dict, p: torch.Tensor) -> bool:
        return p.dtype != torch.float32 and group.get("master_weights") is not False

    def _fp32_zeros(self, p: torch.Tensor) -> torch.Tensor:
        return torch.zeros(p.shape, dtype=torch.float32, device=p.device)

    def _state_for(self, group: dict, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            self._init_state(group, p, state)
        if self._wants_master(group, p) and "master_param" not in state:
            state["master_param"] = p.detach().to(torch.float32, copy=True).contiguous()
        if not self._wants_master(group, p):
            state.pop("master_param", None)
        self._complete_state(group, p, state)
        return state

    def _init_state(self, group: dict, p: torch.Tensor, state: dict) -> None:
        raise NotImplementedError

    def _complete_state(self, group: dict, p: torch.Tensor, state: dict) -> None:
        """State that a loaded dict or changed hyperparameters may lack."""

    # ---- validation (before anything is written) ----------------------------------------------------
    @staticmethod
    def _check_param(i: int, p: torch.Tensor) -> None:
        where = f"param {i} of its group"
        if p.is_complex() or not p.is_floating_point():
            raise ValueError(f"{where}: the fused optimizers update float32/float16/bfloat16 params, got {p.dtype}")
        if p.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{where}: dtype {p.dtype} is not supported (expected float32, float16 or bfloat16)")
        if p.is_sparse:
            raise ValueError(f"{where}: sparse params are not supported")
        if not p.is_contiguous():
            raise ValueError(f"{where}: params must be contiguous (got strides {p.stride()} for shape {tuple(p.shape)})")
        g = p.grad
        if g.is_sparse:
            raise ValueError(f"{where}: sparse gradients are not supported by the fused optimizers")
        if g.shape != p.shape:
            raise ValueError(f"{where}: grad shape {tuple(g.shape)} differs from param shape {tuple(p.shape)}")
        if g.device != p.device:
            raise ValueError(f"{where}: grad is on {g.device} but the param is on {p.device}")
        if g.dtype != p.dtype:
            raise ValueError(f"{where}: grad dtype {g.dtype} differs from param dtype {p.dtype}")

    # ---- step ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Set by torch.amp.GradScaler (the scale itself, and the summed found_inf), or by mpfused's.
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        # Set by mpfused.GradScaler: 1/scale, and for clipping the sum of squares of the unscaled grads
        # (on the device) with max_norm; the kernel folds the clip coefficient into the update.
        inv_scale = getattr(self, "_mpf_inv_scale", None)
        clip = getattr(self, "_mpf_clip", None)

        work = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for i, p in enumerate(params):
                self._check_param(i, p)
            check_lr(group["lr"])
            work.append((group, params))

        per_device: dict[torch.device, tuple] = {}

        def device_scalars(device: torch.device):
            if device not in per_device:
                # torch's scaler hands over the scale S itself; the kernel computes 1/S on the device.
                unscale = {}
                if inv_scale is not None:
                    unscale["inv_scale"] = inv_scale.to(device, non_blocking=True)
                elif grad_scale is not None:
                    unscale["grad_scale"] = grad_scale.to(device, dtype=torch.float32, non_blocking=True).reshape(1)
                per_device[device] = (
                    unscale,
                    (clip[0].to(device, non_blocking=True), clip[1]) if clip is not None else None,
                    found_inf.to(device, dtype=torch.float32, non_blocking=True).reshape(1) if found_inf is not None else None,
                )
            return per_device[device]

        for group, params in work:
            buckets: dict[torch.device, list] = defaultdict(list)
            for p in params:
                buckets[p.device].append(p)
            for device, ps in buckets.items():
                states = [self._state_for(group, p) for p in ps]
                grads = [p.grad if p.grad.is_contiguous() else p.grad.contiguous() for p in ps]
                inv, clip, found = device_scalars(device)
                lr = group["lr"]
                if isinstance(lr, torch.Tensor):
                    lr = lr.to(device=device, dtype=torch.float32, non_blocking=True).reshape(1)
                self._fused_step(group, ps, grads, states, lr, inv, clip, found, self._counter(device))
        return loss

    def _counter(self, device: torch.device) -> torch.Tensor:
        """A zeroed int32 the update kernel borrows and leaves zeroed, one per device: with it the last
        block of the update increments the step counters, so a step is one launch per group."""
        counters = self.__dict__.setdefault("_mpf_counters", {})
        if device not in counters:
            counters[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return counters[device]

    def _fused_step(self, group, params, grads, states, lr, unscale, clip, found_inf, counter) -> None:
        """unscale: {} or {"inv_scale": t} or {"grad_scale": t}; clip: None or (sum of squares, max_norm);
        counter: see _counter()."""
        raise NotImplementedError

    # ---- state dict ---------------------------------------------------------------------------------
    def _load_value(self, param: torch.Tensor, key, value):
        if key == "step":
            return torch.as_tensor(value, dtype=torch.float32).to(param.device).reshape(())
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            # FP32 state stays FP32 (torch's loader would cast it to an FP16 param's dtype).
            return value.to(device=param.device, dtype=torch.float32).contiguous()
        return value

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads our own state dicts and torch.optim's (Adam, AdamW, SGD): FP32 state stays FP32, a missing
        master copy is taken from the current params, a missing SGD step count is inferred."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        groups = self.param_groups
        saved_groups = deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for g, sg in zip(groups, saved_groups):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't match the size of optimizer's group")
        id_map = dict(zip(chain.from_iterable(sg["params"] for sg in saved_groups),
                          chain.from_iterable(g["params"] for g in groups)))
        state: defaultdict = defaultdict(dict)
        for k, v in state_dict["state"].items():
            if k in id_map:
                param = id_map[k]
                state[param] = {key: self._load_value(param, key, value) for key, value in v.items()}
            else:
                state[k] = v
        new_groups = []
        for g, sg in zip(groups, saved_groups):
            ng = dict(sg)
            ng["params"] = g["params"]
            for key, value in self.defaults.items():
                ng.setdefault(key, value)
            new_groups.append(ng)
        self.__setstate__({"state": state, "param_groups": new_groups})
        for group in self.param_groups:
            for p in group["params"]:
                if self.state.get(p):
                    self._after_load(group, p, self.state[p])
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _after_load(self, group: dict, p: torch.Tensor, state: dict) -> None:
        self._state_for(group, p)
