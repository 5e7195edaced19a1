"""PyTorch Lightning with mpfused (mpfused.integrations.lightning): a Trainer run with FP16 mixed precision,
gradient clipping, a fused optimizer and mpfused.GradScaler, against the same training written by hand with
torch.optim, torch.amp.GradScaler and torch's clipping; a forced overflow is skipped and logged."""

import pytest
import torch

L = pytest.importorskip("lightning", reason="lightning is not installed (make test-integrations installs it)")

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import mpfused  # noqa: E402
from mpfused.integrations.lightning import MixedPrecision, SkippedStepsLogger, scaler_of  # noqa: E402
from tolerances import FRAMEWORK_RUN_ATOL  # noqa: E402

STEPS, OVERFLOW_STEP, BATCH, LR, MOMENTUM = 6, 2, 8, 0.1, 0.9
INIT_SCALE = 2.0**8


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def make_data(steps: int = STEPS) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(steps * BATCH, 8, generator=g), 3 * torch.randn(steps * BATCH, 2, generator=g))


def loss_of(net, x, y, step):
    loss = torch.nn.functional.mse_loss(net(x).float(), y)
    return loss * float("inf") if step == OVERFLOW_STEP else loss  # inf/NaN gradients on that step


class Module(L.LightningModule):
    def __init__(self, optimizer_cls, **optimizer_kwargs):
        super().__init__()
        self.net = make_net()
        self.optimizer_cls, self.optimizer_kwargs = optimizer_cls, optimizer_kwargs

    def training_step(self, batch, batch_idx):
        return loss_of(self.net, *batch, self.global_step)

    def configure_optimizers(self):
        return self.optimizer_cls(self.parameters(), **self.optimizer_kwargs)


class ParamsAroundSteps(L.Callback):
    """The params before and after each training batch (on the CPU)."""

    def __init__(self):
        self.before, self.after = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before.append([p.detach().clone() for p in pl_module.parameters()])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append([p.detach().clone() for p in pl_module.parameters()])


def fit(plugin, optimizer_cls=mpfused.optim.FusedSGD, clip_val=0.05, algorithm="norm", tmp_path=None, steps=STEPS,
        **optimizer_kwargs):
    module = Module(optimizer_cls, **(optimizer_kwargs or dict(lr=LR, momentum=MOMENTUM)))
    watch, skipped = ParamsAroundSteps(), SkippedStepsLogger()
    trainer = L.Trainer(accelerator="cpu", devices=1, plugins=[plugin], max_steps=steps, gradient_clip_val=clip_val,
                        gradient_clip_algorithm=algorithm, callbacks=[watch, skipped], log_every_n_steps=1,
                        logger=L.pytorch.loggers.CSVLogger(tmp_path) if tmp_path else False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(make_data(steps), batch_size=BATCH))
    return trainer, module, watch


def reference(clip_val, algorithm="norm", dtype=torch.float16, steps=STEPS):
    """The same training by hand: torch.optim.SGD, torch.amp.GradScaler, unscale_ then torch's clip."""
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, enabled=dtype == torch.float16)
    for step, (x, y) in enumerate(DataLoader(make_data(steps), batch_size=BATCH)):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype, cache_enabled=False):
            loss = loss_of(net, x, y, step)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if clip_val and algorithm == "norm":
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip_val)
        elif clip_val:
            torch.nn.utils.clip_grad_value_(net.parameters(), clip_val)
        scaler.step(opt)
        scaler.update()
    return net, scaler


def assert_params_close(module, net):
    for p, q in zip(module.parameters(), net.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=FRAMEWORK_RUN_ATOL)


def assert_far(module, net):
    """The run differs from ``net`` far beyond the tolerance (so the comparison above can fail)."""
    gap = max((p.detach() - q.detach()).abs().max().item() for p, q in zip(module.parameters(), net.parameters()))
    assert gap > 100 * FRAMEWORK_RUN_ATOL


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_fp16_clipping_matches_torch_loop(algorithm, tmp_path):
    clip_val = 0.05 if algorithm == "norm" else 0.01
    scaler = mpfused.GradScaler("cpu", init_scale=INIT_SCALE)
    trainer, module, watch = fit(MixedPrecision("16-mixed", "cpu", scaler=scaler), clip_val=clip_val,
                                 algorithm=algorithm, tmp_path=tmp_path)
    assert scaler_of(trainer) is scaler
    net, ref_scaler = reference(clip_val, algorithm)
    assert_params_close(module, net)
    # clipping was active: without it the same run ends elsewhere
    assert_far(module, reference(0.0)[0])
    # the forced overflow: skipped (params untouched), counted, the scale backed off as torch's did
    for step in range(STEPS):
        unchanged = all(torch.equal(a, b) for a, b in zip(watch.before[step], watch.after[step]))
        assert unchanged == (step == OVERFLOW_STEP), step
    assert scaler.skipped_steps == 1 and scaler.last_step_skipped is False
    assert scaler.get_scale() == ref_scaler.get_scale() == INIT_SCALE / 2
    # ... and logged by SkippedStepsLogger at every step: 0 before the overflow, 1 from it on
    rows = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    logged = {int(r.split(",")[header.index("step")]): r.split(",") for r in rows[1:]}
    assert sorted(logged) == list(range(STEPS))
    for step, row in logged.items():
        assert float(row[header.index("skipped_steps")]) == (step >= OVERFLOW_STEP), step
        assert float(row[header.index("loss_scale")]) == (INIT_SCALE if step < OVERFLOW_STEP else INIT_SCALE / 2)


