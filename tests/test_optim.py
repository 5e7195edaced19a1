"""The fused optimizers against torch.optim, the FP32-master reference, skip semantics, GradScaler
interop and state-dict interchange."""

import copy
import math

import pytest
import torch

import mpfused
from mpfused.optim import FusedAdam, FusedAdamW, FusedLAMB, FusedLion, FusedSGD
from conftest import requires_cuda
from tolerances import (OPTIM_FP32_ATOL, OPTIM_LOSS_RTOL, OPTIM_LOWP_MAX_ULP, OPTIM_LOWP_MISMATCH_FRACTION)

CASES = {
    "adam": (FusedAdam, torch.optim.Adam, dict(lr=1e-3)),
    "adam-wd-amsgrad": (FusedAdam, torch.optim.Adam, dict(lr=2e-3, weight_decay=0.1, amsgrad=True)),
    "adam-maximize": (FusedAdam, torch.optim.Adam, dict(lr=1e-3, betas=(0.8, 0.99), maximize=True)),
    "adamw": (FusedAdamW, torch.optim.AdamW, dict(lr=1e-3)),
    "adamw-amsgrad-wd": (FusedAdamW, torch.optim.AdamW, dict(lr=3e-3, weight_decay=0.05, amsgrad=True, eps=1e-6)),
    "sgd": (FusedSGD, torch.optim.SGD, dict(lr=0.05)),
    "sgd-momentum": (FusedSGD, torch.optim.SGD, dict(lr=0.02, momentum=0.9)),
    "sgd-dampening-wd": (FusedSGD, torch.optim.SGD, dict(lr=0.02, momentum=0.8, dampening=0.3, weight_decay=1e-2)),
    "sgd-nesterov-maximize": (FusedSGD, torch.optim.SGD, dict(lr=0.01, momentum=0.9, nesterov=True, maximize=True)),
}
LOWP = [torch.float16, torch.bfloat16]


def mlp(device, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.Tanh(), torch.nn.Linear(48, 7)).to(device, dtype)


def batches(device, n, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 24, generator=g).to(device, dtype), torch.randint(0, 7, (16,), generator=g).to(device))
            for _ in range(n)]


def train(model, opt, data, scheduler=None, sign=1.0):
    losses = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        (sign * loss).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def groups_of(model, kw):
    """Two param groups with their own hyperparameters: the first layer at half the lr."""
    first, rest = list(model[0].parameters()), list(model[2].parameters())
    return [dict(params=first, lr=kw.get("lr", 1e-3) / 2), dict(params=rest)]


def assert_params_close(a_model, b_model, atol=OPTIM_FP32_ATOL):
    for a, b in zip(a_model.parameters(), b_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


def ulp_distance(a, b):
    """Distance in representable values between same-dtype tensors (finite values)."""
    view = torch.int16 if a.element_size() == 2 else torch.int32
    ia, ib = a.contiguous().view(view).long(), b.contiguous().view(view).long()
    sign_bit = 1 << (8 * a.element_size() - 1)
    ia = torch.where(ia < 0, -(ia + sign_bit), ia)  # sign-magnitude -> ordered integers
    ib = torch.where(ib < 0, -(ib + sign_bit), ib)
    return (ia - ib).abs()


# ---- FP32 parity with torch.optim ----------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(CASES))
def test_fp32_parity_with_torch_over_60_steps_two_groups_and_a_scheduler(device, case):
    ours_cls, ref_cls, kw = CASES[case]
    ours_model, ref_model = mlp(device), mlp(device)
    ours = ours_cls(groups_of(ours_model, kw), **kw)
    ref = ref_cls(groups_of(ref_model, kw), **kw)
    sched_o = torch.optim.lr_scheduler.StepLR(ours, step_size=20, gamma=0.5)
    sched_r = torch.optim.lr_scheduler.StepLR(ref, step_size=20, gamma=0.5)
    sign = -1.0 if kw.get("maximize") else 1.0
    data = batches(device, 60)
    lo = train(ours_model, ours, data, sched_o, sign)
    lr_ = train(ref_model, ref, data, sched_r, sign)
    assert_params_close(ours_model, ref_model)
    assert lo == pytest.approx(lr_, rel=OPTIM_LOSS_RTOL)
    assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"] < kw["lr"] / 2
    # And the trajectory moved: the test would notice an optimizer that does nothing.
    assert abs(lo[-1] - lo[0]) > 1e-3


@pytest.mark.parametrize("case", ["adamw", "sgd-momentum"])
def test_tensor_lr_equals_float_lr(device, case):
    ours_cls, _, kw = CASES[case]
    kw = dict(kw, lr=2.0**-9)  # exactly representable: float and tensor lr must agree bit for bit
    a_model, b_model = mlp(device), mlp(device)
    a = ours_cls(a_model.parameters(), **kw)
    b = ours_cls(b_model.parameters(), **dict(kw, lr=torch.tensor(2.0**-9, device=device)))
    data = batches(device, 10)
    train(a_model, a, data)
    train(b_model, b, data)
    for x, y in zip(a_model.parameters(), b_model.parameters()):
        assert torch.equal(x, y)


def test_transformer_trained_100_steps_matches_torch(device):
    def build():
        torch.manual_seed(5)
        layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
        return torch.nn.Sequential(torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False),
                                   torch.nn.Linear(32, 5)).to(device)

    ours_model, ref_model = build(), build()
    ours = FusedAdamW(ours_model.parameters(), lr=1e-3)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(8, 12, 32, generator=g).to(device)
    y = torch.randint(0, 5, (8, 12), generator=g).to(device)
    losses = {}
    for name, model, opt in [("ours", ours_model, ours), ("ref", ref_model, ref)]:
        losses[name] = []
        for _ in range(100):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 5), y.reshape(-1))
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    assert losses["ours"] == pytest.approx(losses["ref"], rel=OPTIM_LOSS_RTOL)
    assert losses["ours"][-1] < 0.5 * losses["ours"][0]


