"""PyTorch's GradScaler test suite (test/test_torch.py test_grad_scaling_*, test/test_cuda.py), rewritten
in our own words and run against both torch.amp.GradScaler and mpfused.GradScaler, with torch's
optimizers (SGD, Adam, AdamW: for-loop, foreach, fused) and ours (FusedSGD, FusedAdam, FusedAdamW).

Every case must pass for both scalers; where mpfused deliberately differs from torch, a test pins
mpfused's behaviour and says why. The scaled training runs follow torch's recipe: a control model
trained without scaling (skipping the step by hand where the scaled run sees an inf) against the same
model trained through the scaler, compared parameter by parameter and state by state.
"""

import functools
import pickle

import pytest
import torch

import mpfused
from mpfused.optim import FusedAdam, FusedAdamW, FusedSGD
from conftest import requires_cuda
from tolerances import SCALED_CLIP_RUN_ATOL, SCALED_RUN_ATOL, SCALED_RUN_RTOL

SCALERS = {"torch": torch.amp.GradScaler, "mpfused": mpfused.GradScaler}

# (name, constructor, extra kwargs); lr=1.0 as in torch's cases, to magnify any difference.
OPTIMIZERS = [
    ("SGD", torch.optim.SGD, {}),
    ("SGD-foreach", torch.optim.SGD, {"foreach": True}),
    ("SGD-fused", torch.optim.SGD, {"fused": True}),
    ("Adam", torch.optim.Adam, {}),
    ("Adam-foreach", torch.optim.Adam, {"foreach": True}),
    ("Adam-fused", torch.optim.Adam, {"fused": True}),
    ("AdamW", torch.optim.AdamW, {}),
    ("AdamW-foreach", torch.optim.AdamW, {"foreach": True}),
    ("AdamW-fused", torch.optim.AdamW, {"fused": True}),
    ("mpfused.FusedSGD", FusedSGD, {}),
    ("mpfused.FusedAdam", FusedAdam, {}),
    ("mpfused.FusedAdamW", FusedAdamW, {}),
]
OPT_IDS = [name for name, _, _ in OPTIMIZERS]


@pytest.fixture(params=list(SCALERS))
def scaler_cls(request, device):
    return functools.partial(SCALERS[request.param], device)


@pytest.fixture(params=OPTIMIZERS, ids=OPT_IDS)
def optimizer(request):
    _, ctor, kwargs = request.param
    return ctor, kwargs


def make_models(device, ctor, kwargs, seed=0):
    torch.manual_seed(seed)
    control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(device)
    scaling = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(device)
    with torch.no_grad():
        for c, s in zip(control.parameters(), scaling.parameters()):
            s.copy_(c)
    kw = {"lr": 1.0, **kwargs}
    return control, scaling, ctor(control.parameters(), **kw), ctor(scaling.parameters(), **kw)


def make_data(device, n=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 8, generator=g).to(device), torch.randn(8, 8, generator=g).to(device)) for _ in range(n)]


SKIP_ITER = 2


def check_case(device, scaler_cls, optimizer, run, unskipped, skipped, atol=SCALED_RUN_ATOL, compare_grads=True,
               fused_grads=False):
    """torch's _run_scaling_case: enabled and disabled scalers; the scale's trajectory, then grads,
    optimizer state and params of the scaled run against the control run."""
    ctor, kwargs = optimizer
    for enabled in (True, False):
        control, scaling, opt_c, opt_s = make_models(device, ctor, kwargs)
        data = make_data(device)
        loss_fn = torch.nn.MSELoss()
        scaler = scaler_cls(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)
        run(data, control, opt_c, scaler, loss_fn, False)
        run(data, scaling, opt_s, scaler, loss_fn, True)
        if enabled:
            assert scaler.get_scale() == 128.0 * 2.0**unskipped * 0.5**skipped
        else:
            assert scaler.get_scale() == 1.0
        fused_ours = isinstance(opt_s, mpfused.optim._base.FusedOptimizer)
        for c, s in zip(control.parameters(), scaling.parameters()):
            # mpfused's fused optimizers unscale inside the update; the grads they leave are checked by
            # test_fused_optimizers_leave_unscaled_grads below.
            if compare_grads and (fused_grads or not (fused_ours and enabled)):
                torch.testing.assert_close(s.grad, c.grad, atol=atol, rtol=SCALED_RUN_RTOL)
            for k, v in opt_c.state[c].items():
                torch.testing.assert_close(opt_s.state[s][k], v, atol=atol, rtol=SCALED_RUN_RTOL, msg=k)
            torch.testing.assert_close(s, c, atol=atol, rtol=SCALED_RUN_RTOL)


