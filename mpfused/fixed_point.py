"""Fixed-point arithmetic <IL, FL> after Gupta et al., "Deep Learning with Limited Numerical Precision"
(ICML 2015).

A number of ``<IL, FL>`` is a signed integer code ``c`` of ``WL = IL + FL`` bits standing for ``c * 2^-FL``:
the grid step is ``eps = 2^-FL`` and the range ``[-2^(IL-1), 2^(IL-1) - eps]``. ``IL`` counts the sign bit.

- :func:`quantize` is the paper's Convert(x, <IL,FL>): saturate to the range, then round to the grid, and
  return the values (float32 when ``WL <= 24``, where every value of the format is exact in float32;
  float64 for ``25 <= WL <= 32``). :func:`encode` returns the codes instead (int16 when ``WL <= 16``,
  int32 up to 32) and :func:`decode` turns codes back into values (same dtype rule as quantize).
- Rounding ``"nearest"`` follows the paper's definition: ``floor(x)`` if ``x <= floor(x) + eps/2``, else
  ``floor(x) + eps``, with ``floor`` towards -inf on the grid. Ties therefore go DOWN (towards -inf) for
  both signs: 0.5 eps -> 0, -0.5 eps -> -eps. (Not round-half-even.)
- Rounding ``"stochastic"``: ``floor(x) + eps`` with probability ``(x - floor(x)) / eps``, else ``floor(x)``,
  on the signed value: unbiased, ``E[Convert(x)] = x`` inside the range. The decision compares the
  element's 16 random bits with the exact fraction (frac in units of eps): the probability is exact when
  ``frac * 2^16`` is an integer and at most 2^-16 above ``frac`` otherwise. The bits are those of element
  ``offset + i`` (row-major) in stream (0, 0) under ``seed`` (:func:`mpfused.random.philox_words`), exactly
  as :func:`mpfused.round_stochastic`: so ``quantize(x[k:], ..., offset=k)`` equals ``quantize(x, ...)[k:]``,
  and CPU and CUDA give the same bits for every thread count and CPU path.
- ``inf`` saturates to the range's ends like any large value. NaN becomes 0: a fixed-point word has no
  NaN, 0 contributes nothing to a MACC's sum, and checking for NaN here would cost a host-device sync;
  check beforehand (e.g. :func:`mpfused.non_finite_check_`) where a NaN must be caught.
- Inputs: float32, float64, float16 or bfloat16 tensors on the CPU or a CUDA device. The rounding is done
  on the exact value (``x * 2^FL`` in double).

:func:`matmul` is the paper's MACC on codes: exact products summed in int64, rounded ONCE into the output
format, saturated. :class:`FixedPointLinear` and :class:`FixedPointSGD` train a model whose weights,
activations and gradients are held in fixed point (see ``examples/fixed_point_gupta.py``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Iterable, Optional, Union

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from . import _ops

__all__ = ["FixedPointFormat", "quantize", "encode", "decode", "matmul", "FixedPointLinear", "FixedPointSGD"]

_ROUNDINGS = ("nearest", "stochastic")
_MAX_WL = 32


def _int_arg(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return value


@dataclass(frozen=True)
class FixedPointFormat:
    """``<il, fl>``: ``il`` integer bits (sign included, >= 1), ``fl`` fractional bits (>= 0),
    ``wl = il + fl <= 32``."""

    il: int
    fl: int

    def __post_init__(self):
        _int_arg(self.il, "il")
        _int_arg(self.fl, "fl")
        if self.il < 1:
            raise ValueError(f"il must be >= 1 (it counts the sign bit), got {self.il}")
        if self.fl < 0:
            raise ValueError(f"fl must be >= 0, got {self.fl}")
        if self.il + self.fl > _MAX_WL:
            raise ValueError(f"il + fl (the word length) must be at most {_MAX_WL}, got il={self.il}, fl={self.fl}")

    @property
    def wl(self) -> int:
        return self.il + self.fl

    @property
    def eps(self) -> float:
        """The grid step 2^-fl."""
        return 2.0 ** -self.fl

    @property
    def min(self) -> float:
        return -(2.0 ** (self.il - 1))

    @property
    def max(self) -> float:
        return 2.0 ** (self.il - 1) - self.eps

    @property
    def code_min(self) -> int:
        return -(1 << (self.wl - 1))

    @property
    def code_max(self) -> int:
        return (1 << (self.wl - 1)) - 1

    @property
    def code_dtype(self) -> torch.dtype:
        """int16 when wl <= 16, else int32."""
        return torch.int16 if self.wl <= 16 else torch.int32

    @property
    def value_dtype(self) -> torch.dtype:
        """float32 when wl <= 24 (every value of the format is exact in float32), else float64."""
        return torch.float32 if self.wl <= 24 else torch.float64

    def __str__(self) -> str:
        return f"<{self.il},{self.fl}>"


FormatLike = Union[FixedPointFormat, tuple]


def _as_format(fmt, name: str) -> FixedPointFormat:
    if isinstance(fmt, FixedPointFormat):
        return fmt
    if isinstance(fmt, tuple) and len(fmt) == 2:
        try:
            return FixedPointFormat(*fmt)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}: {e}") from None
    raise TypeError(f"{name} must be a FixedPointFormat or an (il, fl) tuple, got {type(fmt).__name__} {fmt!r}")


def _format_of(il, fl) -> FixedPointFormat:
    return FixedPointFormat(il, fl)


def _rounding(rounding) -> bool:
    if rounding not in _ROUNDINGS:
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    return rounding == "stochastic"


def _tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    _ops.check_strided(x, name)
    return x


_VALUE_DTYPES = (torch.float32, torch.float64)
_CODE_DTYPES = (torch.int16, torch.int32)


def _convert(x, fmt: FixedPointFormat, rounding, seed, offset, out_dtype, out=None, kinds=(), what="") -> torch.Tensor:
    x = _tensor(x, "x")
    stochastic = _rounding(rounding)
    seed = _ops.check_u64(seed, "seed")
    offset = _ops.check_u64(offset, "offset", numel=x.numel())
    if out is not None:
        out = _ops._plain(out, "out", optional=True)
        if out.dtype not in kinds:
            raise ValueError(f"out must be a {' or '.join(str(d) for d in kinds)} tensor ({what}), got {out.dtype}")
    return _ops.fixed_point_quantize(x, fmt.il, fmt.fl, stochastic, seed, offset, out_dtype, out)


def quantize(x: torch.Tensor, il: int, fl: int, *, rounding: str = "nearest", seed: int = 0,
             offset: int = 0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Convert(x, <il, fl>): ``x`` saturated to ``[-2^(il-1), 2^(il-1) - 2^-fl]`` and rounded to the grid
    ``2^-fl`` (see the module docstring for the rounding rules, inf and NaN). Returns a new tensor of
    ``x``'s shape: float32 when ``il + fl <= 24``, float64 above (the values are exact either way).
    ``out``: a contiguous float32 (``il + fl <= 24``) or float64 tensor of ``x``'s shape on its device, not
    overlapping ``x``, to write the values into (returned). Like torch's ``out=`` arguments it takes no
    part in autograd: an ``x`` that requires grad is refused while grad mode is on."""
    fmt = _format_of(il, fl)
    return _convert(x, fmt, rounding, seed, offset, fmt.value_dtype, out, _VALUE_DTYPES, "quantize gives values")


