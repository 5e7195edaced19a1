"""Pytest hooks for the GPU runs (tests/conftest.py takes them): one kernel fault must cost one test, not
every later GPU test of its process.

A kernel fault (an illegal address, a trap) leaves a sticky error in the process's CUDA context: every later
CUDA call of that process fails with it. The GPU check runs the CUDA cases in several pytest-xdist workers, so
a fault in a kernel that has not yet run on a GPU would fail every test its worker ran afterwards. Here:

- after each test, where CUDA was used, the current device is synchronised; an error there fails that test (in
  its teardown, with the error) and marks the process broken;
- under pytest-xdist, the broken worker exits before its next test. xdist starts a fresh worker, and on the
  controller ``pytest_handlecrashitem`` queues the test that was not started again and reports it as "rerun"
  (with the reason), not as failed;
- in one process (no xdist: the sanitizer stage), the session stops there (``pytest.exit``): the tests left
  would only repeat the error.

Without CUDA (``make test``) nothing here does anything beyond one ``torch.cuda.is_initialized()`` a test.
"""

import hashlib
import os
import pathlib
import shutil
import sys
import tempfile

import pytest

# Where a worker that exits leaves the reason for the controller: a folder the controller makes before it starts
# its workers, which inherit the variable.
_MARKS = "MPFUSED_TEST_CUDA_CONTEXT_MARKS"
# (nodeid, error) of the test after which this process's CUDA context was found broken, or None.
_broken = None


def context_error():
    """The error that synchronising the current CUDA device raises, or None (also where CUDA was not used)."""
    torch = sys.modules.get("torch")  # (not imported: no CUDA used; the tests of these hooks run without torch)
    if torch is None or not torch.cuda.is_initialized():
        return None
    try:
        torch.cuda.synchronize()
    except Exception as e:  # torch.AcceleratorError (a RuntimeError) on torch 2.8+
        return " ".join(str(e).split())[:300] or type(e).__name__
    return None


def _mark_path(nodeid: str) -> pathlib.Path:
    return pathlib.Path(os.environ[_MARKS]) / hashlib.sha256(nodeid.encode()).hexdigest()


def pytest_configure(config):
    if not hasattr(config, "workerinput") and _MARKS not in os.environ:  # the controller, or pytest without xdist
        path = tempfile.mkdtemp(prefix="mpfused-cuda-context-")
        os.environ[_MARKS] = path
        config.add_cleanup(lambda: (shutil.rmtree(path, ignore_errors=True), os.environ.pop(_MARKS, None)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    global _broken
    try:
        return (yield)
    finally:
        error = context_error() if _broken is None else None
        if error is not None:
            _broken = (item.nodeid, error)
            raise RuntimeError(f"the CUDA context is broken after this test, a sticky error that every later CUDA "
                               f"call of this process would repeat: {error}")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if _broken is None:
        return None
    nodeid, error = _broken
    why = f"the CUDA context of its process was broken by {nodeid} ({error})"
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(_MARKS):
        _mark_path(item.nodeid).write_text(why)
        sys.stderr.write(f"\n{os.environ['PYTEST_XDIST_WORKER']}: {why}: this worker exits before {item.nodeid}, "
                         "and xdist starts a fresh one\n")
        sys.stderr.flush()
        os._exit(3)
    pytest.exit(f"{why}: the tests left in this process would only repeat the error", returncode=1)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """(pytest-xdist, on the controller) A worker exited on purpose before ``crashitem``: queue it again."""
    if _MARKS not in os.environ:
        return
    path = _mark_path(crashitem)
    if not path.exists():
        return  # a real crash: xdist's report stands
    why = path.read_text()
    path.unlink()
    try:
        sched.mark_test_pending(crashitem)
    except NotImplementedError:  # (--dist loadscope) the test stays reported as failed, with the reason
        report.longrepr = f"{report.longrepr}: not run: {why}"
        return
    report.outcome = "rerun"
    report.longrepr = f"not run yet: {why}; queued again for a fresh worker"
