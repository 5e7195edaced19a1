"""Every kernel is a torch operator (torch.ops.mpfused.*): torch.library.opcheck checks each against its
schema (the arguments it writes are marked, the others untouched), its fake kernel (shapes, dtypes,
devices), its autograd registration and AOT dispatch (functionalization, dynamic shapes), on every device
this machine has. Sample inputs cover each op's optional arguments."""

from __future__ import annotations

import re

import pytest
import torch

import mpfused
from mpfused import _ops

from conftest import DEVICES
from dispatch_helpers import FunctionsSeen, OpsSeen, Traced

OPS = sorted(n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("mpfused::"))


def fp(shape, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


def scalar(device, value=0.0, dtype=torch.float32):
    return torch.full((1,), value, dtype=dtype, device=device)


def adam_args(device, dtype, *, masters, stochastic=False, scaling=True):
    """optim_step_ for Adam on two params (FP32 masters when the params are 16-bit), in the operator's own
    argument order (see mpfused._ops.optim_step_ for the meaning of each)."""
    params = [fp((17,), device, dtype, 1), fp((4, 3), device, dtype, 2)]
    grads = [fp((17,), device, dtype, 3), fp((4, 3), device, dtype, 4)]
    m = [p.float().clone() for p in params] if masters else []
    states = [torch.zeros(p.shape, device=device) for p in params for _ in range(2)]  # exp_avg, exp_avg_sq
    state_index = [0, 2, 1, 3, -1, -1]  # exp_avg of params 0, 1; exp_avg_sq of 0, 1; no max_exp_avg_sq
    steps = [torch.zeros((), device=device) for _ in params]
    return ("adam", params, grads, m, [0, 1] if masters else [], [], [], states, state_index, steps, [0, 1],
            1e-3, None, [0.9, 0.999, 1e-8, 0.01, 0.0, 0.0, 1.0], [],
            scalar(device, 0.5) if scaling else None, None, scalar(device, 4.0) if scaling else None, 1.0,
            scalar(device) if scaling else None, torch.zeros(1, dtype=torch.int32, device=device), scaling,
            "stochastic" if stochastic else "nearest", _ops.u64_arg(2**64 - 5, "seed"), [0, 17] if stochastic else [])


def samples(op: str, device: str) -> list:
    """(args, kwargs) cases for one operator."""
    h16 = torch.float16
    if op in ("non_finite_check_", "unscale_check_"):
        tensors = [fp((100,), device), fp((7, 5), device, h16, 1), fp((3,), device, torch.bfloat16, 2)]
        inv = scalar(device, 0.25)
        extra = (scalar(device), True, scalar(device), torch.zeros(1, dtype=torch.int32, device=device))
        cases = [((tensors, scalar(device), inv, None, False, None, None), {}),
                 ((tensors, scalar(device), inv) + extra, {})]
        if op == "non_finite_check_":
            cases.append(((tensors, scalar(device), None, scalar(device), False, None, None), {}))
        return cases
    if op == "optim_step_":
        return [(adam_args(device, torch.float32, masters=False), {}),
                (adam_args(device, h16, masters=True), {}),
                (adam_args(device, h16, masters=False, stochastic=True, scaling=False), {})]
    if op == "follow_writes_":
        params = [fp((17,), device, h16, 1), fp((4, 3), device, torch.bfloat16, 2), fp((9,), device, torch.bfloat16, 3)]
        targets = [fp((17,), device, seed=4), fp((4, 3), device, seed=5),
                   torch.randint(-2**15, 2**15, (9,), dtype=torch.int16, device=device)]
        return [((params, targets, False), {}), ((params, targets, True), {}), (([], [], True), {})]
    if op == "loss_scale_update_":
        def state(found):
            return (torch.full((), 1024.0, device=device), torch.zeros((), dtype=torch.int32, device=device),
                    torch.ones((), dtype=torch.int32, device=device), torch.zeros((), dtype=torch.int64, device=device),
                    torch.full((), found, device=device))
        cfg = (2.0, 0.5, 2, 1, 0.0, float("inf"), True)
        return [(state(0.0) + (torch.empty((), device=device),) + cfg, {}), (state(1.0) + (None,) + cfg, {})]
    if op in ("gemm", "gemm_with_pre"):
        a, b = fp((6, 8), device, h16, 1), fp((8, 5), device, h16, 2)
        a3 = fp((2, 6, 8), device, h16, 3)
        cases = [((a, b), dict(activation="gelu")),
                 ((a3, b.t().contiguous().t()), dict(bias=fp((5,), device, seed=4), activation="relu", alpha=0.5,
                                                     beta=2.0, c=fp((6, 5), device, seed=5),
                                                     out_dtype=torch.float32)),
                 ((fp((6, 8), device, torch.bfloat16, 6), fp((2, 8, 5), device, torch.bfloat16, 7)), {})]
        if op == "gemm":
            cases.append(((a, b), {}))
        grad_cases = []
        for args, kwargs in cases:  # and with inputs that require grad: the autograd formula
            args = tuple(t.clone().requires_grad_() for t in args)
            kwargs = {k: (v.clone().requires_grad_() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
            grad_cases.append((args, kwargs))
        return cases + grad_cases
    if op == "philox_words_":
        return [((_ops.u64_arg(2**64 - 1, "seed"), 5, 3, 0, torch.empty(37, dtype=torch.int32, device=device)), {}),
                ((1, 0, 0, 0, torch.empty(0, dtype=torch.int32, device=device)), {})]
    if op == "philox4x32_10":
        return [((torch.arange(40, dtype=torch.int32, device=device).reshape(10, 4), 7, 2**32 - 1), {})]
    if op == "round_stochastic":
        return [((fp((9, 11), device), h16, 3, 100), {}), ((fp((33,), device), torch.bfloat16, 0, 0), {})]
    if op == "round_stochastic_out_":
        return [((fp((65,), device), 3, 8, torch.empty(65, dtype=h16, device=device)), {})]
    if op == "fixed_point_quantize":
        return [((fp((50,), device), 4, 8, True, 9, 0, torch.int16), {}),
                ((fp((5, 6), device, torch.float64), 2, 14, False, 0, 0, torch.float32), {})]
    if op == "fixed_point_quantize_out_":
        return [((fp((50,), device), 4, 8, True, 9, 3, torch.empty(50, dtype=torch.int16, device=device)), {}),
                ((fp((5, 6), device, torch.float64), 12, 20, False, 0, 0,
                  torch.empty(5, 6, dtype=torch.float64, device=device)), {})]
    if op == "fixed_point_matmul":
        a = torch.randint(-100, 100, (5, 7), dtype=torch.int16, device=device)
        b = torch.randint(-100, 100, (7, 3), dtype=torch.int32, device=device)
        return [((a, b, 4, 8, 4, 8, 8, 8, True, 5, 0, torch.int32), {}),
                ((a, b, 4, 8, 4, 8, 8, 8, False, 0, 0, torch.int16), {})]
    if op == "activation_backward":
        g, x = fp((6, 5), device, h16, 1), fp((6, 5), device, h16, 2)
        gb, xb, pb = (fp((2, 3, 5), device, torch.bfloat16, s) for s in (3, 4, 5))
        gt, xt = fp((5, 6), device, h16, 7).t(), fp((5, 6), device, h16, 8).t()  # transposed: strides kept
        cases = [((g, x, "gelu", None, h16), {}), ((g, x, "relu", fp((6, 5), device, h16, 6), None), {}),
                 ((gb, xb, "gelu_erf", pb, torch.float32), {}), ((gt, x, "gelu", None, h16), {}),
                 ((g, xt, "relu", None, None), {})]
        # and with inputs that require grad: the second derivative's formula
        return cases + [(tuple(t.clone().requires_grad_() if isinstance(t, torch.Tensor) else t for t in args), {})
                        for args, _ in cases]
    if op == "bias_grad":
        cases = [((fp((6, 5), device, h16, 1), h16), {}), ((fp((2, 3, 4), device, torch.bfloat16, 2), torch.float32), {}),
                 ((fp((0, 3), device, h16, 3), h16), {}), ((fp((5, 6), device, h16, 4).t(), torch.float32), {})]
        return cases + [((args[0].clone().requires_grad_(), args[1]), {}) for args, _ in cases]
    raise AssertionError(f"no sample inputs for mpfused::{op}: add them here")


def test_every_operator_has_samples():
    assert {"gemm", "optim_step_", "non_finite_check_", "unscale_check_", "loss_scale_update_"} <= set(OPS)
    for op in OPS:
        assert samples(op, "cpu"), op


@pytest.mark.parametrize("op", OPS)
def test_opcheck(device, op):
    for args, kwargs in samples(op, device):
        torch.library.opcheck(getattr(torch.ops.mpfused, op).default, args, kwargs)


@pytest.mark.parametrize("op", OPS)
def test_schema_marks_writes_only(op):
    """Which arguments the schema says an operator writes: exactly the ones it may write."""
    writes = {a.name for a in getattr(torch.ops.mpfused, op).default._schema.arguments
              if a.alias_info is not None and a.alias_info.is_write}
    expected = {
        "non_finite_check_": {"found_inf", "sumsq", "norm", "counter"},
        "unscale_check_": {"tensors", "found_inf", "sumsq", "norm", "counter"},
        "optim_step_": {"params", "grads", "masters", "remainders", "states", "steps", "counter"},
        "follow_writes_": {"targets"},
        "loss_scale_update_": {"scale", "growth_tracker", "hysteresis_left", "skipped_steps", "inv_scale"},
        "philox_words_": {"out"},
        "round_stochastic_out_": {"out"},
        "fixed_point_quantize_out_": {"out"},
    }.get(op, set())
    assert writes == expected



# The operators that return nothing and only write their arguments: autograd has nothing to record, so
# their Autograd keys fall through to the backend kernel (csrc/torch/common.h, MPF_TORCH_NO_AUTOGRAD)
# instead of torch's boxed autograd fallback. Every operator with an output has an autograd kernel.
NO_AUTOGRAD = ("optim_step_", "follow_writes_", "non_finite_check_", "unscale_check_", "loss_scale_update_")


@pytest.mark.parametrize("op", OPS)
def test_only_in_place_operators_without_outputs_skip_autograd(op):
    table = torch._C._dispatch_dump_table(f"mpfused::{op}")
    keys = {line.split(":")[0]: line for line in table.splitlines() if ":" in line}
    no_outputs = not getattr(torch.ops.mpfused, op).default._schema.returns
    for key in ("AutogradCPU", "AutogradCUDA"):
        assert ("fallthrough" in keys[key]) == (op in NO_AUTOGRAD), keys[key]
    assert op not in NO_AUTOGRAD or no_outputs


def test_in_place_operators_leave_autograd_as_the_fallback_left_it():
    # What torch's autograd fallback did for these (nothing: no version bump, no grad_fn, a backward through
    # the written tensor unchanged) holds with the fallthrough; the optimizer step counts its writes of the
    # params itself (csrc/torch/optim.cpp: one bump a step, as torch's foreach and for-loop steps count theirs).
    x = torch.randn(4, requires_grad=True)
    y = x * 2
    found = torch.zeros(1)
    torch.ops.mpfused.unscale_check_([y], found, torch.full((1,), 0.5), None, False, None, None)
    assert y._version == 0 and type(y.grad_fn).__name__ == "MulBackward0"
    assert torch.equal(y.detach(), x.detach())  # unscaled in place
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 2.0))
    p = torch.nn.Parameter(torch.randn(3))
    p.grad = torch.randn(3)
    opt = mpfused.optim.FusedAdamW([p])
    before = p.detach().clone()
    with torch.enable_grad():
        opt.step()
    assert p.grad_fn is None and p.is_leaf and p._version == 1 and not torch.equal(p.detach(), before)

def test_meta_tensors_propagate_shapes():
    a = torch.empty(3, 6, 8, dtype=torch.bfloat16, device="meta")
    b = torch.empty(8, 5, dtype=torch.bfloat16, device="meta")
    out, pre = torch.ops.mpfused.gemm_with_pre(a, b, None, "gelu", 1.0, 0.0, None, torch.float32)
    assert out.shape == pre.shape == (3, 6, 5) and out.dtype == torch.float32 and out.device.type == "meta"
    x = torch.empty(4, 4, device="meta")
    assert torch.ops.mpfused.round_stochastic(x, torch.float16, 0, 0).dtype == torch.float16
    assert mpfused.fixed_point.quantize(x, 4, 8).shape == (4, 4)


def test_fake_kernel_checks_what_the_shape_depends_on():
    a = torch.empty(4, 5, dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match="b must have 5 rows"):
        torch.ops.mpfused.gemm(a, torch.empty(6, 3, dtype=torch.float16, device="meta"))
    with pytest.raises(ValueError, match="a must be a 2-D or 3-D float16 or bfloat16"):
        torch.ops.mpfused.gemm(a.float(), torch.empty(5, 3, device="meta"))
    with pytest.raises(ValueError, match="out_dtype must be"):
        torch.ops.mpfused.gemm(a, torch.empty(5, 3, dtype=torch.float16, device="meta"), out_dtype=torch.float64)


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("call, match", [
    (lambda: torch.ops.mpfused.gemm(meta(4, 5, dtype=torch.float16), meta(5, 3, dtype=torch.float16),
                                    meta(4, dtype=torch.float16)), "bias must be 1-D with 3 elements"),
    (lambda: torch.ops.mpfused.gemm(meta(4, 5, dtype=torch.float16), meta(5, 3, dtype=torch.float16), None, "tanh"),
     "activation must be None, 'relu'"),
    (lambda: torch.ops.mpfused.gemm(meta(4, 5, dtype=torch.float16), meta(5, 3, dtype=torch.float16), None, None,
                                    1.0, 1.0, meta(3, 4)), "c must have the output's shape"),
    (lambda: torch.ops.mpfused.round_stochastic(meta(4, dtype=torch.int32), torch.float16, 0, 0), "x must be a float32"),
    (lambda: torch.ops.mpfused.round_stochastic(meta(4), torch.float32, 0, 0), "dtype must be torch.float16"),
    (lambda: torch.ops.mpfused.fixed_point_quantize(meta(4, dtype=torch.int64), 4, 8, False, 0, 0, torch.int16),
     "x must be a float32, float64"),
    (lambda: torch.ops.mpfused.fixed_point_quantize(meta(4), -5, 100, False, 0, 0, torch.int32), "il >= 1"),
    (lambda: torch.ops.mpfused.fixed_point_quantize(meta(4), 8, 12, False, 0, 0, torch.int16), "cannot hold codes"),
    (lambda: torch.ops.mpfused.fixed_point_matmul(meta(3, 4, dtype=torch.int16), meta(3, 5, dtype=torch.int16),
                                                  4, 4, 4, 4, 4, 4, False, 0, 0, torch.int16), "b_codes must have 4 rows"),
    (lambda: torch.ops.mpfused.fixed_point_matmul(meta(4, dtype=torch.int16), meta(4, 5, dtype=torch.int16),
                                                  4, 4, 4, 4, 4, 4, False, 0, 0, torch.int16), "a_codes must be a 2-D"),
    (lambda: torch.ops.mpfused.fixed_point_matmul(meta(3, 4, dtype=torch.int16), meta(4, 5, dtype=torch.int16),
                                                  4, 4, 4, 4, 20, 4, False, 0, 0, torch.int16), "out_dtype must be"),
])
def test_fake_kernels_refuse_what_the_kernels_refuse(call, match):
    """On meta tensors (and under torch.compile's FakeTensors) the real kernel never runs: its fake must
    refuse the same arguments, not make up an output."""
    with pytest.raises(ValueError, match=match):
        call()


def test_subclasses_that_intercept_dispatch_are_refused_and_plain_ones_taken():
    from torch.testing._internal.two_tensor import TwoTensor

    class Plain(torch.Tensor):  # no __torch_dispatch__ of its own: its memory is the tensor's
        pass

    a = torch.ones(4, 5, dtype=torch.float16)
    b = torch.ones(5, 3, dtype=torch.float16)
    assert torch.equal(mpfused.gemm(a.as_subclass(Plain), b), mpfused.gemm(a, b))
    with pytest.raises(TypeError, match="a is a tensor subclass .TwoTensor."):
        mpfused.gemm(TwoTensor(a, a.clone()), b)
    # FusedLinear leaves such inputs to F.linear, which computes through the subclass's own dispatch
    layer = mpfused.nn.FusedLinear(5, 3, dtype=torch.float16)
    out = layer(TwoTensor(a, a.clone()))
    assert isinstance(out, TwoTensor) and torch.equal(out.a, torch.nn.functional.linear(a, layer.weight, layer.bias))


ROUNDINGS = {
    "round_stochastic": lambda x: mpfused.round_stochastic(x, torch.float16, seed=1),
    "quantize": lambda x: mpfused.fixed_point.quantize(x, 4, 8, rounding="stochastic", seed=1),
    "encode": lambda x: mpfused.fixed_point.encode(x, 4, 8, rounding="stochastic", seed=1),
}
ROUNDINGS_OUT = {  # (call, the out tensor it writes, made for an x of 8 elements)
    "round_stochastic": (lambda x, o: mpfused.round_stochastic(x, torch.bfloat16, seed=1, out=o),
                         lambda: torch.full((8,), 3.0, dtype=torch.bfloat16)),
    "quantize": (lambda x, o: mpfused.fixed_point.quantize(x, 4, 8, out=o), lambda: torch.full((8,), 3.0)),
    "encode": (lambda x, o: mpfused.fixed_point.encode(x, 4, 8, out=o), lambda: torch.full((8,), 3, dtype=torch.int16)),
}


@pytest.mark.parametrize("name", ["round_stochastic", "quantize"])
def test_rounding_has_no_derivative(name):
    """A backward through a rounding raises (no silent gradient drop); under no_grad nothing is recorded."""
    call = ROUNDINGS[name]
    x = torch.randn(8, requires_grad=True)
    y = call(x)
    assert y.requires_grad
    with pytest.raises(RuntimeError, match="has no derivative .*straight through"):
        y.float().sum().backward()
    with torch.no_grad():
        assert not call(x).requires_grad
    assert torch.equal(call(x).detach(), call(x.detach()))  # the same bits with and without a graph
    # under vmap, x.requires_grad speaks for the innermost level only: the outer gradient is still refused
    w = torch.randn(3, 8, requires_grad=True)
    out = torch.func.vmap(call)(w)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="has no derivative"):
        out.float().sum().backward()
    with pytest.raises(RuntimeError, match="has no derivative"):  # torch.func.grad, through the same kernel
        torch.func.grad(lambda v: call(v).float().sum())(torch.randn(8))


