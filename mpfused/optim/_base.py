"""The shared base of the fused optimizers: param bucketing by device, lazy state with FP32 master weights,
the scaler interface (``StepScaling``, and torch.amp.GradScaler's protocol), and a state-dict loader that
keeps FP32 state FP32.

A new optimizer is a subclass naming its kernel policy (csrc/core/optim/) and defining four small methods;
see ``FusedOptimizer``."""

from __future__ import annotations

import functools
import math
import numbers
import sys
import threading
import warnings
from collections import defaultdict
from copy import deepcopy
from dataclasses import dataclass, field
from itertools import chain, compress, repeat
from operator import is_, is_not
from typing import Any, Callable, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary
from torch.optim import Optimizer
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from .. import _dist, _ops
from .._layout import is_dense, layouts_match, like, same_layout

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MASTER_WEIGHTS = (None, True, False, "remainder")
ROUNDINGS = ("nearest", "stochastic")
_POLICY_STATES = {name: tuple(spec["states"]) for name, spec in _ops.optim_policies().items()}


def _is_real(value) -> bool:
    # Python and numpy scalars (numpy registers its number types with numbers), not bools (numpy's bool is
    # not a numbers.Real).
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_lr(lr, where: str = "", read_device: bool = True, read_cpu: bool = True) -> None:
    """torch's checks and texts: a tensor lr must have one element; its value, or a number, must be >= 0
    (and finite). A tensor's value is read as check_scalar_or_tensor says: a device tensor's only where
    ``read_device`` (construction, add_param_group: torch reads it there too), a CPU tensor's unless
    ``read_cpu`` is False (a capturable step) or under torch.compile."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element" + where)
        if not lr.is_floating_point():
            raise ValueError(f"Invalid learning rate: a tensor lr must be floating point, got {lr.dtype}{where}")
        if lr.device.type not in ("cpu", "cuda"):  # (torch fails reading a meta lr's value at construction)
            raise ValueError(f"Invalid learning rate: a tensor lr must be on the CPU or on the params' CUDA device, "
                             f"got one on {lr.device.type}{where}")
        cpu = lr.device.type == "cpu"
        if (not cpu and not read_device) or (cpu and (not read_cpu or torch.compiler.is_compiling())):
            return
        lr = lr.item()
    check_number("learning rate", lr, where=where)


def check_number(name: str, value, lo: float = 0.0, hi: float = math.inf, hi_open: bool = False,
                 where: str = "") -> None:
    """torch's ``Invalid <name>: <value>`` for a number outside [lo, hi] (or [lo, hi)), NaN included, and
    (stricter than torch, which would step into NaN weights) for an infinite one."""
    kind = type(value)
    if kind is not float and kind is not int and not _is_real(value):  # (the exact builtins first: step() checks
        raise ValueError(f"Invalid {name}: {value!r} (expected a number, got {type(value).__name__}){where}")  # these)
    if torch.compiler.is_compiling():
        # A float that changes between compiled steps (a scheduled lr) is symbolic there: compared as it is
        # (float() would make it a constant, one compile per value), the comparisons become the compiled
        # step's guards, and a value out of range fails them and raises here. (The operator sees such a
        # value as a float64 tensor, whose value it reads on the device, unchecked: _ops._traced_floats.)
        if not (value >= lo and value <= hi and value < math.inf) or (hi_open and value == hi):
            raise ValueError(f"Invalid {name}: {value}{where}")
        return
    try:
        v = float(value)
    except OverflowError:  # (an int beyond any float, such as 10**400)
        raise ValueError(f"Invalid {name}: an int too large for a float{where}") from None
    if not math.isfinite(v) or not (lo <= v <= hi) or (hi_open and v == hi):
        raise ValueError(f"Invalid {name}: {value}{where}")


def check_scalar_or_tensor(name: str, value, lo: float = 0.0, hi: float = math.inf, hi_open: bool = False,
                           where: str = "", read_device: bool = True, read_cpu: bool = True) -> None:
    """A hyperparameter that may also be a one-element tensor (betas, SGD's weight_decay), on the CPU or on
    the params' device (the update reads it there: no host sync in step()). A device tensor's value is read
    only when ``read_device`` (at construction and in add_param_group, where torch reads it too), never in
    step(). A CPU tensor's is read every time (no sync), except where ``read_cpu`` is False (a capturable
    step reads no tensor) and under torch.compile: there the operator checks a CPU tensor's value, before
    it writes anything."""
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
        if value.device.type == "cpu" and (not read_cpu or torch.compiler.is_compiling()):
            return
        value = value.item()
    check_number(f"{name} value" if not name.startswith("beta") else name, value, lo, hi, hi_open, where)


def switch(name: str, value) -> bool:
    """A constructor's switch (maximize, amsgrad, nesterov, ...) as a bool, checked as check_flags checks a
    group's: bool() would take any object, and maximize="no" would maximize. None is False (torch's
    optimizers read the switch as a truth value)."""
    if value is None:
        return False
    check_flags({name: value}, (name,))
    return bool(value)


def check_flags(group: dict, names: tuple, where: str = "") -> None:
    """The switches of a param group (maximize, amsgrad, nesterov, ...): True or False (0 and 1 too). A
    param group is a plain dict that code may edit between steps; anything else would reach the kernel's
    own check, after the groups before it were stepped."""
    for name in names:
        value = group[name]
        if not _ops.is_switch(value):
            raise ValueError(f"Invalid {name}: expected True or False, got {value!r}{where}")


def check_betas(betas, where: str = "", hi_open: bool = True, tensors: bool = False, read_device: bool = True,
                read_cpu: bool = True, pair_rule: bool = True) -> None:
    """A pair of betas in [0, 1) ([0, 1] without ``hi_open``), torch's texts. ``tensors``: each may be a
    one-element tensor, as torch's Adam allows; see check_scalar_or_tensor. ``pair_rule``: both or neither,
    torch's rule at construction (a scheduler that cycles momentum, OneCycleLR, later writes a float
    beside a tensor; torch steps on with that, and so does the kernel, which takes each on its own)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas: expected a pair, got {betas!r}{where}")
    for i, b in enumerate(betas):
        if tensors:
            check_scalar_or_tensor(f"beta parameter at index {i}", b, 0.0, 1.0, hi_open=hi_open, where=where,
                                   read_device=read_device, read_cpu=read_cpu)
        else:
            check_number(f"beta parameter at index {i}", b, 0.0, 1.0, hi_open=hi_open, where=where)
    if tensors and pair_rule and isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
        raise ValueError(f"betas must be either both floats or both Tensors{where}")


def check_precision(group: dict, where: str = "") -> None:
    """The precision keys of a param group (or of an optimizer's defaults), in one place: ``master_weights``
    (None, True, False or "remainder"), ``rounding`` ("nearest" or "stochastic") and ``seed`` (None or an
    int in [0, 2**64)); a ValueError naming the key otherwise, and for rounding="stochastic" with
    master_weights="remainder" (that param is the master rounded to nearest: see FusedOptimizer)."""
    mw = group.get("master_weights")
    if not any(mw is v for v in (None, True, False)) and not (isinstance(mw, str) and mw == "remainder"):
        raise ValueError(f"Invalid master_weights: expected None, True, False or 'remainder', got {mw!r}{where}")
    rounding = group.get("rounding", "nearest")
    if not (isinstance(rounding, str) and rounding in ROUNDINGS):
        raise ValueError(f"Invalid rounding: expected 'nearest' or 'stochastic', got {rounding!r}{where}")
    seed = group.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
                             or not 0 <= int(seed) < 2**64):
        raise ValueError(f"Invalid seed: expected None or an int in [0, 2**64), got {seed!r}{where}")
    if seed is not None and type(seed) is not int:
        # a numpy integer kept in the group would make the state_dict unloadable by torch.load's default
        # weights_only unpickler
        group["seed"] = int(seed)
    if rounding == "stochastic" and mw == "remainder":
        raise ValueError("Invalid rounding: rounding='stochastic' cannot be combined with master_weights='remainder' "
                         f"(the param is then the high half of its master, rounded to nearest){where}")


def check_remainder_dtype(group: dict, where: str, i: int, p: torch.Tensor) -> None:
    """master_weights='remainder' keeps the low 16 bits of a BF16 param's FP32 master: other dtypes raise."""
    if group.get("master_weights") == "remainder" and p.dtype != torch.bfloat16:
        raise ValueError(f"Invalid master_weights: 'remainder' needs bfloat16 params (the master is the param's 16 "
                         f"bits and 16 more), but param {i}{where} is {p.dtype}; use master_weights=True for "
                         "float16 params (float32 params need no master)")


def draw_seed() -> int:
    """A 64-bit seed from torch's default CPU generator (two 32-bit draws): reproducible under
    torch.manual_seed."""
    lo, hi = torch.randint(0, 2**32, (2,), dtype=torch.int64).tolist()
    return lo | hi << 32


_META = torch.device("meta")


