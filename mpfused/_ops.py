"""Typed wrappers over the native kernels: the only Python that calls them.

The kernels are torch operators, ``torch.ops.mpfused.*``, registered by the native extension (one family
per file under csrc/torch/, each with its schema, mutations marked, and its CPU and CUDA kernels; those
kernels validate every tensor argument before anything is written). This module adds what torch needs
around them in Python: fake (meta) kernels, so that torch.compile and FakeTensor can propagate shapes
without running anything, and the GEMM's autograd formula. The wrappers below only turn Python values
into schema types (lists, optional per-param tensors, 64-bit unsigned ints) and say which Python type
was expected where one is wrong; every other check is the operator's.

Loading checks first that the installed torch is the one the extension was compiled against: torch's
C++ ABI changes between releases, and a mismatch would otherwise surface as an obscure
``undefined symbol`` error (or a crash) deep inside an import.
"""

from __future__ import annotations

import importlib
import math
import numbers
import operator
from itertools import repeat
from typing import Optional, Sequence

import torch
from torch.utils import _python_dispatch
from torch.utils._device import DeviceContext as _DeviceContext

_REBUILD = "pip install --no-build-isolation --force-reinstall --no-deps ."


def _load_native():
    try:
        config = importlib.import_module("mpfused._build_config")
    except ImportError:
        raise ImportError(
            "mpfused's native extension has not been built. From the source tree run: "
            "pip install --no-build-isolation ."
        ) from None
    if torch.__version__ != config.TORCH_VERSION:
        raise ImportError(
            f"mpfused was built against torch {config.TORCH_VERSION}, but torch {torch.__version__} is "
            "installed. torch's C++ ABI differs between releases, so the extension must be rebuilt "
            f"against the installed torch: {_REBUILD}"
        )
    try:
        return importlib.import_module("mpfused._C")
    except ImportError as e:
        if "undefined symbol" in str(e) or "symbol lookup" in str(e):
            raise ImportError(
                f"mpfused._C does not match the installed torch {torch.__version__} ({e}). "
                f"Rebuild it: {_REBUILD}"
            ) from e
        raise


_C = _load_native()  # loading it registers the operators (torch.ops.mpfused.*)
_C.build_info()  # a bad MPFUSED_CPU_ISA raises its ValueError here, at import, not in a kernel
ops = torch.ops.mpfused


def build_info() -> dict:
    """What the extension was compiled with: version, torch version, CUDA version and arch list
    (None in a CPU-only build) and whether OpenMP parallelises the CPU kernels."""
    return dict(_C.build_info())


def has_cuda_kernels() -> bool:
    return _C.build_info()["cuda_version"] is not None


def overflow_limits(device_type: str) -> dict:
    """Chunk size and per-launch capacities (tensors, chunks) of the overflow reduction on
    ``device_type`` ("cpu" or "cuda")."""
    return dict(_C.overflow_limits()[device_type])


def overflow_planned_launches(numel: Sequence[int], device_type: str) -> int:
    """Kernel launches the overflow reduction makes for tensors of these sizes (the C++ plan itself)."""
    return int(_C.overflow_planned_launches([int(n) for n in numel], device_type))


def _tensor_list(tensors, name: str) -> list:
    if isinstance(tensors, torch.Tensor):
        raise TypeError(f"{name} must be a list or tuple of tensors, got a single tensor; wrap it: [t]")
    try:
        out = list(tensors)
    except TypeError:
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}") from None
    if any(not isinstance(t, torch.Tensor) or intercepts_dispatch(t) or t.layout != torch.strided or t.is_nested
           for t in out):  # then say which
        for i, t in enumerate(out):
            _plain(t, f"{name}[{i}]")
    return out


def _tracing_types() -> tuple:
    """torch's own tracing tensors: FakeTensor (torch.export, FakeTensorMode, make_fx's fake and symbolic
    modes) and FunctionalTensor (functionalization). They override ``__torch_dispatch__`` too, but an
    operator called on them runs its fake kernel, which is what tracing needs."""
    global _TRACING_TYPES
    if _TRACING_TYPES is None:
        from torch._subclasses.fake_tensor import FakeTensor
        from torch._subclasses.functional_tensor import FunctionalTensor
        _TRACING_TYPES = (FakeTensor, FunctionalTensor)
    return _TRACING_TYPES


_TRACING_TYPES = None


def intercepts_dispatch(t) -> bool:
    """Whether ``t`` is a tensor subclass that overrides ``__torch_dispatch__`` (DTensor, wrapper subclasses):
    such a tensor takes an operator through its own dispatch, so the kernels never see its memory. A plain
    subclass (``class T(torch.Tensor)``, Parameter) does not, and neither do torch's tracing tensors
    (_tracing_types): with them the operators trace as they are, fused (before, torch.export's default
    non-strict mode saw gemm and round_stochastic refuse its FakeTensors, and FusedLinear export as
    F.linear + the activation, which rounds twice)."""
    return (isinstance(t, torch.Tensor) and type(t).__torch_dispatch__ is not torch._C._disabled_torch_dispatch_impl
            and not isinstance(t, _tracing_types()))


def _plain(t, name: str, optional: bool = False):
    """``t`` itself when it is a tensor the kernels can take (or None where ``optional``); a TypeError naming
    the argument for a non-tensor, and for a subclass that intercepts dispatch (see intercepts_dispatch)."""
    if t is None and optional:
        return t
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor{' or None' if optional else ''}, got {type(t).__name__}")
    if intercepts_dispatch(t):
        raise TypeError(f"{name} is a tensor subclass ({type(t).__name__}) that overrides __torch_dispatch__ (such as "
                        "DTensor); mpfused's kernels take plain dense tensors. Pass its local data (for DTensor: "
                        ".to_local()).")
    check_strided(t, name)
    return t


def check_strided(t: torch.Tensor, name: str) -> None:
    """A ValueError naming ``name`` (as the operators' own check_dense) for a nested or sparse tensor, which
    the kernels cannot take: the dispatcher's message named a backend key ("NestedTensorCPU"), not the
    argument, and Python code before the operator failed on one first."""
    if t.is_nested:
        raise ValueError(f"{name} must be a dense (strided) tensor, got a nested tensor: pad it "
                         "(torch.nested.to_padded_tensor) or pass its components")
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got a {str(t.layout).replace('torch.', '')} "
                         "tensor: convert it with .to_dense()")


