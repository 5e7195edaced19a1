"""FusedLion against a float64 reference (written here from the formulas), sign(0), its one state tensor,
GradScaler interop (skip on inf, torch.amp.GradScaler), state dicts and bad input."""

import copy

import pytest
import torch

import mpfused
from mpfused.optim import FusedLion, FusedOptimizer
from optim_helpers import assert_same, fp32_weight, rounded, snapshot
from tolerances import LION_DIRECTION_ERROR_PER_STEP, LION_WEIGHT_RTOL_PER_STEP

SHAPES = [(16, 12), (12,), (7, 5), (30,)]  # params 0, 1 in group 0; 2, 3 in group 1
GROUPS = [dict(lr=0.01, weight_decay=0.5, betas=(0.9, 0.99)),
          dict(lr=0.003, weight_decay=0.0, betas=(0.8, 0.95))]
DEFAULTS = dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False)
STEPS = 8
LOWP = [torch.float16, torch.bfloat16]
DTYPES = [torch.float32] + LOWP


def lion_reference(init, grads, groups=GROUPS, **kw):
    """Lion in float64. Returns the final params and momenta, G (the largest |g| of the run) and the
    smallest |c| / G: how far the direction whose sign is taken stayed from 0."""
    params = [t.detach().double().cpu() for t in init]
    hyper = [dict(DEFAULTS, **kw, **g) for g in groups]
    m = [torch.zeros_like(p) for p in params]
    grads = [[g.double().cpu() for g in gs] for gs in grads]
    big = max(float(g.abs().max()) for gs in grads for g in gs if g.numel())
    c_min = float("inf")
    for gs in grads:
        for i, (p, g) in enumerate(zip(params, gs)):
            h = hyper[0 if i < 2 else 1]
            b1, b2 = h["betas"]
            if h["maximize"]:
                g = -g
            c = b1 * m[i] + (1 - b1) * g
            if c.numel():
                c_min = min(c_min, float(c.abs().min()) / big)
            p.mul_(1 - h["lr"] * h["weight_decay"]).sub_(h["lr"] * torch.sign(c))
            m[i] = b2 * m[i] + (1 - b2) * g
    return params, m, big, c_min


def make_data(steps=STEPS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(steps)]
    return init, grads


def split(params, groups=GROUPS):
    return [dict(params=params[:2], **groups[0]), dict(params=params[2:], **groups[1])]


def fused_run(device, dtype, init, grads, groups=GROUPS, **kw):
    params = [torch.nn.Parameter(t.to(device, dtype, copy=True)) for t in init]
    opt = FusedLion(split(params, groups), **kw)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.to(device, dtype)
        opt.step()
    return params, opt


def tolerance(init_value, steps):
    """LION_WEIGHT_RTOL_PER_STEP per step of P, the largest |p| the run can reach."""
    lr = max(g["lr"] for g in GROUPS)
    return steps * LION_WEIGHT_RTOL_PER_STEP * (float(init_value.abs().max()) + steps * lr)


def assert_matches_reference(params, opt, init, reference, steps):
    ref, ref_m, big, c_min = reference
    # Every sign the reference took is one FP32 takes too (see tolerances.py): the comparison is meaningful.
    assert c_min > steps * LION_DIRECTION_ERROR_PER_STEP
    for p, p0, r, m in zip(params, init, ref, ref_m):
        if p.numel() == 0:
            continue
        w = fp32_weight(opt, p)
        assert w.dtype == torch.float32
        if p.dtype != torch.float32:
            assert torch.equal(p.detach(), w.to(p.dtype)), "the param must be its master rounded"
        torch.testing.assert_close(w.double().cpu(), r, rtol=0, atol=tolerance(p0, steps))
        # The momentum (the weights only see its sign): 5 roundings of at most G per step.
        torch.testing.assert_close(opt.state[p]["exp_avg"].double().cpu(), m, rtol=0,
                                   atol=steps * LION_DIRECTION_ERROR_PER_STEP * big)


