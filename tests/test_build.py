"""What the extension reports about its build, and the guard against a torch ABI mismatch."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

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
