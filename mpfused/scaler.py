"""mpfused.GradScaler: dynamic loss scaling that never stops the host, with fused clipping.

A drop-in for torch.amp.GradScaler. With the fused optimizers (mpfused.optim) an iteration is:
  1. one pass over the gradients that checks for inf/NaN (and, when clip_grad_norm_ was called, sums the
     squares of the unscaled gradients for the global norm): mpfused.non_finite_check_;
  2. the fused update, which reads found_inf, 1/scale and the clip coefficient on the device;
  3. update(): the scale update (csrc/core/loss_scale.h) in one tiny device launch.
No step of it syncs the host with the device.

With any other optimizer (torch.optim.SGD, Adam, ...) step() unscales the gradients with the same
multi-tensor kernel and must then read found_inf on the host to decide whether to call
optimizer.step(): one sync per iteration, as with torch's scaler.

With a process_group, found_inf is all-reduced with MAX and the sum of squares with SUM, so that every
rank skips or steps together and clips by the true global norm (sharded params, ZeRO, FSDP).
"""

from __future__ import annotations

import enum
import math
import warnings
from collections import defaultdict
from typing import Any, Optional

import torch

from . import _ops
from .optim._base import FusedOptimizer

__all__ = ["GradScaler"]


class _Stage(enum.Enum):
    READY = 0      # nothing done yet this iteration
    CHECKED = 1    # found_inf (and the sum of squares) known; gradients still scaled
    UNSCALED = 2   # gradients unscaled in place
    STEPPED = 3


def _fresh_state() -> dict:
    return {"stage": _Stage.READY, "found_inf": None, "sumsq": None, "norm": None, "max_norm": None}


