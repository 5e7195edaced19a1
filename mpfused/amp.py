"""mpfused.amp: one call turns an FP32 model and a torch optimizer into a mixed-precision setup.

    model, optimizer, scaler = mpfused.amp.initialize(model, optimizer, opt_level="O2")
    for x, y in data:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

The four levels (the table of apex.amp, implemented here from scratch):

    level  model params          forward                          master weights  loss scale
    O0     FP32                  FP32                             no (FP32)       1 (scaler disabled)
    O1     FP32                  torch.autocast(dtype)            no (FP32)       dynamic
    O2     dtype, norms FP32     inputs -> dtype, outputs -> FP32 FP32 masters    dynamic
    O3     dtype                 inputs -> dtype                  no              1 (scaler disabled)

``dtype`` is torch.float16 (default) or torch.bfloat16, for every level. The keyword arguments
``keep_batchnorm_fp32``, ``loss_scale`` and ``master_weights`` override the level's defaults.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import numbers
import types
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Optional, Union

import torch
from torch import nn

from ._layout import like, same_layout
from ._ops import has_cuda_kernels
from .optim import FusedAdam, FusedAdamW, FusedSGD
from .optim._base import FusedOptimizer, check_precision, split_master
from .scaler import GradScaler

__all__ = ["initialize", "properties", "AmpProperties", "OPT_LEVELS", "NORM_LAYERS"]

OPT_LEVELS = ("O0", "O1", "O2", "O3")
_LOW_DTYPES = (torch.float16, torch.bfloat16)

# Normalization layers: kept in FP32 by O2 (and by O3 with keep_batchnorm_fp32=True). _NormBase covers
# the whole BatchNorm family (BatchNorm1d/2d/3d, SyncBatchNorm, the Lazy variants) and InstanceNorm*.
NORM_LAYERS: tuple = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm)
if hasattr(nn, "RMSNorm"):
    NORM_LAYERS = NORM_LAYERS + (nn.RMSNorm,)

# torch.optim class -> fused class. Exact types only: a user subclass may change step(), which the fused
# optimizer would silently drop.
_CONVERTIBLE = {torch.optim.Adam: FusedAdam, torch.optim.AdamW: FusedAdamW, torch.optim.SGD: FusedSGD}

# The level defaults. cast: the model is cast to dtype; autocast: forward under torch.autocast;
# cast_inputs/outputs_fp32: what the model's forward does to its floating inputs and low-precision outputs.
_LEVELS = {
    "O0": dict(cast=False, autocast=False, cast_inputs=False, outputs_fp32=False,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0),
    "O1": dict(cast=False, autocast=True, cast_inputs=False, outputs_fp32=True,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale="dynamic"),
    "O2": dict(cast=True, autocast=False, cast_inputs=True, outputs_fp32=True,
               keep_batchnorm_fp32=True, master_weights=True, loss_scale="dynamic"),
    "O3": dict(cast=True, autocast=False, cast_inputs=True, outputs_fp32=False,
               keep_batchnorm_fp32=False, master_weights=False, loss_scale=1.0),
}


@dataclass(frozen=True)
class AmpProperties:
    """What initialize() resolved for a model: the level's defaults with the overrides applied."""

    opt_level: str
    dtype: torch.dtype
    cast_model: bool            # params and buffers stored in dtype (except norm layers when kept FP32)
    autocast: bool              # forward runs under torch.autocast(device_type, dtype)
    cast_inputs: bool           # floating inputs of model(...) are cast to dtype
    outputs_fp32: bool          # float16/bfloat16 outputs of model(...) are cast to float32
    keep_batchnorm_fp32: Optional[bool]  # norm layers kept FP32 (None: the model is not cast)
    master_weights: Optional[bool]       # FP32 master copies in the fused optimizer for low-precision params
    loss_scale: Union[str, float]        # "dynamic" or the static scale (1.0: the scaler is disabled)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["dtype"] = str(self.dtype).replace("torch.", "")
        return d


def properties(model: nn.Module) -> Optional[AmpProperties]:
    """The AmpProperties initialize() applied to ``model``, or None if it has not been initialized."""
    return getattr(model, "_mpfused_amp", None)