def test_codes_take_no_gradient():
    """encode's int codes cannot carry a gradient (integers never do in torch): no graph, no error, as
    for torch's own integer-valued ops (argmax)."""
    x = torch.randn(8, requires_grad=True)
    codes = ROUNDINGS["encode"](x)
    assert codes.dtype == torch.int16 and not codes.requires_grad and codes.grad_fn is None


@pytest.mark.parametrize("name", ["round_stochastic", "quantize"])
@pytest.mark.parametrize("where", ["x", "out", "none"])
def test_forward_mode_ad_is_refused(name, where):
    """Forward-mode AD (dual tensors, torch.func.jvp) through a rounding raises instead of returning a zero
    or missing tangent, whether the tangent is on x or on out=; out is left unwritten."""
    import torch.autograd.forward_ad as fwAD

    x, t = torch.randn(8), torch.randn(8)
    out = None if where == "none" else ROUNDINGS_OUT[name][1]()
    before = None if out is None else out.clone()
    with fwAD.dual_level():
        if where == "none":
            call, arg = ROUNDINGS[name], fwAD.make_dual(x, t)
        elif where == "x":
            call, arg = (lambda v: ROUNDINGS_OUT[name][0](v, out)), fwAD.make_dual(x, t)
        else:
            dual_out = fwAD.make_dual(out, torch.ones_like(out))
            call, arg = (lambda v: ROUNDINGS_OUT[name][0](v, dual_out)), x
        named = "out" if where == "out" else "x"
        with pytest.raises(RuntimeError, match=f"has no derivative .*forward mode.*but {named} carries a tangent"):
            call(arg)
    if where != "out":
        with pytest.raises(RuntimeError, match="has no derivative .*forward mode"):
            torch.func.jvp(call, (x,), (t,))
    if out is not None:
        assert torch.equal(out, before)