def inject_inf(i, scaler, model):
    if i == SKIP_ITER and scaler.is_enabled():
        with torch.no_grad():
            model[1].weight.grad.fill_(float("inf"))


def control_steps(i, scaler):
    return not scaler.is_enabled() or i != SKIP_ITER


# ---- training cases ---------------------------------------------------------------------------------
def plain_loss(model, x, y, loss_fn, scaler, scaled):
    return loss_fn(model(x), y)


def inject_hook(i, model, opt, scaler, scaled):
    if scaled:
        inject_inf(i, scaler, model)


def make_run(loss_of=plain_loss, hook=inject_hook):
    """A training run as torch's cases write it: ``hook`` runs between backward and step (clipping, the
    injected inf); the control run skips its step by hand where the scaled one sees the inf."""
    def run(data, model, opt, scaler, loss_fn, scaled):
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            loss = loss_of(model, x, y, loss_fn, scaler, scaled)
            (scaler.scale(loss) if scaled else loss).backward()
            hook(i, model, opt, scaler, scaled)
            if scaled:
                scaler.step(opt)
                scaler.update()
            elif control_steps(i, scaler):
                opt.step()
    return run


run_plain = make_run()


def test_scaling_default(device, scaler_cls, optimizer):
    check_case(device, scaler_cls, optimizer, run_plain, unskipped=3, skipped=1)


def test_scaling_autocast(device, scaler_cls, optimizer):
    dtype = torch.bfloat16 if device == "cpu" else torch.float16

    def autocast_loss(model, x, y, loss_fn, scaler, scaled):
        with torch.autocast(device, dtype=dtype):
            out = model(x)
        return loss_fn(out.float(), y)

    # the control run autocasts too, so both see the same low-precision forward; the scale is a power
    # of two, so scaling and unscaling are exact
    check_case(device, scaler_cls, optimizer, make_run(loss_of=autocast_loss), unskipped=3, skipped=1,
               atol=SCALED_CLIP_RUN_ATOL)


MAX_NORM = 0.2


def test_scaling_clipping(device, scaler_cls, optimizer):
    def clip_scaled(i, model, opt, scaler, scaled):
        # the scaled grads clipped to max_norm times the scale, then the inf
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM * (scaler.get_scale() if scaled else 1.0))
        inject_hook(i, model, opt, scaler, scaled)

    check_case(device, scaler_cls, optimizer, make_run(hook=clip_scaled), unskipped=3, skipped=1,
               atol=SCALED_CLIP_RUN_ATOL)


def test_scaling_clipping_separate_unscale(device, scaler_cls, optimizer):
    def unscale_then_clip(i, model, opt, scaler, scaled):
        if scaled:
            inject_inf(i, scaler, model)
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, error_if_nonfinite=False)

    check_case(device, scaler_cls, optimizer, make_run(hook=unscale_then_clip), unskipped=3, skipped=1,
               atol=SCALED_CLIP_RUN_ATOL)


def test_scaling_penalty(device, scaler_cls, optimizer):
    def penalized_loss(model, x, y, loss_fn, scaler, scaled):
        # a gradient penalty: autograd.grad of the scaled loss, unscaled by hand, as torch's case does
        loss = loss_fn(model(x), y)
        grads = torch.autograd.grad(scaler.scale(loss) if scaled else loss, list(model.parameters()),
                                    create_graph=True)
        inv = 1.0 / scaler.get_scale() if scaled else 1.0
        return loss + sum((g * inv).pow(2).sum() for g in grads).sqrt()

    check_case(device, scaler_cls, optimizer, make_run(loss_of=penalized_loss), unskipped=3, skipped=1,
               atol=SCALED_CLIP_RUN_ATOL)


