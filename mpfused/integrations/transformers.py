"""The Hugging Face Trainer with mpfused: ``use_grad_scaler`` and ``SkippedStepsCallback``.

    optimizer = mpfused.optim.FusedAdamW(model.parameters(), lr=3e-4)
    trainer = Trainer(model=model, args=TrainingArguments(..., fp16=True), train_dataset=data,
                      optimizers=(optimizer, scheduler))
    scaler = use_grad_scaler(trainer, mpfused.GradScaler(trainer.accelerator.device.type))  # logs skips too
    trainer.train()

The Trainer's mixed precision is accelerate's (``mpfused.integrations.accelerate``): ``use_grad_scaler``
attaches our scaler to the Trainer's accelerator, so the Trainer's backward, clipping (``max_grad_norm``),
step, skipped-step check (the LR scheduler does not advance on a skipped step) and checkpoints
(``scaler.pt``: the scale, growth tracker and skipped-step count) go through it. The optimizer's state dict,
FP32 master weights included, is the Trainer's ``optimizer.pt``.
"""

from __future__ import annotations

from typing import Any

from . import require
from ..scaler import GradScaler

_transformers = require("transformers", "transformers", "mpfused.integrations.transformers")
from .accelerate import attach_scaler  # noqa: E402  (after: a missing transformers is named first)

__all__ = ["use_grad_scaler", "SkippedStepsCallback"]


def use_grad_scaler(trainer: Any, scaler: GradScaler, *, log_skipped_steps: bool = True) -> GradScaler:
    """Attaches ``scaler`` (an mpfused.GradScaler) to ``trainer`` (a transformers.Trainer built with
    ``TrainingArguments(fp16=True)``); call it after ``Trainer(...)`` and before ``train()``. With
    ``log_skipped_steps`` a ``SkippedStepsCallback(scaler)`` is added to the trainer. Returns the scaler."""
    if not isinstance(trainer, _transformers.Trainer):
        raise TypeError(f"trainer must be a transformers.Trainer, got {type(trainer).__name__}")
    if not trainer.args.fp16:
        raise ValueError("trainer: a loss scale is for FP16 training; build the Trainer with "
                         "TrainingArguments(fp16=True) (bf16=True needs no scaler)")
    if not isinstance(log_skipped_steps, bool):
        raise TypeError(f"log_skipped_steps must be a bool, got {log_skipped_steps!r}")
    attach_scaler(trainer.accelerator, scaler)
    if log_skipped_steps:
        # first, so that the reporting callbacks (the progress bar, TensorBoard, ...) see the added values
        trainer.callback_handler.callbacks.insert(0, SkippedStepsCallback(scaler))
    return scaler


class SkippedStepsCallback(_transformers.TrainerCallback):
    """Adds ``skipped_steps`` (steps skipped for an inf/NaN gradient so far) and ``loss_scale`` to each of
    the Trainer's logs (and to ``state.log_history``), read from ``scaler`` (an mpfused.GradScaler) on the
    host only when the Trainer logs (every ``logging_steps``). ``history`` keeps ``(global_step,
    skipped_steps, loss_scale)`` per log. ``use_grad_scaler`` puts one first among the Trainer's callbacks
    (before the ones that print or report the logs)."""

    def __init__(self, scaler: GradScaler) -> None:
        if not isinstance(scaler, GradScaler):
            raise TypeError(f"scaler must be a mpfused.GradScaler, got {type(scaler).__name__}")
        self.scaler = scaler
        self.history: list[tuple[int, int, float]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        scaler = self.scaler
        if logs is None or not scaler.is_enabled() or scaler.skipped_steps_async() is None:
            return  # disabled, or no step yet
        skipped, scale = scaler.skipped_steps, scaler.get_scale()
        logs["skipped_steps"] = skipped
        logs["loss_scale"] = scale
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(skipped_steps=skipped, loss_scale=scale)  # the Trainer's copy of logs
        self.history.append((state.global_step, skipped, scale))
