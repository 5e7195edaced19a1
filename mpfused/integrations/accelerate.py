"""Hugging Face accelerate with mpfused.GradScaler: ``attach_scaler(accelerator, scaler)``.

    accelerator = Accelerator(mixed_precision="fp16")
    scaler = attach_scaler(accelerator, mpfused.GradScaler(accelerator.device.type))
    model, optimizer = accelerator.prepare(model, mpfused.optim.FusedAdamW(model.parameters()))
    ...
    accelerator.backward(loss)                      # scaler.scale(loss).backward()
    accelerator.clip_grad_norm_(model.parameters(), 1.0)  # scaler.unscale_(optimizer), then the clip
    optimizer.step()                                # scaler.step(optimizer); scaler.update()
    if accelerator.optimizer_step_was_skipped: ...  # read from the scaler's found_inf

accelerate has no argument for a scaler object (``GradScalerKwargs`` only configures the
torch.amp.GradScaler it makes itself), so ``attach_scaler`` puts ours where accelerate keeps its own,
``accelerator.scaler``, before ``prepare()`` hands it to the optimizers. It fixes two things on the way:

- accelerate tells a skipped step by whether the scaler called ``optimizer.step()``. With an optimizer
  that unscales in its own step (``_step_supports_amp_scaling``: mpfused's fused optimizers, torch's
  fused Adam) the scaler always calls it and the kernel skips on the device, so
  ``optimizer_step_was_skipped`` would always be False (and the LR scheduler would advance on skipped
  steps). The optimizers ``prepare()`` returns read the scaler's found_inf instead: a host sync, made only
  when the flag is read (the Hugging Face Trainer and accelerate's scheduler read it every step);
- on the CPU accelerate turns ``mixed_precision="fp16"`` into FP32 training without a word (no autocast,
  no scaler: an overflow then writes inf/NaN into the weights). torch has FP16 autocast on the CPU, so
  with our scaler attached the CPU trains in FP16 mixed precision as a GPU does.
"""

from __future__ import annotations

from typing import Any

from . import require
from ..scaler import GradScaler

_accelerate = require("accelerate", "accelerate", "mpfused.integrations.accelerate")
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

__all__ = ["attach_scaler", "ScalerAwareOptimizer"]

# Data parallel (each rank holds the whole, all-reduced gradient, so every rank finds the same inf/NaN and
# skips together) or one process. DeepSpeed and Megatron-LM scale the loss themselves; FSDP shards the
# gradients (its scaler must reduce found_inf over the ranks); XLA steps through its own path.
_SUPPORTED = {t for t in DistributedType if t is DistributedType.NO or t.name.startswith("MULTI_")}


class ScalerAwareOptimizer(AcceleratedOptimizer):
    """accelerate's optimizer wrapper whose ``step_was_skipped`` comes from mpfused.GradScaler's found_inf
    (``attach_scaler`` makes the optimizers ``prepare()`` returns of this class). Nothing else changes."""

    def step(self, closure=None):
        result = super().step(closure)
        if self.gradient_state.sync_gradients:
            # This iteration's found_inf (after update(): the flag update() used), a device tensor: no sync.
            self._mpf_found_inf = self.scaler.found_inf()
        return result

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step was skipped for an inf/NaN gradient (a host sync when it was a fused step)."""
        found = self.__dict__.get("_mpf_found_inf")
        if found is None:
            return self._is_overflow
        return bool(found.item() != 0)


def attach_scaler(accelerator: Any, scaler: GradScaler) -> GradScaler:
    """Makes ``accelerator`` (``Accelerator(mixed_precision="fp16")``) scale the loss with ``scaler``, an
    mpfused.GradScaler on the accelerator's device type; returns it. Call it before
    ``accelerator.prepare()`` (for the Hugging Face Trainer: after ``Trainer(...)``, before ``train()``).

    Then ``accelerator.backward``, ``clip_grad_norm_``/``clip_grad_value_`` (``scaler.unscale_`` first),
    the prepared optimizer's ``step()`` (``scaler.step`` and ``scaler.update``), ``optimizer_step_was_skipped``
    and ``save_state``/``load_state`` (the scaler's state dict, ours with the skipped-step count) use it.
    """
    if not isinstance(scaler, GradScaler):
        raise TypeError(f"scaler must be a mpfused.GradScaler, got {type(scaler).__name__}")
    if not isinstance(accelerator, _accelerate.Accelerator):
        raise TypeError(f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}")
    if accelerator.mixed_precision != "fp16":
        raise ValueError("accelerator: a loss scale is for FP16 training, so attach_scaler needs "
                         f"Accelerator(mixed_precision='fp16'), got mixed_precision={accelerator.mixed_precision!r}")
    if accelerator.distributed_type not in _SUPPORTED:
        raise NotImplementedError(f"accelerator: attach_scaler supports one process and data parallel training, not "
                                  f"{accelerator.distributed_type.value} (which scales the loss or shards the "
                                  "gradients its own way)")
    if scaler.is_enabled() and scaler._device != accelerator.device.type:
        raise ValueError(f"scaler is for device type {scaler._device!r} but the accelerator trains on "
                         f"{accelerator.device.type!r}: create it as mpfused.GradScaler({accelerator.device.type!r})")
    if accelerator._optimizers or accelerator._models:
        raise RuntimeError("accelerator: attach_scaler must be called before accelerator.prepare() (the prepared "
                           "model and optimizers already hold accelerate's own scaler and autocast)")
    accelerator.scaler = scaler
    # accelerate leaves fp16 autocast off on the CPU; torch has it. On an accelerator it is already on.
    accelerator.native_amp = True
    if not getattr(accelerator.prepare_optimizer, "_mpf_scaler_aware", False):
        accelerator.prepare_optimizer = _scaler_aware(accelerator.prepare_optimizer)
    return scaler


def _scaler_aware(prepare_optimizer):
    """``accelerator.prepare_optimizer`` whose wrappers are ScalerAwareOptimizers (the same object, its
    class made the subclass: the wrapper holds no other state, and the caller keeps what prepare() returns)."""

    def wrapped(optimizer, device_placement=None):
        prepared = prepare_optimizer(optimizer, device_placement=device_placement)
        if type(prepared) is AcceleratedOptimizer and isinstance(prepared.scaler, GradScaler):
            prepared.__class__ = ScalerAwareOptimizer
        return prepared

    wrapped._mpf_scaler_aware = True
    return wrapped
