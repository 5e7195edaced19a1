"""What torch shows of an operator call, for the tests that call mpfused's operators from C++ in eager mode
(mpfused._ops.optim_step_direct): a dispatch mode and a torch function mode that record the calls they
see, and a tensor subclass that records the functions it takes part in."""

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class OpsSeen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class FunctionsSeen(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


class Traced(torch.Tensor):
    """A tensor subclass that records the functions it takes part in (as a user's wrapper might); clear
    ``Traced.seen`` before use."""

    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(str(func))
        return super().__torch_function__(func, types, args, kwargs or {})