# ---- against the float64 reference ---------------------------------------------------------------------
VARIANTS = {  # (groups, keyword arguments)
    "default": (GROUPS, {}),  # group 0 with weight decay, group 1 without
    "maximize": (GROUPS, dict(maximize=True)),
    "decay-everywhere": ([GROUPS[0], dict(GROUPS[1], weight_decay=0.2)], {}),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_float64_reference_two_groups(device, dtype, variant):
    groups, kw = VARIANTS[variant]
    init, grads = make_data()
    init, grads = rounded(init, dtype), [rounded(gs, dtype) for gs in grads]
    params, opt = fused_run(device, dtype, init, grads, groups, **kw)
    ref = lion_reference(init, grads, groups, **kw)
    assert_matches_reference(params, opt, init, ref, STEPS)
    if variant != "default":  # the variant changes the result by far more than the tolerance
        default = lion_reference(init, grads)[0]
        assert max(float((a - b).abs().max()) for a, b in zip(ref[0], default)) > 100 * tolerance(init[0], STEPS)


def test_sign_of_zero_is_zero(device):
    # First step: m = 0, so c = (1 - beta1) * g, and exactly 0 where g is 0: those elements only decay.
    p = torch.nn.Parameter(torch.arange(8.0, device=device) / 4 - 1)  # p -+ lr is exact
    p.grad = torch.tensor([0.5, 0.0, -2.0, 0.0, 1e-30, -0.0, 3.0, -1e-30], device=device)
    before = p.detach().clone()
    FusedLion([p], lr=0.25, weight_decay=0.0).step()
    moved = (before - p.detach()) / 0.25
    assert moved.tolist() == [1.0, 0.0, -1.0, 0.0, 1.0, 0.0, 1.0, -1.0]


def test_one_state_tensor_and_fp32_masters(device):
    init, grads = make_data(steps=2)
    params, opt = fused_run(device, torch.float32, init, grads)
    assert isinstance(opt, FusedOptimizer)
    assert all(set(opt.state[p]) == {"exp_avg"} for p in params)  # no step counter, no second moment
    for dtype in LOWP:
        params, opt = fused_run(device, dtype, init, grads)
        for p in params:
            assert p.dtype == dtype and set(opt.state[p]) == {"exp_avg", "master_param"}
            assert all(v.dtype == torch.float32 for v in opt.state[p].values())
        params, opt = fused_run(device, dtype, init, grads, master_weights=False)
        assert all(set(opt.state[p]) == {"exp_avg"} for p in params)


# ---- GradScaler ------------------------------------------------------------------------------------------
def scaled_step(params, opt, scaler, gs, device):
    opt.zero_grad()
    loss = sum((p.float() * g.to(device).float()).sum() for p, g in zip(params, gs))  # d loss / d p = g
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grad_scaler_skips_an_overflowing_step_bitwise_then_matches(device, dtype):
    init, grads = make_data(steps=3)
    init, grads = rounded(init, dtype), [rounded(gs, dtype) for gs in grads]
    params = [torch.nn.Parameter(t.to(device, dtype, copy=True)) for t in init]
    opt = FusedLion(split(params))
    scaler = mpfused.GradScaler(device, init_scale=2.0**8)  # x 2^8 and back is exact
    scaled_step(params, opt, scaler, grads[0], device)
    before = snapshot(opt, params)
    bad = [g.clone() for g in grads[1]]
    bad[1][5] = float("nan")  # one element of one param (group 0)
    scaled_step(params, opt, scaler, bad, device)
    assert_same(snapshot(opt, params), before)
    assert scaler.get_scale() == 2.0**7
    scaled_step(params, opt, scaler, grads[2], device)
    kept = [grads[0], grads[2]]
    plain, plain_opt = fused_run(device, dtype, init, kept)  # no scaler: the same bits
    assert_same(snapshot(opt, params), snapshot(plain_opt, plain))
    assert_matches_reference(params, opt, init, lion_reference(init, kept), 2)


def test_torch_grad_scaler_run_equals_an_unscaled_run_bitwise(device):
    init, grads = make_data(steps=4)
    plain, plain_opt = fused_run(device, torch.float32, init, grads)
    params = [torch.nn.Parameter(t.to(device, copy=True)) for t in init]
    opt = FusedLion(split(params))
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=2)
    for gs in grads:
        scaled_step(params, opt, scaler, gs, device)
    assert scaler.get_scale() == 2.0**12  # grown twice: powers of two, so unscaling stays exact
    assert_same(snapshot(opt, params), snapshot(plain_opt, plain))


