"""What the extension reports about its build, and the guard against a torch ABI mismatch."""

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
import torch

import mpfused

ROOT = Path(__file__).resolve().parents[1]


def test_build_info_reports_what_was_compiled():
    info = mpfused.build_info()
    assert set(info) == {"version", "torch_version", "cuda_version", "cuda_arch_list", "cpu_isa", "cpu_isa_supported",
                         "openmp"}
    assert info["cpu_isa"] in info["cpu_isa_supported"].split(", ")
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert info["version"] == re.search(r'^version\s*=\s*"([^"]+)"', pyproject, re.M).group(1)
    assert info["version"] == mpfused.__version__
    assert info["torch_version"] == torch.__version__
    assert isinstance(info["openmp"], bool)
    if info["cuda_version"] is None:
        assert info["cuda_arch_list"] is None and not mpfused.has_cuda_kernels()
    else:
        assert re.fullmatch(r"\d+\.\d+", info["cuda_version"]) and info["cuda_arch_list"]
        assert torch.version.cuda is not None


def test_python_dash_m_prints_build_info():
    out = subprocess.run([sys.executable, "-m", "mpfused"], capture_output=True, text=True, check=True).stdout
    assert "torch_version" in out and torch.__version__ in out and "openmp" in out
    # --json: the same as one object; an unknown argument is refused (every argument was ignored)
    out = subprocess.run([sys.executable, "-m", "mpfused", "--json"], capture_output=True, text=True, check=True).stdout
    info = json.loads(out)
    assert info["torch (running)"] == torch.__version__ and info["openmp"] == mpfused.build_info()["openmp"]
    r = subprocess.run([sys.executable, "-m", "mpfused", "--bogus"], capture_output=True, text=True)
    assert r.returncode == 2 and "unrecognized arguments: --bogus" in r.stderr


