"""The hooks of tests/cuda_context.py, which keep a kernel fault in a GPU run to the test that caused it. No GPU
is needed: a test here stands in for the fault by replacing the probe (cuda_context.context_error) in its own
process, and an inner pytest session (pytester) runs it among others, with pytest-xdist and without."""

import os
import re

import pytest

pytest_plugins = ["pytester"]

HERE = os.path.dirname(os.path.abspath(__file__))

INNER_CONFTEST = f"""
import sys
sys.path.insert(0, {HERE!r})
from cuda_context import (pytest_configure, pytest_handlecrashitem, pytest_runtest_protocol,  # noqa: F401
                          pytest_runtest_teardown)
"""

INNER_TESTS = """
import os
import pytest
import cuda_context

@pytest.mark.parametrize("i", range(3))
def test_before(i):
    pass

def test_breaks_the_context():
    # from now on, this process's probe reports a broken context, as a sticky CUDA error would
    cuda_context.context_error = lambda: "an illegal memory access was encountered (stand-in)"

@pytest.mark.parametrize("i", range(3))
def test_after(i):
    assert cuda_context.context_error() is None, "ran in the process whose context is broken"

def test_crashes_for_real():
    os._exit(1)

def test_last():
    pass
"""


@pytest.fixture
def inner(pytester, monkeypatch):
    # the inner session is a pytest of its own: not a worker of this one's xdist, nor sharing its folder
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID",
                 "MPFUSED_TEST_CUDA_CONTEXT_MARKS", "PYTEST_ADDOPTS"):
        monkeypatch.delenv(name, raising=False)
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makepyfile(test_inner=INNER_TESTS)
    return pytester


def outcomes(result):
    """{nodeid tail: set of outcomes} from the inner run's -rA lines ("PASSED test_inner.py::test_x", ...)."""
    found = {}
    for line in result.outlines:
        m = re.match(r"(PASSED|FAILED|ERROR|RERUN) (test_inner\.py::\S+)", line)
        if m:
            found.setdefault(m.group(2).split("::", 1)[1], set()).add(m.group(1))
    return found


def test_a_broken_context_fails_its_test_and_the_worker_restarts_for_the_next(inner):
    pytest.importorskip("xdist")
    # one worker: the order of the tests is the file's, so the test after the fault is known
    result = inner.runpytest_subprocess("-n", "1", "--dist", "load", "-p", "no:cacheprovider", "-rA")
    got = outcomes(result)
    # the test that broke the context: its call passed, its teardown reports the error
    assert got["test_breaks_the_context"] == {"PASSED", "ERROR"}, result.stdout.str()
    result.stdout.fnmatch_lines(["*the CUDA context is broken after this test*illegal memory access*(stand-in)*"])
    # the test its worker had not started yet: the worker exited before it, it was reported as rerun and then
    # passed in a fresh worker (whose probe is the real one), as every later test did
    result.stderr.fnmatch_lines(["*broken by test_inner.py::test_breaks_the_context*this worker exits before "
                                 "test_inner.py::test_after[[]0[]]*"])
    for name in ("test_before[0]", "test_before[1]", "test_before[2]", "test_after[0]", "test_after[1]",
                 "test_after[2]", "test_last"):
        assert got[name] == {"PASSED"}, (name, result.stdout.str())
    # a real crash stays a failure (no mark from the hooks)
    assert got["test_crashes_for_real"] == {"FAILED"}, result.stdout.str()
    result.stdout.fnmatch_lines(["*crashed while running*test_crashes_for_real*"])
    assert result.parseoutcomes() == {"passed": 8, "errors": 1, "failed": 1, "rerun": 1}, result.stdout.str()
    assert result.ret == 1


def test_a_broken_context_stops_a_session_without_workers(inner):
    result = inner.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-rA")
    got = outcomes(result)
    assert got["test_breaks_the_context"] == {"PASSED", "ERROR"}, result.stdout.str()
    assert all(got[f"test_before[{i}]"] == {"PASSED"} for i in range(3)), result.stdout.str()
    assert not any(name.startswith("test_after") or name == "test_last" for name in got), result.stdout.str()
    result.stdout.fnmatch_lines(["*the CUDA context of its process was broken by test_inner.py::"
                                 "test_breaks_the_context*the tests left in this process would only repeat the error*"])
    assert result.ret == 1