def non_finite_check_(
    tensors: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: Optional[torch.Tensor] = None,
    *,
    unscale: bool = False,
    sumsq: Optional[torch.Tensor] = None,
    overwrite: bool = False,
    norm: Optional[torch.Tensor] = None,
    counter: Optional[torch.Tensor] = None,
) -> None:
    """Checks every element of every tensor for inf/NaN in one pass (one launch per list on CUDA).

    - ``found_inf`` (float32, one element): set to 1.0 when any element is inf or NaN; a flag that is
      already set stays set. Consumers should test ``found_inf != 0``.
    - ``inv_scale`` (float32, one element, optional): values are multiplied by it, in FP32.
    - ``unscale=True``: the products are written back in place, rounded to each tensor's dtype (the
      same bits as ``(t.float() * inv_scale).to(t.dtype)``). Needs ``inv_scale``.
    - ``sumsq`` (float32, one element, optional): receives ``+=`` the FP32 sum of squares of the
      (unscaled) values, for global-norm clipping.

    - ``overwrite=True``: ``found_inf`` (0.0 or 1.0) and ``sumsq`` hold this call's result alone, so they
      may be fresh ``torch.empty`` tensors: no zero fill is needed (an empty list writes zeros).
    - ``norm`` (float32, one element, optional, needs ``sumsq``): set to ``sqrt(sumsq)`` in the same launch.
    - ``counter`` (int32, one element, zero, optional): scratch the CUDA kernel borrows for its last-block
      reduction and leaves zero, sparing a memset per call. Two launches running at once must not share one
      (borrowed_counter gives one per device and stream); the kernel traps when it finds its counter shared.
      With overwrite, norm and counter, the whole check is one kernel launch per list on CUDA.

    Tensors may be float32, float16 and bfloat16 in one list; they must be contiguous and on the device
    of ``found_inf``. Empty tensors are skipped. Nothing is written when an argument is invalid.
    Never synchronises the host with the device.
    """
    if unscale.__class__ is not bool or overwrite.__class__ is not bool:
        unscale, overwrite = _switch("unscale", unscale), _switch("overwrite", overwrite)
    if _direct() and _C.overflow_call(unscale, tensors, found_inf, inv_scale, sumsq, overwrite, norm,
                                      counter):
        return  # (plain tensors in a list: the common case, called from C++; see optim_step_direct)
    tensors = _tensor_list(tensors, "tensors")
    found_inf = _plain(found_inf, "found_inf")
    inv_scale, sumsq, norm, counter = (_plain(t, n, optional=True) for t, n in (
        (inv_scale, "inv_scale"), (sumsq, "sumsq"), (norm, "norm"), (counter, "counter")))
    if unscale:
        if inv_scale is None:
            raise ValueError("unscale=True needs inv_scale (a float32 tensor with one element)")
        ops.unscale_check_(tensors, found_inf, inv_scale, sumsq, overwrite, norm, counter)
    else:
        ops.non_finite_check_(tensors, found_inf, inv_scale, sumsq, overwrite, norm, counter)


def is_switch(value) -> bool:
    """Whether ``value`` is a True/False switch: a bool, numpy's bool, or a number equal to 0 or 1 (Python's
    and numpy's). Not a string, None or a tensor, which bool() would read as well ("False" as True)."""
    if value is True or value is False:
        return True
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"):  # (numpy 2 names it "bool")
        return True
    return isinstance(value, numbers.Real) and value in (0, 1)


def _switch(name: str, value) -> bool:
    """A True/False argument, checked (is_switch): bool() would take "False" as True."""
    if is_switch(value):
        return bool(value)
    raise ValueError(f"{name} must be True or False, got {value!r}")


def _direct() -> bool:
    """Whether an operator may be called from C++ (_C.*_call) rather than through torch.ops: in eager mode
    (torch.compile traces torch.ops) with no torch function mode active that would see the call (torch.ops
    hands it the call). torch's default-device mode (``torch.set_default_device``, ``with torch.device``)
    passes every call that creates no tensor through unchanged, so it does not count. The _C functions
    themselves decline any argument that is not a plain tensor. See optim_step_direct."""
    if torch.compiler.is_compiling():
        return False
    if not torch._C._is_torch_function_mode_enabled():
        return True
    return all(type(torch._C._get_function_stack_at(i)) is _DeviceContext
               for i in range(torch._C._len_torch_function_stack()))


def _int64(*values) -> bool:
    """Whether every value fits the schema's int (the _C.*_call functions take C++ int64_t: pybind11 would
    refuse a larger one with a TypeError of its own, where torch.ops names the argument)."""
    return all(-(1 << 63) <= v < 1 << 63 for v in values)


def _capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is capturing a CUDA graph."""
    if device.index is None or device.index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def borrowed_counter(store: dict, device: torch.device) -> Optional[torch.Tensor]:
    """The zeroed int32 counter that a CUDA kernel borrows for its last-block reduction and leaves zero
    (the ``counter`` argument of non_finite_check_ and optim_step_), from ``store``, a dict its owner keeps.

    One counter per (device, stream): two launches that run at the same time never share one (a shared
    counter would let a block reduce partials not yet written; the kernels trap when a counter passes their
    block count). None where none is lent, so that the kernel uses scratch counters of its own, zeroed by
    a memset in stream order:

    - on the CPU, whose kernels need none;
    - while a CUDA graph is being captured: a counter created now would be zeroed only when the graph
      replays (an eager call after the capture would find garbage in it), and one created before would be
      shared between the graph's replays and eager calls on any other stream. The graph then holds its own
      scratch counters and their memsets (one node each);
    - under torch.compile, which traces no stream: a counter baked into compiled code would be shared by
      its calls on every stream (and one created while the first call is captured would never be zeroed).
    """
    if device.type != "cuda" or torch.compiler.is_compiling():
        return None
    if device.index is None:  # the default stream's id is 0 on every device: key by the actual device
        device = torch.device("cuda", torch.cuda.current_device())
    if _capturing(device):
        return None
    key = (device, torch.cuda.current_stream(device).stream_id)
    counter = store.get(key)
    if counter is None:
        counter = store[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


_POLICIES = {name: dict(spec) for name, spec in dict(_C.optim_policies()).items()}


def optim_policies() -> dict:
    """The optimizer policies the kernels implement (csrc/core/optim/registry.h): for each name, its state
    tensors and hyperparameters in kernel order."""
    return {name: {k: list(v) for k, v in spec.items()} for name, spec in _POLICIES.items()}


_ROUNDINGS = ("nearest", "stochastic")


def optim_step_(policy: str, params, grads, masters, states: dict, steps, *, lr, hyper: dict, inv_scale=None,
                grad_scale=None, clip_sumsq=None, max_norm: float = math.inf, found_inf=None, counter=None,
                write_grad: bool = False, remainders=(), rounding: str = "nearest", seed: int = 0,
                sr_offsets=()) -> None:
    """One fused step of the optimizer ``policy`` ("adam", "sgd", "lamb", "lion") over params of one device
    (any mix of FP32/FP16/BF16), in one pass per element (two for LAMB):

    - the gradient times ``inv_scale`` (or ``1 / grad_scale``, computed on the device), and with
      ``clip_sumsq`` (the sum of squares of the unscaled gradients, on the device) times torch's clip
      coefficient ``min(1, max_norm / (sqrt(clip_sumsq) + 1e-6))`` (``max_norm`` infinite: 1; the policy
      also sees the resulting norm, e.g. LAMB's max_grad_norm);
    - the policy's update of the FP32 weight (``masters[i]`` when given, else the param itself) and of its
      FP32 ``states`` (a dict: state name -> one tensor per param; names in ``optim_policies()``; a state the
      step does not use may be omitted), and the param stored in its dtype;
    - ``steps``: per param a float32 one-element tensor of steps taken, += 1 when the step is taken, for
      the policies that count steps (not Lion, nor SGD without momentum: then ignored, may be ``[]``).

    ``hyper``: every hyperparameter of the policy by name; a number (flags 0/1 or bools), or, for those
    torch lets be tensors (Adam's betas, SGD's weight_decay; Lion's and LAMB's betas too), a one-element
    float32/float64 tensor on the params' device, read by the update itself. Params, grads, masters and states must be distinct tensors
    (the kernels read them as non-overlapping arrays). ``lr``: a float or
    a one-element float32 tensor on the device. When ``found_inf`` != 0 nothing is written, steps included.
    ``counter`` (a zero int32 tensor of one element, optional): with it the CUDA update's last block
    increments the step counters, sparing a launch; one per stream (borrowed_counter), never shared by two
    launches that may run at once. ``write_grad``: a taken step also writes the gradient
    it used (unscaled and clipped) back into ``grads``, as torch's fused optimizers leave p.grad unscaled.
    Params may have any dense layout (channels_last, ...) that their grads, masters and states share.

    ``remainders``: empty, or per param None or an int16 tensor beside a bfloat16 param without a master:
    the low 16 bits of its FP32 master, which is ``(param bits << 16) + remainder``; the step updates that
    master and writes it back split (the param its round-to-nearest, ties away from zero; see
    csrc/core/master_split.h). ``rounding``: how an FP16/BF16 param is written from its FP32 result (the
    update without a master, or the copy of the master): "nearest" (even), or "stochastic": element ``e`` of
    param ``i`` with the Philox bits of index ``sr_offsets[i] + e`` of stream ``(step number, 1)`` under
    ``seed`` (an int in [0, 2^64)), the step number being that param's step count after this step (read on
    the device: ``steps[i]`` is then required for every 16-bit param without a remainder).
    Validates everything before writing anything; never syncs the host with the device."""
    OptimCall(policy, params, masters, states, steps, remainders=remainders, rounding=rounding, seed=seed,
              sr_offsets=sr_offsets)(grads, lr=lr, hyper=hyper, inv_scale=inv_scale, grad_scale=grad_scale,
                                     clip_sumsq=clip_sumsq, max_norm=max_norm, found_inf=found_inf, counter=counter,
                                     write_grad=write_grad)


def hyper_args(policy: str, hyper: dict) -> tuple:
    """``hyper`` (every hyperparameter of ``policy`` by name: a number, or a one-element tensor where the
    policy takes one) as optim_step_'s schema takes it: the numbers (0.0 for a tensor), and the tensors
    (empty when none)."""
    names = _POLICIES[policy]["hyper"]
    if len(hyper) != len(names) or not all(map(hyper.__contains__, names)):
        raise ValueError(f"hyper for {policy!r} must give exactly {names}; missing "
                         f"{sorted(set(names) - set(hyper))}, unknown {sorted(set(hyper) - set(names))}")
    values = [hyper[n] for n in names]
    tensors = [v if isinstance(v, torch.Tensor) else None for v in values]
    if all(map(operator.is_, tensors, repeat(None))):
        return [float(v) for v in values], []
    return [0.0 if t is not None else float(v) for v, t in zip(values, tensors)], tensors


def _traced_floats(policy: str, lr, hyper: dict, device: torch.device) -> tuple:
    """Under torch.compile: the lr, and the hyperparameters the update may read from a tensor (the betas of
    Adam, Lion and LAMB, SGD's weight_decay), as float64 tensors made in the graph from the Python numbers (exact: 1.0 * x). The
    operator's ``float`` arguments make dynamo compile once per value, so a scheduled lr (or OneCycleLR's
    cycled betas) recompiled every step until torch's recompile limit; a tensor made from the traced number
    keeps it symbolic. The update reads float64 as the number itself: the bits are eager's."""
    def traced(v):
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return torch.ones((), dtype=torch.float64, device=device) * v
        return v
    names = _POLICIES[policy].get("tensor_hyper", ())
    return traced(lr), {k: traced(v) if k in names else v for k, v in hyper.items()}