@pytest.mark.parametrize("name", ["round_stochastic", "quantize"])
def test_the_advised_straight_through_estimator_works_in_both_modes(name):
    """The way out the errors give: round x.detach(), and pass the gradient straight through. Its tangent
    and its gradient are exactly the identity's."""
    call = ROUNDINGS[name]

    def ste(v):
        return v + (call(v.detach()).float() - v).detach()

    x, t = torch.randn(8), torch.randn(8)
    primal, tangent = torch.func.jvp(ste, (x,), (t,))
    assert torch.equal(tangent, t) and torch.equal(primal, call(x).float())
    assert torch.equal(torch.func.grad(lambda v: (ste(v) * t).sum())(x), t)


def test_roundings_opcheck_with_inputs_that_require_grad():
    """opcheck's autograd-registration check with an x that requires grad (its AOT test is left out: it
    runs a backward, which for a rounding raises by design, as test_rounding_has_no_derivative checks)."""
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    x = fp((9, 11), "cpu").requires_grad_()
    ops = torch.ops.mpfused
    torch.library.opcheck(ops.round_stochastic.default, (x, torch.float16, 3, 100), test_utils=utils)
    for dtype in (torch.float32, torch.int16):
        torch.library.opcheck(ops.fixed_point_quantize.default, (x, 4, 8, True, 9, 0, dtype), test_utils=utils)


