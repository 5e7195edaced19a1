"""mpfused.integrations without the frameworks installed (this runs in the main suite, where they may be
absent): ``import mpfused`` imports none of them, and each adapter module raises an ImportError that names
the package to install. The adapters themselves are tested in tests/integrations (make test-integrations)."""

import importlib
import subprocess
import sys

import pytest

ADAPTERS = [("lightning", "lightning"), ("accelerate", "accelerate"), ("transformers", "transformers")]


def test_import_mpfused_imports_no_framework():
    code = ("import sys, mpfused, mpfused.integrations; "
            "print(sorted(m for m in ('lightning', 'accelerate', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("module,package", ADAPTERS)
def test_missing_framework_is_a_clear_import_error(monkeypatch, module, package):
    for name in list(sys.modules):
        if name == f"mpfused.integrations.{module}" or name.startswith(f"{package}.") or name == package:
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)  # `import <package>` now raises ImportError
    with pytest.raises(ImportError, match=f"needs the package '{package}', which is not installed: pip install {package}"):
        importlib.import_module(f"mpfused.integrations.{module}")


def test_the_hf_trainer_example_says_what_is_missing_instead_of_a_traceback():
    """examples/hf_trainer.py imported transformers at module level: without it, even --help was an
    ImportError traceback. Now --help works and a run is refused with the packages to install."""
    # (the mpfused this test imports: the subprocess runs from the same directory, without a path of its own;
    # the CUDA install check runs this file against the installed package, from outside the source tree)
    example = __import__("pathlib").Path(__file__).resolve().parents[1] / "examples" / "hf_trainer.py"
    code = ("import sys, runpy; sys.modules['transformers'] = None; sys.argv = ['hf_trainer.py'] + sys.argv[1:]; "
            f"runpy.run_path({str(example)!r}, run_name='__main__')")
    helped = subprocess.run([sys.executable, "-c", code, "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "--overflow-step" in helped.stdout, helped.stderr
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 2 and "needs transformers and accelerate" in run.stderr and "Traceback" not in run.stderr
