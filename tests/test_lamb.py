"""FusedLAMB against a float64 reference of apex's FusedLAMB (written here from the formulas), the trust
ratio, GradScaler interop (skip on inf, torch.amp.GradScaler), state dicts and bad input."""

import copy
import math

import pytest
import torch

import mpfused
from mpfused.optim import FusedLAMB, FusedOptimizer
from optim_helpers import assert_same, fp32_weight, rounded, snapshot
from tolerances import LAMB_WEIGHT_RTOL_PER_STEP

SHAPES = [(16, 12), (12,), (7, 5), (30,)]  # params 0, 1 in group 0; 2, 3 in group 1
# Group 0 takes the trust ratio (weight decay); group 1 has none, so no ratio unless use_nvlamb.
GROUPS = [dict(lr=0.02, weight_decay=0.1, betas=(0.9, 0.99)),
          dict(lr=0.05, weight_decay=0.0, betas=(0.8, 0.999), eps=1e-5)]
DEFAULTS = dict(lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, adam_w_mode=True,
                grad_averaging=True, max_grad_norm=1.0, use_nvlamb=False)
STEPS = 6
LOWP = [torch.float16, torch.bfloat16]
DTYPES = [torch.float32] + LOWP


def lamb_reference(init, grads, groups=GROUPS, force_ratio_one=False, **kw):
    """apex's FusedLAMB in float64. init: the params' initial values; grads: per step, one gradient per
    param; groups: per group, hyperparameters over DEFAULTS and kw. Returns the final params."""
    params = [t.detach().double().cpu() for t in init]
    split = [params[:2], params[2:]]
    hyper = [dict(DEFAULTS, **kw, **g) for g in groups]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step, gs in enumerate(grads, start=1):
        gs = [g.double().cpu() for g in gs]
        gnorm = math.sqrt(sum(float((g * g).sum()) for g in gs))  # over all params of the step
        i = 0
        for h, ps in zip(hyper, split):
            b1, b2, wd = h["betas"][0], h["betas"][1], h["weight_decay"]
            b3 = 1 - b1 if h["grad_averaging"] else 1.0
            bc1, bc2 = (1 - b1**step, 1 - b2**step) if h["bias_correction"] else (1.0, 1.0)
            for p in ps:
                g = gs[i]
                if h["max_grad_norm"] > 0 and gnorm > h["max_grad_norm"]:
                    g = g * (h["max_grad_norm"] / gnorm)
                if not h["adam_w_mode"]:
                    g = g + wd * p
                m[i] = b1 * m[i] + b3 * g
                v[i] = b2 * v[i] + (1 - b2) * g * g
                u = (m[i] / bc1) / ((v[i] / bc2).sqrt() + h["eps"])
                if h["adam_w_mode"]:
                    u = u + wd * p
                w_norm, u_norm = float(p.norm()), float(u.norm())
                adaptive = (wd != 0 or h["use_nvlamb"]) and not force_ratio_one
                ratio = w_norm / u_norm if adaptive and w_norm != 0 and u_norm != 0 else 1.0
                p -= h["lr"] * ratio * u
                i += 1
    return params


def make_data(steps=STEPS, seed=0):
    """Initial values and per-step gradients (float32). Each step's gradients have their own size (x1, x2,
    x3): clipping then changes the steps' relative weights in the moments, not only a common scale that
    m / sqrt(v) would cancel. Their global norm (>= 16) exceeds the default max_grad_norm of 1."""
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) * (1 + k % 3) for s in SHAPES] for k in range(steps)]
    return init, grads


def split(params):
    return [dict(params=params[:2], **GROUPS[0]), dict(params=params[2:], **GROUPS[1])]


def fused_run(device, dtype, init, grads, **kw):
    params = [torch.nn.Parameter(t.to(device, dtype, copy=True)) for t in init]
    opt = FusedLAMB(split(params), **kw)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.to(device, dtype)
        opt.step()
    return params, opt


def tolerance(ref, steps):
    return steps * LAMB_WEIGHT_RTOL_PER_STEP * float(ref.abs().max())


def assert_matches_reference(params, opt, ref, steps):
    assert max(g["lr"] for g in opt.param_groups) <= 0.05  # the tolerance's assumption
    for p, r in zip(params, ref):
        w = fp32_weight(opt, p)
        assert w.dtype == torch.float32
        if p.dtype != torch.float32:
            assert "master_param" in opt.state[p]
            assert torch.equal(p.detach(), w.to(p.dtype)), "the param must be its master rounded"
        torch.testing.assert_close(w.double().cpu(), r, rtol=0, atol=tolerance(r, steps))
        assert opt.state[p]["step"].dtype == torch.float32 and opt.state[p]["step"].dim() == 0
        assert opt.state[p]["step"].item() == steps


