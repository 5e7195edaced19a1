"""examples/hf_trainer.py, small: the Hugging Face Trainer with optimizers=(FusedAdamW, scheduler) and
mpfused.GradScaler trains with FP16 mixed precision, skips and logs a forced overflow, saves, and resumes
bit for bit: params, the optimizer's FP32 masters and moments, and the scaler's state."""

import os

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # the example builds its model from a config; nothing may be downloaded
pytest.importorskip("transformers", reason="transformers is not installed (make test-integrations installs it)")
pytest.importorskip("accelerate", reason="accelerate is not installed (make test-integrations installs it)")

from framework_helpers import reset_accelerate_state  # noqa: E402

import mpfused  # noqa: E402
from example_helpers import load_example  # noqa: E402

example = load_example("hf_trainer")
STEPS, SAVE, OVERFLOW = 8, 4, 1
pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")
SMALL = ["--steps", str(STEPS), "--save-steps", str(SAVE), "--overflow-step", str(OVERFLOW), "--batch-size", "8"]




@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_fp16")
    reset_accelerate_state()
    return example.main(SMALL + ["--out", str(out)])


def test_resume_is_bit_exact(fp16_run):
    assert fp16_run["differences"] == []
    unbroken, resumed = fp16_run["unbroken"], fp16_run["resumed"]
    assert unbroken["global_step"] == resumed["global_step"] == STEPS
    # the resumed run really started at the checkpoint: it trained only the later steps (the overflow
    # was before it) and got the skipped-step count from the saved scaler
    assert unbroken["overflow_hits"] == 1 and resumed["overflow_hits"] == 0
    assert unbroken["forwards"] == STEPS and resumed["forwards"] == STEPS - SAVE
    assert resumed["skipped_steps"] == unbroken["skipped_steps"] == 1
    assert resumed["scale"] == unbroken["scale"]


def test_skipped_step_is_logged_and_holds_the_schedule(fp16_run):
    unbroken = fp16_run["unbroken"]
    logged = {step: (skipped, scale) for step, skipped, scale in unbroken["logged"]}
    assert sorted(logged) == list(range(1, STEPS + 1))  # every log line (logging_steps=1) has the count
    for step, (skipped, scale) in logged.items():
        # log "step" is global_step after the step; the forced overflow is the step from OVERFLOW to OVERFLOW + 1
        assert skipped == (1 if step > OVERFLOW else 0), step
    assert logged[OVERFLOW + 1][1] == logged[OVERFLOW][1] / 2  # the scale backed off on the skipped step
    # the Trainer does not advance the LR schedule on a skipped step (accelerator.optimizer_step_was_skipped)
    assert unbroken["scheduler_steps"] == STEPS - 1
    assert all(torch.isfinite(p).all() for p in unbroken["snapshot"]["params"].values())


def test_checkpoint_holds_the_fp32_masters(fp16_run):
    checkpoint = fp16_run["checkpoint"]
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    params = fp16_run["unbroken"]["snapshot"]["params"]
    assert len(saved["state"]) == len(params)
    for state in saved["state"].values():
        master = state["master_param"]
        assert master.dtype == torch.float32 and state["exp_avg"].dtype == torch.float32
    # the masters carry bits the FP16 params lack: restoring them from the params would not be exact
    assert any(not torch.equal(s["master_param"], s["master_param"].half().float()) for s in saved["state"].values())
    scaler_state = torch.load(checkpoint / "scaler.pt", weights_only=True)
    assert scaler_state["_skipped_steps"] == 1
    # the resumed run's masters are the unbroken run's, bit for bit (the comparison the example makes)
    snap = fp16_run["resumed"]["snapshot"]["optimizer"]
    assert all(snap[k].dtype == torch.float32 for k in snap if k.endswith(":master_param"))
    assert sum(k.endswith(":master_param") for k in snap) == len(params)


def test_comparison_sees_one_flipped_bit(fp16_run):
    # the bit-exact check can fail: one bit of one master, or of the scaler's count, is a difference
    a = fp16_run["unbroken"]["snapshot"]
    key = next(k for k in a["optimizer"] if k.endswith(":master_param"))
    b = {"params": dict(a["params"]), "optimizer": dict(a["optimizer"]), "scaler": dict(a["scaler"])}
    flipped = b["optimizer"][key].clone()
    flipped.view(torch.int32).view(-1)[0] ^= 1
    b["optimizer"][key] = flipped
    assert example.differences(a, b) == [f"optimizer: {key}"]
    b["optimizer"][key] = a["optimizer"][key]
    b["scaler"]["_skipped_steps"] += 1
    assert len(example.differences(a, b)) == 1 and example.differences(a, b)[0].startswith("scaler:")


def test_fp32_params_resume_bit_exact(tmp_path):
    # FP32 params under FP16 autocast: no masters, the same exact resume
    result = example.main(SMALL + ["--out", str(tmp_path), "--param-dtype", "float32"])
    assert result["differences"] == []
    assert not any(k.endswith(":master_param") for k in result["resumed"]["snapshot"]["optimizer"])
    assert result["resumed"]["skipped_steps"] == 1


def test_use_grad_scaler_needs_fp16(tmp_path):
    from transformers import Trainer, TrainingArguments

    from mpfused.integrations.transformers import SkippedStepsCallback, use_grad_scaler

    model = example.build_model(torch.float32)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=example.Progressions())
    with pytest.raises(ValueError, match="TrainingArguments\\(fp16=True\\)"):
        use_grad_scaler(trainer, mpfused.GradScaler("cpu"))
    with pytest.raises(TypeError, match="trainer must be a transformers.Trainer"):
        use_grad_scaler(object(), mpfused.GradScaler("cpu"))
    with pytest.raises(TypeError, match="scaler must be a mpfused.GradScaler"):
        SkippedStepsCallback(torch.amp.GradScaler("cpu"))