# ---- FP16/BF16 params with FP32 master weights -----------------------------------------------------
@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("case", ["adamw-amsgrad-wd", "adam", "sgd-dampening-wd"])
def test_master_weights_match_torch_on_an_fp32_copy_with_unscaled_grads(device, dtype, case):
    ours_cls, ref_cls, kw = CASES[case]
    torch.manual_seed(11)
    shapes = [(33, 17), (65,), (4, 4, 4), (1,)]
    init = [torch.randn(s) for s in shapes]
    params = [torch.nn.Parameter(t.to(device, dtype)) for t in init]
    masters_ref = [torch.nn.Parameter(p.detach().float().clone()) for p in params]  # what the master starts as
    ours = ours_cls(params, **kw)
    ref = ref_cls(masters_ref, **kw)
    scale = 2.0**12
    gen = torch.Generator().manual_seed(12)
    for _ in range(25):
        grads = [(torch.randn(s, generator=gen) * scale).to(device, dtype) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g
        for m, g in zip(masters_ref, grads):
            m.grad = g.float() * (1.0 / scale)  # the unscaled FP32 gradient
        ours.grad_scale = torch.tensor(scale, device=device)  # as torch.amp.GradScaler hands it over
        ours.found_inf = torch.zeros((), device=device)
        ours.step()
        del ours.grad_scale, ours.found_inf
        ref.step()
    mismatched = total = 0
    for p, m_ref in zip(params, masters_ref):
        master = ours.state[p]["master_param"]
        assert master.dtype == torch.float32
        torch.testing.assert_close(master, m_ref.detach(), rtol=0, atol=OPTIM_FP32_ATOL)
        assert torch.equal(p.detach(), master.to(dtype)), "the param must be its master rounded"
        dist = ulp_distance(p.detach(), m_ref.detach().to(dtype))
        assert int(dist.max()) <= OPTIM_LOWP_MAX_ULP
        mismatched += int((dist > 0).sum())
        total += p.numel()
    assert mismatched <= max(1, OPTIM_LOWP_MISMATCH_FRACTION * total)
    for s in ours.state.values():
        assert all(v.dtype == torch.float32 for k, v in s.items() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("dtype", LOWP)
def test_master_weights_keep_updates_that_fp16_would_lose(device, dtype):
    # An update of 1e-4 on weights of 1.0 is below half an ulp of FP16 and BF16: without a master
    # it rounds away every step; with one it accumulates.
    p_master = torch.nn.Parameter(torch.ones(64, device=device, dtype=dtype))
    p_plain = torch.nn.Parameter(torch.ones(64, device=device, dtype=dtype))
    with_master = FusedSGD([p_master], lr=1e-4)
    without = FusedSGD([p_plain], lr=1e-4, master_weights=False)
    for _ in range(100):
        for p, opt in [(p_master, with_master), (p_plain, without)]:
            p.grad = torch.ones_like(p)
            opt.step()
    assert torch.all(p_plain == 1.0)
    assert with_master.state[p_master]["master_param"][0].item() == pytest.approx(1.0 - 100 * 1e-4, rel=1e-5)
    assert torch.all(p_master < 1.0)


def test_fp32_params_get_no_master_and_lowp_without_master_weights(device):
    a = torch.nn.Parameter(torch.randn(5, device=device))
    b = torch.nn.Parameter(torch.randn(5, device=device).half())
    opt = FusedAdam([a, b], master_weights=False)
    for p in (a, b):
        p.grad = torch.ones_like(p)
    opt.step()
    assert "master_param" not in opt.state[a] and "master_param" not in opt.state[b]
    opt2 = FusedAdam([a, b])
    opt2.step()
    assert "master_param" not in opt2.state[a] and opt2.state[b]["master_param"].dtype == torch.float32


# ---- skip semantics -----------------------------------------------------------------------------------
def snapshot(opt, params):
    return [p.detach().clone() for p in params], copy.deepcopy({id(k): v for k, v in opt.state.items()})


@pytest.mark.sanitize
@pytest.mark.parametrize("found", [1.0, 2.0])
@pytest.mark.parametrize("case", ["adamw-amsgrad-wd", "sgd-dampening-wd"])
def test_skipped_step_leaves_everything_bitwise_unchanged(device, case, found):
    ours_cls, _, kw = CASES[case]
    params = [torch.nn.Parameter(torch.randn(40, device=device).to(d)) for d in (torch.float32, torch.float16, torch.bfloat16)]
    opt = ours_cls(params, **kw)
    for _ in range(2):  # real state first
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    before_p, before_s = snapshot(opt, params)
    for p in params:
        p.grad = torch.randn_like(p) * 1e3
    opt.found_inf = torch.tensor([found], device=device)
    opt.grad_scale = torch.tensor(1024.0, device=device)
    opt.step()
    del opt.found_inf, opt.grad_scale
    after_p, after_s = snapshot(opt, params)
    for a, b in zip(before_p, after_p):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for key in before_s:
        for name, value in before_s[key].items():
            assert torch.equal(value, after_s[key][name]), name


def test_skipped_first_sgd_step_keeps_the_buffer_unset(device):
    # torch sets the momentum buffer to the first gradient (no dampening). A skipped first step must not
    # count as that first step, although the host never learns that it was skipped.
    p_ours = torch.nn.Parameter(torch.zeros(8, device=device))
    p_ref = torch.nn.Parameter(torch.zeros(8, device=device))
    ours = FusedSGD([p_ours], lr=0.1, momentum=0.9, dampening=0.5)
    ref = torch.optim.SGD([p_ref], lr=0.1, momentum=0.9, dampening=0.5)
    p_ours.grad = torch.full_like(p_ours, 3.0)
    ours.found_inf = torch.ones((), device=device)
    ours.step()
    del ours.found_inf
    for _ in range(3):
        for p, opt in [(p_ours, ours), (p_ref, ref)]:
            p.grad = torch.full_like(p, 2.0)
            opt.step()
    torch.testing.assert_close(p_ours, p_ref, rtol=0, atol=OPTIM_FP32_ATOL)


def test_params_without_grads_are_skipped(device):
    a = torch.nn.Parameter(torch.randn(4, device=device))
    b = torch.nn.Parameter(torch.randn(4, device=device))
    opt = FusedAdamW([a, b])
    b_before = b.detach().clone()
    a.grad = torch.ones_like(a)
    opt.step()
    assert torch.equal(b, b_before) and not opt.state[b]
    assert opt.state[a]["step"].item() == 1.0


# ---- torch.amp.GradScaler interop ---------------------------------------------------------------------
def test_torch_grad_scaler_drives_the_fused_step(device):
    torch.manual_seed(3)
    ours_model, ref_model = mlp(device), mlp(device)
    ours, ref = FusedAdamW(ours_model.parameters(), lr=1e-3), torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    s_ours = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=3)
    s_ref = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=3)
    data = batches(device, 12)
    for i, (x, y) in enumerate(data):
        for model, opt, scaler in [(ours_model, ours, s_ours), (ref_model, ref, s_ref)]:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            if i == 5:
                loss = loss * float("inf")  # an overflow: both must skip and back off
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert s_ours.get_scale() == s_ref.get_scale()
    assert_params_close(ours_model, ref_model)
    assert ours.state[next(ours_model.parameters())]["step"].item() == 11.0  # 12 iterations, one skipped


def test_scaler_unscale_then_clip_then_step(device):
    # With unscale_ called first (for clipping), the scaler hands over no scale: grads are used as they are.
    ours_model, ref_model = mlp(device), mlp(device)
    ours, ref = FusedAdam(ours_model.parameters()), torch.optim.Adam(ref_model.parameters())
    scalers = [torch.amp.GradScaler(device, init_scale=256.0) for _ in range(2)]
    for x, y in batches(device, 5):
        for model, opt, scaler in [(ours_model, ours, scalers[0]), (ref_model, ref, scalers[1])]:
            opt.zero_grad()
            scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            scaler.step(opt)
            scaler.update()
    assert_params_close(ours_model, ref_model)


# ---- state dicts ------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["adamw-amsgrad-wd", "adam", "sgd-dampening-wd", "sgd-nesterov-maximize"])
def test_state_dict_interchange_with_torch_both_ways(device, case):
    ours_cls, ref_cls, kw = CASES[case]
    data = batches(device, 20)
    sign = -1.0 if kw.get("maximize") else 1.0
    # torch -> ours: train 10 steps with torch, continue with ours, compare to torch continuing.
    m_ref, m_ours = mlp(device), mlp(device)
    ref = ref_cls(m_ref.parameters(), **kw)
    train(m_ref, ref, data[:10], sign=sign)
    m_ours.load_state_dict(m_ref.state_dict())
    ours = ours_cls(m_ours.parameters(), **kw)
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))  # as from a checkpoint: no shared state tensors
    train(m_ref, ref, data[10:], sign=sign)
    train(m_ours, ours, data[10:], sign=sign)
    assert_params_close(m_ours, m_ref)
    # ours -> torch
    m_a, m_b = mlp(device), mlp(device)
    a = ours_cls(m_a.parameters(), **kw)
    train(m_a, a, data[:10], sign=sign)
    m_b.load_state_dict(m_a.state_dict())
    b = ref_cls(m_b.parameters(), **kw)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    train(m_a, a, data[10:], sign=sign)
    train(m_b, b, data[10:], sign=sign)
    assert_params_close(m_a, m_b)


@pytest.mark.parametrize("dtype", LOWP)
def test_own_state_dict_round_trip_is_exact_and_stays_fp32(device, dtype):
    params = [torch.nn.Parameter(torch.randn(30, device=device).to(dtype)) for _ in range(2)]
    opt = FusedAdamW(params, amsgrad=True)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"}
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = FusedAdamW(clones, amsgrad=True)
    opt2.load_state_dict(sd)
    for s in opt2.state.values():
        assert all(v.dtype == torch.float32 for v in s.values() if isinstance(v, torch.Tensor))
    grads = [torch.randn_like(p) for p in params]
    for ps, o in [(params, opt), (clones, opt2)]:
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        o.step()
    for p, q in zip(params, clones):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["master_param"], opt2.state[q]["master_param"])