def max_rel_diff(a_list, b_list):
    """The largest difference of two runs (per tensor, as a fraction of the tensor's largest |value|), in
    units of one step's tolerance."""
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(a_list, b_list)) / LAMB_WEIGHT_RTOL_PER_STEP


# ---- against the float64 reference ---------------------------------------------------------------------
VARIANTS = {
    "default": {},  # decoupled decay, grad averaging, bias correction, max_grad_norm=1 active
    "l2": dict(adam_w_mode=False),
    "no-grad-averaging": dict(grad_averaging=False),
    "no-bias-correction": dict(bias_correction=False),
    "nvlamb": dict(use_nvlamb=True),
    "no-clipping": dict(max_grad_norm=0.0),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_float64_reference_two_groups(device, dtype, variant):
    kw = VARIANTS[variant]
    init, grads = make_data()
    init, grads = rounded(init, dtype), [rounded(gs, dtype) for gs in grads]
    params, opt = fused_run(device, dtype, init, grads, **kw)
    ref = lamb_reference(init, grads, **kw)
    assert_matches_reference(params, opt, ref, STEPS)
    gnorms = [math.sqrt(sum(float(g.double().square().sum()) for g in gs)) for gs in grads]
    assert min(gnorms) > DEFAULTS["max_grad_norm"]  # the default's clipping is active at every step
    if kw:  # the variant's flag changes the result far beyond the tolerance: the comparison tests it
        assert max_rel_diff(ref, lamb_reference(init, grads)) > 1000 * STEPS


def test_masters_keep_fp32_state_and_the_param_dtype(device):
    init, grads = make_data(steps=2)
    params, opt = fused_run(device, torch.float16, init, grads)
    assert isinstance(opt, FusedOptimizer)
    for p in params:
        assert p.dtype == torch.float16
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq", "master_param"}
        assert all(v.dtype == torch.float32 for v in opt.state[p].values())
    params, opt = fused_run(device, torch.float32, init, grads)
    assert set(opt.state[params[0]]) == {"step", "exp_avg", "exp_avg_sq"}


# ---- the trust ratio ------------------------------------------------------------------------------------
def test_trust_ratio_applies_where_weight_decay_is_nonzero_only(device):
    init, grads = make_data()
    params, opt = fused_run(device, torch.float32, init, grads)
    ours = [fp32_weight(opt, p).double().cpu() for p in params]
    ratio_one = lamb_reference(init, grads, force_ratio_one=True)
    # group 0 (weight decay) differs from the ratio-1 run by far more than the tolerance ...
    assert max_rel_diff(ours[:2], ratio_one[:2]) > 1000 * STEPS
    # ... group 1 (no weight decay, no use_nvlamb) is the ratio-1 step.
    for w, r in zip(ours[2:], ratio_one[2:]):
        torch.testing.assert_close(w, r, rtol=0, atol=tolerance(r, STEPS))


@pytest.mark.parametrize("case", ["decay", "no-decay", "no-decay-nvlamb"])
def test_step_size_follows_the_weight_norm(device, case):
    """One step from w and from 10 w with the same gradient. The first step's direction is u1 = g / (|g| +
    eps) (m_hat = g, v_hat = g^2), plus wd * w with decay. With decay, ratio * ||u|| = ||w||: the step's norm
    is lr * ||w||. Without, the step is lr * u1 whatever w. use_nvlamb applies the ratio there too: the
    step of 10 w is 10 times the step of w. ||w|| (~2.4) is far from ||u1|| (~8): the three differ."""
    gen = torch.Generator().manual_seed(4)
    w = 0.3 * torch.randn(64, generator=gen)
    grad = torch.randn(64, generator=gen)
    lr, wd = 0.05, (0.1 if case == "decay" else 0.0)
    u1_norm = float((grad.double() / (grad.double().abs() + 1e-6)).norm())
    deltas = []
    for scale in (1.0, 10.0):
        p = torch.nn.Parameter((w * scale).to(device))
        p.grad = grad.to(device)
        FusedLAMB([p], lr=lr, weight_decay=wd, max_grad_norm=0.0, use_nvlamb=case == "no-decay-nvlamb").step()
        delta = p.detach().cpu().double() - (w * scale).double()  # exact
        expected = lr * u1_norm if case == "no-decay" else lr * scale * float(w.norm())
        # each element is within one step's tolerance (of 10 w, the larger), the norm within sqrt(n) of that
        assert float(delta.norm()) == pytest.approx(expected, abs=8 * tolerance(10 * w, 1))
        deltas.append(delta)
    small, large = deltas
    atol = 2 * tolerance(10 * w, 1)  # both deltas' errors
    if case == "no-decay":
        torch.testing.assert_close(large, small, rtol=0, atol=atol)
    elif case == "no-decay-nvlamb":
        torch.testing.assert_close(large, 10 * small, rtol=0, atol=atol)


def test_a_zero_norm_takes_ratio_one(device):
    # ||w|| = 0: the ratio is 1 (not 0), so the step is -lr * u1 = -lr * g / (|g| + eps). ||u|| = 0 (zero
    # weight and gradient): ratio 1 too, and the weight stays 0 (no 0/0).
    grad = torch.tensor([2.0, -0.5, 1.0, -4.0], device=device)
    p, q = torch.nn.Parameter(torch.zeros(4, device=device)), torch.nn.Parameter(torch.zeros(4, device=device))
    p.grad, q.grad = grad, torch.zeros(4, device=device)
    FusedLAMB([p, q], lr=0.05, weight_decay=0.1, max_grad_norm=0.0).step()
    # (the first step's update, computed in ~10 FP32 roundings: well within one step's tolerance, relative)
    torch.testing.assert_close(p.detach(), -0.05 * grad / (grad.abs() + 1e-6), rtol=LAMB_WEIGHT_RTOL_PER_STEP, atol=0)
    assert torch.equal(q.detach(), torch.zeros(4, device=device))


# ---- GradScaler ------------------------------------------------------------------------------------------
def scaled_step(params, opt, scaler, gs, device):
    opt.zero_grad()
    loss = sum((p.float() * g.to(device).float()).sum() for p, g in zip(params, gs))  # d loss / d p = g
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_grad_scaler_skips_an_overflowing_step_bitwise_then_matches(device, dtype):
    init, grads = make_data(steps=3)
    init, grads = rounded(init, dtype), [rounded(gs, dtype) for gs in grads]
    params = [torch.nn.Parameter(t.to(device, dtype, copy=True)) for t in init]
    opt = FusedLAMB(split(params))
    scaler = mpfused.GradScaler(device, init_scale=2.0**8)  # x 2^8 and back is exact: |g| * 2^8 << 65504
    scaled_step(params, opt, scaler, grads[0], device)
    before = snapshot(opt, params)
    bad = [g.clone() for g in grads[1]]
    bad[2][3, 1] = float("inf")  # one element of one param (group 1)
    scaled_step(params, opt, scaler, bad, device)
    assert_same(snapshot(opt, params), before)
    assert scaler.get_scale() == 2.0**7
    scaled_step(params, opt, scaler, grads[2], device)
    kept = [grads[0], grads[2]]
    plain, plain_opt = fused_run(device, dtype, init, kept)  # no scaler: the same bits
    assert_same(snapshot(opt, params), snapshot(plain_opt, plain))
    assert_matches_reference(params, opt, lamb_reference(init, kept), 2)


def test_torch_grad_scaler_run_equals_an_unscaled_run_bitwise(device):
    init, grads = make_data(steps=4)
    plain, plain_opt = fused_run(device, torch.float32, init, grads)
    params = [torch.nn.Parameter(t.to(device, copy=True)) for t in init]
    opt = FusedLAMB(split(params))
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=2)
    for gs in grads:
        scaled_step(params, opt, scaler, gs, device)
    assert scaler.get_scale() == 2.0**12  # grown twice: powers of two, so unscaling stays exact
    assert_same(snapshot(opt, params), snapshot(plain_opt, plain))


