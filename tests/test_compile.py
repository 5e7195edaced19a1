"""torch.compile and CUDA graphs: the kernels are torch operators (torch.ops.mpfused.*), so a FusedLinear
model, an optimizer step and a whole GradScaler iteration compile with no graph break and
``fullgraph=True``, and compute exactly what eager computes; the steps never read a device value on the
host, which is what lets CUDA graphs capture them (``capturable=True``).

Bit for bit against eager: our operators run the same kernels compiled or not. The surrounding torch ops
are compiled by inductor, which by default keeps FP16 intermediates of autocast regions in FP32; its
``emulate_precision_casts`` option rounds them as eager does, and the tests set it. A loss *value*
reduced by inductor may still differ from eager's in the last bit (its summation order; torch's own
numerics, not ours), so the iteration tests compare it bit for bit on the aot_eager backend (AOT
autograd and functionalization, no code generation) and compare everything we compute (params, FP32
masters, optimizer state, grad norms, the scale and the skipped steps) bit for bit on both backends.
"""

from __future__ import annotations

import contextlib
import math
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mpfused
from mpfused import optim as mo
from mpfused.nn import FusedLinear
from conftest import requires_cuda
from optim_helpers import assert_same, bits, snapshot

# dynamo's trace_autograd_ops puts backward() in the graph: torch 2.11 and 2.13 have it, 2.9 does not
# (README: "Install"). Without it a compiled iteration breaks its graph at backward() and the rest still
# compiles: the iteration tests then compile with fullgraph=False and check that backward() is the only break.
TRACES_BACKWARD = hasattr(torch._dynamo.config, "trace_autograd_ops")


def backward_in_graph():
    """dynamo's config with backward() traced, where this torch can trace it."""
    return torch._dynamo.config.patch(trace_autograd_ops=True) if TRACES_BACKWARD else contextlib.nullcontext()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    with torch._inductor.config.patch(emulate_precision_casts=True):
        yield
    torch._dynamo.reset()


def graph_breaks(fn, *args) -> int:
    return torch._dynamo.explain(fn)(*args).graph_break_count


