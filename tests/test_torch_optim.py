"""torch's optimizer tests ported (in our own words): the OptimizerInfo configurations of Adam, AdamW and SGD
stepped side by side with torch.optim, and the generic Optimizer behaviours (state dicts, hooks, zero_grad,
add_param_group, deepcopy/pickle, printing), each run on torch's optimizer and ours with the same assertions."""

import copy
import io
import math
import pickle

import numpy as np
import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import mpfused
from mpfused.optim import FusedAdam, FusedAdamW, FusedSGD, StepScaling
from conftest import DEVICES, cuda_skip_reason, requires_cuda
from tolerances import OPTIM_FP32_ATOL

PAIRS = {"adam": (FusedAdam, torch.optim.Adam), "adamw": (FusedAdamW, torch.optim.AdamW),
         "sgd": (FusedSGD, torch.optim.SGD)}


class OnDevice:
    """A one-element tensor hyperparameter made on the test's device (a CUDA tensor in the cuda cases)."""

    def __init__(self, value, shape=()):
        self.value, self.shape = value, shape

    def make(self, device):
        return torch.full(self.shape, self.value, device=device)


class OnHost(OnDevice):
    """A one-element tensor hyperparameter on the CPU whatever the params' device (read on the host)."""

    def make(self, device):
        return torch.full(self.shape, self.value)


# The kwargs of torch's optim_inputs_func_adam / _adamw / _sgd (common_optimizers.py), as our own table.
ADAM_CONFIGS = [
    {}, dict(lr=0.01), dict(lr=OnDevice(0.001)), dict(lr=OnDevice(0.001, (1,))),
    dict(betas=(OnDevice(0.9), OnDevice(0.99))), dict(betas=(OnDevice(0.9, (1,)), OnDevice(0.99, (1,)))),
    dict(betas=(OnHost(0.9), OnHost(0.99))),
    dict(weight_decay=0.1), dict(weight_decay=0.1, maximize=True), dict(weight_decay=0.1, amsgrad=True),
    dict(amsgrad=True), dict(capturable=True), dict(capturable=True, amsgrad=True), dict(foreach=False),
    dict(foreach=True), dict(fused=True), dict(lr=np.float32(0.01), eps=np.float64(1e-6)),
]
SGD_CONFIGS = [
    {}, dict(lr=0.01), dict(lr=OnDevice(0.001)), dict(momentum=0.9), dict(momentum=0.9, dampening=0.5),
    dict(momentum=0.9, weight_decay=0.1), dict(momentum=0.9, nesterov=True, weight_decay=0.1),
    dict(weight_decay=0.1, maximize=True), dict(weight_decay=OnDevice(0.1)), dict(weight_decay=OnHost(0.1)),
    dict(momentum=np.float64(0.9), lr=np.float32(0.02)), dict(foreach=False), dict(fused=True),
]
CONFIGS = ([("adam", c) for c in ADAM_CONFIGS] + [("adamw", c) for c in ADAM_CONFIGS]
           + [("sgd", c) for c in SGD_CONFIGS])


def value_id(v):
    if isinstance(v, OnDevice):
        return f"{type(v).__name__}{list(v.shape)}"
    if isinstance(v, tuple):
        return "(" + ",".join(value_id(x) for x in v) + ")"
    return str(v) if isinstance(v, (bool, int, float)) else type(v).__name__


def config_id(c):
    name, kw = c
    return name + "-" + (",".join(f"{k}={value_id(v)}" for k, v in kw.items()) or "default")


def has_host_tensor(kw):
    return any(isinstance(x, OnHost) for v in kw.values() for x in (v if isinstance(v, tuple) else (v,)))


def device_params(items, ids):
    """(device, item) cases: every item on the CPU, and on CUDA (skipped with the reason when absent). On the
    CPU a host tensor is a device tensor, so those configurations run on CUDA only."""
    out = []
    for dev in DEVICES:
        name = dev if isinstance(dev, str) else dev.values[0]
        marks = () if isinstance(dev, str) else dev.marks
        for item, i in zip(items, ids):
            if name == "cpu" and has_host_tensor(item[1]):
                continue
            out.append(pytest.param(name, item, marks=marks, id=f"{name}-{i}"))
    return out


def materialize(kw, device):
    def one(v):
        if isinstance(v, OnDevice):
            return v.make(device)
        if isinstance(v, tuple):
            return tuple(one(x) for x in v)
        return v
    return {k: one(v) for k, v in kw.items()}


def torch_kwargs(kw):
    # torch runs its single-tensor reference: no foreach/fused/capturable choice. Its betas are 0-dim tensors
    # of the same values where ours have shape (1,): torch 2.9's reference passes beta1 to addcmul_ as a
    # number, which a 1-element tensor is not (newer torch takes either; the arithmetic is the same).
    kw = {k: v for k, v in kw.items() if k not in ("foreach", "fused", "capturable")}
    if isinstance(kw.get("betas", (None,))[0], torch.Tensor):
        kw["betas"] = tuple(b.reshape(()) for b in kw["betas"])
    return dict(kw, foreach=False)


def make_params(seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(7, 5, generator=g).to(device).requires_grad_(),
            torch.randn(5, generator=g).to(device).requires_grad_(),
            torch.randn(3, 4, 2, generator=g).to(device).requires_grad_()]


def two_groups(params, extra):
    return [dict(params=params[:2]), dict(params=params[2:], **extra)]


def step_side_by_side(name, ours_kw, theirs_kw, steps=6, group_extra=None, device="cpu"):
    ours_cls, theirs_cls = PAIRS[name]
    a, b = make_params(device=device), make_params(device=device)
    if group_extra is not None:
        opt_a, opt_b = ours_cls(two_groups(a, group_extra), **ours_kw), theirs_cls(two_groups(b, group_extra), **theirs_kw)
    else:
        opt_a, opt_b = ours_cls(a, **ours_kw), theirs_cls(b, **theirs_kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        step_both_and_compare(opt_a, opt_b, a, b, g, device)
    return opt_a, opt_b


def step_both_and_compare(opt_a, opt_b, a, b, gen, device):
    """The same random grads for params a (ours) and b (torch's), a step of each optimizer, equal params after."""
    for pa, pb in zip(a, b):
        grad = torch.randn(pa.shape, generator=gen).to(device)
        pa.grad, pb.grad = grad.clone(), grad.clone()
    opt_a.step()
    opt_b.step()
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pa, pb, atol=OPTIM_FP32_ATOL, rtol=0)


@pytest.mark.parametrize("device,config", device_params(CONFIGS, [config_id(c) for c in CONFIGS]))
def test_torch_optimizer_configuration_matches_torch_step_by_step(device, config):
    name, kw = config
    kw = materialize(kw, device)
    step_side_by_side(name, kw, torch_kwargs(kw), device=device)


GROUP_CASES = [("adam", dict(lr=0.02, betas=(0.5, 0.9), weight_decay=0.3, amsgrad=True)),
               ("adamw", dict(lr=0.05, eps=1e-3, maximize=True)),
               ("sgd", dict(lr=0.1, momentum=0.5, dampening=0.2, weight_decay=0.01))]