# optim_step_'s schema positions of what changes from step to step (OptimCall.args fills them)
_GRADS, _LR, _LR_TENSOR, _HYPER, _HYPER_TENSORS, _SCALARS, _COUNTER, _WRITE_GRAD = 2, 11, 12, 13, 14, 15, 20, 21


class OptimCall:
    """``optim_step_`` in two halves: the arguments that a training loop repeats from step to step (the
    policy, the params, their masters, remainders, states and step counters, the rounding, the seed and
    the offsets), turned into the operator's schema types once, here; and those of one step (the grads,
    lr, hyperparameters and the scaler's values), given to :meth:`__call__` (see ``optim_step_`` for the
    meaning of each). FusedOptimizer.step() keeps one per param group while the group's structure holds.
    The operator checks every tensor of every call, before it writes anything."""

    __slots__ = ("_args",)

    def __init__(self, policy: str, params, masters, states: dict, steps, *, remainders=(), rounding: str = "nearest",
                 seed: int = 0, sr_offsets=()) -> None:
        spec = _POLICIES.get(policy)
        if spec is None:
            raise ValueError(f"unknown optimizer policy {policy!r}; expected one of {sorted(_POLICIES)}")
        unknown = set(states) - set(spec["states"])
        if unknown:
            raise ValueError(f"unknown states for {policy!r}: {sorted(unknown)} (expected some of {spec['states']})")
        if rounding not in _ROUNDINGS:
            raise ValueError(f"Invalid rounding: {rounding!r} (expected 'nearest' or 'stochastic')")
        seed = u64_arg(seed, "seed")
        sr_offsets = list(sr_offsets)
        if not (sr_offsets and set(map(type, sr_offsets)) == {int} and min(sr_offsets) >= 0
                and max(sr_offsets) < 1 << 63):
            # (the common case above is already the operator's int64: Python ints below 2^63, unchanged)
            sr_offsets = [u64_arg(o, f"sr_offsets[{i}]") for i, o in enumerate(sr_offsets)]
        params = list(params)  # the operator checks every tensor (and says which)
        n = len(params)
        masters, master_index = _indexed(masters, "masters", n, "master_param")
        remainders, remainder_index = _indexed(remainders, "remainders", n, "master_remainder")
        steps, step_index = _indexed(steps, "steps", n, "step")
        state_tensors, state_index = [], []
        for name in spec["states"]:
            given, index = _indexed(states.get(name, ()), name, n, name)
            if not index:
                state_index += [-1] * n
            elif len(given) == n:  # every param has it: positions in order
                state_index += range(len(state_tensors), len(state_tensors) + n)
            else:
                state_index += [-1 if i < 0 else i + len(state_tensors) for i in index]
            state_tensors += given
        if not state_tensors:
            state_index = []
        self._args = [policy, params, None, masters, master_index, remainders, remainder_index, state_tensors,
                      state_index, steps, step_index, 0.0, None, None, None, None, None, None, math.inf, None, None,
                      False, rounding, seed, sr_offsets]

    def hyper_args(self, hyper: dict) -> tuple:
        return hyper_args(self._args[0], hyper)

    def args(self, grads: list, *, lr, hyper, inv_scale=None, grad_scale=None, clip_sumsq=None,
             max_norm: float = math.inf, found_inf=None, counter=None, write_grad: bool = False,
             params: Optional[list] = None) -> list:
        """The operator's positional arguments for one step. ``hyper``: a dict as optim_step_ takes it, or
        the pair hyper_args made of one. ``params``: this step's params where they are other tensor
        objects than those given when this call was made (a DTensor's local shard)."""
        args = self._args.copy()
        if params is not None:
            args[1] = params
        args[_GRADS] = grads
        if torch.compiler.is_compiling() and args[1] and isinstance(hyper, dict):
            lr, hyper = _traced_floats(self._args[0], lr, hyper, args[1][0].device)
        if isinstance(lr, torch.Tensor):
            args[_LR_TENSOR] = lr
        else:
            args[_LR] = float(lr)
        args[_HYPER], args[_HYPER_TENSORS] = self.hyper_args(hyper) if isinstance(hyper, dict) else hyper
        args[_SCALARS:_SCALARS + 5] = inv_scale, grad_scale, clip_sumsq, float(max_norm), found_inf
        args[_COUNTER] = counter
        args[_WRITE_GRAD] = bool(write_grad)
        return args

    def __call__(self, grads, **step) -> None:
        """One step (see ``args``), through torch.ops: what torch.compile traces, and what torch function
        modes and tensor subclasses see."""
        ops.optim_step_(*self.args(list(grads), **step))