# ---- casting helpers ------------------------------------------------------------------------------
def _cast_floating(obj, dtype: torch.dtype, only: Optional[tuple] = None):
    """``obj`` with every floating tensor (or only those whose dtype is in ``only``) cast to ``dtype``,
    through nested lists, tuples (namedtuples included), dicts and dataclass instances (a copy, the original
    left as it is). Anything else is returned as is."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.dtype != dtype and (only is None or obj.dtype in only):
            return obj.to(dtype)
        return obj
    if isinstance(obj, tuple):
        items = [_cast_floating(v, dtype, only) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return [_cast_floating(v, dtype, only) for v in obj]
    if isinstance(obj, dict):
        items = [(k, _cast_floating(v, dtype, only)) for k, v in obj.items()]
        try:
            return type(obj)(items)
        except TypeError:  # e.g. defaultdict, whose constructor wants a factory first
            return dict(items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # A copy with its fields cast (frozen ones too), made without calling __init__ or __post_init__
        changed = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            cast = _cast_floating(value, dtype, only)
            if cast is not value:
                changed[f.name] = cast
        if not changed:
            return obj
        out = copy.copy(obj)
        for name, value in changed.items():
            object.__setattr__(out, name, value)
        return out
    return obj


class _InstanceSignature:
    """``__signature__`` of a _CastingForward: the forward's it calls; None on the class itself (which
    inspect then reads as usual) and where the forward has none."""

    def __get__(self, obj, cls=None):
        if obj is None:
            return None
        try:
            return inspect.signature(obj._forward())
        except (TypeError, ValueError):
            return None


class _CastingForward:
    """Replaces a module's forward (as an instance attribute): casts the floating inputs, optionally runs
    under torch.autocast, casts the outputs. A plain object, so deepcopy rebinds it to the copy and
    torch.save can pickle the module. Calls the class's forward, or the instance forward it replaced."""

    def __init__(self, module: nn.Module, *, input_dtype=None, autocast=None, output_dtype=None,
                 output_from: Optional[tuple] = None) -> None:
        self.module = module
        self.inner = module.__dict__.get("forward")  # an instance-level forward set before us, if any
        self.input_dtype = input_dtype
        self.autocast = autocast                      # None or the autocast dtype
        self.output_dtype = output_dtype
        self.output_from = output_from

    def _forward(self):
        return self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)

    # The forward's own signature and name: code that reads them (the Hugging Face Trainer keeps the dataset
    # columns that forward's signature names) sees the model's, not (*args, **kwargs).
    __signature__ = _InstanceSignature()

    @property
    def __name__(self) -> str:
        return getattr(self._forward(), "__name__", "forward")

    @property
    def __code__(self):
        """Our own __call__'s code: torch.export (non-strict) reads the forward's ``__code__`` for the name, file
        and line it reports, and raised AttributeError on an initialized model."""
        return type(self).__call__.__code__

    def __call__(self, *args, **kwargs):
        if self.input_dtype is not None:
            args = _cast_floating(args, self.input_dtype)
            kwargs = _cast_floating(kwargs, self.input_dtype)
        forward = self._forward()
        if self.autocast is not None:
            # the model's device now (it may have moved since initialize): autocast for another device type
            # leaves the forward in FP32
            with torch.autocast(device_type=_model_device(self.module).type, dtype=self.autocast):
                out = forward(*args, **kwargs)
        else:
            out = forward(*args, **kwargs)
        if self.output_dtype is not None:
            out = _cast_floating(out, self.output_dtype, self.output_from)
        return out


class _ReplicaCasting:
    """``_replicate_for_data_parallel`` of a module whose forward amp replaced (set on the instance). nn.DataParallel
    makes its replicas with it: a shallow copy of the module's ``__dict__``, so each replica's casting forward would
    call the original module's forward, on the original's params (on device 0). The replica's is rebound to the
    replica. A plain object, as _CastingForward: deepcopy and pickle rebind or keep it with the module."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self) -> nn.Module:
        replica = type(self.module)._replicate_for_data_parallel(self.module)
        replica.__dict__.pop("_replicate_for_data_parallel", None)  # (the original's: a replica is not replicated)
        fwd = replica.__dict__.get("forward")
        if isinstance(fwd, _CastingForward) and fwd.module is self.module:
            fwd = copy.copy(fwd)
            fwd.module = replica
            inner = fwd.inner
            if inner is not None and getattr(inner, "__self__", None) is self.module:  # a bound method of the original
                fwd.inner = inner.__func__.__get__(replica)
            replica.forward = fwd
        return replica


def _beside(t, p: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``t`` where it is a ``dtype`` tensor of ``p``'s shape on its device (a master loaded into
    the optimizer's state before initialize), else None."""
    if isinstance(t, torch.Tensor) and t.dtype == dtype and t.shape == p.shape and t.device == p.device:
        return t
    return None