def test_torch_state_of_an_fp16_param_loads_without_downcasting(device):
    p = torch.nn.Parameter(torch.randn(16, device=device).half())
    ref = torch.optim.AdamW([torch.nn.Parameter(p.detach().float())])
    ref.param_groups[0]["params"][0].grad = torch.randn(16, device=device)
    ref.step()
    ours = FusedAdamW([p])
    ours.load_state_dict(ref.state_dict())
    st = ours.state[p]
    assert st["exp_avg"].dtype == torch.float32 and st["master_param"].dtype == torch.float32
    assert torch.equal(st["exp_avg"], ref.state[ref.param_groups[0]["params"][0]]["exp_avg"])
    assert st["step"].item() == 1.0


# ---- API and bad input ----------------------------------------------------------------------------------
def test_add_param_group_and_zero_grad(device):
    a, b = torch.nn.Parameter(torch.randn(3, device=device)), torch.nn.Parameter(torch.randn(3, device=device))
    opt = FusedSGD([a], lr=0.1)
    opt.add_param_group({"params": [b], "lr": 0.5})
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    a0, b0 = a.detach().clone(), b.detach().clone()
    opt.step()
    torch.testing.assert_close(a0 - a.detach(), torch.full_like(a0, 0.1))
    torch.testing.assert_close(b0 - b.detach(), torch.full_like(b0, 0.5))
    opt.zero_grad(set_to_none=True)
    assert a.grad is None and b.grad is None


@pytest.mark.parametrize("make", [
    lambda p: FusedAdam(p, lr=-1.0),
    lambda p: FusedAdam(p, lr=float("nan")),
    lambda p: FusedAdam(p, betas=(1.0, 0.999)),
    lambda p: FusedAdam(p, betas=(0.9, -0.1)),
    lambda p: FusedAdam(p, eps=-1e-8),
    lambda p: FusedAdamW(p, weight_decay=float("inf")),
    lambda p: FusedAdam(p, lr=torch.tensor([1e-3, 1e-3])),
    lambda p: FusedAdam(p, lr=torch.tensor(-1.0)),
    lambda p: FusedAdamW(p, lr=torch.tensor(float("nan"))),
    lambda p: FusedSGD(p, lr=torch.tensor(-0.1)),
    lambda p: FusedSGD(p, momentum=-0.5),
    lambda p: FusedSGD(p, nesterov=True),
    lambda p: FusedSGD(p, momentum=0.9, dampening=0.1, nesterov=True),
    lambda p: FusedSGD(p, master_weights="yes"),
])
def test_invalid_hyperparameters_raise_value_error(make):
    with pytest.raises(ValueError, match="Invalid|Nesterov|must be 1-element"):
        make([torch.nn.Parameter(torch.zeros(2))])


def test_a_tensor_lr_added_with_a_group_is_checked():
    opt = FusedAdam([torch.nn.Parameter(torch.zeros(2))], lr=torch.tensor(0.1))
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": torch.tensor(-1.0)})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("make, key, bad", [
    (lambda ps: FusedAdam(ps, lr=0.1), "maximize", 2),
    (lambda ps: FusedAdamW(ps, lr=0.1), "amsgrad", "yes"),
    (lambda ps: FusedAdam(ps, lr=0.1), "decoupled_weight_decay", None),
    (lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9), "nesterov", 3),
    (lambda ps: mpfused.optim.FusedLion(ps, lr=0.1), "maximize", 0.5),
    (lambda ps: mpfused.optim.FusedLAMB(ps, lr=0.1), "use_nvlamb", 7),
])
def test_a_bad_switch_in_a_later_group_writes_nothing(make, key, bad):
    """A param group is a dict that code edits between steps; a switch that is not True/False in group 1
    must stop the step before group 0's params or state are written (each group is one kernel call)."""
    p0, p1 = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = make([{"params": [p0]}, {"params": [p1]}])
    p0.grad, p1.grad = torch.ones(4), torch.ones(4)
    opt.param_groups[1][key] = bad
    with pytest.raises(ValueError, match=f"Invalid {key}: expected True or False, got {bad!r} \\(param group 1\\)"):
        opt.step()
    assert p0.tolist() == [1.0] * 4 and not opt.state[p0]


def test_betas_a_scheduler_makes_mixed_still_step():
    """OneCycleLR (cycle_momentum) writes a float beta1 beside a tensor beta2; torch steps on with that."""
    results = []
    for cls in (torch.optim.Adam, FusedAdam):
        p = torch.nn.Parameter(torch.ones(3))
        opt = cls([p], lr=torch.tensor(0.01), betas=(torch.tensor(0.9), torch.tensor(0.99)))
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=10)
        for _ in range(4):
            p.grad = torch.tensor([1.0, -2.0, 0.5])
            opt.step()
            sched.step()
        assert not isinstance(opt.param_groups[0]["betas"][0], torch.Tensor)
        results.append(p.detach().clone())
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=OPTIM_FP32_ATOL)


def test_load_state_dict_pre_hook_edits_a_copy():
    p = torch.nn.Parameter(torch.ones(2))
    opt = FusedSGD([p], lr=0.1)
    sd = opt.state_dict()

    def hook(optimizer, state_dict):
        state_dict["param_groups"] = [dict(g, lr=0.5) for g in state_dict["param_groups"]]

    opt.register_load_state_dict_pre_hook(hook)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.5 and sd["param_groups"][0]["lr"] == 0.1


def test_load_state_dict_rejects_a_step_of_several_elements():
    p = torch.nn.Parameter(torch.ones(2))
    opt = FusedAdam([p], lr=0.1)
    p.grad = torch.ones(2)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["step"] = torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match="state 'step' must be a number or a one-element tensor"):
        opt.load_state_dict(sd)
    assert opt.state[p]["step"].item() == 1.0


def _snapshot_optimizer(opt):
    return copy.deepcopy({"groups": opt.param_groups, "state": {id(p): dict(s) for p, s in opt.state.items()}})


def _same_optimizer(a, b):
    assert [{k: v for k, v in g.items() if k != "params"} for g in a["groups"]] == \
        [{k: v for k, v in g.items() if k != "params"} for g in b["groups"]]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert a["state"][k].keys() == b["state"][k].keys()
        for key, v in a["state"][k].items():
            assert torch.equal(v, b["state"][k][key]), key