class NoHostReads(TorchDispatchMode):
    """Raises on a read of a tensor's value by the host: .item(), float(t), bool(t) and int(t) go through
    aten._local_scalar_dense, and a copy from a CUDA device to the CPU is refused too. With a GPU, CUDA's
    sync debug mode also turns any synchronising call into an error. (t.tolist() of a CPU tensor reads its
    memory without an operator: nothing here can see that one.) A step that passes under it can be
    captured in a CUDA graph."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("the host read a tensor's value")
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default) and isinstance(out, torch.Tensor):
            sources = [a for a in args if isinstance(a, torch.Tensor)]
            if out.device.type == "cpu" and any(t.device.type == "cuda" for t in sources):
                raise AssertionError("a device value was copied to the host")
        return out

    def __enter__(self):
        if torch.cuda.is_available():
            self._debug_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        return super().__enter__()

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(self._debug_mode)
        return super().__exit__(*exc)


# ---- FusedLinear ---------------------------------------------------------------------------------------
def linear_model(device, dtype, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(FusedLinear(16, 32, activation="gelu"), FusedLinear(32, 32, activation="relu"),
                               FusedLinear(32, 4, bias=False)).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_linear_model_compiles_whole_and_matches_eager(device, dtype):
    model = linear_model(device, dtype)
    x = torch.randn(2, 6, 16, device=device, dtype=dtype, requires_grad=True)
    assert graph_breaks(model, x) == 0

    def run(fn):
        model.zero_grad(set_to_none=True)
        x.grad = None
        out = fn(x)
        out.float().square().sum().backward()
        return [out.detach()] + [t.grad.clone() for t in [x, *model.parameters()]]

    eager = run(model)
    compiled = run(torch.compile(model, fullgraph=True))
    for e, c in zip(eager, compiled, strict=True):
        assert e.dtype == c.dtype and torch.equal(e, c)


def test_compiled_backward_keeps_the_activation_and_bias_gradients_as_operators(device):
    """The backward graph that AOT autograd hands the compiler holds mpfused::activation_backward and
    mpfused::bias_grad, not torch's gelu_backward / threshold_backward and sum, which inductor would
    generate code for (and round otherwise than eager: torch 2.11)."""
    from torch._dynamo.backends.common import aot_autograd
    seen = []

    def keep(gm, example_inputs):
        seen.append({n.target for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    model = torch.nn.Sequential(FusedLinear(16, 32, activation="gelu"), FusedLinear(32, 8, activation="relu"),
                                FusedLinear(8, 4)).to(device=device, dtype=torch.float16)
    x = torch.randn(5, 16, device=device, dtype=torch.float16)
    out = torch.compile(model, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))(x)
    out.float().sum().backward()
    assert len(seen) == 2
    backward = seen[1]
    ops = torch.ops.mpfused
    assert {ops.activation_backward.default, ops.bias_grad.default} <= backward, backward
    assert not {torch.ops.aten.gelu_backward.default, torch.ops.aten.threshold_backward.default,
                torch.ops.aten.sum.dim_IntList} & backward, backward
    assert all(p.grad is not None for p in model.parameters())


def test_fused_linear_under_autocast_compiles_whole(device):
    model = linear_model(device, torch.float32)
    x = torch.randn(8, 16, device=device)

    def fwd(x):
        with torch.autocast(device, dtype=torch.bfloat16):
            return model(x)

    assert graph_breaks(fwd, x) == 0
    assert torch.equal(fwd(x), torch.compile(fwd, fullgraph=True)(x))


def test_gemm_support_query_is_a_constant_under_compile(monkeypatch):
    """FusedLinear asks once per device and dtype whether mpfused's GEMM runs there (mpfused.nn). Under
    torch.compile that answer must be a constant computed at trace time: the real query calls into the
    extension, which dynamo cannot trace. The query here calls a builtin of C (as the real one does), so
    fullgraph=True fails unless the function is marked constant, as torch's decorator marks it."""
    from mpfused import nn as mnn

    def marked():
        return None

    torch.compiler.assume_constant_result(marked)
    assert vars(marked) == {"_dynamo_marked_constant": True}, "torch's constant marker changed; see mpfused/nn.py"
    assert vars(mnn._gemm_unsupported).items() >= vars(marked).items()

    calls = []

    def query(device, dtype):
        calls.append((device, dtype))
        return "no kernel" + sys.intern("")

    monkeypatch.setattr(mnn, "_query_gemm", query)
    monkeypatch.setattr(mnn, "_GEMM_UNSUPPORTED", {})

    @torch.compile(fullgraph=True, backend="eager")
    def f(x):
        return x + len(mnn._gemm_unsupported(x.device, torch.bfloat16))

    with pytest.warns(RuntimeWarning, match="computes with torch's matmul"):
        out = f(torch.zeros(2))
    assert torch.equal(out, torch.full((2,), 9.0)) and calls == [(torch.device("cpu"), torch.bfloat16)]
    assert torch.equal(f(torch.ones(2)), torch.full((2,), 10.0)) and len(calls) == 1


def test_gemm_compiles_with_its_epilogue(device):
    a = torch.randn(3, 8, 16, device=device, dtype=torch.float16)
    b = torch.randn(16, 8, device=device, dtype=torch.float16)
    c = torch.randn(8, 8, device=device)

    def f(a, b, c):
        return mpfused.gemm(a, b, activation="gelu_erf", alpha=0.5, beta=2.0, c=c, out_dtype=torch.float32)

    assert graph_breaks(f, a, b, c) == 0
    assert torch.equal(f(a, b, c), torch.compile(f, fullgraph=True)(a, b, c))


# ---- torch.export and FakeTensors -------------------------------------------------------------------------
def fused_ops(graph) -> list:
    return [str(n.target) for n in graph.nodes if n.op == "call_function" and "mpfused" in str(n.target)]


@pytest.mark.parametrize("strict", [False, True])
def test_fused_linear_exports_fused(device, strict):
    # torch.export's default (non-strict) mode runs the module on FakeTensors, which override
    # __torch_dispatch__ like DTensor: taken for one, FusedLinear exported as F.linear + gelu, rounding twice
    torch.manual_seed(0)
    f = FusedLinear(16, 8, activation="gelu", device=device, dtype=torch.bfloat16)
    x = torch.randn(3, 5, 16, device=device, dtype=torch.bfloat16)
    ep = torch.export.export(f, (x,), strict=strict)
    assert fused_ops(ep.graph) == ["mpfused.gemm_with_pre.default"]
    assert torch.equal(ep.module()(x), f(x))