def _cast_forward(module: nn.Module, **kw) -> None:
    """Replaces ``module``'s forward by a _CastingForward (``kw``: its settings), and its replication for
    nn.DataParallel by one that rebinds the replica's."""
    module.forward = _CastingForward(module, **kw)
    module._replicate_for_data_parallel = _ReplicaCasting(module)


def _replaced_step(self, *args, **kwargs):
    """The step of an optimizer that amp.initialize replaced by a fused one: bound to it as a method (LR
    schedulers wrap ``optimizer.step.__func__``); torch's optimizers pickle without it."""
    raise RuntimeError(f"this {type(self).__name__} was replaced by the {self._mpfused_replaced_by} that "
                       "mpfused.amp.initialize returned, which holds its state and the FP32 master weights: step "
                       "that one (and attach LR schedulers to it)")


def _cast_module_(module: nn.Module, dtype: torch.dtype, seen: set) -> dict:
    """Casts the module's own floating params (in place through .data: the Parameter objects, and so
    every optimizer's references to them, stay the same) and floating buffers to dtype. Returns
    {param: its FP32 data before the cast}, the exact values for the FP32 master copies."""
    originals = {}
    for name, p in module._parameters.items():
        if p is None or id(p) in seen:
            continue
        seen.add(id(p))
        if p.is_floating_point() and p.dtype != dtype:
            old = p.data
            p.data = old.to(dtype)
            if p.grad is not None:
                p.grad = p.grad.to(dtype)
            originals[p] = old
    for name, b in module._buffers.items():
        if b is not None and b.is_floating_point() and b.dtype != dtype:
            module._buffers[name] = b.to(dtype)
    return originals


# ---- argument checks ------------------------------------------------------------------------------
def _check_loss_scale(loss_scale) -> Union[str, float]:
    if isinstance(loss_scale, str):
        if loss_scale != "dynamic":
            raise ValueError(f"loss_scale must be \"dynamic\" or a positive number, got {loss_scale!r}")
        return loss_scale
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, numbers.Real):  # (numpy scalars too)
        raise ValueError(f"loss_scale must be \"dynamic\" or a positive number, got {type(loss_scale).__name__} "
                         f"{loss_scale!r}")
    try:
        value = float(loss_scale)
    except OverflowError:  # (an int beyond any float)
        value = math.inf
    if not math.isfinite(value) or value < 2.0**-126 or value > 3.4e38:  # (the scaler's float32 range: 2**-126 up)
        raise ValueError(f"loss_scale must be a positive finite number in [2**-126, 3.4e38] (a static scale) or "
                         f"\"dynamic\", got {loss_scale!r}")
    return value


def _check_optional_bool(name: str, value) -> None:
    if value not in (None, True, False) or (value is not None and not isinstance(value, bool)):
        raise ValueError(f"{name} must be None, True or False, got {value!r}")


def _resolve(opt_level, dtype, keep_batchnorm_fp32, loss_scale, master_weights) -> AmpProperties:
    if not isinstance(opt_level, str) or opt_level not in _LEVELS:
        raise ValueError(f"unknown opt_level {opt_level!r}: expected one of {', '.join(OPT_LEVELS)} "
                         "(the letter O and a digit)")
    if dtype not in _LOW_DTYPES:
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype!r}")
    _check_optional_bool("keep_batchnorm_fp32", keep_batchnorm_fp32)
    _check_optional_bool("master_weights", master_weights)
    level = _LEVELS[opt_level]
    if not level["cast"] and master_weights:  # (as apex refuses it: nothing would keep a master)
        raise ValueError(f"master_weights=True has no meaning at {opt_level}: {opt_level} keeps the model's params in "
                         "FP32, which are their own masters (FP32 masters are for O2 and O3)")
    if not level["cast"] and keep_batchnorm_fp32 is False:
        raise ValueError(f"keep_batchnorm_fp32=False cannot hold at {opt_level}: {opt_level} keeps the whole "
                         "model in FP32 (use O3 for low-precision normalization layers)")
    keep = level["keep_batchnorm_fp32"] if keep_batchnorm_fp32 is None else keep_batchnorm_fp32
    if not level["cast"]:
        keep = None
    return AmpProperties(
        opt_level=opt_level, dtype=dtype, cast_model=level["cast"], autocast=level["autocast"],
        cast_inputs=level["cast_inputs"], outputs_fp32=level["outputs_fp32"], keep_batchnorm_fp32=keep,
        # FP32 params need no master copy: the override only matters where the model is cast.
        master_weights=(level["master_weights"] if master_weights is None else master_weights) if level["cast"] else False,
        loss_scale=level["loss_scale"] if loss_scale is None else _check_loss_scale(loss_scale))