def test_codes_pass_forward_mode_as_integers_do():
    """encode's integer codes carry no tangent, as torch's argmax: a function of x and its codes has the
    tangent of its float part."""
    fxp = mpfused.fixed_point
    x, t = torch.randn(8), torch.randn(8)
    q = fxp.decode(fxp.encode(x, 4, 8), 4, 8)
    primal, tangent = torch.func.jvp(lambda v: v * fxp.decode(fxp.encode(v, 4, 8), 4, 8), (x,), (t,))
    assert torch.equal(primal, x * q) and torch.equal(tangent, t * q)
    codes = torch.zeros(8, dtype=torch.int16)
    x_grad = x.clone().requires_grad_()
    assert fxp.encode(x_grad, 4, 8, out=codes) is codes and torch.equal(codes, fxp.encode(x, 4, 8))


@pytest.mark.parametrize("name", ["round_stochastic", "quantize", "encode"])
def test_out_forms_refuse_autograd_and_write_nothing(name):
    """out= takes no part in autograd, as torch's own out= arguments: an x or out that requires grad while
    grad mode is on is refused before out is written (never a result detached in silence); under
    no_grad, or with detached tensors, the call writes out. Integer codes take no gradient: there
    encode(out=) writes, as torch's integer-valued ops do."""
    call, make_out = ROUNDINGS_OUT[name]
    x = torch.randn(8, requires_grad=True)
    out = make_out()
    before = out.clone()
    if out.is_floating_point():
        with pytest.raises(RuntimeError, match="with out= takes no part in autograd .*, but x requires grad"):
            call(x, out)
        assert torch.equal(out, before)
        target = make_out().requires_grad_()
        with pytest.raises(RuntimeError, match="out requires grad"):
            call(x.detach(), target)
        assert torch.equal(target.detach(), before)
        with torch.no_grad():
            call(x, out)
    else:
        call(x, out)
    assert not out.requires_grad and torch.equal(out, call(x.detach(), make_out()))