def test_a_bad_state_dict_is_refused_whole_and_the_optimizer_stays_as_it_was():
    """Every entry is checked before the optimizer changes, and what only the loaded state can tell (a
    remainder against its param) puts the optimizer back as it was: a number where a state tensor belongs,
    a wrongly shaped state, and a count that is not one (NaN or negative: the next step wrote NaN params)."""
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    q = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = FusedAdam([p, q], lr=0.1, master_weights="remainder")
    p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
    opt.step()
    good = copy.deepcopy(opt.state_dict())
    before = _snapshot_optimizer(opt)

    def bad(edit):
        sd = copy.deepcopy(good)
        edit(sd)
        return sd

    cases = [
        (bad(lambda sd: sd["state"][0].__setitem__("exp_avg", 3)), r"state 'exp_avg' of param 0 .* must be a tensor, got int"),
        # None only where torch saves it (SGD's momentum_buffer): a None moment loaded, the next step rewrote the
        # masters from the params before the operator refused it
        (bad(lambda sd: sd["state"][1].__setitem__("exp_avg", None)), r"state 'exp_avg' of param 1 .* must be a tensor, got NoneType"),
        (bad(lambda sd: sd["state"][0].__setitem__("master_remainder", None)), r"state 'master_remainder' of param 0 .* got NoneType"),
        (bad(lambda sd: sd["state"][1].__setitem__("exp_avg_sq", torch.zeros(5))), r"state 'exp_avg_sq' of param 1 .* shape \(3,\)"),
        # a wrongly shaped remainder while the group switches to FP32 masters (the group's key changed too)
        (bad(lambda sd: (sd["state"][1].__setitem__("master_remainder", torch.zeros(5, dtype=torch.int16)),
                         sd["param_groups"][0].__setitem__("master_weights", True))), r"state 'master_remainder' of param 1"),
        (bad(lambda sd: sd["state"][0].__setitem__("step", float("nan"))), r"state 'step' must be a count >= 0, got nan"),
        (bad(lambda sd: sd["state"][0].__setitem__("step", torch.tensor(-5.0))), r"state 'step' must be a count >= 0"),
        (bad(lambda sd: sd["state"][0].__setitem__("step", "3")), r"state 'step' must be a number .* got str"),
        (bad(lambda sd: sd["state"][0].__setitem__("step", torch.zeros((), device="meta"))), r"state 'step' .* meta"),
        (bad(lambda sd: sd["state"].__setitem__(0, 7)), r"state 0 of the loaded state dict must be a dict"),
        # a hyperparameter the step refuses (torch's load takes any value; the next step raised)
        (bad(lambda sd: sd["param_groups"][0].__setitem__("lr", -1.0)), r"Invalid learning rate: -1.0 \(param group 0"),
        (bad(lambda sd: sd["param_groups"][0].__setitem__("betas", (0.9, 1.5))), r"Invalid beta parameter at index 1"),
        # tensors without dense values: torch's messages (a copy_ between dense and sparse, "Cannot copy out of
        # meta tensor", a nested tensor's "Internal error ... doesn't support sizes") named no state
        (bad(lambda sd: sd["state"][0].__setitem__("exp_avg", sd["state"][0]["exp_avg"].to_sparse())),
         r"state 'exp_avg' of param 0 .* dense \(strided\) tensor with values, got a tensor of layout torch.sparse_coo"),
        (bad(lambda sd: sd["state"][1].__setitem__("exp_avg_sq", torch.zeros(3, device="meta"))),
         r"state 'exp_avg_sq' of param 1 .* got a tensor on the meta device"),
        (bad(lambda sd: sd["state"][0].__setitem__("master_remainder", torch.nested.nested_tensor(
            [torch.zeros(2, dtype=torch.int16), torch.zeros(2, dtype=torch.int16)], layout=torch.jagged))),
         r"state 'master_remainder' of param 0 .* got a nested tensor"),
    ]
    for sd, match in cases:
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(sd)
        _same_optimizer(before, _snapshot_optimizer(opt))
    # and the optimizer still steps as before (its plan and its state kept)
    twin = FusedAdam([torch.nn.Parameter(p.detach().clone()), torch.nn.Parameter(q.detach().clone())], lr=0.1,
                     master_weights="remainder")
    twin.load_state_dict(good)
    for o in (opt, twin):
        for t in o.param_groups[0]["params"]:
            t.grad = torch.full_like(t, 0.5)
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(opt.param_groups[0]["params"], twin.param_groups[0]["params"]))


def test_a_state_dict_that_a_scheduler_left_with_a_float_beside_a_tensor_beta_loads():
    """OneCycleLR writes a float beta1 beside a tensor beta2; the step takes that, so the load must too (its
    hyperparameter check is the step's, not the constructor's both-or-neither rule)."""
    p, q = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = FusedAdamW([p], betas=(torch.tensor(0.9), torch.tensor(0.999)))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    p.grad = torch.ones(4)
    opt.step()
    sched.step()
    assert isinstance(opt.param_groups[0]["betas"][0], float)
    twin = FusedAdamW([q], betas=(torch.tensor(0.9), torch.tensor(0.999)))
    twin.load_state_dict(opt.state_dict())
    q.data.copy_(p.detach())
    p.grad, q.grad = torch.full((4,), 0.5), torch.full((4,), 0.5)
    opt.step()
    twin.step()
    assert torch.equal(p, q)


