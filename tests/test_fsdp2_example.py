"""examples/fsdp2_transformer.py through torchrun, 2 processes: FSDP2 with FusedAdamW and
mpfused.GradScaler(device_mesh=mesh) trains (the loss falls), the inf that rank 0 alone writes into its
gradient shard makes every rank skip that step and halve the scale, and the run resumed from its DCP
checkpoint equals the unbroken run bit for bit.

CPU processes with gloo (CUDA is hidden from the example unless this machine has 2 GPUs and mpfused has CUDA
kernels, which makes it use nccl). Each case runs one torchrun with a time limit, so it cannot hang."""

import importlib
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mpfused

from conftest import cuda_skip_reason

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "fsdp2_transformer.py"
TIMEOUT_S = 240
ROW = re.compile(r"^\s*(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\d+)\s*$")  # step, loss, grad norm, scale, skipped


def _skip_reason():
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if not dist.is_gloo_available():
        return "torch.distributed has no gloo backend in this torch build"
    try:
        importlib.import_module("torch.distributed.checkpoint")
        fsdp = importlib.import_module("torch.distributed.fsdp")
    except ImportError as e:
        return f"this torch has no torch.distributed.checkpoint or torch.distributed.fsdp: {e}"
    if not all(hasattr(fsdp, name) for name in ("fully_shard", "MixedPrecisionPolicy")):
        return "this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


def run_example(*args: str) -> str:
    """rank 0's output of ``torchrun --nproc_per_node 2 examples/fsdp2_transformer.py *args``; fails the test
    on a non-zero exit or after TIMEOUT_S (then the whole process group is killed)."""
    # the ranks import the mpfused this test imported (the in-place build, or an installed one: then the
    # source tree's unbuilt package must not shadow it)
    where = str(Path(mpfused.__file__).resolve().parents[1])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([where] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    if not (cuda_skip_reason() is None and torch.cuda.device_count() >= 2):
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path: gloo
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", str(EXAMPLE), *args]
    proc = subprocess.Popen(cmd, cwd=EXAMPLE.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {TIMEOUT_S} s; its output:\n{out}")
    print(out)  # shown by pytest when a test fails
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{out}"
    return out


def parse_rows(out: str) -> dict:
    rows = {}
    for line in out.splitlines():
        m = ROW.match(line)
        if m:
            step, loss, norm, scale, skipped = m.groups()
            rows[int(step)] = dict(loss=float(loss), norm=float(norm), scale=float(scale), skipped=int(skipped))
    return rows


def one_number(pattern: str, out: str) -> str:
    found = re.findall(pattern, out)
    assert len(found) == 1, f"expected one match of {pattern!r}, got {found} in:\n{out}"
    return found[0]


@pytest.mark.parametrize("param_dtype,steps,save_at,overflow_at", [
    ("fp32", 60, 30, 5),   # the overflow before the checkpoint
    ("bf16", 60, 20, 45),  # BF16 compute; the overflow after it: the resumed run skips it again
])
def test_fsdp2_example_trains_skips_together_and_resumes_bit_for_bit(tmp_path, param_dtype, steps, save_at,
                                                                     overflow_at):
    ckpt = tmp_path / "ckpt"
    out = run_example("--steps", str(steps), "--save-at", str(save_at), "--overflow-at", str(overflow_at),
                      "--param-dtype", param_dtype, "--log-every", "10", "--checkpoint-dir", str(ckpt))
    assert f"params {param_dtype} in compute" in out
    rows = parse_rows(out)
    assert {1, overflow_at - 1, overflow_at, steps} <= rows.keys(), out

    # It trains: an untrained model scores about ln(64) on the copied half; the loss falls by over 1 nat.
    assert rows[1]["loss"] == pytest.approx(math.log(64), abs=0.4)
    assert rows[steps]["loss"] < rows[1]["loss"] - 1.0, out
    assert all(math.isfinite(r["loss"]) for r in rows.values())

    # The overflow: rank 0's inf reaches the norm, the step is skipped and the scale halves; no other skips.
    before, at = rows[overflow_at - 1], rows[overflow_at]
    assert before["skipped"] == 0 and at["skipped"] == 1
    assert at["scale"] == before["scale"] / 2
    assert not math.isfinite(at["norm"])
    assert all(math.isfinite(r["norm"]) for s, r in rows.items() if s != overflow_at)
    assert rows[steps]["skipped"] == 1
    # ... on every rank, although only rank 0 saw the inf.
    assert one_number(r"skipped steps on each rank: (\[[^\]]*\])", out) == "[1, 1]"

    # The resume from the step-save_at checkpoint equals the unbroken run.
    assert (ckpt / ".metadata").is_file()
    assert f"resumed from the step-{save_at} checkpoint and re-ran steps {save_at + 1}..{steps}" in out
    for what in ("loss", "param", "optimizer state"):
        assert float(one_number(rf"max \|{what} diff\| (\S+?),", out)) == 0.0, out
    assert "scaler state equal" in out
    assert one_number(r"resume matches the unbroken run bit for bit: (\w+)", out) == "True"