def test_gemm_and_round_stochastic_export_and_take_fake_tensors(device):
    class M(torch.nn.Module):
        def forward(self, a, b, x):
            return mpfused.gemm(a, b, alpha=0.5), mpfused.round_stochastic(x, torch.float16, seed=3, offset=5)

    torch.manual_seed(0)
    args = (torch.randn(6, 16, device=device, dtype=torch.float16), torch.randn(16, 4, device=device,
            dtype=torch.float16), torch.randn(100, device=device))
    ep = torch.export.export(M(), args)
    assert fused_ops(ep.graph) == ["mpfused.gemm.default", "mpfused.round_stochastic.default"]
    for got, want in zip(ep.module()(*args), M()(*args)):
        assert torch.equal(got, want)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        a = torch.empty(6, 16, device=device, dtype=torch.bfloat16)
        out = mpfused.gemm(a, a.t(), out_dtype=torch.float32)
        r = mpfused.round_stochastic(torch.empty(7, device=device), torch.bfloat16, seed=1)
    assert out.shape == (6, 6) and out.dtype == torch.float32 and r.shape == (7,) and r.dtype == torch.bfloat16


def test_a_dtensor_is_still_refused_with_its_name():
    # the tracing tensors pass; a subclass that intercepts dispatch for itself still gets the clear error
    from torch.testing._internal.two_tensor import TwoTensor
    t = TwoTensor(torch.randn(4, 4, dtype=torch.float16), torch.randn(4, 4, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"a is a tensor subclass \(TwoTensor\)"):
        mpfused.gemm(t, t)
    with pytest.raises(TypeError, match=r"x is a tensor subclass \(TwoTensor\)"):
        mpfused.round_stochastic(TwoTensor(torch.randn(4), torch.randn(4)), torch.float16, seed=1)


def test_seed_and_offset_that_change_between_calls_compile_whole(device):
    # a Python int that changes between calls reaches the second compile as a traced int (no __index__):
    # the range checks failed to trace and fullgraph=True raised
    from mpfused import fixed_point as fxp
    x = torch.randn(300, device=device)
    rs = torch.compile(lambda x, s, k: mpfused.round_stochastic(x, torch.bfloat16, seed=s, offset=k), fullgraph=True)
    q = torch.compile(lambda x, s, k: fxp.quantize(x, 4, 8, rounding="stochastic", seed=s, offset=k), fullgraph=True)
    for s, k in ((1, 0), (2, 8), (3, 13), (2**63 + 5, 2**64 - 300)):
        assert torch.equal(rs(x, s, k), mpfused.round_stochastic(x, torch.bfloat16, seed=s, offset=k))
        assert torch.equal(q(x, s, k), fxp.quantize(x, 4, 8, rounding="stochastic", seed=s, offset=k))
    # and stay symbolic: a seed or offset that changes at every call (a step count, a position in a stream)
    # compiles twice, not once per value (the operators' schemas take SymInt; with int, every value was a
    # recompile, and the ninth call of a fullgraph compile raised at torch's recompile limit)
    a = fxp.encode(torch.randn(8, 16, device=device), 4, 8)
    mm = torch.compile(lambda a, s: fxp.matmul(a, a.t().contiguous(), (4, 8), (4, 8), (6, 10), rounding="stochastic",
                                                 seed=s), fullgraph=True)
    for fn, call, ref in ((rs, lambda f, i: f(x, i, 300 * i), lambda i: mpfused.round_stochastic(
                               x, torch.bfloat16, seed=i, offset=300 * i)),
                          (q, lambda f, i: f(x, i, i), lambda i: fxp.quantize(x, 4, 8, rounding="stochastic", seed=i,
                                                                               offset=i)),
                          (mm, lambda f, i: f(a, i), lambda i: fxp.matmul(a, a.t().contiguous(), (4, 8), (4, 8), (6, 10),
                                                                          rounding="stochastic", seed=i))):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        for i in range(20, 32):
            assert torch.equal(call(fn, i), ref(i))
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2
    with pytest.raises(Exception, match="offset"):  # still checked: 2**64 - 299 + 300 elements pass 2**64
        rs(x, 5, 2**64 - 299)


def test_gemm_takes_numpy_scalars():
    np = pytest.importorskip("numpy")
    a = torch.randn(4, 8, dtype=torch.float16)
    want = mpfused.gemm(a, a.t(), alpha=2.0, beta=0.5, c=torch.ones(4, 4))
    assert torch.equal(mpfused.gemm(a, a.t(), alpha=np.float32(2), beta=np.float16(0.5), c=torch.ones(4, 4)), want)
    with pytest.raises(TypeError, match="alpha must be a Python int or float, got Tensor"):
        mpfused.gemm(a, a.t(), alpha=torch.tensor(2.0))


# ---- optimizer steps -----------------------------------------------------------------------------------
STEP_CASES = {
    "adamw-fp16-masters": (mo.FusedAdamW, torch.float16, dict(lr=1e-2, weight_decay=0.1)),
    "adam-amsgrad-bf16": (mo.FusedAdam, torch.bfloat16, dict(lr=1e-2, amsgrad=True)),
    "adamw-tensor-lr-betas": (mo.FusedAdamW, torch.float16,
                              dict(lr=torch.tensor(1e-2), betas=(torch.tensor(0.9), torch.tensor(0.99)))),
    "adamw-bf16-remainder": (mo.FusedAdamW, torch.bfloat16, dict(lr=1e-2, master_weights="remainder")),
    "adamw-fp16-stochastic": (mo.FusedAdamW, torch.float16, dict(lr=1e-2, rounding="stochastic", seed=7)),
    "sgd-nesterov": (mo.FusedSGD, torch.float16, dict(lr=1e-2, momentum=0.9, nesterov=True)),
    "sgd-fp32": (mo.FusedSGD, torch.float32, dict(lr=1e-2, momentum=0.9, weight_decay=1e-3)),
    "lamb": (mo.FusedLAMB, torch.float16, dict(lr=1e-2, max_grad_norm=1.0)),
    "lion": (mo.FusedLion, torch.bfloat16, dict(lr=1e-3, weight_decay=0.1)),
}


def step_run(case, device, compiled, steps=4):
    cls, dtype, kwargs = STEP_CASES[case]
    torch.manual_seed(0)
    params = [torch.randn(33, 7, device=device).to(dtype).requires_grad_(), torch.randn(5, device=device).to(dtype)
              .requires_grad_()]
    kwargs = {k: (v.to(device) if isinstance(v, torch.Tensor) else
                  tuple(b.to(device) for b in v) if k == "betas" and isinstance(v[0], torch.Tensor) else v)
              for k, v in kwargs.items()}
    opt = cls(params, **kwargs)
    step = torch.compile(opt.step, fullgraph=True) if compiled else opt.step
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(device=device, dtype=dtype)
        if i == 2 and not isinstance(opt.param_groups[0]["lr"], torch.Tensor):
            opt.param_groups[0]["lr"] *= 0.5  # a scheduled lr: a new float (a symbolic one once compiled)
        step()
    return snapshot(opt, params)


@pytest.mark.parametrize("case", sorted(STEP_CASES))
def test_compiled_step_matches_eager(device, case):
    """torch.compile(opt.step, fullgraph=True): the state made in the first step, and every later step,
    bit for bit as eager, a changed lr included."""
    assert_same(step_run(case, device, compiled=False), step_run(case, device, compiled=True))


@pytest.mark.parametrize("case", ["adamw-fp16-masters", "adamw-fp16-stochastic", "sgd-fp32", "lion", "lamb"])
def test_a_scheduled_lr_and_betas_compile_once(device, case):
    """A float lr that changes at every step (any LR scheduler), and the betas of Adam, Lion and LAMB cycled
    as floats (OneCycleLR's cycle_momentum), SGD's weight_decay: 12 compiled steps (fullgraph=True) take at
    most two graphs and equal eager bit for bit. The operator's float arguments made dynamo compile once per
    value: the ninth step raised at torch's recompile limit. (SGD's momentum stays a number: whether it is 0
    decides the step's state, as in torch's SGD, whose compiled step recompiles for a cycled momentum too.)"""
    def run(compiled):
        cls, dtype, kwargs = STEP_CASES[case]
        torch.manual_seed(0)
        params = [torch.randn(33, 7, device=device).to(dtype).requires_grad_()]
        opt = cls(params, **kwargs)
        step = torch.compile(opt.step, fullgraph=True, backend="aot_eager") if compiled else opt.step
        g = torch.Generator().manual_seed(1)
        group = opt.param_groups[0]
        for i in range(12):
            params[0].grad = torch.randn(params[0].shape, generator=g).to(device=device, dtype=dtype)
            step()
            group["lr"] *= 0.9
            if cls in (mo.FusedAdam, mo.FusedAdamW, mo.FusedLion, mo.FusedLAMB):
                group["betas"] = (0.85 + 0.01 * i, 0.98 - 1e-3 * (i % 3))
            if cls is mo.FusedSGD:
                group["weight_decay"] = 1e-3 * (i + 2)
        return snapshot(opt, params)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = run(True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2
    assert_same(run(False), compiled)


def test_a_compiled_step_still_refuses_a_bad_scheduled_value(device):
    """The lr and betas reach the compiled operator as tensors whose values it does not read on the host; the
    step's own checks compare the traced numbers (guards), so a NaN lr or beta1 = 1 (bias correction 0: NaN
    params) still raises before anything is written, in the compiled step as in eager."""
    p = torch.randn(8, device=device).to(torch.float16).requires_grad_()
    opt = mo.FusedAdamW([p], lr=1e-2)
    step = torch.compile(opt.step, fullgraph=True, backend="aot_eager")
    for i in range(3):
        p.grad = torch.randn(8, device=device).to(torch.float16)
        step()
        opt.param_groups[0]["lr"] *= 0.5
    before = p.detach().clone()
    for key, bad in (("lr", float("nan")), ("lr", -1.0), ("betas", (1.0, 0.999))):
        good = opt.param_groups[0][key]
        opt.param_groups[0][key] = bad
        with pytest.raises(Exception, match="Invalid"):
            step()
        opt.param_groups[0][key] = good
        assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("case", ["adamw-fp16-masters", "lamb", "lion", "sgd-nesterov"])
def test_step_has_no_graph_break(device, case):
    cls, dtype, kwargs = STEP_CASES[case]
    p = torch.randn(10, device=device).to(dtype).requires_grad_()
    p.grad = torch.randn(10, device=device).to(dtype)
    opt = cls([p], **kwargs)
    opt.step()  # the state exists: the steady-state step
    assert graph_breaks(opt.step) == 0


# ---- a whole GradScaler iteration ----------------------------------------------------------------------
ITERATION_CASES = {
    # model dtype (None: FP32 weights under FP16 autocast), optimizer, clip
    "autocast-adamw-clip": (None, mo.FusedAdamW, dict(lr=1e-2), 1.0),
    "fp16-adamw-masters-clip": (torch.float16, mo.FusedAdamW, dict(lr=1e-2), 0.5),
    "fp16-sgd-noclip": (torch.float16, mo.FusedSGD, dict(lr=1e-2, momentum=0.9), None),
    "fp16-lamb-clip": (torch.float16, mo.FusedLAMB, dict(lr=1e-2), 1.0),
}
POISON = [1.0, 1.0, float("inf"), 1.0, 1.0, float("nan"), 1.0]  # two skipped steps, growth in between


def make_iteration(case, device):
    dtype, cls, kwargs, clip = ITERATION_CASES[case]
    torch.manual_seed(0)
    model = torch.nn.Sequential(FusedLinear(16, 32, activation="gelu"), FusedLinear(32, 4))
    if dtype is not None:
        model = model.to(dtype)
    model = model.to(device)
    opt = cls(model.parameters(), **kwargs)
    scaler = mpfused.GradScaler(device, init_scale=2.0**12, growth_interval=2)

    def iteration(x, y, poison):
        with torch.autocast(device, dtype=torch.float16, enabled=dtype is None):
            out = model(x if dtype is None else x.to(dtype))
        loss = (out.float() - y).square().mean() * poison
        scaler.scale(loss).backward()
        norm = scaler.clip_grad_norm_(opt, clip) if clip is not None else torch.zeros((), device=device)
        scaler.step(opt)
        scaler.update()
        return loss.detach(), norm

    return model, opt, scaler, iteration


def iteration_run(case, device, backend):
    model, opt, scaler, iteration = make_iteration(case, device)
    fn = iteration if backend is None else torch.compile(iteration, fullgraph=TRACES_BACKWARD, backend=backend)
    g = torch.Generator().manual_seed(2)
    losses, norms, scales = [], [], []
    for poison in POISON:
        x, y = torch.randn(8, 16, generator=g).to(device), torch.randn(8, 4, generator=g).to(device)
        opt.zero_grad(set_to_none=True)
        loss, norm = fn(x, y, torch.tensor(poison, device=device))
        losses.append(loss)
        norms.append(norm)
        scales.append(scaler.get_scale())
    params = list(model.parameters())
    return dict(state=snapshot(opt, params), losses=torch.stack(losses), norms=torch.stack(norms), scales=scales,
                scaler=scaler.state_dict(), skipped=scaler.skipped_steps)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", sorted(ITERATION_CASES))
def test_compiled_iteration_matches_eager(device, case, backend):
    """scale, backward, clip (the fused clip), step and update, compiled whole with fullgraph=True (backward
    in the graph: dynamo's trace_autograd_ops), over steps that overflow and steps that grow the scale. On a
    torch without trace_autograd_ops, compiled around backward() (test_iteration_has_no_graph_break: the only
    break)."""
    with backward_in_graph():
        eager = iteration_run(case, device, None)
        compiled = iteration_run(case, device, backend)
    assert eager["skipped"] == compiled["skipped"] == 2
    assert eager["scales"] == compiled["scales"] and eager["scaler"] == compiled["scaler"]
    assert len(set(eager["scales"])) > 1  # the scale backed off and grew
    assert_same(eager["state"], compiled["state"])
    assert torch.equal(bits(eager["norms"]), bits(compiled["norms"]))  # bits: NaN norms of skipped steps too
    if backend == "aot_eager":
        assert torch.equal(bits(eager["losses"]), bits(compiled["losses"]))


def _grads_in(kind: str, shapes, dtype, device, seed: int):
    """Grads that are views: of one flat buffer (DDP's gradient_as_bucket_view, Megatron's contiguous grad
    buffer), or transposed."""
    g = torch.Generator().manual_seed(seed)
    if kind == "bucket":
        buf = (torch.randn(sum(math.prod(s) for s in shapes), generator=g) * 4).to(device, dtype)
        out, at = [], 0
        for s in shapes:
            out.append(buf[at:at + math.prod(s)].view(s))
            at += math.prod(s)
        return out
    return [(torch.randn(s[::-1], generator=g) * 4).to(device, dtype).t() if len(s) == 2 else
            (torch.randn(s, generator=g) * 4).to(device, dtype) for s in shapes]


@pytest.mark.parametrize("mode", ["step", "clip-step", "unscale"])
@pytest.mark.parametrize("kind", ["bucket", "transposed"])
@pytest.mark.parametrize("cls", [mo.FusedAdamW, mo.FusedLAMB])
def test_grads_that_are_views_compile_as_in_eager(device, cls, kind, mode):
    """dynamo (torch 2.13) fails on stride() and storage_offset() of a ``.grad`` that is a view of part of a
    buffer, or transposed ("Cannot construct ConstantVariable for value of type SymInt"): a compiled step or
    scaler call raised for DDP's bucket-view grads, where eager ran (and torch's own compiled AdamW runs).
    Compiled with fullgraph=True, equal to eager bit for bit: params, masters, state, and the grads
    unscale_ writes."""
    shapes = [(5, 6), (10,)]

    def run(compiled):
        torch._dynamo.reset()
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s).to(device, torch.float16)) for s in shapes]
        opt = cls(params, lr=1e-2)
        scaler = mpfused.GradScaler(device, init_scale=4.0)

        def iteration():
            if mode == "step":
                opt.step()
            elif mode == "clip-step":
                norm = scaler.clip_grad_norm_(opt, 1.0)
                scaler.step(opt)
                scaler.update()
                return norm
            else:
                scaler.unscale_(opt)

        fn = torch.compile(iteration, backend="aot_eager", fullgraph=True) if compiled else iteration
        out = []
        for s in range(3):
            scaler.scale(torch.ones((), device=device))
            for p, g in zip(params, _grads_in(kind, shapes, torch.float16, device, s)):
                p.grad = g
            out.append(fn())
            if mode == "unscale":
                out.append([p.grad.clone() for p in params])
                scaler.step(opt)
                scaler.update()
        return snapshot(opt, params), out

    eager, compiled = run(False), run(True)
    assert_same(eager[0], compiled[0])
    for a, b in zip(eager[1], compiled[1]):
        for x, y in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
            assert (x is None and y is None) or torch.equal(bits(x), bits(y))