def _model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def _fused_kwargs(cls, defaults: dict) -> dict:
    accepted = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in defaults.items() if k in accepted and k not in ("self", "params", "master_weights")}


# The hooks a torch.optim.Optimizer keeps per instance (register_step_pre_hook and the like).
_OPTIMIZER_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                    "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                    "_optimizer_load_state_dict_post_hooks")


def _convert_optimizer(opt, master_weights):
    """The fused optimizer that continues ``opt``: same param groups (the same Parameter objects), the
    same hyperparameters and extra group keys, the same state (moments, step counts), the same hooks."""
    fused_cls = _CONVERTIBLE[type(opt)]
    if getattr(opt.step, "_wrapped_by_lr_sched", False):
        warnings.warn(f"an LR scheduler is attached to this {type(opt).__name__}; amp.initialize replaces the "
                      f"optimizer by a {fused_cls.__name__}, and the scheduler keeps driving the old one. "
                      "Create LR schedulers after amp.initialize.", stacklevel=3)
    # The user's hooks on opt are not run by the hand-over below (a state_dict post-hook that edits the dict,
    # e.g. to shrink a checkpoint, would edit what the fused optimizer loads), and then become the fused
    # optimizer's: the very same dicts, so that a handle from opt.register_..._hook still removes its hook.
    hooks = {name: opt.__dict__[name] for name in _OPTIMIZER_HOOKS if isinstance(opt.__dict__.get(name), dict)}
    for name, d in hooks.items():
        opt.__dict__[name] = type(d)()
    try:
        fused = fused_cls([{"params": list(g["params"])} for g in opt.param_groups],
                          master_weights=master_weights, **_fused_kwargs(fused_cls, opt.defaults))
        # torch.optim state dicts load into the fused optimizers: every group's hyperparameters (and any
        # extra keys, e.g. a scheduler's initial_lr) and the state tensors (FP32 stays FP32). The tensors are
        # taken over, not copied: no second copy of the moments, even for a moment; opt must not step again.
        fused.load_state_dict(opt.state_dict())
    finally:
        opt.__dict__.update(hooks)
    for name, d in hooks.items():
        d.update(fused.__dict__.get(name) or {})  # (none: a new fused optimizer registers no hook of its own)
        fused.__dict__[name] = d
    return fused