def optim_step_direct(args: list) -> None:
    """The operator call of FusedOptimizer.step()'s planned path in eager mode: ``args`` as OptimCall.args
    gives them, with plain tensors for params, grads and state (the plan checks them: _C.step_layout). The
    same operator through torch's dispatcher (autograd, the profiler, dispatch modes, the CPU and CUDA
    kernels), called from C++ (_C.optim_step_call) instead of through torch.ops' generic
    conversion of each Python argument to its schema type, which costs more than the rest of a small
    model's step (csrc/bindings.cpp). Where that conversion would hand the call to ``__torch_function__``
    (a torch function mode is active, or a scalar argument is a tensor subclass), it goes through torch.ops."""
    if not (_direct() and _C.optim_step_call(*args)):
        ops.optim_step_(*args)


def _indexed(tensors, name: str, n: int, state_key: str) -> tuple:
    """An optional per-param list (empty, or one tensor or None per param) as the operator takes it: the
    tensors given, and per param its position among them or -1 (both empty when none is given). The
    operator checks each tensor; what is not a tensor at all is refused here, with the optimizer state key
    it comes from (``state_key``), where the operator's schema would only name its argument's type."""
    tensors = list(tensors)
    if not tensors:
        return [], []
    if len(tensors) != n:
        raise ValueError(f"{name} must be empty or have one entry per param ({n}), got {len(tensors)}")
    for i, t in enumerate(tensors):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] (state['{state_key}'] of param {i} of the step's call) must be a tensor, got "
                            f"{type(t).__name__} {t!r}: the optimizer keeps it as one, and load_state_dict converts "
                            "numbers")
    if not any(map(operator.is_, tensors, repeat(None))):
        return tensors, list(range(n))
    given = [t for t in tensors if t is not None]
    index, k = [], 0
    for t in tensors:
        index.append(-1 if t is None else k)
        k += t is not None
    return given, index


def follow_writes_(params: list, targets: list, stochastic: bool) -> None:
    """Where code outside a step wrote FP16/BF16 params kept with FP32 masters or BF16 remainders
    (``targets[i]``: ``params[i]``'s master, float32, or remainder, int16), the masters take the written
    values and the remainders that would make a NaN become 0, element by element (csrc/core/follow.h):
    one pass over each param and its target, one launch per 512 tensors on CUDA. ``stochastic``: the masters were
    written with stochastic rounding (a param one of its master's two neighbours keeps the master)."""
    ops.follow_writes_(params, targets, bool(stochastic))


def loss_scale_update_(scale, growth_tracker, hysteresis_left, skipped_steps, found_inf, inv_scale=None, *,
                       growth_factor, backoff_factor, growth_interval, hysteresis, min_scale=None, max_scale=None,
                       dynamic=True) -> None:
    """The dynamic loss-scale update (csrc/core/loss_scale.h) on the scaler's device tensors, in place:
    ``scale`` (float32), ``growth_tracker``, ``hysteresis_left`` (int32), ``skipped_steps`` (int64,
    incremented when ``found_inf != 0``), each of one element (0-d is fine). ``inv_scale`` (optional) is
    refreshed to 1/scale. ``min_scale``/``max_scale`` None: no clamp (torch's rule). One tiny launch on
    CUDA; no host sync."""
    args = (scale, growth_tracker, hysteresis_left, skipped_steps, found_inf, inv_scale, float(growth_factor),
            float(backoff_factor), int(growth_interval), int(hysteresis), 0.0 if min_scale is None else float(min_scale),
            float("inf") if max_scale is None else float(max_scale), bool(dynamic))
    if not (_direct() and _int64(args[8], args[9]) and _C.loss_scale_update_call(*args)):
        ops.loss_scale_update_(*args)


def _number(x, name: str) -> float:
    # A real number only (a Python int or float, numpy's float32 ...): float() of a CUDA tensor would
    # synchronise the host with the device.
    if isinstance(x, (bool, torch.Tensor)) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a Python int or float, got {type(x).__name__}")
    try:
        return float(x)
    except OverflowError:  # (an int beyond any float, such as 10**400)
        raise ValueError(f"{name} must be a number within float range, got an int of {int(x).bit_length()} bits") from None


def gemm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None, activation: Optional[str] = None,
         alpha: float = 1.0, beta: float = 0.0, c: Optional[torch.Tensor] = None,
         out_dtype: Optional[torch.dtype] = None, return_pre_activation: bool = False):
    """``act(alpha * a @ b + beta * c + bias)`` from FP16/BF16 ``a`` and ``b`` with FP32 accumulation, as a
    new tensor (see :func:`mpfused.functional.gemm` for the full contract); differentiable. With
    ``return_pre_activation``: ``(out, pre)``, ``pre`` being the value before the activation in the
    output dtype (``out`` itself when there is no activation). The operator validates every argument
    before anything is allocated or launched."""
    a, b = _plain(a, "a"), _plain(b, "b")
    bias, c = _plain(bias, "bias", optional=True), _plain(c, "c", optional=True)
    if activation is not None and not isinstance(activation, str):
        raise TypeError(f"activation must be None, 'relu', 'gelu' (tanh approximation) or 'gelu_erf', got "
                        f"{type(activation).__name__} {activation!r}")
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be None or a torch.dtype, got {type(out_dtype).__name__} {out_dtype!r}")
    alpha, beta = _number(alpha, "alpha"), _number(beta, "beta")
    if return_pre_activation and activation is not None:
        return ops.gemm_with_pre(a, b, bias, activation, alpha, beta, c, out_dtype)
    out = ops.gemm(a, b, bias, activation, alpha, beta, c, out_dtype)
    return (out, out) if return_pre_activation else out


# ---- random bits and stochastic rounding (csrc/core/philox.h, csrc/core/stochastic.h) ---------------
_U64 = 1 << 64


def check_u64(value, name: str, *, numel: int = 0) -> int:
    """``value`` as a Python int in [0, 2^64), with ``value + numel <= 2^64`` (a seed, or the index of a
    call's first element): a TypeError/ValueError naming ``name`` otherwise. Under torch.compile an int that
    changes between calls is traced: its range checks become the compiled code's guards (make_fx's symbolic
    mode passes a SymInt, whose range is checked as the traced code runs)."""
    if isinstance(numel, torch.Tensor):  # torch.jit.trace gives x.numel() as a 0-d tensor: its value now
        numel = int(numel)
    if isinstance(value, torch.SymInt):
        torch._check(value >= 0, lambda: f"{name} must be in [0, 2**64)")
        torch._check(value + numel <= _U64, lambda: f"{name} + numel must be at most 2**64")
        return value
    if isinstance(value, int) and not isinstance(value, bool):  # (dynamo's traced ints too: no __index__ there)
        v = value
    elif isinstance(value, torch.Tensor) or isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be a Python int in [0, 2**64), got {type(value).__name__} {value!r}")
    else:
        v = int(value.__index__())
    if not 0 <= v < _U64:
        raise ValueError(f"{name} must be in [0, 2**64), got {v}")
    if v + numel > _U64:
        raise ValueError(f"{name} + numel must be at most 2**64 (one stream's element indices), got {name}={v} "
                         f"with {numel} elements")
    return v


