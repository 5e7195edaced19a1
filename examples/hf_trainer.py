"""`python examples/hf_trainer.py`: the Hugging Face Trainer with an mpfused optimizer and GradScaler: trains,
saves, resumes, and the resumed run ends bit for bit where the unbroken one does.

A tiny GPT-2 built from a config (nothing downloaded) learns synthetic token sequences (arithmetic
progressions modulo the vocabulary). Its params are FP16 by default (``--param-dtype float32``: FP32 params
under FP16 autocast), so FusedAdamW keeps an FP32 master weight for each. The Trainer gets the optimizer and
an LR schedule through ``optimizers=(optimizer, scheduler)`` and ``TrainingArguments(fp16=True)``;
``mpfused.integrations.transformers.use_grad_scaler`` hands it an mpfused.GradScaler, whose skipped-step
count and loss scale appear in every log line. One step (``--overflow-step``) is forced to overflow (the
logits times inf): it is skipped, the scale backs off, and the LR schedule does not advance.

Two runs:

1. unbroken: ``--steps`` steps, a checkpoint every ``--save-steps`` (model, optimizer with its FP32
   masters, scheduler, scaler, RNG and data position: what the Trainer saves);
2. resumed: a new model, optimizer and Trainer resume from the first checkpoint and train to ``--steps``.

The params, the optimizer's state (masters and moments) and the scaler's state of the two runs must be
equal bit for bit; the script says so and exits 1 otherwise.

Run from the repository root with mpfused importable (``PYTHONPATH=.`` for the in-place build); needs
``transformers`` and ``accelerate`` (``make test-integrations`` installs the tested versions). ``--device
cuda`` runs it on a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is built from a config: never reach the Hub

import torch
from torch.utils.data import Dataset

import mpfused

try:  # (--help needs none of it; parse() names what is missing)
    from mpfused.integrations.transformers import use_grad_scaler
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
    from transformers.utils import logging as hf_logging  # noqa: E402
    _MISSING = None
except ImportError as e:
    _MISSING, TrainerCallback = e, object

VOCAB, SEQ, SEQUENCES = 64, 16, 256
DTYPES = {"float16": torch.float16, "float32": torch.float32}


class Progressions(Dataset):
    """Sequence i: a + b * t modulo VOCAB for t < SEQ, with a drawn from i and the step b = 1 + i % 3 (the
    same data every run; the model learns to continue a progression from its first tokens)."""

    def __len__(self) -> int:
        return SEQUENCES

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(1000 + i)
        a = int(torch.randint(0, VOCAB, (), generator=g))
        ids = (a + (1 + i % 3) * torch.arange(SEQ)) % VOCAB
        return {"input_ids": ids, "labels": ids}


def build_model(param_dtype: torch.dtype) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        tie_word_embeddings=False)
    return GPT2LMHeadModel(config).to(param_dtype)


class ForcedOverflow(TrainerCallback):
    """Makes the logits inf in the optimizer step that starts at global step ``step`` (a forward hook on
    the LM head): its gradients are inf/NaN, so the scaler skips it. Counts the training forwards too."""

    def __init__(self, model: torch.nn.Module, step: int) -> None:
        self.step, self.active, self.hit, self.forwards = step, False, 0, 0
        model.lm_head.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        if not module.training:
            return None
        self.forwards += 1
        if self.active:
            self.hit += 1
            return output * float("inf")
        return None

    def on_step_begin(self, args, state, control, **kwargs):
        self.active = state.global_step == self.step

    def on_step_end(self, args, state, control, **kwargs):
        self.active = False


def make_trainer(args: argparse.Namespace, out: Path):
    """A fresh model, FusedAdamW, schedule, Trainer and scaler (the same for both runs)."""
    model = build_model(DTYPES[args.param_dtype])
    optimizer = mpfused.optim.FusedAdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.0, 1.0 - s / args.steps))
    training_args = TrainingArguments(
        output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        save_strategy="steps", save_steps=args.save_steps, logging_steps=1, report_to="none", fp16=True,
        use_cpu=args.device == "cpu", max_grad_norm=1.0, seed=0, disable_tqdm=True, dataloader_num_workers=0)
    overflow = ForcedOverflow(model, args.overflow_step)
    trainer = Trainer(model=model, args=training_args, train_dataset=Progressions(),
                      optimizers=(optimizer, scheduler), callbacks=[overflow])
    scaler = use_grad_scaler(trainer, mpfused.GradScaler(args.device, init_scale=2.0**12, growth_interval=4))
    return trainer, optimizer, scheduler, scaler, overflow


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: mpfused.GradScaler) -> dict:
    """Everything the resumed run must reproduce, on the CPU: params, optimizer state, scaler state."""
    names = {id(p): n for n, p in model.named_parameters()}
    state = {}
    for p, s in optimizer.state.items():
        for key, value in s.items():
            state[f"{names[id(p)]}:{key}"] = value.detach().cpu().clone() if torch.is_tensor(value) else value
    params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return {"params": params, "optimizer": state, "scaler": scaler.state_dict()}


def same_bits(x, y) -> bool:
    """Tensors equal bit for bit (dtype and shape included; NaNs compare by their bits), other values by ==."""
    if not (torch.is_tensor(x) and torch.is_tensor(y)):
        return not torch.is_tensor(x) and not torch.is_tensor(y) and x == y
    return (x.dtype == y.dtype and x.shape == y.shape
            and torch.equal(x.contiguous().reshape(-1).view(torch.uint8), y.contiguous().reshape(-1).view(torch.uint8)))


def differences(a: dict, b: dict) -> list[str]:
    """The entries of two snapshots that differ (tensors compared bit for bit, dtype included)."""
    diff = []
    for part in ("params", "optimizer"):
        if a[part].keys() != b[part].keys():
            diff.append(f"{part}: keys differ")
        for key in a[part].keys() & b[part].keys():
            if not same_bits(a[part][key], b[part][key]):
                diff.append(f"{part}: {key}")
    if a["scaler"] != b["scaler"]:
        diff.append(f"scaler: {a['scaler']} != {b['scaler']}")
    return sorted(diff)


def run(args: argparse.Namespace, out: Path, resume_from: Path | None) -> dict:
    trainer, optimizer, scheduler, scaler, overflow = make_trainer(args, out)
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from is not None else None)
    losses = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    logged = [(h["step"], h["skipped_steps"], h["loss_scale"]) for h in trainer.state.log_history
              if "skipped_steps" in h]
    return {"snapshot": snapshot(trainer.model, optimizer, scaler), "losses": losses, "logged": logged,
            "skipped_steps": scaler.skipped_steps, "scale": scaler.get_scale(), "overflow_hits": overflow.hit,
            "forwards": overflow.forwards,
            "scheduler_steps": scheduler.last_epoch, "global_step": trainer.state.global_step}


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="hf_trainer_out", help="folder for the two runs' checkpoints")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--save-steps", type=int, default=8, help="checkpoint interval; the resumed run starts at the first")
    p.add_argument("--overflow-step", type=int, default=3, help="the optimizer step forced to overflow (0-based)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--param-dtype", choices=sorted(DTYPES), default="float16")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps must be >= 2, got {args.steps}")
    if not 1 <= args.save_steps < args.steps:
        p.error(f"--save-steps must be in [1, --steps), got {args.save_steps} with --steps {args.steps}")
    if not 0 <= args.overflow_step < args.steps:
        p.error(f"--overflow-step must be in [0, --steps), got {args.overflow_step}")
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if not 0 < args.lr < float("inf"):
        p.error(f"--lr must be a finite number > 0, got {args.lr}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device on this machine")
    if _MISSING is not None:
        p.error(f"this example needs transformers and accelerate ({_MISSING}); make test-integrations installs the "
                "tested versions, or: pip install transformers accelerate")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    hf_logging.disable_progress_bar()  # the checkpoint writer's bars; the logs are printed below
    out = Path(args.out)
    try:  # the output folder now, not after the training (a bad --out lost it)
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        sys.exit(f"hf_trainer.py: --out {args.out}: {e.strerror or e}")
    unbroken = run(args, out / "unbroken", None)
    checkpoint = out / "unbroken" / f"checkpoint-{args.save_steps}"
    resumed = run(args, out / "resumed", checkpoint)
    diff = differences(unbroken["snapshot"], resumed["snapshot"])

    print(f"\n{args.steps} steps, FP16 mixed precision, {args.param_dtype} params, FusedAdamW"
          f"{' with FP32 masters' if args.param_dtype != 'float32' else ''}, mpfused.GradScaler")
    print(" step  loss     skipped  scale")
    logged = {step: (skipped, scale) for step, skipped, scale in unbroken["logged"]}
    before = 0
    for step, loss in unbroken["losses"]:
        skipped, scale = logged[step]
        # the Trainer logs a skipped step's inf/NaN loss as the mean of the losses since the last log: none
        shown = "skipped" if skipped > before else f"{loss:7.4f}"
        print(f"{step:5d}  {shown:>7}  {skipped:7d}  {scale:g}")
        before = skipped
    print(f"skipped steps: {unbroken['skipped_steps']} (step {args.overflow_step} forced to overflow); "
          f"the LR schedule advanced {unbroken['scheduler_steps']} of {unbroken['global_step']} steps")
    masters = " (FP32 masters included)" if args.param_dtype != "float32" else ""
    print(f"resumed from {checkpoint.name}: "
          + (f"params, optimizer state{masters} and scaler state equal the unbroken run's, bit for bit"
             if not diff else "DIFFERS from the unbroken run: " + ", ".join(diff)))
    return {"unbroken": unbroken, "resumed": resumed, "differences": diff, "checkpoint": checkpoint}


if __name__ == "__main__":
    sys.exit(1 if main()["differences"] else 0)
