"""The README's "Frameworks" blocks run as written (tests/readme_snippets.py finds them), on the CPU, with the
pinned Lightning, accelerate and transformers: each with a preamble for what it takes as given, the one argument
a short CPU run needs added where the block leaves it open (a Trainer's length, TrainingArguments' `...`), and a
check that our scaler did the scaling. tests/test_readme.py runs the README's other blocks."""

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import mpfused

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: readme_snippets
from readme_snippets import block, on_cpu  # noqa: E402


def run(code: str, **names) -> dict:
    ns = {"torch": torch, "nn": nn, "mpfused": mpfused, **names}
    exec(compile(on_cpu(code), "<README block>", "exec"), ns)  # noqa: S102 - the README's own code
    return ns


def with_argument(code: str, anchor: str, replacement: str) -> str:
    """The block with `anchor` (which must be there, once) replaced: the argument a short run needs."""
    assert code.count(anchor) == 1, f"the README block no longer has {anchor!r}:\n{code}"
    return code.replace(anchor, replacement)


def batches(n=16):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, generator=g), torch.randn(4, generator=g)) for _ in range(n)]


def needs(name: str):
    return pytest.importorskip(name, reason=f"{name} is not installed (make test-integrations installs it)")


def test_lightning_block():
    lightning = needs("lightning")

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

        def training_step(self, batch, i):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return mpfused.optim.FusedAdamW(self.parameters())

        def train_dataloader(self):
            return torch.utils.data.DataLoader(batches(), batch_size=4)

    module = Module()
    before = [p.detach().clone() for p in module.parameters()]
    short = dict(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                 enable_model_summary=False)
    code = with_argument(block("Frameworks", 0), "callbacks=[SkippedStepsLogger()])",
                         "callbacks=[SkippedStepsLogger()], **SHORT)")
    ns = run(code, lightning=lightning, module=module, SHORT=short)
    from mpfused.integrations.lightning import scaler_of

    scaler = scaler_of(ns["trainer"])
    assert isinstance(scaler, mpfused.GradScaler) and ns["trainer"].global_step == 4
    assert scaler._growth_tracker.item() + scaler.skipped_steps > 0  # its update ran: it did the scaling
    assert all(not torch.equal(p, b) for p, b in zip(module.parameters(), before))


def test_accelerate_block(fresh_accelerate_state):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    Accelerator = needs("accelerate").Accelerator
    ns = run(block("Frameworks", 1), Accelerator=Accelerator, model=model)
    accelerator, scaler, model, optimizer = ns["accelerator"], ns["scaler"], ns["model"], ns["optimizer"]
    assert accelerator.scaler is scaler and isinstance(scaler, mpfused.GradScaler)
    scale = scaler.get_scale()
    for i, (x, y) in enumerate(batches(3)):  # the block's comment: backward, clip and step through our scaler
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x[None]).float(), y[None]) * (math.inf if i == 1 else 1.0)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        assert accelerator.optimizer_step_was_skipped == (i == 1)
    assert scaler.skipped_steps == 1 and scaler.get_scale() == scale / 2


def test_hf_trainer_block(fresh_accelerate_state, tmp_path):
    needs("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)).half()
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (32, 16))]
    optimizer = mpfused.optim.FusedAdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    short = dict(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=8, report_to="none",
                 save_strategy="no", disable_tqdm=True)
    code = with_argument(block("Frameworks", 2), "TrainingArguments(..., fp16=True)",
                         "TrainingArguments(**SHORT, fp16=True)")
    ns = run(code, Trainer=Trainer, TrainingArguments=TrainingArguments, model=model, data=data,
             optimizer=optimizer, scheduler=scheduler, SHORT=short)
    assert ns["trainer"].state.global_step == 4 and isinstance(ns["scaler"], mpfused.GradScaler)
    p = next(model.parameters())
    assert p.dtype == torch.float16 and optimizer.state[p]["master_param"].dtype == torch.float32
    scaler = ns["scaler"]
    assert scaler._growth_tracker.item() + scaler.skipped_steps > 0  # its update ran: it did the scaling
