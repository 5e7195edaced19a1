"""Typed wrappers over the native extension. The only Python module that touches ``mpfused._C``.

Loading checks first that the installed torch is the one the extension was compiled against: torch's
C++ ABI changes between releases, and a mismatch would otherwise surface as an obscure
``undefined symbol`` error (or a crash) deep inside an import.
"""

from __future__ import annotations

import importlib
from typing import Optional, Sequence

import torch

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


_C = _load_native()
_C.build_info()  # a bad MPFUSED_CPU_ISA raises its ValueError here, at import, not in a kernel


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
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a tensor, got {type(t).__name__}")
    return out


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
      reduction and leaves zero, sparing a memset per call; use one per stream. With overwrite, norm and
      counter, the whole check is one kernel launch per list on CUDA.

    Tensors may be float32, float16 and bfloat16 in one list; they must be contiguous and on the device
    of ``found_inf``. Empty tensors are skipped. Nothing is written when an argument is invalid.
    Never synchronises the host with the device.
    """
    _C.non_finite_check_(_tensor_list(tensors, "tensors"), found_inf, inv_scale, bool(unscale), sumsq,
                         bool(overwrite), norm, counter)


def _lr_args(lr):
    if isinstance(lr, torch.Tensor):
        return 0.0, lr
    return float(lr), None


def _hyper_args(value):
    """A hyperparameter that may be a one-element float32/float64 tensor on the params' device: then the
    update reads it there (no host sync) and the float argument is ignored."""
    if isinstance(value, torch.Tensor):
        return 0.0, value
    return float(value), None


def adam_step_(params, grads, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, lr, beta1, beta2, eps,
               weight_decay, amsgrad, maximize, decoupled, inv_scale=None, clip_coef=None, clip_sumsq=None,
               max_norm=0.0, found_inf=None, grad_scale=None, counter=None, write_grad=False) -> None:
    """One fused Adam(W) step over params of one device (any mix of FP32/FP16/BF16): per element the
    gradient times ``inv_scale`` (or ``1 / grad_scale``, computed on the device) and ``clip_coef``, the update of the FP32 weight (``masters[i]`` when
    given, else the param itself) and FP32 moments, and the param stored in its dtype. When
    ``found_inf`` != 0 nothing is written, steps included. With ``clip_sumsq`` (the sum of squares of the
    unscaled gradients, on the device) the gradients are also multiplied by torch's clip coefficient
    ``min(1, max_norm / (sqrt(clip_sumsq) + 1e-6))``, computed in the kernel. ``lr`` is a float or a one-element float32
    tensor on the device. ``counter`` (a zero int32 tensor of one element, optional): with it the CUDA
    update's last block increments the step counters, so the step is one launch per group instead of two.
    ``write_grad``: a taken step also writes the gradient it used (times the unscale factor and the clip
    coefficient) back into ``grads``, as torch's fused optimizers leave p.grad unscaled; a skipped step
    leaves them as they were. ``beta1``/``beta2`` are floats or one-element float32/float64 tensors on the
    params' device, read by the update itself. Params may have any dense layout (channels_last, ...) that
    their grads, masters and state share. Validates everything before writing anything."""
    lr_value, lr_tensor = _lr_args(lr)
    (b1, b1_tensor), (b2, b2_tensor) = _hyper_args(beta1), _hyper_args(beta2)
    _C.adam_step_(params, grads, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr_value, lr_tensor,
                  b1, b2, float(eps), float(weight_decay), bool(amsgrad), bool(maximize),
                  bool(decoupled), inv_scale, clip_coef, clip_sumsq, float(max_norm), found_inf, grad_scale, counter,
                  bool(write_grad), b1_tensor, b2_tensor)


def sgd_step_(params, grads, masters, momentum_buffers, steps, *, lr, momentum, dampening, weight_decay, nesterov,
              maximize, inv_scale=None, clip_coef=None, clip_sumsq=None, max_norm=0.0, found_inf=None,
              grad_scale=None, counter=None, write_grad=False) -> None:
    """One fused SGD step; see :func:`adam_step_`. ``steps[i] == 0`` marks a momentum buffer that was
    never written (torch then sets it to the gradient itself). ``weight_decay`` may be a tensor, as the betas
    of :func:`adam_step_`."""
    lr_value, lr_tensor = _lr_args(lr)
    wd, wd_tensor = _hyper_args(weight_decay)
    _C.sgd_step_(params, grads, masters, momentum_buffers, steps, lr_value, lr_tensor, float(momentum),
                 float(dampening), wd, bool(nesterov), bool(maximize), inv_scale, clip_coef,
                 clip_sumsq, float(max_norm), found_inf, grad_scale, counter, bool(write_grad), wd_tensor)


def loss_scale_update_(scale, growth_tracker, hysteresis_left, skipped_steps, found_inf, inv_scale=None, *,
                       growth_factor, backoff_factor, growth_interval, hysteresis, min_scale=None, max_scale=None,
                       dynamic=True) -> None:
    """The dynamic loss-scale update (csrc/core/loss_scale.h) on the scaler's device tensors, in place:
    ``scale`` (float32), ``growth_tracker``, ``hysteresis_left`` (int32), ``skipped_steps`` (int64,
    incremented when ``found_inf != 0``), each of one element (0-d is fine). ``inv_scale`` (optional) is
    refreshed to 1/scale. ``min_scale``/``max_scale`` None: no clamp (torch's rule). One tiny launch on
    CUDA; no host sync."""
    _C.loss_scale_update_(scale, growth_tracker, hysteresis_left, skipped_steps, found_inf, inv_scale,
                          float(growth_factor), float(backoff_factor), int(growth_interval), int(hysteresis),
                          0.0 if min_scale is None else float(min_scale),
                          float("inf") if max_scale is None else float(max_scale), bool(dynamic))


_ACTIVATIONS = (None, "relu", "gelu", "gelu_erf")
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _number(x, name: str) -> float:
    # A Python number only: float() of a CUDA tensor would synchronise the host with the device.
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a Python int or float, got {type(x).__name__}")
    return float(x)


def _optional_tensor(t, name: str):
    if t is not None and not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor or None, got {type(t).__name__}")
    return t


def gemm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor] = None, activation: Optional[str] = None,
         alpha: float = 1.0, beta: float = 0.0, c: Optional[torch.Tensor] = None,
         out_dtype: Optional[torch.dtype] = None, return_pre_activation: bool = False):
    """``act(alpha * a @ b + beta * c + bias)`` from FP16/BF16 ``a`` and ``b`` with FP32 accumulation, as a
    new tensor (see :func:`mpfused.functional.gemm` for the full contract). With
    ``return_pre_activation``: ``(out, pre)``, ``pre`` being the value before the activation in the
    output dtype (``out`` itself when there is no activation). Not differentiable; validates every
    argument before anything is allocated or launched."""
    for t, name in ((a, "a"), (b, "b")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if activation is not None and not (isinstance(activation, str) and activation in _ACTIVATIONS):
        raise ValueError(f"activation must be None, 'relu', 'gelu' (tanh approximation) or 'gelu_erf', got {activation!r}")
    if out_dtype is not None and out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be None, torch.float16, torch.bfloat16 or torch.float32, got {out_dtype!r}")
    out, pre = _C.gemm(a, b, _optional_tensor(bias, "bias"), activation, _number(alpha, "alpha"),
                       _number(beta, "beta"), _optional_tensor(c, "c"), out_dtype, bool(return_pre_activation))
    return (out, pre) if return_pre_activation else out