@pytest.mark.parametrize("device,case", device_params(GROUP_CASES, [n for n, _ in GROUP_CASES]))
def test_param_groups_with_different_hyperparameters_match_torch(device, case):
    name, extra = case
    step_side_by_side(name, {}, dict(foreach=False), group_extra=extra, device=device)


# ---- generic Optimizer behaviour, same assertions on torch's optimizer and ours ---------------------------
BOTH = [pytest.param(i, name, id=f"{'torch' if i else 'ours'}-{name}") for name in PAIRS for i in (0, 1)]


def build(which, name, params, **kw):
    cls = PAIRS[name][which]
    if name == "sgd":
        kw.setdefault("momentum", 0.9)
        kw.setdefault("dampening", 0.1)
    return cls(params, lr=0.01, **kw)


def fill_grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.device)


def step_both(opt_a, a, opt_b, b, seeds, atol=OPTIM_FP32_ATOL, fill=None):
    """Same grads for both (``fill``: fill_grads by default), one step each, params compared (atol 0: bitwise)."""
    fill = fill or fill_grads
    for s in seeds:
        fill(a, s)
        fill(b, s)
        opt_a.step()
        opt_b.step()
        for pa, pb in zip(a, b):
            torch.testing.assert_close(pb, pa, atol=atol, rtol=0)


@pytest.mark.parametrize("which,name", BOTH)
def test_state_dict_round_trip_then_identical_steps(which, name, device):
    a = make_params(device=device)
    opt = build(which, name, a)
    for s in range(3):
        fill_grads(a, s)
        opt.step()
    b = [p.detach().clone().requires_grad_() for p in a]
    opt2 = build(which, name, b)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    step_both(opt, a, opt2, b, range(3, 6), atol=0.0)


@pytest.mark.parametrize("name", PAIRS)
def test_a_torch_state_dict_loads_and_steps_like_torch(name, device):
    a, b = make_params(device=device), make_params(device=device)
    theirs, ours = build(1, name, a), build(0, name, b)
    for s in range(2):
        fill_grads(a, s)
        theirs.step()
    with torch.no_grad():
        for pa, pb in zip(a, b):
            pb.copy_(pa)
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
    step_both(theirs, a, ours, b, range(2, 5))


@pytest.mark.parametrize("which,name", BOTH)
def test_param_names_survive_state_dict_round_trip(which, name):
    model = torch.nn.Linear(3, 2)
    opt = build(which, name, model.named_parameters())
    assert opt.param_groups[0]["param_names"] == ["weight", "bias"]
    sd = opt.state_dict()
    assert sd["param_groups"][0]["param_names"] == ["weight", "bias"]
    opt2 = build(which, name, torch.nn.Linear(3, 2).named_parameters())
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["param_names"] == ["weight", "bias"]
    # A dict saved without names keeps the names this optimizer was built with.
    sd = opt.state_dict()
    del sd["param_groups"][0]["param_names"]
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["param_names"] == ["weight", "bias"]


@pytest.mark.parametrize("which,name", BOTH)
def test_step_and_state_dict_hooks_run(which, name):
    p = make_params()
    opt = build(which, name, p)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    opt.register_state_dict_pre_hook(lambda o: calls.append("sd-pre"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("sd-post"))
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load-pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))
    fill_grads(p, 0)
    opt.step()
    opt.load_state_dict(opt.state_dict())
    assert calls == ["pre", "post", "sd-pre", "sd-post", "load-pre", "load-post"]


@pytest.mark.parametrize("which,name", BOTH)
def test_step_hooks_order_global_hooks_and_replaced_arguments(which, name):
    # Our optimizers wrap step() themselves (FusedOptimizer.profile_hook_step, a cheaper profiler range):
    # the hooks must run as torch's wrapper runs them.
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    p = make_params()
    opt = build(which, name, p)
    calls = []
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("global-pre", o is opt))),
               register_optimizer_step_post_hook(lambda o, a, k: calls.append(("global-post", o is opt)))]
    try:
        opt.register_step_post_hook(lambda o, a, k: calls.append(("post", a[1:], k)))
        closure_calls = []

        def closure():
            closure_calls.append(1)
            return torch.tensor(3.0)

        # A pre-hook may replace the arguments: the step, the later pre-hooks and the post-hooks see the new ones.
        opt.register_step_pre_hook(lambda o, a, k: ((o,), {"closure": closure}))
        opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", a[1:], k)))
        fill_grads(p, 0)
        before = [q.detach().clone() for q in p]
        loss = opt.step()
        assert loss == 3.0 and closure_calls == [1]
        assert not any(torch.equal(a, b) for a, b in zip(before, p))
        assert calls == [("global-pre", True), ("pre", (), {"closure": closure}), ("post", (), {"closure": closure}),
                         ("global-post", True)]
    finally:
        for h in handles:
            h.remove()
    calls.clear()
    opt.register_step_pre_hook(lambda o, a, k: "not a pair")
    with pytest.raises(RuntimeError, match="must return None or a tuple of"):
        opt.step()


@pytest.mark.parametrize("name", PAIRS)
def test_step_hooks_see_the_arguments_torchs_scaler_passes(name):
    """mpfused.GradScaler hands its scale and flag to a fused step as ``scaling=``; the step hooks saw it, where
    torch's scaler, stepping torch's fused optimizers, passes no argument (it sets attributes). A hook that
    forwards its kwargs to another optimizer's step then failed. The step itself still gets it: an overflowing
    iteration is skipped (inside the step, which both fused optimizers take every iteration)."""
    results = []
    for scaler_cls, which in ((torch.amp.GradScaler, 1), (mpfused.GradScaler, 0)):
        p = make_params()
        opt = build(which, name, p, **({"fused": True} if which else {}))
        seen = []
        opt.register_step_pre_hook(lambda o, a, k: seen.append(("pre", a[1:], dict(k))))
        opt.register_step_post_hook(lambda o, a, k: seen.append(("post", a[1:], dict(k))))
        scaler = scaler_cls("cpu", init_scale=4.0)
        for poison in (1.0, math.inf):
            opt.zero_grad()
            scaler.scale(sum((q * poison).sum() for q in p)).backward()
            scaler.step(opt)
            scaler.update()
        results.append((seen, [q.detach().clone() for q in p], scaler.get_scale()))
    assert results[1][0] == results[0][0] == [("pre", (), {}), ("post", (), {})] * 2
    assert results[1][2] == results[0][2] == 2.0  # the second iteration overflowed and backed off
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=OPTIM_FP32_ATOL, rtol=0)