# ---- state dicts ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_state_dict_round_trip_continues_bitwise(device, dtype):
    init, grads = make_data()
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
    opt = FusedLAMB([dict(params=params[:2]), dict(params=params[2:])])
    opt.load_state_dict(opt_sd)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in GROUPS]
    for p in params:
        st = opt.state[p]
        assert st["step"].item() == k
        assert all(v.dtype == torch.float32 for v in st.values())
        assert ("master_param" in st) == (dtype != torch.float32)
    for gs in grads[k:]:
        for p, g in zip(params, gs):
            p.grad = g.to(device, dtype)
        opt.step()
    assert_same(snapshot(opt, params), snapshot(full_opt, full))


# ---- bad input ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,name", [
    (dict(lr=-1e-3), "learning rate"),
    (dict(lr=float("nan")), "learning rate"),
    (dict(betas=(1.0, 0.999)), "beta parameter at index 0"),
    (dict(betas=(0.9, -0.1)), "beta parameter at index 1"),
    (dict(eps=-1e-6), "epsilon"),
    (dict(weight_decay=-0.01), "weight_decay"),
    (dict(max_grad_norm=-1.0), "max_grad_norm"),
    (dict(max_grad_norm=float("nan")), "max_grad_norm"),
    (dict(use_nvlamb="no"), "use_nvlamb"),  # (bool() took it as True)
    (dict(set_grad_none="False"), "set_grad_none"),
])
def test_invalid_hyperparameters_raise_value_error_naming_them(kw, name):
    with pytest.raises(ValueError, match=f"Invalid {name}"):
        FusedLAMB([torch.nn.Parameter(torch.zeros(2))], **kw)