def test_iteration_has_no_graph_break(device):
    """None with trace_autograd_ops; on a torch without it, one: backward(), which dynamo does not trace there
    (the scaler's scale, clip, step and update, before and after it, break nothing). There explain() also
    counts the graphs of the layers' backward (torch 2.9.1: four graphs), which are not breaks: the check is
    on the reasons."""
    _, opt, _, iteration = make_iteration("fp16-adamw-masters-clip", device)
    x, y = torch.randn(8, 16, device=device), torch.randn(8, 4, device=device)
    with backward_in_graph():
        explained = torch._dynamo.explain(iteration)(x, y, torch.tensor(1.0, device=device))
    if TRACES_BACKWARD:
        assert explained.graph_break_count == 0
    else:
        assert len(explained.break_reasons) == 1, explained.break_reasons
        assert "Tensor.backward()" in explained.break_reasons[0].reason, explained.break_reasons


def test_a_disabled_scaler_iteration_compiles_whole(device):
    """A disabled scaler (amp's O0 and O3 make one) in the same loop: compiled with fullgraph=True and equal to
    eager. Its step() went through torch's GradScaler.step, which torch.compile does not trace. On a torch
    without trace_autograd_ops, backward() runs eagerly and step() and update() compile whole."""
    def run(compiled):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 3).to(device)
        opt = mo.FusedAdamW(model.parameters(), lr=1e-2)
        scaler = mpfused.GradScaler(device, enabled=False)

        def step():
            scaler.step(opt)
            scaler.update()

        def iteration(x):
            scaler.scale(model(x).square().mean()).backward()
            step()

        if compiled and TRACES_BACKWARD:
            fn = torch.compile(iteration, fullgraph=True, backend="aot_eager")
        elif compiled:
            compiled_step = torch.compile(step, fullgraph=True, backend="aot_eager")

            def fn(x):
                scaler.scale(model(x).square().mean()).backward()
                compiled_step()
        else:
            fn = iteration
        g = torch.Generator().manual_seed(3)
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            fn(torch.randn(4, 8, generator=g).to(device))
        return snapshot(opt, list(model.parameters()))

    with backward_in_graph():
        assert_same(run(False), run(True))