def copy_to(t: torch.Tensor, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """t on ``device`` (and in ``dtype``): asynchronous towards an accelerator (no host sync), a finished
    copy towards the CPU (a non-blocking device-to-host copy may not have landed when the CPU kernels or
    the host read it)."""
    if t.device == device and (dtype is None or t.dtype == dtype):
        return t  # (what .to() returns too; this is the common case, at a tenth of its cost)
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


def check_capturable(group: dict, params: list, scaling: "StepScaling", where: str) -> None:
    """capturable=True: every tensor the step reads (lr, tensor hyperparameters, the scaler's values) must
    already be on its params' device. A copy from the host inside a CUDA-graph capture is not allowed (and
    a copy to the host would sync), so a capturable step never makes one: a ValueError naming the value
    instead, raised before anything is written."""
    devices = {p.device for p in params}
    values = [(k, v) for k, v in group.items() if k != "params"]
    values += [(f"scaling.{k}", getattr(scaling, k)) for k in ("inv_scale", "grad_scale", "found_inf")]
    if scaling.clip is not None:
        values.append(("scaling.clip sumsq", scaling.clip[0]))
    for name, value in values:
        for i, t in enumerate(value if isinstance(value, (tuple, list)) else (value,)):
            if isinstance(t, torch.Tensor) and any(t.device != d for d in devices):
                label = name if not isinstance(value, (tuple, list)) else f"{name}[{i}]"
                raise ValueError(f"capturable=True: {label} is on {t.device} but the params are on "
                                 f"{', '.join(sorted(str(d) for d in devices))}; a capturable step reads every value "
                                 f"on the params' device (move it there, e.g. torch.tensor(..., device=...)){where}")


def join_master(p: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The FP32 master of a BF16 param and its int16 remainder: bits (param << 16) + remainder, in p's
    layout (used when a group leaves master_weights='remainder' for FP32 masters). DTensors: shard by shard."""
    if _dist.is_dtensor(p):
        shard = join_master(_dist.local(p), _dist.local(remainder))
        return type(p).from_local(shard, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    hi = p.detach().view(torch.int16).to(torch.int64) & 0xFFFF
    bits = ((hi << 16) + remainder.to(torch.int64)) & 0xFFFFFFFF
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    return like(bits.view(torch.float32), p, torch.float32)


def split_master(m: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The BF16 param and int16 remainder that hold FP32 masters ``m`` exactly, in p's layout: join_master's
    inverse (core/master_split.h: the param is m rounded to nearest with ties away from zero on the bit
    pattern, so that the difference fits 16 bits; a NaN master gives the param 0x7FC0 and the remainder 0)."""
    u = m.detach().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    hi = ((u + 0x8000) >> 16) & 0xFFFF
    lo = u - (hi << 16)  # in [-0x8000, 0x7FFF] for every non-NaN pattern
    nan = m.detach().isnan()
    hi = torch.where(nan, 0x7FC0, hi)
    lo = torch.where(nan, 0, lo)
    hi16 = torch.where(hi >= 0x8000, hi - 0x10000, hi).to(torch.int16).view(torch.bfloat16)
    return like(hi16, p, torch.bfloat16), like(lo.to(torch.int16), p, torch.int16)


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _memory_spans(params, gi: int) -> list:
    """((device, storage address), (first byte, end byte, gi, i)) of each param of ``params`` (group ``gi``)
    that a step could write: a plain dense strided tensor that holds memory, frozen or not (it may be
    unfrozen later); the bytes its elements span in its storage (FusedOptimizer._check_no_overlap). (A
    sparse, non-dense or meta one is refused by the step itself.)"""
    out = []
    for i, p in enumerate(params):
        if (not isinstance(p, torch.Tensor) or not is_plain_tensor(p) or p.numel() == 0 or p.layout != torch.strided
                or p.is_nested or p.device.type == "meta" or not is_dense(p)):
            continue
        lo = hi = p.storage_offset()
        for size, stride in zip(p.shape, p.stride()):
            if stride >= 0:
                hi += (size - 1) * stride
            else:
                lo += (size - 1) * stride
        size = p.element_size()
        out.append(((p.device, p.untyped_storage().data_ptr()), (lo * size, (hi + 1) * size, gi, i)))
    return out


def _same(t):
    return t


def _address(p) -> Optional[tuple]:
    """Where a param's memory starts and how many elements it holds (FusedOptimizer._check_memory_disjoint),
    None where it has none a step could write (a subclass such as DTensor, a sparse or meta tensor: see
    _memory_spans)."""
    if (type(p) is torch.nn.Parameter or type(p) is torch.Tensor) and p.layout == torch.strided and not p.is_meta:
        return p.data_ptr(), p.numel()
    return None


def is_plain_tensor(t: torch.Tensor) -> bool:
    return type(t) in _PLAIN_TYPES


@dataclass(frozen=True)
class StepScaling:
    """What a gradient scaler hands to :meth:`FusedOptimizer.step` (``step(scaling=...)``), all on the
    device, so that the step unscales, clips and skips in its own pass with no host sync.

    - ``inv_scale``: one-element float32 tensor; gradients are multiplied by it. Or ``grad_scale``: the loss
      scale S itself (torch.amp.GradScaler's form); gradients are multiplied by float(1 / S), computed on
      the device in double. At most one of the two.
    - ``found_inf``: one-element tensor; != 0 skips the whole step (nothing is written, step counts
      included).
    - ``clip``: ``(sumsq, max_norm)``: the sum of squares of the unscaled gradients of the whole step (a
      one-element float32 tensor) and the norm to clip to; the gradients are multiplied by
      ``min(1, max_norm / (sqrt(sumsq) + 1e-6))``, as torch.nn.utils.clip_grad_norm_.

    A step given any of these leaves in ``p.grad`` the gradient it used (unscaled and clipped), as torch's
    fused optimizers do; a skipped step leaves the gradients as they were.
    """

    inv_scale: Optional[torch.Tensor] = None
    grad_scale: Optional[torch.Tensor] = None
    found_inf: Optional[torch.Tensor] = None
    clip: Optional[tuple] = None

    def __post_init__(self) -> None:
        if self.inv_scale is not None and self.grad_scale is not None:
            raise ValueError("StepScaling takes inv_scale or grad_scale, not both")
        for name in ("inv_scale", "grad_scale", "found_inf"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.Tensor) and value.numel() == 1):
                raise TypeError(f"StepScaling.{name} must be a one-element tensor or None, got {value!r}")
        if self.clip is not None:
            ok = (isinstance(self.clip, tuple) and len(self.clip) == 2 and isinstance(self.clip[0], torch.Tensor)
                  and self.clip[0].numel() == 1 and _is_real(self.clip[1]) and float(self.clip[1]) >= 0)
            if not ok:
                raise TypeError(f"StepScaling.clip must be (sumsq: one-element tensor, max_norm: number >= 0), "
                                f"got {self.clip!r}")


_NO_SCALING = StepScaling()
_NO_STATE: dict = {}  # read-only: the state of a param that keeps none


class _Same:
    """A group value compared by identity in a plan's signature (no ``==`` on arbitrary objects); holding
    it keeps its id from being reused."""

    __slots__ = ("value",)

    def __init__(self, value) -> None:
        self.value = value

    def __eq__(self, other) -> bool:
        return isinstance(other, _Same) and other.value is self.value

    __hash__ = None


def _plan_value(value):
    """What of a group value decides the structure of a step (see _StepPlan.signature), tagged with its
    kind so that no two kinds compare equal (False == 0 == 0.0 in Python): a real number other than an
    integer only by whether it is zero (a scheduled lr changes every step; a momentum of 0 keeps no
    buffer), a tensor by being one (the update reads its value), a sequence element by element, a bool,
    int (numpy's integers too: a seed the plan packs) or str by its value, anything else by identity."""
    kind = type(value)
    if kind is float:
        return "real", value == 0
    if isinstance(value, (bool, int, str)) or value is None:
        return kind, value
    if isinstance(value, numbers.Integral):  # numpy's integers: by value, as a seed must be (the plan packs it)
        return "integral", int(value)
    if isinstance(value, numbers.Real):
        return "real", bool(value == 0)
    if isinstance(value, torch.Tensor):
        return torch.Tensor
    if isinstance(value, (tuple, list)):
        return type(value), tuple(map(_plan_value, value))
    return _Same(value)


# Types whose values cannot change in place: a group value of one of these (or a tuple of them) that is the
# same object as at the last step needs no new check (see _GroupPlan.frozen).
_IMMUTABLE = (float, int, bool, str, type(None))


def _frozen(value) -> bool:
    kind = type(value)
    return kind in _IMMUTABLE or (kind is tuple and all(type(v) in _IMMUTABLE for v in value))


# The group keys that are not values (the plan compares the params themselves).
_NOT_VALUES = ("params", "param_names")

# The state entries a kernel call reads, per param: the policy's states, then these.
_PRECISION_KEYS = ("master_param", "master_remainder", "step")


_ENTRY_NAMES = {policy: states + _PRECISION_KEYS for policy, states in _POLICY_STATES.items()}


def _kernel_entries(policy: str, states: list) -> list:
    """Per state key the kernel call reads (the policy's states, then _PRECISION_KEYS: _ENTRY_NAMES), the
    list of each param's entry (None where it has none): what a plan compares by identity (_C.same_entries)
    and _fused_step passes on."""
    if any(map(is_, states, repeat(None))):  # a param without state (SGD without momentum), from a plan
        states = [_NO_STATE if s is None else s for s in states]
    return [[s.get(name) for s in states] for name in _ENTRY_NAMES[policy]]


def _step_layout(params: list, grads: list, entries: list) -> Optional[bytes]:
    """_C.step_layout of params, their grads and their _kernel_entries (moments and masters beside the
    params, remainders, step counters)."""
    return _ops._C.step_layout(params, grads, entries[:-2], entries[-2], entries[-1])


def _step_versions(params: list, entries: list, memory: Optional[list] = None) -> bytes:
    """_C.step_versions: the version counters and data pointers of the plain params with a master or a
    remainder (the entries' last two lists before the step counters): a write from outside the step moves
    one, and the step then makes the masters follow it (_follow_writes' rules; the planned step in
    _StepPlan._moved, the full path in _follow_writes).
    DTensor params: ``memory`` holds their local shards (the counters are the DTensors', the memory the
    shards')."""
    return _ops._C.step_versions(params, entries[-3], entries[-2], memory)


def _followed(params: list, states: list, stochastic: bool) -> tuple:
    """(param, master, remainder, stochastic) of the plain and DTensor params among ``params`` that keep an
    FP32 master or a BF16 remainder (see _follow_writes; a DTensor's ``states`` hold its shards)."""
    out = []
    for p, st in zip(params, states):
        if st and (type(p) is torch.Tensor or type(p) is torch.nn.Parameter or _dist.is_dtensor(p)):
            master, remainder = st.get("master_param"), st.get("master_remainder")
            if master is not None or remainder is not None:
                out.append((p, master, remainder, stochastic))
    return tuple(out)


def _seen_key(master, remainder) -> torch.Tensor:
    """What _follow_writes notes a param's count under: its master (or remainder), held weakly: a weak
    reference to the param itself would make torch.utils.swap_tensors refuse it (module.to() and
    load_state_dict under torch.__future__.set_swap_module_params_on_conversion(True)), and a new master
    (a loaded state) is a param not yet seen."""
    return master if master is not None else remainder


def _seen_value(p: torch.Tensor) -> tuple:
    """A param's version counter and its memory: a swap_tensors or a ``p.data = ...`` gives it another
    TensorImpl or storage, whose counter may hold any count. A DTensor: its own counter (a write through it
    moves that one, not its shard's) and its shard's memory."""
    return p._version, _dist.local(p).data_ptr()


def _follow_writes(followed: tuple, seen) -> None:
    """Where code outside the step wrote a param that keeps an FP32 master (``model.load_state_dict``, an
    ``init_`` or a ``clamp_`` under no_grad, a broadcast), the elements it changed keep what was written:
    their master takes the param's value, as with torch's optimizers, where the param is the weight.
    Without it the step would compute from the stale master and write over the edit.

    Which params to look at: those whose version counter moved since the last step saw them (every in-place
    op on a param moves it; the step's kernel does too, and the step then records the new count), or that it
    never saw (masters made before the params were loaded; a loaded optimizer state). Which elements: those where the param is no longer what
    the step wrote from the master, its rounding (to nearest; with stochastic rounding, one of the master's
    two neighbours in the param's dtype, or infinity where the master lies beyond the largest finite
    value). So a write that changes nothing (an EMA swapped in and back, an Embedding's max_norm renorm
    that clips no row, a compiled step's copy-back) and the elements a write left alone keep their masters'
    low bits. With stochastic rounding a write that lands on one of the master's two neighbours (a clamp_
    to a bound less than a step below the master) looks like the step's own rounding and is not followed.
    Not seen: in-place writes through ``.data`` (a tensor with a version counter of its own; an assignment
    ``p.data = t`` is seen, by the param's memory), and subclass params other than DTensors (FSDP1's flat
    params). A DTensor (FSDP2) is followed by its local shard, which a write through the DTensor changes.

    A BF16 remainder: the param's bits are the master's high half, so a written value stands, with the old
    low bits (less than half a step of BF16) below it; except where those would make the master a NaN: a
    negative remainder below a written 0 (of either sign: the bits wrap), a positive one below an inf. Those
    remainders become 0. (A negative one below an inf is a real split: a master within half a step of
    2^128, which the kernel writes as inf; a positive one below a 0, a master below 2^-133.)

    The full path calls this, after every check and before the kernels; the planned path follows the params
    whose counters moved since its last step itself (_StepPlan._moved, the same operator). The rules are applied by
    one pass over each moved param and its master or remainder (``torch.ops.mpfused.follow_writes_``,
    csrc/core/follow.h; one launch per 512 tensors on CUDA, no read on the host), which writes a block of masters only
    where one of its elements changes."""
    params, targets, moved, stochastic = [], [], [], False
    for p, master, remainder, stoch in followed:
        key, v = _seen_key(master, remainder), _seen_value(p)
        if seen.get(key) == v:
            continue
        moved.append((key, v))
        q = _dist.local(p).detach()
        for target in (remainder, master):
            if target is not None:
                params.append(q)
                targets.append(target)
        stochastic = stoch  # (one group's params: one rounding)
    if params:
        _ops.follow_writes_(params, targets, stochastic)
    for key, v in moved:  # (noted once followed: a call that raised leaves them to the next step)
        seen[key] = v


@dataclass
class _GroupPlan:
    group: dict
    params: tuple  # the group's params when the plan was made
    signature: tuple  # _StepPlan.signature(group), in the group's key order
    mask: Optional[tuple]  # which params had a grad; None: all of them
    layout: bytes  # _C.step_layout of the params with a grad (of their local shards: DTensors)
    states: list  # their entries in the optimizer's state (None where none)
    entries: list  # _kernel_entries of those states after the step
    local_entries: Optional[list]  # DTensors: the entries' local shards (what the kernel call takes)
    layout_entries: list  # those the kernel call checks (a state the step does not use: None), for step_layout
    device: Optional[torch.device]
    call: Optional[_ops.OptimCall]  # the kernel call's arguments that the plan fixes (None: no param has a grad)
    # The group's keys and values when they were last checked, and whether every value is of a type that
    # cannot change in place (_frozen): then the same objects need no new check.
    keys: tuple
    values: tuple
    frozen: bool
    hyper: Optional[tuple] = None  # call.hyper_args of the checked values, while they are frozen
    # The version counters of the params with masters or remainders (DTensors: their own counters, with their
    # shards' memory) after
    # the last step, full or planned (_step_versions): one that differs now was written from outside the step
    versions: Optional[bytes] = None


# The end of the error for a grad that a scaled or clipped step writes back over memory that it also writes
# (FusedOptimizer._check_state_disjoint on the full path, _StepPlan.check_grads on the planned one).
_GRADS_OVERLAP = ("are over the same memory, and this step unscales or clips each grad in place (a grad shared by "
                  "two params would be unscaled twice, one over a param or state would write its values there); "
                  "give each param a grad of its own (e.g. .clone()), or step without a scaler or clip")


@dataclass
class _StepPlan:
    """What a step fixed for the next one (FusedOptimizer.step's planned path).

    The full path checks every param and grad, makes or mends each param's state (_state_for) and finds
    the stochastic rounding's offsets: per param, several microseconds of Python, which dominate the step
    of a model with many small tensors. What it decides depends only on the groups' structural values
    (master_weights, rounding, seed, amsgrad, whether momentum is zero: ``signature``), on which params have
    a grad, on their dtypes, devices, shapes and strides, and on the state entries it left. A step that
    repeats all of these (the same state dicts holding the same tensors, compared by identity) takes the
    same decisions. Each step still checks every grad and state entry against its param (in C++,
    ``_C.step_layout``: what the operator would refuse, e.g. a state tensor changed in place through
    ``.data``; in ``_C.step_versions``, the version counter and memory of a plain param with an FP32 master
    or a remainder, which a write from outside the step moves: its master then follows the write before the
    kernels, _moved) and every group's values before the first kernel call (a value that is the very object
    last checked, of a type that cannot change in place, needs no new check: a scheduler's new lr is
    checked alone); then it calls the operator from C++ (``_ops.optim_step_direct``) with the arguments
    the plan packed (``_ops.OptimCall``). Anything else takes the full path, which drops the plan first
    and makes a new one when it succeeds. A DTensor group (FSDP2) is planned on its local shards: each grad
    must still be a DTensor on its param's mesh with its placements and shape, and the shards pair as
    plain tensors do; the state DTensors' shards are the plan's while the DTensors are.
    Not planned: a group's params on several devices, a grad that needed a copy, torch.compile tracing.
    """

    state: dict
    groups: list
    numels: Optional[list]  # every param's numel, for the offsets (stochastic rounding, some param without a grad)
    follows: list = field(default_factory=list)  # match()'s: the writes from outside this step to follow (_moved)
    # Where groups make several operator calls: the memory their steps write in place (params and state entries,
    # _C.memory_spans; the layouts hold it while the plan does) and, per owner, (group index, param); a scaled
    # or clipped step checks that no grad is over another grad or over that memory (check_grads).
    written: Optional[bytes] = None
    owners: list = field(default_factory=list)

    @staticmethod
    def signature(group: dict) -> tuple:
        """Per key of the group, in its order, what of its value decides the step's structure (_plan_value;
        None for the params and their names, which the plan compares itself)."""
        return tuple((k, None if k in _NOT_VALUES else _plan_value(v)) for k, v in group.items())

    @classmethod
    def make(cls, opt: "FusedOptimizer", work: list, offsets: Optional[dict]) -> Optional["_StepPlan"]:
        """The plan of the step just taken (``work``: its groups and their params with a grad, checked and
        updated), or None where a group cannot be planned."""
        groups = []
        local = _dist.local
        for group, ps, dtensors in work:
            params = group["params"]
            if type(params) is not list:
                return None
            grads = [p.grad for p in ps]
            lps, lgs = ([local(p) for p in ps], [local(g) for g in grads]) if dtensors else (ps, grads)
            states = list(map(opt.state.get, ps))
            entries = _kernel_entries(opt._policy, states)
            local_entries = [[local(t) for t in tensors] for tensors in entries] if dtensors else None
            device = lps[0].device if ps else None
            hyper = _ops.hyper_args(opt._policy, opt._hyper(group, device)) if ps else None
            # The operator checks only the states the step uses (not SGD's momentum buffer without momentum):
            # neither does the plan, or it would refuse a step the operator takes. Which ones depends only on
            # values in the signature.
            used = _ops._C.optim_state_mask(opt._policy, hyper[0]) if ps else 0
            layout_entries = [tensors if k >= len(_POLICY_STATES[opt._policy]) or used >> k & 1 else [None] * len(lps)
                              for k, tensors in enumerate(local_entries or entries)]
            if any(t is not None and not is_plain_tensor(t) for unused, tensors in zip(layout_entries, local_entries or entries)
                   if unused is not tensors for t in tensors):
                return None  # (an unused state that is a subclass: torch.ops hands it the call, the full path's)
            layout = _step_layout(lps, lgs, layout_entries)
            if layout is None:
                return None
            versions = _step_versions(ps, layout_entries, lps) if dtensors else _step_versions(lps, layout_entries)
            versions = versions or None  # (empty: no param with a master or a remainder, nothing to compare)
            mask = None if len(ps) == len(params) else tuple(p.grad is not None for p in params)
            # (the offsets are keyed by the tensor the kernel call sees: a DTensor's local shard)
            sr = ([_ops.u64_arg(offsets[id(p)], "sr_offsets") for p in lps]
                  if offsets is not None and group.get("rounding") == "stochastic" else None)
            call = opt._optim_call(group, lps, local_entries or entries, sr) if ps else None
            values = tuple(group.values())
            frozen = all(_frozen(v) for k, v in zip(group, values) if k not in _NOT_VALUES)
            groups.append(_GroupPlan(group, tuple(params), cls.signature(group), mask, layout, states, entries,
                                     local_entries, layout_entries, device, call, tuple(group), values, frozen,
                                     hyper if frozen else None, versions))
        # The offsets count every param's elements; where every param had a grad, the layouts already hold
        # their shapes (and a param without a grad now fails the mask): no numels to compare. (Not for
        # DTensors: their layouts hold the local shards' shapes, their offsets come from the global ones.)
        numels = None if offsets is None or all(g.mask is None and g.local_entries is None for g in groups) else \
            [p.numel() for g in opt.param_groups for p in g["params"]]
        plan = cls(opt.state, groups, numels)
        if sum(1 for g in groups if g.call is not None) > 1:
            tensors, owner_of = [], []
            for gi, ((group, ps, dtensors), gp) in enumerate(zip(work, groups)):
                lps = [local(p) for p in ps] if dtensors else ps
                for j, p in enumerate(ps):
                    owner = len(plan.owners)
                    plan.owners.append((gi, p))
                    tensors.append(lps[j])
                    owner_of.append(owner)
                    for entries in gp.layout_entries:
                        tensors.append(entries[j])
                        owner_of.append(owner)
            plan.written = _ops._C.memory_spans(tensors, owner_of)
        return plan

    def check_grads(self, grads: list) -> None:
        """No grad of this step (``grads``: each group's, the kernels' tensors) over another grad or over what the
        step writes in place (``written``): FusedOptimizer._check_state_disjoint's rule for the grads, on the planned
        path. A ValueError naming both, before anything is written."""
        flat = [g for gs in grads for g in gs]
        found = _ops._C.shared_grads(flat, self.written)
        if found is None:
            return

        def name(k: int, what: str) -> str:
            gi, p = self.owners[k]
            i = next(j for j, q in enumerate(self.groups[gi].group["params"]) if q is p)
            return f"{what} {i} of param group {gi}"

        # (the grads are in the owners' order: the plan's params with a grad, group by group)
        first = name(found[0], "the grad of param")
        second = name(found[1], "the grad of param" if found[2] == 0 else "param")
        raise ValueError(f"{first} and {second}{'' if found[2] == 0 else ' (or its state)'} {_GRADS_OVERLAP}")

    def match(self, opt: "FusedOptimizer") -> Optional[list]:
        """Per group, when this step repeats the plan's (else None): (the group, its _GroupPlan, its params
        with a grad, their local shards for a DTensor group (else None), the grads the kernel call takes
        (local shards for DTensors), ``changed``, the group's values). ``changed``: None where every value
        is the object last checked, () where only the params list or their names are other objects,
        ("lr",) where only the lr is, else all the group's keys (every value is checked)."""
        if opt.state is not self.state or len(opt.param_groups) != len(self.groups):
            return None
        state_get = opt.state.get
        calls = []
        self.follows = []  # (params, targets, stochastic) that code outside the step wrote: followed before the kernels
        for group, gp in zip(opt.param_groups, self.groups):
            params = group["params"]
            if (group is not gp.group or type(params) is not list or len(params) != len(gp.params)
                    or not all(map(is_, params, gp.params))):
                return None
            # The group's values: the same objects as last checked need neither a check nor a new signature
            # when none can change in place; a scheduler's new lr, only its own.
            values = tuple(group.values())
            keys = tuple(group)
            if keys != gp.keys or len(values) != len(gp.values):
                return None  # (a key added or removed: another signature)
            changed = None
            if not gp.frozen:
                changed = keys
            elif not all(map(is_, values, gp.values)):
                changed = ()  # (the params list or their names replaced: no value to check)
                for k, now, then in zip(keys, values, gp.values):
                    if now is not then and k not in _NOT_VALUES:
                        changed = ("lr",) if not changed and k == "lr" else keys
            if changed is keys:
                if self.signature(group) != gp.signature:
                    return None
            elif changed and _plan_value(group["lr"]) != gp.signature[keys.index("lr")][1]:
                return None
            grads = [p.grad for p in params]
            if gp.mask is None:
                kps, kgrads = params, grads  # (a grad that is None now fails step_layout)
            else:
                if tuple(map(is_not, grads, repeat(None))) != gp.mask:
                    return None
                kps, kgrads = list(compress(params, gp.mask)), list(compress(grads, gp.mask))
            lps, lgs = kps, kgrads
            if gp.local_entries is not None:  # DTensors: what _dtensor_ok asks of them, then their shards
                for p, g in zip(kps, kgrads):
                    if (type(g) is not type(p) or g.device_mesh is not p.device_mesh or g.placements != p.placements
                            or g.shape != p.shape):
                        return None
                local = _dist.local
                lps, lgs = [local(p) for p in kps], [local(g) for g in kgrads]
            states = list(map(state_get, kps))
            if not all(map(is_, states, gp.states)) or not _ops._C.same_entries(states, _ENTRY_NAMES[opt._policy],
                                                                                 gp.entries):
                return None  # an entry replaced, deleted or set to None: the full path mends it
            # (an entry changed in place, e.g. through .data, fails here: the full path mends it too)
            if _step_layout(lps, lgs, gp.layout_entries) != gp.layout:
                return None
            if gp.versions is not None:
                now = _step_versions(kps, gp.layout_entries, lps if lps is not kps else None)
                if now != gp.versions:
                    # Params written from outside the step (a clamp_, an Embedding's max_norm renorm every step): their
                    # memory is the plan's (step_layout), only their counters moved. Their masters follow the writes
                    # (_follow_writes' rules, one pass) before this step's kernels, and the plan holds.
                    moved = self._moved(gp, lps, now, group.get("rounding") == "stochastic")
                    if moved is None:
                        return None
                    self.follows.append(moved)
            calls.append((group, gp, kps, lps if gp.local_entries is not None else None, lgs, changed, values))
        if self.numels is not None and [p.numel() for g in opt.param_groups for p in g["params"]] != self.numels:
            return None
        return calls

    @staticmethod
    def _moved(gp: "_GroupPlan", lps: list, now: bytes, stochastic: bool) -> Optional[tuple]:
        """(params, targets, stochastic) for follow_writes_: the params (local shards) of a group whose version
        counters moved since the plan's last step (``now`` against ``gp.versions``: a (counter, memory) pair of
        int64 per param with a master or a remainder, in order), with their masters and remainders. None where
        the pairs do not line up (the full path then looks)."""
        if len(now) != len(gp.versions):
            return None
        masters, remainders = gp.layout_entries[-3], gp.layout_entries[-2]
        params, targets = [], []
        j = 0
        for q, master, remainder in zip(lps, masters, remainders):
            if master is None and remainder is None:
                continue
            if now[16 * j:16 * j + 16] != gp.versions[16 * j:16 * j + 16]:
                for target in (remainder, master):
                    if target is not None:
                        params.append(q.detach())
                        targets.append(target)
            j += 1
        return params, targets, stochastic


# The profiler range around step() and zero_grad() (see FusedOptimizer.profile_hook_step).
# torch.autograd.profiler.record_function, which torch's optimizers use, enters and leaves through two
# torch.ops calls: 11 µs, and 16 µs around a step that calls an operator (torch 2.13, 2-core VM), a quarter
# of a one-tensor step. So it is used where someone records it: torch's profiler is on (then the range is
# torch's user annotation, exactly), or torch's CUPTI monitor runs (it takes record_function's ranges
# without the profiler). Otherwise the range is torch's C++ record (~0.5 µs), which the RecordFunction
# observers that run without the profiler (an execution-trace observer) still see. Under torch.compile:
# torch's own wrapper (dynamo knows record_function).
_RecordFunctionFast = getattr(getattr(torch._C, "_profiler", None), "_RecordFunctionFast", None)
_profiler_enabled = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)
_disable_dynamo = getattr(torch, "_disable_dynamo", lambda fn: fn)