def u64_arg(value, name: str, *, numel: int = 0) -> int:
    """``check_u64(value, name, numel=numel)`` as the operators' ``int`` (int64) takes it: the same 64 bits,
    two's complement (csrc/torch/common.h u64_of maps it back)."""
    v = check_u64(value, name, numel=numel)
    if isinstance(v, torch.SymInt):  # a traced int is an int64 already
        return v
    return v - _U64 if v >= 1 << 63 else v


def philox_words(numel: int, seed: int, offset: int = 0, stream: tuple = (0, 0),
                 device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """The random bits of elements ``offset .. offset + numel - 1`` of ``stream`` under ``seed``, as the
    rounding kernels take them (int64 values in [0, 2^32) whose low 16 bits are zero): element ``e`` gets
    16 bits of Philox4x32-10 with key ``(seed & 0xffffffff, seed >> 32)`` and counter ``(e // 8 as two
    words, *stream)``: word ``e // 2 % 4``, low half for even ``e``, high half for odd, shifted up by 16.
    For tests and for users who want the same bits."""
    if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
        raise ValueError(f"numel must be an int >= 0, got {numel!r}")
    seed = check_u64(seed, "seed")
    offset = check_u64(offset, "offset", numel=numel)
    if not (isinstance(stream, tuple) and len(stream) == 2
            and all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**32 for s in stream)):
        raise ValueError(f"stream must be a pair of ints in [0, 2**32), got {stream!r}")
    words = torch.empty(numel, dtype=torch.int32, device=device)
    ops.philox_words_(u64_arg(seed, "seed"), u64_arg(offset, "offset"), stream[0], stream[1], words)
    return words.to(torch.int64) & 0xFFFFFFFF


def philox4x32_10(counters, key) -> torch.Tensor:
    """Philox4x32-10 itself: ``counters`` a sequence of 4-word counters (ints in [0, 2^32)) or an (n, 4)
    integer tensor on the CPU or a CUDA device, ``key`` a pair of words; returns the (n, 4) output words as
    int64 values in [0, 2^32), on the counters' device. For known-answer tests of both backends."""
    if not isinstance(counters, torch.Tensor):
        try:  # (the values' own type first: converted to int64 straight away, a float 1.5 became the word 1)
            own = torch.as_tensor(counters)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            own = None  # (e.g. numpy uint64 beside Python ints, which torch does not promote)
        if own is not None and own.numel() and (own.is_floating_point() or own.is_complex()):
            raise ValueError(f"counters must be (n, 4) integer words, got {own.dtype} values")
        try:
            counters = torch.tensor(counters, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise ValueError(f"counters must be (n, 4) integer words in [0, 2**32): {e}") from None
    if (counters.dim() != 2 or counters.shape[1] != 4 or counters.is_floating_point() or counters.is_complex()
            or counters.dtype == torch.bool):
        raise ValueError(f"counters must be (n, 4) integer words, got {counters.dtype} of shape {tuple(counters.shape)}")
    if counters.device.type not in ("cpu", "cuda"):  # (a meta tensor's words cannot be range-checked)
        raise ValueError(f"counters must be on the CPU or a CUDA device, got a tensor on {counters.device}")
    if counters.dtype in (torch.uint16, torch.uint32):  # (words in range already; torch compares few unsigned types)
        counters = counters.to(torch.int64)
    elif counters.dtype == torch.uint64:
        raise ValueError("counters must be words in [0, 2**32): give them as int64, uint32 or int32 (bit patterns), "
                         "not uint64")
    if counters.dtype != torch.int32 and counters.numel() and (  # int32: taken as the words' bit patterns
            bool((counters < 0).any()) or bool((counters.to(torch.int64) >= 2**32).any())):
        raise ValueError("counters must be words in [0, 2**32) (or an int32 tensor of their bit patterns)")
    if not (isinstance(key, (tuple, list)) and len(key) == 2
            and all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k < 2**32 for k in key)):
        raise ValueError(f"key must be a pair of ints in [0, 2**32), got {key!r}")
    as_i32 = (counters.to(torch.int64) & 0xFFFFFFFF)
    as_i32 = torch.where(as_i32 >= 2**31, as_i32 - 2**32, as_i32).to(torch.int32)
    return ops.philox4x32_10(as_i32, key[0], key[1]).to(torch.int64) & 0xFFFFFFFF


