"""mpfused.GradScaler against torch.amp.GradScaler: scale trajectory, skipping, fused clipping,
accumulation, state dicts, non-fused optimizers and two-process distributed training."""

import copy
import math

import pytest
import torch

import mpfused
from mpfused.optim import FusedAdamW, FusedSGD
from conftest import requires_cuda
from tolerances import CLIPPED_GRAD_TOL, FP16_ROUNDING_RTOL, OPTIM_FP32_ATOL


def model(device, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3)).to(device)


def data(device, n, batch=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 12, generator=g).to(device), torch.randint(0, 3, (batch,), generator=g).to(device))
            for _ in range(n)]


def loss_of(m, x, y):
    return torch.nn.functional.cross_entropy(m(x), y)


def run_pattern(scaler, overflow_pattern, device):
    """One param, one optimizer: an overflow wherever the pattern says 1. Returns (scale, tracker) per step."""
    p = torch.nn.Parameter(torch.ones(4, device=device))
    opt = torch.optim.SGD([p], lr=0.1) if isinstance(scaler, torch.amp.GradScaler) else FusedSGD([p], lr=0.1)
    out = []
    for bad in overflow_pattern:
        opt.zero_grad()
        loss = (p * (float("inf") if bad else 1.0)).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        out.append((scaler.get_scale(), scaler._get_growth_tracker()))
    return out


PATTERN = [0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]


@pytest.mark.sanitize
def test_scale_and_growth_tracker_follow_torch_exactly(device):
    kw = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.25, growth_interval=3)
    ours = run_pattern(mpfused.GradScaler(device, **kw), PATTERN, device)
    ref = run_pattern(torch.amp.GradScaler(device, **kw), PATTERN, device)
    assert ours == ref
    assert len({s for s, _ in ours}) >= 3  # the scale went up and down


@pytest.mark.sanitize
def test_hysteresis_tolerates_k_minus_1_consecutive_overflows(device):
    scaler = mpfused.GradScaler(device, init_scale=1024.0, growth_interval=100, hysteresis=3)
    scales = [s for s, _ in run_pattern(scaler, [1, 1, 0, 1, 1, 1, 1, 1, 1], device)]
    # two overflows tolerated, a clean step restores the allowance, then backoff at every third.
    assert scales == [1024.0, 1024.0, 1024.0, 1024.0, 1024.0, 512.0, 512.0, 512.0, 256.0]


@pytest.mark.sanitize
def test_min_and_max_scale_clamp(device):
    up = mpfused.GradScaler(device, init_scale=2.0**20, growth_interval=1, max_scale=2.0**22)
    assert [s for s, _ in run_pattern(up, [0] * 5, device)] == [2.0**21, 2.0**22, 2.0**22, 2.0**22, 2.0**22]
    down = mpfused.GradScaler(device, init_scale=8.0, growth_interval=1, min_scale=2.0)
    assert [s for s, _ in run_pattern(down, [1] * 4, device)] == [4.0, 2.0, 2.0, 2.0]