@pytest.mark.parametrize("which,name", BOTH)
def test_profiler_sees_step_and_zero_grad_by_torchs_names(which, name):
    from torch.profiler import ProfilerActivity, profile
    p = make_params()
    opt = build(which, name, p)
    fill_grads(p, 0)
    opt.step()
    fill_grads(p, 1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.step()
        opt.zero_grad()
    cls = type(opt).__name__
    events = {e.name: e for e in prof.events()}
    step = events[f"Optimizer.step#{cls}.step"]
    zero = events[f"Optimizer.zero_grad#{cls}.zero_grad"]
    assert step.is_user_annotation and zero.is_user_annotation  # the kind of event torch's range is
    if which == 0:  # our operator runs inside the step's range
        assert "mpfused::optim_step_" in {c.name for c in step.cpu_children}
    assert all(q.grad is None for q in p)


@pytest.mark.parametrize("name", PAIRS)
def test_a_subclass_overriding_step_runs_each_hook_once(name):
    # (torch's optimizers run them twice here: each class's step gets a wrapper once it has an instance, and
    # the subclass's step calls the parent's)
    cls = PAIRS[name][0]
    cls(make_params(), lr=0.01)

    class Sub(cls):
        def step(self, closure=None):
            return super().step(closure)

    p = make_params()
    opt = Sub(p, lr=0.01)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    fill_grads(p, 0)
    before = [q.detach().clone() for q in p]
    opt.step()
    assert calls == ["pre", "post"]
    assert not any(torch.equal(a, b) for a, b in zip(before, p))
    # and a hook that raises leaves the next step's hooks running
    opt.register_step_pre_hook(lambda o, a, k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        opt.step()
    calls.clear()
    opt._optimizer_step_pre_hooks.popitem()
    opt.step()
    assert calls == ["pre", "post"]


@pytest.mark.parametrize("which,name", BOTH)
def test_steps_on_two_threads_each_run_the_hooks(which, name):
    # (ours keeps which optimizers are inside a step per thread: another thread's step is not nested in it)
    import threading
    p = make_params()
    opt = build(which, name, p)
    calls, started, release = [], threading.Event(), threading.Event()

    def pre(o, a, k):
        calls.append(threading.current_thread().name)
        if threading.current_thread().name == "first":
            started.set()
            release.wait(10)

    opt.register_step_pre_hook(pre)
    fill_grads(p, 0)
    first = threading.Thread(target=opt.step, name="first")
    first.start()
    try:
        assert started.wait(10)
        opt.step()
    finally:
        release.set()
        first.join(10)
    assert sorted(calls) == ["MainThread", "first"]


@pytest.mark.parametrize("which,name", BOTH)
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(which, name, set_to_none):
    p = make_params()
    opt = build(which, name, p)
    fill_grads(p, 0)
    opt.zero_grad(set_to_none=set_to_none)
    for q in p:
        assert (q.grad is None) if set_to_none else torch.equal(q.grad, torch.zeros_like(q))


@pytest.mark.parametrize("which,name", BOTH)
def test_add_param_group_and_its_errors(which, name):
    p = make_params()
    opt = build(which, name, p[:2])
    opt.add_param_group(dict(params=[p[2]], lr=0.5))
    assert opt.param_groups[1]["lr"] == 0.5 and len(opt.param_groups) == 2
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        opt.add_param_group(dict(params=[p[0]]))
    with pytest.raises(TypeError):
        opt.add_param_group([torch.zeros(2, requires_grad=True)])
    with pytest.raises(ValueError, match="all optimizer param groups should be with/without names"):
        opt.add_param_group(dict(params=[("x", torch.zeros(2, requires_grad=True))]))
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize("which,name", BOTH)
def test_deepcopy_and_pickle_keep_state_and_step_alike(which, name, device):
    p = make_params(device=device)
    opt = build(which, name, p)
    fill_grads(p, 0)
    opt.step()
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert len(clone.state) == len(opt.state)
        cp = [q for g in clone.param_groups for q in g["params"]]
        fill_grads(cp, 1)
        clone.step()
    fill_grads(p, 1)
    opt.step()
    for q, r in zip(p, cp):
        assert torch.equal(q, r)


@pytest.mark.parametrize("which,name", BOTH)
def test_step_without_grads_is_a_no_op(which, name):
    p = make_params()
    opt = build(which, name, p)
    before = [q.detach().clone() for q in p]
    opt.step()
    assert all(torch.equal(q, r) for q, r in zip(p, before))
    assert len(opt.state) == 0


@pytest.mark.parametrize("which,name", BOTH)
def test_printing_lists_groups_and_hyperparameters(which, name):
    text = repr(build(which, name, make_params()))
    assert "Parameter Group 0" in text and "lr: 0.01" in text


@pytest.mark.parametrize("which", [0, 1])
def test_sgd_without_momentum_keeps_no_state(which):
    p = make_params()
    opt = PAIRS["sgd"][which](p, lr=0.1)
    fill_grads(p, 0)
    opt.step()
    assert len(opt.state) == 0 and opt.state_dict()["state"] == {}


@pytest.mark.parametrize("device", DEVICES)
def test_sgd_nesterov_rule_is_checked_at_construction_only_as_torch_does(device):
    """A momentum schedule that reaches 0 under nesterov=True (torch's step is then plain SGD), a dampening set
    mid-run and a group added with Nesterov but no momentum: torch.optim.SGD steps through all of them (its rule
    holds for the constructor's defaults only), and so does FusedSGD, with the same values."""
    a, b = make_params(device=device), make_params(device=device)
    opt_a = FusedSGD(a[:2], lr=0.1, momentum=0.9, nesterov=True)
    opt_b = torch.optim.SGD(b[:2], lr=0.1, momentum=0.9, nesterov=True, foreach=False)
    opt_a.add_param_group(dict(params=a[2:], momentum=0.0))
    opt_b.add_param_group(dict(params=b[2:], momentum=0.0))
    g = torch.Generator().manual_seed(3)
    for momentum, dampening in [(0.9, 0.0), (0.5, 0.0), (0.0, 0.0), (0.0, 0.0), (0.9, 0.25), (0.9, 0.0)]:
        for opt in (opt_a, opt_b):
            opt.param_groups[0]["momentum"], opt.param_groups[0]["dampening"] = momentum, dampening
        step_both_and_compare(opt_a, opt_b, a, b, g, device)
    with pytest.raises(ValueError, match="^Nesterov momentum requires a momentum and zero dampening$"):
        FusedSGD(make_params(), lr=0.1, momentum=0.9, dampening=0.1, nesterov=True)


@pytest.mark.parametrize("saved", [0, 1])
def test_adamw_stays_adamw_after_loading_an_adam_state_dict(saved):
    p, q = make_params(), make_params()
    source = (FusedAdam if saved == 0 else torch.optim.Adam)(p, lr=0.01, weight_decay=0.5)
    fill_grads(p, 0)
    source.step()
    opt = FusedAdamW(q, lr=0.01, weight_decay=0.5)
    opt.load_state_dict(copy.deepcopy(source.state_dict()))
    assert opt.param_groups[0]["decoupled_weight_decay"] is True
    ref = torch.optim.AdamW(make_params(), lr=0.01, weight_decay=0.5, foreach=False)
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))
    with torch.no_grad():
        for a, b in zip(q, ref.param_groups[0]["params"]):
            b.copy_(a)
    fill_grads(q, 1)
    fill_grads(ref.param_groups[0]["params"], 1)
    opt.step()
    ref.step()
    for a, b in zip(q, ref.param_groups[0]["params"]):
        torch.testing.assert_close(a, b, atol=OPTIM_FP32_ATOL, rtol=0)


