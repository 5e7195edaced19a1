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


def test_a_missing_cuda_tool_fails_only_the_stages_that_need_it(tmp_path):
    # A stand-in interpreter whose dependency check finds every package and a GPU (and which has no mpfused
    # build), and a compute-sanitizer that is not there: the deps stage passes and names it, the stages that
    # do not need it go on to their next check, the sanitize stage fails naming it.
    python = tmp_path / "stand-in-python"
    python.write_text("#!/bin/sh\nif [ \"$1\" = - ]; then cat >/dev/null; echo 'torch CUDA | cuda:0 stand-in'; "
                      "exit 0; fi\nexit 1\n")
    python.chmod(0o755)
    env_extra = {"COMPUTE_SANITIZER": str(tmp_path / "no-such-compute-sanitizer")}

    def run(*args):
        env = dict(os.environ, PYTHON=str(python), GPU_CHECK_LOGS=str(tmp_path / "logs"), **env_extra)
        r = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300)
        return r.returncode, r.stdout, [line for line in r.stdout.splitlines() if line.startswith("gpu-check ")][-1]

    rc, out, line = run("deps")
    assert rc == 0 and line.startswith("gpu-check deps: PASS"), out
    assert "not found: compute-sanitizer" in line and "missing" not in line, line
    for name in ("tests", "bench", "bench-cpu"):
        rc, out, line = run(name)
        assert rc != 0 and "no CUDA build of mpfused here" in out and "compute-sanitizer" not in line, out
    rc, out, line = run("sanitize", "memcheck")
    assert rc != 0 and line.startswith("gpu-check sanitize-memcheck: FAIL") and "missing: compute-sanitizer" in line


def test_stages_refuse_bad_arguments_and_a_missing_build(tmp_path):
    rc, out, line = stage(tmp_path, "sanitize", "leakcheck")
    assert rc == 2 and "must be memcheck, racecheck, synccheck or initcheck, got 'leakcheck'" in out
    assert line.startswith("gpu-check sanitize-leakcheck: FAIL")
    rc, out, line = stage(tmp_path, "nonsense")
    assert rc == 2 and "unknown stage 'nonsense'" in out
    if not torch.cuda.is_available():  # every stage checks the dependencies first
        for name in ("build", "tests", "bench", "bench-cpu", "profile"):
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
    assert {"sanitize-memcheck-gemm-nn", "tests-optim", "bench-gemm"} <= set(labels), labels
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


# ---- the prebuilt extension (.ci/gpu_prebuild.sh builds it off the GPU machine; the build stage reuses it)

def tree_copy(tmp_path, with_package=False):
    """The parts of the repository that the key and the reuse read, copied: the script, the sources
    and (for a load) the Python package without its built extension."""
    tree = tmp_path / "tree"
    (tree / ".ci").mkdir(parents=True)
    shutil.copy(SCRIPT, tree / ".ci" / SCRIPT.name)
    shutil.copytree(ROOT / "csrc", tree / "csrc")
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(ROOT / name, tree / name)
    if with_package:
        shutil.copytree(ROOT / "mpfused", tree / "mpfused",
                        ignore=shutil.ignore_patterns("_C*.so", "_build_config.py", "__pycache__"))
    return tree


def run_script(tree, *args, env_extra=None):
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_LOGS=str(tree / "logs"), **(env_extra or {}))
    return subprocess.run(["bash", str(tree / ".ci" / SCRIPT.name), *args], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tree)


def key_of(tree):
    r = run_script(tree, "--key", sys.executable)
    assert r.returncode == 0, r.stderr
    return dict(line.split("=", 1) for line in r.stdout.splitlines())


def test_the_build_key_names_the_sources_torch_and_python(tmp_path):
    import sysconfig
    tree = tree_copy(tmp_path)
    key = key_of(tree)
    assert set(key) == {"sources", "torch", "torch_git", "ext_suffix"}
    assert key["torch"] == torch.__version__ and key["torch_git"] == str(torch.version.git_version)
    assert key["ext_suffix"] == sysconfig.get_config_var("EXT_SUFFIX")
    assert len(key["sources"]) == 64 and key_of(tree) == key  # a sha256, the same twice
    # any change to a source, setup.py or pyproject.toml gives another key; the other parts stay
    for path in (tree / "csrc" / "cuda" / "optim.cu", tree / "setup.py", tree / "pyproject.toml"):
        before = key_of(tree)
        path.write_text(path.read_text() + "\n")
        after = key_of(tree)
        assert after["sources"] != before["sources"], path
        assert {k: v for k, v in after.items() if k != "sources"} == {k: v for k, v in before.items() if k != "sources"}
    # a new file under csrc counts too
    before = key_of(tree)
    (tree / "csrc" / "core" / "extra.h").write_text("// new\n")
    assert key_of(tree)["sources"] != before["sources"]


