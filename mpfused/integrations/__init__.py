"""Adapters for training frameworks. Each submodule imports its framework when it is imported itself
(``import mpfused`` never does), and raises an ImportError naming the package to install when the
framework is missing:

- ``mpfused.integrations.lightning``: ``MixedPrecision``, a Lightning precision plugin that drives
  mpfused.GradScaler (gradient clipping included) and ``SkippedStepsLogger``, a callback;
- ``mpfused.integrations.accelerate``: ``attach_scaler(accelerator, scaler)`` for
  ``Accelerator(mixed_precision="fp16")`` (and so for the Hugging Face Trainer);
- ``mpfused.integrations.transformers``: ``SkippedStepsCallback`` for the Hugging Face Trainer's logs.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, package: str, feature: str) -> ModuleType:
    """``import module``, or an ImportError that names the pip package ``package`` needed for ``feature``."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{feature} needs the package {package!r}, which is not installed: pip install {package}"
                          f" (the versions mpfused is tested with are pinned in the Makefile, INTEGRATION_PACKAGES)"
                          ) from e
