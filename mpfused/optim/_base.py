"""The shared base of the fused optimizers: param bucketing by device and dtype, lazy state with FP32
master weights, torch.amp.GradScaler integration, and a state-dict loader that keeps FP32 state FP32."""

from __future__ import annotations

import math
import warnings
import numbers
from collections import defaultdict
from copy import deepcopy
from itertools import chain
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.optim import Optimizer

from .._layout import is_dense, like, same_layout

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _is_real(value) -> bool:
    # Python and numpy scalars (np.float32, np.float64, np.int64, ...), not bools.
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def check_lr(lr, where: str = "") -> None:
    """torch's checks and texts: a tensor lr must have one element; a number must be >= 0."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element" + where)
        if not lr.is_floating_point():
            raise ValueError(f"Invalid learning rate: a tensor lr must be floating point, got {lr.dtype}{where}")
        return
    check_number("learning rate", lr, where=where)


def check_number(name: str, value, lo: float = 0.0, hi: float = math.inf, hi_open: bool = False,
                 where: str = "") -> None:
    """torch's ``Invalid <name>: <value>`` for a number outside [lo, hi] (or [lo, hi)), NaN included, and
    (stricter than torch, which would step into NaN weights) for an infinite one."""
    if not _is_real(value):
        raise ValueError(f"Invalid {name}: {value!r} (expected a number, got {type(value).__name__}){where}")
    v = float(value)
    if not math.isfinite(v) or not (lo <= v <= hi) or (hi_open and v == hi):
        raise ValueError(f"Invalid {name}: {value}{where}")


def check_scalar_or_tensor(name: str, value, lo: float = 0.0, hi: float = math.inf, hi_open: bool = False,
                           where: str = "", read_device: bool = True) -> None:
    """A hyperparameter that may also be a one-element tensor (betas, SGD's weight_decay), on the CPU or on
    the params' device (the update reads it there: no host sync in step()). A CPU tensor's value is checked
    every time; a device tensor's only when ``read_device`` (at construction and in add_param_group, where
    torch reads it too), never in step()."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element{where}")
        if value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"Invalid {name}: a tensor {name} must be real, got {value.dtype}{where}")
        if value.device.type not in ("cpu", "cuda"):
            raise ValueError(f"Invalid {name}: a tensor {name} must be on the CPU or on the params' CUDA device, "
                             f"got one on {value.device}{where}")
        if value.device.type != "cpu" and not read_device:
            return
        value = value.item()
    check_number(f"{name} value" if not name.startswith("beta") else name, value, lo, hi, hi_open, where)


