"""PyTorch Lightning with mpfused: a precision plugin that drives mpfused.GradScaler, clipping included.

    from mpfused.integrations.lightning import MixedPrecision, SkippedStepsLogger
    trainer = lightning.Trainer(plugins=[MixedPrecision("16-mixed", "cuda")], gradient_clip_val=1.0,
                                callbacks=[SkippedStepsLogger()])

Lightning's own plugin (``precision="16-mixed"``) refuses ``gradient_clip_val`` with any optimizer that
unscales in its own step (``_step_supports_amp_scaling``, as mpfused's fused optimizers do): it clips after
unscale_(), which such an optimizer never gets. This plugin clips through the scaler instead:

- norm clipping: ``scaler.clip_grad_norm_(optimizer, max_norm)``. With a fused optimizer the global norm
  comes from the overflow pass and the clip coefficient is applied inside the fused update (no extra
  pass, no host sync); with any other optimizer Lightning has unscaled the gradients already and the
  scaler clips them in place;
- value clipping: the gradients are unscaled first (``scaler.unscale_``; the step then skips or not on
  the found_inf of that pass), then clamped to ``[-clip_val, clip_val]``.

An overflow skips the step (on the device with a fused optimizer) and backs the scale off;
``SkippedStepsLogger`` logs the scaler's skipped-step count and loss scale.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch.amp.grad_scaler import OptState

from . import require
from ..scaler import GradScaler

require("lightning", "lightning", "mpfused.integrations.lightning")
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision as _LightningMixedPrecision  # noqa: E402
from lightning.pytorch.plugins.precision.precision import Precision  # noqa: E402
from lightning.pytorch.core.optimizer import LightningOptimizer  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402

__all__ = ["MixedPrecision", "SkippedStepsLogger", "scaler_of"]


class MixedPrecision(_LightningMixedPrecision):
    """Lightning's ``MixedPrecision`` plugin with an mpfused.GradScaler and clipping that works with fused
    optimizers.

    Args:
        precision: ``"16-mixed"`` (FP16 autocast and a loss scale) or ``"bf16-mixed"`` (BF16 autocast, no
            scaler; clipping as in FP32).
        device: the device type for ``torch.autocast`` (``"cuda"``, ``"cpu"``).
        scaler: an mpfused.GradScaler for ``device``; default (``"16-mixed"``) ``mpfused.GradScaler(device)``.
    """

    def __init__(self, precision: str = "16-mixed", device: str = "cuda", scaler: Optional[GradScaler] = None) -> None:
        if precision not in ("16-mixed", "bf16-mixed"):
            raise ValueError(f"precision must be '16-mixed' or 'bf16-mixed', got {precision!r}")
        if not isinstance(device, str):
            raise TypeError(f"device must be a device type such as 'cuda' or 'cpu', got {device!r}")
        device_type = torch.device(device).type
        if precision == "16-mixed":
            if scaler is None:
                scaler = GradScaler(device_type)
            elif not isinstance(scaler, GradScaler):
                raise TypeError(f"scaler must be a mpfused.GradScaler (its clip_grad_norm_ clips inside the fused "
                                f"step), got {type(scaler).__name__}")
            elif scaler.is_enabled() and scaler._device != device_type:
                raise ValueError(f"scaler is for device type {scaler._device!r} but the plugin autocasts on "
                                 f"{device_type!r}: create it as mpfused.GradScaler({device_type!r})")
        elif scaler is not None:
            raise ValueError("precision='bf16-mixed' takes no scaler (BF16 has FP32's range), got "
                             f"{type(scaler).__name__}")
        super().__init__(precision, device_type, scaler)

    def clip_gradients(self, optimizer: torch.optim.Optimizer, clip_val: Union[int, float] = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        """Clips through the scaler (see the module's docstring); without a scaler (BF16) as Lightning does.
        In manual optimization the module passes ``self.optimizers()``, a LightningOptimizer around the real one,
        which the step hands to the scaler: the clip is recorded for the real one (under the wrapper's id it was
        never applied, and a value clip's unscale_ was repeated by the step)."""
        optimizer = getattr(optimizer, "optimizer", optimizer) if isinstance(optimizer, LightningOptimizer) else optimizer
        if clip_val <= 0:
            return
        scaler = self.scaler
        if scaler is None or not scaler.is_enabled():
            # BF16 or a disabled scaler: the gradients are not scaled, Lightning's clip is right as it is
            Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)
            return
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not params:
            # No backward ran (training_step returned None): Lightning then calls neither step() nor
            # update(), so nothing may be recorded on the scaler for this optimizer.
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.NORM:
            scaler.clip_grad_norm_(optimizer, float(clip_val))
        elif gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            if scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
                scaler.unscale_(optimizer)  # a fused optimizer's gradients are still scaled here
                # Lightning's optimizer_step unscales a torch optimizer once more (it lacks native scaling):
                # that second call is then a no-op, as after clip_grad_norm_'s own unscale_
                scaler._mpf_clip_states[id(optimizer)]["unscaled"] = True
            torch.nn.utils.clip_grad_value_(params, clip_value=clip_val)
        else:
            raise ValueError(f"gradient_clip_algorithm must be 'norm' or 'value', got {gradient_clip_algorithm!r}")


def scaler_of(trainer: "pl.Trainer") -> Optional[GradScaler]:
    """The trainer's mpfused.GradScaler (from its precision plugin), or None when it has none."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler if isinstance(scaler, GradScaler) else None


class SkippedStepsLogger(pl.Callback):
    """Logs ``skipped_steps`` (iterations skipped for an inf/NaN gradient, counted by the scaler on the
    device) and ``loss_scale`` after every training batch, with ``LightningModule.log`` (``on_step``; the
    trainer's logger writes them every ``log_every_n_steps``, and only then are they read on the host).
    Does nothing without an mpfused.GradScaler (BF16 skips no step)."""

    def __init__(self, prog_bar: bool = False) -> None:
        if not isinstance(prog_bar, bool):
            raise TypeError(f"prog_bar must be a bool, got {prog_bar!r}")
        self.prog_bar = prog_bar

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        scaler = scaler_of(trainer)
        if scaler is None or not scaler.is_enabled() or scaler.skipped_steps_async() is None:
            return
        # device tensors (no sync here); Lightning reads them when its logger writes
        pl_module.log("skipped_steps", scaler.skipped_steps_async().float(), on_step=True, on_epoch=False,
                      prog_bar=self.prog_bar, reduce_fx="max")
        pl_module.log("loss_scale", scaler._scale.reshape(()).float(), on_step=True, on_epoch=False,
                      prog_bar=self.prog_bar, reduce_fx="max")