# ---- state dicts ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_state_dict_round_trip_continues_bitwise(device, dtype):
    init, grads = make_data(steps=6)
    k = 3
    full, full_opt = fused_run(device, dtype, init, grads)
    params, opt = fused_run(device, dtype, init, grads[:k])
    model_sd = copy.deepcopy(torch.nn.ParameterList(params).state_dict())
    opt_sd = copy.deepcopy(opt.state_dict())
    del params, opt
    # A fresh model (other values) and optimizer (default hyperparameters): both come from the state dicts.
    fresh = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s, device=device, dtype=dtype)) for s in SHAPES])
    fresh.load_state_dict(model_sd)
    params = list(fresh)
    opt = FusedLion([dict(params=params[:2]), dict(params=params[2:])])
    opt.load_state_dict(opt_sd)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in GROUPS]
    for p in params:
        assert set(opt.state[p]) == ({"exp_avg"} if dtype == torch.float32 else {"exp_avg", "master_param"})
        assert all(v.dtype == torch.float32 for v in opt.state[p].values())
    for gs in grads[k:]:
        for p, g in zip(params, gs):
            p.grad = g.to(device, dtype)
        opt.step()
    assert_same(snapshot(opt, params), snapshot(full_opt, full))


# ---- bad input ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,name", [
    (dict(lr=-1e-4), "learning rate"),
    (dict(lr=float("inf")), "learning rate"),
    (dict(betas=(1.5, 0.99)), "beta parameter at index 0"),
    (dict(betas=(0.9, -0.1)), "beta parameter at index 1"),
    (dict(betas=(0.9,)), "betas"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(weight_decay=float("nan")), "weight_decay"),
])
def test_invalid_hyperparameters_raise_value_error_naming_them(kw, name):
    with pytest.raises(ValueError, match=f"Invalid {name}"):
        FusedLion([torch.nn.Parameter(torch.zeros(2))], **kw)


@pytest.mark.parametrize("key,value,name", [
    ("lr", -0.1, "learning rate"),
    ("betas", (0.9, 1.5), "beta parameter at index 1"),
    ("weight_decay", -1.0, "weight_decay"),
])
def test_invalid_group_value_makes_step_raise_before_anything_is_written(device, key, value, name):
    init, grads = make_data(steps=2)
    params, opt = fused_run(device, torch.float16, init, grads[:1])
    before = snapshot(opt, params)
    opt.param_groups[1][key] = value  # group 0 comes first: it must not be updated either
    for p, g in zip(params, grads[1]):
        p.grad = g.to(device, torch.float16)
    with pytest.raises(ValueError, match=f"Invalid {name}.*param group 1"):
        opt.step()
    assert_same(snapshot(opt, params), before)


# ---- multi-chunk tensors, an empty one, a misaligned one ------------------------------------------------
BIG_SHAPES = [(70001,), (0,), (65537,), (3,)]  # more than one work item; params 0, 1 in group 0


@pytest.mark.sanitize
def test_multi_chunk_empty_and_misaligned_tensors_match_the_reference(device):
    """Tensors of several chunks, an empty tensor and a param at a storage offset of one element. Every
    element's gradient keeps one sign over the run and |g| >= 0.5, so |c| stays far from 0 (the margin
    is asserted): every sign is the reference's."""
    gen = torch.Generator().manual_seed(7)
    init = [torch.randn(s, generator=gen) for s in BIG_SHAPES]
    signs = [torch.randint(0, 2, s, generator=gen) * 2.0 - 1.0 for s in BIG_SHAPES]
    grads = [[sg * (0.5 + torch.rand(s, generator=gen)) for s, sg in zip(BIG_SHAPES, signs)] for _ in range(4)]
    base = torch.zeros(init[0].numel() + 1, device=device)
    base[1:] = init[0].to(device)
    params = [torch.nn.Parameter(base[1:])] + [torch.nn.Parameter(t.to(device).clone()) for t in init[1:]]
    assert params[0].storage_offset() == 1
    opt = FusedLion(split(params))
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.to(device)
        opt.step()
    assert_matches_reference(params, opt, init, lion_reference(init, grads), 4)