def test_amsgrad_raises_runtime_error():
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedLAMB([torch.nn.Parameter(torch.zeros(2))], amsgrad=True)


@pytest.mark.parametrize("key,value,name", [
    ("lr", -0.1, "learning rate"),
    ("betas", (0.9, 1.5), "beta parameter at index 1"),
    ("eps", float("nan"), "epsilon"),
    ("weight_decay", -1.0, "weight_decay"),
    ("max_grad_norm", -0.5, "max_grad_norm"),
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


def offset_param(t, device, offset):
    """A param whose data starts `offset` elements into its storage (misaligned for vector loads)."""
    base = torch.zeros(t.numel() + offset, device=device)
    base[offset:] = t.reshape(-1).to(device)
    return torch.nn.Parameter(base[offset:].view(t.shape))


@pytest.mark.sanitize
def test_multi_chunk_empty_and_misaligned_tensors_match_the_reference(device):
    """Tensors of several chunks (the per-tensor sums add several partials), an empty tensor (its step is
    still counted, as torch counts it) and a param at a storage offset of one element, over three steps."""
    gen = torch.Generator().manual_seed(7)
    init = [torch.randn(s, generator=gen) for s in BIG_SHAPES]
    grads = [[torch.randn(s, generator=gen) * 1e-3 for s in BIG_SHAPES] for _ in range(3)]
    params = [offset_param(init[0], device, 1)] + [torch.nn.Parameter(t.to(device).clone()) for t in init[1:]]
    assert params[0].storage_offset() == 1
    opt = FusedLAMB(split(params))
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.to(device)
        opt.step()
    ref = lamb_reference(init, grads)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach().double().cpu(), r, rtol=0, atol=tolerance(r, 3) if r.numel() else 0)
    assert [float(opt.state[p]["step"]) for p in params] == [3.0] * 4


def test_an_overflowing_sum_of_squares_does_not_poison_the_update(device):
    """Finite gradients whose FP32 sum of squares overflows (|g| = 1e20): the global norm is inf, and the
    clip to max_grad_norm must scale the gradients down (to 0 here), never multiply them by NaN."""
    p = torch.nn.Parameter(torch.ones(8, device=device))
    p.grad = torch.full((8,), 1e20, device=device)
    FusedLAMB([p], lr=1e-2).step()
    assert torch.isfinite(p).all()


@pytest.mark.parametrize("copier", ["deepcopy", "pickle"])
@pytest.mark.parametrize("set_grad_none", [True, False])
def test_a_copy_keeps_set_grad_none(copier, set_grad_none):
    """set_grad_none is an attribute of its own, which torch's Optimizer.__getstate__ (defaults, state,
    param_groups) left out of a copy: the copy's zero_grad() raised AttributeError."""
    import pickle
    p = torch.nn.Parameter(torch.ones(3))
    opt = FusedLAMB([p], set_grad_none=set_grad_none)
    p.grad = torch.ones(3)
    opt.step()
    clone = copy.deepcopy(opt) if copier == "deepcopy" else pickle.loads(pickle.dumps(opt))
    q = clone.param_groups[0]["params"][0]
    q.grad = torch.ones(3)
    clone.zero_grad()
    assert (q.grad is None) == set_grad_none and (set_grad_none or torch.equal(q.grad, torch.zeros(3)))