def test_sgd_dampening_state_after_a_skipped_first_step_loads_right_in_torch():
    p = make_params()
    opt = FusedSGD(p, lr=0.1, momentum=0.9, dampening=0.5)
    fill_grads(p, 0)
    opt.found_inf = torch.ones(())  # the scaler skips the first step
    opt.grad_scale = torch.ones(())
    opt.step()
    del opt.found_inf, opt.grad_scale
    sd = opt.state_dict()
    assert all(st["momentum_buffer"] is None for st in sd["state"].values())
    # Our own optimizer's state is untouched by saving.
    assert all(st["momentum_buffer"] is not None for st in opt.state.values())
    q = [x.detach().clone().requires_grad_() for x in p]
    ref = torch.optim.SGD(q, lr=0.1, momentum=0.9, dampening=0.5, foreach=False)
    ref.load_state_dict(sd)
    step_both(ref, q, opt, p, (1, 2))


# ---- arguments: torch's texts, accepted kwargs, what we reject ---------------------------------------------
@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("name,kw,text", [
    ("adam", dict(lr=-1.0), "Invalid learning rate: -1.0"),
    ("adam", dict(eps=-1.0), "Invalid epsilon value: -1.0"),
    ("adam", dict(betas=(1.0, 0.9)), "Invalid beta parameter at index 0: 1.0"),
    ("adam", dict(betas=(0.9, -0.1)), "Invalid beta parameter at index 1: -0.1"),
    ("adamw", dict(weight_decay=-0.1), "Invalid weight_decay value: -0.1"),
    ("adam", dict(lr=torch.tensor([0.1, 0.2])), "Tensor lr must be 1-element"),
    ("sgd", dict(momentum=-0.5), "Invalid momentum value: -0.5"),
    ("sgd", dict(weight_decay=-1.0), "Invalid weight_decay value: -1.0"),
    ("sgd", dict(momentum=0.0, nesterov=True), "Nesterov momentum requires a momentum and zero dampening"),
])
def test_invalid_values_give_torchs_error_texts(which, name, kw, text):
    with pytest.raises(ValueError, match="^" + text.replace("(", r"\(").replace(".", r"\.")):
        PAIRS[name][which](make_params(), **kw)


@pytest.mark.parametrize("name", PAIRS)
def test_differentiable_is_refused_clearly(name):
    with pytest.raises(NotImplementedError, match="differentiable=True"):
        PAIRS[name][0](make_params(), differentiable=True)


@pytest.mark.parametrize("name", PAIRS)
def test_duplicate_params_are_rejected_at_construction_and_in_add_param_group(name):
    # Deliberate difference: torch only warns for a duplicate inside one group; one fused pass cannot
    # update a tensor twice.
    p = make_params()
    with pytest.raises(ValueError, match="param 2 of param group 0 is param 0 again"):
        PAIRS[name][0]([p[0], p[1], p[0]])
    opt = PAIRS[name][0]([p[0]])
    with pytest.raises(ValueError, match="param 1 of param group 1 is param 0 again"):
        opt.add_param_group(dict(params=[p[1], p[1]]))
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("name", PAIRS)
def test_params_over_the_same_memory_are_rejected(name):
    # Two Parameter objects over one storage (nn.Parameter(other)): torch updates them one after the other;
    # a fused pass updated both from the same old values (with FP16 masters the last write won, silently).
    w = torch.nn.Parameter(torch.zeros(4, 3))
    for params in ([w, torch.nn.Parameter(w)], [dict(params=[w]), dict(params=[torch.nn.Parameter(w.t())])],
                   [w, torch.nn.Parameter(w.view(-1)[5:7])]):
        with pytest.raises(ValueError, match="different tensors over the same memory"):
            PAIRS[name][0](params)
    # disjoint views of one buffer (FSDP1's use_orig_params, a flat buffer) are fine, in any group
    flat = torch.zeros(100)
    views = [torch.nn.Parameter(flat[:10]), torch.nn.Parameter(flat[30:].view(7, 10)), torch.nn.Parameter(flat[10:30])]
    opt = PAIRS[name][0](views[:2])
    opt.add_param_group(dict(params=[views[2]]))
    with pytest.raises(ValueError, match="param 0 of param group 2 and param 0 of param group 1"):
        opt.add_param_group(dict(params=[torch.nn.Parameter(flat[25:35])]))
    assert len(opt.param_groups) == 2
    copy.deepcopy(opt).add_param_group(dict(params=[torch.nn.Parameter(torch.zeros(3))]))
    # a group refused for another reason, or removed by hand, leaves nothing behind: added again, it is fine
    other = torch.zeros(20)
    late = torch.nn.Parameter(other[5:15])
    with pytest.raises(ValueError, match="learning rate"):
        opt.add_param_group(dict(params=[late], lr=-1.0))
    opt.add_param_group(dict(params=[late]))
    opt.param_groups.pop()
    opt.add_param_group(dict(params=[late]))
    with pytest.raises(ValueError, match="param 0 of param group 3 and param 0 of param group 2"):
        opt.add_param_group(dict(params=[torch.nn.Parameter(other[:6])]))
    # a frozen tie is compared too (it may be unfrozen later); what the step refuses itself (a sparse or
    # mkldnn param) is left to the step
    with pytest.raises(ValueError, match="different tensors over the same memory"):
        PAIRS[name][0]([w, torch.nn.Parameter(w, requires_grad=False)])
    PAIRS[name][0]([w, torch.nn.Parameter(torch.zeros(3).to_sparse()), torch.nn.Parameter(torch.zeros(2, 3).to_mkldnn())])