# ---- the entry point ------------------------------------------------------------------------------
def initialize(model: nn.Module, optimizer=None, opt_level: str = "O1", *, dtype: torch.dtype = torch.float16,
               keep_batchnorm_fp32: Optional[bool] = None, loss_scale: Union[str, float, None] = None,
               master_weights: Optional[bool] = None):
    """Sets up mixed-precision training at ``opt_level`` and returns ``(model, optimizer, scaler)``.

    ``model``: an FP32 ``nn.Module``; it is modified in place (its Parameter objects are kept, so
    optimizers and other references to them stay valid) and returned.

    ``optimizer``: None, one optimizer or a list/tuple of them, all over params of ``model``. A
    ``torch.optim.Adam``, ``AdamW`` or ``SGD`` is replaced by ``mpfused.optim.FusedAdam``, ``FusedAdamW``
    or ``FusedSGD`` with the same param groups, hyperparameters and state; a fused optimizer is kept. Any
    other optimizer is kept as is, except where FP32 master weights are needed (O2, or
    ``master_weights=True`` with a low-precision model): that is an error. A torch optimizer over the
    weight of an ``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True`` is kept as is where no masters
    are needed (the fused optimizers take no sparse gradients), and is an error where they are, as is a
    fused optimizer over one. Create LR schedulers after this call (they hold a reference to the optimizer).
    The hooks registered on a replaced optimizer (``register_step_pre_hook`` and the other per-optimizer
    hooks) are the fused one's: the two share them, so their handles stay valid (and a hook registered on
    the old one later runs on the new one); the replacement itself runs none of them.

    ``opt_level``: "O0" FP32 (the accuracy baseline, loss scale 1); "O1" FP32 weights, forward under
    ``torch.autocast(device_type, dtype)`` with its low-precision outputs returned as FP32, dynamic loss
    scaling; "O2" model in ``dtype`` except normalization layers (``NORM_LAYERS``: the BatchNorm and
    InstanceNorm family, LayerNorm, GroupNorm, ...) which compute in FP32, floating inputs cast to
    ``dtype`` and outputs back to FP32, FP32 master weights in the fused optimizer, dynamic loss scaling;
    "O3" everything in ``dtype`` (inputs cast, outputs left in ``dtype``), loss scale 1 (the speed
    baseline).

    Overrides (None: the level's default): ``keep_batchnorm_fp32`` (O2/O3); ``loss_scale``: "dynamic"
    or a positive number, a static scale; ``master_weights``: whether the fused optimizer keeps FP32
    masters for the low-precision params, for every param group. Left None, a fused optimizer's group that
    set its own ``master_weights`` (True, False or ``"remainder"``, which needs ``dtype=torch.bfloat16``)
    keeps it, and the others take the level's; masters and remainders start from the exact FP32 values.

    The scaler is an ``mpfused.GradScaler`` on the model's device: dynamic, static
    (``dynamic=False`` at the given scale) or, for a scale of exactly 1, disabled (``scale`` returns the
    loss as is, ``step`` calls ``optimizer.step()``, ``update`` does nothing, ``get_scale()`` is 1.0;
    steps are then not checked for inf/NaN, as in plain training). The same loop works at every level.
    With several optimizers call ``scaler.step`` on each, then ``scaler.update()`` once.
    """
    props = _resolve(opt_level, dtype, keep_batchnorm_fp32, loss_scale, master_weights)

    # ---- validate everything before anything is modified ----
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if properties(model) is not None:
        raise RuntimeError(f"this model was already initialized by mpfused.amp.initialize "
                           f"(opt_level {properties(model).opt_level}); call it once, on the FP32 model")
    names = {}
    for name, p in model.named_parameters():
        names[id(p)] = name
        if p.is_floating_point() and p.dtype != torch.float32:
            raise ValueError(f"amp.initialize expects an FP32 model, but parameter {name!r} is {p.dtype}; call it "
                             "on the FP32 model (the level decides what is cast)")
    if optimizer is None:
        optimizers, container = [], None
    elif isinstance(optimizer, (list, tuple)):
        optimizers, container = list(optimizer), type(optimizer)
    else:
        optimizers, container = [optimizer], "single"
    for k, opt in enumerate(optimizers):
        where = f"optimizer {k}" if container not in (None, "single") else "optimizer"
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"{where} must be a torch.optim.Optimizer, got {type(opt).__name__}")
        if any(o is opt for o in optimizers[:k]):
            raise ValueError(f"{where} is the same object as optimizer {next(j for j, o in enumerate(optimizers) if o is opt)}; "
                             "pass each optimizer once (each would become a fused optimizer of its own over the "
                             "same masters)")
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                if id(p) not in names:
                    raise ValueError(f"{where}: param {pi} of param group {gi} (shape {tuple(p.shape)}, {p.dtype}) "
                                     "is not a parameter of the model; amp.initialize casts the model's params, "
                                     "so every optimized param must belong to it")
    if props.cast_model and props.keep_batchnorm_fp32:
        # a param shared by a normalization layer (kept FP32) and another module (cast) cannot be both
        # (a ParameterList or ParameterDict only holds params, e.g. a list of those without weight decay)
        owners: dict = {}
        for mname, module in model.named_modules():
            if isinstance(module, (nn.ParameterList, nn.ParameterDict)):
                continue
            kind = isinstance(module, NORM_LAYERS)
            for pname, p in module._parameters.items():
                if p is None:
                    continue
                other = owners.setdefault(id(p), (kind, f"{mname}.{pname}" if mname else pname))
                if other[0] != kind:
                    norm, rest = (other[1], f"{mname}.{pname}" if mname else pname)[::1 if other[0] else -1]
                    raise ValueError(f"parameter {norm!r} of a normalization layer is also {rest!r}: {opt_level} keeps "
                                     "normalization layers in FP32 and casts the other modules, so a param cannot be "
                                     "both; untie them, or pass keep_batchnorm_fp32=False")
    low_params = props.cast_model and any(p.is_floating_point() for p in model.parameters())
    needs_masters = low_params and props.master_weights is not False
    # Params whose gradients are sparse (nn.Embedding / nn.EmbeddingBag with sparse=True), which the fused
    # optimizers do not take: a torch optimizer over them is kept as it is where no masters are needed
    # (torch's SGD trains them), and is an error where they are, as is a fused optimizer over them.
    sparse = {id(p): f"{mname}.{pname}" if mname else pname for mname, m in model.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
              for pname, p in m._parameters.items() if p is not None and p.requires_grad}  # (a frozen one has no grad)
    keep = set()
    for k, opt in enumerate(optimizers):
        where = f"optimizer {k}" if container not in (None, "single") else "optimizer"
        held = next((sparse[id(p)] for g in opt.param_groups for p in g["params"] if id(p) in sparse), None)
        if held is None or not (isinstance(opt, FusedOptimizer) or type(opt) in _CONVERTIBLE):
            continue
        if isinstance(opt, FusedOptimizer) or needs_masters:
            raise ValueError(
                f"the {where} ({type(opt).__name__}) updates {held!r}, the weight of an embedding with sparse=True, "
                "whose sparse gradients the fused optimizers do not take"
                + (f"; {opt_level} keeps FP32 master weights in a fused optimizer: build the embedding with "
                   "sparse=False, or pass master_weights=False (a torch.optim.SGD is then kept as it is)"
                   if needs_masters else ": build the embedding with sparse=False, or give its params a "
                   "torch.optim.SGD of their own (kept as it is where no masters are needed)"))
        keep.add(id(opt))  # e.g. torch.optim.SGD at O0/O1: it stays, and trains the embedding as in torch
    for k, opt in enumerate(optimizers):
        if type(opt) in _CONVERTIBLE and any(g.get("differentiable", False) for g in opt.param_groups):
            raise ValueError(f"{type(opt).__name__}(differentiable=True) cannot be converted: the fused optimizers "
                             "do not differentiate through step()")
        if needs_masters and not isinstance(opt, FusedOptimizer) and type(opt) not in _CONVERTIBLE:
            raise ValueError(
                f"{opt_level} keeps FP32 master weights inside a fused optimizer, and {type(opt).__name__} cannot "
                "be converted to one: use torch.optim.Adam, AdamW or SGD, or one of mpfused.optim's FusedAdam, "
                "FusedAdamW, FusedSGD, FusedLAMB, FusedLion (or pass master_weights=False to update the "
                "low-precision params directly)")
    # A fused optimizer's group that chose its precision itself (master_weights True, False or "remainder"
    # rather than the default None) keeps it at a level that casts the model, unless initialize's
    # master_weights is given, which sets every group (as apex's keyword sets the level's): "remainder"
    # then needs the model cast to BF16.
    def keeps_own(group: dict) -> bool:
        return props.cast_model and master_weights is None and group.get("master_weights") is not None

    # (The norm layers' params that the level keeps in FP32, as the cast below decides.)
    fp32_norms = {id(p) for m in model.modules() if isinstance(m, NORM_LAYERS)
                  for p in m._parameters.values() if p is not None} if props.keep_batchnorm_fp32 else set()
    for k, opt in enumerate(optimizers):
        where = f"optimizer {k}" if container not in (None, "single") else "optimizer"
        if not isinstance(opt, FusedOptimizer):
            continue
        for gi, group in enumerate(opt.param_groups):
            if not keeps_own(group):
                continue
            check_precision(group, f" (param group {gi} of the {where})")  # a value set on the group directly
            if group["master_weights"] != "remainder":
                continue
            fix = "set that group's master_weights to True, or pass master_weights= to initialize"
            if props.dtype != torch.bfloat16:
                raise ValueError(f"param group {gi} of the {where} has master_weights='remainder', which keeps BF16 "
                                 f"params' masters, but {opt_level} casts the model to {props.dtype}: pass "
                                 f"dtype=torch.bfloat16, or {fix}")
            for pi, p in enumerate(group["params"]):
                if id(p) in fp32_norms:
                    raise ValueError(f"param {pi} of param group {gi} of the {where} ({names[id(p)]!r}) belongs to a "
                                     f"normalization layer, which {opt_level} keeps in FP32, but the group has "
                                     "master_weights='remainder', which needs BF16 params: pass keep_batchnorm_fp32="
                                     f"False, put the normalization params in a group of their own, or {fix}")
    device = _model_device(model)
    fused_needed = any(isinstance(o, FusedOptimizer) or type(o) in _CONVERTIBLE for o in optimizers)
    scaler_enabled = props.loss_scale != 1.0
    if device.type == "cuda" and (fused_needed or scaler_enabled):
        if not has_cuda_kernels():
            raise RuntimeError("the model is on CUDA, but this mpfused build has no CUDA kernels (the fused "
                               "optimizers and the scaler need them); rebuild on a machine with nvcc: "
                               "pip install --no-build-isolation --force-reinstall --no-deps .")

    # ---- optimizers (built over the still-FP32 params: nothing is modified if this fails) ----
    group_masters = props.master_weights if props.cast_model else None
    converted = [_convert_optimizer(o, group_masters) if type(o) in _CONVERTIBLE and id(o) not in keep else o
                 for o in optimizers]
    for opt in converted:
        if isinstance(opt, FusedOptimizer):
            for group in opt.param_groups:
                if not keeps_own(group):
                    group["master_weights"] = group_masters

    # ---- the model ----
    if props.cast_model:
        originals, seen = {}, set()
        keep_norms = bool(props.keep_batchnorm_fp32)
        if keep_norms:  # the norms' params stay FP32 wherever else they are held (a ParameterList)
            seen.update(id(p) for m in model.modules() if isinstance(m, NORM_LAYERS)
                        for p in m._parameters.values() if p is not None)
        for module in model.modules():
            if keep_norms and isinstance(module, NORM_LAYERS):
                # FP32 params and statistics; FP32 in, the model's dtype out.
                for p in module._parameters.values():
                    if p is not None:
                        seen.add(id(p))
                _cast_forward(module, input_dtype=torch.float32, output_dtype=props.dtype,
                                                 output_from=(torch.float32,))
                continue
            originals.update(_cast_module_(module, props.dtype, seen))
        # The exact FP32 values become the master copies (not the rounded low-precision params); with
        # master_weights="remainder", the param and its remainder that hold them (the param then differs
        # from the cast only where the value lies halfway between two BF16 values: the split rounds ties
        # away from zero). An FP32 master the optimizer's state already holds (a checkpoint loaded before
        # initialize) is taken instead: it has the low bits that the model's saved low-precision weights lost.
        # (The first step compares every param with its master, and elements that differ follow the param.)
        for opt in converted:
            if not isinstance(opt, FusedOptimizer):
                continue
            for group in opt.param_groups:
                if group["master_weights"] is False:
                    continue
                for p in group["params"]:
                    if p in originals:
                        o = originals[p]  # FP32; the master needs the param's memory layout
                        state = opt.state[p]
                        saved = _beside(state.get("master_param"), p, torch.float32)
                        master = o if saved is None else saved
                        if group["master_weights"] == "remainder" and p.dtype == torch.bfloat16:
                            hi, state["master_remainder"] = split_master(master, p)
                            with torch.no_grad():
                                p.copy_(hi)
                            state.pop("master_param", None)
                        else:
                            state["master_param"] = master if same_layout(master, p) else like(master, p, torch.float32)
                            state.pop("master_remainder", None)
        _cast_forward(
            model, input_dtype=props.dtype if props.cast_inputs else None,
            output_dtype=torch.float32 if props.outputs_fp32 else None, output_from=_LOW_DTYPES)
    elif props.autocast:
        _cast_forward(model, autocast=props.dtype, output_dtype=torch.float32,
                                        output_from=_LOW_DTYPES)
    model._mpfused_amp = props

    # The optimizers replaced: their state tensors are the fused ones' now, and their params low precision
    # without masters. A step of one (a framework that kept the reference) would train past the masters
    # and disturb their moments, in silence: it raises instead. (apex patches the optimizers in place.)
    for old, new in zip(optimizers, converted):
        if new is not old:
            old._mpfused_replaced_by = type(new).__name__
            old.step = types.MethodType(_replaced_step, old)

    # ---- the scaler ----
    if props.loss_scale == "dynamic":
        scaler = GradScaler(str(device))
    elif props.loss_scale == 1.0:
        scaler = GradScaler(str(device), enabled=False)
    else:
        scaler = GradScaler(str(device), init_scale=props.loss_scale, dynamic=False)

    if container is None:
        out_opt: Any = None
    elif container == "single":
        out_opt = converted[0]
    else:
        out_opt = container(converted)
    return model, out_opt, scaler
