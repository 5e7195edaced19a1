"""Hugging Face accelerate with mpfused (mpfused.integrations.accelerate): Accelerator(mixed_precision="fp16")
with mpfused.GradScaler and a fused optimizer trains like the same loop written with torch.optim and
torch.amp.GradScaler, a forced overflow is skipped and reported, and save_state/load_state keep the
scaler's state and the FP32 master weights."""

import pytest
import torch

pytest.importorskip("accelerate", reason="accelerate is not installed (make test-integrations installs it)")

from accelerate import Accelerator  # noqa: E402
from framework_helpers import reset_accelerate_state  # noqa: E402

import mpfused  # noqa: E402
from mpfused.integrations.accelerate import ScalerAwareOptimizer, attach_scaler  # noqa: E402
from tolerances import FRAMEWORK_RUN_ATOL  # noqa: E402

STEPS, OVERFLOW_STEP, BATCH, LR, MOMENTUM, MAX_NORM = 6, 2, 8, 0.1, 0.9, 0.05
INIT_SCALE = 2.0**8
pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")




def make_net(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to(dtype)


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=g), 3 * torch.randn(BATCH, 2, generator=g)) for _ in range(STEPS)]


def loss_of(out, y, step):
    loss = torch.nn.functional.mse_loss(out.float(), y)
    return loss * float("inf") if step == OVERFLOW_STEP else loss  # inf/NaN gradients on that step


def accelerated_run(clip=True, dtype=torch.float32):
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    scaler = attach_scaler(accelerator, mpfused.GradScaler("cpu", init_scale=INIT_SCALE))
    net = make_net(dtype)
    inner_dtypes = []
    net[0].register_forward_hook(lambda m, i, o: inner_dtypes.append(o.dtype))
    opt = mpfused.optim.FusedSGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = accelerator.prepare(net, opt, sched)
    record = []
    for step, (x, y) in enumerate(batches()):
        loss = loss_of(model(x), y, step)
        accelerator.backward(loss)
        if clip:
            accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
        before = [p.detach().clone() for p in model.parameters()]
        scale = scaler.get_scale()
        opt.step()
        sched.step()
        opt.zero_grad()
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        record.append((accelerator.optimizer_step_was_skipped, unchanged, scale, scaler.get_scale()))
    return accelerator, model, opt, sched, scaler, record, inner_dtypes


def reference_run(clip=True):
    """The same loop by hand: torch.optim.SGD, torch.amp.GradScaler, torch.autocast, unscale_ then the clip."""
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM, foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    for step, (x, y) in enumerate(batches()):
        with torch.autocast("cpu", dtype=torch.float16):
            out = net(x)
        scaler.scale(loss_of(out, y, step)).backward()
        scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() >= scale:  # not skipped: the schedule advances, as accelerate's does
            sched.step()
        opt.zero_grad(set_to_none=True)
    return net, sched, scaler


def test_fp16_training_with_forced_overflow():
    accelerator, model, opt, sched, scaler, record, inner_dtypes = accelerated_run()
    assert isinstance(opt, ScalerAwareOptimizer) and accelerator.scaler is scaler
    # FP16 autocast on the CPU (accelerate alone would train in FP32 here)
    assert inner_dtypes and all(d == torch.float16 for d in inner_dtypes)
    for step, (skipped, unchanged, scale_before, scale_after) in enumerate(record):
        assert skipped == (step == OVERFLOW_STEP), step          # accelerator.optimizer_step_was_skipped
        assert unchanged == (step == OVERFLOW_STEP), step        # params untouched on the skipped step only
        assert scale_after == (scale_before / 2 if step == OVERFLOW_STEP else scale_before), step
    assert scaler.skipped_steps == 1 and scaler.get_scale() == INIT_SCALE / 2
    # accelerate's scheduler does not advance on the skipped step
    assert sched.scheduler.last_epoch == STEPS - 1
    # the same training as torch's own loop, the clip included
    net, ref_sched, ref_scaler = reference_run()
    assert ref_sched.last_epoch == STEPS - 1 and ref_scaler.get_scale() == scaler.get_scale()
    for p, q in zip(model.parameters(), net.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=FRAMEWORK_RUN_ATOL)
    # the clip mattered: without it the run ends far away
    unclipped, _, _ = reference_run(clip=False)
    gap = max((p.detach() - q.detach()).abs().max().item() for p, q in zip(model.parameters(), unclipped.parameters()))
    assert gap > 100 * FRAMEWORK_RUN_ATOL


def test_without_attach_accelerate_trains_fp32_and_steps_into_nan():
    # what attach_scaler fixes on the CPU: no scaler, no autocast, the overflow step writes NaN weights
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    assert accelerator.scaler is None and not accelerator.native_amp
    net = make_net()
    model, opt = accelerator.prepare(net, mpfused.optim.FusedSGD(net.parameters(), lr=LR))
    for step, (x, y) in enumerate(batches()[: OVERFLOW_STEP + 1]):
        accelerator.backward(loss_of(model(x), y, step))
        opt.step()
        opt.zero_grad()
    assert not accelerator.optimizer_step_was_skipped
    assert any(torch.isnan(p).any() for p in model.parameters())


def test_save_and_load_state_keep_scaler_and_masters(tmp_path):
    # FP16 params: the fused optimizer keeps FP32 masters, which save_state/load_state must carry
    accelerator, model, opt, _, scaler, record, _ = accelerated_run(dtype=torch.float16)
    assert [r[0] for r in record] == [s == OVERFLOW_STEP for s in range(STEPS)]
    masters = [opt.state[p]["master_param"] for p in model.parameters()]
    assert all(m.dtype == torch.float32 for m in masters)
    # the masters hold more than the FP16 params do (else the test below could not tell them apart)
    assert any(not torch.equal(m, m.half().float()) for m in masters)
    accelerator.save_state(str(tmp_path))

    reset_accelerate_state()
    accelerator2 = Accelerator(mixed_precision="fp16", cpu=True)
    scaler2 = attach_scaler(accelerator2, mpfused.GradScaler("cpu"))
    net2 = make_net(torch.float16)
    opt2 = mpfused.optim.FusedSGD(net2.parameters(), lr=LR, momentum=MOMENTUM)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    model2, opt2, sched2 = accelerator2.prepare(net2, opt2, sched2)
    accelerator2.load_state(str(tmp_path))
    assert scaler2.state_dict() == scaler.state_dict()
    assert scaler2.skipped_steps == 1 and scaler2.get_scale() == INIT_SCALE / 2
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, p2)
        m, m2 = opt.state[p]["master_param"], opt2.state[p2]["master_param"]
        assert m2.dtype == torch.float32 and torch.equal(m, m2)
        assert torch.equal(opt.state[p]["momentum_buffer"], opt2.state[p2]["momentum_buffer"])


def test_bad_arguments():
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    with pytest.raises(TypeError, match="scaler must be a mpfused.GradScaler"):
        attach_scaler(accelerator, torch.amp.GradScaler("cpu"))
    with pytest.raises(TypeError, match="accelerator must be an accelerate.Accelerator"):
        attach_scaler(object(), mpfused.GradScaler("cpu"))
    accelerator.prepare(make_net())
    with pytest.raises(RuntimeError, match="before accelerator.prepare"):
        attach_scaler(accelerator, mpfused.GradScaler("cpu"))
    reset_accelerate_state()
    with pytest.raises(ValueError, match="mixed_precision='fp16'.*got mixed_precision='bf16'"):
        attach_scaler(Accelerator(mixed_precision="bf16", cpu=True), mpfused.GradScaler("cpu"))