@pytest.mark.parametrize("name", ["round_stochastic", "quantize", "encode"])
def test_out_forms_count_their_write_in_out_version(name):
    """A write through out= bumps out's version counter, as torch's in-place ops do: a graph that saved out
    for its backward then refuses the new values instead of using them."""
    call, make_out = ROUNDINGS_OUT[name]
    x = torch.randn(8)
    out = make_out()
    v0 = out._version
    call(x, out)
    assert out._version > v0
    if out.is_floating_point():
        w = torch.ones(8, requires_grad=True, dtype=out.dtype)
        y = (w * out).sum()  # saves out for w's gradient
        call(x * 3, out)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()


def test_out_forms_refuse_an_inference_tensor_before_writing():
    with torch.inference_mode():
        out = torch.full((8,), 3.0)
    with pytest.raises(RuntimeError, match="out is an inference tensor"):
        mpfused.fixed_point.quantize(torch.randn(8), 4, 8, out=out)
    assert torch.equal(out, torch.full((8,), 3.0))
    with torch.inference_mode():  # inside inference mode the write is allowed, as for torch's in-place ops
        mpfused.fixed_point.quantize(torch.randn(8), 4, 8, out=out)


def test_gemm_refuses_forward_mode_ad():
    """The GEMM has a reverse-mode formula only: a tangent on any input raises (it used to come back as
    None for a dual tensor and as zeros under torch.func.jvp); reverse mode is unchanged."""
    import torch.autograd.forward_ad as fwAD

    a, b = torch.randn(4, 8, dtype=torch.float16), torch.randn(8, 3, dtype=torch.float16)
    ta = torch.randn_like(a)
    with fwAD.dual_level():
        with pytest.raises(RuntimeError, match="no forward-mode derivative, but a carries a tangent"):
            mpfused.gemm(fwAD.make_dual(a, ta), b)
        with pytest.raises(RuntimeError, match="but b carries a tangent"):
            mpfused.gemm(a, fwAD.make_dual(b, torch.randn_like(b)))
    with pytest.raises(RuntimeError, match="no forward-mode derivative"):
        torch.func.jvp(lambda v: mpfused.gemm(v, b), (a,), (ta,))
    layer = mpfused.nn.FusedLinear(8, 3, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="no forward-mode derivative"):
        torch.func.jvp(layer, (a,), (ta,))
    a_rg = a.clone().requires_grad_()  # reverse mode passes the new kernel: d(sum(a @ b))/da = b's row sums
    mpfused.gemm(a_rg, b).float().sum().backward()
    assert torch.equal(a_rg.grad, mpfused.gemm(torch.ones(4, 3, dtype=torch.float16), b.t().contiguous()))