def test_static_scaling_keeps_the_scale_and_still_skips(device):
    scaler = mpfused.GradScaler(device, init_scale=128.0, growth_interval=1, dynamic=False)
    p = torch.nn.Parameter(torch.ones(3, device=device))
    opt = FusedSGD([p], lr=0.5)
    for bad in [0, 1, 0, 1]:
        before = p.detach().clone()
        opt.zero_grad()
        scaler.scale((p * (float("inf") if bad else 1.0)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 128.0
        assert torch.equal(p, before) == bool(bad)
        assert scaler.found_inf().item() == float(bad)


def test_skipped_step_leaves_params_and_state_bitwise_unchanged(device):
    m = model(device)
    opt = FusedAdamW(m.parameters(), lr=1e-2)
    scaler = mpfused.GradScaler(device, init_scale=256.0)
    (x, y), = data(device, 1)
    for bad in (False, True):
        opt.zero_grad()
        loss = loss_of(m, x, y) * (float("nan") if bad else 1.0)
        scaler.scale(loss).backward()
        scaler.clip_grad_norm_(opt, 1.0)
        params = [p.detach().clone() for p in m.parameters()]
        state = copy.deepcopy({i: s for i, s in enumerate(opt.state.values())})
        scaler.step(opt)
        scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(params, m.parameters()))
    for i, s in enumerate(opt.state.values()):
        assert all(torch.equal(v, state[i][k]) for k, v in s.items())
    assert scaler.get_scale() == 128.0


@pytest.mark.sanitize
@pytest.mark.parametrize("unscale_after", [False, True], ids=["fused-clip", "clip-then-unscale"])
@pytest.mark.parametrize("max_norm", [0.05, 100.0])
def test_fused_clipping_equals_torch_clip_on_unscaled_grads(device, max_norm, unscale_after):
    """The clip recorded by clip_grad_norm_ is applied in the fused update, or by unscale_() when it is
    called next (unscale_ used to drop it and clip nothing)."""
    ours_m, ref_m = model(device), model(device)
    ours, ref = FusedAdamW(ours_m.parameters(), lr=1e-2), torch.optim.AdamW(ref_m.parameters(), lr=1e-2)
    s_ours, s_ref = mpfused.GradScaler(device, init_scale=2.0**12), torch.amp.GradScaler(device, init_scale=2.0**12)
    for x, y in data(device, 6):
        ours.zero_grad()
        s_ours.scale(loss_of(ours_m, x, y)).backward()
        n_ours = s_ours.clip_grad_norm_(ours, max_norm)
        ref.zero_grad()
        s_ref.scale(loss_of(ref_m, x, y)).backward()
        s_ref.unscale_(ref)
        n_ref = torch.nn.utils.clip_grad_norm_(ref_m.parameters(), max_norm)
        if unscale_after:
            s_ours.unscale_(ours)
            for a, b in zip(ours_m.parameters(), ref_m.parameters()):
                torch.testing.assert_close(a.grad, b.grad, rtol=CLIPPED_GRAD_TOL[0], atol=CLIPPED_GRAD_TOL[1])
            with pytest.raises(RuntimeError, match="already been called"):
                s_ours.unscale_(ours)
        s_ours.step(ours)
        s_ours.update()
        s_ref.step(ref)
        s_ref.update()
        assert isinstance(n_ours, torch.Tensor) and n_ours.device.type == device
        assert n_ours.item() == pytest.approx(n_ref.item(), rel=1e-5)
    for a, b in zip(ours_m.parameters(), ref_m.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=OPTIM_FP32_ATOL)


def test_accumulation_over_4_micro_batches_equals_one_big_batch(device):
    big_m, acc_m = model(device), model(device)
    big, acc = FusedAdamW(big_m.parameters(), lr=1e-2), FusedAdamW(acc_m.parameters(), lr=1e-2)
    s_big, s_acc = mpfused.GradScaler(device, init_scale=2.0**10), mpfused.GradScaler(device, init_scale=2.0**10)
    for x, y in data(device, 5, batch=16):
        big.zero_grad()
        s_big.scale(loss_of(big_m, x, y)).backward()
        s_big.clip_grad_norm_(big, 1.0)
        s_big.step(big)
        s_big.update()
        acc.zero_grad()
        for xs, ys in zip(x.chunk(4), y.chunk(4)):
            s_acc.scale(loss_of(acc_m, xs, ys) / 4).backward()
        s_acc.clip_grad_norm_(acc, 1.0)
        s_acc.step(acc)
        s_acc.update()
    for a, b in zip(big_m.parameters(), acc_m.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=OPTIM_FP32_ATOL)


def test_non_fused_torch_optimizer_and_two_optimizers(device):
    ours_m, ref_m = model(device), model(device)
    ours_opts = [torch.optim.SGD(ours_m[0].parameters(), lr=0.1, momentum=0.9), FusedAdamW(ours_m[2].parameters())]
    ref_opts = [torch.optim.SGD(ref_m[0].parameters(), lr=0.1, momentum=0.9), torch.optim.AdamW(ref_m[2].parameters())]
    s_ours, s_ref = mpfused.GradScaler(device, init_scale=64.0, growth_interval=2), torch.amp.GradScaler(device, init_scale=64.0, growth_interval=2)
    for i, (x, y) in enumerate(data(device, 7)):
        for m, opts, s in [(ours_m, ours_opts, s_ours), (ref_m, ref_opts, s_ref)]:
            for o in opts:
                o.zero_grad()
            loss = loss_of(m, x, y) * (float("inf") if i == 2 else 1.0)
            s.scale(loss).backward()
            for o in opts:
                s.step(o)
            s.update()
        assert s_ours.get_scale() == s_ref.get_scale()
    for a, b in zip(ours_m.parameters(), ref_m.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=OPTIM_FP32_ATOL)


def test_state_dict_interchange_with_torch_both_ways(device):
    ours = mpfused.GradScaler(device, init_scale=512.0, growth_interval=3, hysteresis=2)
    run_pattern(ours, [0, 0, 1, 1, 0], device)
    sd = ours.state_dict()
    assert {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"} <= set(sd)
    ref = torch.amp.GradScaler(device)
    ref.load_state_dict(sd)
    assert ref.get_scale() == ours.get_scale() and ref._get_growth_tracker() == ours._get_growth_tracker()
    run_pattern(ref, [0, 0, 0], device)
    back = mpfused.GradScaler(device)
    back.load_state_dict(ref.state_dict())
    assert back.get_scale() == ref.get_scale() and back._get_growth_tracker() == ref._get_growth_tracker()
    assert back.get_growth_interval() == 3
    mirror = mpfused.GradScaler(device)
    mirror.load_state_dict(sd)
    assert mirror.state_dict() == sd


def test_disabled_scaler_is_a_pass_through(device):
    scaler = mpfused.GradScaler(device, enabled=False)
    t = torch.ones(3, device=device)
    assert scaler.scale(t) is t and scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    p = torch.nn.Parameter(torch.ones(2, device=device))
    opt = FusedSGD([p], lr=1.0)
    p.grad = torch.full_like(p, 3.0)
    norm = scaler.clip_grad_norm_(opt, 1e9)
    assert norm.item() == pytest.approx(18**0.5)
    scaler.step(opt)
    scaler.update()
    assert torch.equal(p.detach(), torch.full((2,), -2.0, device=device))


@pytest.mark.parametrize("cls", [mpfused.GradScaler, torch.amp.GradScaler])
def test_setters_of_a_disabled_scaler_store_their_values_as_torchs_do(cls):
    # A script written for GradScaler("cuda") that runs on a CPU-only machine (or with enabled=use_amp):
    # ours raised AttributeError, checking the value against a factor a disabled scaler never stored.
    scaler = cls("cpu", enabled=False)
    scaler.set_growth_factor(3.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(0)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (3.0, 0.25, 0)
    assert not scaler.is_enabled()
    if cls is mpfused.GradScaler:  # an enabled one still checks them
        enabled = cls("cpu")
        with pytest.raises(AssertionError, match="growth factor must be > 1.0"):
            enabled.set_growth_factor(0.5)
        with pytest.raises(ValueError, match="new_interval"):
            enabled.set_growth_interval(0)


def clip_run(device, opt_cls, max_norm, **kwargs):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(6, device=device))
    scaler = mpfused.GradScaler(device, init_scale=1024.0)
    opt = opt_cls([p], lr=1.0)
    scaler.scale((p * torch.arange(6.0, device=device)).sum()).backward()
    norm = scaler.clip_grad_norm_(opt, max_norm, **kwargs)
    scaler.step(opt)
    scaler.update()
    return norm, p.detach()


@pytest.mark.parametrize("opt_cls", [FusedSGD, torch.optim.SGD])
def test_clip_takes_what_torchs_clip_takes(device, opt_cls):
    np = pytest.importorskip("numpy")
    # inf: the norm alone, no clip (torch's idiom for logging the norm); numpy numbers and CPU tensors
    norm, p = clip_run(device, opt_cls, float("inf"))
    norm0, p0 = clip_run(device, torch.optim.SGD, 1e30)
    assert torch.equal(norm, norm0) and torch.equal(p, p0) and float(norm) == pytest.approx(55**0.5)
    for max_norm in (np.float32(0.5), torch.tensor(0.5), 0.5):
        norm, p = clip_run(device, opt_cls, max_norm)
        assert torch.equal(p, clip_run(device, torch.optim.SGD, 0.5)[1])
    for bad in (float("nan"), -1.0, torch.tensor([0.5, 1.0])):
        with pytest.raises(ValueError, match="max_norm must be"):
            clip_run(device, opt_cls, bad)
    with pytest.raises(TypeError, match="torch.nn.utils.clip_grad_norm_ is the one that takes params"):
        mpfused.GradScaler(device).clip_grad_norm_([torch.nn.Parameter(torch.ones(2, device=device))], 1.0)


@pytest.mark.parametrize("opt_cls", [FusedSGD, torch.optim.SGD])
def test_clip_error_if_nonfinite_raises_as_torchs(device, opt_cls):
    p = torch.nn.Parameter(torch.ones(2, device=device))
    scaler = mpfused.GradScaler(device)
    opt = opt_cls([p], lr=1.0)
    scaler.scale((p * float("inf")).sum()).backward()
    with pytest.raises(RuntimeError, match="The total norm of order 2.0 for gradients from `parameters` is non-finite"):
        scaler.clip_grad_norm_(opt, 1.0, error_if_nonfinite=True, foreach=None)
    scaler.clip_grad_norm_(opt, 1.0, error_if_nonfinite=False)  # (the fused path recorded nothing: again)
    scaler.step(opt)
    scaler.update()
    assert torch.equal(p.detach(), torch.ones(2, device=device)) and scaler.get_scale() == 2.0**15


def test_scale_handles_nested_outputs(device):
    scaler = mpfused.GradScaler(device, init_scale=4.0)
    a, b, c = (torch.ones(2, device=device) * k for k in (1, 2, 3))
    out = scaler.scale([a, (b, [c])])
    assert isinstance(out, list) and isinstance(out[1], tuple)
    assert out[0].tolist() == [4.0, 4.0] and out[1][1][0].tolist() == [12.0, 12.0]
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        scaler.scale([a, 3.0])


@pytest.mark.parametrize("kwargs, message", [
    (dict(init_scale=0.0), "init_scale"),
    (dict(init_scale=float("inf")), "init_scale"),
    (dict(growth_factor=float("nan")), "growth_factor"),
    (dict(init_scale=-1.0), "init_scale"),
    (dict(growth_interval=0), "growth_interval"),
    (dict(growth_interval=2.5), "growth_interval"),
    (dict(backoff_factor=0.0), "backoff_factor"),
    (dict(backoff_factor=-0.5), "backoff_factor"),
    (dict(init_scale=True), "init_scale"),
    (dict(init_scale="8"), "init_scale"),
    (dict(hysteresis=0), "hysteresis"),
    (dict(min_scale=4.0, max_scale=2.0), "min_scale"),
    (dict(init_scale=2.0**30, max_scale=2.0**24), r"init_scale .* must lie in"),
    (dict(process_group=object()), "grad_sharding must be 'replicated'"),
    (dict(grad_sharding="zero"), "grad_sharding must be None"),
    (dict(dynamic="no"), "Invalid dynamic: expected True or False"),  # (bool("no") is True: it was dynamic)
])
def test_invalid_arguments_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mpfused.GradScaler("cpu", **kwargs)


def test_setters_validate_and_name_the_argument():
    with pytest.raises(ValueError, match="device must be a device type"):
        mpfused.GradScaler("foo")
    scaler = mpfused.GradScaler("cpu")
    for setter, bad in [(scaler.set_backoff_factor, 0.0), (scaler.set_backoff_factor, -1.0),
                        (scaler.set_growth_factor, float("nan")), (scaler.set_growth_interval, 0)]:
        with pytest.raises(ValueError, match="new_"):
            setter(bad)
    assert (scaler.get_backoff_factor(), scaler.get_growth_factor(), scaler.get_growth_interval()) == (0.5, 2.0, 2000)


def test_numbers_torch_takes_are_taken(device):
    """numpy scalars, one-element tensors and integral floats (a checkpoint or a config may hold them; torch's
    scaler takes them): stored as Python numbers, and the scaler runs as with plain ones."""
    np = pytest.importorskip("numpy")
    odd = mpfused.GradScaler(device, init_scale=np.float32(1024.0), growth_factor=torch.tensor(2.0),
                             backoff_factor=np.float64(0.5), growth_interval=np.int64(2), hysteresis=np.int32(1))
    plain = mpfused.GradScaler(device, init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
    assert type(odd._init_scale) is float and type(odd._growth_interval) is int
    assert run_pattern(odd, PATTERN, device) == run_pattern(plain, PATTERN, device)
    sd = dict(plain.state_dict(), scale=torch.tensor(plain.get_scale()), growth_interval=3.0,
              _growth_tracker=torch.tensor(1), backoff_factor=np.float32(0.25), _skipped_steps=np.int64(4))
    odd.load_state_dict(sd)
    got = odd.state_dict()
    assert got["scale"] == plain.get_scale() and got["growth_interval"] == 3 and got["_growth_tracker"] == 1
    assert got["backoff_factor"] == 0.25 and odd.skipped_steps == 4


@pytest.mark.parametrize("cls", [torch.optim.SGD, FusedSGD])
@pytest.mark.parametrize("write", ["fill_", "new tensor", "new tensors of shape (1,)"])
def test_a_scale_written_from_outside_is_the_one_unscaled_by(device, cls, write):
    """Code that writes ``_scale`` (a cap, a reset after NaNs: ``scaler._scale.fill_(s)``) changes what the
    gradients are divided by, as with torch's scaler; both scalers must leave the same grads and params.
    Also with a scale and growth tracker of shape (1,), as torch's older scalers made them (the next scale()
    raised a broadcast error)."""
    results = []
    for scaler_cls in (torch.amp.GradScaler, mpfused.GradScaler):
        p = torch.nn.Parameter(torch.ones(3, device=device))
        opt = cls([p], lr=0.1)
        scaler = scaler_cls(device, init_scale=1024.0)
        grads = []
        for it in range(3):
            opt.zero_grad()
            if it == 1:
                if write == "fill_":
                    scaler._scale.fill_(8.0)
                elif write == "new tensor":
                    scaler._scale = torch.full((), 8.0, device=device)
                else:
                    scaler._scale = torch.full((1,), 8.0, device=device)
                    scaler._growth_tracker = torch.full((1,), 1, dtype=torch.int32, device=device)
            scaler.scale((p * torch.tensor([1.0, 2.0, 3.0], device=device)).sum()).backward()
            scaler.unscale_(opt)
            grads.append(p.grad.tolist())
            scaler.step(opt)
            scaler.update()
        results.append((grads, p.tolist(), scaler.get_scale(), scaler.state_dict()["_growth_tracker"]))
    assert results[0] == results[1]
    assert results[1][0] == [[1.0, 2.0, 3.0]] * 3


def test_a_scale_tensor_without_one_element_is_named():
    scaler = mpfused.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    scaler._scale = torch.full((2,), 8.0)
    with pytest.raises(ValueError, match=r"_scale must be a tensor with one element .* got a tensor of shape \(2,\)"):
        scaler.scale(torch.ones(()))


def test_unscale_after_clip_grad_norm_works_with_every_optimizer(device):
    """clip_grad_norm_ then unscale_ (the order the fused clip allows) also with torch's optimizers, whose
    gradients clip_grad_norm_ unscales itself: unscale_ then has nothing left to do. A second unscale_
    still raises, as torch's does."""
    for cls in (torch.optim.SGD, FusedSGD):
        p = torch.nn.Parameter(torch.ones(4, device=device))
        opt = cls([p], lr=0.1)
        scaler = mpfused.GradScaler(device, init_scale=64.0)
        scaler.scale((p * 3.0).sum()).backward()
        norm = scaler.clip_grad_norm_(opt, 1.0)
        scaler.unscale_(opt)
        assert norm.item() == pytest.approx(6.0)
        assert p.grad.tolist() == pytest.approx([0.5] * 4, rel=1e-5), cls
        with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        assert p.tolist() == pytest.approx([0.95] * 4, rel=1e-6), cls


def test_a_grad_that_cannot_be_written_stops_unscale_before_any_grad_is(device):
    """An expand()ed grad goes to torch's op, which refuses to write it, but only after our kernel had
    unscaled the grads before it: a retry then unscaled those twice. Now nothing is written."""
    a, b = torch.nn.Parameter(torch.ones(4, device=device)), torch.nn.Parameter(torch.ones(4, device=device))
    opt = torch.optim.SGD([a, b], lr=0.1)
    scaler = mpfused.GradScaler(device, init_scale=4.0)
    scaler.scale(torch.ones((), device=device))
    a.grad = torch.full((4,), 8.0, device=device)
    b.grad = torch.full((1,), 8.0, device=device).expand(4)
    with pytest.raises(RuntimeError, match="param 1 of param group 0: its grad has elements that share memory"):
        scaler.unscale_(opt)
    assert a.grad.tolist() == [8.0] * 4
    b.grad = b.grad.clone()
    scaler.unscale_(opt)
    assert a.grad.tolist() == [2.0] * 4 and b.grad.tolist() == [2.0] * 4
    # an integer grad (set through .data): torch's op refused it after the float grads were unscaled
    scaler = mpfused.GradScaler(device, init_scale=4.0)
    scaler.scale(torch.ones((), device=device))
    a.grad, b.grad = torch.full((4,), 8.0, device=device), torch.zeros(4, device=device)
    b.grad.data = torch.ones(4, dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="param 1 of param group 0: its grad is a torch.int32 tensor"):
        scaler.unscale_(opt)
    assert a.grad.tolist() == [8.0] * 4


def test_update_checks_a_cpu_tensor_new_scale():
    scaler = mpfused.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    for bad in (float("nan"), -4.0, 0.0):
        with pytest.raises(ValueError, match="new_scale must be a finite number"):
            scaler.update(torch.tensor(bad))
    scaler.update(torch.tensor(16.0))
    assert scaler.get_scale() == 16.0 and scaler._inv_scale.item() == 1 / 16


def test_scales_that_float32_cannot_hold_with_a_finite_inverse_raise():
    """A scale is a float32 tensor, and its inverse too: 1e-46 would be stored as 0 (every gradient 0, the
    unscale 0 * inf = NaN) and 1e-40 as a subnormal whose inverse is inf. FP32's smallest normal number is the
    smallest scale taken, in every place a scale comes in."""
    for bad in (1e-46, 1e-40, 2.0**-127):
        with pytest.raises(ValueError, match="init_scale must be a finite number in \\[2\\*\\*-126"):
            mpfused.GradScaler("cpu", init_scale=bad)
    smallest = mpfused.GradScaler("cpu", init_scale=2.0**-126)
    assert smallest.scale(torch.ones(())).item() == 2.0**-126
    assert math.isfinite(smallest._inv_scale.item())
    scaler = mpfused.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    for bad in (1e-46, torch.tensor(1e-40)):
        with pytest.raises(ValueError, match="new_scale must be a finite number"):
            scaler.update(bad)
    # a state dict may hold any positive scale the updates reached (126 overflows in a row without min_scale
    # take it below 2**-126), and a scaler's own checkpoints always load
    low = mpfused.GradScaler("cpu", init_scale=2.0**-120)
    low.scale(torch.ones(()))
    for _ in range(10):
        low._scale.mul_(0.5)  # what ten backoffs do
    other = mpfused.GradScaler("cpu", init_scale=4.0)
    other.load_state_dict(low.state_dict())
    assert other.get_scale() == 2.0**-130
    with pytest.raises(ValueError, match="state_dict\\['scale'\\] must be a finite number in \\(0"):
        scaler.load_state_dict(dict(scaler.state_dict(), scale=1e-46))  # 0 as a float32
    assert scaler.get_scale() == 4.0
    with pytest.raises(ValueError, match="growth_factor must be a number > 1, got a tensor on the meta device"):
        mpfused.GradScaler("cpu", growth_factor=torch.tensor(2.0, device="meta"))


def test_torch_scaler_drives_a_fused_optimizer_without_grads(device):
    """torch.amp.GradScaler hands a fused optimizer found_inf = sum([]) = 0 (an int) when no param has a
    grad (a frozen branch, a second optimizer unused this iteration): a step that does nothing, as torch's
    fused optimizers take it."""
    p = torch.nn.Parameter(torch.ones(2, device=device))
    used = torch.nn.Parameter(torch.ones(2, device=device))
    idle, busy = FusedSGD([p], lr=0.1), FusedSGD([used], lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=4.0)
    scaler.scale(used.sum()).backward()
    scaler.step(idle)
    scaler.step(busy)
    scaler.update()
    assert p.tolist() == [1.0, 1.0] and used.tolist() == pytest.approx([0.9, 0.9])


# ---- drop-in: what frameworks check, read and call -----------------------------------------------------
def test_is_a_torch_grad_scaler_with_its_private_api(device):
    scaler = mpfused.GradScaler(device, init_scale=8.0)
    assert isinstance(scaler, torch.amp.GradScaler)
    assert scaler._enabled and scaler._init_scale == 8.0 and scaler._scale is None and scaler._growth_tracker is None
    scaler._lazy_init_scale_growth_tracker(torch.device(device))
    assert scaler._get_scale_async() is scaler._scale and scaler._scale.shape == ()
    p = torch.nn.Parameter(torch.ones(3, device=device))
    opt = FusedSGD([p], lr=1.0)
    p.grad = torch.full_like(p, float("inf"))
    found = scaler._check_inf_per_device(opt)
    assert scaler._found_inf_per_device(opt) is found and found[p.device].item() == 1.0
    assert set(scaler._per_optimizer_states[id(opt)]) == {"stage", "found_inf_per_device"}
    assert scaler._per_optimizer_states[id(opt)]["stage"] is torch.amp.grad_scaler.OptState.READY
    scaler.step(opt)  # uses the recorded flag: skipped
    assert p.tolist() == [1.0] * 3
    assert scaler._per_optimizer_states[id(opt)]["stage"] is torch.amp.grad_scaler.OptState.STEPPED


@pytest.mark.parametrize("case", ["channels_last", "float64", "strided"])
def test_grads_torch_accepts_are_accepted_with_torch_optimizers(device, case):
    """channels_last grads go to our kernel as a flat view of their memory; float64 and non-dense ones
    to torch's foreach op. Both scalers must leave the same params."""
    results = []
    for cls in (torch.amp.GradScaler, mpfused.GradScaler):
        torch.manual_seed(0)
        dtype = torch.float64 if case == "float64" else torch.float32
        conv = torch.nn.Conv2d(3, 4, 3).to(device=device, dtype=dtype)
        if case == "channels_last":
            conv = conv.to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(conv.parameters(), lr=0.1, momentum=0.9)
        scaler = cls(device, init_scale=2.0**10, growth_interval=1)
        x = torch.randn(2, 3, 6, 6, device=device, dtype=dtype)
        if case == "channels_last":
            x = x.to(memory_format=torch.channels_last)
        for it in range(3):
            opt.zero_grad()
            scaler.scale(conv(x).square().mean() * (float("inf") if it == 1 else 1.0)).backward()
            if case == "strided":
                conv.weight.grad = conv.weight.grad.transpose(0, 1).contiguous().transpose(0, 1)[:, :, ::1, :]
                assert not conv.weight.grad.is_contiguous()
            elif case == "channels_last":
                assert conv.weight.grad.is_contiguous(memory_format=torch.channels_last)
                assert not conv.weight.grad.is_contiguous()
            scaler.step(opt)
            scaler.update()
        results.append(([p.detach().clone() for p in conv.parameters()], scaler.get_scale()))
    assert results[0][1] == results[1][1] == 2.0**10 * 2 / 2 * 2
    for a, b in zip(results[0][0], results[1][0]):
        assert torch.equal(a, b)


class _PlainSGD(torch.optim.Optimizer):
    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def _apply(self, factor=1.0):
        for g in self.param_groups:
            for p in g["params"]:
                p.add_(p.grad, alpha=-g["lr"] * factor)


class _AmpAwareWithKwarg(_PlainSGD):
    """A third-party optimizer of the deprecated protocol: step() takes the scaler itself."""
    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        self.seen = grad_scaler
        found = sum(v.item() for v in grad_scaler._check_inf_per_device(self).values())
        if not found:
            self._apply(1.0 / grad_scaler.get_scale())


class _AmpAwareAttributes(_PlainSGD):
    """A third-party optimizer of the current protocol: grad_scale and found_inf set as attributes."""
    _step_supports_amp_scaling = True

    def step(self, closure=None):
        self.seen = (self.grad_scale.clone(), self.found_inf.clone())
        if not self.found_inf.item():
            self._apply(1.0 / self.grad_scale.item())


@pytest.mark.parametrize("opt_cls", [_AmpAwareWithKwarg, _AmpAwareAttributes])
def test_step_supports_amp_scaling_protocol_like_torch(device, opt_cls):
    outcomes = []
    for cls in (torch.amp.GradScaler, mpfused.GradScaler):
        p = torch.nn.Parameter(torch.ones(3, device=device))
        opt = opt_cls([p], lr=0.5)
        scaler = cls(device, init_scale=4.0)
        seen = []
        for bad in (False, True):
            opt.zero_grad()
            scaler.scale((p * (float("inf") if bad else 2.0)).sum()).backward()
            if opt_cls is _AmpAwareWithKwarg:
                with pytest.warns(FutureWarning, match="GradScaler is going to stop passing itself"):
                    scaler.step(opt)
                assert opt.seen is scaler
            else:
                scaler.step(opt)
                seen.append(tuple(t.item() for t in opt.seen))
                assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
            scaler.update()
        outcomes.append((p.tolist(), scaler.get_scale(), seen))
    assert outcomes[0] == outcomes[1]
    assert outcomes[1][0] == [0.0] * 3


def test_load_state_dict_validates_everything_first(device):
    scaler = mpfused.GradScaler(device, init_scale=64.0, hysteresis=2)
    run_pattern(scaler, [0, 1], device)
    before = scaler.state_dict()
    good = dict(before)
    for key, bad in [("scale", float("nan")), ("scale", -1.0), ("scale", 0.0), ("scale", float("inf")),
                     ("growth_factor", 1.0), ("backoff_factor", 1.0), ("growth_interval", 0),
                     ("_growth_tracker", -1), ("hysteresis", 0), ("_hysteresis_left", 0), ("_hysteresis_left", 3),
                     ("min_scale", -1.0), ("dynamic", "yes"), ("_skipped_steps", -2), ("backoff_factor", 0.0),
                     ("growth_interval", 2.5), ("scale", "8"), ("_growth_tracker", torch.ones(2))]:
        sd = dict(good, **{key: bad})
        with pytest.raises((ValueError, AssertionError)):
            scaler.load_state_dict(sd)
        assert scaler.state_dict() == before, key  # nothing was written
    with pytest.raises(KeyError, match="_growth_tracker"):
        scaler.load_state_dict({k: v for k, v in good.items() if k != "_growth_tracker"})
    assert scaler.state_dict() == before
    # a torch state dict (its five keys) loads, and the extras keep their values
    ref = torch.amp.GradScaler(device, init_scale=32.0)
    scaler.load_state_dict(ref.state_dict())
    assert scaler.get_scale() == 32.0 and scaler.get_hysteresis() == 2 and scaler.skipped_steps == 1


def test_counts_at_their_maxima_saturate_and_the_scale_still_grows(device):
    """A state dict may load the growth tracker at 2**31 - 1 and the skipped count at 2**63 - 1: the next
    clean step grows the scale (the tracker passed the interval) and the next overflow keeps the count at its
    maximum; neither wraps to a negative value that the scaler's own state dict would then refuse."""
    scaler = mpfused.GradScaler(device, init_scale=1024.0, growth_interval=5)
    scaler.load_state_dict(dict(scaler.state_dict(), _growth_tracker=2**31 - 1, _skipped_steps=2**63 - 1))
    (scale, tracker), = run_pattern(scaler, [0], device)
    assert (scale, tracker) == (2048.0, 0)
    run_pattern(scaler, [1], device)
    assert scaler.skipped_steps == 2**63 - 1 and scaler.get_scale() == 1024.0
    mpfused.GradScaler(device).load_state_dict(scaler.state_dict())  # still loads


def test_load_state_dict_keeps_a_dynamic_scale_within_its_clamps(device):
    """A scale outside the loaded clamps (a torch scaler's dict under ours, or update(new_scale) past them,
    which torch's API allows) is loaded clamped, with a warning: loaded as it was, the next backoff raised it
    to min_scale and a growth cut it to max_scale. The scaler's own dicts round-trip."""
    scaler = mpfused.GradScaler(device, init_scale=4.0)
    run_pattern(scaler, [0], device)
    before = scaler.state_dict()
    for clamps, want in (({"min_scale": 8.0, "max_scale": 16.0}, 8.0), ({"max_scale": 2.0}, 2.0)):
        fresh = mpfused.GradScaler(device, init_scale=4.0)
        with pytest.warns(UserWarning, match=r"state_dict\['scale'\] \(4.0\) lies outside \[min_scale, max_scale\]"):
            fresh.load_state_dict(dict(before, **clamps))
        assert fresh.get_scale() == want
        run_pattern(fresh, [1], device)  # a backoff never raises the scale
        assert fresh.get_scale() == max(want / 2, clamps.get("min_scale", 0.0))
    capped = mpfused.GradScaler(device, init_scale=4.0, max_scale=16.0)
    run_pattern(capped, [0], device)
    capped.update(2.0**20)  # torch's API: not clamped
    with pytest.warns(UserWarning, match="loaded as 16.0"):
        mpfused.GradScaler(device, init_scale=4.0, max_scale=16.0).load_state_dict(capped.state_dict())
    scaler.load_state_dict(dict(before, dynamic=False, min_scale=8.0))  # a static scale is not clamped
    assert scaler.get_scale() == 4.0
    # A scale the update clamped to a min_scale that float32 does not hold (0.7 is stored as 0.69999998...,
    # below 0.7) reloads: the clamps are compared as the update applies them.
    clamped = mpfused.GradScaler(device, init_scale=1.0, min_scale=0.7)
    run_pattern(clamped, [1], device)
    assert clamped.get_scale() == torch.tensor(0.7).item() < 0.7
    mpfused.GradScaler(device, init_scale=1.0, min_scale=0.7).load_state_dict(clamped.state_dict())


def test_numbers_too_large_for_a_float_raise_naming_the_argument(device):
    with pytest.raises(ValueError, match="init_scale must be .* too large for a float"):
        mpfused.GradScaler(device, init_scale=10**400)
    scaler = mpfused.GradScaler(device)
    with pytest.raises(ValueError, match=r"state_dict\['growth_factor'\] must be"):
        scaler.load_state_dict(dict(scaler.state_dict(), growth_factor=10**400))


def test_unscale_validates_every_grad_before_unscaling_any(device):
    scaler = mpfused.GradScaler(device, init_scale=4.0)
    scaler.scale(torch.ones((), device=device))
    a = torch.nn.Parameter(torch.ones(3, device=device))
    b = torch.nn.Parameter(torch.ones(3, device=device, dtype=torch.float16))
    opt = torch.optim.SGD([a, b], lr=1.0)
    a.grad, b.grad = torch.full_like(a, 4.0), torch.full_like(b, 4.0)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        scaler._unscale_grads_(opt, torch.full((), 0.25, device=device), torch.zeros((), device=device), False)
    assert a.grad.tolist() == [4.0] * 3  # the FP32 grad before it was not touched


def test_clip_grad_norm_twice_raises(device):
    scaler = mpfused.GradScaler(device)
    p = torch.nn.Parameter(torch.ones(2, device=device))
    opt = FusedSGD([p])
    scaler.scale(p.sum()).backward()
    scaler.clip_grad_norm_(opt, 1.0)
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_\(\) has already been called"):
        scaler.clip_grad_norm_(opt, 1.0)


@pytest.mark.parametrize("dynamic", [True, False])
def test_skipped_steps_are_counted_on_the_device(device, dynamic):
    scaler = mpfused.GradScaler(device, init_scale=16.0, dynamic=dynamic)
    assert scaler.skipped_steps == 0 and scaler.skipped_steps_async() is None and not scaler.last_step_skipped
    pattern = [0, 1, 1, 0, 1, 0]
    p = torch.nn.Parameter(torch.ones(2, device=device))
    opt = FusedSGD([p], lr=0.1)
    for i, bad in enumerate(pattern):
        opt.zero_grad()
        scaler.scale((p * (float("inf") if bad else 1.0)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        count = scaler.skipped_steps_async()
        assert count.device.type == device and count.dtype == torch.int64 and count.shape == ()
        assert count.item() == sum(pattern[: i + 1]) == scaler.skipped_steps
        assert scaler.last_step_skipped == bool(bad)
    restored = mpfused.GradScaler(device)
    restored.load_state_dict(scaler.state_dict())
    assert restored.skipped_steps == 3


def test_growth_after_lowering_the_interval_differs_from_torch_deliberately(device):
    """torch grows only when the tracker equals growth_interval: after set_growth_interval() lowers the
    interval below the tracker (or a state dict brings a larger tracker), its scale never grows again.
    Ours grows at the next clean step (tracker >= interval)."""
    scales = {}
    for name, cls in (("torch", torch.amp.GradScaler), ("mpfused", mpfused.GradScaler)):
        scaler = cls(device, init_scale=8.0, growth_interval=4)
        run_pattern(scaler, [0, 0, 0], device)
        scaler.set_growth_interval(2)
        scales[name] = [s for s, _ in run_pattern(scaler, [0, 0, 0], device)]
    assert scales["torch"] == [8.0, 8.0, 8.0]
    assert scales["mpfused"] == [16.0, 16.0, 32.0]


def test_disabled_scaler_clips_across_a_process_group_of_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        scaler = mpfused.GradScaler("cpu", enabled=False, process_group=dist.group.WORLD, grad_sharding="sharded")
        p = torch.nn.Parameter(torch.ones(4))
        p.grad = torch.full_like(p, 2.0)
        norm = scaler.clip_grad_norm_(FusedSGD([p]), 1.0)
        assert norm.item() == 4.0 and p.grad.tolist() == pytest.approx([0.5] * 4, rel=1e-6)
    finally:
        dist.destroy_process_group()


def test_a_process_group_clip_of_float64_grads_and_its_norm_type_check(tmp_path):
    # _foreach_norm(dtype=float32) refuses to narrow FP64 grads: the clip failed after unscaling them; a
    # norm_type it cannot take is refused before the grads are unscaled
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        p = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
        for sharding in ("replicated", "sharded"):
            scaler = mpfused.GradScaler("cpu", init_scale=4.0, process_group=dist.group.WORLD, grad_sharding=sharding)
            opt = torch.optim.SGD([p], lr=1.0)
            scaler.scale(torch.ones(()))
            p.grad = torch.full_like(p, 8.0)  # 2.0 unscaled: norm 4
            with pytest.raises(ValueError, match="only norm_type=2.0"):
                scaler.clip_grad_norm_(opt, 1.0, norm_type=1.0)
            assert torch.equal(p.grad, torch.full_like(p, 8.0))
            norm = scaler.clip_grad_norm_(opt, 1.0)
            assert norm.item() == pytest.approx(4.0) and p.grad.tolist() == pytest.approx([0.5] * 4, rel=1e-6)
    finally:
        dist.destroy_process_group()


def test_fused_iteration_reads_nothing_on_the_host(device, monkeypatch):
    """The Python of the fused path (clip_grad_norm_, step, update) never asks a tensor for a host value:
    item(), bool(), float(), int() and tolist() raise inside it. (On CUDA the sync-debug test checks
    the same end to end.)"""
    m = model(device)
    opt = FusedAdamW(m.parameters(), lr=1e-3)
    scaler = mpfused.GradScaler(device)
    (x, y), = data(device, 1)
    for it in range(2):
        opt.zero_grad()
        scaler.scale(loss_of(m, x, y)).backward()
        with monkeypatch.context() as mp:
            def forbidden(*args, **kwargs):
                raise AssertionError("host read of a tensor in the fused path")
            for name in ("item", "__bool__", "__float__", "__int__", "tolist"):
                mp.setattr(torch.Tensor, name, forbidden)
            norm = scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()
    assert torch.isfinite(norm).item() and scaler.skipped_steps == 0


# ---- CUDA only -------------------------------------------------------------------------------------
@pytest.mark.sanitize
@pytest.mark.cuda
@requires_cuda
def test_cuda_iteration_never_syncs():
    m = model("cuda").half()
    opt = FusedAdamW(m.parameters(), lr=torch.tensor(1e-3, device="cuda"))
    scaler = mpfused.GradScaler("cuda")
    x, y = torch.randn(8, 12, device="cuda").half(), torch.randint(0, 3, (8,), device="cuda")
    for it in range(3):
        opt.zero_grad(set_to_none=True)
        scaler.scale(torch.nn.functional.cross_entropy(m(x).float(), y)).backward()
        if it > 0:
            torch.cuda.set_sync_debug_mode("error")
        try:
            scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert scaler.found_inf().item() == 0.0


@pytest.mark.cuda
@pytest.mark.profiler
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_iteration_with_clipping_is_at_most_3_launches_per_group(dtype):
    m = model("cuda").to(dtype)
    opt = FusedAdamW(m.parameters(), lr=1e-3)  # one param group, one dtype
    scaler = mpfused.GradScaler("cuda")
    x, y = torch.randn(8, 12, device="cuda").to(dtype), torch.randint(0, 3, (8,), device="cuda")
    for it in range(3):
        opt.zero_grad(set_to_none=True)
        scaler.scale(torch.nn.functional.cross_entropy(m(x).float(), y)).backward()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            norm = scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()
            torch.cuda.synchronize()
        gpu = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        if it > 0:  # the first iteration also creates the optimizer state
            assert len(gpu) <= 3, gpu
    assert torch.isfinite(norm).item() and norm.item() > 0
    # The steps were incremented by the update launch's last block (no separate launch): all 3 taken.
    assert all(s["step"].item() == 3.0 for s in opt.state.values())


def test_clip_grad_norm_without_any_grad_returns_zero_like_torch(device):
    model = torch.nn.Linear(3, 2).to(device)
    for opt in (FusedSGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)):
        scaler = mpfused.GradScaler(device)
        scaler.scale(torch.ones((), device=device))
        norm = scaler.clip_grad_norm_(opt, 1.0)
        assert norm.item() == 0.0 == torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()


def test_fused_clip_of_strided_fp16_grads_whose_scaled_norm_exceeds_fp16(device):
    """Strided FP16 grads take torch's foreach path: their scaled norm (~2e5) is beyond FP16's range, so it
    must be taken in FP32, or the clip coefficient becomes 0 and the step silently does nothing."""
    p = torch.nn.Parameter(torch.zeros(64, 64, dtype=torch.float16, device=device))
    opt = FusedSGD([p], lr=1.0)
    scaler = mpfused.GradScaler(device, init_scale=2.0**16)
    scaler.scale(torch.ones((), device=device))
    p.grad = torch.full((64, 128), 0.05 * 2.0**16, dtype=torch.float16, device=device)[:, ::2]
    unscaled = torch.full((64, 64), 0.05, dtype=torch.float16, device=device).float()  # the FP16 value of 0.05
    expected = unscaled.norm()
    norm = scaler.clip_grad_norm_(opt, 1.0)
    assert norm.item() == pytest.approx(expected.item(), rel=CLIPPED_GRAD_TOL[0])
    scaler.step(opt)
    scaler.update()
    assert scaler.skipped_steps == 0
    # the step moved p by the clipped gradient (FP16 storage of the FP32 master)
    torch.testing.assert_close(p.float(), (-unscaled / expected).half().float(), rtol=FP16_ROUNDING_RTOL, atol=0)


def test_a_param_listed_twice_in_a_torch_optimizer_is_named_before_anything_is_unscaled():
    """torch's optimizers only warn about a param listed twice, and torch's scaler then unscales its grad
    twice (0.25 where 0.5 is meant). Ours names both places before any grad is unscaled."""
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = torch.optim.SGD([p, q, p], lr=0.1)
    scaler = mpfused.GradScaler("cpu", init_scale=2.0)
    scaler.scale(torch.ones(()))
    p.grad, q.grad = torch.ones(3), torch.ones(2)
    with pytest.raises(ValueError, match="param 2 of param group 0 has the grad of param 0 of param group 0"):
        scaler.unscale_(opt)
    assert p.grad.tolist() == [1.0] * 3 and q.grad.tolist() == [1.0] * 2


@pytest.mark.parametrize("fused", [False, True], ids=["torch-sgd", "fused-adamw"])
def test_grads_over_the_same_memory_are_named_by_param_before_anything_is_unscaled(fused):
    """Two params' grads that are overlapping views of one tensor: unscale_ (the kernel's own check) names
    the two params, not the kernel's list, and leaves every grad as it was."""
    base = torch.arange(1.0, 11.0)
    params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(6)), torch.nn.Parameter(torch.ones(6))]
    opt = FusedAdamW(params) if fused else torch.optim.SGD([params[0], params[1]], lr=0.1)
    if not fused:
        opt.add_param_group(dict(params=[params[2]]))
    params[0].grad, params[1].grad, params[2].grad = torch.ones(2), base[:6], base[4:]
    scaler = mpfused.GradScaler("cpu", init_scale=2.0)
    scaler.scale(torch.ones(()))
    second = "param 2 of param group 0" if fused else "param 0 of param group 1"
    with pytest.raises(ValueError, match=f"the grads of param 1 of param group 0 and of {second} share memory"):
        scaler.unscale_(opt)
    assert params[0].grad.tolist() == [1.0] * 2 and torch.equal(base, torch.arange(1.0, 11.0))
    # two views that start at the same address: two params named, not one twice
    square = torch.arange(1.0, 5.0).reshape(2, 2)
    pair = [torch.nn.Parameter(torch.ones(2, 2)) for _ in range(2)]
    pair[0].grad, pair[1].grad = square, square.t()
    with pytest.raises(ValueError, match="the grads of param 0 of param group 0 and of param 1 of param group 0 share"):
        scaler.unscale_(torch.optim.SGD(pair, lr=0.1))


class _CountingAdamW(FusedAdamW):
    """A subclass that overrides step() with torch's signature, as training code does to log or count."""

    calls = 0

    def step(self, closure=None):
        type(self).calls += 1
        return super().step(closure)


class _TwiceAdamW(FusedAdamW):
    """A subclass whose step() calls FusedOptimizer.step twice (two updates an iteration)."""

    def step(self, closure=None):
        super().step(closure)
        return super().step(closure)


class _OwnAdamW(FusedAdamW):
    """A subclass whose step() never reaches FusedOptimizer.step: a plain SGD update of its own."""

    def step(self, closure=None, **kwargs):  # (**kwargs taken and not passed on)
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-group["lr"])


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("bad", [False, True])
def test_scaler_steps_a_subclass_whose_step_takes_no_scaling(clip, bad):
    """mpfused.GradScaler hands a fused optimizer its scaling as step(scaling=...); a subclass's own
    step(closure=None) cannot take it, and got a TypeError. Such a subclass is now stepped as torch's scaler
    steps an optimizer without native scaling (grads unscaled and clipped in place, the step skipped on a host
    read of found_inf): the same result as the plain class (skipped on an inf, clipped), whatever the subclass's
    step does with the grads (calls FusedOptimizer.step twice, or never)."""
    for sub in (_CountingAdamW, _TwiceAdamW, _OwnAdamW):
        results = []
        for cls in (FusedAdamW, sub):
            p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
            opt, scaler = cls([p], lr=0.1), mpfused.GradScaler("cpu", init_scale=8.0)
            grads, params = [], [p.detach().clone()]
            for it in range(3):
                loss = (p * p).sum() * (math.inf if bad and it == 1 else 1.0)
                scaler.scale(loss).backward()
                if clip:  # (deferred into the step, or applied by the unscale_ before a subclass's step)
                    scaler.clip_grad_norm_(opt, 1.0)
                scaler.step(opt)
                scaler.update()
                grads.append(p.grad.clone())
                params.append(p.detach().clone())
                opt.zero_grad()
            results.append((params, scaler.get_scale(), grads))
        (params0, scale0, grads0), (params1, scale1, grads1) = results
        assert scale0 == scale1
        assert torch.allclose(grads0[0], grads1[0])  # the first iteration's grads, unscaled (and clipped) alike
        if bad:  # the overflowing iteration is skipped: no param moves
            assert torch.equal(params1[2], params1[1]) and torch.equal(params0[2], params0[1])
        assert all(torch.isfinite(q).all() for q in params1)
        if sub is _CountingAdamW:
            assert torch.equal(params0[-1], params1[-1])
            assert _CountingAdamW.calls == 3 - bad  # (the skipped step is not called)
            _CountingAdamW.calls = 0


def test_a_process_group_that_is_not_one_is_refused_when_made():
    """It was taken, and the first step failed inside torch.distributed ('str' object has no attribute
    'allreduce')."""
    with pytest.raises(TypeError, match=r"process_group must be a torch.distributed.ProcessGroup \(.*\), got str"):
        mpfused.GradScaler("cpu", process_group="pg", grad_sharding="sharded")


def test_a_torch_scaler_dict_keeps_the_hysteresis_count():
    """torch's dict has no hysteresis count: it kept its value as every key torch's lacks does, as the
    docstring says, except this one, which was reset to the full hysteresis (the next overflow then did not
    back off)."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = FusedSGD([p], lr=0.1)
    scaler = mpfused.GradScaler("cpu", init_scale=256.0, hysteresis=3)
    for _ in range(2):
        opt.zero_grad()
        scaler.scale((p * math.inf).sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.state_dict()["_hysteresis_left"] == 1
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    torch_scaler.scale(p.sum())
    scaler.load_state_dict(torch_scaler.state_dict())
    assert scaler.state_dict()["_hysteresis_left"] == 1 and scaler.state_dict()["_skipped_steps"] == 2
    fresh = mpfused.GradScaler("cpu", hysteresis=2)
    fresh.load_state_dict(torch_scaler.state_dict())
    assert fresh.state_dict()["_hysteresis_left"] == 2