# ---- capturable: nothing on the host -------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(STEP_CASES))
def test_capturable_step_never_reads_a_device_value(device, case):
    """capturable=True: the step's counters, lr, betas and every scalar stay tensors; no value of any of
    them reaches the host (what a CUDA graph capture needs), from the second step on (the first builds the
    state, as with torch, whose capture also needs warm-up steps)."""
    cls, dtype, kwargs = STEP_CASES[case]
    p = torch.randn(20, device=device).to(dtype).requires_grad_()
    p.grad = torch.randn(20, device=device).to(dtype)
    kwargs = {k: (v.to(device) if isinstance(v, torch.Tensor) else
                  tuple(b.to(device) for b in v) if k == "betas" and isinstance(v[0], torch.Tensor) else v)
              for k, v in kwargs.items()}
    if cls in (mo.FusedAdam, mo.FusedAdamW):  # torch's Adam and AdamW have the flag (SGD has none)
        kwargs["capturable"] = True
    opt = cls([p], **kwargs)
    opt.step()
    with NoHostReads():
        opt.step()
        opt.step(scaling=mo.StepScaling(inv_scale=torch.full((1,), 0.5, device=device),
                                        found_inf=torch.zeros(1, device=device)))


def test_capturable_refuses_values_on_another_device():
    """A capturable step never copies a value between devices (a host-to-device copy cannot be captured):
    a value elsewhere is a ValueError naming it, before anything is written."""
    p = torch.randn(8).requires_grad_()
    p.grad = torch.randn(8)
    before = p.detach().clone()
    for kwargs, scaling, name in [
            (dict(lr=1e-2), None, "Invalid learning rate: a tensor lr must be on the CPU or on the params' CUDA device"),
            (dict(lr=1e-2, betas=(torch.tensor(0.9), torch.tensor(0.99))), None,
             r"Invalid beta parameter at index 1: .* must be on the CPU or on the params' CUDA device"),
            (dict(lr=1e-2), mo.StepScaling(found_inf=torch.zeros(1, device="meta")), "scaling.found_inf")]:
        opt = mo.FusedAdamW([p], capturable=True, **kwargs)
        if name.startswith("Invalid beta"):  # set later (the constructor checks the devices of its own)
            opt.param_groups[0]["betas"] = (torch.tensor(0.9), torch.tensor(0.99, device="meta"))
        if name.startswith("Invalid learning rate"):
            opt.param_groups[0]["lr"] = torch.tensor(1e-2, device="meta")
        message = name if name.startswith("Invalid") else f"capturable=True: {name} is on meta but the params are on cpu"
        with pytest.raises(ValueError, match=message):
            opt.step(scaling=scaling)
        assert torch.equal(p.detach(), before) and not opt.state[p]