def test_scaling_accumulation(device, scaler_cls, optimizer):
    every = 2

    def run(data, model, opt, scaler, loss_fn, scaled):
        for i, (x, y) in enumerate(data):
            loss = loss_fn(model(x), y) / every
            if scaled:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if (i + 1) % every == 0:
                if scaled:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                opt.zero_grad()

    check_case(device, scaler_cls, optimizer, run, unskipped=2, skipped=0, compare_grads=False)


def test_scaling_multiple_models_optimizers_losses(device, scaler_cls, optimizer):
    """Two models, two optimizers, two losses that each depend on both models; only the second optimizer
    sees the inf, so only it skips, but the scale backs off once for the iteration."""
    ctor, kwargs = optimizer
    for enabled in (True, False):
        c0, s0, oc0, os0 = make_models(device, ctor, kwargs, seed=0)
        c1, s1, oc1, os1 = make_models(device, ctor, kwargs, seed=3)
        scaler = scaler_cls(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)
        loss_fn = torch.nn.MSELoss()
        for models, opts, scaled in (((c0, c1), (oc0, oc1), False), ((s0, s1), (os0, os1), True)):
            for i, (x, y) in enumerate(make_data(device)):
                for o in opts:
                    o.zero_grad()
                a, b = models[0](x), models[1](x)
                losses = [loss_fn(0.3 * a + 0.7 * b, y), loss_fn(0.6 * a - 0.4 * b, y)]
                if scaled:
                    scaler.scale(losses[0]).backward(retain_graph=True)
                    scaler.scale(losses[1]).backward()
                    inject_inf(i, scaler, models[1])
                    scaler.step(opts[0])
                    scaler.step(opts[1])
                    scaler.update()
                else:
                    losses[0].backward(retain_graph=True)
                    losses[1].backward()
                    opts[0].step()
                    if control_steps(i, scaler):
                        opts[1].step()
        assert scaler.get_scale() == (128.0 * 2.0**3 * 0.5 if enabled else 1.0)
        for c, s in zip([*c0.parameters(), *c1.parameters()], [*s0.parameters(), *s1.parameters()]):
            torch.testing.assert_close(s, c, atol=SCALED_RUN_ATOL, rtol=SCALED_RUN_RTOL)


@pytest.mark.parametrize("ctor", [FusedSGD, FusedAdam, FusedAdamW], ids=lambda c: c.__name__)
def test_fused_optimizers_leave_unscaled_grads(device, ctor):
    check_case(device, functools.partial(mpfused.GradScaler, device), (ctor, {}), run_plain, unskipped=3, skipped=1,
               fused_grads=True)


# ---- scale, unscale, update, state ------------------------------------------------------------------
def test_scale_keeps_shape_dtype_and_nesting(device, scaler_cls):
    scaler = scaler_cls(init_scale=2.0)
    t0 = torch.tensor(4.0, device=device)
    out = scaler.scale(t0)
    assert out.shape == () and out.dtype == torch.float32 and out.item() == 8.0
    half = scaler.scale(torch.full((3,), 4.0, device=device, dtype=torch.float16))
    assert half.dtype == torch.float16 and half.tolist() == [8.0] * 3
    nested = scaler.scale([t0, (t0, t0), [t0]])
    assert isinstance(nested[1], tuple) and isinstance(nested[2], list)
    assert nested[1][1].item() == 8.0 and nested[2][0].item() == 8.0
    assert scaler._scale.shape == () and scaler._scale.dtype == torch.float32
    assert scaler._growth_tracker.shape == () and scaler._growth_tracker.dtype == torch.int32
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        scaler.scale(1.0)
    assert not scaler_cls(enabled=False).is_enabled()


