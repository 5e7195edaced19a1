"""mpfused.GradScaler: a torch.amp.GradScaler whose hot path never stops the host, with fused clipping.

It subclasses torch.amp.GradScaler and keeps its state layout (``_scale`` and ``_growth_tracker`` are
0-d device tensors created by ``_lazy_init_scale_growth_tracker`` on the first ``scale()``;
``_per_optimizer_states[id(opt)]`` holds ``{"stage": OptState, "found_inf_per_device": {device: t}}``),
its private methods (``_unscale_grads_``, ``_check_inf_per_device``, ``_maybe_opt_step``, ...), its
pickling rules and its errors. What it changes:

- the gradient pass is mpfused's multi-tensor kernel (mpfused.non_finite_check_) for every gradient it
  can take (dense float32/float16/bfloat16 plain tensors, contiguous or a flat view of dense memory such
  as channels_last); torch's own foreach op takes the rest (float64, sparse values, tensor subclasses);
- with the fused optimizers (mpfused.optim) an iteration is: one pass over the gradients for found_inf
  (and, after clip_grad_norm_, the sum of squares and the norm), the fused update, which reads found_inf,
  1/scale and the clip coefficient on the device, and update(): the scale update (csrc/core/loss_scale.h)
  in one tiny device launch. No step of it syncs the host with the device;
- extras: hysteresis, opt-in min/max clamps, static scaling, a device-side count of skipped steps, and a
  process_group (DDP, FSDP1) or a DTensor mesh (FSDP2, HSDP) whose ranks skip together and clip by the
  true global norm; DTensor grads are checked on their local shards, with no gather.

With torch's own optimizers (and any optimizer that sets ``_step_supports_amp_scaling``) step() follows
torch's protocol exactly; a plain optimizer needs found_inf on the host once per iteration, as in torch.

torch.compile: every method an iteration calls (scale, unscale_, clip_grad_norm_, step, update) is defined
here, in code torch.compile traces; torch.amp's own module is on dynamo's skip list, so nothing of it is
called on that path (the per-optimizer state and the per-device copies have their own small versions
below). With a fused optimizer a whole iteration compiles with ``fullgraph=True``.
"""

from __future__ import annotations

import inspect
import math
import re
import struct
import weakref
import numbers
import warnings
from collections import abc, defaultdict
from typing import Any, Optional

import torch
from torch.amp.grad_scaler import OptState

from . import _dist, _ops
from ._layout import dense_grad, flat
from .optim._base import FusedOptimizer, StepScaling, copy_to, switch

__all__ = ["GradScaler"]

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FLT_MAX = 3.4028234663852886e38
_SHARDINGS = ("replicated", "sharded")
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_CUDA_KERNELS = _ops.has_cuda_kernels()


def _fresh_clip_state() -> dict:
    """mpfused's per-optimizer extras (a top-level factory so that the scaler pickles): the sum of
    squares of the unscaled gradients and max_norm recorded by clip_grad_norm_ on the fused path, and
    whether clip_grad_norm_ unscaled the gradients itself (any other optimizer: an unscale_() after it
    then has nothing left to do)."""
    return {"sumsq": None, "max_norm": None, "unscaled": False}


def _fresh_optimizer_state() -> dict:
    """torch's per-optimizer state (``_per_optimizer_states[id(opt)]``), as torch.amp builds it; defined here
    so that torch.compile traces it (and a top-level factory, so that the scaler pickles)."""
    return {"stage": OptState.READY, "found_inf_per_device": {}}


class _PerDevice:
    """A tensor's copies per device, made on first use: a fresh copy on every device, the tensor's own
    included (each device's found_inf is written by that device's pass). torch.amp's replicator does the
    same; this one is traceable by torch.compile."""

    def __init__(self, master: torch.Tensor) -> None:
        self.master = master
        self._copies: dict = {}

    def get(self, device: torch.device) -> torch.Tensor:
        if device not in self._copies:
            self._copies[device] = self.master.clone() if device == self.master.device else copy_to(self.master, device)
        return self._copies[device]