def test_capturable_step_still_checks_its_values():
    """A capturable step reads no tensor on the host, yet a bad value never reaches the update: Python checks
    what needs no read (types, sizes, numbers), the operator the values it can read without a sync (tensors
    on the CPU), before anything is written (after the warm-up step, which builds the state)."""
    p = torch.randn(8).requires_grad_()
    p.grad = torch.randn(8)
    opt = mo.FusedAdam([p], capturable=True, betas=(torch.tensor(0.9), torch.tensor(0.99)))
    opt.step()
    before = snapshot(opt, [p])
    for key, value, message in [("betas", (torch.tensor(1.5), torch.tensor(0.99)), "invalid beta1: 1.5"),
                                ("eps", "1e-8", "Invalid epsilon value"),
                                ("lr", torch.tensor([1e-3, 1e-3]), "Tensor lr must be 1-element"),
                                ("lr", -1.0, "Invalid learning rate")]:
        good = opt.param_groups[0][key]
        opt.param_groups[0][key] = value
        with pytest.raises(ValueError, match=message):
            opt.step()
        opt.param_groups[0][key] = good
        assert_same(before, snapshot(opt, [p]))


@pytest.mark.parametrize("case", sorted(ITERATION_CASES))
def test_scaler_iteration_never_reads_a_device_value(device, case):
    _, opt, scaler, iteration = make_iteration(case, device)
    x, y = torch.randn(8, 16, device=device), torch.randn(8, 4, device=device)
    iteration(x, y, torch.tensor(1.0, device=device))  # warm-up: lazy scale and optimizer state
    # (the poison values go to the device first: a copy from pageable host memory is itself a synchronising
    # call, which CUDA's sync debug mode reports; the GPU run of 2026-11-27 met exactly that)
    poisons = [torch.tensor(v, device=device) for v in (1.0, float("inf"), 1.0)]
    with NoHostReads():
        for poison in poisons:
            opt.zero_grad(set_to_none=True)
            iteration(x, y, poison)
    assert scaler.skipped_steps == 1