def test_unscale_grads_records_found_inf_per_device(device, scaler_cls):
    scaler = scaler_cls(init_scale=4.0)
    scaler.scale(torch.ones((), device=device))
    ps = [torch.nn.Parameter(torch.zeros(5, device=device, dtype=dt)) for dt in (torch.float32, torch.float64)]
    opt = torch.optim.SGD(ps, lr=0.0)
    for bad in (False, True):
        for p in ps:
            p.grad = torch.full_like(p, 4.0)
        if bad:
            ps[1].grad[2] = float("nan")
        inv = torch.full((), 0.25, device=device)
        found = scaler._unscale_grads_(opt, inv, torch.zeros((), device=device), True)
        assert set(found) == {ps[0].device}
        assert found[ps[0].device].item() == float(bad)
        assert ps[0].grad.tolist() == [1.0] * 5 and ps[1].grad[0].item() == 1.0


def test_unscale_sparse_grads(device, scaler_cls):
    scaler = scaler_cls(init_scale=4.0)
    scaler.scale(torch.ones((), device=device))
    p = torch.nn.Parameter(torch.zeros(4, 3, device=device))
    opt = torch.optim.SGD([p], lr=1.0)
    i = torch.tensor([[0, 2, 2]], device=device)
    v = torch.full((3, 3), 8.0, device=device)
    for bad in (False, True):
        if bad:
            v[1, 1] = float("inf")
        p.grad = torch.sparse_coo_tensor(i, v.clone(), (4, 3), check_invariants=True)
        found = scaler._unscale_grads_(opt, torch.full((), 0.25, device=device), torch.zeros((), device=device), False)
        assert found[p.device].item() == float(bad)
        if not bad:
            assert p.grad._values().tolist() == [[2.0] * 3] * 3
    # FP16: duplicates that overflow only once added are found, on the coalesced values
    p16 = torch.nn.Parameter(torch.zeros(4, 3, device=device, dtype=torch.float16))
    opt16 = torch.optim.SGD([p16], lr=1.0)
    p16.grad = torch.sparse_coo_tensor(i, torch.full((3, 3), 6.4e4, device=device, dtype=torch.float16), (4, 3), check_invariants=True)
    found = scaler._unscale_grads_(opt16, torch.full((), 1.0, device=device), torch.zeros((), device=device), True)
    assert found[p16.device].item() == 1.0 and p16.grad.is_coalesced()
    # without duplicates the same values are finite
    p16.grad = torch.sparse_coo_tensor(torch.tensor([[0, 1]], device=device),
                                       torch.full((2, 3), 6.4e4, device=device, dtype=torch.float16), (4, 3),
                                       check_invariants=True)
    found = scaler._unscale_grads_(opt16, torch.full((), 1.0, device=device), torch.zeros((), device=device), True)
    assert found[p16.device].item() == 0.0