def _profiler_range(name: str):
    if _RecordFunctionFast is None or _profiler_enabled is None or _profiler_enabled() or _cupti_monitor_on() \
            or torch.compiler.is_compiling():
        return torch.autograd.profiler.record_function(name)
    return _RecordFunctionFast(name)


def _cupti_monitor_on() -> bool:
    monitor = sys.modules.get("torch.profiler._cupti_monitor")
    return monitor is not None and getattr(monitor, "_monitor_singleton", None) is not None


# The (thread, optimizer) pairs inside a step() wrapper (FusedOptimizer.profile_hook_step).
_IN_STEP: set = set()
_NO_ARG = object()  # (a keyword argument not given)


class FusedOptimizer(Optimizer):
    """Base of the fused optimizers (FusedAdam, FusedAdamW, FusedSGD, FusedLAMB, FusedLion): one fused
    kernel per device and param group applies the policy ``_policy`` (csrc/core/optim/) to every param.

    A subclass sets ``_policy`` (a name in ``mpfused._ops.optim_policies()``), its state tensors keyed by
    the policy's state names, and defines ``_check_group`` (hyperparameters, torch's error texts),
    ``_init_state``/``_complete_state`` (lazy state) and ``_hyper`` (the policy's hyperparameters from a
    group).

    Precision (group keys, checked by ``check_precision``):

    - ``master_weights``: None keeps an FP32 master copy for FP16/BF16 params (never for FP32 ones), True
      the same, False updates low-precision params directly (the math is still FP32). "remainder" (BF16
      params only): ``state['master_remainder']``, an int16 tensor, holds the low 16 bits of the FP32
      master, whose bits are ``(param bits << 16) + remainder``: the update is bit-identical to FP32
      masters at 2 bytes per param instead of 4. The param is then the master rounded to nearest with ties
      away from zero (not ties to even: that would leave a remainder range of 65537 values, one too many
      for int16); a NaN master becomes the param NaN 0x7FC0 with remainder 0. The remainder starts at 0
      (the master starts equal to the param, as an FP32 master does).
    - ``rounding``: how an FP16/BF16 param is written from its FP32 value: "nearest" (ties to even) or
      "stochastic": unbiased, element ``e`` of a param with the Philox bits of index ``offset + e`` of
      stream ``(step, 1)`` under ``seed``, where ``step`` is the param's step count after the step
      (``state['step']``, kept for every param of a stochastic group, also by optimizers that need none)
      and ``offset`` the param's start in the flat order of all params of all groups (stable across
      save/load). It applies wherever such a param is written: the update of a param without a master,
      and the model copy of an FP32 master (the master itself is FP32 and unaffected). FP32 params are
      unaffected. Not with "remainder".
    - ``seed``: an int in [0, 2**64) keying the stochastic rounding, a group key (saved in the state
      dict's param groups). None: the first group with rounding="stochastic" draws one from torch's
      default CPU generator (``draw_seed``; reproducible under torch.manual_seed), shared by all groups
      of the optimizer whose seed is None.

    Scaling: ``step(scaling=StepScaling(...))`` is the explicit interface mpfused.GradScaler uses; torch's
    GradScaler protocol (``_step_supports_amp_scaling``: it sets ``optimizer.grad_scale`` and
    ``optimizer.found_inf`` around ``step()``) works too, so torch.amp.GradScaler drives these optimizers
    as it drives torch's fused ones.
    """

    # torch.amp.GradScaler then hands the scale and found_inf to step() instead of unscaling the grads.
    _step_supports_amp_scaling = True
    _policy: str = ""
    _state_float_keys: tuple[str, ...] = ()
    # Group keys that define the algorithm: kept from this optimizer when a state dict is loaded.
    _class_keys: tuple[str, ...] = ()

    def __init__(self, params, defaults: dict[str, Any]) -> None:
        defaults.setdefault("rounding", "nearest")
        defaults.setdefault("seed", None)
        check_precision(defaults)
        super().__init__(params, defaults)

    # Attributes a copy (deepcopy, pickle, torch.save of the optimizer) keeps beside torch's three (defaults,
    # state, param_groups): the seed drawn for groups with rounding="stochastic" and seed None, which a group
    # added to the copy takes as the original's would.
    _copied_attrs: tuple[str, ...] = ("_mpf_seed",)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        for name in self._copied_attrs:
            if name in self.__dict__:
                state[name] = self.__dict__[name]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.pop("_mpf_plan", None)  # a plan holds the state and groups being replaced
        # the next step compares every param with its (loaded) master again (_follow_writes)
        self.__dict__.pop("_mpf_versions", None)
        self.__dict__.pop("_mpf_spans", None)  # (a copy's params live elsewhere)
        self.__dict__.pop("_mpf_memory", None)
        super().__setstate__(state)

    @staticmethod
    def profile_hook_step(func: Callable) -> Callable:
        """torch's wrapper of an optimizer class's step(), which torch.optim.Optimizer's constructor puts
        around it (once per class, through this name): the global and the optimizer's own step pre-hooks
        (a pre-hook may return new ``(args, kwargs)``), the step, ``_optimizer_step_code`` (where torch's
        profiler looks for the optimizer with Python tracing on), the post-hooks, all inside a profiler
        range named as torch names it, ``Optimizer.step#<class>.step``. The same in eager mode, with the
        range recorded by _profiler_range (torch's wrapper costs 13-16 µs a step, this one ~1), and once
        per call of step() in eager mode: a subclass's step() that calls ``super().step()`` runs the hooks
        once, where torch's run them twice as soon as the parent class has had an instance. torch.compile
        traces torch's own wrapper (so there, as in torch, twice)."""
        traced = Optimizer.profile_hook_step(func)

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            self = args[0]
            if torch.compiler.is_compiling():
                return traced(*args, **kwargs)
            key = (threading.get_ident(), id(self))
            if key in _IN_STEP:  # (inside the wrapper of a subclass's step)
                return func(*args, **kwargs)
            _IN_STEP.add(key)
            # mpfused.GradScaler's hand-over (scaling=) is not the caller's argument: the hooks see what torch's
            # scaler would have passed them (torch's sets attributes on the optimizer instead)
            scaling = kwargs.pop("scaling", _NO_ARG)
            try:
                with _profiler_range(f"Optimizer.step#{type(self).__name__}.step"):
                    if _global_optimizer_pre_hooks or self._optimizer_step_pre_hooks:
                        for pre_hook in chain(_global_optimizer_pre_hooks.values(),
                                              self._optimizer_step_pre_hooks.values()):
                            result = pre_hook(self, args, kwargs)
                            if result is not None:
                                if isinstance(result, tuple) and len(result) == 2:
                                    args, kwargs = result
                                else:
                                    raise RuntimeError(f"{func} must return None or a tuple of (new_args, "
                                                       f"new_kwargs), but got {result}.")
                    # (a pre-hook's new kwargs may hold a scaling of their own: that one is taken)
                    out = func(*args, **(kwargs if scaling is _NO_ARG or "scaling" in kwargs
                                         else dict(kwargs, scaling=scaling)))
                    self._optimizer_step_code()
                    if self._optimizer_step_post_hooks or _global_optimizer_post_hooks:
                        for post_hook in chain(self._optimizer_step_post_hooks.values(),
                                               _global_optimizer_post_hooks.values()):
                            post_hook(self, args, kwargs)
                    return out
            finally:
                _IN_STEP.discard(key)

        return wrapper

    @_disable_dynamo
    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad (grads set to None, or detached and zeroed in place), inside the same profiler
        range as torch's (``Optimizer.zero_grad#<class>.zero_grad``), recorded by _profiler_range."""
        if not set_to_none:
            return super().zero_grad(set_to_none=False)
        if not hasattr(self, "_zero_grad_profile_name"):
            self._patch_step_function()
        with _profiler_range(self._zero_grad_profile_name):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad = None

    def _default_seed(self) -> int:
        """The seed of the groups with rounding='stochastic' and seed None: drawn once per optimizer, from
        this process's torch generator. Under torch.distributed that draw is each rank's own: a warning says
        to give ``seed=`` (replicas and shards must round with one seed; a collective here would hang a rank
        that builds its optimizer alone)."""
        seed = self.__dict__.get("_mpf_seed")
        if seed is None:
            seed = self.__dict__["_mpf_seed"] = draw_seed()
            _dist.warn_drawn_seed()
        return seed

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
            self._check_no_overlap(index)
            self._check_kinds(group, f" (param group {index})")
            # A param the step would refuse (the step checks again: a dtype or requires_grad may change after
            # this); a frozen one of another dtype (a complex rotary table) is the step's to skip
            for i, p in enumerate(group["params"]):
                if p.requires_grad and p.dtype not in SUPPORTED_DTYPES:
                    raise ValueError(f"param {i} of param group {index}: the fused optimizers update float32/float16/"
                                     f"bfloat16 params, got {p.dtype}")
            check_precision(group, f" (param group {index})")
            for i, p in enumerate(group["params"]):
                check_remainder_dtype(group, f" of param group {index}", i, p)
            self._check_group(group, f" (param group {index})")
            if group["rounding"] == "stochastic" and group["seed"] is None:
                group["seed"] = self._default_seed()
        except Exception:
            self.param_groups.pop(index)
            raise

    def _check_no_overlap(self, index: int) -> None:
        """A ValueError where a param of group ``index`` shares memory with another param of this optimizer
        (two Parameter objects over one storage: ``nn.Parameter(other)``, overlapping views). torch's
        optimizers update them one after the other; a fused pass updates both from the same old values, and
        with FP32 masters each keeps a master of its own: the last write would win, and on a GPU the two
        updates would race. Disjoint views of one storage (FSDP1's ``use_orig_params``, a flat buffer) are
        fine. The spans of the groups added before are kept per storage (``_mpf_spans``); one found to
        overlap is measured again before the error, in case its param moved since (``p.data = ...``); the
        spans are rebuilt where the groups before are not those they were taken from (a group removed, or
        added and then refused by a later check)."""
        groups = self.param_groups
        made_from = tuple((id(g), tuple(map(id, g["params"]))) for g in groups[:index])
        cached = self.__dict__.pop("_mpf_spans", None)
        if cached is not None and cached[0] == made_from:
            table = cached[1]
        else:
            table = {}
            for gi in range(index):
                for key, span in _memory_spans(groups[gi]["params"], gi):
                    table.setdefault(key, []).append(span)
        new: dict = {}
        for key, span in _memory_spans(self.param_groups[index]["params"], index):
            new.setdefault(key, []).append(span)
        for key, spans in new.items():
            # in order of first byte: a span overlaps one before it iff it starts before the furthest end so
            # far; a new span is compared with every span before it, an old one with the new ones only
            reach_any = reach_new = None
            for b in sorted(table.get(key, []) + spans):
                a = reach_any if b[2] == index else reach_new
                if a is not None and b[0] < a[1] and self._span_still(a, key) and self._span_still(b, key):
                    if b[2] != index:  # (the new group's param first)
                        a, b = b, a
                    if groups[a[2]]["params"][a[3]] is groups[b[2]]["params"][b[3]]:  # (added to a list by hand)
                        raise ValueError(f"param {b[3]} of param group {b[2]} and param {a[3]} of param group {a[2]} are "
                                         "the same tensor: some parameters appear more than once in the param groups "
                                         "(torch refuses it too); list each param once")
                    raise ValueError(
                        f"param {b[3]} of param group {b[2]} and param {a[3]} of param group {a[2]} are different "
                        "tensors over the same memory (e.g. a weight tied with nn.Parameter(other) or with "
                        "b.data = a.data, or overlapping views); a fused step would update both from the same old "
                        "values: tie the modules by sharing one Parameter object, which the optimizer then updates "
                        "once")
                if reach_any is None or b[1] > reach_any[1]:
                    reach_any = b
                if b[2] == index and (reach_new is None or b[1] > reach_new[1]):
                    reach_new = b
        for key, spans in new.items():
            table.setdefault(key, []).extend(spans)
        self.__dict__["_mpf_spans"] = (made_from + ((id(groups[index]), tuple(map(id, groups[index]["params"]))),), table)

    def _check_memory_disjoint(self) -> None:
        """add_param_group's overlap check (_check_no_overlap) again, over every group, where a param's memory
        moved since it last ran: a param given other memory after it was added (``b.data = a.data``, a weight
        tied late) may now overlap another param, which a fused step would update from the same old values
        (with FP16 masters the last write won, silently; on a GPU the two updates would race). The full path
        runs it first, before anything is written; the planned path compares the params' addresses (its
        layout holds them) and takes the full path where one moved. The addresses, one call a param, are
        compared with those of the last check; where they differ (a first step, ``model.half()``,
        ``model.to()``), the spans are measured again."""
        memory = tuple(map(_address, chain.from_iterable(g["params"] for g in self.param_groups)))
        if memory == self.__dict__.get("_mpf_memory"):
            return
        self.__dict__.pop("_mpf_spans", None)
        for index in range(len(self.param_groups)):
            self._check_no_overlap(index)
        self.__dict__["_mpf_memory"] = memory

    def _span_still(self, span: tuple, key: tuple) -> bool:
        groups = self.param_groups
        gi, i = span[2], span[3]
        if gi >= len(groups) or i >= len(groups[gi]["params"]):
            return False
        now = _memory_spans([groups[gi]["params"][i]], gi)
        return bool(now) and now[0][0] == key and now[0][1][:2] == span[:2]

    # Whether the policy is element-wise (each element's update reads only that element): then a sharded
    # DTensor param's update is its local shard's. LAMB's trust ratio reads whole-param norms: False.
    _elementwise = True

    def _check_kinds(self, group: dict, where: str) -> bool:
        """A group's params are all plain tensors or all DTensors (one fused pass takes local shards or plain
        tensors, and a scaler or clip cannot tell a plain tensor's placement); a ValueError otherwise, and a
        NotImplementedError for a policy that is not element-wise on sharded DTensors. Returns whether the
        group's params are DTensors."""
        params = group["params"]
        kinds = [_dist.is_dtensor(p) for p in params]
        if any(kinds) and not all(kinds):
            i, j = kinds.index(True), kinds.index(False)
            raise ValueError(f"param group mixes DTensor and plain params (param {i} is a {_dist.describe(params[i])}, "
                             f"param {j} a plain tensor){where}; put the plain params in a group of their own, or "
                             "make them DTensors (e.g. fully_shard the module that owns them)")
        if any(kinds) and not self._elementwise:
            for i, p in enumerate(params):
                if _dist.sum_dims(p):
                    raise NotImplementedError(
                        f"{type(self).__name__} needs each param's whole-tensor norms, but param {i}{where} is a "
                        f"{_dist.describe(p)} whose local shard is a part of it; shard it with an element-wise "
                        "optimizer (FusedAdam, FusedAdamW, FusedSGD, FusedLion) or replicate it")
        return bool(kinds) and kinds[0]

    def _check_group(self, group: dict, where: str, in_step: bool = False) -> None:
        """Raises for an invalid hyperparameter of ``group``; ``where`` ends the message. ``in_step``: the
        values of tensor hyperparameters on a device are not read (that would sync the host)."""
        raise NotImplementedError

    # ---- state --------------------------------------------------------------------------------------
    def _wants_master(self, group: dict, p: torch.Tensor) -> bool:
        mw = group.get("master_weights")
        return p.dtype != torch.float32 and mw is not False and mw != "remainder"

    @staticmethod
    def _wants_remainder(group: dict, p: torch.Tensor) -> bool:
        return p.dtype == torch.bfloat16 and group.get("master_weights") == "remainder"

    def _fp32_zeros(self, p: torch.Tensor) -> torch.Tensor:
        """FP32 zeros with p's memory layout (contiguous, channels_last, ...): the kernels read a param and
        its state as flat arrays of the same element order."""
        return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)

    def _param_versions(self) -> WeakIdKeyDictionary:
        """Each followed param's version counter and memory when the last step saw it (_follow_writes), keyed
        by its master or remainder (_seen_key), held weakly: a state dropped is not kept alive."""
        versions = self.__dict__.get("_mpf_versions")
        if versions is None:
            versions = self.__dict__["_mpf_versions"] = WeakIdKeyDictionary()
        return versions

    def _entry_checks(self, group: dict) -> tuple:
        """What _check_state_entries asks of each state entry of ``group``'s params, made once per group and
        step: ``key: (dtype, kind)`` per entry the kernel may take, ``kind`` 0 for a tensor of the param's
        shape, 1 for the step count (one element), 2 for a state this step leaves alone (SGD's momentum
        buffer without momentum: only its type is checked, as the operator checks nothing of it), 3 for the
        FP32 master, checked where the group keeps one for the param. Which of the policy's states a step
        uses is the operator's decision (``_C.optim_state_mask``), from values that are never tensors: a
        tensor hyperparameter is taken here as a meta tensor, read nowhere, so that nothing is copied or
        synced."""
        hyper = _ops.hyper_args(self._policy, self._hyper(group, _META))[0]
        used = _ops._C.optim_state_mask(self._policy, hyper)
        names = _POLICY_STATES[self._policy]
        checks = {}
        for key in self._state_float_keys:
            if key == "master_param":
                checks[key] = (torch.float32, 3)
            else:
                checks[key] = (torch.float32, 0 if used >> names.index(key) & 1 else 2)
        checks["master_remainder"] = (torch.int16, 0)
        checks["step"] = (torch.float32, 1)
        mw = group.get("master_weights")
        # (and the same for _C.state_entries_check: (key, int16, kind), whether the group keeps FP32 masters)
        flat = tuple((key, want is torch.int16, kind) for key, (want, kind) in checks.items())
        return checks, flat, mw is not False and mw != "remainder"

    def _check_state_entries(self, state: dict, group: dict, p: torch.Tensor, i: int, gi: int, checks: dict) -> None:
        """The entries of param ``i`` of param group ``gi``'s state that the kernel takes, as code outside the
        optimizer may have set them (``state['step'] = 3``, a moment of another dtype, shape or device): a
        TypeError or ValueError naming the entry, the param and its group. step() runs it for every param of
        every group before anything is created or written; the operator's own checks, which run per group
        and name a position in its call's lists, then find nothing. Every entry must be a tensor; the dtype,
        shape and device are checked where the step uses the entry, as the operator checks them (see
        _entry_checks). A layout other than the param's is not an error: the step moves such an entry to the
        param's layout. (The full path's host time: one pass over the param's entries, the param's device and
        shape read once, the message made only for an entry that fails.)"""
        device = shape = None
        for key, value in state.items():
            spec = checks.get(key)
            if spec is None or value is None:
                continue  # (an entry of no kernel argument)
            want, kind = spec
            if not isinstance(value, torch.Tensor):  # set by code outside the optimizer
                raise TypeError(f"state['{key}'] of param {i} of param group {gi} must be a tensor, got "
                                f"{type(value).__name__} {value!r}: the optimizer keeps it as one, and load_state_dict "
                                "converts numbers")
            if kind == 2 or (kind == 3 and not self._wants_master(group, p)):
                continue  # a state this step leaves alone; a master the step drops (or rebuilds from the remainder)
            if device is None:
                device, shape = p.device, p.shape
            if value.dtype is want and value.device == device and \
                    (value.numel() == 1 if kind == 1 else value.shape == shape):
                continue
            what = ("a float32 tensor of one element (the step count)" if kind == 1 else
                    f"a {str(want).replace('torch.', '')} tensor of its param's shape {tuple(p.shape)}")
            raise ValueError(f"state['{key}'] of param {i} of param group {gi} must be {what} on its param's device "
                             f"{p.device}, got a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}; "
                             "load_state_dict converts a saved state")

    @staticmethod
    def _check_state_disjoint(params: list, states: list, group_of: list, where: list, checks: list,
                              grads: Optional[list] = None) -> None:
        """No two of the tensors a step writes in place share memory, over every group (the operator checks only
        its own call's): the params with a grad and the state entries it takes as they are, and with ``grads``
        (a scaled or clipped step, which writes each grad back) their grads (_C.state_overlap says which;
        DTensors by their local shards). An entry set by hand over another's memory (``state['exp_avg'] =
        state['exp_avg_sq']``, or over a param) was updated twice from the same old values, one write lost, in
        silence; on a GPU the writes would race. A grad shared by two params was unscaled twice, and one over
        another param or state wrote its unscaled values there. A ValueError naming both."""
        found = _ops._C.state_overlap(params, states, group_of, checks, grads)
        if found is None:
            return

        def name(k: int, key) -> str:
            gi, i = where[k]
            what = "param" if key is None else "the grad of param" if key is Ellipsis else f"state['{key}'] of param"
            return f"{what} {i} of param group {gi}"

        if found[1] is Ellipsis or found[3] is Ellipsis:
            first, second = sorted((found[:2], found[2:]), key=lambda f: (where[f[0]], f[1] is Ellipsis))
            raise ValueError(f"{name(*first)} and {name(*second)} {_GRADS_OVERLAP}")
        raise ValueError(f"{name(found[2], found[3])} and {name(found[0], found[1])} are over the same memory; a fused "
                         "step writes each in place, so one would be updated from the other's old values: give each "
                         "state entry a tensor of its own (e.g. .clone())")

    def _state_for(self, group: dict, p: torch.Tensor) -> dict:
        # (its entries were checked by step(): _check_state_entries)
        state = self.state.get(p)
        if state is None:
            state = {}
        if not state:
            self._init_state(group, p, state)
        remainder = state.get("master_remainder")
        if self._wants_remainder(group, p):
            state.pop("master_param", None)  # the master starts from the param again (remainder 0)
            if remainder is None:
                state["master_remainder"] = torch.zeros_like(p, dtype=torch.int16, memory_format=torch.preserve_format)
            elif remainder.stride() != p.stride() and not same_layout(remainder, p):
                state["master_remainder"] = like(remainder, p, torch.int16)
        else:
            if remainder is not None:
                del state["master_remainder"]
                if p.dtype == torch.float32:  # a BF16 param made FP32 (its group no longer "remainder")
                    self._continue_from_master(p, join_master(p.detach().to(torch.bfloat16), remainder))
            if self._wants_master(group, p):
                if "master_param" not in state:
                    state["master_param"] = (join_master(p, remainder) if remainder is not None and p.dtype == torch.bfloat16
                                             else like(p.detach(), p, torch.float32))
            elif "master_param" in state:
                master = state.pop("master_param")
                if p.dtype == torch.float32:
                    self._continue_from_master(p, master)
        self._complete_state(group, p, state)
        if group.get("rounding") == "stochastic" and "step" not in state:
            # the stochastic write-back's stream is the step number: counted for every policy
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
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

    @staticmethod
    @torch.no_grad()
    def _continue_from_master(p: torch.Tensor, master) -> None:
        """An FP16/BF16 param with an FP32 master (or a BF16 remainder, joined into one) that is now FP32 itself
        (``model.float()``, or a low-precision run's checkpoint loaded into an FP32 model) needs no master, and
        continues from it: the rule by which masters follow writes, seen from the other side. Where the param
        still holds one of the master's two neighbours in FP16 or BF16 (its rounding to nearest, or the other
        one, which stochastic rounding writes too: whatever the group's rounding is now), it takes the master's
        value, low bits included; an element written since keeps what was written. Done in chunks of 2^22
        elements (the temporaries: about 20 bytes an element)."""
        if not isinstance(master, torch.Tensor) or master.dtype != torch.float32:
            return
        pv, mv = _dist.local(p.detach()), _dist.local(master)  # (DTensors: shard by shard)
        if pv.shape != mv.shape or pv.device != mv.device or pv.numel() == 0:
            return
        if pv.is_contiguous() and mv.is_contiguous():
            pv, mv = pv.view(-1), mv.view(-1)
            parts = zip(pv.split(1 << 22), mv.split(1 << 22))
        else:
            parts = [(pv, mv)]
        for pc, mc in parts:
            held = torch.zeros(pc.shape, dtype=torch.bool, device=pc.device)
            for low in (torch.float16, torch.bfloat16):
                near = mc.to(low)
                held |= pc == near.float()
                # The master's other neighbour: one step of magnitude from the nearest, toward the master (the
                # bits are sign and magnitude: +1 / -1 on them moves the magnitude; from inf, the largest finite;
                # from 0, the smallest subnormal of the zero's sign). (Not torch.nextafter: older torch releases
                # have no FP16 nextafter on CUDA.)
                gap = mc.abs() - near.float().abs()
                step = (gap > 0).to(torch.int16) - (gap < 0).to(torch.int16)
                held |= pc == (near.view(torch.int16) + step).view(low).float()
            pc.copy_(torch.where(held, mc, pc))

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
        try:
            return (type(p) in _PLAIN_TYPES and type(g) in _PLAIN_TYPES and p.dtype in SUPPORTED_DTYPES
                    and g.dtype == p.dtype and p.layout == torch.strided and g.layout == torch.strided
                    and g.shape == p.shape and g.device == p.device and (p.is_contiguous() or is_dense(p))
                    and (torch.compiler.is_compiling() or not p.is_inference()))
        except RuntimeError:  # (a nested tensor has no sizes to compare: _check_param names it)
            return False

    @staticmethod
    def _param_kind_ok(p) -> bool:
        return type(p) in _PLAIN_TYPES

    @classmethod
    def _dtensor_ok(cls, p) -> bool:
        """The common case of a DTensor param (FSDP2's): its grad a DTensor on the same mesh with the same
        placements, and their local shards what _param_ok asks of plain tensors."""
        g = p.grad
        if type(g) is not type(p) or g.device_mesh is not p.device_mesh or g.placements != p.placements:
            return False
        lp, lg = _dist.local(p), _dist.local(g)
        return (type(lp) in _PLAIN_TYPES and type(lg) in _PLAIN_TYPES and lp.dtype in SUPPORTED_DTYPES
                and lg.dtype == lp.dtype and lp.layout == torch.strided and lg.layout == torch.strided
                and lg.shape == lp.shape and g.shape == p.shape and lg.device == lp.device
                and lg.stride() == lp.stride() and (lp.is_contiguous() or is_dense(lp)))

    @classmethod
    def _check_dtensor_param(cls, where: str, p) -> None:
        _dist.check_same_spec(where, p, p.grad)
        lp, lg = _dist.local(p), _dist.local(p.grad)
        if not is_plain_tensor(lp) or not is_plain_tensor(lg):
            raise TypeError(f"{where}: the DTensor's local shard is a {type(lp).__name__}; the fused optimizers "
                            "take DTensors whose local shards are plain tensors")
        cls._check_param(where + " (local shard)", lp, lg)
        if lg.stride() != lp.stride() and not same_layout(lg, lp):
            raise ValueError(f"{where}: the grad's local shard has strides {lg.stride()} but the param's has "
                             f"{lp.stride()}; the fused update pairs them element by element")

    @staticmethod
    def _check_param(where: str, p: torch.Tensor, g: Optional[torch.Tensor] = None) -> None:
        """The checks of a param and its grad (``p.grad`` unless ``g`` is given: a DTensor's local shards)."""
        g = p.grad if g is None else g
        if _dist.is_dtensor(p) != _dist.is_dtensor(g):
            dt, plain = ("param", "grad") if _dist.is_dtensor(p) else ("grad", "param")
            raise TypeError(f"{where}: the {dt} is a DTensor but the {plain} is a plain {type(p if plain == 'param' else g).__name__}; "
                            "both must be DTensors with the same placements")
        if not is_plain_tensor(p) or not is_plain_tensor(g):
            bad = p if not is_plain_tensor(p) else g
            raise TypeError(f"{where}: the fused optimizers take plain tensors or DTensors, got a {type(bad).__name__} "
                            f"{'param' if bad is p else 'grad'}")
        if p.is_nested or g.is_nested:  # (before anything asks for its sizes: a nested tensor has none)
            raise ValueError(f"{where}: nested {'params' if p.is_nested else 'gradients'} are not supported by the "
                             "fused optimizers (they update dense tensors)")
        if p.is_complex() or not p.is_floating_point():
            raise ValueError(f"{where}: the fused optimizers update float32/float16/bfloat16 params, got {p.dtype}")
        if p.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{where}: dtype {p.dtype} is not supported (expected float32, float16 or bfloat16)")
        if p.is_sparse:
            raise ValueError(f"{where}: sparse params are not supported")
        if not is_dense(p):
            raise ValueError(f"{where}: params must be dense: contiguous, channels_last or another permutation of a "
                             f"contiguous tensor (got strides {p.stride()} for shape {tuple(p.shape)})")
        if g.is_sparse:
            raise ValueError(f"{where}: sparse gradients are not supported by the fused optimizers")
        if g.shape != p.shape:
            raise ValueError(f"{where}: grad shape {tuple(g.shape)} differs from param shape {tuple(p.shape)}")
        if g.device != p.device:
            raise ValueError(f"{where}: grad is on {g.device} but the param is on {p.device}")
        if g.dtype != p.dtype:
            raise ValueError(f"{where}: grad dtype {g.dtype} differs from param dtype {p.dtype}")
        # torch's in-place update raises for one too (outside inference mode), having written the params
        # before it. A grad may be one (read only; the operator refuses one it would write back, outside
        # inference mode). (dynamo cannot trace is_inference(); the operator checks there.)
        if not torch.compiler.is_compiling() and p.is_inference():
            raise RuntimeError(f"{where}: the param is an inference tensor (made under torch.inference_mode()); the "
                               "fused optimizers do not step one, inside inference mode or out (its writes cannot be "
                               "counted): make the model (or clone its params) outside torch.inference_mode()")

    # ---- step ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *, scaling: Optional[StepScaling] = None):
        """One step of every param group. ``scaling``: what a gradient scaler hands over (see StepScaling);
        without it, torch.amp.GradScaler's ``grad_scale``/``found_inf`` attributes are read when set."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if scaling is None:
            # torch.amp.GradScaler's protocol: the scale S itself and the summed found_inf, set around step()
            grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
            if _is_real(found_inf):
                # torch's scaler sums the per-device flags; with no grads at all that sum is the int 0
                if found_inf:
                    return loss  # a host-side overflow flag: the step is skipped
                found_inf = None
            scaling = (_NO_SCALING if grad_scale is None and found_inf is None
                       else StepScaling(grad_scale=grad_scale, found_inf=found_inf))
        elif not isinstance(scaling, StepScaling):
            raise TypeError(f"scaling must be a mpfused.optim.StepScaling or None, got {type(scaling).__name__}")

        # The planned path: a step that repeats the last one's structure (see _StepPlan) skips the per-param
        # work below whose outcome that step fixed.
        if self._planned_step(scaling):
            return loss

        # The full path. It mends state in place as it goes, so a plan made before it no longer holds
        # (even where it raises): the plan is dropped here and remade when the step succeeds. Not in a step
        # that torch.compile traces: it never takes the plan, and torch 2.11's dynamo cannot trace a write
        # to an optimizer's attributes; a plan left from an eager step still checks, before it is taken,
        # that every param, grad, state dict and state tensor is the object it was made for.
        compiling = torch.compiler.is_compiling()
        if not compiling:
            self._credit_planned_writes(self.__dict__.get("_mpf_plan"))
            self.__dict__["_mpf_plan"] = None
            self._check_memory_disjoint()
        # Everything is checked before anything (state included) is created or written.
        work = []
        offsets: dict[int, int] = {}  # the stochastic rounding's offsets: id(p) -> start in the flat order
        stochastic = any(group.get("rounding") == "stochastic" for group in self.param_groups)
        start = 0
        stated = ([], [], [], [], [], [])  # the params a step writes, their states, groups, (gi, i), each group's
        # checks, their grads
        for gi, group in enumerate(self.param_groups):
            check_precision(group, f" (param group {gi})")
            remainder = group.get("master_weights") == "remainder"
            self._check_group(group, f" (param group {gi})", in_step=True)
            # (len(), not bool(): torch 2.11's dynamo cannot trace bool of a list)
            dtensors = len(group["params"]) > 0 and not self._param_kind_ok(group["params"][0]) and \
                self._check_kinds(group, f" (param group {gi})")
            params = []
            stepped = []  # (i, p) of the params with a grad
            with_state = []  # (i, p, state) of the params with a grad and a state: their entries are checked below
            for i, p in enumerate(group["params"]):
                if p.grad is not None:
                    if dtensors:
                        if not self._dtensor_ok(p):
                            self._check_dtensor_param(f"param {i} of param group {gi}", p)
                    elif not self._param_ok(p):
                        if _dist.is_dtensor(p):
                            self._check_kinds(group, f" (param group {gi})")
                        self._check_param(f"param {i} of param group {gi}", p)
                    if remainder:
                        check_remainder_dtype(group, f" of param group {gi}", i, p)
                    state = self.state.get(p)
                    if state and not compiling:  # (compiled: the operator's checks, in the graph)
                        with_state.append((i, p, state))
                    params.append(p)
                    stepped.append((i, p))
                if stochastic:
                    # a DTensor's shard starts at its first element's index in the global param
                    # (keyed by the tensor the kernel call sees: a DTensor's local shard)
                    if dtensors:
                        offsets[id(_dist.local(p))] = start + (_dist.flat_offset(p, f"param {i} of param group {gi}")
                                                               if group.get("rounding") == "stochastic" else 0)
                    else:
                        offsets[id(p)] = start
                    start += p.numel()
            flat, masters = (), False
            if with_state:  # every entry in one C++ pass; the Python check makes the message where one fails
                checks, flat, masters = self._entry_checks(group)
                bad = _ops._C.state_entries_check([p for _, p, _ in with_state], [st for _, _, st in with_state], flat,
                                                  masters)
                if bad >= 0:
                    i, p, state = with_state[bad]
                    self._check_state_entries(state, group, p, i, gi, checks)
            if stepped and not compiling:  # (for _check_state_disjoint; DTensors: their local shards)
                local = _dist.local if dtensors else _same
                for i, p in stepped:
                    state = self.state.get(p) or {}
                    stated[0].append(local(p))
                    stated[1].append({k: local(v) for k, v in state.items()} if dtensors and state else state)
                    stated[2].append(len(stated[4]))
                    stated[3].append((gi, i))
                    stated[5].append(local(p.grad))
                stated[4].append((flat, masters, remainder))
            if group.get("capturable") and params:
                check_capturable(group, params, scaling, f" (param group {gi})")
            work.append((group, params, dtensors))
        # A step that unscales or clips leaves in p.grad the gradient it used (unscaled, clipped), as torch's
        # fused optimizers do: the kernel writes it in the same pass. A skipped step writes nothing.
        write_grad = scaling.inv_scale is not None or scaling.grad_scale is not None or scaling.clip is not None
        if stated[0]:  # (the grads it writes back too)
            self._check_state_disjoint(*stated[:5], stated[5] if write_grad else None)
        for group in self.param_groups:  # a group switched to stochastic after it was added
            if group.get("rounding") == "stochastic" and group.get("seed") is None:
                group["seed"] = self._default_seed()

        clip = scaling.clip
        if clip is None:
            clip = self._own_clip(work, scaling)
        device_scalars = self._device_scalars(scaling, clip)
        for device in {p.device for _, params, _ in work for p in params}:
            device_scalars(device)  # each device's copies now: what cannot be copied raises before any write

        if write_grad and not compiling:
            inference = torch.is_inference_mode_enabled()  # (there an inference grad can be written)
            # Grads this step cannot write back are refused before any group is written (the operator refuses
            # some too, but only for its own call's groups): an inference grad, outside inference mode; one that
            # overlaps itself (an expand()ed view), where it goes through a copy (laid out unlike its param)
            # that is written back after the kernels.
            for group, params, dtensors in work:
                for p in params:
                    g = _dist.local(p.grad) if dtensors else p.grad
                    lp = _dist.local(p) if dtensors else p
                    if not inference and g.is_inference():
                        why = ("is an inference tensor (made under torch.inference_mode())", RuntimeError,
                               "make the grad outside inference mode")
                    elif g.stride() != lp.stride() and not same_layout(g, lp) and \
                            torch._debug_has_internal_overlap(g) == 1:
                        why = ("overlaps itself in memory (an expand()ed or similar view)", ValueError,
                               "give the grad memory of its own (.contiguous())")
                    else:
                        continue
                    i = next(j for j, q in enumerate(group["params"]) if q is p)
                    gi = next(k for k, g in enumerate(self.param_groups) if g is group)
                    raise why[1](f"param {i} of param group {gi}: its grad {why[0]}, which this step would write "
                                 f"back unscaled; {why[2]}, or step without a scaler")
        plannable = not torch.compiler.is_compiling()
        for group, params, dtensors in work:
            buckets: dict[torch.device, list] = defaultdict(list)
            for p in params:
                buckets[p.device].append(p)
            plannable = plannable and len(buckets) <= 1
            for device, ps in buckets.items():
                states = [self._state_for(group, p) for p in ps]
                followed = ()
                if not compiling:  # (DTensors: with their states' local shards)
                    followed = _followed(ps, self._local_views([], [], states)[2] if dtensors else states,
                                         group.get("rounding") == "stochastic")
                    _follow_writes(followed, self._param_versions())
                # A grad laid out unlike its param (rare: autograd gives a dense param's grad its layout)
                # goes through a copy in the param's layout. DTensors: their local shards' layouts, which the
                # kernels read (and torch.compile's dynamo cannot trace a DTensor's own stride() here).
                laid = _dist.local if dtensors else _same
                grads = [g if layouts_match(laid(g), laid(p)) else like(g, p, p.dtype)
                         for p, g in ((p, p.grad) for p in ps)]
                # DTensors: the kernels update the local shards (the same memory as the DTensors)
                kps, kgrads, kstates = self._local_views(ps, grads, states) if dtensors else (ps, grads, states)
                sr = [offsets[id(p)] for p in kps] if group.get("rounding") == "stochastic" else None
                entries = _kernel_entries(self._policy, kstates)
                self._fused_step(group, kps, kgrads, entries, self._device_lr(group, device), device_scalars(device),
                                 self._counter(device), write_grad, sr)
                if followed:  # the kernel counted its writes (csrc/torch/optim.cpp): they are the step's own
                    seen = self._param_versions()
                    for p, master, remainder, _ in followed:
                        seen[_seen_key(master, remainder)] = _seen_value(p)
                for p, g in zip(ps, grads):
                    if g is not p.grad:  # the grad went through a copy
                        plannable = False
                        if write_grad:
                            p.grad.copy_(g)
        if plannable and not compiling:
            self.__dict__["_mpf_plan"] = _StepPlan.make(self, work, offsets if stochastic else None)
        return loss

    def _credit_planned_writes(self, plan: Optional["_StepPlan"]) -> None:
        """Where the full path follows a plan's steps, whose writes moved the params' version counters
        (csrc/torch/optim.cpp): a group whose followed params' counters are still what its last step left
        had no write from outside since, so the full path notes their counts as its own (_follow_writes) and
        does not compare them with their masters again (on a GPU: no comparison kernels, which a CUDA-graph
        capture of that step would keep). A group written from outside keeps the old counts: compared."""
        if plan is None:
            return
        seen = None
        for gp in plan.groups:
            if gp.versions is None or not gp.versions or gp.call is None:
                continue
            written = list(gp.params if gp.mask is None else compress(gp.params, gp.mask))
            memory = [_dist.local(p) for p in written] if gp.local_entries is not None else None
            if memory is None and not all(map(is_plain_tensor, written)):
                continue
            if _step_versions(written, gp.layout_entries, memory) != gp.versions:
                continue
            seen = self._param_versions() if seen is None else seen
            for p, master, remainder in zip(written, gp.layout_entries[-3], gp.layout_entries[-2]):
                if (master is not None or remainder is not None) and _seen_key(master, remainder) in seen:
                    seen[_seen_key(master, remainder)] = _seen_value(p)

    def _planned_step(self, scaling: StepScaling) -> bool:
        """The step on the plan the last step left (_StepPlan), when this one repeats that step's structure;
        False, having checked and written nothing, when it does not (the caller then takes the full path)."""
        if torch.compiler.is_compiling():  # (first: dynamo would otherwise guard on the plan object)
            return False
        plan = self.__dict__.get("_mpf_plan")
        if plan is None:
            return False
        calls = plan.match(self)
        if calls is None:
            return False
        # The checks of the full path that the plan cannot fix: the groups' values (those that are not the
        # objects last checked), and what a capturable step reads; all before anything is written.
        hypers = []
        for gi, (group, gp, kps, _, _, changed, _) in enumerate(calls):
            if changed:
                where = f" (param group {gi})"
                if changed == ("lr",):
                    check_lr(group["lr"], where, read_device=False, read_cpu=not group.get("capturable"))
                else:
                    check_precision(group, where)
                    self._check_group(group, where, in_step=True)
            if group.get("capturable") and kps:
                check_capturable(group, kps, scaling, f" (param group {gi})")
            hyper = gp.hyper
            if gp.call is not None and (hyper is None or (changed and changed != ("lr",))):
                hyper = gp.call.hyper_args(self._hyper(group, gp.device))
            hypers.append(hyper)
        for (group, gp, _, _, _, changed, values), hyper in zip(calls, hypers):
            if changed is not None:
                gp.values = values
                # (only the lr changed: every other value is the frozen one last checked)
                if changed == ("lr",):
                    gp.frozen = _frozen(group["lr"])
                elif changed:
                    gp.frozen = all(_frozen(v) for k, v in zip(gp.keys, values) if k not in _NOT_VALUES)
            gp.hyper = hyper if gp.frozen else None
        clip = scaling.clip
        if clip is None:
            clip = self._own_clip([(group, kps, gp.local_entries is not None) for group, gp, kps, *_ in calls], scaling)
        no_scalars = scaling is _NO_SCALING and clip is None
        device_scalars = None if no_scalars else self._device_scalars(scaling, clip)
        write_grad = scaling.inv_scale is not None or scaling.grad_scale is not None or scaling.clip is not None
        if write_grad and plan.written is not None:  # (within one call, the operator checks)
            plan.check_grads([lgs for _, _, _, _, lgs, _, _ in calls])
        try:
            for params, targets, stochastic in plan.follows:  # (after every check: the first write of the step)
                if params:
                    _ops.follow_writes_(params, targets, stochastic)
            plan.follows = []  # (holds no tensor past the step)
            for (group, gp, kps, local_ps, lgs, _, _), hyper in zip(calls, hypers):
                if kps:
                    device = gp.device
                    counter = self._counter(device) if device.type == "cuda" else None
                    _ops.optim_step_direct(gp.call.args(lgs, lr=self._device_lr(group, device), hyper=hyper,
                                                        counter=counter, write_grad=write_grad, params=local_ps,
                                                        **({} if no_scalars else device_scalars(device))))
        except BaseException:
            # (nothing the plan checked can raise here; whatever did, the next step takes the full path)
            self.__dict__.pop("_mpf_plan", None)
            raise
        # The counters the step's own writes left (counted by the operator), once every group is written:
        # views of one buffer in several groups share a counter, which each group's call moves
        for _, gp, kps, local_ps, *_ in calls:
            if gp.versions is not None and kps:
                gp.versions = _step_versions(kps, gp.layout_entries, local_ps)
        return True

    @staticmethod
    def _device_lr(group: dict, device: torch.device):
        lr = group["lr"]
        return copy_to(lr, device, torch.float32).reshape(1) if isinstance(lr, torch.Tensor) else lr

    @staticmethod
    def _device_scalars(scaling: StepScaling, clip: Optional[tuple]) -> Callable[[torch.device], dict]:
        """The keyword arguments of ``_ops.optim_step_`` for the unscale, clip and skip on a device (made
        once per device and step)."""
        per_device: dict[torch.device, dict] = {}

        def on(t: torch.Tensor, device: torch.device, name: str) -> torch.Tensor:
            # a one-element float32 tensor on the device, of any shape: as the operator takes it
            if t.device == device and t.dtype == torch.float32:
                return t
            if t.is_meta:  # (a meta tensor holds no value to copy)
                raise ValueError(f"StepScaling.{name} is on the meta device, which holds no value, and the params are "
                                 f"on {device}: give it on the params' device or the CPU")
            return copy_to(t, device, torch.float32).reshape(1)

        def device_scalars(device: torch.device) -> dict:
            if device not in per_device:
                kw = {}
                if scaling.inv_scale is not None:
                    kw["inv_scale"] = on(scaling.inv_scale, device, "inv_scale")
                elif scaling.grad_scale is not None:  # the kernel computes 1/S on the device
                    kw["grad_scale"] = on(scaling.grad_scale, device, "grad_scale")
                if clip is not None:
                    kw["clip_sumsq"] = on(clip[0], device, "clip[0] (the sum of squares)")
                    kw["max_norm"] = float(clip[1])
                if scaling.found_inf is not None:
                    kw["found_inf"] = on(scaling.found_inf, device, "found_inf")
                per_device[device] = kw
            return per_device[device]

        return device_scalars

    @staticmethod
    def _local_views(params: list, grads: list, states: list) -> tuple:
        """DTensor params, grads and state as their local shards (the step's own ``self.state`` keeps the
        DTensors; only the kernel call sees the shards)."""
        local = _dist.local
        return ([local(p) for p in params], [local(g) for g in grads],
                [{k: local(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()} for s in states])

    def _own_clip(self, work: list, scaling: StepScaling) -> Optional[tuple]:
        """A clip the optimizer itself needs when the scaler gave none: ``(sumsq, max_norm)`` or None
        (LAMB's max_grad_norm: the sum of squares of all unscaled gradients, max_norm infinite). ``work``:
        (group, params with a grad) per param group, validated."""
        return None

    def _counter(self, device: torch.device) -> Optional[torch.Tensor]:
        """The zeroed int32 the update kernel borrows and leaves zeroed, one per device and stream
        (_ops.borrowed_counter): with it the last block of the update increments the step counters, so a
        step is one launch per group."""
        if device.type != "cuda" or torch.compiler.is_compiling():
            return None  # (borrowed_counter's answer there, without the store: torch 2.11's dynamo cannot
            # trace the write of a new attribute of the optimizer)
        return _ops.borrowed_counter(self.__dict__.setdefault("_mpf_counters", {}), device)

    def _hyper(self, group: dict, device: torch.device) -> dict:
        """The policy's hyperparameters (``_ops.optim_policies()[self._policy]["hyper"]``) from ``group``:
        floats, bools, or one-element tensors on ``device`` (see device_hyper)."""
        raise NotImplementedError

    def _fused_step(self, group: dict, params: list, grads: list, entries: list, lr, scalars: dict,
                    counter: Optional[torch.Tensor], write_grad: bool, sr_offsets: Optional[list]) -> None:
        """The kernel call for one group's params on one device. ``entries``: their state entries
        (_kernel_entries). ``scalars``: the keyword arguments of ``_ops.optim_step_`` for the unscale,
        clip and skip. ``sr_offsets``: each param's stochastic-rounding offset, when the group rounds
        stochastically."""
        self._optim_call(group, params, entries, sr_offsets)(grads, lr=lr, hyper=self._hyper(group, params[0].device),
                                                             counter=counter, write_grad=write_grad, **scalars)

    def _optim_call(self, group: dict, params: list, entries: list, sr_offsets: Optional[list]) -> _ops.OptimCall:
        """What of the kernel call of ``group``'s ``params`` does not change while their states stay (see
        _fused_step)."""
        names = _POLICY_STATES[self._policy]
        kernel_states = {name: tensors for name, tensors in zip(names, entries)
                         if not all(map(is_, tensors, repeat(None)))}
        masters, remainders, steps = entries[len(names):]
        precision = {}
        if not all(map(is_, remainders, repeat(None))):
            precision["remainders"] = remainders
        if group.get("rounding") == "stochastic":
            precision.update(rounding="stochastic", seed=group["seed"], sr_offsets=sr_offsets)
        return _ops.OptimCall(self._policy, params, masters, kernel_states,
                              [] if all(map(is_, steps, repeat(None))) else steps, **precision)

    # ---- state dict ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch's, with one change: a remainder (``master_remainder``) appears as a bfloat16 view of its
        int16 bits (the same memory, no copy: an in-place load such as DCP's restores it). For a DTensor param
        (FSDP2) that is needed: torch.distributed.checkpoint's full state dict and resharding gather it, and
        gloo and NCCL have no int16 collectives ("Invalid scalar type"), while a collective moves a view's bits
        as they are. A plain param's is the same view, so that a checkpoint moves between the two: DCP loads
        into the tensors of the destination's state dict and converts a saved dtype into theirs value by value
        (an int16 remainder loaded into a bfloat16 one, or back, came out as other bits). load_state_dict takes
        the view, int16 (older checkpoints, torch.save'd ones), and int32 of int16 values."""
        sd = super().state_dict()
        for k, st in list(sd["state"].items()):
            remainder = st.get("master_remainder") if isinstance(st, dict) else None
            if remainder is not None and remainder.dtype == torch.int16:
                sd["state"][k] = {**st, "master_remainder": remainder.view(torch.bfloat16)}  # (st is the live state)
        return sd

    @staticmethod
    def _remainder_bits(value: torch.Tensor) -> torch.Tensor:
        """A saved remainder as int16 bits: int16; the bfloat16 view of them a DTensor param's state_dict()
        gives (viewed back, never converted); or int32 of int16 values (a plain tensor's are checked; a
        DTensor's would need a collective on every rank)."""
        if value.dtype == torch.int16:
            return value
        if value.dtype == torch.bfloat16:
            return value.view(torch.int16)
        if value.dtype != torch.int32:
            raise ValueError(f"state 'master_remainder' must be an int16 tensor (or its bfloat16 view, or int32 of "
                             f"int16 values), got {value.dtype}")
        if not _dist.is_dtensor(value) and value.numel() and not (
                bool(value.min() >= -2**15) and bool(value.max() < 2**15)):
            raise ValueError("state 'master_remainder' is an int32 tensor with values outside int16's range")
        return value

    def _load_value(self, param: torch.Tensor, key, value):
        if isinstance(value, torch.Tensor) and key != "step" and (_dist.is_dtensor(param) or _dist.is_dtensor(value)):
            return self._load_sharded_value(param, key, value)
        if key == "step":
            if _dist.is_dtensor(value):  # a replicated count: every shard holds it
                value = _dist.local(value)
            # a copy: the kernels count steps in place, and a state dict taken from a live optimizer must not
            # share its counters with this one
            if isinstance(value, bool) or not (isinstance(value, torch.Tensor) or _is_real(value)):
                raise ValueError(f"state 'step' must be a number or a one-element tensor, got {type(value).__name__} "
                                 f"{value!r}")
            if isinstance(value, torch.Tensor) and (value.is_meta or value.is_complex() or value.dtype == torch.bool):
                raise ValueError(f"state 'step' must be a real number or a one-element tensor that holds one, got a "
                                 f"{value.dtype} tensor on {value.device}")
            step = torch.as_tensor(value, dtype=torch.float32)
            if step.numel() != 1:
                raise ValueError(f"state 'step' must be a number or a one-element tensor, got shape {tuple(step.shape)}")
            # (a count: the bias corrections of a NaN or negative one made NaN params at the next step; read on
            # the host once, at load, where torch reads it too)
            count = float(step.reshape(()).item())
            if not (math.isfinite(count) and count >= 0):
                raise ValueError(f"state 'step' must be a count >= 0, got {count}")
            return step.to(param.device).reshape(()).clone()
        if key == "master_remainder" and isinstance(value, torch.Tensor):
            # int16 bits, never cast through a float dtype, in the param's memory layout
            value = self._remainder_bits(value)
            if value.shape == param.shape and is_dense(param):
                return like(value, param, torch.int16)
            return value.to(device=param.device, dtype=torch.int16).contiguous()
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            # FP32 state stays FP32 (torch's loader would cast it to an FP16 param's dtype), in the param's
            # memory layout.
            if value.shape == param.shape and is_dense(param):
                return like(value, param, torch.float32)
            return value.to(device=param.device, dtype=torch.float32).contiguous()
        return value

    @staticmethod
    def _load_sharded_value(param: torch.Tensor, key, value: torch.Tensor) -> torch.Tensor:
        """A state tensor where the param or the value is a DTensor (FSDP2, a DCP checkpoint): state of a
        DTensor param is a DTensor with the param's mesh and placements (float32; int16 for a remainder).
        A saved DTensor with other placements is redistributed (every rank loads, so every rank joins); a
        plain value of the param's global shape is cut to this rank's shard (no communication)."""
        dtype = torch.int16 if key == "master_remainder" else torch.float32
        if key == "master_remainder":
            value = FusedOptimizer._remainder_bits(value)
        if not (value.is_floating_point() or key == "master_remainder"):
            return value
        # the collectives below move int16 (a remainder) as int32: gloo and NCCL have no int16 sums or gathers
        wide = torch.int32 if dtype == torch.int16 else None
        if not _dist.is_dtensor(param):
            # a sharded checkpoint loaded into an unsharded param: the whole value (a collective)
            whole = (value.to(wide) if wide else value).full_tensor()
            return FusedOptimizer._load_value_plain(param, dtype, whole)
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"state {key!r} has shape {tuple(value.shape)} but its param has shape {tuple(param.shape)}")
        if not _dist.is_dtensor(value):
            return _dist.shard_like(value.to(dtype), param)
        if value.device_mesh != param.device_mesh:
            raise ValueError(f"state {key!r} is a {_dist.describe(value)} but its param is a {_dist.describe(param)}: "
                             "load the state dict through torch.distributed.checkpoint.state_dict"
                             ".set_optimizer_state_dict, which reshards it")
        if tuple(value.placements) != tuple(param.placements):
            value = (value.to(wide) if wide else value).redistribute(param.device_mesh, param.placements)
        shard = _dist.local(value).to(device=_dist.local(param).device, dtype=dtype)
        lp = _dist.local(param)
        if shard.shape == lp.shape and is_dense(lp) and not same_layout(shard, lp):
            shard = like(shard, lp, dtype)
        return type(param).from_local(shard, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                      stride=param.stride())

    @staticmethod
    def _load_value_plain(param: torch.Tensor, dtype: torch.dtype, value: torch.Tensor) -> torch.Tensor:
        if value.shape == param.shape and is_dense(param):
            return like(value, param, dtype)
        return value.to(device=param.device, dtype=dtype).contiguous()

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads our own state dicts and torch.optim's (Adam, AdamW, SGD): FP32 state stays FP32, a missing
        master copy is taken from the current params, a missing SGD step count is inferred."""
        state_dict = state_dict.copy()  # as torch: a pre-hook that edits its dict leaves the caller's as it was
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
        tensor_keys = set(_POLICY_STATES[self._policy]) | {"master_param", "master_remainder"}
        for k, v in state_dict["state"].items():
            if k in id_map:
                param = id_map[k]
                if not isinstance(v, dict):
                    raise ValueError(f"state {k!r} of the loaded state dict must be a dict, got {type(v).__name__} "
                                     "(nothing was loaded)")
                for key, value in v.items():  # (None: torch's SGD without momentum saves momentum_buffer as None)
                    if key in tensor_keys and not isinstance(value, torch.Tensor) and \
                            (value is not None or key != "momentum_buffer"):
                        raise ValueError(f"state {key!r} of param {k!r} of the loaded state dict must be a tensor, "
                                         f"got {type(value).__name__} (nothing was loaded)")
                    held = _dist.local(value) if isinstance(value, torch.Tensor) and _dist.is_dtensor(value) else value
                    if key in tensor_keys and isinstance(held, torch.Tensor) and (
                            held.is_nested or held.layout != torch.strided
                            or (held.device.type == "meta" and _dist.local(param).device.type != "meta")):
                        what = ("a nested tensor" if held.is_nested else f"a tensor of layout {held.layout}"
                                if held.layout != torch.strided else "a tensor on the meta device, which holds no values")
                        raise ValueError(f"state {key!r} of param {k!r} of the loaded state dict must be a dense "
                                         f"(strided) tensor with values, got {what} (nothing was loaded)")
                    if key in tensor_keys and isinstance(value, torch.Tensor) and not _dist.is_dtensor(param) \
                            and not _dist.is_dtensor(value) and value.shape != param.shape:
                        raise ValueError(f"state {key!r} of param {k!r} of the loaded state dict must have the param's "
                                         f"shape {tuple(param.shape)}, got {tuple(value.shape)} (nothing was loaded)")
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
        # The saved precision keys, as add_param_group checks them, before anything is loaded (master_weights=
        # "remainder" saved with BF16 params and loaded over FP16 or FP32 ones was taken, and the next step raised)
        for gi, ng in enumerate(new_groups):
            where = f" (param group {gi} of the loaded state dict; nothing was loaded)"
            check_precision(ng, where)
            # what the step would refuse, no more (in_step: a scheduler's float beside a tensor beta is taken; a
            # device value is not read): torch's load takes any value, and our step then refused it
            self._check_group(ng, where, in_step=True)
            for i, p in enumerate(ng["params"]):
                check_remainder_dtype(ng, f" of param group {gi} of the loaded state dict (nothing was loaded)", i, p)
        # From here the loaded state is checked as a step would use it (_after_load: shapes, dtypes, devices,
        # remainders against params); on an error the optimizer is put back as it was, whole.
        kept = {key: self.__dict__.get(key) for key in ("state", "param_groups", "_mpf_seed", "_mpf_plan",
                                                        "_mpf_versions", "_mpf_spans", "_mpf_memory")}
        try:
            self.__setstate__({"state": state, "param_groups": new_groups})
            if self.defaults.get("seed") is None:
                # The seed this optimizer draws for stochastic groups with seed None is the saved run's: the seed
                # of its first stochastic group (so a group added after a resume rounds as it would have in the
                # run that saved the dict, where it would have taken that run's drawn seed)
                saved_seed = next((g["seed"] for g in self.param_groups
                                   if g.get("rounding") == "stochastic" and type(g.get("seed")) is int), None)
                if saved_seed is not None:
                    self.__dict__["_mpf_seed"] = saved_seed
            for group in self.param_groups:
                for p in group["params"]:
                    if self.state.get(p):
                        self._after_load(group, p, self.state[p])
        except Exception:
            for key, value in kept.items():
                if value is None:
                    self.__dict__.pop(key, None)
                else:
                    self.__dict__[key] = value
            raise
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _after_load(self, group: dict, p: torch.Tensor, state: dict) -> None:
        # An FP32 master loaded over an FP32 param (a low-precision run's checkpoint, loaded into the FP32 model
        # that mpfused.amp.initialize casts next) is kept until a step: initialize takes it as the master, with
        # the low bits the saved low-precision weights lost; a step over the FP32 param, which needs no master,
        # first gives the param the master's value where the param still holds its rounding (_state_for; not
        # here: a load does not write the params).
        kept = state.pop("master_param", None) if p.dtype == torch.float32 else None
        self._state_for(group, p)
        if isinstance(kept, torch.Tensor) and kept.dtype == torch.float32 and kept.shape == p.shape \
                and kept.device == p.device and "master_param" not in state:
            state["master_param"] = kept
            self.state[p] = state