def test_a_prebuilt_extension_is_reused_only_where_its_key_and_arch_fit(tmp_path):
    tree = tree_copy(tmp_path, with_package=True)
    prebuilt = tree / "build" / "gpu-prebuilt"
    r = run_script(tree, "--reuse", "9.0")
    assert r.returncode != 0 and "no prebuilt extension" in r.stdout and "building from source" in r.stdout
    prebuilt.mkdir(parents=True)
    for f in list((ROOT / "mpfused").glob("_C*.so")) + [ROOT / "mpfused" / "_build_config.py"]:
        shutil.copy(f, prebuilt / f.name)
    key = key_of(tree)

    def write_key(archs, **changed):
        k = dict(key, **changed)
        (prebuilt / "PREBUILT").write_text("".join(f"{n}={v}\n" for n, v in k.items()) + f"archs={archs}\n")

    # another torch, or other sources: refused, naming the part that differs on both sides
    write_key("9.0", torch="2.0.0+cu999")
    r = run_script(tree, "--reuse", "9.0")
    assert r.returncode != 0 and "not for this machine or these sources" in r.stdout
    assert "prebuilt: torch=2.0.0+cu999" in r.stdout and f"here:     torch={torch.__version__}" in r.stdout
    assert "sources=" not in r.stdout  # only what differs
    write_key("9.0", sources="0" * 64)
    r = run_script(tree, "--reuse", "9.0")
    assert r.returncode != 0 and "prebuilt: sources=" + "0" * 64 in r.stdout
    assert not list((tree / "mpfused").glob("_C*.so"))  # nothing was put in place
    # the right key, but not this GPU's arch (9.0+PTX counts as 9.0; 9.0 is not 8.0 or 9.0a)
    write_key("8.0;8.6")
    r = run_script(tree, "--reuse", "9.0")
    assert r.returncode != 0 and "has archs 8.0;8.6, not this GPU's 9.0" in r.stdout
    write_key("9.0a")
    assert "not this GPU's 9.0" in run_script(tree, "--reuse", "9.0").stdout
    write_key("8.0;9.0+PTX")
    r = run_script(tree, "--reuse", "8.0;9.0")
    if torch.version.cuda is None:
        # key and archs fit, so the extension is put in place and loaded: this CPU-only one has no CUDA kernels
        assert r.returncode != 0 and "does not load here: building from source" in r.stdout, r.stdout + r.stderr
        assert sorted(p.name for p in (tree / "mpfused").glob("_C*.so")) == sorted(p.name for p in prebuilt.glob("_C*.so"))