def test_fixed_point_format_overflow_is_refused():
    x = torch.randn(4)
    with pytest.raises(ValueError, match="il >= 1, fl >= 0 and il \\+ fl <= 32"):
        torch.ops.mpfused.fixed_point_quantize(x, 2**62, 2**62, False, 0, 0, torch.int32)


# ---- eager calls from C++ ---------------------------------------------------------------------------------
# In eager mode the wrappers of the per-step operators call them through the dispatcher from C++ (_C.*_call),
# not through torch.ops' per-argument conversion (mpfused._ops.optim_step_direct says why). Torch must see
# the same operator, and where torch.ops would hand the call to __torch_function__, it still does.
def _scaler_calls(device):
    """(operator name, a fresh call of its wrapper on fixed inputs returning what it wrote, the name of the
    _C function that calls it from C++) for the scaler's per-iteration operators."""
    def check(unscale, found_kind=None):
        def run(found_wrap=lambda t: t):
            grads = [fp((33,), device, torch.float16, 5) * 100, fp((7,), device, seed=6)]
            found, sumsq, norm = scalar(device), scalar(device), scalar(device)
            _ops.non_finite_check_(grads, found_wrap(found), scalar(device, 0.5), unscale=unscale, sumsq=sumsq,
                                   norm=norm, overwrite=True)
            return grads + [found, sumsq, norm]
        return run

    def update(found_wrap=lambda t: t):
        scale, tracker = torch.full((), 2.0**16, device=device), torch.zeros((), dtype=torch.int32, device=device)
        left, skipped = torch.ones((), dtype=torch.int32, device=device), torch.zeros((), dtype=torch.int64, device=device)
        inv = torch.empty((), device=device)
        _ops.loss_scale_update_(scale, tracker, left, skipped, found_wrap(scalar(device, 1.0)), inv, growth_factor=2.0,
                                backoff_factor=0.5, growth_interval=3, hysteresis=1)
        return [scale, tracker, left, skipped, inv]

    return [("mpfused.non_finite_check_", check(False), "overflow_call"),
            ("mpfused.unscale_check_", check(True), "overflow_call"),
            ("mpfused.loss_scale_update_", update, "loss_scale_update_call")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("which", range(3))
def test_eager_calls_from_cpp_are_the_operators_torch_sees(monkeypatch, device, which):
    name, run, c_name = _scaler_calls(device)[which]
    made = []
    real = getattr(_ops._C, c_name)
    monkeypatch.setattr(_ops._C, c_name, lambda *a: made.append(real(*a)) or made[-1])
    with OpsSeen() as seen:
        direct = run()
    assert made == [True]
    assert [op for op in seen.ops if op.startswith("mpfused.")] == [name + ".default"]
    # a torch function mode: torch.ops, which hands it the call; the same results
    with FunctionsSeen() as functions:
        via_ops = run()
    assert made == [True] and sum(c.startswith(name) for c in functions.calls) == 1
    # a subclass argument: C++ declines it (having done nothing), torch.ops hands it the call
    Traced.seen = []
    via_subclass = run(lambda t: t.as_subclass(Traced))
    assert made == [True, False] and sum(c.startswith(name) for c in Traced.seen) == 1
    for a, b, c in zip(direct, via_ops, via_subclass, strict=True):
        assert torch.equal(a, b) and torch.equal(a, torch.as_tensor(c))


def test_eager_calls_fall_back_for_what_cpp_does_not_take(monkeypatch):
    """A tuple or generator of tensors, or an integer beyond int64: the C++ call declines (or is not made)
    and torch.ops takes the call, with its own result or message."""
    made = []
    real = _ops._C.overflow_call
    monkeypatch.setattr(_ops._C, "overflow_call", lambda *a: made.append(real(*a)) or made[-1])
    grads = [fp((9,), "cpu", seed=1), fp((4,), "cpu", seed=2)]
    results = []
    for given in (list, tuple, lambda ts: (t for t in ts)):
        found, sumsq = scalar("cpu"), scalar("cpu")
        _ops.non_finite_check_(given(grads), found, sumsq=sumsq)
        results.append((found, sumsq))
    assert made == [True, False, False]
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0], r))
    scale, tracker = torch.full((), 2.0**16), torch.zeros((), dtype=torch.int32)
    left, skipped = torch.ones((), dtype=torch.int32), torch.zeros((), dtype=torch.int64)
    with pytest.raises(RuntimeError, match="growth_interval"):
        _ops.loss_scale_update_(scale, tracker, left, skipped, scalar("cpu"), None, growth_factor=2.0,
                                backoff_factor=0.5, growth_interval=2**63, hysteresis=1)
    assert scale.item() == 2.0**16 and tracker.item() == 0