def test_sparse_embedding_training_matches_torch(device):
    results = []
    for cls in SCALERS.values():
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 4, sparse=True).to(device)
        opt = torch.optim.SGD(emb.parameters(), lr=0.5)
        scaler = cls(device, init_scale=64.0, growth_interval=1)
        for it in range(4):
            opt.zero_grad()
            loss = emb(torch.tensor([1, 3, 3, 7], device=device)).pow(2).sum() * (float("inf") if it == 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        results.append((emb.weight.detach().clone(), scaler.get_scale()))
    assert results[0][1] == results[1][1] == 64.0 * 2 * 2 / 2 * 2
    assert torch.equal(results[0][0], results[1][0])


def test_unscale_fp16_grads_torch_rejects_mpfused_accepts(device, scaler_cls):
    """Deliberate difference: torch's unscale_ raises on FP16 gradients; mpfused's accepts them, because
    O2/O3 training (FP16 params) has FP16 gradients. _unscale_grads_(allow_fp16=False) still raises."""
    scaler = scaler_cls(init_scale=4.0)
    p = torch.nn.Parameter(torch.ones(3, device=device, dtype=torch.float16))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler.scale(p.float().sum()).backward()
    if isinstance(scaler, mpfused.GradScaler):
        scaler.unscale_(opt)
        assert p.grad.tolist() == [1.0] * 3
    else:
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
            scaler.unscale_(opt)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        scaler._unscale_grads_(opt, torch.ones((), device=device), torch.zeros((), device=device), False)


@pytest.mark.parametrize("init_scale, pattern, expected", [
    (2.0, [1, 1, 1, 0, 0, 0], [1.0, 0.5, 0.25, 0.25, 0.5, 0.5]),  # below 1, no clamp
    (2.0**32, [0, 0, 1], [2.0**32, 2.0**33, 2.0**32]),
    (1e38, [0, 0, 0, 0], [1e38, 2e38, 2e38, 2e38]),  # 4e38 is not a finite float32: the scale is kept
    (0.5, [0, 0], [0.5, 1.0]),
])
def test_update_scale_defaults_follow_torch(device, scaler_cls, init_scale, pattern, expected):
    scaler = scaler_cls(init_scale=init_scale, growth_interval=2)
    p = torch.nn.Parameter(torch.ones(2, device=device))
    opt = torch.optim.SGD([p], lr=0.0)
    scales = []
    for bad in pattern:
        opt.zero_grad()
        scaler.scale((p * (float("inf") if bad else 1.0)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales == [float(torch.tensor(e, dtype=torch.float32)) for e in expected]


def test_update_with_new_scale(device, scaler_cls):
    scaler = scaler_cls(init_scale=8.0)
    scaler.scale(torch.ones((), device=device))
    scaler.update(4.0)
    assert scaler.get_scale() == 4.0
    scaler.update(torch.tensor(2.0, device=device))  # 0-d like the scale (torch cannot copy a (1,) into it)
    assert scaler.get_scale() == 2.0
    with pytest.raises(AssertionError, match="new_scale should be a float"):
        scaler.update(torch.tensor([2.0, 3.0], device=device))
    with pytest.raises(AssertionError, match="new_scale should be a float"):
        scaler.update(torch.tensor([2.0], device=device, requires_grad=True))


@pytest.mark.parametrize("kwargs, message", [
    (dict(growth_factor=1.0), "The growth factor must be > 1.0."),
    (dict(growth_factor=0.5), "The growth factor must be > 1.0."),
    (dict(backoff_factor=1.0), "The backoff factor must be < 1.0."),
    (dict(backoff_factor=2.0), "The backoff factor must be < 1.0."),
])
def test_constructor_factor_checks(scaler_cls, kwargs, message):
    with pytest.raises(AssertionError, match=message):
        scaler_cls(**kwargs)
    scaler_cls(enabled=False, **kwargs)  # a disabled scaler checks nothing, as in torch


@pytest.mark.parametrize("lazy_init", [False, True])
@pytest.mark.parametrize("src, dst", [("torch", "torch"), ("torch", "mpfused"), ("mpfused", "torch"), ("mpfused", "mpfused")])
def test_state_dict(device, lazy_init, src, dst):
    s0 = SCALERS[src](device, init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = SCALERS[dst](device, init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    s1._init_growth_tracker = 7  # as torch's case: a loaded tracker replaces it
    if lazy_init:
        s1.scale(torch.full((1,), 4.0, device=device))
        s0.scale(torch.full((1,), 4.0, device=device))
    s1.load_state_dict(s0.state_dict())
    assert s1.get_scale() == 3.0 and s1.get_growth_factor() == 4.0 and s1.get_backoff_factor() == 0.5
    assert s1.get_growth_interval() == 2 and s1._init_growth_tracker == 0
    # the loaded scaler trains on: two clean steps grow the scale once
    p = torch.nn.Parameter(torch.ones(2, device=device))
    opt = torch.optim.SGD([p], lr=0.0)
    for _ in range(2):
        opt.zero_grad()
        s1.scale(p.sum()).backward()
        s1.step(opt)
        s1.update()
    assert s1.get_scale() == 12.0 and s1._get_growth_tracker() == 0


def test_pickle_between_iterations_only(device, scaler_cls):
    scaler = scaler_cls(init_scale=16.0, growth_interval=3)
    p = torch.nn.Parameter(torch.ones(2, device=device))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler.scale(p.sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(AssertionError, match="may only be pickled"):
        pickle.dumps(scaler)
    scaler.step(opt)
    scaler.update()
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone._scale is None and clone.get_scale() == 16.0 and clone._get_growth_tracker() == 1
    assert type(clone) is type(scaler)
    clone.scale(torch.ones((), device=device))
    assert clone.get_scale() == 16.0 and clone._growth_tracker.item() == 1


@pytest.mark.parametrize("opt_ctor", [torch.optim.SGD, FusedSGD], ids=["SGD", "mpfused.FusedSGD"])
def test_step_before_scale_and_misuse(device, scaler_cls, opt_ctor):
    scaler = scaler_cls()
    p = torch.nn.Parameter(torch.ones(2, device=device))
    p.grad = torch.ones_like(p)
    opt = opt_ctor([p], lr=0.0)
    with pytest.raises(AssertionError, match="Attempted step but _scale is None"):
        scaler.step(opt)
    scaler.scale(p.sum())
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        scaler.step(opt, closure=lambda: 0.0)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) is being called after step\\(\\)"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called since the last update\\(\\)"):
        scaler.step(opt)
    scaler.update()
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update."):
        scaler.update()


def test_params_invalidated_between_unscale_and_step(device, scaler_cls, optimizer):
    """found_inf is recorded by unscale_: grads broken afterwards are stepped with (torch's semantics)."""
    ctor, kwargs = optimizer
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4).to(device)
    opt = ctor(model.parameters(), lr=1.0, **kwargs)
    scaler = scaler_cls(init_scale=128.0)
    x = torch.randn(3, 4, device=device)
    opt.zero_grad()
    scaler.scale(model(x).pow(2).mean()).backward()
    scaler.unscale_(opt)
    for j, p in enumerate(model.parameters()):
        p.grad.fill_(float("inf") if j % 2 else float("nan"))
    scaler.step(opt)
    scaler.update()
    assert all(not torch.isfinite(p).all() for p in model.parameters())
    assert scaler.get_scale() == 128.0


def test_device_as_key_dedupes(device, scaler_cls):
    """Different torch.device objects naming the same device are one key of found_inf_per_device."""
    scaler = scaler_cls(init_scale=2.0)
    scaler.scale(torch.ones((), device=device))
    dev = torch.device(device, 0) if device == "cuda" else torch.device(device)
    ps = [torch.nn.Parameter(torch.ones(2, device=d)) for d in (device, dev, torch.device(dev))]
    for p in ps:
        p.grad = torch.ones_like(p)
    opt = torch.optim.SGD(ps, lr=0.0)
    scaler.unscale_(opt)
    assert len(scaler._found_inf_per_device(opt)) == 1


@requires_cuda
@pytest.mark.cuda
def test_grads_on_two_devices():
    """Grads on the CPU and on CUDA: each device's found_inf recorded; an inf on one skips the step.
    (Ours only. torch.amp.GradScaler copies found_inf and the inverse scale to the CPU with non_blocking=True
    and runs its CPU kernel at once, so the copy of the zero flag can land after the kernel set it: on the
    H200 run of 2026-11-27 (torch 2.11) it took this step, a == 0.)"""
    scaler = mpfused.GradScaler("cuda", init_scale=4.0)
    a = torch.nn.Parameter(torch.ones(3, device="cuda"))
    b = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([a, b], lr=1.0)
    scaler.scale(torch.ones((), device="cuda"))
    a.grad, b.grad = torch.full_like(a, 4.0), torch.full_like(b, float("inf"))
    scaler.step(opt)
    scaler.update()
    assert a.tolist() == [1.0] * 3 and scaler.get_scale() == 2.0