@pytest.mark.parametrize("name", PAIRS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("steps_before", [0, 2])
def test_params_tied_after_they_were_added_are_rejected_before_anything_is_written(name, dtype, steps_before):
    """``b.data = a.data`` after the optimizer was made (a weight tied late): the overlap check ran only when
    the group was added, so a step updated both from the same old values (FP16 masters: a's update was
    lost, the last write winning; on a GPU the two would race). The step now checks again wherever a param's
    memory moved (the planned path sees the address change too), before anything is written; memory that
    moves and stays disjoint (a new tensor for one param) steps as before."""
    a = torch.nn.Parameter(torch.ones(4, dtype=dtype))
    b = torch.nn.Parameter(torch.full((4,), 2.0, dtype=dtype))
    c = torch.nn.Parameter(torch.full((3,), 3.0, dtype=dtype))
    opt = PAIRS[name][0]([dict(params=[a, c]), dict(params=[b])], lr=0.25)

    def grads():
        for p in (a, b, c):
            p.grad = torch.ones_like(p)

    for _ in range(steps_before):
        grads()
        opt.step()
    b.data = a.data
    grads()
    before = [p.detach().clone() for p in (a, b, c)]
    states = copy.deepcopy(opt.state_dict()["state"])
    with pytest.raises(ValueError, match="param 0 of param group 1 and param 0 of param group 0 are different tensors "
                                         "over the same memory"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip((a, b, c), before))
    assert str(opt.state_dict()["state"]) == str(states)
    # untied into memory of its own: the steps go on, the moved param from its new values
    b.data = torch.full((4,), 5.0, dtype=dtype)
    grads()
    opt.step()
    ref = PAIRS[name][1]([torch.nn.Parameter(torch.full((4,), 5.0, dtype=torch.float32))], lr=0.25)
    ref.param_groups[0]["params"][0].grad = torch.ones(4)
    if steps_before == 0 or name == "sgd":  # (a fresh torch optimizer: b's state starts there too)
        ref.step()
        torch.testing.assert_close(b.float(), ref.param_groups[0]["params"][0].detach(), atol=1e-3, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_state_entries_over_shared_memory_are_rejected_before_anything_is_written(dtype):
    """A state entry set by hand over another's memory (``state['exp_avg'] = state['exp_avg_sq']``, a param's
    tensor, one step count for two params) was updated twice from the same old values, one write lost, in
    silence. The full path (which a new entry object sends the step to) names both before any write; views
    of one buffer that do not overlap step as before."""
    params = [torch.nn.Parameter(torch.randn(6).to(dtype)) for _ in range(3)]
    opt = FusedAdamW([dict(params=params[:2]), dict(params=params[2:])], lr=0.1)

    def step():
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()

    step()
    st = opt.state[params[1]]
    for entry, other, match in (
            (("exp_avg", params[1], "exp_avg_sq"), None,
             r"state\['exp_avg_sq'\] of param 1 of param group 0 and state\['exp_avg'\] of param 1 of param group 0"),
            (("exp_avg", params[1], None), params[2], "param 0 of param group 1 and state\\['exp_avg'\\] of param 1"),
            (("step", params[0], "step"), params[2], r"state\['step'\] of param 0 of param group 1 and state\['step'\] of "
                                                     r"param 0 of param group 0")):
        key, owner, source = entry
        kept = opt.state[owner][key]
        if other is None:
            opt.state[owner][key] = opt.state[owner][source]
        elif source is None:
            opt.state[owner][key] = other.data if dtype == torch.float32 else opt.state[other]["master_param"]
        else:
            opt.state[owner][key] = opt.state[other][source]
        before = [p.detach().clone() for p in params]
        states = copy.deepcopy(opt.state_dict()["state"])
        for p in params:
            p.grad = torch.ones_like(p)
        with pytest.raises(ValueError, match=match + ".* are over the same memory"):
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(params, before))
        assert str(opt.state_dict()["state"]) == str(states)
        opt.state[owner][key] = kept
    buffer = torch.zeros(12)
    st["exp_avg"], st["exp_avg_sq"] = buffer[:6].copy_(st["exp_avg"]), buffer[6:].copy_(st["exp_avg_sq"])
    step()  # disjoint views of one buffer
    assert st["exp_avg"].data_ptr() == buffer.data_ptr() and float(st["step"]) == 2
    # over a param that has no state yet (a group added later): it is written too
    fresh = torch.nn.Parameter(torch.randn(6).to(dtype))
    opt.add_param_group(dict(params=[fresh]))
    params.append(fresh)
    kept = st["exp_avg"]
    st["exp_avg"] = fresh.data if dtype == torch.float32 else fresh.data.float()
    if dtype == torch.float32:
        with pytest.raises(ValueError, match=r"state\['exp_avg'\] of param 1 of param group 0 and param 0 of param "
                                             r"group 2 are over the same memory|param 0 of param group 2 and state"):
            step()
    st["exp_avg"] = kept
    step()


@pytest.mark.parametrize("name", PAIRS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_backward_through_params_the_step_changed_raises_as_torchs(name, dtype):
    # torch's default (foreach) and for-loop steps count their writes in the params' version counters, so
    # a graph that saved a param refuses to run backward on the new values; ours computed a wrong gradient
    for cls in PAIRS[name]:
        w = torch.nn.Parameter(torch.randn(3).to(dtype))
        x = torch.randn(3, dtype=dtype, requires_grad=True)
        y = (w * x).sum()
        w.grad = torch.ones(3, dtype=dtype)
        cls([w], lr=0.1).step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_two_optimizers_over_one_low_precision_param_both_move_it(dtype):
    # Each keeps an FP32 master of its own; the second sees (by the version counter) that the first wrote
    # the param, and its master follows, as the weight itself does in torch
    w, ref = torch.nn.Parameter(torch.zeros(4, dtype=dtype)), torch.nn.Parameter(torch.zeros(4, dtype=dtype))
    ours, theirs = (FusedSGD([w], lr=0.1), FusedSGD([w], lr=0.1)), (torch.optim.SGD([ref], lr=0.1),) * 2
    for _ in range(3):
        for p, opts in ((w, ours), (ref, theirs)):
            for opt in opts:
                p.grad = torch.ones(4, dtype=dtype)
                opt.step()
    assert torch.equal(w, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_an_inference_tensor_param_is_refused_before_anything_is_written(dtype):
    with torch.inference_mode():
        p = torch.nn.Parameter(torch.zeros(3, dtype=dtype))
    p.grad = torch.ones(3, dtype=dtype)
    opt = FusedAdam([p])
    with pytest.raises(RuntimeError, match="param 0 of param group 0: the param is an inference tensor"):
        opt.step()
    assert torch.equal(p, torch.zeros(3, dtype=dtype)) and len(opt.state) == 0
    with pytest.raises(RuntimeError, match="inference tensor"):  # torch's, having written the param
        torch.optim.Adam([p]).step()
    with torch.inference_mode():
        p.zero_()
    # a grad that is one is only read (as torch reads it), unless the step writes it back (unscaled):
    # the operator refuses that before writing anything
    q = torch.nn.Parameter(torch.zeros(3, dtype=dtype))
    with torch.inference_mode():
        q.grad = torch.ones(3, dtype=dtype)
    opt = FusedSGD([q], lr=0.5)
    for _ in range(2):  # the full path, then the planned one
        opt.step()
    assert torch.equal(q, torch.full((3,), -1.0, dtype=dtype))
    with pytest.raises(ValueError, match=r"grads\[0\] is an inference tensor"):  # (the operator itself)
        torch.ops.mpfused.optim_step_("sgd", [q], [q.grad], [], [], [], [], [], [], [], [], 0.1, None,
                                      [0.0, 0.0, 0.0, 0.0, 0.0], [], torch.ones(1), None, None, 0.0, None, None, True,
                                      "nearest", 0, [])
    # ... and the step before any group is written: here group 0 (a plain grad) comes first, and a grad
    # laid out unlike its param would be written back through a copy after the kernel
    first = torch.nn.Parameter(torch.zeros(3, dtype=dtype))
    first.grad = torch.ones(3, dtype=dtype)
    r = torch.nn.Parameter(torch.zeros(2, 3, dtype=dtype))
    with torch.inference_mode():
        r.grad = torch.ones(3, 2, dtype=dtype).t()
    for params in ([[first], [q]], [[r]]):
        opt = FusedSGD([dict(params=ps) for ps in params], lr=0.5)
        before = [p.detach().clone() for ps in params for p in ps]
        with pytest.raises(RuntimeError, match="its grad is an inference tensor"):
            opt.step(scaling=StepScaling(inv_scale=torch.ones(1)))
        assert all(torch.equal(p, b) for p, b in zip((p for ps in params for p in ps), before))
        assert not any(opt.state[p] for ps in params for p in ps)
    # the operator refuses one too (the planned path calls it from C++), before writing
    g = torch.ones(3, dtype=dtype)
    with pytest.raises(ValueError, match=r"params\[0\] is an inference tensor"):
        torch.ops.mpfused.optim_step_("sgd", [p], [g], [], [], [], [], [], [], [], [], 0.1, None,
                                      [0.0, 0.0, 0.0, 0.0, 0.0], [], None, None, None, 0.0, None, None, False,
                                      "nearest", 0, [])
    assert torch.equal(p, torch.zeros(3, dtype=dtype))


def test_a_meta_tensor_lr_is_refused_at_construction():
    with pytest.raises(ValueError, match="a tensor lr must be on the CPU or on the params' CUDA device, got one on meta"):
        FusedAdam(make_params(), lr=torch.tensor(0.1, device="meta"))


def test_a_numpy_seed_is_kept_as_an_int_so_the_state_dict_loads_with_weights_only():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    opt = FusedAdamW([p], rounding="stochastic", master_weights=False, seed=np.int64(5))
    p.grad = torch.ones(3, dtype=torch.float16)
    opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["param_groups"][0]["seed"] == 5


@pytest.mark.parametrize("name,bad,text", [("adam", dict(betas=(0.9, 1.5)), "beta parameter at index 1"),
                                           ("sgd", dict(momentum=-1.0), "momentum value"),
                                           ("adamw", dict(lr=-0.1), "learning rate")])
def test_an_invalid_later_group_fails_the_step_before_anything_is_written(name, bad, text):
    p = make_params()
    opt = PAIRS[name][0](two_groups(p, {}), lr=0.01)
    opt.param_groups[1].update(bad)
    fill_grads(p, 0)
    before = [q.detach().clone() for q in p]
    with pytest.raises(ValueError, match=f"Invalid {text}.*param group 1"):
        opt.step()
    assert all(torch.equal(q, r) for q, r in zip(p, before)) and len(opt.state) == 0


def test_a_bad_param_is_named_by_its_index_in_the_groups_params_list():
    p = make_params()
    bad = torch.zeros(3, requires_grad=True)
    opt = FusedAdam([dict(params=p[:2]), dict(params=[bad])])
    opt2 = FusedAdam([dict(params=[p[2], bad])])
    bad.data = bad.data.double()  # (after the constructors, which refuse a float64 param)
    bad.grad = torch.ones(3, dtype=torch.float64)
    fill_grads(p[:2], 0)
    with pytest.raises(ValueError, match="param 0 of param group 1"):
        opt.step()
    # The index counts every param of the group, those without grads too.
    with pytest.raises(ValueError, match="param 1 of param group 0"):
        opt2.step()
    assert len(opt.state) == 0 and len(opt2.state) == 0


@pytest.mark.parametrize("name", PAIRS)
def test_a_tensor_subclass_raises_type_error_in_python_before_state_is_created(name):
    p = make_params()
    sub = torch.nn.Parameter(TwoTensor(torch.zeros(4), torch.zeros(4)))
    opt = PAIRS[name][0]([dict(params=p[:1]), dict(params=[p[1], sub])], lr=0.1, **(dict(momentum=0.9) if name == "sgd" else {}))
    fill_grads(p[:2], 0)
    sub.grad = TwoTensor(torch.ones(4), torch.ones(4))
    before = p[0].detach().clone()
    with pytest.raises(TypeError, match="param 1 of param group 1.*TwoTensor"):
        opt.step()
    assert torch.equal(p[0], before) and len(opt.state) == 0


def test_tensor_hyperparameters_are_checked_like_torchs():
    with pytest.raises(ValueError, match="betas must be either both floats or both Tensors"):
        FusedAdam(make_params(), betas=(torch.tensor(0.9), 0.99))
    with pytest.raises(ValueError, match="Tensor beta parameter at index 0 must be 1-element"):
        FusedAdam(make_params(), betas=(torch.tensor([0.9, 0.8]), torch.tensor(0.99)))
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1: 1.5"):
        FusedAdam(make_params(), betas=(torch.tensor(0.9), torch.tensor(1.5)))
    with pytest.raises(ValueError, match="Invalid weight_decay value: -0.5"):
        FusedSGD(make_params(), weight_decay=torch.tensor(-0.5))
    # A device the kernels cannot read from is refused at construction, with the argument named.
    with pytest.raises(ValueError, match="weight_decay must be on the CPU or on the params' CUDA device.*meta"):
        FusedSGD(make_params(), weight_decay=torch.tensor(0.1, device="meta"))
    with pytest.raises(ValueError, match="must be real.*complex64"):
        FusedAdam(make_params(), betas=(torch.tensor(0.9j), torch.tensor(0.99j)))


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_tensor_hyperparameters_changed_in_place_are_read_by_each_step(name, dtype, device):
    """A beta (or SGD's weight_decay) schedule written into the tensor between steps, as a scheduler would: the
    update reads the tensor itself on the params' device, so each step sees the current value."""
    ours_cls, theirs_cls = PAIRS[name]
    a, b = make_params(device=device), make_params(device=device)
    if name == "sgd":
        knobs = [torch.tensor(0.1, dtype=dtype, device=device)]
        opt_a = ours_cls(a, lr=0.05, momentum=0.9, weight_decay=knobs[0])
        opt_b = theirs_cls(b, lr=0.05, momentum=0.9, weight_decay=float(knobs[0]), foreach=False)
    else:
        knobs = [torch.tensor(v, dtype=dtype, device=device) for v in (0.9, 0.99)]
        opt_a = ours_cls(a, lr=0.01, betas=tuple(knobs))
        opt_b = theirs_cls(b, lr=0.01, betas=tuple(float(x) for x in knobs), foreach=False)
    for s, scale in enumerate((1.0, 0.5, 0.75, 0.25)):
        for knob in knobs:
            knob.mul_(scale)
        # torch's reference gets the new values as floats
        if name == "sgd":
            opt_b.param_groups[0]["weight_decay"] = float(knobs[0])
        else:
            opt_b.param_groups[0]["betas"] = tuple(float(k) for k in knobs)
        step_both(opt_a, a, opt_b, b, [s])


@requires_cuda
@pytest.mark.parametrize("where", ["cuda", "cpu"])
def test_tensor_hyperparameters_never_sync_the_host_in_step(where):
    """CUDA params with tensor betas / weight_decay on the device (read by the kernel) or on the host (read
    there, no device involved): step() makes no synchronizing call. (Host values and capturable=True
    do not go together: a capturable step reads every value on the device, see
    test_compile.py's test_capturable_refuses_values_on_another_device.)"""
    p = make_params(device="cuda")
    opts = [FusedAdamW(p, lr=torch.tensor(0.01, device="cuda"), capturable=where == "cuda",
                       betas=(torch.tensor(0.9, device=where), torch.tensor(0.99, device=where))),
            FusedSGD(make_params(device="cuda"), lr=0.1, momentum=0.9, weight_decay=torch.tensor(0.01, device=where))]
    for opt in opts:
        ps = opt.param_groups[0]["params"]
        fill_grads(ps, 0)
        opt.step()  # state created
        fill_grads(ps, 1)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)


@requires_cuda
def test_cpu_params_with_cuda_hyperparameters_and_scaler_tensors_step_like_all_cpu_ones():
    """A CPU step reads CUDA betas, lr, grad_scale and found_inf only after their copies to the host have
    landed (a non-blocking device-to-host copy would race with the CPU kernel)."""
    a, b = make_params(), make_params()
    cuda = dict(lr=torch.tensor(0.01, device="cuda"), betas=(torch.tensor(0.8, device="cuda"),
                                                             torch.tensor(0.95, device="cuda")))
    ours = FusedAdamW(a, **cuda)
    ref = FusedAdamW(b, lr=torch.tensor(0.01), betas=(torch.tensor(0.8), torch.tensor(0.95)))
    for s in range(3):
        ours.grad_scale, ours.found_inf = torch.full((), 4.0, device="cuda"), torch.zeros((), device="cuda")
        ref.grad_scale, ref.found_inf = torch.full((), 4.0), torch.zeros(())
        step_both(ours, a, ref, b, [s], atol=0.0)


# ---- grads after scaler.step: what the update used, as torch's fused optimizers leave them ---------------
@pytest.mark.parametrize("name", PAIRS)
def test_grads_after_scaler_step_are_unscaled_like_torchs_fused_optimizer(name, device):
    ours_cls, theirs_cls = PAIRS[name]
    a, b = make_params(device=device), make_params(device=device)
    ours, theirs = ours_cls(a, lr=0.01), theirs_cls(b, lr=0.01, fused=True)
    sa, sb = torch.amp.GradScaler(device, init_scale=1024.0), torch.amp.GradScaler(device, init_scale=1024.0)
    for s, poison in ((0, False), (1, True), (2, False)):
        sa.scale(torch.ones((), device=device))  # the scalers start their scale; the grads below stand for scaled ones
        sb.scale(torch.ones((), device=device))
        fill_grads(a, s)
        fill_grads(b, s)
        if poison:  # an overflow: the step is skipped and the grads stay as they were
            a[1].grad[0] = b[1].grad[0] = float("inf")
        before = [p.grad.clone() for p in a]
        sa.step(ours)
        sb.step(theirs)
        sa.update()
        sb.update()
        for pa, pb, g0 in zip(a, b, before):
            torch.testing.assert_close(pa.grad, pb.grad, atol=0, rtol=0)
            assert torch.equal(pa.grad, g0) == poison
            torch.testing.assert_close(pa, pb, atol=OPTIM_FP32_ATOL, rtol=0)


@pytest.mark.parametrize("name", PAIRS)
def test_grads_after_a_clipping_mpfused_scaler_step_are_unscaled_and_clipped(name, device):
    import mpfused
    p = make_params(device=device)
    opt = PAIRS[name][0](p, lr=0.01)
    scaler = mpfused.GradScaler(device, init_scale=256.0)
    scaler.scale(torch.ones((), device=device))
    fill_grads(p, 0)
    unscaled = [q.grad / 256.0 for q in p]
    norm = torch.linalg.vector_norm(torch.cat([u.flatten() for u in unscaled]))
    assert norm > 0.01  # the clip below is active
    expected = [u * (0.01 / (norm + 1e-6)) for u in unscaled]
    scaler.clip_grad_norm_(opt, max_norm=0.01)
    scaler.step(opt)
    for q, e in zip(p, expected):
        torch.testing.assert_close(q.grad, e, atol=OPTIM_FP32_ATOL, rtol=0)


# ---- memory layouts: any dense layout (channels_last, a transpose), as torch's optimizers take ------------
LAYOUTS = {
    "channels_last": lambda t: t.to(memory_format=torch.channels_last),
    "transposed": lambda t: t.transpose(0, 3).contiguous().transpose(0, 3),  # dense, dims permuted
    "channels_last_size1": lambda t: t[:, :1].to(memory_format=torch.channels_last),  # a size-1 dim
}


def conv_params(layout, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = LAYOUTS[layout](torch.randn(8, 4, 3, 3, generator=g)).to(device=device, dtype=dtype)
    return [w.requires_grad_(), torch.randn(5, generator=g).to(device=device, dtype=dtype).requires_grad_()]


def set_grads(params, seed, grad_layout=None):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        grad = torch.randn(p.shape, generator=g).to(device=p.device, dtype=p.dtype)
        # By default the param's layout, as autograd gives a dense param's grad.
        p.grad = grad_layout(grad) if grad_layout is not None and p.dim() == 4 else torch.empty_like(p).copy_(grad)


OPT_KW = {"adam": dict(lr=0.01, weight_decay=0.1, amsgrad=True), "adamw": dict(lr=0.01, weight_decay=0.1),
          "sgd": dict(lr=0.05, momentum=0.9, weight_decay=0.01)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", PAIRS)
def test_dense_layouts_step_like_torch_and_keep_state_in_the_params_layout(name, layout, device):
    ours_cls, theirs_cls = PAIRS[name]
    a, b = conv_params(layout, torch.float32, device), conv_params(layout, torch.float32, device)
    assert not a[0].is_contiguous() or layout == "channels_last_size1"
    ours, theirs = ours_cls(a, **OPT_KW[name]), theirs_cls(b, foreach=False, **OPT_KW[name])
    step_both(theirs, b, ours, a, range(4), fill=set_grads)
    for key, t in ours.state[a[0]].items():
        if t.dim():
            assert t.stride() == a[0].stride(), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", PAIRS)
def test_a_layout_changes_no_bit_of_the_result(name, dtype, device):
    """The update is element-wise: the same values in channels_last or contiguous give the same bits, FP32
    masters of FP16/BF16 params included; so does a param switched to channels_last mid-training (its state
    follows it), and a grad whose layout differs from its param's."""
    ours_cls = PAIRS[name][0]
    a = conv_params("channels_last", dtype, device)
    b = [p.detach().contiguous().requires_grad_() for p in a]
    c = [p.detach().contiguous().requires_grad_() for p in a]
    opts = [ours_cls(x, **OPT_KW[name]) for x in (a, b, c)]
    for s in range(5):
        if s == 2:  # as model.to(memory_format=torch.channels_last) does: the same Parameter, new data
            c[0].data = c[0].data.to(memory_format=torch.channels_last)
        set_grads(a, s)
        set_grads(b, s)
        set_grads(c, s, grad_layout=(lambda t: t.contiguous()) if s >= 2 else None)  # grad unlike its param
        for opt in opts:
            opt.step()
        for pa, pb, pc in zip(a, b, c):
            assert torch.equal(pa, pb) and torch.equal(pa, pc)
        for key in ours_cls._state_float_keys:
            if key in opts[0].state[a[0]]:
                assert torch.equal(opts[0].state[a[0]][key], opts[1].state[b[0]][key]), key
                assert opts[2].state[c[0]][key].stride() == c[0].stride(), key
    assert c[0].is_contiguous(memory_format=torch.channels_last) and not c[0].is_contiguous()


@pytest.mark.parametrize("name", PAIRS)
def test_a_grad_in_another_layout_gets_the_unscaled_values_written_back(name, device):
    import mpfused
    a = conv_params("channels_last", torch.float32, device)
    opt = PAIRS[name][0](a, **OPT_KW[name])
    scaler = mpfused.GradScaler(device, init_scale=64.0)
    scaler.scale(torch.ones((), device=device))
    set_grads(a, 0, grad_layout=lambda t: t.contiguous())
    grad = a[0].grad
    expected = grad / 64.0
    scaler.step(opt)
    assert a[0].grad is grad and grad.is_contiguous()  # the user's tensor, in its own layout
    torch.testing.assert_close(grad, expected, atol=0, rtol=0)


@pytest.mark.parametrize("name", PAIRS)
def test_a_torch_state_dict_of_channels_last_params_loads_in_their_layout(name, device):
    ours_cls, theirs_cls = PAIRS[name]
    a, b = conv_params("channels_last", torch.float32, device), conv_params("channels_last", torch.float32, device)
    theirs = theirs_cls(a, foreach=False, **OPT_KW[name])
    set_grads(a, 0)
    theirs.step()
    with torch.no_grad():
        for pa, pb in zip(a, b):
            pb.copy_(pa)
    ours = ours_cls(b, **OPT_KW[name])
    sd = copy.deepcopy(theirs.state_dict())
    for st in sd["state"].values():  # as torch.save/load gives it back: state may come contiguous
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim():
                st[k] = v.contiguous()
    ours.load_state_dict(sd)
    for t in ours.state[b[0]].values():
        if isinstance(t, torch.Tensor) and t.dim():
            assert t.stride() == b[0].stride()
    step_both(theirs, a, ours, b, range(1, 4), fill=set_grads)


@pytest.mark.parametrize("name", PAIRS)
def test_a_param_that_is_not_dense_is_refused_before_anything_is_written(name):
    good = make_params()[0]
    gappy = torch.randn(4, 12)[:, ::2].requires_grad_()
    opt = PAIRS[name][0]([good, gappy], **OPT_KW[name])
    fill_grads([good, gappy], 0)
    before = good.detach().clone()
    with pytest.raises(ValueError, match=r"param 1 of param group 0: params must be dense.*strides \(12, 2\)"):
        opt.step()
    assert torch.equal(good, before) and len(opt.state) == 0


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_params_with_different_step_counts_in_one_group(name):
    # The CPU step computes the bias corrections once per run of params with the same step count: params
    # whose counts interleave must each get their own, as separate optimizers (bitwise) and torch's give them.
    g = torch.Generator().manual_seed(3)
    shapes = [(5,), (3, 2), (7,), (1,), (4,)]
    init = [torch.randn(s, generator=g) for s in shapes]
    ours = [t.clone().requires_grad_() for t in init]
    alone = [t.clone().requires_grad_() for t in init]
    theirs = [t.clone().requires_grad_() for t in init]
    cls, ref = PAIRS[name]
    opt = cls(ours, lr=0.05, weight_decay=0.01)
    opts_alone = [cls([p], lr=0.05, weight_decay=0.01) for p in alone]
    opt_ref = ref(theirs, lr=0.05, weight_decay=0.01)
    which = [(0, 2, 4), (0, 1, 2, 3, 4), (1, 3), (0, 3), (2,), (0, 2)]
    for s, with_grad in enumerate(which):
        for params in (ours, alone, theirs):
            for i, p in enumerate(params):
                p.grad = (torch.full(p.shape, float(s + 1)) * (i + 1) / 7 if i in with_grad else None)
        opt.step()
        for o in opts_alone:
            o.step()
        opt_ref.step()
    steps = [int(opt.state[p]["step"]) for p in ours]
    assert steps == [4, 2, 4, 3, 2]  # the counts interleave
    for a, b, c in zip(ours, alone, theirs):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, atol=OPTIM_FP32_ATOL, rtol=0)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
@pytest.mark.parametrize("key,value", [("step", 3), ("step", 2.0), ("exp_avg", [0.0])])
def test_a_state_entry_that_is_not_a_tensor_is_named_before_anything_is_written(name, key, value):
    """Code that sets ``state['step']`` (or another state) to a plain number: torch's own step fails too, with an
    internal message; ours names the state key and the param, before any param or state is written."""
    if key == "exp_avg" and name != "adamw":
        key = "momentum_buffer"
    p = make_params()
    opt = PAIRS[name][0](p, lr=0.1, **({"momentum": 0.9} if name == "sgd" else {}))
    fill_grads(p, 0)
    opt.step()
    opt.state[p[1]][key] = value
    before = [t.detach().clone() for t in p]
    states = {k: v.clone() for k, v in opt.state[p[0]].items() if isinstance(v, torch.Tensor)}
    fill_grads(p, 1)
    with pytest.raises(TypeError, match=rf"state\['{key}'\] of param 1 .* must be a tensor, got {type(value).__name__}"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(p, before))
    assert all(torch.equal(opt.state[p[0]][k], v) for k, v in states.items())


@pytest.mark.parametrize("key,make,error,message", [
    ("step", lambda p: 3, TypeError, r"must be a tensor, got int"),
    ("exp_avg", lambda p: torch.zeros(3), ValueError, r"must be a float32 tensor of its param's shape \(3, 4, 2\)"),
    ("exp_avg_sq", lambda p: torch.zeros_like(p).half(), ValueError, r"got a torch.float16 tensor"),
    ("exp_avg", lambda p: torch.zeros_like(p, device="meta"), ValueError, r"on meta"),
    ("step", lambda p: torch.zeros(2), ValueError, r"must be a float32 tensor of one element"),
    ("master_param", lambda p: torch.zeros(5), ValueError, r"must be a float32 tensor of its param's shape"),
])
def test_a_bad_state_entry_in_a_later_group_is_named_before_any_group_is_written(key, make, error, message):
    """Each group's state was checked in turn, inside the loop that stepped the groups: a bad entry of group 1
    raised after group 0's params, moments and step counts were written, and the operator's message named a
    position in its call's lists (exp_avg_sq[1]) rather than the param. Now every entry of every group is
    checked first, and the message names the entry, the param and its group."""
    p = make_params()
    if key == "master_param":  # a master is kept for 16-bit params
        p = [t.detach().half().requires_grad_() for t in p]
    opt = FusedAdam(two_groups(p, {}), lr=0.1)

    def grads(seed):
        g = torch.Generator().manual_seed(seed)
        for t in p:
            t.grad = torch.randn(t.shape, generator=g).to(t.dtype)

    grads(0)
    opt.step()
    opt.state[p[2]][key] = make(p[2])
    before = [t.detach().clone() for t in p]
    states = {k: v.clone() for k, v in opt.state[p[0]].items()}
    grads(1)
    with pytest.raises(error, match=rf"state\['{key}'\] of param 0 of param group 1 .*{message}"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(p, before))
    assert all(torch.equal(opt.state[p[0]][k], v) for k, v in states.items())