def encode(x: torch.Tensor, il: int, fl: int, *, rounding: str = "nearest", seed: int = 0,
           offset: int = 0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The codes of Convert(x, <il, fl>): integers in ``[-2^(wl-1), 2^(wl-1) - 1]``, int16 when
    ``wl <= 16``, int32 up to 32; ``decode(encode(x, ...), il, fl) == quantize(x, ...)``. ``out``: a
    contiguous int16 (``wl <= 16``) or int32 tensor of ``x``'s shape on its device, not overlapping ``x``, to
    write the codes into (returned). Integer codes carry no gradient (as torch's integer-valued ops), so
    ``x`` may require grad here."""
    fmt = _format_of(il, fl)
    return _convert(x, fmt, rounding, seed, offset, fmt.code_dtype, out, _CODE_DTYPES, "encode gives codes")


def decode(codes: torch.Tensor, il: int, fl: int) -> torch.Tensor:
    """The values ``codes * 2^-fl`` of int16/int32 codes of <il, fl>: float32 when ``il + fl <= 24``,
    float64 above (exact). The codes are taken as they are (not checked against the format's range,
    which would need a host-device sync on CUDA)."""
    fmt = _format_of(il, fl)
    codes = _tensor(codes, "codes")
    if codes.dtype not in (torch.int16, torch.int32):
        raise ValueError(f"codes must be an int16 or int32 tensor, got {codes.dtype}")
    return (codes.to(torch.float64) * fmt.eps).to(fmt.value_dtype)


def matmul(a_codes: torch.Tensor, b_codes: torch.Tensor, fmt_a: FormatLike, fmt_b: FormatLike,
           fmt_out: FormatLike, *, rounding: str = "nearest", seed: int = 0, offset: int = 0) -> torch.Tensor:
    """The paper's MACC on codes: ``a_codes`` (M, K) of ``fmt_a`` times ``b_codes`` (K, N) of ``fmt_b``,
    the products summed exactly in int64 (a value with ``fl_a + fl_b`` fractional bits), rounded ONCE
    into ``fmt_out`` with the nearest (ties down) or stochastic rule of :func:`quantize`, saturated.
    Returns the (M, N) codes of ``fmt_out`` (int16 when its wl <= 16, else int32). Stochastic rounding of
    output (i, j) takes the random bits of element ``offset + i * N + j``.

    The int64 sum must be exact: ``wl_a + wl_b + ceil(log2 K) <= 64`` (K products of at most
    ``2^(wl_a + wl_b - 2)`` stay within 2^62), else ValueError. Codes must be int16/int32 tensors wide
    enough for their formats, on one device, and lie in their formats' ranges (``code_min`` to
    ``code_max``): a ValueError otherwise, which on CUDA costs one read of a flag by the host (not checked
    under torch.compile); a code beyond its format could overflow the int64 sum."""
    fa, fb, fo = _as_format(fmt_a, "fmt_a"), _as_format(fmt_b, "fmt_b"), _as_format(fmt_out, "fmt_out")
    a_codes, b_codes = _tensor(a_codes, "a_codes"), _tensor(b_codes, "b_codes")
    if a_codes.device != b_codes.device:
        raise ValueError(f"b_codes is on {b_codes.device} but a_codes is on {a_codes.device}: both must be on one device")
    checked = [(name, codes, f) for name, codes, f in (("a_codes", a_codes, fa), ("b_codes", b_codes, fb))
               if codes.dtype in _CODE_DTYPES and codes.numel() and codes.device.type != "meta"]
    if checked and not torch.compiler.is_compiling() and len({c.device for _, c, _ in checked}) == 1:
        # (under torch.func.vmap the codes are batched tensors, whose values only the tensor below holds)
        ranges = torch.stack([torch.stack(_unbatched(c).aminmax()).long() for _, c, _ in checked]).tolist()
        for (name, _, f), (lo, hi) in zip(checked, ranges):
            if lo < f.code_min or hi > f.code_max:
                raise ValueError(f"{name} must hold codes of {f}, in [{f.code_min}, {f.code_max}]; got values in "
                                 f"[{lo}, {hi}]")
    return _matmul_codes(a_codes, b_codes, fa, fb, fo, rounding, seed, offset)


def _unbatched(t: torch.Tensor) -> torch.Tensor:
    """The tensor a torch.func.vmap batched tensor wraps (all its batch elements), or t itself."""
    functorch = torch._C._functorch
    while functorch.is_batchedtensor(t):
        t = functorch.get_unwrapped(t)
    return t


def _matmul_codes(a_codes, b_codes, fa, fb, fo, rounding, seed, offset) -> torch.Tensor:
    """matmul without the range check of the codes (FixedPointLinear's come from encode; its bias column
    holds 1.0, which a format with il = 1 cannot, and which the int64 bound still covers)."""
    stochastic = _rounding(rounding)
    seed = _ops.check_u64(seed, "seed")
    numel = a_codes.shape[0] * b_codes.shape[-1] if a_codes.dim() == 2 and b_codes.dim() == 2 else 0
    offset = _ops.check_u64(offset, "offset", numel=numel)
    return _ops.fixed_point_matmul(a_codes, b_codes, (fa.il, fa.fl), (fb.il, fb.fl), (fo.il, fo.fl), stochastic,
                                   seed, offset, fo.code_dtype)


# ---- training in fixed point --------------------------------------------------------------------------
_MASK64 = (1 << 64) - 1
_LAYER, _OPTIM = 1, 2  # domains of the derived keys: FixedPointLinear's roundings, FixedPointSGD's


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _derive_seed(seed: int, *words: int) -> int:
    """A Philox key for one rounding of a training run, from the user's seed and what identifies the
    rounding (domain, call or step, role): SplitMix64 over each word, so that distinct roundings draw
    from unrelated keys, every one from element index 0, with no limit on the number of calls or steps."""
    z = seed
    for w in words:
        z = _splitmix64(z ^ _splitmix64(w & _MASK64))
    return z


class _FixedPointLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer, call):
        fmt, gfmt = layer.fmt, layer.grad_fmt
        rounding, seed = layer.rounding, layer.seed
        x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # (not -1: in_features may be 0)
        xc = encode(x2, fmt.il, fmt.fl, rounding=rounding, seed=_derive_seed(seed, _LAYER, call, 0))
        wc = encode(weight.detach(), fmt.il, fmt.fl)  # on the grid already (FixedPointSGD keeps it there)
        if bias is not None:  # the bias as one more product: a column of 1.0 in x times a column of b
            one = torch.full((xc.shape[0], 1), 1 << fmt.fl, dtype=xc.dtype, device=xc.device)
            xc = torch.cat([xc, one], 1)
            wc = torch.cat([wc, encode(bias.detach(), fmt.il, fmt.fl)[:, None]], 1)
        yc = _matmul_codes(xc, wc.t(), fmt, fmt, fmt, rounding, _derive_seed(seed, _LAYER, call, 1), 0)
        # Where a saturation clamped (the input outside fmt's range, an output at its ends), the gradient
        # is the clamp's: zero.
        x_clamped = (x2 < fmt.min) | (x2 > fmt.max)
        y_clamped = (yc == fmt.code_min) | (yc == fmt.code_max)
        ctx.save_for_backward(xc, wc, x_clamped, y_clamped)
        ctx.meta = (fmt, gfmt, rounding, seed, call, bias is not None, x.shape)
        return decode(yc, fmt.il, fmt.fl).to(x.dtype).reshape(*x.shape[:-1], yc.shape[-1])

    @staticmethod
    @once_differentiable  # (the gradients are MACCs of codes: a second derivative through them raises, not 0)
    def backward(ctx, gy):
        xc, wc, x_clamped, y_clamped = ctx.saved_tensors
        fmt, gfmt, rounding, seed, call, has_bias, x_shape = ctx.meta
        g2 = gy.reshape(math.prod(gy.shape[:-1]), gy.shape[-1]).float().masked_fill(y_clamped, 0.0)  # (out_features may be 0)
        gc = encode(g2, gfmt.il, gfmt.fl, rounding=rounding, seed=_derive_seed(seed, _LAYER, call, 2))
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            w_only = wc[:, :-1] if has_bias else wc
            gx = _matmul_codes(gc, w_only, gfmt, fmt, gfmt, rounding, _derive_seed(seed, _LAYER, call, 3), 0)
            grad_x = decode(gx, gfmt.il, gfmt.fl).masked_fill_(x_clamped, 0.0).reshape(x_shape)
        if ctx.needs_input_grad[1] or (has_bias and ctx.needs_input_grad[2]):
            gw = decode(_matmul_codes(gc.t(), xc, gfmt, fmt, gfmt, rounding, _derive_seed(seed, _LAYER, call, 4), 0),
                        gfmt.il, gfmt.fl)
            if has_bias:
                grad_w, grad_b = gw[:, :-1].contiguous(), gw[:, -1].contiguous()
            else:
                grad_w = gw
        return grad_x, grad_w, grad_b, None, None


def _checked_extra_state(state) -> tuple:
    """(calls, seed) of a FixedPointLinear's saved state, checked as the constructor checks its seed: a count
    that is not an int >= 0, or a seed outside [0, 2**64), would silently draw another layer's bits."""
    calls = state.get("calls") if isinstance(state, dict) else None
    if type(calls) is not int or calls < 0:
        raise ValueError(f"a FixedPointLinear's saved state must hold its call count as an int >= 0, got {calls!r} "
                         f"(the state {state!r})")
    return calls, _ops.check_u64(state.get("seed"), "the saved state's seed")


class FixedPointLinear(nn.Module):
    """A linear layer computed in fixed point, as in Gupta et al.: ``y = Convert(x) @ W^T + b`` where the
    input activation is converted to ``fmt``, ``W`` and ``b`` are held on ``fmt``'s grid, the products are
    summed exactly and the sum is rounded once to ``fmt`` (:func:`matmul`). Backward: the output gradient
    is converted to ``grad_fmt`` (default ``fmt``), and the input, weight and bias gradients are MACCs of
    codes rounded once to ``grad_fmt``. The rounding passes gradients straight through; a saturation
    passes the clamp's gradient: zero for the outputs that reached the range's ends (code_min, code_max)
    and for the inputs outside the range. So weights, activations and gradients are all fixed-point values
    (held in float32 tensors; the values are exact).

    ``rounding`` ("stochastic" or "nearest") applies to every conversion above. Each stochastic rounding
    of call ``t`` (the layer's forward count) draws under its own key, derived from ``seed``, ``t`` and the
    rounding's role (SplitMix64; no limit on ``t``); give each layer its own seed. The count is saved in
    the state dict (``get_extra_state``): a resumed run draws the same bits.
    With ``bias``, ``fmt`` must hold 1.0 (il >= 2): the bias is added as one more product, 1.0 * b.
    Weights start as torch's Linear initialisation rounded to the nearest grid value."""

    def __init__(self, in_features: int, out_features: int, fmt: FormatLike, *, grad_fmt: Optional[FormatLike] = None,
                 bias: bool = True, rounding: str = "stochastic", seed: int = 0, device=None):
        super().__init__()
        self.fmt = _as_format(fmt, "fmt")
        self.grad_fmt = self.fmt if grad_fmt is None else _as_format(grad_fmt, "grad_fmt")
        _rounding(rounding)
        self.rounding = rounding
        self.seed = _ops.check_u64(seed, "seed")
        for f, name in ((self.fmt, "fmt"), (self.grad_fmt, "grad_fmt")):
            if f.wl > 24:
                raise ValueError(f"{name} {f} has il + fl > 24: its values are not exact in the float32 tensors "
                                 "that hold them")
        if bias and self.fmt.il < 2:
            raise ValueError(f"fmt {self.fmt} cannot hold 1.0, which the bias product needs: use il >= 2 or bias=False")
        self.calls = 0
        ref = nn.Linear(in_features, out_features, bias=bias, device=device)
        self.weight = nn.Parameter(quantize(ref.weight.detach(), self.fmt.il, self.fmt.fl).float())
        self.bias = nn.Parameter(quantize(ref.bias.detach(), self.fmt.il, self.fmt.fl).float()) if bias else None
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.in_features:
            got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"input must be a tensor of shape (..., in_features={self.in_features}), got {got}")
        if x.device != self.weight.device:
            raise ValueError(f"input is on {x.device} but the layer's weight is on {self.weight.device}: move one to "
                             "the other's device")
        if x.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"input must be a float32 or float64 tensor, got {x.dtype}: the output, a value of fmt "
                             f"{self.fmt} held exactly in float32, is returned in the input's dtype, and {x.dtype} "
                             "would round it again; pass x.float()")
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, self.weight, self.bias)):
            # The weight gradient is a MACC over the input's rows (every leading dim flattened): its exact
            # int64 sum bounds them, where the forward's bounds only in_features. Refused now, not in backward.
            rows = int(math.prod(x.shape[:-1]))  # (int: under torch.jit.trace the dims are 0-d tensors)
            bits = self.grad_fmt.wl + self.fmt.wl
            if bits + max(rows - 1, 0).bit_length() > 64:
                raise ValueError(f"the weight gradient of a FixedPointLinear with fmt {self.fmt} and grad_fmt "
                                 f"{self.grad_fmt} is an exact int64 sum over the input's rows: at most 2**{64 - bits}"
                                 f" rows a call (the leading dims flattened), got {rows}; split the batch")
        # The count advances before the call: a forward that stops midway (activation checkpointing's recompute
        # ends early, from inside the function) must not leave its number to the next call, whose bits it drew.
        call = self.calls
        self.calls += 1
        return _FixedPointLinearFn.apply(x, self.weight, self.bias, self, call)

    def get_extra_state(self):
        return {"calls": self.calls, "seed": self.seed}

    def set_extra_state(self, state):
        self.calls, self.seed = _checked_extra_state(state)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        # An nn.Linear's state dict (a float model's weights, to train on in fixed point) has no call count and
        # seed: the layer keeps its own, where strict loading reported a missing key. The loaded weight and bias
        # are converted to fmt (to nearest), the grid the layer holds them on: a float model's, and another
        # FixedPointLinear's of another fmt (weights already on the grid are left as loaded).
        key = prefix + "_extra_state"
        if key in state_dict:  # checked before anything is loaded
            _checked_extra_state(state_dict[key])
        errors, kept = len(error_msgs), (self.calls, self.seed)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if len(error_msgs) > errors:  # load_state_dict raises: the layer's random stream stays its own (torch
            self.calls, self.seed = kept  # has copied the tensors that fit, as nn.Linear's load does)
        if key in missing_keys and key not in state_dict:
            missing_keys.remove(key)
        assign = local_metadata.get("assign_to_params_buffers", False)
        with torch.no_grad():
            for name in ("weight", "bias"):
                t = getattr(self, name)
                if prefix + name not in state_dict or t is None or t.is_meta:
                    continue
                on_grid = quantize(t, self.fmt.il, self.fmt.fl)
                if torch.equal(on_grid, t):
                    continue
                if assign:  # the Parameter is the caller's tensor now: rounded into a new one, the caller's kept
                    setattr(self, name, nn.Parameter(on_grid, requires_grad=t.requires_grad))
                else:
                    t.copy_(on_grid)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, "
                f"grad_fmt={self.grad_fmt}, bias={self.bias is not None}, rounding={self.rounding!r}, seed={self.seed}")


