"""The GPU check's stages (.ci/gpu_check.sh, `make gpu-check-<stage>`) as far as they run without a GPU: the
dependency check names what is missing, a stage that needs the build says so, bad arguments are refused,
a stage past its time limit is stopped and reported, and every stage ends with its summary line, kept
for the report."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(shutil.which("timeout") is None or shutil.which("bash") is None,
                                reason="needs bash and coreutils' timeout")


def stage(tmp_path, *args, python=sys.executable, limit=None):
    env = dict(os.environ, PYTHON=str(python), GPU_CHECK_LOGS=str(tmp_path / "logs"))
    if limit is not None:
        env["GPU_STAGE_TIMEOUT"] = str(limit)
    r = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300)
    summary = [line for line in r.stdout.splitlines() if line.startswith("gpu-check ")]
    return r.returncode, r.stdout, summary[-1] if summary else ""


def summary_rows(tmp_path):
    return [line.split("\t") for line in (tmp_path / "logs" / "summary.tsv").read_text().splitlines()]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU lacks")
def test_deps_names_what_is_missing(tmp_path):
    rc, out, line = stage(tmp_path, "deps")
    assert rc != 0
    assert line.startswith("gpu-check deps: FAIL in ") and "missing" in line, out
    missing = "a CUDA build of torch" if torch.version.cuda is None else "a visible CUDA device"
    assert missing in line
    assert summary_rows(tmp_path)[-1][:2] == ["deps", "FAIL"]
    assert (tmp_path / "logs" / "deps.log").read_text().count("missing") >= 1


def test_stages_refuse_bad_arguments_and_a_missing_build(tmp_path):
    rc, out, line = stage(tmp_path, "sanitize", "leakcheck")
    assert rc == 2 and "must be memcheck, racecheck, synccheck or initcheck, got 'leakcheck'" in out
    assert line.startswith("gpu-check sanitize-leakcheck: FAIL")
    rc, out, line = stage(tmp_path, "nonsense")
    assert rc == 2 and "unknown stage 'nonsense'" in out
    if not torch.cuda.is_available():  # every stage checks the dependencies first
        for name in ("build", "tests", "bench"):
            rc, out, line = stage(tmp_path, name)
            assert rc != 0 and line.startswith(f"gpu-check {name}: FAIL") and "missing" in line, out
    # a stage run again replaces its line; the report lists every stage and fails while one has not passed
    stage(tmp_path, "sanitize", "leakcheck")
    labels = [row[0] for row in summary_rows(tmp_path)]
    assert labels.count("sanitize-leakcheck") == 1 and "nonsense" in labels
    assert torch.cuda.is_available() or {"build", "tests", "bench"} <= set(labels)
    # a stage given files or benchmarks keeps a line per part
    stage(tmp_path, "sanitize", "memcheck", "tests/test_gemm.py", "tests/test_nn.py")
    stage(tmp_path, "tests", "tests/test_optim.py")
    stage(tmp_path, "bench", "bench_gemm")
    labels = [row[0] for row in summary_rows(tmp_path)]
    assert {"sanitize-memcheck-gemm-nn", "tests-optim", "bench-bench_gemm"} <= set(labels), labels
    rc, out, line = stage(tmp_path, "report")
    assert rc != 0 and "sanitize-leakcheck" in out and "nonsense" in out
    assert line.startswith("gpu-check report: FAIL") and "stages not passed" in line


def test_a_stage_past_its_limit_is_stopped_and_reported(tmp_path):
    slow = tmp_path / "slow-python"
    slow.write_text(f"#!/bin/sh\nsleep 30\nexec {sys.executable} \"$@\"\n")
    slow.chmod(0o755)
    rc, out, line = stage(tmp_path, "deps", python=slow, limit=2)
    assert rc in (124, 137)
    assert line.startswith("gpu-check deps: TIMEOUT in ") and "stopped after 2s" in line
    assert summary_rows(tmp_path)[-1][:2] == ["deps", "TIMEOUT"]
