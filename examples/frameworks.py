"""`python examples/frameworks.py lightning|accelerate`: one small FP16 mixed-precision training, with a fused
optimizer, mpfused.GradScaler and gradient clipping, run through PyTorch Lightning or through accelerate.

The task: an MLP regresses the outputs of a fixed random "teacher" MLP on Gaussian inputs (synthetic data,
nothing downloaded). One step (``--overflow-step``) is forced to overflow (its loss times inf): the scaler
skips it and backs the scale off. Every ``--log-every`` steps the script prints the loss, the skipped-step
count and the loss scale, read from the scaler (a host sync, made only when printing).

- ``lightning``: ``lightning.Trainer(plugins=[mpfused.integrations.lightning.MixedPrecision(...)],
  gradient_clip_val=...)`` with ``SkippedStepsLogger`` (Lightning's own 16-mixed plugin refuses
  ``gradient_clip_val`` with a fused optimizer);
- ``accelerate``: ``Accelerator(mixed_precision="fp16")`` with
  ``mpfused.integrations.accelerate.attach_scaler``, ``accelerator.backward``, ``clip_grad_norm_`` and
  ``optimizer_step_was_skipped``.

Run from the repository root with mpfused importable (``PYTHONPATH=.`` for the in-place build); needs the
framework (``make test-integrations`` installs the tested versions). ``--device cuda`` runs on a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import torch
from torch import nn

import mpfused

DIM, HIDDEN, BATCH = 32, 128, 64


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, 1))


def dataset(steps: int) -> torch.utils.data.TensorDataset:
    teacher = mlp(seed=100)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(steps * BATCH, DIM, generator=g)
    with torch.no_grad():
        y = teacher(x)
    return torch.utils.data.TensorDataset(x, y)


def loss_fn(out: torch.Tensor, y: torch.Tensor, step: int, overflow_step: int) -> torch.Tensor:
    loss = nn.functional.mse_loss(out.float(), y)
    return loss * float("inf") if step == overflow_step else loss  # inf/NaN gradients on that step


def report(rows: list, step: int, loss: float, skipped: int, scale: float) -> None:
    rows.append((step, loss, skipped, scale))
    print(f"{step:5d}  {loss:9.5f}  {skipped:7d}  {scale:g}")


def run_lightning(args: argparse.Namespace) -> dict:
    import lightning as L

    from mpfused.integrations.lightning import MixedPrecision, SkippedStepsLogger

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp(seed=0)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = loss_fn(self.net(x), y, self.global_step, args.overflow_step)
            self.log("train_loss", loss, on_step=True, on_epoch=False)
            return loss

        def configure_optimizers(self):
            return mpfused.optim.FusedAdamW(self.parameters(), lr=args.lr)

    rows: list = []

    class Print(L.Callback):
        # after SkippedStepsLogger (callbacks run in order): its values are in callback_metrics
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step
            if step % args.log_every == 0 or step == args.steps:
                m = trainer.callback_metrics
                report(rows, step, float(m["train_loss"]), int(m["skipped_steps"]), float(m["loss_scale"]))

    scaler = mpfused.GradScaler(args.device, init_scale=2.0**12)
    trainer = L.Trainer(accelerator=args.device, devices=1, max_steps=args.steps, logger=False,
                        plugins=[MixedPrecision("16-mixed", args.device, scaler=scaler)],
                        gradient_clip_val=args.clip, gradient_clip_algorithm=args.clip_algorithm,
                        callbacks=[SkippedStepsLogger(), Print()], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regression(), torch.utils.data.DataLoader(dataset(args.steps), batch_size=BATCH))
    return {"rows": rows, "skipped_steps": scaler.skipped_steps, "scale": scaler.get_scale()}


def run_accelerate(args: argparse.Namespace) -> dict:
    from accelerate import Accelerator

    from mpfused.integrations.accelerate import attach_scaler

    accelerator = Accelerator(mixed_precision="fp16", cpu=args.device == "cpu")
    scaler = attach_scaler(accelerator, mpfused.GradScaler(args.device, init_scale=2.0**12))
    net = mlp(seed=0)
    optimizer = mpfused.optim.FusedAdamW(net.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    data = torch.utils.data.DataLoader(dataset(args.steps), batch_size=BATCH)
    model, optimizer, schedule, data = accelerator.prepare(net, optimizer, schedule, data)
    rows: list = []
    skipped_seen = []
    for step, (x, y) in enumerate(data):
        loss = loss_fn(model(x), y, step, args.overflow_step)
        accelerator.backward(loss)
        if args.clip_algorithm == "norm":
            accelerator.clip_grad_norm_(model.parameters(), args.clip)
        else:
            accelerator.clip_grad_value_(model.parameters(), args.clip)
        optimizer.step()
        schedule.step()  # accelerate's wrapper does not advance it on a skipped step
        optimizer.zero_grad()
        if step == args.overflow_step:
            skipped_seen.append(accelerator.optimizer_step_was_skipped)  # a host sync: read when wanted
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            report(rows, step + 1, float(loss.detach()), scaler.skipped_steps, scaler.get_scale())
    return {"rows": rows, "skipped_steps": scaler.skipped_steps, "scale": scaler.get_scale(),
            "overflow_step_was_skipped": skipped_seen[0] if skipped_seen else None,
            "schedule_steps": schedule.scheduler.last_epoch}


RUNS = {"lightning": run_lightning, "accelerate": run_accelerate}


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("framework", choices=sorted(RUNS))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--overflow-step", type=int, default=None,
                   help="the step forced to overflow (0-based; default 5, or the last step of a shorter run)")
    p.add_argument("--clip", type=float, default=1.0, help="max norm (or max |value| with --clip-algorithm value)")
    p.add_argument("--clip-algorithm", choices=("norm", "value"), default="norm")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if not args.clip > 0:
        p.error(f"--clip must be > 0, got {args.clip}")
    if args.overflow_step is None:
        args.overflow_step = min(5, args.steps - 1)
    if not 0 <= args.overflow_step < args.steps:
        p.error(f"--overflow-step must be in [0, --steps), got {args.overflow_step} with --steps {args.steps}")
    if not 0 < args.lr < float("inf"):
        p.error(f"--lr must be a finite number > 0, got {args.lr}")
    if args.log_every < 1:
        p.error(f"--log-every must be >= 1, got {args.log_every}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device on this machine")
    if importlib.util.find_spec(args.framework) is None:
        p.error(f"{args.framework} is not installed (make test-integrations installs the tested version, or: pip "
                f"install {args.framework})")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    print(f"{args.framework}: FP16 mixed precision, FusedAdamW, mpfused.GradScaler, {args.clip_algorithm} clipping "
          f"at {args.clip:g}; step {args.overflow_step} forced to overflow")
    print(" step       loss  skipped  scale")
    result = RUNS[args.framework](args)
    print(f"skipped steps: {result['skipped_steps']}, final loss scale {result['scale']:g}")
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