# ---- CUDA graphs (GPU only) ----------------------------------------------------------------------------
@requires_cuda
@pytest.mark.parametrize("case", sorted(ITERATION_CASES))
def test_cuda_graph_replay_matches_eager(case):
    """A captured iteration (scale, backward, clip, step, update) replayed N times equals eager bit for
    bit, the skipped steps and the scale changes included."""
    def run(capture):
        _, opt, scaler, iteration = make_iteration(case, "cuda")
        model_params = [p for g in opt.param_groups for p in g["params"]]
        g = torch.Generator().manual_seed(3)
        data = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in POISON]
        static_x, static_y = torch.zeros(8, 16, device="cuda"), torch.zeros(8, 4, device="cuda")
        static_p = torch.ones((), device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: state, scale and scratch exist before the capture
            for _ in range(3):
                static_x.copy_(data[0][0])
                static_y.copy_(data[0][1])
                iteration(static_x, static_y, static_p)
        torch.cuda.current_stream().wait_stream(side)
        graph = None
        if capture:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = iteration(static_x, static_y, static_p)
        losses = []
        for (x, y), poison in zip(data, POISON):
            static_x.copy_(x)
            static_y.copy_(y)
            static_p.fill_(poison)
            if graph is not None:
                graph.replay()
                losses.append(out[0].clone())
            else:
                losses.append(iteration(static_x, static_y, static_p)[0])
        torch.cuda.synchronize()
        return snapshot(opt, model_params), torch.stack(losses), scaler.state_dict()

    eager, replayed = run(False), run(True)
    assert_same(eager[0], replayed[0])
    assert torch.equal(bits(eager[1]), bits(replayed[1]))
    assert eager[2] == replayed[2]