def test_import_loads_no_compiler_stack():
    """``import mpfused`` costs little more than ``import torch``: nothing of torch.compile (torch._dynamo,
    1.4 s to import) or inductor is imported until the user compiles."""
    code = "import sys, mpfused; print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_import_against_another_torch_fails_with_a_clear_message():
    # Pretend the installed torch is another release: the import must refuse before loading _C.
    code = textwrap.dedent(
        """
        import torch
        torch.__version__ = "1.0.0+other"
        try:
            import mpfused
        except ImportError as e:
            print("IMPORT-ERROR:", e)
        else:
            print("IMPORTED")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "IMPORT-ERROR:" in out, out
    assert f"built against torch {torch.__version__}" in out and "1.0.0+other" in out
    assert "pip install --no-build-isolation" in out


def _setup_functions(*names: str) -> dict:
    """Functions of setup.py, without running it (running it builds): their definitions, executed alone."""
    import ast

    tree = ast.parse((ROOT / "setup.py").read_text())
    module = ast.Module(body=[n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names],
                        type_ignores=[])
    namespace = {"torch": torch, "re": re, "subprocess": subprocess, "sys": sys, "Path": Path}
    exec(compile(module, "setup.py", "exec"), namespace)
    assert all(n in namespace for n in names), names
    return namespace


def test_setup_checks_nvcc_against_the_cuda_of_torch():
    """setup.py refuses an nvcc of another CUDA major version than torch's, naming both and the ways out;
    a different minor version is allowed with a note."""
    check = _setup_functions("cuda_toolkit_problem")["cuda_toolkit_problem"]
    assert check("13.0", "13.0") == ("", "")
    level, message = check("13.0", "12.8")
    assert level == "error"
    for part in ("CUDA 13.0", "CUDA 12.8", torch.__version__, "CUDA_HOME", "a CUDA 12.x toolkit", "built for CUDA 13.x",
                 "MPFUSED_FORCE_CPU=1"):
        assert part in message, (part, message)
    level, message = check("12.4", "13.0")
    assert level == "error" and "built for CUDA 12.x" in message and "a CUDA 13.x toolkit" in message
    level, message = check("13.1", "13.0")
    assert level == "note" and "13.1" in message and "13.0" in message


def test_setup_checks_the_setuptools_version():
    """pyproject.toml's SPDX license needs setuptools 77+; with --no-build-isolation the environment's own builds, and
    an older one (Python 3.11's venvs start with 65.5) stopped with a schema error naming no version: setup.py says
    which setuptools it found and what to install, before anything else."""
    problem = _setup_functions("setuptools_problem")["setuptools_problem"]
    assert problem("77.0.3") == problem("84.2.1") == problem("100.0") == ""
    message = problem("65.5.0")
    assert "setuptools 65.5.0 is too old" in message and "pip install -U 'setuptools>=77'" in message
    assert problem("76.1.0") != "" and problem("61.0.0") != ""
    assert problem("59.6.0") == ""  # reads no [project] table: `setup.py build_ext` works as before
    assert re.search(r'^license = "Apache-2\.0"', (ROOT / "pyproject.toml").read_text(), re.M)  # what needs 77
    assert '"setuptools>=77"' in (ROOT / "pyproject.toml").read_text()


def test_setup_refuses_a_torch_older_than_pyproject_asks_for():
    """Built against an older torch, the extension would fail its ABI check once pip installed the torch that
    pyproject.toml asks for: setup.py stops first, naming both versions."""
    functions = _setup_functions("torch_problem")
    functions["OLDEST_TORCH"] = (2, 9)
    problem = functions["torch_problem"]
    assert problem("2.9.1+cu128") == problem("2.13.0+cpu") == problem("3.0.0") == ""
    message = problem("2.8.0")
    assert "torch 2.8.0 is older than 2.9" in message and "pip install 'torch>=2.9'" in message
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"torch>=2\.9"', pyproject) and "OLDEST_TORCH = (2, 9)" in (ROOT / "setup.py").read_text()


def test_setup_reads_the_nvcc_release(tmp_path):
    """The release number comes from $CUDA_HOME/bin/nvcc --version; an nvcc that prints none, or cannot run,
    stops the build with a message naming it."""
    read = _setup_functions("nvcc_version")["nvcc_version"]
    (tmp_path / "bin").mkdir()
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                    "echo 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    nvcc.chmod(0o755)
    assert read(str(tmp_path)) == "12.4"
    nvcc.write_text("#!/bin/sh\necho 'something else'\n")
    with pytest.raises(SystemExit, match="printed no release number"):
        read(str(tmp_path))
    with pytest.raises(SystemExit, match="could not run"):
        read(str(tmp_path / "missing"))


def test_setup_builds_compute_capability_9_for_sm90a():
    """setup.py makes its own -gencode flags: machine code per arch, compute capability 9.0 as sm_90a (the Hopper
    GEMM's warpgroup MMAs), PTX for "+PTX" entries as the generic compute_XY (which newer GPUs compile), each flag
    once; arches named as torch names them are left to torch; a bad entry stops the build naming it."""
    flags = _setup_functions("gencode_flags")["gencode_flags"]
    assert flags("7.5;8.0;9.0+PTX") == (["-gencode=arch=compute_75,code=sm_75", "-gencode=arch=compute_80,code=sm_80",
                                         "-gencode=arch=compute_90a,code=sm_90a",
                                         "-gencode=arch=compute_90,code=compute_90"], True)
    assert flags("8.6 8.9+PTX") == (["-gencode=arch=compute_86,code=sm_86", "-gencode=arch=compute_89,code=sm_89",
                                     "-gencode=arch=compute_89,code=compute_89"], False)
    assert flags("9.0a") == (["-gencode=arch=compute_90a,code=sm_90a"], True)
    assert flags("10.0+PTX") == (["-gencode=arch=compute_100,code=sm_100",
                                  "-gencode=arch=compute_100,code=compute_100"], False)
    assert flags("9.0+PTX", sm90a_ok=False) == (["-gencode=arch=compute_90,code=sm_90",
                                                 "-gencode=arch=compute_90,code=compute_90"], False)
    assert flags("9.0;9.0a;8.0") == (["-gencode=arch=compute_90a,code=sm_90a",
                                      "-gencode=arch=compute_80,code=sm_80"], True)  # each flag once
    assert flags("Ampere;Hopper") == ([], False) and flags("native") == ([], False)  # torch's names: torch's flags
    for bad in ("9", "8.0;sm_90", "Hopper;sm_90", ""):
        with pytest.raises(SystemExit, match="TORCH_CUDA_ARCH_LIST"):
            flags(bad)


# What a copy of the repository for an sdist leaves out: git's data and what builds, tests and runs write beside
# the sources (all ignored by git), so that the sdist is made from what a fresh clone holds.
_NOT_IN_A_CLONE = shutil.ignore_patterns(".git", "build", "dist", ".venv*", "*.egg-info", "__pycache__", "*.so",
                                         ".pytest_cache", ".hypothesis", "demo_out", "hf_trainer_out", ".whl")


def test_the_sdist_holds_every_file_the_build_reads(tmp_path):
    """`pip install --no-build-isolation mpfused-<version>.tar.gz` builds from the source distribution alone: it
    must hold every file of csrc/ (the headers and .inc files that the sources include, and the .cu files whatever
    kind of build the sdist was made in: without MANIFEST.in, setuptools took only the sources setup.py named for
    the build at hand, none of the headers, and no .cu file in a CPU-only environment), the Python package, and
    setup.py with the files it reads. A build's generated mpfused/_build_config.py stays out, and so do the tests.
    (The CUDA install check in CI, .ci/cuda_install_check.sh, builds and installs the CUDA extension from such an
    sdist.)"""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT, tree, ignore=_NOT_IN_A_CLONE)
    (tree / "mpfused" / "_build_config.py").write_text("# a build's output, left behind in the tree\n")
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(dist)], cwd=tree, check=True,
                   capture_output=True, text=True, env={**os.environ, "MPFUSED_FORCE_CPU": "1"})
    (archive,) = dist.glob("mpfused-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {Path(*Path(m.name).parts[1:]).as_posix() for m in tar.getmembers() if m.isfile()}

    def files(*parts):
        return {p.relative_to(tree).as_posix() for p in tree.joinpath(*parts).rglob("*") if p.is_file()}

    csrc = files("csrc")
    assert {"csrc/core/philox.h", "csrc/cpu/optim_impl.inc", "csrc/cuda/gemm.cu", "csrc/cuda/wgmma.cuh"} <= csrc
    assert not csrc - names, f"the sdist lacks these files of csrc/: {sorted(csrc - names)}"
    package = {f for f in files("mpfused") if f.endswith(".py") and f != "mpfused/_build_config.py"}
    assert package and not package - names, f"the sdist lacks these files of the package: {sorted(package - names)}"
    assert {"setup.py", "pyproject.toml", "README.md", "MANIFEST.in"} <= names
    assert "mpfused/_build_config.py" not in names
    assert not {n for n in names if n.startswith("tests/")}, "the tests stay in the repository"
