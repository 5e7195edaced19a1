"""README.md's Python code blocks run as written (tests/readme_snippets.py finds them), on the CPU: each with a
preamble that makes what it takes as given, then a check of what its comments say it does."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mpfused
from dist_helpers import run_ranks
from readme_snippets import SNIPPETS, block, on_cpu, python_blocks
from tolerances import GELU_TOL, SUMSQ_RTOL


def run(code: str, **names) -> dict:
    """Runs a README block (its devices on the CPU) in a namespace holding torch, F, nn, mpfused and `names`;
    returns the namespace."""
    ns = {"torch": torch, "F": F, "nn": nn, "mpfused": mpfused, **names}
    exec(compile(on_cpu(code), "<README block>", "exec"), ns)  # noqa: S102 - the README's own code
    return ns


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batches(n=3, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g).to(dtype), torch.randn(16, 4, generator=g).to(dtype)) for _ in range(n)]


def test_every_readme_snippet_is_run():
    """A ```python block added to the README, moved to another section or removed: SNIPPETS must say where it runs."""
    found = set(python_blocks())
    assert found == set(SNIPPETS), (f"README blocks without a test: {sorted(found - set(SNIPPETS))}; "
                                    f"tested blocks no longer in the README: {sorted(set(SNIPPETS) - found)}")
    assert on_cpu('GradScaler("cuda"); init_device_mesh(\'cuda\', (2,)); x.cuda()') == \
        'GradScaler("cpu"); init_device_mesh(\'cpu\', (2,)); x.cuda()'


def test_quickstart():
    """One pass checks, unscales (as (t.float() * inv_scale).to(t.dtype), bit for bit) and sums the squares of
    FP32, FP16 and BF16 grads together."""
    g = torch.Generator().manual_seed(2)
    model = nn.ParameterList([nn.Parameter(torch.randn(n, generator=g).to(dt))
                              for n, dt in ((300, torch.float32), (200, torch.float16), (100, torch.bfloat16))])
    for p in model:
        p.grad = (torch.randn(p.shape, generator=g) * 1024).to(p.dtype)
    scaled = [p.grad.clone() for p in model]
    ns = run(block("Quickstart"), model=model)
    inv = ns["inv_scale"]
    for p, s in zip(model, scaled):
        assert torch.equal(p.grad, (s.float() * inv).to(s.dtype))
    exact = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model))
    assert ns["grad_norm"].item() == pytest.approx(exact, rel=SUMSQ_RTOL[torch.float32])
    assert ns["skip_step"].dtype == torch.bool and not ns["skip_step"].item()
    model[1].grad[7] = math.inf  # and the flag is raised by an inf in any of them
    ns = run(block("Quickstart"), model=model)
    assert ns["skip_step"].item()


def test_gradscaler():
    """The fused clip returns the unscaled global norm as a 0-d tensor (torch's clip_grad_norm_ of the unscaled
    grads), and the step updates the params."""
    model = mlp()
    x, y = batches(1)[0]
    loss = F.mse_loss(model(x), y)
    expect_grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    before = [p.detach().clone() for p in model.parameters()]
    ns = run(block("GradScaler"), model=model, loss=loss)
    norm = ns["norm"]
    assert norm.dim() == 0
    assert norm.item() == pytest.approx(torch.linalg.vector_norm(torch.cat([e.flatten() for e in expect_grads])).item(),
                                        rel=SUMSQ_RTOL[torch.float32])
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert ns["scaler"].get_scale() == 65536.0  # no overflow: the scale stays


def test_fused_optimizers():
    """FP16 params, torch's GradScaler: the fused step keeps FP32 masters and updates the FP16 copy."""
    model = mlp()
    ns = run(block("Fused optimizers"), model=model, data=batches(3, torch.float16), loss_fn=F.mse_loss)
    model, opt = ns["model"], ns["opt"]
    for p in model.parameters():
        assert p.dtype == torch.float16
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32 and torch.equal(master.half(), p.detach())
    # an FP16 backward at torch's initial scale (2^16) can overflow: each such step is skipped, its scale halved
    skipped = round(math.log2(65536.0 / ns["scaler"].get_scale()))
    assert int(opt.state[next(model.parameters())]["step"]) == 3 - skipped


def test_lamb_and_lion():
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16))
    decay = [model[0].weight]
    no_decay = [model[0].bias, *model[1].parameters()]
    ns = run(block("LAMB and Lion"), model=model, decay=decay, no_decay=no_decay)
    from mpfused.optim import FusedLAMB, FusedLion
    assert isinstance(ns["opt"], FusedLion) and ns["opt"].defaults["betas"] == (0.9, 0.99)
    lamb = FusedLAMB([dict(params=decay, weight_decay=0.01), dict(params=no_decay, weight_decay=0.0)], lr=2e-3)
    assert [g["weight_decay"] for g in lamb.param_groups] == [0.01, 0.0]
    model(torch.randn(4, 8)).square().sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    ns["opt"].step()
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_fewer_bytes_per_param():
    """The remainder keeps the FP32 master exactly in 2 bytes: (param bits << 16) + remainder; stochastic rounding
    keeps no master."""
    from mpfused.optim import FusedAdamW
    model = mlp()
    code = block("Fewer bytes per param: remainders and stochastic rounding").splitlines()
    ns = run(code[0] + "\n", model=model, FusedAdamW=FusedAdamW)
    reference = mlp().bfloat16()
    ref_opt = FusedAdamW(reference.parameters(), lr=1e-4, master_weights=True)
    for x, y in batches(3, torch.bfloat16):
        for m, o in ((model, ns["opt"]), (reference, ref_opt)):
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            o.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        rem = ns["opt"].state[p]["master_remainder"]
        assert rem.dtype == torch.int16
        bits = (p.detach().view(torch.int16).to(torch.int32) << 16) + rem.to(torch.int32)
        assert torch.equal(bits.view(torch.float32), ref_opt.state[q]["master_param"])
    ns = run("\n".join(code[1:]) + "\n", model=mlp(), FusedAdamW=FusedAdamW)
    x, y = batches(1, torch.bfloat16)[0]
    F.mse_loss(ns["model"](x), y).backward()
    ns["opt"].step()
    p = next(ns["model"].parameters())
    assert p.dtype == torch.bfloat16 and int(ns["opt"].state[p]["step"]) == 1
    assert not {"master_param", "master_remainder"} & set(ns["opt"].state[p])
    assert ns["opt"].param_groups[0]["rounding"] == "stochastic" and ns["opt"].param_groups[0]["seed"] == 1234


def test_amp_initialize():
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().float().clone() for p in model.parameters()]
    ns = run(block("Mixed precision in one call: `mpfused.amp`"), model=model, optimizer=optimizer,
             data=batches(3), loss_fn=F.mse_loss)
    model = ns["model"]
    assert model[0].weight.dtype == torch.float16 and model[1].weight.dtype == torch.float32  # O2: norms stay FP32
    assert ns["scaler"].is_enabled()
    assert all(not torch.equal(p.detach().float(), b) for p, b in zip(model.parameters(), before))


def test_gemm_and_fused_linear():
    g = torch.Generator().manual_seed(3)
    rand = lambda *s: torch.randint(-3, 4, s, generator=g).half()  # noqa: E731 - small integers: exact products
    a, b, bias, x, w = rand(32, 24), rand(24, 16), rand(16), rand(8, 24), rand(16, 24)
    model = mlp()
    ns = run(block("GEMM and FusedLinear"), a=a, b=b, bias=bias, x=x, w=w, model=model)
    assert ns["y"].dtype == torch.float32 and torch.equal(ns["y"], x.float() @ w.t().float())
    assert isinstance(ns["model"][0], mpfused.nn.FusedLinear) and ns["model"][0].weight is model[0].weight
    first = mpfused.gemm(a, b, bias=bias, activation="gelu")  # the block's first line (its y was overwritten)
    rtol, atol = GELU_TOL[torch.float16]
    assert first.dtype == torch.float16
    torch.testing.assert_close(first.float(), F.gelu(a.float() @ b.float() + bias.float(), approximate="tanh").half().float(),
                               rtol=rtol, atol=atol)  # "gelu" is the tanh form ("gelu_erf" the other)


def test_stochastic_rounding():
    g = torch.Generator().manual_seed(4)
    x, k = torch.randn(1000, generator=g), 123
    buf = torch.empty(1000, dtype=torch.float16)
    ns = run(block("Stochastic rounding"), x=x, k=k, buf=buf)
    y, part = ns["y"], ns["part"]
    assert y.dtype == torch.bfloat16 and torch.equal(part.view(torch.int16), y[k:].view(torch.int16))
    assert bool(((y.float() - x).abs() < x.abs() * 2.0**-7).all())  # one of x's two BF16 neighbours
    assert torch.equal(buf.view(torch.int16), mpfused.round_stochastic(x, torch.float16, seed=7).view(torch.int16))


def test_fixed_point():
    g = torch.Generator().manual_seed(5)
    x = torch.rand(64, generator=g) * 3 - 1.5
    from mpfused import fixed_point as fxp
    a_codes = fxp.encode(torch.rand(8, 16, generator=g) - 0.5, 2, 14)
    b_codes = fxp.encode(torch.rand(16, 4, generator=g) - 0.5, 2, 14)
    ns = run(block("Fixed point (Gupta et al. 2015)"), x=x, a_codes=a_codes, b_codes=b_codes)
    q, c, x2, y = ns["q"], ns["c"], ns["x2"], ns["y"]
    step = 2.0**-14
    assert q.dtype == torch.float32 and torch.equal(q, torch.round(q / step) * step)
    assert c.dtype == torch.int16 and torch.equal(x2, c.to(torch.float32) * step)
    exact = (a_codes.double() * step) @ (b_codes.double() * step)
    assert y.dtype == torch.int16 and bool(((y.double() * 2.0**-8 - exact).abs() < 2.0**-8).all())


def test_torch_compile(monkeypatch):
    """The block's three compiled objects run with fullgraph=True (a graph break raises): on aot_eager here
    (inductor's code generation would take most of a minute; tests/test_compile.py runs both backends)."""
    if not hasattr(torch._dynamo.config, "trace_autograd_ops"):
        pytest.skip(f"torch {torch.__version__} has no torch._dynamo.config.trace_autograd_ops, which the block "
                    "sets (README: leave it and fullgraph=True out there; tests/test_compile.py runs that case)")
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *a, **kw: compile_(*a, **{"backend": "aot_eager", **kw}))
    monkeypatch.setattr(torch._dynamo.config, "trace_autograd_ops", torch._dynamo.config.trace_autograd_ops)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(mpfused.nn.FusedLinear(8, 16), nn.ReLU(), mpfused.nn.FusedLinear(16, 4))
    opt = mpfused.optim.FusedAdamW(model.parameters(), lr=1e-3)
    scaler = mpfused.GradScaler("cpu")
    try:
        ns = run(block("torch.compile, CUDA graphs, torch operators"), model=model, opt=opt, scaler=scaler,
                 loss_fn=F.mse_loss)
        before = [p.detach().clone() for p in model.parameters()]
        for x, y in batches(2):
            opt.zero_grad(set_to_none=True)
            loss, norm = ns["iteration"](x, y)
            assert math.isfinite(loss.item()) and norm.dim() == 0 and math.isfinite(norm.item())
        assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
        ns["step"]()  # the compiled step alone
    finally:
        torch._dynamo.reset()


def _fsdp2_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            for b in self.blocks:
                x = torch.relu(b(x))
            return x

    torch.manual_seed(0)
    model = Model()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    names = {"init_device_mesh": init_device_mesh, "MixedPrecisionPolicy": MixedPrecisionPolicy,
             "fully_shard": fully_shard, "world_size": world, "model": model}
    # The block in three parts: the sharding and the optimizer; the loss (which the block takes as given) and its
    # backward; the fused clip, the step and the update. Between the last two, the whole model's grad norm from the
    # sharded grads (gathered), for the check.
    code = block("Distributed training")
    head, rest = code.split("scaler.scale(loss)", 1)
    backward, tail = ("scaler.scale(loss)" + rest).split("norm = ", 1)
    ns = run(head, **names)
    keep = {k: v for k, v in ns.items() if k not in ("torch", "F", "nn", "mpfused", "__builtins__")}
    ns = run(backward, loss=model(x).float().square().mean(), **keep)
    scale = ns["scaler"].get_scale()
    full = [p.grad.full_tensor().double() for p in model.parameters()]
    expect = math.sqrt(sum(float(g.square().sum()) for g in full)) / scale
    ns = run("norm = " + tail, **{k: v for k, v in ns.items() if k not in ("torch", "F", "nn", "mpfused", "__builtins__")})
    return (type(ns["norm"]) is torch.Tensor, ns["norm"].dim(), ns["norm"].item(), expect,
            all(isinstance(p, DTensor) and isinstance(p.grad, DTensor) for p in model.parameters()))


def test_fsdp2():
    """The FSDP2 block on two gloo ranks: the norm is a plain 0-d tensor, the whole model's grad norm (of the
    unscaled grads, gathered from every shard), the same on every rank; params and grads are DTensors."""
    results = run_ranks(_fsdp2_rank, 2)
    for plain, dim, norm, expect, dtensors in results:
        assert plain and dim == 0 and dtensors
        assert norm == pytest.approx(expect, rel=SUMSQ_RTOL[torch.float32])
    assert results[0][2] == results[1][2]