def _float_or_inf(value: numbers.Real) -> float:
    """float(value), or inf for an int beyond float range (float() raises OverflowError there)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


class FixedPointSGD(torch.optim.Optimizer):
    """SGD whose weights stay on a fixed-point grid: ``w <- Convert(w - lr * d, fmt)`` with ``d`` the
    gradient (or, with ``momentum``, the buffer ``m <- momentum * m + g``, held in float32). The update
    is computed in float64 (exact for weights of up to 32 bits and far below any grid step), then
    converted with ``rounding``: "nearest" loses every update smaller than half a grid step, "stochastic"
    keeps it in expectation (the paper's point).

    Stochastic rounding of a param's element ``i`` at its step ``s`` takes the bits of index ``p + i``
    under a key derived from ``seed`` and ``s`` (SplitMix64, apart from :class:`FixedPointLinear`'s keys),
    ``p`` the number of elements of the params before it (in param-group order): a function of (seed,
    step, element), so a run resumed from ``state_dict()`` (steps per param, momentum buffers, the groups'
    seeds) is bit-identical."""

    def __init__(self, params: Iterable, lr: float, fmt: FormatLike, rounding: str = "stochastic", seed: int = 0,
                 momentum: float = 0.0):
        defaults = dict(lr=lr, fmt=fmt, rounding=rounding, seed=seed, momentum=momentum)
        defaults.update(self._check_group(defaults)[1])
        super().__init__(params, defaults)

    @staticmethod
    def _check_group(group: dict, where: str = "") -> tuple:
        """Validates a param group's values; returns its format and the values made plain ((il, fl),
        floats, an int seed). step() checks every group before it writes any (code may edit a group)."""
        fmt = _as_format(group["fmt"] if not isinstance(group["fmt"], list) else tuple(group["fmt"]), "fmt" + where)
        if fmt.wl > 24:
            raise ValueError(f"fmt {fmt}{where} has il + fl > 24: its values are not exact in float32 params")
        if group["rounding"] not in _ROUNDINGS:
            raise ValueError(f"rounding must be 'nearest' or 'stochastic'{where}, got {group['rounding']!r}")
        lr, momentum = group["lr"], group["momentum"]
        if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not (lr >= 0 and math.isfinite(_float_or_inf(lr))):
            raise ValueError(f"lr must be a finite number >= 0{where}, got {lr!r}")
        if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) or not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be a number in [0, 1){where}, got {momentum!r}")
        return fmt, dict(fmt=(fmt.il, fmt.fl), lr=float(lr), momentum=float(momentum),
                         seed=_ops.check_u64(group["seed"], "seed" + where))

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group (which the constructor calls too), then: float32 params only, and the
        group's values checked (fmt, lr, rounding, momentum, seed, made plain), the group removed again when
        either fails."""
        super().add_param_group(param_group)
        group, where = self.param_groups[-1], f" (param group {len(self.param_groups) - 1})"
        try:
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise ValueError(f"params must be float32 tensors (holding fixed-point values), got {p.dtype}")
            group.update(self._check_group(group, where)[1])
        except (ValueError, TypeError):
            self.param_groups.pop()
            raise

    def __setstate__(self, state: dict) -> None:
        """torch's (load_state_dict ends here, after its pre-hooks, having changed nothing before), after
        refusing groups that ask for what this SGD does not do (a torch.optim.SGD or FusedSGD state dict with
        nesterov, dampening, weight_decay or maximize: loaded, the run would go on with another update rule,
        in silence); a group saved by another optimizer (no fmt) keeps this one's fmt, rounding and seed (its
        own group's, else the defaults); then a group's missing values (a seed of None) come from the
        defaults, and a one-element tensor step (a FusedSGD state dict's float32 count) becomes the int this
        optimizer counts in."""
        for gi, group in enumerate(state.get("param_groups", [])):
            for key, plain in (("nesterov", False), ("dampening", 0), ("weight_decay", 0), ("maximize", False)):
                if group.get(key, plain) != plain:
                    raise ValueError(f"param group {gi} of the state dict has {key}={group[key]!r}, which FixedPointSGD "
                                     f"does not implement (its update is w - lr * (momentum * m + g)); nothing was loaded")
        # A group saved by another optimizer (no fmt: torch.optim.SGD, FusedSGD) keeps this optimizer's fixed-point
        # values, the group's own where it has one: a FusedSGD's "rounding" and "seed" are its FP16/BF16 write-back's,
        # and taken here they switched a stochastic FixedPointSGD to nearest, in silence.
        before = self.__dict__.get("param_groups") or []
        foreign = [gi for gi, group in enumerate(state.get("param_groups", [])) if "fmt" not in group]
        for gi in foreign:
            own = before[gi] if gi < len(before) else {}
            for key in ("fmt", "rounding", "seed"):
                state["param_groups"][gi][key] = own.get(key, self.defaults[key])
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                if group.get(key) is None:  # (a fused optimizer's seed None: its own default)
                    group[key] = value
        for st in self.state.values():
            step = st.get("step") if isinstance(st, dict) else None
            if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_complex():
                value = step.item()
                if float(value).is_integer() and value >= 0:
                    st["step"] = int(value)

    def _check_states(self) -> None:
        """Every param that steps and its state, before anything is written: the param writable in place
        (an ``expand()``ed one, whose elements share memory, is not: its write failed after the params
        before it were written) and its grad on its device; ``step`` an int >= 0 and the momentum buffer
        (where momentum is used and one exists) a float32 tensor like its param."""
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                where = f"param {i} of param group {gi}"
                if p.dtype != torch.float32:  # (add_param_group checked it; `p.data = p.data.half()` may come after)
                    raise ValueError(f"{where} must be a float32 tensor (holding fixed-point values), got {p.dtype}")
                if p.is_inference() and not torch.is_inference_mode_enabled():
                    raise ValueError(f"{where} is an inference tensor (made under torch.inference_mode), which a step "
                                     "outside inference mode cannot write in place")
                if torch._debug_has_internal_overlap(p) == 1:  # (1: MemOverlap::Yes)
                    raise ValueError(f"{where} has elements that share memory (an expand()ed tensor), which a step "
                                     "cannot write in place")
                if p.grad.device != p.device:
                    raise ValueError(f"the grad of {where} is on {p.grad.device}, its param on {p.device}")
                if p not in self.state:
                    continue
                st = self.state[p]
                step = st.get("step", 0)
                if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**64:
                    raise TypeError(f"state['step'] of {where} must be an int in [0, 2**64) (the steps it took), got "
                                    f"{type(step).__name__} {step!r}")
                buf = st.get("momentum_buffer")
                if group["momentum"] and buf is not None and not (
                        isinstance(buf, torch.Tensor) and buf.dtype == torch.float32 and buf.shape == p.shape
                        and buf.device == p.device):
                    what = (f"{buf.dtype} tensor of shape {tuple(buf.shape)} on {buf.device}"
                            if isinstance(buf, torch.Tensor) else type(buf).__name__)
                    raise TypeError(f"state['momentum_buffer'] of {where} must be a float32 tensor of the param's "
                                    f"shape {tuple(p.shape)} on {p.device}, got a {what}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # every group and every state checked before anything is written
        checked = [self._check_group(group, f" (param group {gi})") for gi, group in enumerate(self.param_groups)]
        for group, (_, plain) in zip(self.param_groups, checked):
            group.update(plain)
        self._check_states()
        fmts = [fmt for fmt, _ in checked]
        first = 0  # index of the param's element 0 among all params
        for group, fmt in zip(self.param_groups, fmts):
            for p in group["params"]:
                numel = p.numel()
                if p.grad is not None:
                    state = self.state[p]
                    step = state.get("step", 0)
                    d = p.grad
                    if group["momentum"]:
                        buf = state.get("momentum_buffer")
                        if buf is None:
                            buf = state["momentum_buffer"] = d.detach().float().clone()
                        else:
                            buf.mul_(group["momentum"]).add_(d)
                        d = buf
                    v = p.double() - group["lr"] * d.double()
                    key = _derive_seed(group["seed"], _OPTIM, step)
                    p.copy_(_convert(v, fmt, group["rounding"], key, first, torch.float64))
                    state["step"] = step + 1
                first += numel
        return loss