def _check_int(name: str, value, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or value > 2**31 - 1:
        raise ValueError(f"{name} must be an integer in [{lo}, 2**31 - 1], got {value!r}")


def _check_float(name: str, value, lo: float, hi: float, lo_open: bool = True, hi_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        bounds = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"{name} must be a finite number in {bounds}, got {value!r}")


class GradScaler:
    """Drop-in for ``torch.amp.GradScaler`` with mpfused extensions.

    Extra arguments: ``hysteresis=k`` tolerates k-1 consecutive overflows before backing off (DeepSpeed's
    behaviour); ``min_scale``/``max_scale`` clamp the scale (it never becomes 0 or inf); ``dynamic=False``
    keeps the scale at ``init_scale`` (static loss scaling); ``process_group`` keeps every rank of a
    distributed job in step.
    """

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True, *,
                 hysteresis: int = 1, min_scale: float = 1.0, max_scale: float = 2.0**24, dynamic: bool = True,
                 process_group=None) -> None:
        self._device = torch.device(device)
        if enabled and self._device.type == "cuda" and not torch.cuda.is_available():
            warnings.warn("mpfused.GradScaler is enabled, but CUDA is not available. Disabling.")
            enabled = False
        _check_float("init_scale", init_scale, 0.0, 3.4e38)
        _check_float("growth_factor", growth_factor, 1.0, math.inf, hi_open=True)
        _check_float("backoff_factor", backoff_factor, 0.0, 1.0, hi_open=True)
        _check_int("growth_interval", growth_interval, 1)
        _check_int("hysteresis", hysteresis, 1)
        _check_float("min_scale", min_scale, 0.0, 3.4e38)
        _check_float("max_scale", max_scale, 0.0, 3.4e38)
        if min_scale > max_scale:
            raise ValueError(f"min_scale ({min_scale}) must not exceed max_scale ({max_scale})")
        if dynamic and not min_scale <= init_scale <= max_scale:
            raise ValueError(f"init_scale ({init_scale}) must lie in [min_scale, max_scale] = [{min_scale}, {max_scale}]")
        self._enabled = bool(enabled)
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._hysteresis = int(hysteresis)
        self._min_scale = float(min_scale)
        self._max_scale = float(max_scale)
        self._dynamic = bool(dynamic)
        self._process_group = process_group
        self._scale: Optional[torch.Tensor] = None
        self._inv_scale: Optional[torch.Tensor] = None
        self._growth_tracker: Optional[torch.Tensor] = None
        self._hysteresis_left: Optional[torch.Tensor] = None
        self._counter: Optional[torch.Tensor] = None
        self._last_found_inf: Optional[torch.Tensor] = None
        self._per_optimizer: defaultdict = defaultdict(_fresh_state)

    # ---- device state ---------------------------------------------------------------------------------
    def _lazy_init(self) -> None:
        if self._scale is not None:
            return
        if self._device.type == "cuda" and self._device.index is None:
            # "cuda" means the current device; compare grads against cuda:N, not against "cuda"
            self._device = torch.device("cuda", torch.cuda.current_device())
        d = self._device
        self._scale = torch.full((1,), self._init_scale, dtype=torch.float32, device=d)
        self._inv_scale = self._scale.double().reciprocal().float()
        self._growth_tracker = torch.zeros(1, dtype=torch.int32, device=d)
        self._hysteresis_left = torch.full((1,), self._hysteresis, dtype=torch.int32, device=d)
        # A zeroed counter the overflow kernel borrows for its last-block reduction and leaves zeroed:
        # it saves the memset of a fresh one in every iteration.
        self._counter = torch.zeros(1, dtype=torch.int32, device=d)

    # ---- scale ----------------------------------------------------------------------------------------
    def scale(self, outputs):
        """Multiplies a tensor, or the tensors of nested lists/tuples, by the scale (on the device)."""
        if not self._enabled:
            return outputs
        self._lazy_init()

        def apply(x):
            if isinstance(x, torch.Tensor):
                return x * self._scale.to(device=x.device, non_blocking=True)
            if isinstance(x, (list, tuple)):
                mapped = [apply(v) for v in x]
                return type(x)(mapped) if not hasattr(x, "_fields") else type(x)(*mapped)
            raise ValueError(f"outputs must be a tensor or (nested) lists/tuples of tensors, got {type(x).__name__}")

        return apply(outputs)

    # ---- the gradient pass ------------------------------------------------------------------------------
    @staticmethod
    def _grads_by_device(optimizer) -> dict[torch.device, list]:
        by_device: dict[torch.device, list] = defaultdict(list)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    by_device[p.grad.device].append(p.grad)
        return by_device

    def _grad_pass(self, optimizer, *, unscale: bool, sumsq: bool, scaled: bool = True) -> None:
        """One multi-tensor pass per device: found_inf, optionally the sum of squares of the unscaled
        gradients, optionally the unscale in place; then the cross-rank reductions."""
        state = self._per_optimizer[id(optimizer)]
        by_device = self._grads_by_device(optimizer)
        norm = None
        if set(by_device) <= {self._device}:
            # The common case, all grads on the scaler's device: one launch writes found_inf, the sum of
            # squares and the norm from scratch (fresh tensors need no zero fill, the counter no memset).
            found = torch.empty(1, dtype=torch.float32, device=self._device)
            total = torch.empty(1, dtype=torch.float32, device=self._device) if sumsq else None
            norm = torch.empty(1, dtype=torch.float32, device=self._device) if sumsq else None
            inv = self._inv_scale if scaled and self._enabled else None
            _ops.non_finite_check_(by_device.get(self._device, []), found, inv, unscale=unscale and inv is not None,
                                   sumsq=total, overwrite=True, norm=norm,
                                   counter=self._counter)
        else:
            found = torch.zeros(1, dtype=torch.float32, device=self._device)
            total = torch.zeros(1, dtype=torch.float32, device=self._device) if sumsq else None
            for device, grads in by_device.items():
                home = device == self._device
                f = found if home else torch.zeros(1, dtype=torch.float32, device=device)
                s = total if (home or total is None) else torch.zeros(1, dtype=torch.float32, device=device)
                inv = None
                if scaled and self._enabled:
                    inv = self._inv_scale if home else self._inv_scale.to(device, non_blocking=True)
                _ops.non_finite_check_(grads, f, inv, unscale=unscale and inv is not None, sumsq=s)
                if not home:
                    found.add_(f.to(self._device, non_blocking=True))
                    if total is not None:
                        total.add_(s.to(self._device, non_blocking=True))
        if self._process_group is not None:
            import torch.distributed as dist

            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self._process_group)
            if total is not None:
                dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self._process_group)
            norm = None  # the global norm is that of the reduced sum
        state["found_inf"] = found
        if sumsq:
            state["sumsq"] = total
            state["norm"] = norm if norm is not None else total.sqrt()

    def unscale_(self, optimizer) -> None:
        """Unscales the optimizer's gradients in place (one pass per device, FP32/FP16/BF16) and records
        found_inf. Call it before inspecting or modifying the gradients; at most once per iteration."""
        if not self._enabled:
            return
        self._lazy_init()
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] is _Stage.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        self._grad_pass(optimizer, unscale=True, sumsq=False)
        state["stage"] = _Stage.UNSCALED
        state["max_norm"] = None  # a clip recorded before is applied by whoever clips the unscaled grads

    def clip_grad_norm_(self, optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the optimizer's gradients to a global norm of ``max_norm`` and returns the unscaled
        global norm as a device tensor (no sync).

        With a fused optimizer and the 2-norm, the norm comes from the overflow pass itself and the clip
        coefficient is applied inside the fused update: no extra pass over the gradients. Otherwise the
        gradients are unscaled and clipped in place (torch.nn.utils.clip_grad_norm_, or for the 2-norm
        with a process_group, a global-norm clip).
        """
        _check_float("max_norm", max_norm, 0.0, math.inf, hi_open=True)
        norm_type = float(norm_type)
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("clip_grad_norm_() is being called after step().")
        if not self._enabled and self._process_group is None:
            params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        if self._enabled:
            self._lazy_init()
        fused = isinstance(optimizer, FusedOptimizer)
        if fused and norm_type == 2.0 and state["stage"] is not _Stage.UNSCALED:
            self._grad_pass(optimizer, unscale=False, sumsq=True, scaled=self._enabled)
            state["stage"] = _Stage.CHECKED
            state["max_norm"] = float(max_norm)
            return state["norm"]
        if self._enabled and state["stage"] in (_Stage.READY, _Stage.CHECKED):
            state["stage"] = _Stage.READY
            self.unscale_(optimizer)
        if self._process_group is None:
            params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        if norm_type != 2.0:
            raise ValueError(f"with a process_group only norm_type=2.0 is supported, got {norm_type}")
        # Global 2-norm of the (now unscaled) gradients across ranks, then scale them in place.
        found_before = state["found_inf"]
        self._grad_pass(optimizer, unscale=False, sumsq=True, scaled=False)
        if found_before is not None:
            state["found_inf"] = torch.maximum(state["found_inf"], found_before)
        norm = state["sumsq"].sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for device, grads in self._grads_by_device(optimizer).items():
            torch._foreach_mul_(grads, coef.to(device, non_blocking=True))
        return norm

    # ---- step and update ----------------------------------------------------------------------------------
    def step(self, optimizer, *args: Any, **kwargs: Any):
        """Steps the optimizer unless the gradients held an inf/NaN. Fused optimizers decide on the
        device (no sync); other optimizers need found_inf on the host (one sync)."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._lazy_init()
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if isinstance(optimizer, FusedOptimizer):
            if state["stage"] is _Stage.READY:
                self._grad_pass(optimizer, unscale=False, sumsq=False)
            optimizer.found_inf = state["found_inf"]
            if state["stage"] is not _Stage.UNSCALED:
                optimizer._mpf_inv_scale = self._inv_scale
            if state["max_norm"] is not None:
                optimizer._mpf_clip = (state["sumsq"], state["max_norm"])
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                for attr in ("found_inf", "_mpf_inv_scale", "_mpf_clip"):
                    if hasattr(optimizer, attr):
                        delattr(optimizer, attr)
        else:
            if state["stage"] is _Stage.READY:
                self.unscale_(optimizer)
            retval = None
            if not state["found_inf"].item():  # the one host sync of a non-fused optimizer
                retval = optimizer.step(*args, **kwargs)
        state["stage"] = _Stage.STEPPED
        return retval

    def update(self, new_scale=None) -> None:
        """Updates the scale from this iteration's found_inf (on the device), or sets it to new_scale."""
        if not self._enabled:
            return
        self._lazy_init()
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                if new_scale.numel() != 1 or not new_scale.is_floating_point():
                    raise ValueError("new_scale must be a float or a one-element floating-point tensor")
                self._scale.copy_(new_scale.reshape(1))
            else:
                _check_float("new_scale", new_scale, 0.0, 3.4e38)
                self._scale.fill_(float(new_scale))
            self._inv_scale.copy_(self._scale.double().reciprocal())
        else:
            found = [s["found_inf"] for s in self._per_optimizer.values() if s["found_inf"] is not None]
            if not found:
                raise AssertionError("No inf checks were recorded prior to update.")
            total = found[0]
            for f in found[1:]:
                total = total + f
            _ops.loss_scale_update_(self._scale, self._growth_tracker, self._hysteresis_left, total, self._inv_scale,
                                    growth_factor=self._growth_factor, backoff_factor=self._backoff_factor,
                                    growth_interval=self._growth_interval, hysteresis=self._hysteresis,
                                    min_scale=self._min_scale, max_scale=self._max_scale, dynamic=self._dynamic)
            self._last_found_inf = total
        self._per_optimizer = defaultdict(_fresh_state)

    # ---- queries ------------------------------------------------------------------------------------------
    def found_inf(self) -> Optional[torch.Tensor]:
        """This iteration's found_inf (summed over optimizers) as a device tensor, or after update() the
        last iteration's; != 0 means the step was skipped. No sync."""
        current = [s["found_inf"] for s in self._per_optimizer.values() if s["found_inf"] is not None]
        if current:
            total = current[0]
            for f in current[1:]:
                total = total + f
            return total
        return self._last_found_inf

    def get_scale(self) -> float:
        """The current scale as a Python float (a host sync, as in torch), 1.0 when disabled."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def is_enabled(self) -> bool:
        return self._enabled

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        _check_float("growth_factor", new_factor, 1.0, math.inf, hi_open=True)
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        _check_float("backoff_factor", new_factor, 0.0, 1.0, hi_open=True)
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        _check_int("growth_interval", new_interval, 1)
        self._growth_interval = int(new_interval)

    def get_hysteresis(self) -> int:
        return self._hysteresis

    def _get_growth_tracker(self) -> int:
        if self._growth_tracker is None:
            return 0
        return int(self._growth_tracker.item())

    # ---- state dict -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch.amp.GradScaler's keys (scale, growth_factor, backoff_factor, growth_interval,
        _growth_tracker) plus mpfused's (hysteresis, _hysteresis_left, min_scale, max_scale, dynamic)."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
            "hysteresis": self._hysteresis,
            "_hysteresis_left": self._hysteresis if self._hysteresis_left is None else int(self._hysteresis_left.item()),
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            "dynamic": self._dynamic,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads ours or torch.amp.GradScaler's state dict (mpfused's extra keys keep their values)."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler.")
        self._init_scale = float(state_dict["scale"])
        self.set_growth_factor(state_dict["growth_factor"])
        self.set_backoff_factor(state_dict["backoff_factor"])
        self.set_growth_interval(state_dict["growth_interval"])
        self._hysteresis = int(state_dict.get("hysteresis", self._hysteresis))
        self._min_scale = float(state_dict.get("min_scale", self._min_scale))
        self._max_scale = float(state_dict.get("max_scale", self._max_scale))
        self._dynamic = bool(state_dict.get("dynamic", self._dynamic))
        self._lazy_init()
        self._scale.fill_(self._init_scale)
        self._inv_scale.fill_(1.0 / self._init_scale)
        self._growth_tracker.fill_(int(state_dict["_growth_tracker"]))
        self._hysteresis_left.fill_(int(state_dict.get("_hysteresis_left", self._hysteresis)))