def round_stochastic(x: torch.Tensor, dtype: torch.dtype, seed: int, offset: int,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    x = _plain(x, "x")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {type(dtype).__name__} {dtype!r}")
    out = _plain(out, "out", optional=True)
    seed = u64_arg(seed, "seed")
    offset = u64_arg(offset, "offset", numel=x.numel())
    if out is None:
        return ops.round_stochastic(x, dtype, seed, offset)
    if out.dtype != dtype:
        raise ValueError(f"out must be a {dtype} tensor (the dtype argument), got {out.dtype}")
    ops.round_stochastic_out_(x, seed, offset, out)
    return out


# ---- fixed point <IL, FL> (csrc/core/fixed_point.h) ---------------------------------------------------
def fixed_point_quantize(x: torch.Tensor, il: int, fl: int, stochastic: bool, seed: int, offset: int,
                         out_dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Convert(x, <il, fl>) as int16/int32 codes or float32/float64 values (see mpfused.fixed_point), into
    a new tensor of ``out_dtype`` or into ``out`` (whose dtype is then the output's); arguments already
    validated by the caller, checked again natively."""
    if out is None:
        return ops.fixed_point_quantize(x, il, fl, bool(stochastic), u64_arg(seed, "seed"), u64_arg(offset, "offset"),
                                        out_dtype)
    ops.fixed_point_quantize_out_(x, il, fl, bool(stochastic), u64_arg(seed, "seed"), u64_arg(offset, "offset"), out)
    return out


def fixed_point_matmul(a: torch.Tensor, b: torch.Tensor, fmt_a: tuple, fmt_b: tuple, fmt_out: tuple,
                       stochastic: bool, seed: int, offset: int, out_dtype: torch.dtype) -> torch.Tensor:
    """The fixed-point MACC on codes (see mpfused.fixed_point.matmul); formats as (il, fl) pairs."""
    return ops.fixed_point_matmul(a, b, fmt_a[0], fmt_a[1], fmt_b[0], fmt_b[1], fmt_out[0], fmt_out[1],
                                  bool(stochastic), u64_arg(seed, "seed"), u64_arg(offset, "offset"), out_dtype)


# ---- fake (meta) kernels: shapes and dtypes only, for torch.compile and FakeTensor ------------------------
# The dispatcher sends a call here when any tensor is on the meta device (or fake): then the real kernel,
# whose checks would refuse a meta tensor mixed with real ones, never runs, so the one check that cannot
# wait is made here: every tensor on one device.
def _one_device(op: str, args) -> None:
    names = [a.name for a in getattr(torch.ops.mpfused, op).default._schema.arguments]
    first = None
    for i, a in enumerate(args):
        items = enumerate(a) if isinstance(a, (list, tuple)) else ((None, a),)
        for j, t in items:
            if not isinstance(t, torch.Tensor):
                continue
            name = names[i] if j is None else f"{names[i]}[{j}]"
            if first is None:
                first = (name, t.device)
            elif t.device != first[1]:
                raise ValueError(f"{name} is on {t.device} but {first[0]} is on {first[1]}; all tensors of "
                                 f"mpfused.{op} must be on one device")


def _positional(op: str, args: tuple, kwargs: dict) -> tuple:
    schema = getattr(torch.ops.mpfused, op).default._schema.arguments
    if not kwargs and len(args) == len(schema):
        return args
    return tuple(args) + tuple(kwargs[a.name] if a.name in kwargs else a.default_value for a in schema[len(args):])


def _fake(op: str):
    def register(fn):
        def fake(*args, **kwargs):
            args = _positional(op, args, kwargs)
            _one_device(op, args)
            return fn(*args)
        torch.library.register_fake(f"mpfused::{op}")(fake)
        return fn
    return register


for _name in ("non_finite_check_", "unscale_check_", "optim_step_", "follow_writes_", "loss_scale_update_",
              "philox_words_", "round_stochastic_out_", "fixed_point_quantize_out_"):
    _fake(_name)(lambda *args: None)


def _gemm_shape(a: torch.Tensor, b: torch.Tensor) -> list:
    if a.dim() == 3 or b.dim() == 3:
        return [a.shape[0] if a.dim() == 3 else b.shape[0], a.shape[-2], b.shape[-1]]
    return [a.shape[-2], b.shape[-1]]


def _gemm_out(a, b, out_dtype):
    # What the output's shape and dtype depend on, checked as the kernel does (the rest is checked when the
    # kernel runs): a fake kernel must not make up a shape.
    for t, name in ((a, "a"), (b, "b")):
        if t.dtype not in (torch.float16, torch.bfloat16) or t.dim() not in (2, 3):
            raise ValueError(f"{name} must be a 2-D or 3-D float16 or bfloat16 tensor, got {t.dtype} of shape "
                             f"{tuple(t.shape)}")
    if b.dtype != a.dtype:
        raise ValueError(f"b must have a's dtype {a.dtype}, got {b.dtype}")
    if b.shape[-2] != a.shape[-1]:
        raise ValueError(f"b must have {a.shape[-1]} rows, the inner dim of a, got shape {tuple(b.shape)}")
    if a.dim() == 3 and b.dim() == 3 and a.shape[0] != b.shape[0]:
        raise ValueError(f"b must have a's batch size {a.shape[0]}, got shape {tuple(b.shape)}")
    if out_dtype not in (None, torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be torch.float16, torch.bfloat16 or torch.float32, got {out_dtype}")
    return _gemm_shape(a, b), out_dtype or a.dtype


def _gemm_epilogue(shape, bias, activation, c) -> None:
    # the epilogue's arguments, as the kernel checks their shapes and names (a fake must refuse them too)
    if activation not in (None, "relu", *_GELU_APPROXIMATE):
        raise ValueError(f"activation must be None, 'relu', 'gelu' (tanh approximation) or 'gelu_erf', got "
                         f"{activation!r}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != shape[-1]):
        raise ValueError(f"bias must be 1-D with {shape[-1]} elements (the output's columns), got shape "
                         f"{tuple(bias.shape)}")
    if c is not None and not (list(c.shape) == list(shape) or list(c.shape) == list(shape[-2:])):
        raise ValueError(f"c must have the output's shape {tuple(shape)}, got shape {tuple(c.shape)}")


@_fake("gemm")
def _gemm_fake(a, b, bias, activation, alpha, beta, c, out_dtype):
    shape, dtype = _gemm_out(a, b, out_dtype)
    _gemm_epilogue(shape, bias, activation, c)
    return a.new_empty(shape, dtype=dtype)


@_fake("gemm_with_pre")
def _gemm_with_pre_fake(a, b, bias, activation, alpha, beta, c, out_dtype):
    shape, dtype = _gemm_out(a, b, out_dtype)
    _gemm_epilogue(shape, bias, activation, c)
    return a.new_empty(shape, dtype=dtype), a.new_empty(shape, dtype=dtype)


@_fake("philox4x32_10")
def _philox_fake(counters, k0, k1):
    return torch.empty_like(counters, memory_format=torch.contiguous_format)


@_fake("round_stochastic")
def _round_stochastic_fake(x, dtype, seed, offset):
    if x.dtype != torch.float32:
        raise ValueError(f"x must be a float32 tensor, got {x.dtype}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    return x.new_empty(x.shape, dtype=dtype)


_CODE_BITS = {torch.int16: 16, torch.int32: 32}


def _fixed_format_fake(il, fl, name) -> int:
    # the kernel's rule for a format (fixed_format in csrc/torch/fixed_point.cpp); returns its WL
    if not (il >= 1 and fl >= 0 and il + fl <= 32):
        raise ValueError(f"{name} must have il >= 1, fl >= 0 and il + fl <= 32, got il={il}, fl={fl}")
    return il + fl


@_fake("fixed_point_quantize")
def _fixed_point_quantize_fake(x, il, fl, stochastic, seed, offset, out_dtype):
    if x.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be a float32, float64, float16 or bfloat16 tensor, got {x.dtype}")
    wl = _fixed_format_fake(il, fl, "the format")
    if out_dtype in _CODE_BITS and wl > _CODE_BITS[out_dtype]:
        raise ValueError(f"out_dtype {out_dtype} cannot hold codes of {wl} bits; use torch.int32")
    if out_dtype == torch.float32 and wl > 24:
        raise ValueError(f"out_dtype float32 cannot hold the values of a format with il + fl = {wl} > 24 exactly")
    if out_dtype not in (torch.int16, torch.int32, torch.float32, torch.float64):
        raise ValueError(f"out_dtype must be torch.int16, torch.int32, torch.float32 or torch.float64, got {out_dtype}")
    return x.new_empty(x.shape, dtype=out_dtype)


@_fake("fixed_point_matmul")
def _fixed_point_matmul_fake(a, b, il_a, fl_a, il_b, fl_b, il_out, fl_out, stochastic, seed, offset, out_dtype):
    for t, name in ((a, "a_codes"), (b, "b_codes")):
        if t.dtype not in _CODE_BITS or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D int16 or int32 tensor of fixed-point codes, got {t.dtype} of "
                             f"shape {tuple(t.shape)}")
    if b.shape[0] != a.shape[1]:
        raise ValueError(f"b_codes must have {a.shape[1]} rows, the inner dim of a_codes, got shape {tuple(b.shape)}")
    wls = [_fixed_format_fake(il, fl, name) for il, fl, name in
           ((il_a, fl_a, "fmt_a"), (il_b, fl_b, "fmt_b"), (il_out, fl_out, "fmt_out"))]
    if wls[0] > _CODE_BITS[a.dtype] or wls[1] > _CODE_BITS[b.dtype]:
        raise ValueError("a_codes' and b_codes' dtypes must hold codes of fmt_a and fmt_b")
    if out_dtype not in _CODE_BITS or wls[2] > _CODE_BITS[out_dtype]:
        raise ValueError(f"out_dtype must be torch.int16 or torch.int32 and hold codes of fmt_out, got {out_dtype}")
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


# ---- the GEMM's autograd ----------------------------------------------------------------------------------
_GELU_APPROXIMATE = {"gelu": "tanh", "gelu_erf": "none"}


def _gemm_setup(ctx, inputs, output) -> None:
    a, b, bias, activation, alpha, beta, c, out_dtype = inputs
    saved_out = output[0] if isinstance(output, tuple) else output
    # What the activation's backward reads: ReLU its output; GELU the value before it (gemm_with_pre returns
    # it; gemm recomputes it in the backward, without the activation).
    if activation == "relu":
        act_input = saved_out
    elif activation in _GELU_APPROXIMATE and isinstance(output, tuple):
        act_input = output[1]
    else:
        act_input = None
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    recompute = activation in _GELU_APPROXIMATE and act_input is None
    ctx.save_for_backward(a if need_b or recompute else None, b if need_a or recompute else None, act_input,
                          bias if recompute else None, c if recompute else None)
    ctx.activation, ctx.alpha, ctx.beta, ctx.out_dtype = activation, alpha, beta, out_dtype
    ctx.recompute = recompute
    ctx.a_dtype, ctx.a_dim, ctx.b_dim = a.dtype, a.dim(), b.dim()
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.c_info = None if c is None else (c.dtype, c.dim())


def _reduce_batch(t: torch.Tensor, dim: int) -> torch.Tensor:
    # A 2-D operand shared by every batch of a batched product: its gradient sums over the batch (in FP32).
    return t.sum(0) if t.dim() == 3 and dim == 2 else t


def _matmul_grad(x: torch.Tensor, y: torch.Tensor, alpha: float, dtype: torch.dtype, x_dim_target: int) -> torch.Tensor:
    """alpha * x @ y as the gradient of an operand of ``dtype``: on mpfused's GEMM (FP32 accumulation) when x
    and y are that dtype, else in FP32 through torch; summed over a batch the operand does not have."""
    batched_to_2d = x.dim() == 3 or y.dim() == 3
    batched_to_2d = batched_to_2d and x_dim_target == 2
    if x.dtype == dtype and y.dtype == dtype and dtype in (torch.float16, torch.bfloat16):
        if batched_to_2d:
            return ops.gemm(x, y, None, None, alpha, 0.0, None, torch.float32).sum(0).to(dtype)
        return ops.gemm(x, y, None, None, alpha, 0.0, None, dtype)
    r = torch.matmul(x.float(), y.float()) * alpha
    return (r.sum(0) if batched_to_2d and r.dim() == 3 else r).to(dtype)


def _activation_grad(grad: torch.Tensor, act_input: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "relu":
        return torch.ops.aten.threshold_backward(grad, act_input, 0)
    return torch.ops.aten.gelu_backward(grad, act_input, approximate=_GELU_APPROXIMATE[activation])


@torch.library.custom_op("mpfused::activation_backward", mutates_args=(), device_types=("cpu", "cuda"))
def activation_backward(grad: torch.Tensor, act_input: torch.Tensor, activation: str,
                        grad_pre: Optional[torch.Tensor], bias_dtype: Optional[torch.dtype]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMM backward's first step: the gradient before the activation ("relu", "gelu" or "gelu_erf"),
    plus ``grad_pre`` where the value before the activation had a gradient of its own (gemm_with_pre), and,
    where the GEMM had a bias (``bias_dtype``; else an empty tensor), the bias's gradient: the FP32 sum of
    that gradient over every row, in ``bias_dtype``. One operator, so that torch.compile runs it as eager
    does instead of generating its own code for it: inductor's code for the activation's derivative, and
    for the sum fused after it, rounds differently from eager's kernels (torch 2.11 on CPU: the bias
    gradient of a FusedLinear with a GELU differed in every one of 200 random cases), and a compiled
    training step would then not be eager's bit for bit."""
    _check_activation_backward(grad, act_input, activation, grad_pre, bias_dtype)
    _check_in_storage((("grad", grad), ("act_input", act_input), ("grad_pre", grad_pre)))
    return _activation_backward_eager(grad, act_input, activation, grad_pre, bias_dtype)


def _check_in_storage(tensors) -> None:
    """The C++ operators' storage check (csrc/torch/common.h, check_in_storage) for the operators made of torch's
    own ops, whose kernels read a tensor whose storage was freed or shrunk after it was made past its end (a
    crash): every element inside the storage, the same message. Real tensors only (not in fake kernels)."""
    for name, t in tensors:
        if t is None or t.numel() == 0:
            continue
        end = (t.storage_offset() + 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()
        nbytes = t.untyped_storage().nbytes()
        if end > nbytes:
            raise ValueError(
                f"{name} reaches past the end of its storage (a {str(t.dtype).replace('torch.', '')} tensor of shape "
                f"{list(t.shape)} on {t.device} at storage offset {t.storage_offset()} with strides {list(t.stride())}, "
                f"over a storage of {nbytes} bytes): its storage was freed or shrunk after the tensor was made "
                "(untyped_storage().resize_(), as FSDP frees unsharded params)")


_GRAD_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_grad_dtypes(tensors, bias_dtype) -> None:
    """The GEMM backward operators' dtypes: floating-point gradients and inputs (a GEMM's: FP16, BF16, FP32,
    or FP64 in a double-backward), and a floating-point bias dtype (an integer one truncated the sum)."""
    for name, t in tensors:
        if t is not None and t.dtype not in _GRAD_DTYPES:
            raise ValueError(f"{name} must be a float16, bfloat16, float32 or float64 tensor, got {t.dtype}")
    if bias_dtype is not None and bias_dtype not in _GRAD_DTYPES:
        raise ValueError(f"bias_dtype must be torch.float16, bfloat16, float32 or float64, got {bias_dtype}")


def _check_activation_backward(grad, act_input, activation, grad_pre, bias_dtype) -> None:
    """The operator's arguments (the eager backward, which calls _activation_backward_eager, makes them
    itself)."""
    if activation not in ("relu", *_GELU_APPROXIMATE):
        raise ValueError(f"activation must be 'relu', 'gelu' or 'gelu_erf', got {activation!r}")
    for name, t in (("act_input", act_input), ("grad_pre", grad_pre)):
        if t is not None and t.shape != grad.shape:
            raise ValueError(f"{name} must have grad's shape {tuple(grad.shape)}, got {tuple(t.shape)}")
    _check_grad_dtypes((("grad", grad), ("act_input", act_input), ("grad_pre", grad_pre)), bias_dtype)


def _activation_backward_eager(grad, act_input, activation, grad_pre, bias_dtype):
    # The operator's computation, which eager backward calls directly (the same code, so the same bits: an
    # operator call from Python costs ~60 us more on a slow CPU, and an eager backward needs no operator)
    g = _activation_grad(grad, act_input, activation)
    if grad_pre is not None:
        g = g + grad_pre
    if bias_dtype is None:
        return g, g.new_empty(0)
    return g, _bias_grad_eager(g, bias_dtype)


def _bias_grad_eager(grad, bias_dtype):
    return grad.sum(tuple(range(grad.dim() - 1)), dtype=torch.float32).to(bias_dtype)


@activation_backward.register_fake
def _activation_backward_fake(grad, act_input, activation, grad_pre, bias_dtype):
    _check_activation_backward(grad, act_input, activation, grad_pre, bias_dtype)
    # the operator's own code on fake tensors: torch's kernels' meta functions give its strides and dtypes
    return _activation_backward_eager(grad, act_input, activation, grad_pre, bias_dtype)


def _activation_second_derivative(x: torch.Tensor, activation: str) -> torch.Tensor:
    """act''(x) in FP32 (FP64 for FP64 x; torch ops, themselves differentiable): 0 for ReLU; for GELU with the exact erf,
    phi(x) (2 - x^2); for the tanh approximation 0.5 x (1 + t) with t = tanh(u), u = k (x + c x^3):
    (1 - t^2) u' - x t (1 - t^2) u'^2 + 0.5 x (1 - t^2) u''."""
    x = x if x.dtype == torch.float64 else x.float()
    if activation == "relu":
        return torch.zeros_like(x)
    if activation == "gelu_erf":
        return torch.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi)) * (2.0 - x * x)
    k, c = math.sqrt(2.0 / math.pi), 0.044715
    t = torch.tanh(k * (x + c * x * x * x))
    sech2 = 1.0 - t * t
    du = k * (1.0 + 3.0 * c * x * x)
    d2u = k * 6.0 * c * x
    return sech2 * du - x * t * sech2 * du * du + 0.5 * x * sech2 * d2u


def _activation_backward_setup(ctx, inputs, output) -> None:
    grad, act_input, activation, grad_pre, bias_dtype = inputs
    ctx.save_for_backward(grad, act_input)
    ctx.activation, ctx.has_bias, ctx.has_pre = activation, bias_dtype is not None, grad_pre is not None


def _activation_backward_backward(ctx, g_grad_in, g_bias):
    """Second derivatives (a backward differentiated with create_graph=True): with T the gradient reaching
    the output (plus the bias gradient's, broadcast over the rows), d/dgrad = act'(x) T, d/dgrad_pre = T,
    d/dx = T grad act''(x)."""
    grad, x = ctx.saved_tensors
    t = g_grad_in
    if ctx.has_bias and g_bias is not None:
        t = g_bias.to(grad.dtype).expand(grad.shape) if t is None else t + g_bias.to(t.dtype)
    if t is None:
        return None, None, None, None, None
    d_grad = _activation_grad(t, x, ctx.activation) if ctx.needs_input_grad[0] else None
    d_x = None
    if ctx.needs_input_grad[1]:
        wide = torch.float64 if torch.float64 in (t.dtype, grad.dtype, x.dtype) else torch.float32
        d_x = (t.to(wide) * grad.to(wide) * _activation_second_derivative(x, ctx.activation)).to(x.dtype)
    d_pre = t if ctx.has_pre and ctx.needs_input_grad[3] else None
    return d_grad, d_x, None, d_pre, None


activation_backward.register_autograd(_activation_backward_backward, setup_context=_activation_backward_setup)


@torch.library.custom_op("mpfused::bias_grad", mutates_args=(), device_types=("cpu", "cuda"))
def bias_grad(grad: torch.Tensor, bias_dtype: torch.dtype) -> torch.Tensor:
    """The gradient of a GEMM's bias: the FP32 sum of ``grad`` over every row (all dims but the last),
    rounded once to ``bias_dtype``. An operator for the reason given at activation_backward: compiled by
    inductor, the sum and its rounding differ from eager's (torch 2.11 under autocast: the rounding to FP16
    was left out)."""
    _check_bias_grad(grad, bias_dtype)
    _check_in_storage((("grad", grad),))
    return _bias_grad_eager(grad, bias_dtype)


def _check_bias_grad(grad, bias_dtype) -> None:
    if grad.dim() < 1:
        raise ValueError("grad must have at least one dimension")
    _check_grad_dtypes((("grad", grad),), bias_dtype)


@bias_grad.register_fake
def _bias_grad_fake(grad, bias_dtype):
    _check_bias_grad(grad, bias_dtype)
    return _bias_grad_eager(grad, bias_dtype)


def _bias_grad_backward(ctx, g):
    return g.to(ctx.grad_dtype).expand(ctx.grad_shape), None


def _bias_grad_setup(ctx, inputs, output) -> None:
    ctx.grad_dtype, ctx.grad_shape = inputs[0].dtype, inputs[0].shape


bias_grad.register_autograd(_bias_grad_backward, setup_context=_bias_grad_setup)


def _gemm_backward(ctx, grad, grad_pre=None):
    a, b, act_input, bias, c = ctx.saved_tensors
    act = ctx.activation
    if ctx.recompute:  # gemm (one output) with a GELU: the value before it, computed again
        act_input = ops.gemm(a, b, bias, None, ctx.alpha, ctx.beta, c, ctx.out_dtype)
    grad_bias = None
    want_bias = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
    # Traced (torch.compile's dynamo, or its AOT autograd tracing the backward with fake or functional tensors
    # under a dispatch mode): the operators, which compiled code runs as eager does. Eager: their code,
    # called directly.
    compiling = (torch.compiler.is_compiling() or type(grad) is not torch.Tensor
                 or _python_dispatch.is_in_torch_dispatch_mode())
    if act is not None:
        grad, grad_bias = (ops.activation_backward if compiling else _activation_backward_eager)(
            grad, act_input, act, grad_pre, ctx.bias_dtype if want_bias else None)
        grad_bias = grad_bias if want_bias else None
    elif grad_pre is not None:  # gemm_with_pre without an activation: its "pre" is a copy of out, so both count
        grad = grad_pre if grad is None else grad + grad_pre
    grad_a = grad_b = grad_c = None
    if ctx.needs_input_grad[0]:  # alpha * grad @ b^T
        grad_a = _matmul_grad(grad, b.transpose(-1, -2), ctx.alpha, ctx.a_dtype, ctx.a_dim)
    if ctx.needs_input_grad[1]:  # alpha * a^T @ grad, computed as (grad^T @ a)^T: a transposed view, no copy
        if ctx.b_dim == 2 and a.dim() == 3:  # b shared by every batch: one product over all the rows
            g2, a2 = grad.flatten(0, 1), a.flatten(0, 1)
            grad_b = _matmul_grad(g2.t(), a2, ctx.alpha, ctx.a_dtype, 2).t()
        else:
            grad_b = _matmul_grad(grad.transpose(-1, -2), a, ctx.alpha, ctx.a_dtype, ctx.b_dim).transpose(-1, -2)
    if want_bias and grad_bias is None:
        grad_bias = (ops.bias_grad if compiling else _bias_grad_eager)(grad, ctx.bias_dtype)
    if ctx.c_info is not None and ctx.needs_input_grad[6] and ctx.beta != 0.0:
        c_dtype, c_dim = ctx.c_info
        gc = grad.float() * ctx.beta
        grad_c = _reduce_batch(gc, c_dim).to(c_dtype)
    return grad_a, grad_b, grad_bias, None, None, None, grad_c, None


def _gemm_with_pre_backward(ctx, grad, grad_pre):
    return _gemm_backward(ctx, grad, grad_pre)


torch.library.register_autograd("mpfused::gemm", _gemm_backward, setup_context=_gemm_setup)
torch.library.register_autograd("mpfused::gemm_with_pre", _gemm_with_pre_backward, setup_context=_gemm_setup)


# ---- the operators with no derivative ------------------------------------------------------------------
# round_stochastic, fixed_point_quantize and their out_ forms: their autograd kernel is C++
# (csrc/torch/no_derivative.cpp). A backward through a rounding raises, forward-mode AD raises, and an out_
# form refuses tensors that take part in autograd: no gradient is dropped in silence. The same file keeps
# forward-mode tangents out of the GEMM, whose formula above is reverse-mode only.
