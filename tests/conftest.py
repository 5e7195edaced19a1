"""Shared fixtures: every feature test runs per device. cpu always; cuda when this machine has a GPU and
mpfused was built with CUDA kernels, otherwise the cuda cases are skipped with the reason (never
silently passed)."""

import pytest
import torch

import mpfused


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
