"""Shared fixtures: every feature test runs per device. cpu always; cuda when this machine has a GPU and
mpfused was built with CUDA kernels, otherwise the cuda cases are skipped with the reason (never
silently passed)."""

import os

import pytest
import torch

import mpfused
# A kernel fault costs one test, not its process's later GPU tests (see tests/cuda_context.py).
from cuda_context import (pytest_configure, pytest_handlecrashitem, pytest_runtest_protocol,  # noqa: F401
                          pytest_runtest_teardown)

# Under pytest-xdist (`make test` runs one worker per core), the workers share the cores: each gets its share
# of CPU threads, or their OpenMP teams spin against each other (measured on 2 cores, 2 workers: the suite in
# 256 s with 2 threads each, 227 s with 1). The tests of thread-count independence set their own counts.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


def cuda_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA device on this machine"
    if not mpfused.has_cuda_kernels():
        return "mpfused was built without CUDA kernels"
    return None


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(cuda_skip_reason() is not None,
                                                                      reason=str(cuda_skip_reason()))]),
]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


_skip_without_cuda = pytest.mark.skipif(cuda_skip_reason() is not None, reason=str(cuda_skip_reason()))


def requires_cuda(test):
    """A test that needs a GPU: skipped with the reason without one, and marked ``cuda``, the marker by
    which the GPU check's test and sanitizer stages select the GPU cases (``-m cuda``)."""
    return pytest.mark.cuda(_skip_without_cuda(test))
