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


requires_cuda = pytest.mark.skipif(cuda_skip_reason() is not None, reason=str(cuda_skip_reason()))