def test_fused_adamw_with_norm_clipping():
    # Adam and a default-made scaler (2^16: the first steps overflow until the scale fits): the run trains,
    # and exactly the steps the scaler counts as skipped left the params as they were
    plugin = MixedPrecision("16-mixed", "cpu")
    _, module, watch = fit(plugin, optimizer_cls=mpfused.optim.FusedAdamW, clip_val=0.5, lr=1e-2)
    unchanged = [all(torch.equal(a, b) for a, b in zip(before, after)) for before, after in zip(watch.before, watch.after)]
    assert unchanged[OVERFLOW_STEP] and sum(unchanged) == plugin.scaler.skipped_steps < STEPS
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_bf16_mixed_clipping_matches_torch_loop():
    # Lightning's own plugin refuses clipping with fused optimizers under bf16 too; ours clips as in FP32.
    # No loss scale: the forced overflow would write NaN into the weights, so the runs stop before it.
    _, module, _ = fit(MixedPrecision("bf16-mixed", "cpu"), clip_val=0.05, steps=OVERFLOW_STEP)
    net, _ = reference(0.05, dtype=torch.bfloat16, steps=OVERFLOW_STEP)
    assert_params_close(module, net)
    assert_far(module, reference(0.0, dtype=torch.bfloat16, steps=OVERFLOW_STEP)[0])


def test_torch_optimizer_with_our_scaler():
    # a plain torch optimizer: Lightning unscales first, the scaler clips the unscaled gradients in place
    scaler = mpfused.GradScaler("cpu", init_scale=INIT_SCALE)
    _, module, _ = fit(MixedPrecision("16-mixed", "cpu", scaler=scaler), optimizer_cls=torch.optim.SGD,
                       clip_val=0.05, lr=LR, momentum=MOMENTUM, foreach=False)
    net, _ = reference(0.05)
    assert_params_close(module, net)
    assert scaler.skipped_steps == 1


class SkipsABatch(Module):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            return None  # Lightning's way to skip a batch: no backward, no step
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_batch_skipped_by_training_step(algorithm):
    # no gradients to clip: nothing is recorded on the scaler, so the next batch clips and steps as usual
    plugin = MixedPrecision("16-mixed", "cpu", scaler=mpfused.GradScaler("cpu", init_scale=INIT_SCALE))
    module = SkipsABatch(mpfused.optim.FusedSGD, lr=LR, momentum=MOMENTUM)
    trainer = L.Trainer(accelerator="cpu", devices=1, plugins=[plugin], max_epochs=1, gradient_clip_val=0.05,
                        gradient_clip_algorithm=algorithm, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(make_data(), batch_size=BATCH))
    assert trainer.global_step == STEPS  # Lightning counts the skipped batch's (empty) step too
    assert all(torch.isfinite(p).all() for p in module.parameters())
    # the batches after the skipped one stepped: the forced overflow (global step 2) was skipped, once
    assert plugin.scaler.skipped_steps == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="precision must be"):
        MixedPrecision("32-true", "cpu")
    with pytest.raises(TypeError, match="scaler must be a mpfused.GradScaler"):
        MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="bf16-mixed' takes no scaler"):
        MixedPrecision("bf16-mixed", "cpu", scaler=mpfused.GradScaler("cpu"))
    with pytest.raises(TypeError, match="device must be"):
        MixedPrecision("16-mixed", torch.device("cpu"))
    with pytest.raises(TypeError, match="prog_bar must be a bool"):
        SkippedStepsLogger(prog_bar="yes")


def test_checkpoint_keeps_the_scaler_state(tmp_path):
    scaler = mpfused.GradScaler("cpu", init_scale=INIT_SCALE)
    trainer, _, _ = fit(MixedPrecision("16-mixed", "cpu", scaler=scaler))
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    restored = MixedPrecision("16-mixed", "cpu", scaler=mpfused.GradScaler("cpu"))
    checkpoint = torch.load(path, weights_only=True)
    restored.load_state_dict(checkpoint["MixedPrecision"])
    assert restored.scaler.state_dict() == scaler.state_dict()
    assert restored.scaler.skipped_steps == 1 and restored.scaler.get_scale() == INIT_SCALE / 2


class ManualModule(L.LightningModule):
    """Manual optimization: the module clips through self.clip_gradients and steps itself."""

    def __init__(self, clip_val, algorithm, optimizer_cls):
        super().__init__()
        self.automatic_optimization = False
        self.net = make_net()
        self.clip_val, self.algorithm, self.optimizer_cls = clip_val, algorithm, optimizer_cls

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss_of(self.net, *batch, self.global_step))
        self.clip_gradients(opt, gradient_clip_val=self.clip_val, gradient_clip_algorithm=self.algorithm)
        opt.step()

    def configure_optimizers(self):
        kw = {} if self.optimizer_cls is mpfused.optim.FusedSGD else dict(foreach=False)
        return self.optimizer_cls(self.parameters(), lr=LR, momentum=MOMENTUM, **kw)


@pytest.mark.parametrize("optimizer_cls", [mpfused.optim.FusedSGD, torch.optim.SGD])
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_manual_optimization_clips_as_torch(algorithm, optimizer_cls):
    """self.optimizers() is a LightningOptimizer around the fused one: the plugin recorded the clip under the
    wrapper's id, where the step never looked (a norm clip was not applied; a value clip unscaled the grads
    twice). The run now matches the hand-written torch loop."""
    clip_val = 0.05 if algorithm == "norm" else 0.01
    module = ManualModule(clip_val, algorithm, optimizer_cls)
    scaler = mpfused.GradScaler("cpu", init_scale=INIT_SCALE)
    L.Trainer(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
              max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(module, DataLoader(make_data(), batch_size=BATCH))
    net, ref_scaler = reference(clip_val, algorithm)
    assert_params_close(module, net)
    assert_far(module, reference(0.0)[0])
    assert scaler.get_scale() == ref_scaler.get_scale()