def test_loss_scale_update_refuses_aliased_tensors_and_a_zero_backoff_before_writing():
    """The operator took tensors that share memory, which mpfused.GradScaler never passes but a direct call
    may: inv_scale as scale made the scale 1 / scale, found_inf as scale read the new scale as the flag, the
    growth tracker as hysteresis_left mixed two counts; and backoff_factor 0, which the scaler refuses (the
    scale goes to 0 at the first overflow). Each is a ValueError naming the arguments, before any write."""
    def fresh():
        return (torch.full((), 2.0**16), torch.zeros((), dtype=torch.int32), torch.ones((), dtype=torch.int32),
                torch.zeros((), dtype=torch.int64), torch.ones(()), torch.zeros(()))

    kw = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=2, hysteresis=1)
    for alias, match in [(lambda t: (t[0], t[1], t[2], t[3], t[4], t[0]), "inv_scale must not overlap scale"),
                         (lambda t: (t[0], t[1], t[2], t[3], t[0], t[5]), "scale must not overlap found_inf"),
                         (lambda t: (t[0], t[1], t[1], t[3], t[4], t[5]), "hysteresis_left must not overlap growth_tracker")]:
        t = fresh()
        args = alias(t)
        with pytest.raises(ValueError, match=match):
            _ops.loss_scale_update_(*args, **kw)
        assert t[0].item() == 2.0**16 and t[1].item() == 0 and t[2].item() == 1 and t[3].item() == 0
    t = fresh()
    with pytest.raises(ValueError, match="backoff_factor must be > 0"):
        _ops.loss_scale_update_(*t, **dict(kw, backoff_factor=0.0))
    assert t[0].item() == 2.0**16 and t[3].item() == 0
    _ops.loss_scale_update_(*t, **kw)  # found_inf 1: backs off
    assert t[0].item() == 2.0**15 and t[3].item() == 1 and t[5].item() == 2.0**-15


def _schema(op):
    return getattr(torch.ops.mpfused, op).default._schema


def _tensor_slots(args):
    """(argument index, list index or None, tensor) of every tensor among args, in lists too."""
    for i, v in enumerate(args):
        if isinstance(v, torch.Tensor):
            yield i, None, v
        elif isinstance(v, (list, tuple)):
            for j, t in enumerate(v):
                if isinstance(t, torch.Tensor):
                    yield i, j, t


def _cloned(args):
    return [v.clone() if isinstance(v, torch.Tensor) else
            [t.clone() if isinstance(t, torch.Tensor) else t for t in v] if isinstance(v, (list, tuple)) else v
            for v in args]


def _put(args, i, j, t):
    if j is None:
        args[i] = t
    else:
        args[i][j] = t


def _bits(t):
    return t.detach().resolve_conj().resolve_neg().reshape(-1).contiguous().view(torch.uint8)


def _same_tensors(a, b):
    return all(torch.equal(_bits(x), _bits(y)) for (_, _, x), (_, _, y) in zip(_tensor_slots(a), _tensor_slots(b)))


def _plain_cases(op):
    """The samples without autograd (inputs that require grad), their keyword arguments placed by the schema
    (the GEMM's bias and c), and for optim_step_ one with every optional tensor: an lr tensor, tensor betas
    (Tensor?[]), a grad scale and a BF16 param with a remainder."""
    arguments = _schema(op).arguments
    cases = []
    for args, kwargs in samples(op, "cpu"):
        args = list(args)
        for a in arguments[len(args):]:
            args.append(kwargs.pop(a.name, a.default_value))
        assert not kwargs, kwargs
        if not any(t.requires_grad for _, _, t in _tensor_slots(args)):
            cases.append(args)
    if op == "optim_step_":
        full = list(adam_args("cpu", torch.float32, masters=False))
        names = [a.name for a in arguments]
        full[names.index("lr_tensor")] = torch.tensor([1e-3], dtype=torch.float64)
        full[names.index("hyper_tensors")] = [torch.tensor([0.9], dtype=torch.float64)] + [None] * 6  # beta1
        full[names.index("grad_scale")] = scalar("cpu", 2.0)
        full[names.index("inv_scale")] = None  # (one or the other)
        bf = fp((5,), "cpu", torch.bfloat16, 9)
        full[names.index("params")] = full[names.index("params")][:1] + [bf]
        full[names.index("grads")] = full[names.index("grads")][:1] + [fp((5,), "cpu", torch.bfloat16, 10)]
        full[names.index("remainders")] = [torch.zeros(5, dtype=torch.int16)]
        full[names.index("remainder_index")] = [-1, 0]
        full[names.index("states")] = [torch.zeros(p.shape) for p in full[names.index("params")] for _ in range(2)]
        cases.append(full)
    return cases


