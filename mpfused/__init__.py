"""mpfused: fused CUDA/C++ kernels for mixed-precision training in PyTorch."""

from . import optim
from . import amp
from ._ops import build_info, has_cuda_kernels, non_finite_check_
from .scaler import GradScaler

__version__ = build_info()["version"]

__all__ = ["__version__", "optim", "amp", "GradScaler", "build_info", "has_cuda_kernels", "non_finite_check_"]
from . import fixed_point, functional, nn, random
from .functional import gemm
from .random import round_stochastic
__all__ += ["fixed_point", "functional", "nn", "gemm", "random", "round_stochastic"]
