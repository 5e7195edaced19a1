"""``FusedLinear``: a drop-in ``nn.Linear`` whose FP16/BF16 forward and backward run on mpfused's GEMM, with
the bias and the activation fused into the GEMM's epilogue; ``convert_linear`` swaps it in."""

from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn import init

from . import _ops

__all__ = ["FusedLinear", "convert_linear"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_ACTIVATIONS = (None, "relu", "gelu", "gelu_erf")
_GELU_APPROXIMATE = {"gelu": "tanh", "gelu_erf": "none"}


def _activate(y: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    """The activation as torch computes it (the FP32 fallback)."""
    if activation == "relu":
        return F.relu(y)
    if activation in _GELU_APPROXIMATE:
        return F.gelu(y, approximate=_GELU_APPROXIMATE[activation])
    return y


def _query_gemm(device: torch.device, dtype: torch.dtype) -> str:
    """The extension's answer: empty when its GEMM runs ``dtype`` inputs on ``device``, else why not."""
    if device.type != "cuda" or not _ops.has_cuda_kernels():
        return ""
    return _ops._C.gemm_unsupported(str(dtype).removeprefix("torch."), device.index)


_GEMM_UNSUPPORTED: dict = {}  # (device, dtype) -> _query_gemm's answer


def _gemm_unsupported(device: torch.device, dtype: torch.dtype) -> str:
    """Empty when mpfused's GEMM runs ``dtype`` inputs on ``device``, else the reason (BF16 below sm_80, or
    a build without an sm_80+ BF16 kernel). Asked once per device and dtype; the first time the answer is
    not empty, one RuntimeWarning says that FusedLinear computes with torch's matmul there instead. A
    constant under torch.compile (no graph break)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, dtype)
    reason = _GEMM_UNSUPPORTED.get(key)
    if reason is None:
        reason = _GEMM_UNSUPPORTED[key] = _query_gemm(device, dtype)
        if reason:
            warnings.warn(f"FusedLinear on {device} with {dtype} inputs computes with torch's matmul (F.linear) and "
                          f"the activation instead of mpfused's fused GEMM: {reason}", RuntimeWarning, stacklevel=2)
    return reason


# A constant under torch.compile: what ``torch.compiler.assume_constant_result`` does (tests/test_compile.py
# checks that it sets this one attribute and nothing else), without the decorator's import of torch._dynamo,
# which would add 1.4 s to every ``import mpfused`` (tests/test_build.py checks that it does not).
_gemm_unsupported._dynamo_marked_constant = True


def _fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  activation: Optional[str]) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` for 2-D ``x``, with ``x``, ``weight`` and ``bias`` of one FP16/BF16 dtype.

    Forward: one GEMM (torch.ops.mpfused.gemm) with the bias and the activation in its epilogue; for a GELU
    the operator that also returns the value before it (gemm_with_pre), which the backward reads (ReLU's
    backward needs only the output). Backward: the operators' autograd formula (mpfused/_ops.py): the
    activation's backward (mpfused::activation_backward: torch's ``gelu_backward`` / ``threshold_backward``
    and the bias's FP32 sum, in one operator that compiled code runs as eager does), then ``grad_input = grad_pre
    @ weight`` and ``grad_weight = grad_pre.T @ x`` on the same GEMM (``grad_pre.T`` is a transposed view,
    read without a copy); without an activation, ``grad_bias`` from mpfused::bias_grad. Only the gradients autograd asks
    for are computed. Operators all the way, so torch.compile traces it without a graph break."""
    if activation in _GELU_APPROXIMATE:
        return _ops.gemm(x, weight.t(), bias, activation, return_pre_activation=True)[0]
    return _ops.gemm(x, weight.t(), bias, activation)


class FusedLinear(nn.Module):
    """``activation(x @ weight.T + bias)``: ``nn.Linear`` followed by an optional activation, with the bias and
    the activation fused into the epilogue of mpfused's FP16/BF16 GEMM.

    Parameters, their shapes, initialisation (``reset_parameters``, the same as ``nn.Linear``'s: the same
    seed gives the same values), ``state_dict`` keys and input/output shapes are those of ``nn.Linear``:
    ``weight`` ``(out_features, in_features)``, ``bias`` ``(out_features,)`` or None; the input is
    ``(*, in_features)``, flattened to 2-D without a copy where its strides allow, and the output
    ``(*, out_features)``.

    The arguments are ``nn.Linear``'s, in its order (``FusedLinear(4, 3, True, "cuda", torch.bfloat16)``), then
    ``activation`` (keyword-only): None, ``"relu"``, ``"gelu"`` (the tanh approximation, like
    ``F.gelu(y, approximate="tanh")``) or ``"gelu_erf"`` (the exact ``F.gelu(y)``).

    Which path runs:

    - Under ``torch.autocast`` for the input's device type with an FP16/BF16 autocast dtype: the input,
      weight and bias are cast to that dtype (as autocast casts them for ``F.linear``; the gradients flow
      back through the casts to FP32 weights), and the fused GEMM runs with autocast disabled inside.
    - Input, weight and bias all FP16, or all BF16, on a CPU or CUDA device: the fused GEMM (forward, and
      backward through the GEMM operator's autograd formula: the activation's backward, then
      ``grad_input`` and ``grad_weight`` on the same GEMM, ``grad_bias`` as an FP32 sum). Outputs and gradients are in that
      dtype, as with ``nn.Linear`` on FP16/BF16 weights; every product is accumulated in FP32.
    - Anything else, FP32 in particular: ``F.linear`` followed by the activation, exactly what
      ``nn.Linear`` + the activation compute. mpfused's GEMM is a low-precision GEMM; FP32 (and FP64)
      layers keep torch's FP32 GEMM. So do tensor subclasses that intercept dispatch (DTensor, wrapper
      subclasses): they compute through their own dispatch, which the fused kernel cannot join.

    - On a GPU where mpfused's GEMM cannot run the dtype (BF16 below compute capability 8.0, e.g. a T4 on
      sm_75, or a build without an sm_80+ BF16 kernel): ``F.linear`` + the activation, with one
      RuntimeWarning per device and dtype that says why.

    Double backward (``create_graph=True``) works on the fused path: each operator of the backward has a
    derivative of its own.
    """

    __constants__ = ["in_features", "out_features", "activation"]

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 activation: Optional[str] = None) -> None:
        if activation is not None and not (isinstance(activation, str) and activation in _ACTIVATIONS):
            raise ValueError(f"activation must be None, 'relu', 'gelu' (tanh approximation) or 'gelu_erf', got "
                             f"{activation!r}")
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self.activation = activation
        self.weight = nn.Parameter(torch.empty((out_features, in_features), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation: weight ``U(-1/sqrt(in), 1/sqrt(in))`` through torch's
        ``kaiming_uniform_(a=sqrt(5))``, bias ``U(-1/sqrt(in), 1/sqrt(in))``, drawn in the same order."""
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
            init.uniform_(self.bias, -bound, bound)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"activation={self.activation!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():
            # torch.jit.script compiles only this branch (the fused path's autocast queries and Python autograd
            # function are not TorchScript): torch's linear and activation, as the FP32 fallback computes them.
            y = F.linear(x, self.weight, self.bias)
            act = self.activation
            if act is None:
                return y
            if act == "relu":
                return F.relu(y)
            return F.gelu(y, approximate="tanh" if act == "gelu" else "none")
        return _linear_forward(x, self.weight, self.bias, self.activation)


def _linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    activation: Optional[str]) -> torch.Tensor:
    """FusedLinear's forward (a function of its own, which torch.fx.symbolic_trace records as one call: its
    branches on the input's device and dtype cannot take a traced value). As nn.Linear, the shapes are the
    weight's (in_features and out_features are what the module was made with: code may replace the weight).
    What the GEMM's epilogue does not take goes to torch's linear: a nested or sparse input, a weight that is
    not a dense matrix, a bias other than one value per output (F.linear broadcasts any bias)."""
    device_type = x.device.type
    fusable_device = (device_type in ("cpu", "cuda") and not x.is_nested and x.layout == torch.strided
                      and weight.layout == torch.strided and weight.dim() == 2
                      and (bias is None or (bias.layout == torch.strided and bias.shape == weight.shape[:1])))
    if fusable_device and x.is_floating_point() and torch.is_autocast_enabled(device_type) and not any(
            _ops.intercepts_dispatch(t) for t in (x, weight, bias)):
        dtype = torch.get_autocast_dtype(device_type)
        if dtype in _LOW_PRECISION and all(t is None or t.dtype != torch.float64 for t in (x, weight, bias)):
            with torch.autocast(device_type, enabled=False):
                return _fused_forward(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype),
                                      activation)
    if (fusable_device and x.dtype in _LOW_PRECISION and weight.dtype == x.dtype
            and (bias is None or bias.dtype == x.dtype)
            and not any(_ops.intercepts_dispatch(t) for t in (x, weight, bias))):
        return _fused_forward(x, weight, bias, activation)
    return _activate(F.linear(x, weight, bias), activation)


torch.fx.wrap("_linear_forward")


def _fused_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   activation: Optional[str]) -> torch.Tensor:
    out_features, in_features = weight.shape
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise RuntimeError(f"FusedLinear: the input's last dim must be the weight's in_features={in_features} (a "
                           f"weight of shape {tuple(weight.shape)}), got an input of shape {tuple(x.shape)}")
    if _gemm_unsupported(x.device, x.dtype):  # BF16 on a GPU older than sm_80: torch's matmul, warned once
        return _activate(F.linear(x, weight, bias), activation)
    lead = x.shape[:-1]
    x2d = x.reshape(math.prod(lead), in_features)
    out = _fused_linear(x2d, weight, bias, activation)
    return out.reshape(*lead, out_features)


_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks", "_state_dict_hooks",
                 "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def _convertible(module: nn.Module) -> bool:
    """Whether convert_linear replaces ``module``: exactly an ``nn.Linear`` whose weight (and bias, if any)
    are its registered Parameters, with no hooks of its own. ``weight_norm`` and ``spectral_norm`` keep the
    weight as a plain tensor that a forward pre-hook recomputes, and a hook is part of what the module does;
    a replacement would drop either."""
    if type(module) is not nn.Linear:
        return False
    params = module._parameters
    if not isinstance(params.get("weight"), nn.Parameter) or "bias" not in params:
        return False
    if params["bias"] is not None and not isinstance(params["bias"], nn.Parameter):
        return False
    if "forward" in module.__dict__:  # a forward set on the instance (accelerate's add_hook_to_module)
        return False
    return not any(getattr(module, name, None) for name in _MODULE_HOOKS)


def _fused_from(linear: nn.Linear) -> FusedLinear:
    # Built on the meta device (nothing allocated, nothing drawn), then given linear's own Parameters.
    fused = FusedLinear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                        dtype=linear.weight.dtype)
    fused.weight = linear.weight
    if linear.bias is not None:
        fused.bias = linear.bias
    fused.train(linear.training)
    return fused


def convert_linear(model: nn.Module) -> nn.Module:
    """Replaces every ``nn.Linear`` in ``model`` (recursively, in place) with a :class:`FusedLinear` (no
    activation) and returns ``model``; when ``model`` itself is an ``nn.Linear``, returns its replacement.

    The ``FusedLinear`` holds the very same ``Parameter`` objects as the ``nn.Linear`` it replaces (not
    copies): device, dtype, values and ``requires_grad`` are unchanged, an optimizer created before the
    conversion keeps updating the model's weights, its state stays attached, and tied weights stay
    tied. A ``nn.Linear`` that appears several times in the model is replaced by one ``FusedLinear``.

    Only modules whose type is exactly ``nn.Linear`` are replaced: subclasses (``LazyLinear``,
    parametrized or quantized linears, ``MultiheadAttention``'s ``out_proj``) may rely on their own
    ``forward`` or type and are left alone. So is an ``nn.Linear`` with hooks of its own (forward, backward
    or state-dict hooks: ``weight_norm`` and ``spectral_norm`` recompute its weight in one) or whose weight
    or bias is not a registered Parameter, or whose ``forward`` was replaced on the instance: a replacement
    would drop what they do. When ``model`` is such a module, it is returned unchanged.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if type(model) is nn.Linear:
        return _fused_from(model) if _convertible(model) else model
    replaced: dict[int, FusedLinear] = {}

    def convert(module: nn.Module) -> None:
        # Every slot, not named_children(): that lists a module used in two places only once.
        for name, child in list(module._modules.items()):
            if child is None:
                continue
            if _convertible(child):
                if id(child) not in replaced:
                    replaced[id(child)] = _fused_from(child)
                setattr(module, name, replaced[id(child)])
            elif type(child) is not nn.Linear:
                convert(child)

    convert(model)
    return model