def copy_to(t: torch.Tensor, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """t on ``device`` (and in ``dtype``): asynchronous towards an accelerator (no host sync), a finished
    copy towards the CPU (a non-blocking device-to-host copy may not have landed when the CPU kernels or
    the host read it)."""
    return t.to(device=device, dtype=dtype, non_blocking=torch.device(device).type != "cpu")


def device_hyper(value, device: torch.device):
    """A checked hyperparameter as the kernels take it on ``device``: a Python float, or a one-element
    float32/float64 tensor on ``device`` that the update reads itself. A CPU tensor for a CUDA step is read
    on the host (no sync); a tensor on another accelerator is copied, asynchronously, to ``device``; a CPU
    step reads a device tensor on the host (that step syncs: CPU params with CUDA hyperparameters are an
    odd mix)."""
    if not isinstance(value, torch.Tensor):
        return float(value)
    if value.device != device:
        if value.device.type == "cpu" or device.type == "cpu":
            return float(value.item())  # a CPU value, or a CPU step that must read the device's anyway
        value = copy_to(value, device)
    if value.dtype not in (torch.float32, torch.float64):
        value = value.to(torch.float64)
    return value


def check_common_kwargs(foreach, fused, capturable, differentiable) -> None:
    """torch's implementation-choice kwargs: we are always one fused, sync-free kernel, so foreach/fused/
    capturable are accepted (the result is the same); differentiable needs autograd through step()."""
    for name, value in (("foreach", foreach), ("fused", fused)):
        if value not in (None, True, False):
            raise ValueError(f"Invalid {name}: expected None, True or False, got {value!r}")
    if capturable not in (True, False):
        raise ValueError(f"Invalid capturable: expected True or False, got {capturable!r}")
    if differentiable not in (True, False):
        raise ValueError(f"Invalid differentiable: expected True or False, got {differentiable!r}")
    if differentiable:
        raise NotImplementedError("differentiable=True is not supported by the fused optimizers: their step() is "
                                  "an in-place kernel that autograd cannot differentiate through")
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def is_plain_tensor(t: torch.Tensor) -> bool:
    return type(t) in _PLAIN_TYPES


class FusedOptimizer(Optimizer):
    """Base of FusedAdam, FusedAdamW and FusedSGD. Subclasses define ``_init_state`` and ``_fused_step``.

    ``master_weights``: None keeps an FP32 master copy for FP16/BF16 params (never for FP32 ones), True the
    same, False updates low-precision params directly (the math is still FP32).
    """

    # torch.amp.GradScaler then hands the scale and found_inf to step() instead of unscaling the grads.
    _step_supports_amp_scaling = True
    _state_float_keys: tuple[str, ...] = ()
    # Group keys that define the algorithm: kept from this optimizer when a state dict is loaded.
    _class_keys: tuple[str, ...] = ()

    def __init__(self, params, defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group, then our checks of the new group: its hyperparameters, and no param
        listed twice (torch only warns for that; one fused pass cannot update one tensor twice, so we raise)."""
        index = len(self.param_groups)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="optimizer contains a parameter group with duplicate")
            super().add_param_group(param_group)
        group = self.param_groups[index]
        try:
            seen: dict[int, int] = {}
            for i, p in enumerate(group["params"]):
                if id(p) in seen:
                    raise ValueError(
                        f"optimizer contains a parameter group with duplicate parameters: param {i} of param group "
                        f"{index} is param {seen[id(p)]} again (a fused step updates each tensor once)")
                seen[id(p)] = i
            self._check_group(group, f" (param group {index})")
        except Exception:
            self.param_groups.pop(index)
            raise

    def _check_group(self, group: dict, where: str, in_step: bool = False) -> None:
        """Raises for an invalid hyperparameter of ``group``; ``where`` ends the message. ``in_step``: the
        values of tensor hyperparameters on a device are not read (that would sync the host)."""
        raise NotImplementedError

    # ---- state --------------------------------------------------------------------------------------
    def _wants_master(self, group: dict, p: torch.Tensor) -> bool:
        return p.dtype != torch.float32 and group.get("master_weights") is not False

    def _fp32_zeros(self, p: torch.Tensor) -> torch.Tensor:
        """FP32 zeros with p's memory layout (contiguous, channels_last, ...): the kernels read a param and
        its state as flat arrays of the same element order."""
        return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)

    def _state_for(self, group: dict, p: torch.Tensor) -> dict:
        state = self.state.get(p)
        if state is None:
            state = {}
        if not state:
            self._init_state(group, p, state)
        if self._wants_master(group, p):
            if "master_param" not in state:
                state["master_param"] = like(p.detach(), p, torch.float32)
        elif "master_param" in state:
            del state["master_param"]
        self._complete_state(group, p, state)
        stride = p.stride()
        for key in self._state_float_keys:
            # A param whose layout changed since its state was made (model.to(memory_format=...)) gets its
            # state in the new layout, once. (State is made with the param's exact strides, so equal strides
            # is the common case; same_layout also accepts other strides on size-1 dims.)
            t = state.get(key)
            if t is not None and t.stride() != stride and t.shape == p.shape and not same_layout(t, p):
                state[key] = like(t, p, torch.float32)
        if state:  # no empty entries (SGD without momentum keeps no state, like torch)
            self.state[p] = state
        return state

    def _init_state(self, group: dict, p: torch.Tensor, state: dict) -> None:
        raise NotImplementedError

    def _complete_state(self, group: dict, p: torch.Tensor, state: dict) -> None:
        """State that a loaded dict or changed hyperparameters may lack."""

    # ---- validation (before anything is written) ----------------------------------------------------
    @staticmethod
    def _param_ok(p: torch.Tensor) -> bool:
        """Everything _check_param asks, in one expression for the common case (step()'s host time per
        param matters for models with many small tensors); False sends the param to _check_param."""
        g = p.grad
        return (type(p) in _PLAIN_TYPES and type(g) in _PLAIN_TYPES and p.dtype in SUPPORTED_DTYPES
                and g.dtype == p.dtype and p.layout == torch.strided and g.layout == torch.strided
                and g.shape == p.shape and g.device == p.device and (p.is_contiguous() or is_dense(p)))

    @staticmethod
    def _check_param(where: str, p: torch.Tensor) -> None:
        if not is_plain_tensor(p) or not is_plain_tensor(p.grad):
            bad = p if not is_plain_tensor(p) else p.grad
            raise TypeError(f"{where}: the fused optimizers take plain tensors, got a {type(bad).__name__} "
                            f"{'param' if bad is p else 'grad'} (a tensor subclass such as DTensor)")
        if p.is_complex() or not p.is_floating_point():
            raise ValueError(f"{where}: the fused optimizers update float32/float16/bfloat16 params, got {p.dtype}")
        if p.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{where}: dtype {p.dtype} is not supported (expected float32, float16 or bfloat16)")
        if p.is_sparse:
            raise ValueError(f"{where}: sparse params are not supported")
        if not is_dense(p):
            raise ValueError(f"{where}: params must be dense: contiguous, channels_last or another permutation of a "
                             f"contiguous tensor (got strides {p.stride()} for shape {tuple(p.shape)})")
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

        # Everything is checked before anything (state included) is created or written.
        work = []
        for gi, group in enumerate(self.param_groups):
            self._check_group(group, f" (param group {gi})", in_step=True)
            params = []
            for i, p in enumerate(group["params"]):
                if p.grad is not None:
                    if not self._param_ok(p):
                        self._check_param(f"param {i} of param group {gi}", p)
                    params.append(p)
            work.append((group, params))

        per_device: dict[torch.device, tuple] = {}

        def device_scalars(device: torch.device):
            if device not in per_device:
                # torch's scaler hands over the scale S itself; the kernel computes 1/S on the device.
                unscale = {}
                if inv_scale is not None:
                    unscale["inv_scale"] = copy_to(inv_scale, device)
                elif grad_scale is not None:
                    unscale["grad_scale"] = copy_to(grad_scale, device, torch.float32).reshape(1)
                per_device[device] = (
                    unscale,
                    (copy_to(clip[0], device), clip[1]) if clip is not None else None,
                    copy_to(found_inf, device, torch.float32).reshape(1) if found_inf is not None else None,
                )
            return per_device[device]

        for group, params in work:
            buckets: dict[torch.device, list] = defaultdict(list)
            for p in params:
                buckets[p.device].append(p)
            for device, ps in buckets.items():
                states = [self._state_for(group, p) for p in ps]
                # A grad laid out unlike its param (rare: autograd gives a dense param's grad its layout)
                # goes through a copy in the param's layout.
                grads = [g if g.stride() == p.stride() or same_layout(g, p) else like(g, p, p.dtype)
                         for p, g in ((p, p.grad) for p in ps)]
                inv, clip, found = device_scalars(device)
                lr = group["lr"]
                if isinstance(lr, torch.Tensor):
                    lr = copy_to(lr, device, torch.float32).reshape(1)
                # A step that unscales or clips leaves in p.grad the gradient it used (unscaled, clipped),
                # as torch's fused optimizers do: the kernel writes it in the same pass. A skipped step
                # writes nothing.
                write_grad = bool(inv) or clip is not None
                self._fused_step(group, ps, grads, states, lr, inv, clip, found, self._counter(device),
                                 write_grad=write_grad)
                if write_grad:
                    for p, g in zip(ps, grads):
                        if g is not p.grad:  # the grad went through a copy
                            p.grad.copy_(g)
        return loss

    def _counter(self, device: torch.device) -> torch.Tensor:
        """A zeroed int32 the update kernel borrows and leaves zeroed, one per device: with it the last
        block of the update increments the step counters, so a step is one launch per group."""
        counters = self.__dict__.setdefault("_mpf_counters", {})
        if device not in counters:
            counters[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return counters[device]

    def _fused_step(self, group, params, grads, states, lr, unscale, clip, found_inf, counter, *,
                    write_grad: bool = False) -> None:
        """unscale: {} or {"inv_scale": t} or {"grad_scale": t}; clip: None or (sum of squares, max_norm);
        counter: see _counter()."""
        raise NotImplementedError

    # ---- state dict ---------------------------------------------------------------------------------
    def _load_value(self, param: torch.Tensor, key, value):
        if key == "step":
            return torch.as_tensor(value, dtype=torch.float32).to(param.device).reshape(())
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            # FP32 state stays FP32 (torch's loader would cast it to an FP16 param's dtype), in the param's
            # memory layout.
            if value.shape == param.shape and is_dense(param):
                return like(value, param, torch.float32)
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
            if "param_names" in g and "param_names" not in ng:
                ng["param_names"] = g["param_names"]
            for key in self._class_keys:  # the algorithm comes from the class, not from the file
                ng[key] = g[key]
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