def _kernel_view(t: torch.Tensor) -> Optional[torch.Tensor]:
    """t, or a flat view of its memory, when mpfused's kernel can take it; None when torch's op must."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided or t.dtype not in _KERNEL_DTYPES:
        return None
    if t.device.type != "cpu" and not (t.device.type == "cuda" and _CUDA_KERNELS):
        return None
    if dense_grad(t):  # e.g. channels_last: the check and the unscale are element-wise
        return flat(t)
    return None


def _name_overlap(error: ValueError, kernel: list, optimizer) -> ValueError:
    """The kernel's error for two of its tensors over the same memory ("tensors[b] and tensors[a] share
    memory"), with the params whose grads they are named instead; ``error`` itself for any other."""
    m = re.match(r"tensors\[(\d+)\] and tensors\[(\d+)\] share memory", str(error))
    if m is None:
        return error

    def find(t: torch.Tensor, after: tuple = (-1, -1)) -> Optional[tuple]:
        """The first (group, param) past ``after`` whose grad the kernel took as ``t`` (the kernel's list is in
        the params' order, so the later of the two tensors belongs to a later param)."""
        for gi, group in enumerate(optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                grad = param.grad
                if grad is None or (gi, i) <= after:
                    continue
                if type(grad) not in _PLAIN and _dist.is_dtensor(grad):
                    grad = _dist.local(grad)
                if grad.is_sparse:
                    grad = grad._values()
                if grad.layout == torch.strided and grad.data_ptr() == t.data_ptr() and grad.numel() == t.numel():
                    return gi, i
        return None

    a, b = sorted((int(j) for j in m.groups()))
    first = find(kernel[a])
    second = None if first is None else find(kernel[b], first)
    if second is None:
        return error
    return ValueError(f"the grads of param {first[1]} of param group {first[0]} and of param {second[1]} of param "
                      f"group {second[0]} share memory: an in-place unscale would unscale the shared elements twice; "
                      "give each param a grad of its own (e.g. .clone())")


def _number(name: str, value, what: str) -> float:
    """``value`` as a Python float: an int, a float, a numpy scalar or a one-element real tensor (what a
    checkpoint or a config may hold; torch's scaler takes them too). A bool (numpy's too: not a
    numbers.Real), NaN or anything else is a ValueError naming ``name``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool:
        if value.device.type == "meta":  # (no value to read)
            raise ValueError(f"{name} must be {what}, got a tensor on the meta device, which holds no value")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    try:
        v = float(value)
    except OverflowError:  # (an int beyond any float, such as 10**400)
        raise ValueError(f"{name} must be {what}, got a number too large for a float") from None
    if math.isnan(v):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return v


def _check_int(name: str, value, lo: int, hi: int = 2**31 - 1, hi_text: str = "2**31 - 1") -> int:
    """``value`` as a Python int in [lo, hi]: an int, a numpy integer, an integral float (3.0, as a JSON
    checkpoint holds it) or a one-element tensor of one; else a ValueError naming ``name``."""
    what = f"an integer in [{lo}, {hi_text}]"
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and not value.is_complex() and value.dtype != torch.bool:
        value = value.item()
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        v = int(value)
    else:
        f = _number(name, value, what)
        v = int(f) if f.is_integer() else None
    if v is None or not lo <= v <= hi:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return v


# The smallest scale taken: FP32's smallest normal number. A smaller one is a subnormal or 0 once stored as the
# float32 scale (1e-46 is 0: every gradient would become 0 and the unscale 0 * inf = NaN), its inverse may
# pass FP32's largest finite value (1 / 1e-40 is inf), and a device flushing subnormals reads it as 0.
_MIN_SCALE = 2.0**-126


def _check_scale(name: str, value, loaded: bool = False) -> float:
    """A scale given by the user: a finite number in [2**-126, FLT_MAX]. ``loaded``: a state dict's, which the
    scaler may have saved itself after its updates took the scale below 2**-126 (about 126 overflows in a row
    without min_scale; torch's scaler goes there too): any positive finite float32 then, so that a scaler's
    own checkpoints always load."""
    if loaded:
        what = f"a finite number in (0, {_FLT_MAX:g}] (a float32 scale)"
        v = _number(name, value, what)
        # (as the float32 it is stored as: 1e-46 is 0 there)
        ok = math.isfinite(v) and 0.0 < v <= _FLT_MAX and struct.unpack("f", struct.pack("f", v))[0] > 0.0
    else:
        what = f"a finite number in [2**-126, {_FLT_MAX:g}] (a normal float32 scale, with a finite inverse)"
        v = _number(name, value, what)
        ok = math.isfinite(v) and _MIN_SCALE <= v <= _FLT_MAX
    if not ok:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return v


def _check_factors(growth_factor, backoff_factor, names=("growth_factor", "backoff_factor")) -> tuple:
    """torch's rule (growth_factor > 1, backoff_factor < 1, as AssertionErrors with torch's texts), and
    backoff_factor > 0, which torch does not check: 0 takes the scale to 0 at the first overflow (every
    later gradient is then 0 * inf = NaN), and a negative one makes it negative. A non-number or NaN, which
    torch lets through to a NaN scale, is a ValueError here. Returns both as floats."""
    growth = _number(names[0], growth_factor, "a number > 1")
    backoff = _number(names[1], backoff_factor, "a number in (0, 1)")
    if growth <= 1.0:
        raise AssertionError("The growth factor must be > 1.0.")
    if backoff >= 1.0:
        raise AssertionError("The backoff factor must be < 1.0.")
    if backoff <= 0.0:
        raise ValueError(f"{names[1]} must be a number in (0, 1) (the scale is multiplied by it on an overflow), "
                         f"got {backoff_factor!r}")
    return growth, backoff


def _check_clamp(name: str, value) -> Optional[float]:
    if value is None:
        return None
    what = "None (no clamp) or a number >= 0"
    v = _number(name, value, what)
    if not v >= 0.0:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return v


_TAKES_SCALING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _step_takes_scaling(cls: type) -> bool:
    """Whether ``cls.step`` names the ``scaling`` keyword (FusedOptimizer.step does; a subclass may override it
    with torch's ``step(self, closure=None)``, or take ``**kwargs`` that it may not pass on). Answered once per
    step function (a class's step replaced later is asked again; the cache keeps no function alive)."""
    step = cls.step
    try:
        return _TAKES_SCALING[step]
    except (KeyError, TypeError):
        pass
    try:
        takes = "scaling" in inspect.signature(step).parameters
    except (TypeError, ValueError):  # (a step without a signature to read: the keyword is not tried)
        takes = False
    try:
        _TAKES_SCALING[step] = takes
    except TypeError:  # (not weakly referenceable)
        pass
    return takes


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` with a sync-free fused path and extras (keyword-only):

    - ``hysteresis=k``: tolerate k-1 consecutive overflows before backing off (DeepSpeed's rule);
    - ``min_scale``/``max_scale``: opt-in clamps (default None: torch's rule, no clamp);
    - ``dynamic=False``: the scale stays at ``init_scale`` (static loss scaling); steps are still skipped;
    - ``process_group``: found_inf is all-reduced (MAX) so that every rank skips together, and
      clip_grad_norm_ clips by the global norm. Then ``grad_sharding`` is required: ``"replicated"``
      (DDP, and torch's ZeroRedundancyOptimizer: every rank holds the whole gradient, so the local norm is
      the global one) or ``"sharded"`` (FSDP1, ZeRO stages that partition the gradients: each rank holds a
      part; the squares are summed over the ranks). Without a process_group
      ``grad_sharding`` is ignored (one process: its norm is the global one), so ``process_group=pg if
      dist.is_initialized() else None`` beside a fixed ``grad_sharding`` works in both.
    - DTensor params (FSDP2, HSDP, tensor parallel) need no argument: the kernels take the local shards of
      their grads, found_inf is all-reduced (MAX) over every rank of the params' mesh, and a grad's squares
      are summed over the mesh dims where its param is sharded, not where it is replicated (HSDP: within
      the shard group). ``device_mesh`` names that mesh explicitly (it must hold every rank of every
      param's mesh). Plain grads beside DTensor ones (in other param groups) are taken as replicated: the
      same on every rank, counted once.

    Skipped steps: ``found_inf()`` (this or the last iteration's flag) and ``skipped_steps_async()`` (a
    device-side count kept by update()) never sync; ``skipped_steps`` and ``last_step_skipped`` do.
    """

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True, *,
                 hysteresis: int = 1, min_scale: Optional[float] = None, max_scale: Optional[float] = None,
                 dynamic: bool = True, process_group=None, grad_sharding: Optional[str] = None,
                 device_mesh=None) -> None:
        try:
            device = torch.device(device).type  # torch keeps the device type; the scale lives on the loss's device
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device must be a device type such as 'cuda' or 'cpu', got {device!r} ({e})") from None
        dynamic = switch("dynamic", dynamic)  # (bool("no") would be True)
        if enabled:  # numbers as Python floats and ints (numpy scalars and one-element tensors are taken)
            growth_factor, backoff_factor = _check_factors(growth_factor, backoff_factor)
            init_scale = _check_scale("init_scale", init_scale)
            growth_interval = _check_int("growth_interval", growth_interval, 1)
        hysteresis = _check_int("hysteresis", hysteresis, 1)
        min_scale = _check_clamp("min_scale", min_scale)
        max_scale = _check_clamp("max_scale", max_scale)
        if min_scale is not None and max_scale is not None and min_scale > max_scale:
            raise ValueError(f"min_scale ({min_scale}) must not exceed max_scale ({max_scale})")
        if enabled and dynamic and not ((min_scale or 0.0) <= init_scale <= (math.inf if max_scale is None else max_scale)):
            raise ValueError(f"init_scale ({init_scale}) must lie in [min_scale, max_scale] = [{min_scale}, {max_scale}]")
        if process_group is not None and grad_sharding not in _SHARDINGS:
            raise ValueError("with a process_group, grad_sharding must be 'replicated' (DDP: every rank holds the "
                             "whole gradient, as with torch's ZeroRedundancyOptimizer; the norm needs no reduction) or "
                             "'sharded' (FSDP1, ZeRO stages that partition the gradients: each rank holds a part; the "
                             f"squares are summed over the ranks), got {grad_sharding!r}")
        if device_mesh is not None:
            if process_group is not None or grad_sharding is not None:
                raise ValueError("device_mesh is for DTensor grads, whose placements say how each norm is reduced: "
                                 "give the scaler device_mesh, or process_group with grad_sharding (plain grads, DDP "
                                 "and FSDP1), not both")
            if not all(hasattr(device_mesh, a) for a in ("get_group", "ndim", "mesh")):
                raise TypeError(f"device_mesh must be a torch.distributed.DeviceMesh, got {type(device_mesh).__name__}")
        if grad_sharding is not None and grad_sharding not in _SHARDINGS:
            raise ValueError(f"grad_sharding must be None, 'replicated' or 'sharded', got {grad_sharding!r}")
        if process_group is not None and not (torch.distributed.is_available()
                                              and isinstance(process_group, torch.distributed.ProcessGroup)):
            raise TypeError(f"process_group must be a torch.distributed.ProcessGroup (e.g. dist.group.WORLD, or one "
                            f"from dist.new_group), got {type(process_group).__name__}")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.cuda.amp.GradScaler is enabled")
            super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        if enabled and not self._enabled:
            warnings.warn("mpfused.GradScaler is enabled, but CUDA is not available. Disabling.", stacklevel=2)
        self._hysteresis = int(hysteresis)
        self._min_scale = None if min_scale is None else float(min_scale)
        self._max_scale = None if max_scale is None else float(max_scale)
        self._dynamic = dynamic
        self._process_group = process_group
        self._grad_sharding = grad_sharding
        self._device_mesh = device_mesh
        self._init_hysteresis_left = self._hysteresis
        self._init_skipped_steps = 0
        self._reset_device_extras()
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)
        self._mpf_clip_states: defaultdict = defaultdict(_fresh_clip_state)

    # ---- device state ---------------------------------------------------------------------------------
    def _reset_device_extras(self) -> None:
        self._inv_scale: Optional[torch.Tensor] = None
        self._inv_of: Optional[tuple] = None  # (the _scale tensor, its version) that _inv_scale is 1 over
        self._hysteresis_left: Optional[torch.Tensor] = None
        self._skipped_steps: Optional[torch.Tensor] = None
        # the zeroed counters the overflow kernel borrows for its last-block reduction and leaves zeroed (one
        # per device and stream, _ops.borrowed_counter): they save the memset of a fresh one per iteration
        self._counters: dict = {}
        self._last_found_inf: Optional[torch.Tensor] = None

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        """torch's lazy init (the scale and growth tracker as 0-d tensors on ``dev``) and mpfused's extras."""
        if self._growth_tracker is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=dev)
        self._device_extras()

    def _check_scale_growth_tracker(self, funcname: str) -> tuple:
        """torch's check (and its messages) that scale() ran before ``funcname``."""
        fix = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
        if self._scale is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + fix)
        if self._growth_tracker is None:
            raise AssertionError(f"Attempted {funcname} but _growth_tracker is None.  " + fix)
        return self._scale, self._growth_tracker

    def _device_extras(self) -> torch.device:
        """Creates mpfused's device state next to ``_scale`` (also when a framework set ``_scale`` itself),
        and keeps ``_inv_scale`` = 1 / ``_scale``: code that writes ``_scale`` (``scaler._scale.fill_(s)``
        to cap or reset the scale, or a new tensor in its place) changes what unscale_ and step divide by,
        as with torch's scaler, which computes 1 / scale at each unscale_. Checked by the tensor's identity
        and version counter (no device work unless they changed; our own writes note the new version)."""
        if not isinstance(self._scale, torch.Tensor):
            raise ValueError(f"_scale must be a tensor with one element, got {type(self._scale).__name__}")
        dev = self._scale.device
        changed = (self._inv_scale is None or self._inv_scale.device != dev) or not torch.compiler.is_compiling() and (
            (of := getattr(self, "_inv_of", None)) is None or of[0] is not self._scale or of[1] != self._scale._version)
        if changed and self._scale.numel() != 1:
            raise ValueError("_scale must be a tensor with one element (a 0-d tensor, or of shape (1,) as torch's "
                             f"older scalers made it), got a tensor of shape {tuple(self._scale.shape)}")
        if self._inv_scale is None or self._inv_scale.device != dev:
            # (0-d whatever _scale's shape: torch's older scalers, and code written for them, made it of shape (1,))
            self._inv_scale = self._scale.double().reciprocal().float().reshape(())
            self._hysteresis_left = torch.full((), self._init_hysteresis_left, dtype=torch.int32, device=dev)
            self._skipped_steps = torch.full((), self._init_skipped_steps, dtype=torch.int64, device=dev)
            self._note_scale()
        elif changed:
            self._inv_scale.copy_(self._scale.double().reciprocal().reshape(()))
            self._note_scale()
        return dev

    def _note_scale(self) -> None:
        """Records that ``_inv_scale`` is 1 / ``_scale`` as it stands (after a write of both by us). A traced
        step (torch.compile) neither checks nor records: the first eager call after it recomputes."""
        if not torch.compiler.is_compiling():
            self._inv_of = (self._scale, self._scale._version)

    def _ready(self, funcname: str) -> torch.device:
        self._check_scale_growth_tracker(funcname)
        return self._device_extras()

    def scale(self, outputs):
        """torch's scale(): the outputs (a tensor, or an iterable of them, nested) times the scale, same
        shapes and dtypes (the scale is 0-d); lists and tuples keep their type, another iterable comes
        back as a lazy map, as in torch."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            self._device_extras()
            scale = self._scale
            return outputs * (scale if scale.device == outputs.device else scale.to(device=outputs.device,
                                                                                      non_blocking=True))
        copies: list = []

        def apply(val):
            if isinstance(val, torch.Tensor):
                if not copies:
                    if self._scale is None:
                        self._lazy_init_scale_growth_tracker(val.device)
                    self._device_extras()
                    copies.append(_PerDevice(self._scale))
                return val * copies[0].get(val.device)
            if isinstance(val, abc.Iterable):
                mapped = map(apply, val)
                return type(val)(mapped) if isinstance(val, (list, tuple)) else mapped
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    # ---- the gradient pass ------------------------------------------------------------------------------
    def _collect(self, optimizer, allow_fp16: bool, for_norm: bool = False) -> tuple:
        """The optimizer's gradients, in buckets keyed by (device, norm key): (tensors for mpfused's kernel,
        {dtype: tensors for torch's foreach op}). A DTensor grad enters as its local shard; its norm key is
        (mesh, the mesh dims its squares are summed over: its param's, with or without a grad on this rank),
        a plain grad's is None (see _all_reduce). Returns
        (buckets, the mesh whose ranks skip together, or None). Everything is validated here, before any
        kernel runs on any device and before any collective."""
        buckets: dict = defaultdict(lambda: ([], defaultdict(list)))
        meshes: dict = {}  # mesh -> the first (group, param) index on it, for messages
        # id(grad) -> (group, param) index: a param listed twice (torch's optimizers only warn). Not while
        # torch.compile traces (torch 2.11's dynamo cannot trace id() of a tensor it made: a graph break)
        seen: Optional[dict] = None if torch.compiler.is_compiling() else {}
        with torch.no_grad():
            for gi, group in enumerate(optimizer.param_groups):
                for i, param in enumerate(group["params"]):
                    if not isinstance(param, torch.Tensor):
                        raise AssertionError(f"expected param to be torch.Tensor, got {type(param).__name__}")
                    grad = param.grad
                    key = None
                    if type(param) not in _PLAIN and _dist.is_dtensor(param):
                        # The mesh and the norm key come from the param, which every rank holds with or
                        # without a grad: every rank then issues the same collectives.
                        meshes.setdefault(param.device_mesh, (gi, i))
                        dims = _dist.sum_dims(param)
                        key = (param.device_mesh, dims) if dims else None  # replicated: local = global
                        if key is not None and for_norm:
                            buckets[(_dist.local(param).device, key)]  # noqa: B018 - the key, on every rank
                        if grad is None:
                            continue
                        _dist.check_same_spec(f"param {i} of param group {gi}", param, grad)
                        grad = _dist.local(grad)
                    elif grad is None:
                        continue
                    elif type(grad) not in _PLAIN and _dist.is_dtensor(grad):
                        raise TypeError(f"param {i} of param group {gi}: the grad is a {_dist.describe(grad)} but the "
                                        "param is a plain tensor; both must be DTensors with the same placements")
                    first = (gi, i) if seen is None else seen.setdefault(id(grad), (gi, i))
                    if first != (gi, i):
                        raise ValueError(f"param {i} of param group {gi} has the grad of param {first[1]} of param group "
                                         f"{first[0]} (a param listed twice?): it would be unscaled twice, and counted "
                                         "twice in a norm")
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if not grad.is_floating_point():  # torch's op refused it, after the grads before it were unscaled
                        raise TypeError(f"param {i} of param group {gi}: its grad is a {grad.dtype} tensor; the "
                                        "scaler unscales floating-point grads only")
                    if grad.is_sparse:
                        if grad.dtype is torch.float16 or for_norm:
                            # duplicate indices of scaled FP16 values may overflow only once added: check
                            # (and unscale) the coalesced values, as torch does; a norm needs them summed
                            param.grad = grad = grad.coalesce()
                        grad = grad._values()
                    view = _kernel_view(grad)
                    kernel, other = buckets[(grad.device, key)]
                    if view is not None:
                        kernel.append(view)
                    else:
                        # (not under torch.compile, which cannot trace the query: there torch's op raises)
                        if (grad.layout == torch.strided and not torch.compiler.is_compiling()
                                and torch._debug_has_internal_overlap(grad) == 1):
                            # torch's op raises for it, but only once the grads before it were unscaled
                            raise RuntimeError(f"param {i} of param group {gi}: its grad has elements that share "
                                               "memory (an expand()ed tensor), which an in-place unscale cannot "
                                               "write; clone() it first")
                        other[grad.dtype].append(grad)
        return buckets, self._skip_mesh(meshes)

    def _skip_mesh(self, meshes: dict):
        """The mesh over which found_inf is reduced: the one the scaler was given (``device_mesh``), which
        must hold every rank of every DTensor grad's mesh, or else the one mesh of the DTensor grads that
        holds the others' ranks; None without either."""
        if not meshes:
            return self._device_mesh
        where = lambda m: "param {1} of param group {0}".format(*meshes[m])  # noqa: E731
        if self._process_group is not None:
            m = next(iter(meshes))
            raise ValueError(f"{where(m)} has a DTensor grad (on {m}), but this scaler was given a process_group; "
                             "for DTensor grads (FSDP2, HSDP, tensor parallel) give it the mesh instead: "
                             "GradScaler(..., device_mesh=mesh); it reduces each grad's norm by its placements")
        if self._device_mesh is not None:
            for m in meshes:
                if not _dist.covers(self._device_mesh, m):
                    raise ValueError(f"{where(m)} has a DTensor grad on {m}, a mesh this scaler was not told of (it was "
                                     f"given device_mesh={self._device_mesh}, which does not hold all of that mesh's "
                                     "ranks); give the scaler the mesh that holds every rank of the training job")
            return self._device_mesh
        mesh = _dist.common_mesh(meshes)
        if mesh is None:
            raise ValueError("the DTensor grads lie on several meshes, none of which holds the others' ranks "
                             f"({', '.join(f'{m} ({where(m)})' for m in meshes)}); tell the scaler which ranks skip "
                             "together: GradScaler(..., device_mesh=the mesh of the whole job)")
        return mesh

    def _pass(self, buckets: dict, inv_scale: Optional[torch.Tensor], *, unscale: bool, sumsq: bool,
              found_inf: Optional[torch.Tensor] = None, optimizer=None):
        """One multi-tensor pass per bucket (see _collect): found_inf per device, optionally the unscale in
        place (by inv_scale) and the sum of squares of the unscaled values per norm key (``optimizer``, the
        one _collect read, names the params in the kernel's errors). ``found_inf``
        (optional) is the value each device's flag starts from, as in torch's _unscale_grads_. Returns
        (found per device, {norm key: sum of squares on the scale's device} or None, the norm when one
        launch computed it, else None)."""
        # the scale's device; a disabled scaler (clipping with a process_group) has none
        scale = getattr(self, "_scale", None)
        home = scale.device if scale is not None else next(iter(buckets), (torch.device("cpu"), None))[0]
        found_rep = _PerDevice(found_inf) if found_inf is not None else None
        inv_rep = _PerDevice(inv_scale) if inv_scale is not None else None
        # The common case, every grad on the scale's device, one norm key and all taken by our kernel: one
        # launch writes found_inf, the sum of squares and the norm from scratch (no zero fills, no memset).
        fresh = (found_rep is None and len(buckets) == 1 and next(iter(buckets))[0] == home
                 and not next(iter(buckets.values()))[1])
        new = torch.empty if fresh else torch.zeros
        found: dict = {}
        sums: Optional[dict] = {} if sumsq else None
        norm = None
        for (device, key), (kernel, other) in buckets.items():
            f = found.get(device)
            if f is None:
                f = found_rep.get(device) if found_rep is not None else new((), dtype=torch.float32, device=device)
                found[device] = f
            s = new((), dtype=torch.float32, device=device) if sumsq else None
            n = torch.empty((), dtype=torch.float32, device=device) if (fresh and sumsq) else None
            inv = None if inv_rep is None else (inv_scale if device == inv_scale.device else inv_rep.get(device))
            if kernel or fresh:
                args = dict(unscale=unscale and inv is not None, sumsq=s, overwrite=fresh, norm=n,
                            counter=_ops.borrowed_counter(self._counters, device) if fresh else None)
                if optimizer is None or torch.compiler.is_compiling():
                    _ops.non_finite_check_(kernel, f, inv, **args)
                else:
                    try:
                        _ops.non_finite_check_(kernel, f, inv, **args)
                    except ValueError as e:  # (refused before anything was written)
                        raise _name_overlap(e, kernel, optimizer) from None
            for grads in other.values():
                factor = inv if (unscale and inv is not None) else torch.ones((), dtype=torch.float32, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, f, factor)
                if s is not None:
                    # FP32 norms: an FP16 norm of scaled grads overflows to inf past 65504 (FP64 grads: their
                    # own norms, which _foreach_norm will not narrow, summed in FP64)
                    wide = grads[0].dtype == torch.float64
                    part = torch.stack(torch._foreach_norm(grads, dtype=None if wide else torch.float32)).square().sum()
                    part = part.float() if wide else part
                    s.add_(part if (unscale or inv is None) else part * inv * inv)
            if sumsq:
                s = copy_to(s, home)
                sums[key] = s if key not in sums else sums[key] + s
                norm = n
        return found, sums, norm

    def _all_reduce(self, found: dict, mesh=None, sums: Optional[dict] = None, norm: Optional[torch.Tensor] = None):
        """Across ranks, then the total sum of squares and the norm (None, None without ``sums``):

        - found_inf over every rank of the process group or of ``mesh`` (every rank skips together, even
          where one replica's grads differ from another's);
        - each norm key's sum of squares with SUM: a DTensor grad's over the mesh dims where it is sharded
          (not where it is replicated: those ranks hold the same values); a plain grad's over the process
          group only for grad_sharding='sharded' (replicated grads already hold the global norm).

        found_inf rides with the first sum over the same ranks, as one SUM of (sum of squares, flag): a sum
        of flags is != 0 exactly when one of them is, and clamped to 1 it is their MAX (torch's fused
        optimizers skip only for a flag of exactly 1). The dims that sum leaves get a MAX of the flag alone.
        So FSDP2 and FSDP1 clip with one scalar all-reduce, HSDP with two, and the optimizer step with none.
        """
        import torch.distributed as dist

        scale = getattr(self, "_scale", None)
        home = scale.device if scale is not None else next(
            iter(found), next((s.device for s in (sums or {}).values()), torch.device("cpu")))
        reduced = False
        done: set = set()  # the norm keys whose sum went with the flag
        if self._process_group is not None or mesh is not None:
            # Exactly one reduction of found_inf, whatever this rank holds: ranks with grads on other
            # devices, or none, must issue the same collectives or they hang.
            flag = torch.zeros((), dtype=torch.float32, device=home)
            for f in found.values():
                flag = torch.maximum(flag, copy_to(f, home))
            if sums is not None and self._process_group is not None and self._grad_sharding == "sharded":
                if None not in sums:  # this rank holds no plain grad: it still joins the sum
                    sums[None] = torch.zeros((), dtype=torch.float32, device=home)
                packed = torch.stack([sums[None], flag])
                dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=self._process_group)
                sums[None], flag = packed[0], packed[1].clamp(max=1.0)
                reduced = True
            elif sums is not None and mesh is not None and any(k is not None and k[0] == mesh for k in sums):
                key = next(k for k in sums if k is not None and k[0] == mesh)
                packed = torch.stack([sums[key], flag])
                _dist.all_reduce_sum(packed, mesh, key[1])
                sums[key], flag = packed[0], packed[1].clamp(max=1.0)
                _dist.all_reduce_max(flag, mesh=mesh, skip_dims=key[1])
                done.add(key)
                reduced = True
            else:
                _dist.all_reduce_max(flag, mesh=mesh, group=self._process_group)
            for device in list(found):
                found[device] = flag if device == home else copy_to(flag, device)
            if not found:  # a rank without grads still skips (or steps) with the others
                found[home] = flag
        if sums is None:
            return None, None
        total = None
        for key, s in sums.items():
            if key is not None and key not in done:
                _dist.all_reduce_sum(s, key[0], key[1])
                reduced = True
            total = s if total is None else total + s
        if total is None:  # no gradients at all: the norm is 0, as torch's clip_grad_norm_ says
            total = torch.zeros((), dtype=torch.float32, device=home)
        if norm is None or reduced or len(sums) != 1:
            norm = total.sqrt()
        return total, norm

    def _unscale_grads_(self, optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool) -> dict:
        """torch's contract (grads unscaled in place, returns {device: found_inf}, not reduced across ranks),
        with mpfused's kernel for what it takes. Every grad is validated before anything is unscaled."""
        return self._pass(self._collect(optimizer, allow_fp16)[0], inv_scale, unscale=True, sumsq=False,
                          found_inf=found_inf, optimizer=optimizer)[0]

    def _check_inf_per_device(self, optimizer) -> dict:
        """found_inf per device of the (still scaled) grads, recorded for the optimizer; no unscale."""
        self._ready("_check_inf_per_device")
        buckets, mesh = self._collect(optimizer, True)
        found = self._pass(buckets, None, unscale=False, sumsq=False)[0]
        self._all_reduce(found, mesh)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
        return found

    def unscale_(self, optimizer) -> None:
        """torch's unscale_(), except that FP16 gradients are accepted (O2/O3 training has them; torch
        raises). A clip recorded by clip_grad_norm_ before is applied in the same pass."""
        if not self._enabled:
            return
        self._ready("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        clip = self._mpf_clip_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED and clip["unscaled"]:
            # clip_grad_norm_ unscaled them (an optimizer without the fused clip): the order that works with
            # the fused optimizers (clip_grad_norm_, then unscale_) works with every optimizer
            clip["unscaled"] = False
            return
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        inv = self._inv_scale
        if clip["max_norm"] is not None:
            inv = inv * self._clip_coef(clip["sumsq"], clip["max_norm"])
        zero = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        buckets, mesh = self._collect(optimizer, True)
        found = self._pass(buckets, inv, unscale=True, sumsq=False, found_inf=zero, optimizer=optimizer)[0]
        self._all_reduce(found, mesh)
        state["found_inf_per_device"] = found
        state["stage"] = OptState.UNSCALED
        clip["max_norm"] = clip["sumsq"] = None

    @staticmethod
    def _clip_coef(sumsq: torch.Tensor, max_norm: float) -> torch.Tensor:
        # torch.nn.utils.clip_grad_norm_'s coefficient; the fused kernels compute the same from sumsq
        # (max_norm inf: 1, no clip, whatever the norm: core/optim/common.h clip_coefficient)
        if math.isinf(max_norm):
            return torch.ones((), dtype=torch.float32, device=sumsq.device)
        return (max_norm / (sumsq.sqrt() + 1e-6)).clamp(max=1.0)

    @staticmethod
    def _check_finite_norm(norm: torch.Tensor, norm_type: float) -> None:
        # error_if_nonfinite=True: torch's check and text (a read of the norm on the host, as torch's)
        if norm is not None and not bool(torch.isfinite(norm).all()):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so "
                               "it cannot be clipped. To disable this error and scale the gradients by the non-finite "
                               "norm anyway, set `error_if_nonfinite=False`")

    def clip_grad_norm_(self, optimizer, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: Optional[bool] = None) -> torch.Tensor:
        """Clips the optimizer's gradients to a global norm of ``max_norm`` and returns the unscaled
        global norm as a device tensor (no sync).

        With a fused optimizer and the 2-norm, the norm comes from the overflow pass itself and the clip
        coefficient is applied inside the fused update (or by unscale_(), if it is called next): no extra
        pass over the gradients, and ``p.grad`` keeps its scaled values until then (the step writes back
        the unscaled, clipped ones). Otherwise the gradients are unscaled and clipped in place
        (torch.nn.utils.clip_grad_norm_, or with a process_group a global 2-norm clip).

        ``max_norm``: a number >= 0 (``inf``: the norm alone, no clip, as torch's), or a one-element CPU
        tensor, read on the host (under torch.compile with fullgraph=True, pass a number); NaN and negative
        values, which torch takes into NaN or sign-flipped grads, raise.
        ``error_if_nonfinite`` and ``foreach`` as torch's (the first reads the norm on the host: a sync, as
        in torch; the second only matters where torch's clip runs).
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer (the scaler clips the grads of its params, "
                            f"and defers the clip into its step), got {type(optimizer).__name__}; "
                            "torch.nn.utils.clip_grad_norm_ is the one that takes params")
        if isinstance(max_norm, torch.Tensor):
            if max_norm.numel() != 1 or max_norm.device.type != "cpu" or max_norm.is_complex():
                raise ValueError(f"max_norm must be a number or a one-element CPU tensor (reading a device tensor "
                                 f"would sync the host), got a tensor of shape {tuple(max_norm.shape)} on {max_norm.device}")
            max_norm = max_norm.item()
        if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not 0.0 <= float(max_norm):
            raise ValueError(f"max_norm must be a number >= 0 (inf: no clip), got {max_norm!r}")
        max_norm = float(max_norm)
        norm_type = float(norm_type)
        if self._process_group is not None and norm_type != 2.0:  # (before unscale_ below writes the grads)
            raise ValueError(f"with a process_group only norm_type=2.0 is supported, got {norm_type}")
        state = self._per_optimizer_states[id(optimizer)] if self._enabled else {"stage": OptState.READY}
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("clip_grad_norm_() is being called after step().")
        clip = self._mpf_clip_states[id(optimizer)]
        if clip["max_norm"] is not None:
            raise RuntimeError("clip_grad_norm_() has already been called on this optimizer since the last update().")
        if self._enabled:
            self._ready("clip_grad_norm_")
            if isinstance(optimizer, FusedOptimizer) and norm_type == 2.0 and state["stage"] is OptState.READY:
                buckets, mesh = self._collect(optimizer, True, for_norm=True)
                found, sums, norm = self._pass(buckets, self._inv_scale, unscale=False, sumsq=True)
                total, norm = self._all_reduce(found, mesh, sums, norm)
                if error_if_nonfinite:  # (before anything is recorded: the grads are untouched)
                    self._check_finite_norm(norm, norm_type)
                state["found_inf_per_device"] = found
                clip["sumsq"], clip["max_norm"] = total, max_norm
                return norm
            if state["stage"] is OptState.READY:
                self.unscale_(optimizer)
                clip["unscaled"] = True
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        sharded = self._device_mesh is not None or any(_dist.is_dtensor(p.grad) for p in params)
        if self._process_group is None and (not sharded or norm_type != 2.0):
            # torch's clip (which reads DTensor grads' placements itself)
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
        if norm_type != 2.0:
            raise ValueError(f"with a process_group only norm_type=2.0 is supported, got {norm_type}")
        # Global 2-norm of the (now unscaled) gradients across ranks, then scale them in place.
        buckets, mesh = self._collect(optimizer, True, for_norm=True)
        found, sums, norm = self._pass(buckets, None, unscale=False, sumsq=True)
        total, norm = self._all_reduce(found, mesh, sums, norm)
        if error_if_nonfinite:
            self._check_finite_norm(norm, norm_type)
        if self._enabled:
            recorded = state["found_inf_per_device"]
            for device, f in found.items():
                recorded[device] = torch.maximum(recorded[device], f) if device in recorded else f
        coef = self._clip_coef(total, max_norm)
        for device, grads in self._grads_by_device(params).items():
            torch._foreach_mul_(grads, copy_to(coef, device))
        return norm

    @staticmethod
    def _grads_by_device(params) -> dict:
        by_device: dict = defaultdict(list)
        for p in params:
            g = _dist.local(p.grad)
            by_device[g.device].append(g)
        return by_device

    # ---- step and update ----------------------------------------------------------------------------------
    def step(self, optimizer, *args: Any, **kwargs: Any):
        """torch's step(); with a fused optimizer the skip is decided on the device (no sync)."""
        if not self._enabled:
            # torch's rule, here rather than through torch's step(), which torch.compile does not trace (a
            # disabled scaler, as amp's O0 and O3 make, broke a fullgraph compile of the iteration)
            return optimizer.step(*args, **kwargs)
        if not isinstance(optimizer, FusedOptimizer):
            return super().step(optimizer, *args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        home = self._ready("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if not _step_takes_scaling(type(optimizer)):
            # A subclass whose own step() has no `scaling` keyword (torch's step(closure=None)): stepped as
            # torch's scaler steps an optimizer without native scaling. The grads are unscaled (and clipped) in
            # place first, and the step is taken only where none overflowed: a host read of found_inf, one sync.
            # (Handing the scaling beside the call would rely on the subclass calling FusedOptimizer.step once.)
            if state["stage"] is OptState.READY:
                self.unscale_(optimizer)
            retval = None
            if not sum(v.item() for v in state["found_inf_per_device"].values()):
                retval = optimizer.step(*args, **kwargs)
            state["stage"] = OptState.STEPPED
            return retval
        if state["stage"] is OptState.READY and not state["found_inf_per_device"]:
            self._check_inf_per_device(optimizer)
        found = list(state["found_inf_per_device"].values())
        clip = self._mpf_clip_states[id(optimizer)]
        scaling = StepScaling(
            inv_scale=self._inv_scale if state["stage"] is not OptState.UNSCALED else None,
            found_inf=(found[0] if len(found) == 1 else sum(copy_to(f, home) for f in found)) if found else None,
            clip=(clip["sumsq"], clip["max_norm"]) if clip["max_norm"] is not None else None)
        retval = optimizer.step(*args, scaling=scaling, **kwargs)
        state["stage"] = OptState.STEPPED
        return retval

    def update(self, new_scale=None) -> None:
        """torch's update(): the scale update from this iteration's found_inf (one device launch, with
        hysteresis, clamps and the skipped-step count), or the scale set to ``new_scale``."""
        if not self._enabled:
            return
        _scale, _growth_tracker = self._check_scale_growth_tracker("update")
        home = self._device_extras()
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                reason = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                          "torch.FloatTensor with requires_grad=False.")
                if new_scale.device.type != self._device or new_scale.numel() != 1 or new_scale.requires_grad:
                    raise AssertionError(reason)
                if new_scale.device.type == "cpu" and not torch.compiler.is_compiling():
                    _check_scale("new_scale", new_scale)  # (a device tensor's value is not read: no sync)
                _scale.copy_(new_scale.reshape(()))
            else:
                _scale.fill_(_check_scale("new_scale", new_scale))
            self._inv_scale.copy_(_scale.double().reciprocal().reshape(()))
            self._note_scale()
        else:
            found = [copy_to(f, home) for s in self._per_optimizer_states.values()
                     for f in s["found_inf_per_device"].values()]
            if not found:
                raise AssertionError("No inf checks were recorded prior to update.")
            combined = found[0]
            for f in found[1:]:
                combined = combined + f
            _ops.loss_scale_update_(_scale, _growth_tracker, self._hysteresis_left, self._skipped_steps, combined,
                                    self._inv_scale, growth_factor=self._growth_factor,
                                    backoff_factor=self._backoff_factor, growth_interval=self._growth_interval,
                                    hysteresis=self._hysteresis, min_scale=self._min_scale,
                                    max_scale=self._max_scale, dynamic=self._dynamic)
            self._note_scale()
            self._last_found_inf = combined
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)
        self._mpf_clip_states = defaultdict(_fresh_clip_state)

    # ---- queries ------------------------------------------------------------------------------------------
    def found_inf(self) -> Optional[torch.Tensor]:
        """This iteration's found_inf (summed over optimizers and devices) as a device tensor, or after
        update() the last iteration's; != 0 means a step was skipped. None before the first check. No sync."""
        current = [f for s in self._per_optimizer_states.values() for f in s["found_inf_per_device"].values()] \
            if self._enabled else []
        if current:
            home = self._scale.device
            return sum(copy_to(f, home) for f in current[1:]) + current[0] if len(current) > 1 else current[0]
        return self._last_found_inf

    def skipped_steps_async(self) -> Optional[torch.Tensor]:
        """The number of iterations whose update() saw an inf/NaN (their steps were skipped), as a 0-d int64
        tensor on the scale's device, kept by the update kernel itself. None before the first scale(). No sync."""
        return self._skipped_steps

    @property
    def skipped_steps(self) -> int:
        """The number of skipped iterations so far, as a Python int (a host sync; 0 when disabled)."""
        if not self._enabled:
            return 0
        return self._init_skipped_steps if self._skipped_steps is None else int(self._skipped_steps.item())

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last update()'s iteration was skipped (a host sync; False before any update)."""
        return self._last_found_inf is not None and bool(self._last_found_inf.item() != 0)

    def get_hysteresis(self) -> int:
        return self._hysteresis

    # On a disabled scaler (enabled=False, or "cuda" without CUDA) the setters store what they are given, as
    # torch's do: its values were never checked either (the constructor checks them only when enabled), and a
    # script written for a GPU must run on a CPU-only machine. (They checked the value against the other
    # factor, which a disabled scaler never stored: an AttributeError.)
    def set_growth_factor(self, new_factor: float) -> None:
        if not self._enabled:
            self._growth_factor = new_factor
            return
        self._growth_factor = _check_factors(new_factor, self._backoff_factor, ("new_factor", "backoff_factor"))[0]

    def set_backoff_factor(self, new_factor: float) -> None:
        if not self._enabled:
            self._backoff_factor = new_factor
            return
        self._backoff_factor = _check_factors(self._growth_factor, new_factor, ("growth_factor", "new_factor"))[1]

    def set_growth_interval(self, new_interval: int) -> None:
        if not self._enabled:
            self._growth_interval = new_interval
            return
        self._growth_interval = _check_int("new_interval", new_interval, 1)

    # ---- state dict and pickling -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch's keys (scale, growth_factor, backoff_factor, growth_interval, _growth_tracker) plus
        mpfused's (hysteresis, _hysteresis_left, min_scale, max_scale, dynamic, _skipped_steps)."""
        sd = super().state_dict()
        if self._enabled:
            left = self._init_hysteresis_left if self._hysteresis_left is None else int(self._hysteresis_left.item())
            sd.update(hysteresis=self._hysteresis, _hysteresis_left=left, min_scale=self._min_scale,
                      max_scale=self._max_scale, dynamic=self._dynamic, _skipped_steps=self.skipped_steps)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads ours or torch.amp.GradScaler's state dict (a key torch's lacks keeps its value). Every
        value is validated first: on an error nothing changes."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled "
                               "instance of GradScaler.")
        missing = [k for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
                   if k not in state_dict]
        if missing:
            raise KeyError(f"state_dict lacks the GradScaler keys {missing}")
        # validated and made Python numbers (a checkpoint may hold tensors or numpy scalars, as torch allows)
        sd = dict(state_dict)
        sd["scale"] = _check_scale("state_dict['scale']", sd["scale"], loaded=True)
        sd["growth_factor"], sd["backoff_factor"] = _check_factors(
            sd["growth_factor"], sd["backoff_factor"], ("state_dict['growth_factor']", "state_dict['backoff_factor']"))
        sd["growth_interval"] = _check_int("state_dict['growth_interval']", sd["growth_interval"], 1)
        sd["_growth_tracker"] = _check_int("state_dict['_growth_tracker']", sd["_growth_tracker"], 0)
        hysteresis = _check_int("state_dict['hysteresis']", sd.get("hysteresis", self._hysteresis), 1)
        if "_hysteresis_left" in sd:
            left = _check_int("state_dict['_hysteresis_left']", sd["_hysteresis_left"], 1)
        else:  # (torch's dict: the count this scaler holds, as for every key torch's lacks; within the hysteresis)
            held = self._hysteresis_left
            left = min(int(held.item()) if held is not None else self._init_hysteresis_left, hysteresis)
        if left > hysteresis:
            raise ValueError(f"state_dict['_hysteresis_left'] ({left}) must not exceed hysteresis ({hysteresis})")
        min_scale = _check_clamp("state_dict['min_scale']", sd.get("min_scale", self._min_scale))
        max_scale = _check_clamp("state_dict['max_scale']", sd.get("max_scale", self._max_scale))
        if min_scale is not None and max_scale is not None and min_scale > max_scale:
            raise ValueError(f"state_dict['min_scale'] ({min_scale}) exceeds state_dict['max_scale'] ({max_scale})")
        dynamic = sd.get("dynamic", self._dynamic)
        if not isinstance(dynamic, bool):
            raise ValueError(f"state_dict['dynamic'] must be a bool, got {dynamic!r}")
        skipped = _check_int("state_dict['_skipped_steps']", sd.get("_skipped_steps", self.skipped_steps), 0,
                             2**63 - 1, "2**63 - 1")
        if dynamic:  # the clamps as the update applies them (in float32), applied to a scale outside them
            lo = 0.0 if min_scale is None else torch.tensor(min_scale, dtype=torch.float32).item()
            hi = math.inf if max_scale is None else torch.tensor(max_scale, dtype=torch.float32).item()
            if not lo <= sd["scale"] <= hi:
                # (a torch scaler's dict under this scaler's clamps, or update(new_scale) past them, which torch's
                # API allows: loaded as is, the next backoff raised the scale to min_scale, or a growth cut it)
                clamped = min(max(sd["scale"], lo), hi)
                warnings.warn(f"state_dict['scale'] ({sd['scale']}) lies outside [min_scale, max_scale] = "
                              f"[{min_scale}, {max_scale}]: loaded as {clamped}", UserWarning, stacklevel=2)
                sd["scale"] = clamped
        # every value is valid: write
        super().load_state_dict(sd)
        self._hysteresis, self._init_hysteresis_left = hysteresis, left
        self._min_scale = None if min_scale is None else float(min_scale)
        self._max_scale = None if max_scale is None else float(max_scale)
        self._dynamic, self._init_skipped_steps = dynamic, skipped
        if self._scale is not None:
            self._device_extras()  # 1 / the loaded scale
            self._hysteresis_left.fill_(left)
            self._skipped_steps.fill_(skipped)

    def __getstate__(self) -> dict:
        state = super().__getstate__()  # torch's rule: only between iterations; tensors rebuilt lazily
        if self._enabled:
            state["_init_hysteresis_left"] = self.state_dict()["_hysteresis_left"]
            state["_init_skipped_steps"] = self.skipped_steps
        for key in ("_inv_scale", "_inv_of", "_hysteresis_left", "_skipped_steps", "_last_found_inf"):
            state[key] = None
        state["_counters"] = {}
        return state