def test_a_failure_after_the_state_is_installed_puts_the_optimizer_back(monkeypatch):
    """What only the installed state can tell (here: _after_load raising) restores the groups and state."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = FusedAdam([p], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["lr"] = 0.5
    before = _snapshot_optimizer(opt)

    def fail(*args):
        raise RuntimeError("refused")
    monkeypatch.setattr(type(opt), "_after_load", fail)
    with pytest.raises(RuntimeError, match="refused"):
        opt.load_state_dict(sd)
    _same_optimizer(before, _snapshot_optimizer(opt))
    assert opt.param_groups[0]["lr"] == 0.1


def test_an_int_beyond_float_range_is_a_value_error_naming_the_argument():
    """10**400 made float() raise a bare OverflowError that named nothing."""
    import mpfused.fixed_point as fxp
    huge = 10**400
    p = torch.nn.Parameter(torch.ones(2))
    for call, match in [(lambda: FusedAdam([p], lr=huge), "Invalid learning rate: an int too large for a float"),
                        (lambda: FusedAdam([p], lr=0.1, weight_decay=huge), "Invalid weight_decay value"),
                        (lambda: mpfused.gemm(torch.ones(2, 2).half(), torch.ones(2, 2).half(), alpha=huge),
                         "alpha must be a number within float range"),
                        (lambda: mpfused.amp.initialize(torch.nn.Linear(2, 2), None, "O2", loss_scale=huge),
                         "loss_scale must be a positive finite number"),
                        (lambda: fxp.FixedPointSGD([p], lr=huge, fmt=(4, 4)), "lr must be a finite number")]:
        with pytest.raises(ValueError, match=match):
            call()


def test_the_step_refuses_tensors_it_writes_that_share_memory():
    """A grad shared by two params in a scaled step (unscaled twice, the second param's update off by the
    scale), a param listed twice in the operator (one update lost), a state pointed at another with `.data`
    (the planned step took it, each update reading the other's writes), a state that is the param itself:
    refused, naming both, before anything is written. A CPU lr tensor's value is checked as a number's."""
    from mpfused.optim import StepScaling
    p1, p2 = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    shared = torch.full((4,), 8.0)
    p1.grad = p2.grad = shared
    with pytest.raises(ValueError, match=r"the grad of param 0 of param group 0 and the grad of param 1 of param group 0 "
                                         r"are over the same memory.* unscaled twice"):
        FusedSGD([p1, p2], lr=1.0).step(scaling=StepScaling(inv_scale=torch.tensor([0.5])))
    assert p1.tolist() == p2.tolist() == [1.0] * 4 and shared.tolist() == [8.0] * 4
    # (the operator's own check, for its call's tensors)
    with pytest.raises(ValueError, match=r"grads\[0\] and grads\[1\] share memory.* unscaled twice"):
        torch.ops.mpfused.optim_step_("sgd", [p1.detach(), p2.detach()], [shared, shared], [], [], [], [], [], [], [], [],
                                      1.0, None, [0.0] * 5, [], torch.tensor([0.5]), None, None, math.inf, None, None,
                                      True, "nearest", 0, [])
    assert shared.tolist() == [8.0] * 4

    # In two param groups (two operator calls), on the full path and on the planned one (grads of their own for
    # three steps, then one shared): refused before either group is written.
    for planned in (False, True):
        p1, p2 = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
        opt = FusedAdamW([{"params": [p1]}, {"params": [torch.nn.Parameter(torch.ones(2)), p2]}], lr=0.1)
        for _ in range(3 if planned else 0):
            for q in (p1, p2):
                q.grad = torch.full((4,), 8.0)
            opt.step(scaling=StepScaling(inv_scale=torch.tensor([0.5])))
        if planned:
            assert opt.__dict__.get("_mpf_plan") is not None
        before = [p1.detach().clone(), p2.detach().clone(), {k: v.clone() for k, v in opt.state[p1].items()}]
        shared = torch.full((4,), 8.0)
        p1.grad = p2.grad = shared
        with pytest.raises(ValueError, match=r"the grad of param 0 of param group 0 and the grad of param 1 of param "
                                             r"group 1 are over the same memory"):
            opt.step(scaling=StepScaling(inv_scale=torch.tensor([0.5])))
        unchanged = lambda: (torch.equal(p1, before[0]) and torch.equal(p2, before[1])  # noqa: E731
                             and all(torch.equal(opt.state[p1][k], v) for k, v in before[2].items()))
        assert unchanged() and shared.tolist() == [8.0] * 4
        # a clipped step writes the grads too
        with pytest.raises(ValueError, match="over the same memory"):
            opt.step(scaling=StepScaling(clip=(torch.tensor([1.0]), 1.0)))
        # A grad over another group's param or state: its unscaled values were written there.
        p2.grad = torch.full((4,), 8.0)
        for over, named in ((p2.detach(), r"param 1 of param group 1"),
                            (opt.state[p2]["exp_avg"] if planned else None, r"state\['exp_avg'\] of param 1 of param group 1"
                             r"|param 1 of param group 1 \(or its state\)")):
            if over is None:
                continue
            p1.grad = over
            with pytest.raises(ValueError, match=r"(the grad of param 0 of param group 0 and {0}|{0} and the grad of "
                                                 r"param 0 of param group 0).* over the same memory".format(named)):
                opt.step(scaling=StepScaling(inv_scale=torch.tensor([0.5])))
            assert unchanged() and torch.equal(p2.grad, torch.full((4,), 8.0))
        # an unscaled, unclipped step only reads the grads (allowed, as in torch)
        p1.grad = p2.grad = shared
        opt.step()
        assert not torch.equal(p1, before[0]) and torch.equal(p1, p2)

    # A grad over another group's FP32 master, or over its BF16 remainder (read as BF16): refused on both paths,
    # before anything is written (the master's and remainder's memory is state, as the moments are).
    for planned in (False, True):
        for key, dtype, mw in (("master_param", torch.float16, True), ("master_remainder", torch.bfloat16, "remainder")):
            p1 = torch.nn.Parameter(torch.ones(4, dtype=torch.float32 if key == "master_param" else torch.bfloat16))
            p2 = torch.nn.Parameter(torch.ones(4, dtype=dtype))
            opt = FusedAdamW([{"params": [p1]}, {"params": [p2], "master_weights": mw}], lr=0.1)
            for _ in range(3):
                p1.grad, p2.grad = torch.full_like(p1, 8.0), torch.full_like(p2, 8.0)
                opt.step(scaling=StepScaling(inv_scale=torch.tensor([0.5])))
            if not planned:  # a loaded state dict: the next step takes the full path
                opt.load_state_dict(opt.state_dict())
            assert (opt.__dict__.get("_mpf_plan") is not None) == planned
            held = opt.state[p2][key]
            p1.grad = held if key == "master_param" else held.view(torch.bfloat16)
            before = held.clone(), p1.detach().clone(), p2.detach().clone()
            with pytest.raises(ValueError, match=r"state\['{}'\] of param 0 of param group 1|param 0 of param group 1 "
                                                 r"\(or its state\)".format(key)):
                opt.step(scaling=StepScaling(inv_scale=torch.tensor([0.5])))
            assert torch.equal(held, before[0]) and torch.equal(p1, before[1]) and torch.equal(p2, before[2])

    # Grads that interleave in one buffer (columns 0-1 and 2-3) share no element: stepped as separate grads, in
    # one group and in two, on both paths.
    for split in (False, True):
        ref = [torch.nn.Parameter(torch.ones(4, 2)) for _ in range(2)]
        ps = [torch.nn.Parameter(torch.ones(4, 2)) for _ in range(2)]
        groups = lambda q: [{"params": [q[0]]}, {"params": [q[1]]}] if split else [{"params": q}]  # noqa: E731
        opt, opt_ref = FusedAdamW(groups(ps), lr=0.1), FusedAdamW(groups(ref), lr=0.1)
        for step in range(4):
            buf = torch.arange(16.0).reshape(4, 4) * (step + 1)
            ps[0].grad, ps[1].grad = buf[:, :2], buf[:, 2:]
            ref[0].grad, ref[1].grad = buf[:, :2].clone(), buf[:, 2:].clone()
            opt.step(scaling=StepScaling(inv_scale=torch.tensor([0.5])))
            opt_ref.step(scaling=StepScaling(inv_scale=torch.tensor([0.5])))
            assert torch.equal(buf[:, :2], ref[0].grad) and torch.equal(buf[:, 2:], ref[1].grad)
        assert torch.equal(ps[0], ref[0]) and torch.equal(ps[1], ref[1])

    # A state pointed at another group's by `.data` after the plan was made: refused (the plan's layouts hold the
    # entries' memory, so the full path's check over every group runs), before the first group is written.
    p1, p2 = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = FusedAdam([{"params": [p1]}, {"params": [p2]}], lr=0.1)
    for _ in range(3):
        p1.grad, p2.grad = torch.full((4,), 0.5), torch.full((4,), 0.25)
        opt.step()
    assert opt.__dict__.get("_mpf_plan") is not None
    opt.state[p2]["exp_avg"].data = opt.state[p1]["exp_avg"].data
    before = p1.detach().clone(), opt.state[p1]["step"].clone()
    with pytest.raises(ValueError, match=r"state\['exp_avg'\] of param 0 of param group 1 and state\['exp_avg'\] of "
                                         r"param 0 of param group 0 are over the same memory"):
        opt.step()
    assert torch.equal(p1.detach(), before[0]) and torch.equal(opt.state[p1]["step"], before[1])

    p = torch.nn.Parameter(torch.ones(3))
    opt = FusedAdam([p], lr=0.1)
    for _ in range(3):  # (from the third step on, the planned step)
        p.grad = torch.full((3,), 0.5)
        opt.step()
    st = opt.state[p]
    st["exp_avg_sq"].data = st["exp_avg"].data
    before = p.detach().clone()
    p.grad = torch.full((3,), 0.5)
    with pytest.raises(ValueError, match=r"state\['exp_avg_sq'\] of param 0 of param group 0 and state\['exp_avg'\] of "
                                         r"param 0 of param group 0 are over the same memory"):
        opt.step()
    assert torch.equal(p.detach(), before)

    op = torch.ops.mpfused.optim_step_
    q = torch.ones(4)
    sgd_tail = (None, [0.0] * 5, [], None, None, None, math.inf, None, None, False, "nearest", 0, [])
    with pytest.raises(ValueError, match=r"params\[0\] and params\[1\] share memory"):
        op("sgd", [q, q], [torch.full((4,), 0.5)] * 2, [], [], [], [], [], [], [], [], 0.1, *sgd_tail)
    with pytest.raises(ValueError, match=r"params\[0\] and exp_avg\[0\] share memory"):
        op("lion", [q], [torch.full((4,), 0.5)], [], [], [], [], [q], [0], [], [], 0.1, None, [0.9, 0.99, 0.0, 0.0], [],
           None, None, None, math.inf, None, None, False, "nearest", 0, [])
    with pytest.raises(ValueError, match=r"invalid lr: nan"):
        op("sgd", [q], [torch.full((4,), 0.5)], [], [], [], [], [], [], [], [], 0.0, torch.tensor([math.nan]),
           *sgd_tail[1:])
    assert q.tolist() == [1.0] * 4


def test_nested_and_sparse_tensors_are_refused_naming_the_argument():
    """The dispatcher's own message named a backend key ("NestedTensorCPU"), or torch raised an internal
    error asking a nested tensor for its sizes."""
    import warnings
    import mpfused.fixed_point as fxp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's nested tensors are a prototype: it warns)
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
        p = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], requires_grad=True)
        torch.nested.to_padded_tensor(p * 2, 0.0).sum().backward()
    codes = torch.ones(2, 2, dtype=torch.int16)
    for call, match in [
            (lambda: mpfused.round_stochastic(nested, torch.float16, seed=1), "x must be a dense .strided. tensor, got a nested tensor"),
            (lambda: mpfused.non_finite_check_([torch.ones(2), nested], torch.zeros(1)), r"tensors\[1\] must be a dense .strided. tensor, got a nested"),
            (lambda: fxp.quantize(nested, 4, 4), "x must be a dense .strided. tensor, got a nested tensor"),
            (lambda: mpfused.gemm(nested.half(), torch.ones(2, 2).half()), "a must be a dense .strided. tensor, got a nested"),
            (lambda: fxp.matmul(codes.to_sparse(), codes, (4, 4), (4, 4), (4, 4)), "a_codes must be a dense .strided. tensor, got a sparse_coo"),
            (lambda: FusedSGD([p], lr=0.1).step(), "nested params are not supported")]:
        with pytest.raises((TypeError, ValueError), match=match):
            call()


def test_bad_params_and_grads_raise_before_anything_is_written():
    good = torch.nn.Parameter(torch.randn(6))
    cases = []
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    cases.append(([emb.weight], "sparse gradients"))
    # a param whose dtype changed after the optimizer took it (the constructor refuses one: below)
    for dtype in (torch.complex64, torch.float64):
        c = torch.nn.Parameter(torch.randn(3))
        c.data = torch.randn(3, dtype=dtype)
        c.grad = torch.randn(3, dtype=dtype)
        cases.append(([c], "float32/float16/bfloat16|not supported"))
    nc = torch.nn.Parameter(torch.randn(4, 12)[:, ::2])  # a gap every other element: not dense
    nc.grad = torch.randn(4, 6)
    cases.append(([nc], "must be dense"))
    for bad, message in cases:
        good.grad = torch.ones_like(good)
        opt = FusedAdamW([good] + [torch.nn.Parameter(torch.randn(3))])
        opt.param_groups[0]["params"][1:] = bad  # (past the constructor's checks)
        before = good.detach().clone()
        with pytest.raises(ValueError, match=message):
            opt.step()
        assert torch.equal(good, before) and not opt.state[good]


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float64])
@pytest.mark.parametrize("cls", [FusedAdamW, FusedSGD, FusedLion, FusedLAMB])
def test_a_param_of_a_dtype_the_step_cannot_update_is_refused_by_the_constructor(cls, dtype):
    """Refused when the optimizer is made (or a group added), naming it: the step refused it only later, after
    amp.initialize had replaced the torch optimizer that could update it (torch's Adam steps complex params).
    A frozen one (a complex rotary table kept as a Parameter, an int64 one) is taken: the step skips it."""
    good = torch.nn.Parameter(torch.randn(3))
    bad = torch.nn.Parameter(torch.zeros(3, dtype=dtype))
    with pytest.raises(ValueError, match=f"param 1 of param group 0: .* float32/float16/bfloat16 params, got {dtype}"):
        cls([good, bad], lr=0.1)
    opt = cls([good], lr=0.1)
    with pytest.raises(ValueError, match=f"param 0 of param group 1: .* got {dtype}"):
        opt.add_param_group(dict(params=[bad]))
    assert len(opt.param_groups) == 1
    frozen = [torch.nn.Parameter(torch.zeros(3, dtype=d), requires_grad=False) for d in (dtype, torch.int64)]
    opt = cls([good] + frozen, lr=0.1)
    good.grad = torch.ones(3)
    before = good.detach().clone()
    opt.step()
    assert not torch.equal(good, before) and all(torch.equal(f, torch.zeros(3, dtype=f.dtype)) for f in frozen)


def adam_kernel(params, grads, masters, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, lr, found_inf=None,
                **hyper):
    """The kernel entry for the adam policy, with the state lists by position."""
    states = dict(exp_avg=exp_avgs, exp_avg_sq=exp_avg_sqs, max_exp_avg_sq=max_exp_avg_sqs)
    mpfused._ops.optim_step_("adam", params, grads, masters, states, steps, lr=lr, hyper=hyper, found_inf=found_inf)


def test_kernel_entry_validates_shapes_devices_and_state():
    p, g = torch.randn(6), torch.randn(6)
    z = lambda: torch.zeros(6)  # noqa: E731
    step = torch.zeros(())
    base = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False, decoupled=True)
    bad = [
        (dict(grads=[torch.randn(5)]), r"grads\[0\] must have its param's shape"),
        (dict(grads=[torch.randn(6).half()]), r"grads\[0\] must have its param's dtype"),
        (dict(grads=[torch.randn(6, device="meta")]), r"grads\[0\] is on meta but params\[0\] is on"),
        (dict(exp_avgs=[torch.zeros(6).half()]), r"exp_avg\[0\] must be float32"),
        (dict(exp_avgs=[torch.zeros(5)]), r"exp_avg\[0\] must have its param's shape"),
        (dict(exp_avg_sqs=[]), r"exp_avg_sq\[0\] is required"),
        (dict(steps=[]), r"steps\[0\] is required"),
        (dict(steps=[torch.zeros(2)]), r"steps\[0\] must be a float32 tensor with one element"),
        (dict(masters=[torch.zeros(6, device="meta")]), r"masters\[0\] is on meta but params\[0\] is on"),
        (dict(found_inf=torch.zeros(1).half()), r"found_inf must be a float32"),
        (dict(beta1=float("nan")), r"invalid beta1"),
        (dict(params=[torch.randn(6, 2)[:, 0]], grads=[torch.randn(6)]), r"params\[0\] must be dense"),
        (dict(grads=[torch.randn(6, 2)[:, 0]]), r"grads\[0\] must have its param's memory layout"),
        (dict(exp_avgs=[torch.zeros(6, 2)[:, 0]]), r"exp_avg\[0\] must have its param's memory layout"),
        (dict(beta1=torch.tensor(0.9, dtype=torch.float16)), r"beta1 must be a float32 or float64 tensor"),
        (dict(beta2=torch.tensor([0.9, 0.9])), r"beta2 must be a float32 or float64 tensor with one element"),
        (dict(beta2=torch.tensor(0.9, device="meta")), r"hyper_tensors\[1\] is on meta but params\[0\] is on"),
        # only the hyperparameters torch lets be tensors may be: the others decide which states and steps
        # the kernel touches, which the entry must know (a tensor amsgrad or momentum crashed the process)
        (dict(eps=torch.tensor(1e-8)), r"eps must be a number, not a tensor"),
        (dict(amsgrad=torch.tensor(1.0)), r"amsgrad must be a number, not a tensor"),
        (dict(amsgrad=0.5), r"amsgrad must be 0 or 1"),
    ]
    for override, message in bad:
        args = dict(params=[p], grads=[g], masters=[None], exp_avgs=[z()], exp_avg_sqs=[z()], max_exp_avg_sqs=[],
                    steps=[step], **base)
        found_inf = override.pop("found_inf", None)
        args.update(override)
        before = p.clone()
        with pytest.raises(ValueError, match=message):
            adam_kernel(args.pop("params"), args.pop("grads"), args.pop("masters"), args.pop("exp_avgs"),
                        args.pop("exp_avg_sqs"), args.pop("max_exp_avg_sqs"), args.pop("steps"),
                        found_inf=found_inf, **args)
        assert torch.equal(p, before) and step.item() == 0.0


def test_kernel_entry_rejects_a_tensor_momentum_and_validates_lr_without_params():
    p, g = torch.randn(6), torch.randn(6)
    hyper = dict(momentum=torch.tensor(0.9), dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False)
    before = p.clone()
    with pytest.raises(ValueError, match="momentum must be a number, not a tensor"):
        mpfused._ops.optim_step_("sgd", [p], [g], [None], {}, [], lr=0.1, hyper=hyper)
    assert torch.equal(p, before)
    with pytest.raises(ValueError, match="invalid lr"):
        mpfused._ops.optim_step_("sgd", [], [], [], {}, [], lr=-5.0, hyper=dict(hyper, momentum=0.0))


def _kernel_step(kind, device, **hyper):
    """One step of the kernel entry on fixed data; returns the param."""
    g = torch.Generator().manual_seed(3)
    p, grad = (torch.randn(1000, generator=g).to(device) for _ in range(2))
    z = lambda: torch.zeros(1000, device=device)  # noqa: E731
    step = torch.full((), 2.0, device=device)
    if kind == "adam":
        kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False,
                  decoupled=True)
        kw.update(hyper)
        adam_kernel([p], [grad], [None], [z() + 0.1], [z() + 0.2], [], [step], **kw)
    else:
        kw = dict(lr=1e-2, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False)
        kw.update(hyper)
        lr = kw.pop("lr")
        mpfused._ops.optim_step_("sgd", [p], [grad], [None], dict(momentum_buffer=[z() + 0.1]), [step], lr=lr, hyper=kw)
    return p


@pytest.mark.parametrize("kind,key,value", [("adam", "beta1", 0.5), ("adam", "beta2", 0.75),
                                            ("sgd", "weight_decay", 0.25)])
def test_a_tensor_hyperparameter_is_read_by_the_kernel_as_its_value(kind, key, value, device):
    # value, 0.5 and 0.75 and 0.25, are exact in float32 and float64: every form gives the same bits.
    plain = _kernel_step(kind, device, **{key: value})
    for dtype in (torch.float32, torch.float64):
        t = torch.tensor(value, dtype=dtype, device=device)
        assert torch.equal(_kernel_step(kind, device, **{key: t}), plain)
        assert torch.equal(_kernel_step(kind, device, **{key: t.reshape(1)}), plain)
    # A float32 tensor holds float32(0.9): the update uses that value, as torch's .item() would.
    t = torch.tensor(0.9, dtype=torch.float32, device=device)
    assert torch.equal(_kernel_step(kind, device, **{key: t}), _kernel_step(kind, device, **{key: float(t)}))
    assert not torch.equal(_kernel_step(kind, device, **{key: t}), plain)


def test_state_whose_strides_differ_only_on_size_one_dims_is_accepted(device):
    """A (8, 1, 3, 3) param in channels_last has strides (9, 1, 3, 1); contiguous state and grad have
    (9, 9, 3, 1). The stride of a size-1 dim never addresses memory, so both lay out their elements alike:
    the kernel takes them, and the result equals the all-contiguous step bit for bit."""
    g = torch.Generator().manual_seed(5)
    base, grad = (torch.randn(8, 1, 3, 3, generator=g).to(device) for _ in range(2))
    results = []
    for p in (base.clone(), base.clone().to(memory_format=torch.channels_last)):
        m, v, step = torch.zeros_like(grad), torch.zeros_like(grad), torch.zeros((), device=device)
        adam_kernel([p], [grad.clone()], [None], [m], [v], [], [step], lr=1e-2, beta1=0.9, beta2=0.999,
                    eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=False, decoupled=True)
        results.append(p)
    assert results[1].stride() != grad.stride()
    assert torch.equal(results[0], results[1])


# ---- CUDA only (skipped without a GPU) -----------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.profiler
@requires_cuda
def test_cuda_step_is_sync_free_one_launch_and_graph_capturable():
    params = [torch.nn.Parameter(torch.randn(1000 + i, device="cuda").half()) for i in range(50)]
    lr = torch.tensor(1e-3, device="cuda")
    opt = FusedAdamW(params, lr=lr)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # state initialisation happens outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            opt.step()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "kernel" in e.name.lower()]
    # step() lends the kernel a counter: the update's last block advances the steps, one launch per group
    assert len([k for k in kernels if "optim_kernel" in k.name or "step_increment" in k.name]) == 1
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        opt.step()
    step_before = opt.state[params[0]]["step"].item()
    lr.fill_(0.0)
    graph.replay()
    torch.cuda.synchronize()
    assert opt.state[params[0]]["step"].item() == step_before + 1


@pytest.mark.cuda
@pytest.mark.profiler
@requires_cuda
def test_cuda_kernel_entry_without_a_counter_launches_the_step_increment_and_gives_the_same_bits():
    """Without a counter (the kernel entry's other path) a second, small launch advances the steps after
    the update; with one, the update's last block does. Both give the same params, states and steps."""
    def run(counter):
        g = torch.Generator(device="cuda").manual_seed(11)
        params = [torch.randn(70000 + i, device="cuda", generator=g) for i in range(3)] + [torch.zeros(0, device="cuda")]
        grads = [torch.randn(p.shape, device="cuda", generator=g) for p in params]  # (both runs: the same)
        m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
        steps = [torch.zeros((), device="cuda") for _ in params]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                mpfused._ops.optim_step_("adam", params, grads, [None] * 4, dict(exp_avg=m, exp_avg_sq=v), steps,
                                         lr=1e-2, hyper=dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                                                             amsgrad=False, maximize=False, decoupled=True),
                                         counter=torch.zeros(1, dtype=torch.int32, device="cuda") if counter else None)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        launches = (sum("optim_kernel" in n for n in names), sum("step_increment" in n for n in names))
        return params + m + v, [float(s) for s in steps], launches

    with_counter, without = run(True), run(False)
    assert with_counter[2][0] == without[2][0] == 2
    assert without[2][1] == 2  # one increment launch per step
    assert with_counter[2][1] == 2  # the empty tensor's step: no update launch holds it
    assert with_counter[1] == without[1] == [2.0] * 4
    for a, b in zip(with_counter[0], without[0]):
        assert torch.equal(a, b)


# ---- the scaler interface and the exported base ------------------------------------------------------
def test_mpfused_scaler_hands_a_step_scaling_to_step_and_sets_nothing_on_the_optimizer(device):
    """mpfused.GradScaler talks to the optimizer through step(scaling=StepScaling(...)), not through
    attributes set on it from outside; the step it drives equals one given the same scaling by hand."""
    from mpfused.optim import StepScaling

    model = mlp(device)
    ref = copy.deepcopy(model)
    opt, opt_ref = FusedAdamW(model.parameters(), lr=1e-2), FusedAdamW(ref.parameters(), lr=1e-2)
    scaler = mpfused.GradScaler(device, init_scale=2.0**8)
    seen = []
    step = opt.step

    def spy(*args, **kwargs):
        seen.append((kwargs.get("scaling"), set(vars(opt)) - before))
        return step(*args, **kwargs)

    before = set(vars(opt)) | {"step"}
    opt.step = spy
    (x, y), = batches(device, 1)
    for m in (model, ref):
        m.zero_grad()
    scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
    torch.nn.functional.cross_entropy(ref(x), y).mul(2.0**8).backward()
    total = scaler.clip_grad_norm_(opt, 0.5)
    scaler.step(opt)
    (scaling, added), = seen
    assert isinstance(scaling, StepScaling) and added == set()
    assert scaling.inv_scale is not None and scaling.found_inf is not None and scaling.clip[1] == 0.5
    # (the optimizer's own caches aside: its kernels' counters and its step plan)
    assert not any(k.startswith("_mpf_") and k not in ("_mpf_counters", "_mpf_plan", "_mpf_versions", "_mpf_spans",
                                                       "_mpf_memory")
               for k in vars(opt))  # (the optimizer's own: its counters, step plan, params' versions, spans, addresses)
    sumsq = torch.stack([p.grad.float().pow(2).sum() for p in ref.parameters()]).sum() / 2.0**16
    opt_ref.step(scaling=StepScaling(inv_scale=torch.tensor([2.0**-8], device=device),
                                     found_inf=torch.zeros(1, device=device), clip=(sumsq.reshape(1), 0.5)))
    assert torch.allclose(total, sumsq.sqrt())
    assert_params_close(model, ref)


def test_step_scaling_rejects_bad_values_before_any_step():
    from mpfused.optim import StepScaling

    one = torch.ones(1)
    with pytest.raises(ValueError, match="inv_scale or grad_scale, not both"):
        StepScaling(inv_scale=one, grad_scale=one)
    with pytest.raises(TypeError, match="StepScaling.found_inf must be a one-element tensor"):
        StepScaling(found_inf=torch.zeros(2))
    with pytest.raises(TypeError, match="StepScaling.clip must be"):
        StepScaling(clip=(one, -1.0))
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with pytest.raises(TypeError, match="scaling must be a mpfused.optim.StepScaling"):
        FusedAdamW([p]).step(scaling={"inv_scale": one})
    assert torch.equal(p, torch.ones(3))


def test_a_subclass_of_the_exported_base_is_an_optimizer_over_a_kernel_policy(device):
    """FusedOptimizer is public: a subclass naming a policy and defining its hyperparameters and state is
    a working optimizer (here a plain Adam without weight decay, against torch's)."""
    from mpfused.optim import FusedOptimizer

    class PlainAdam(FusedOptimizer):
        _policy = "adam"
        _state_float_keys = ("exp_avg", "exp_avg_sq", "master_param")

        def __init__(self, params, lr=1e-3):
            super().__init__(params, dict(lr=lr))

        def _check_group(self, group, where, in_step=False):
            if not group["lr"] >= 0:
                raise ValueError(f"Invalid learning rate: {group['lr']}{where}")

        def _init_state(self, group, p, state):
            state["step"] = torch.zeros((), device=p.device)
            state["exp_avg"], state["exp_avg_sq"] = self._fp32_zeros(p), self._fp32_zeros(p)

        def _hyper(self, group, device):
            return dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False,
                        decoupled=False)

    model = mlp(device)
    ref = copy.deepcopy(model)
    data = batches(device, 4)
    losses = train(model, PlainAdam(model.parameters(), lr=1e-2), data)
    ref_losses = train(ref, torch.optim.Adam(ref.parameters(), lr=1e-2), data)
    assert losses == pytest.approx(ref_losses, rel=OPTIM_LOSS_RTOL)
    assert_params_close(model, ref)


def test_meta_tensors_that_hold_no_value_are_named_before_anything_is_written():
    """A StepScaling tensor on the meta device, or FusedLAMB's global norm over CPU and meta params: torch's
    'Cannot copy out of meta tensor' (a NotImplementedError) came out of the copy, naming nothing. Now a
    ValueError names the argument, before any param is written."""
    from mpfused.optim import FusedLAMB, StepScaling

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = FusedAdamW([p], lr=0.1)
    meta = torch.ones(1, device="meta")
    for kw, name in [(dict(inv_scale=meta, found_inf=torch.zeros(1)), "inv_scale"),
                     (dict(grad_scale=meta), "grad_scale"),
                     (dict(found_inf=meta), "found_inf"),
                     (dict(inv_scale=torch.ones(1), clip=(meta, 1.0)), "clip\\[0\\]")]:
        with pytest.raises(ValueError, match=f"StepScaling.{name} .*is on the meta device"):
            opt.step(scaling=StepScaling(**kw))
        assert torch.equal(p, torch.ones(3)) and not opt.state.get(p)
    q = torch.nn.Parameter(torch.ones(3, device="meta"))
    q.grad = torch.ones(3, device="meta")
    with pytest.raises(ValueError, match="FusedLAMB's max_grad_norm .*devices: \\['cpu', 'meta'\\]"):
        FusedLAMB([p, q]).step()
    assert torch.equal(p, torch.ones(3))
    # FusedLAMB's own global norm unscales first: a meta or sparse scale there was torch's raw error
    lamb = FusedLAMB([p])
    for bad, what in ((meta, "is on the meta device"), (torch.ones(1).to_sparse(), "must be a dense tensor")):
        for key in ("inv_scale", "grad_scale"):
            with pytest.raises(ValueError, match=f"StepScaling.{key} {what}"):
                lamb.step(scaling=StepScaling(**{key: bad}))
    assert torch.equal(p, torch.ones(3)) and not lamb.state.get(p)
    # all on meta: the scale is taken as it is, as the other optimizers take it (shapes only)
    m = torch.nn.Parameter(torch.ones(3, device="meta"))
    m.grad = torch.ones(3, device="meta")
    FusedLAMB([m]).step(scaling=StepScaling(inv_scale=meta))


def test_an_expanded_grad_that_a_scaled_step_would_write_back_is_refused_before_any_write():
    """A step driven by a scaler writes the unscaled grad back; a grad laid out unlike its param goes through
    a copy, copied back after every group's kernel. An expand()ed grad cannot take that copy: the step raised
    there, with the params and step counts already updated. Now it raises before any write."""
    from mpfused.optim import StepScaling
    a, b = torch.nn.Parameter(torch.ones(2, 3)), torch.nn.Parameter(torch.ones(4))
    opt = FusedAdam([b, a], lr=0.1)
    b.grad, a.grad = torch.full((4,), 4.0), torch.full((1, 3), 4.0).expand(2, 3)
    with pytest.raises(ValueError, match=r"param 1 of param group 0: its grad overlaps itself in memory"):
        opt.step(scaling=StepScaling(inv_scale=torch.tensor([0.25]), found_inf=torch.zeros(1)))
    assert a.tolist() == [[1.0] * 3] * 2 and b.tolist() == [1.0] * 4 and not opt.state
    a.grad = a.grad.contiguous()
    opt.step(scaling=StepScaling(inv_scale=torch.tensor([0.25]), found_inf=torch.zeros(1)))
    assert torch.equal(a.grad, torch.ones(2, 3)) and a[0, 0].item() < 1.0


@pytest.mark.parametrize("cls, name", [(FusedAdam, "maximize"), (FusedAdam, "amsgrad"), (FusedAdamW, "maximize"),
                                       (FusedAdam, "decoupled_weight_decay"), (FusedSGD, "nesterov"),
                                       (FusedSGD, "maximize")])
def test_a_constructor_switch_that_is_not_a_bool_is_refused(cls, name):
    """bool() took any object: maximize="no" maximized. The constructors now check a switch as a param
    group's is checked (True, False, 0 or 1)."""
    kw = dict(momentum=0.9) if cls is FusedSGD else {}
    with pytest.raises(ValueError, match=f"Invalid {name}: expected True or False, got 'no'"):
        cls([torch.nn.Parameter(torch.zeros(3))], **kw, **{name: "no"})
    import numpy as np
    for value, want in ((0, False), (np.True_, True), (np.False_, False), (np.int64(1), True), (None, False)):
        assert cls([torch.nn.Parameter(torch.zeros(3))], **kw, **{name: value}).param_groups[0][name] is want


@pytest.mark.parametrize("arg", ["unscale", "overwrite"])
def test_a_check_switch_that_is_not_a_bool_is_refused_before_writing(arg):
    x, found = torch.full((3,), 4.0), torch.ones(1)
    with pytest.raises(ValueError, match=f"{arg} must be True or False, got 'False'"):
        mpfused.non_finite_check_([x], found, torch.full((1,), 0.5), **{arg: "False"})
    assert x.tolist() == [4.0] * 3 and found.item() == 1.0
    import numpy as np  # numpy's bools are switches (numpy 2 names their type "bool")
    mpfused.non_finite_check_([x], found, torch.full((1,), 0.5), **{arg: np.True_})
    assert x.tolist() == ([2.0] * 3 if arg == "unscale" else [4.0] * 3) and found.item() == (0.0 if arg == "overwrite" else 1.0)


def test_a_param_appended_twice_after_construction_is_named_as_the_same_tensor():
    """A param appended by hand to a second group (or twice to one) after construction: refused at the step,
    nothing written, saying it is the same tensor listed twice (it said 'different tensors over the same memory'
    and advised sharing one Parameter object, which is what the user had done)."""
    ps = [torch.nn.Parameter(torch.ones(3)) for _ in range(3)]
    opt = FusedAdamW([{"params": [ps[0]]}, {"params": [ps[1]]}, {"params": [ps[2]]}], lr=0.1)
    opt.param_groups[2]["params"].append(ps[0])
    for p in ps:
        p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="param 1 of param group 2 and param 0 of param group 0 are the same tensor"):
        opt.step()
    assert all(p.tolist() == [1.0] * 3 for p in ps) and not opt.state
    opt = FusedSGD([ps[1]], lr=0.1)
    opt.param_groups[0]["params"].append(ps[1])
    with pytest.raises(ValueError, match="param 1 of param group 0 and param 0 of param group 0 are the same tensor"):
        opt.step()