# Arguments that the storage check's message names by their role, not by the schema's name.
STORAGE_NAMES = {("fixed_point_matmul", "a"): "a_codes", ("fixed_point_matmul", "b"): "b_codes",
                 ("optim_step_", "states"): r"(exp_avg|exp_avg_sq|max_exp_avg_sq)\[\d\]",
                 ("optim_step_", "remainders"): r"remainders\[\d\]",  # (by its param's index)
                 ("optim_step_", "lr_tensor"): "lr", ("optim_step_", "hyper_tensors"): "beta1"}


@pytest.mark.parametrize("op", OPS)
def test_a_tensor_outside_its_storage_is_refused_before_anything_is_written(op):
    """A tensor whose storage was freed (untyped_storage().resize_(0), as FSDP frees unsharded params) or shrunk
    after it was made: the kernels take untyped data pointers, so it was read or written out of bounds (a crash,
    or a heap corrupted in silence). Every operator refuses it, naming the argument, before any write."""
    names = [a.name for a in _schema(op).arguments]
    cases = _plain_cases(op) or [args for args, _ in samples(op, "cpu")][:1]
    ran = 0
    for args in cases:
        for i, j, t in list(_tensor_slots(args)):
            if t.numel() == 0 or t.requires_grad:
                continue
            for keep in (0, 1):  # freed, or shrunk to one element's bytes less than the tensor needs
                call = _cloned(args)
                victim = call[i] if j is None else call[i][j]
                needed = (victim.storage_offset() + 1 + sum((s - 1) * st for s, st in zip(victim.shape, victim.stride())))
                # (the others' values before the call; the victim itself cannot be read: torch's own clone of
                # it would read past its storage too)
                before = {(ia, ja): a.clone() for ia, ja, a in _tensor_slots(call) if (ia, ja) != (i, j)}
                victim.untyped_storage().resize_(keep * (needed - 1) * victim.element_size())
                name = re.escape(names[i] + ("" if j is None else f"[{j}]"))
                name = STORAGE_NAMES.get((op, names[i]), name)  # (where the message names the argument's role)
                with pytest.raises(ValueError, match=rf"^({name}) reaches past the end of its storage"):
                    getattr(torch.ops.mpfused, op)(*call)
                rest = [(a, before[(ia, ja)]) for ia, ja, a in _tensor_slots(call) if (ia, ja) != (i, j)]
                assert all(torch.equal(_bits(a), _bits(b)) for a, b in rest), (op, names[i], j)
                ran += 1
    assert ran > 0, op


IN_PLACE = [op for op in OPS if any(a.alias_info is not None and a.alias_info.is_write for a in _schema(op).arguments)]


@pytest.mark.parametrize("op", IN_PLACE)
def test_in_place_operators_refuse_written_math_bit_views_and_resolve_read_ones(op):
    """x.conj().imag is a view with torch's lazy negation bit. Through torch's math-bits fallback an operator that
    returns nothing read past its call's arguments (an internal assert, a crash, or a found_inf left unset): an
    argument the operator writes with such a bit is refused, naming it, before anything is written; one it only
    reads is resolved (the same result as without the bit)."""
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"mpfused::{op}", "Negative")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"mpfused::{op}", "Conjugate")
    arguments = _schema(op).arguments
    fn = getattr(torch.ops.mpfused, op)
    written_seen = read_seen = 0
    for args in _plain_cases(op):
        for i, j, t in list(_tensor_slots(args)):
            a = arguments[i]
            call = _cloned(args)
            value = call[i] if j is None else call[i][j]
            _put(call, i, j, torch._neg_view(value.neg()))  # the same values, through the negation bit
            if a.alias_info is not None and a.alias_info.is_write:
                before = _cloned(call)
                name = re.escape(a.name + ("" if j is None else f"[{j}]"))
                with pytest.raises(ValueError, match=rf"{name} is a view with torch's lazy negation bit set"):
                    fn(*call)
                assert _same_tensors(call, before), (op, a.name, j)
                written_seen += 1
            else:
                plain = _cloned(args)
                fn(*plain)
                fn(*call)
                assert _same_tensors(call, plain), (op, a.name, j)
                read_seen += 1
    assert written_seen > 0, op
    # a written complex tensor with the conjugation bit (the Conjugate key): refused too, naming it
    if op == "non_finite_check_":
        with pytest.raises(ValueError, match="found_inf is a view with torch's lazy conjugation bit set"):
            fn([torch.ones(3)], torch.zeros(1, dtype=torch.complex64).conj(), None, None, False, None, None)
    # the view of the real part of a conjugated complex tensor, as user code makes one
    if op == "non_finite_check_":
        grads = torch.tensor([1.0 + 0j, 2.0 - 1j * float("inf")]).conj().imag  # [-0., inf] through the bit
        found = torch.zeros(1)
        fn([grads], found, None, None, False, None, None)
        assert found.item() == 1.0