def test_a_window_refuses_unknown_stages_and_reports_what_it_ran(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_LOGS=str(tmp_path / "logs"), GPU_WINDOW_OUT=str(out))
    r = subprocess.run(["bash", str(SCRIPT), "window", "120", "tests", "profile", "lint"], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 2 and "unknown stage 'lint'" in r.stdout and "'profile'" not in r.stdout
    if torch.cuda.is_available():
        return
    r = subprocess.run(["bash", str(SCRIPT), "window", "120", "bench"], capture_output=True, text=True,
                       env=env, timeout=300)
    # no GPU here: deps fails, nothing else runs but the report, and the window's files are written
    assert r.returncode != 0
    labels = [row.split("\t")[0] for row in (out / "summary.tsv").read_text().splitlines()]
    assert labels == ["deps", "report"], labels
    import tarfile
    with tarfile.open(out / "gpu-window.tar.gz") as tar:
        names = tar.getnames()
    assert "logs/deps.log" in names and "logs/summary.tsv" in names and "logs/report.log" in names, names
    # a window too short for a stage: the stage is reported as skipped, and the report counts it
    r = subprocess.run(["bash", str(SCRIPT), "window", "30", "tests"], capture_output=True, text=True, env=env,
                       timeout=300)
    rows = [row.split("\t") for row in (out / "summary.tsv").read_text().splitlines()]
    assert [row[:2] for row in rows] == [["deps", "SKIPPED"], ["report", "FAIL"]], rows
    assert r.returncode != 0 and "stages not passed: 1" in r.stdout


def test_the_wgmma_diagnosis_says_where_wrong_outputs_came_from(monkeypatch):
    """.ci/wgmma_diagnose.py (run by the tests stage when the Hopper kernel's tests fail): on the CPU GEMM every case
    passes, and a GEMM that misplaces one 16-byte chunk of outputs in one consumer's rows is reported with the
    count, the place in the tile and the decoded source of the first wrong output."""
    import importlib.util

    import mpfused

    spec = importlib.util.spec_from_file_location("wgmma_diagnose", ROOT / ".ci" / "wgmma_diagnose.py")
    diag = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(diag)
    assert diag.run_case("fp16-acol-bcol-k320-krow", "cpu") == (True, "ok")
    real = mpfused.gemm

    def misplaced(a, b, **kw):  # rows 64-127 of each tile (the second consumer): columns 8-15 take 0-7's values
        out = real(a, b, **kw)
        bad = out.clone()
        bad[:, 64:128, 8:16] = out[:, 64:128, 0:8]
        return bad

    monkeypatch.setattr(mpfused, "gemm", misplaced)
    ok, msg = diag.run_case("fp16-arow-brow-k64-col", "cpu")
    assert not ok
    assert msg.startswith(f"{3 * 64 * 8} of {3 * 384 * 768} wrong") and "by consumer {1: 1536}" in msg, msg
    assert "by cols32 {0: 1536}" in msg and "by batch {0: 512, 1: 512, 2: 512}" in msg, msg
    assert "(0,64,8) got 1 (from batch 0 col%512 0), want batch 0 col%512 8" in msg, msg


# ---- the Hopper kernel's canaries (run_wgmma, in the test stage)

STAND_IN = """#!/usr/bin/env bash
# a stand-in interpreter: records each call; pytest's canary of the form in $BROKEN reports a broken context
echo "$*" >> "$CALLS"
[ "$1" = "-c" ] && exit 1  # (no pytest-xdist, no pytest-timeout)
case "$*" in
  *"-k itself_runs"*"cuda-$BROKEN-1 "*) echo "the CUDA context of its process was broken by X (stand-in)"
                                       echo "1 failed in 1.00s"; exit 1 ;;
  *"-k itself_runs"*) echo "1 passed in 1.00s"; exit 0 ;;
esac
echo "7 passed in 2.00s"
"""


@pytest.mark.parametrize("broken", ["none", "wgmma-cluster", "wgmma"])
def test_a_hopper_canary_that_breaks_the_context_keeps_its_form_from_running(tmp_path, broken):
    """A Hopper kernel whose pipeline never completes traps after about 70 s and breaks its process's CUDA
    context: each case of it would cost as much. The test stage runs one small case of each form first, alone,
    and leaves out the form whose canary broke the context (the plain form: every case)."""
    python, calls = tmp_path / "python", tmp_path / "calls"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    env = dict(os.environ, PYTHON=str(python), GPU_CHECK_LOGS=str(tmp_path / "logs"), CALLS=str(calls),
               BROKEN=broken)
    log = tmp_path / "w.log"
    r = subprocess.run(["bash", str(SCRIPT), "--wgmma", str(log), "tests/test_gemm.py"], capture_output=True,
                       text=True, env=env, timeout=120)
    runs = [c for c in calls.read_text().splitlines() if c.startswith("-m pytest")]
    canaries = [c for c in runs if "-k itself_runs" in c]
    assert all("-p no:xdist" in c for c in canaries)
    counts = (tmp_path / "w.log.counts").read_text()
    if broken == "wgmma":
        assert r.returncode == 2 and len(runs) == 1 and "cuda-wgmma-1 " in canaries[0] + " "
        assert "plain kernel's canary broke the CUDA context; no other case run" in counts
        return
    assert len(canaries) == 2 and [c for c in runs if c not in canaries] == [runs[-1]]
    if broken == "wgmma-cluster":
        assert r.returncode == 2 and "-k not cluster" in runs[-1]
        assert counts.startswith("7 passed") and "cluster kernel's canary broke the CUDA context" in counts
    else:
        assert r.returncode == 0 and "-k" not in runs[-1] and counts.strip() == "7 passed in 2.00s"
