"""The optimizers' planned step (mpfused/optim/_base.py, _StepPlan): a step that repeats the last one's
structure reuses its per-param decisions. These tests hold it to the full path bit for bit, through every
change a training loop or a user can make between steps, and check that it still raises before anything
is written."""

import copy
import gc
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpfused.optim import FusedAdam, FusedAdamW, FusedLAMB, FusedLion, FusedSGD, StepScaling
from mpfused.optim._base import FusedOptimizer
from mpfused.optim import _base

from conftest import DEVICES
from dispatch_helpers import FunctionsSeen, OpsSeen, Traced
from optim_helpers import assert_same, bits

SHAPES = [(8, 6), (8,), (4, 3, 2, 2), (1,), (5, 3)]  # the third can take channels_last


def make_params(dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device, dtype)) for s in SHAPES]


def full_path(opt):
    """``opt`` with the planned path switched off: every step takes the full path (the reference)."""
    opt._planned_step = lambda scaling: False
    return opt


def spy_plan(opt):
    """Records, per step() of ``opt``, whether the planned path took it."""
    taken = []
    real = opt._planned_step

    def planned_step(scaling):
        taken.append(real(scaling))
        return taken[-1]

    opt._planned_step = planned_step
    return taken


def set_grads(params, step, mask=None):
    g = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        grad = (torch.randn(p.shape, generator=g) * 0.1).to(p.device, p.dtype)
        if p.dim() == 4:  # autograd gives a grad its param's layout
            grad = grad.contiguous(memory_format=torch.channels_last) if p.is_contiguous(
                memory_format=torch.channels_last) and not p.is_contiguous() else grad
        p.grad = grad if mask is None or mask[i] else None


NONE = torch.empty(0, dtype=torch.int8)  # a state entry set to None, in a snapshot


def snap(opt):
    params = [p for g in opt.param_groups for p in g["params"]]
    return [bits(p) for p in params], [{k: NONE if v is None else bits(v) for k, v in opt.state[p].items()}
                                       if p in opt.state else {} for p in params]


OPTIMIZERS = {
    "adamw": lambda ps, **kw: FusedAdamW(ps, lr=1e-2, weight_decay=0.1, **kw),
    "adam": lambda ps, **kw: FusedAdam(ps, lr=1e-2, **kw),
    "sgd": lambda ps, **kw: FusedSGD(ps, lr=1e-2, **{"momentum": 0.9, **kw}),
    "lion": lambda ps, **kw: FusedLion(ps, lr=1e-3, **kw),
    "lamb": lambda ps, **kw: FusedLAMB(ps, lr=1e-2, **kw),
}


def pair(name, dtype=torch.float32, groups=2, device="cpu", **kw):
    """The same optimizer twice on equal params: planned, and full path only."""
    out = []
    for planned in (True, False):
        ps = make_params(dtype, device=device)
        split = [ps[:2], ps[2:]] if groups == 2 else [ps]
        opt = OPTIMIZERS[name]([{"params": s} for s in split], **kw)
        opt.__dict__["_mpf_seed"] = 1234  # the seed a group with rounding='stochastic' and seed None takes
        out.append(opt if planned else full_path(opt))
    return out


def both(a, b, op):
    """op(opt) on both; they must raise alike (or not at all)."""
    errors = []
    for opt in (a, b):
        try:
            op(opt)
            errors.append(None)
        except Exception as e:  # compared below: the same type and text from both paths
            errors.append((type(e), str(e)))
    assert errors[0] == errors[1]
    return errors[0]


# ---- the planned path is taken, and equals the full path ------------------------------------------------
def count_state_for(monkeypatch):
    calls = []
    real = FusedOptimizer._state_for

    def counted(self, group, p):
        calls.append(p)
        return real(self, group, p)

    monkeypatch.setattr(FusedOptimizer, "_state_for", counted)
    return calls


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_repeated_step_takes_the_plan_and_equals_the_full_path(monkeypatch, name, device):
    calls = count_state_for(monkeypatch)
    a, b = pair(name, device=device)
    for step in range(4):
        n = len(calls)
        for opt in (a, b):
            set_grads([p for g in opt.param_groups for p in g["params"]], step)
            opt.step()
        # the full path visits every param's state on each step; the planned one, from the second step on, none
        assert len(calls) - n == len(SHAPES) * (2 if step == 0 else 1)
        assert_same(snap(a), snap(b))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("precision", [dict(), dict(master_weights=False),
                                       dict(master_weights=False, rounding="stochastic"), dict(rounding="stochastic"),
                                       dict(master_weights="remainder")])
@pytest.mark.parametrize("device", DEVICES)
def test_planned_16_bit_steps_equal_the_full_path(dtype, precision, device):
    if precision.get("master_weights") == "remainder" and dtype != torch.bfloat16:
        pytest.skip("remainders are for bfloat16 params (float16 raises, tested in test_optim_precision)")
    a, b = pair("adamw", dtype, device=device, seed=5, **precision)
    taken = spy_plan(a)
    for step in range(4):
        for opt in (a, b):
            set_grads([p for g in opt.param_groups for p in g["params"]], step)
            inv = torch.tensor([0.5], device=device)
            found = torch.tensor([1.0 if step == 2 else 0.0], device=device)  # step 2 is skipped
            opt.step(scaling=StepScaling(inv_scale=inv, found_inf=found))
        assert_same(snap(a), snap(b))
    assert taken == [False, True, True, True]


# ---- every change between steps: a random sequence applied to both ---------------------------------------
def op_step(opt, k, mask=None):
    set_grads([p for g in opt.param_groups for p in g["params"]], k, mask)
    opt.step()


def op_scaled_step(opt, k, skip):
    set_grads([p for g in opt.param_groups for p in g["params"]], k)
    device = opt.param_groups[0]["params"][0].device
    opt.step(scaling=StepScaling(grad_scale=torch.tensor([4.0], device=device),
                                 found_inf=torch.tensor([float(skip)], device=device)))


def op_group_value(opt, gi, key, value):
    group = opt.param_groups[gi]
    if key in group:
        group[key] = value


def op_betas_in_place(opt, gi, beta2):
    group = opt.param_groups[gi]
    if "betas" in group:
        if not isinstance(group["betas"], list):
            group["betas"] = list(group["betas"])
        group["betas"][1] = beta2  # the same list object, another value


def op_dtype(opt, i, dtype):
    p = [p for g in opt.param_groups for p in g["params"]][i]
    p.data = p.data.to(dtype)


def op_channels_last(opt, to_cl):
    p = [p for g in opt.param_groups for p in g["params"]][2]
    p.data = p.data.contiguous(memory_format=torch.channels_last if to_cl else torch.contiguous_format)


def op_resize(opt, i):
    p = [p for g in opt.param_groups for p in g["params"]][i]
    p.data = torch.linspace(-1, 1, p.numel() + 3).to(p.device, p.dtype)  # a new numel: later offsets move


def op_replace_state(opt, i):
    p = [p for g in opt.param_groups for p in g["params"]][i]
    for key, value in list(opt.state.get(p, {}).items()):
        if key != "step" and value is not None and value.is_floating_point():
            opt.state[p][key] = value * 0.5  # a new tensor: the next step must read it, not a cached one
            break


def op_del_entry(opt, i, key):
    p = [p for g in opt.param_groups for p in g["params"]][i]
    opt.state.get(p, {}).pop(key, None)  # in place: the state dict stays the same object


def op_unset_entry(opt, i):
    p = [p for g in opt.param_groups for p in g["params"]][i]
    if "momentum_buffer" in opt.state.get(p, {}):
        opt.state[p]["momentum_buffer"] = None  # torch.optim.SGD's "not set yet"


def op_clear_state(opt, i):
    p = [p for g in opt.param_groups for p in g["params"]][i]
    opt.state.get(p, {}).clear()


def op_relayout_state(opt, i):
    p = [p for g in opt.param_groups for p in g["params"]][i]
    for key, value in list(opt.state.get(p, {}).items()):
        if value is not None and value.dim() == 2:
            opt.state[p][key] = value.t().contiguous().t()  # the same values, column-major


def op_change_state_in_place(opt, i, how):
    """A state tensor that stays the same object but is laid out (or typed) anew through .data: the
    planned path must see it as the operator would."""
    p = [p for g in opt.param_groups for p in g["params"]][i]
    for key, value in list(opt.state.get(p, {}).items()):
        if value is not None and value.dim() == 2:
            value.data = value.data.t().contiguous().t() if how == "layout" else value.data.double()
            break


def op_drop_state(opt, i):
    p = [p for g in opt.param_groups for p in g["params"]][i]
    opt.state.pop(p, None)


def op_append_param(opt, gi, seed):
    g = torch.Generator().manual_seed(seed)
    device = opt.param_groups[0]["params"][0].device
    opt.param_groups[gi]["params"].append(torch.nn.Parameter(torch.randn(3, generator=g).to(device)))


def op_add_group(opt, seed):
    g = torch.Generator().manual_seed(seed)
    device = opt.param_groups[0]["params"][0].device
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2, 2, generator=g).to(device))]})


def op_reload(opt):
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))


OPS = st.one_of(
    st.tuples(st.just(op_step), st.integers(0, 50), st.none()),
    st.tuples(st.just(op_step), st.integers(0, 50), st.lists(st.booleans(), min_size=9, max_size=9)),
    st.tuples(st.just(op_scaled_step), st.integers(0, 50), st.booleans()),
    st.tuples(st.just(op_group_value), st.integers(0, 1), st.just("lr"),
              st.sampled_from([1e-3, 0.0, 2e-2, -1.0, 1, torch.tensor(3e-3)])),
    # a value whose object changes, to another valid or an invalid one (a step must check it again and
    # compute the kernel's hyperparameters anew), and betas made a list and changed in place
    st.tuples(st.just(op_group_value), st.integers(0, 1), st.just("weight_decay"), st.sampled_from([0.0, 0.3, -0.5])),
    st.tuples(st.just(op_group_value), st.integers(0, 1), st.just("eps"), st.sampled_from([1e-6, float("nan")])),
    st.tuples(st.just(op_betas_in_place), st.integers(0, 1), st.sampled_from([0.5, 0.99, 1.5])),
    st.tuples(st.just(op_group_value), st.integers(0, 1), st.just("master_weights"),
              st.sampled_from([None, True, False])),  # ("remainder": BF16 only; its planned steps are tested above)
    st.tuples(st.just(op_group_value), st.integers(0, 1), st.just("rounding"),
              st.sampled_from(["nearest", "stochastic"])),
    st.tuples(st.just(op_group_value), st.integers(0, 1), st.just("seed"), st.sampled_from([None, 7])),
    st.tuples(st.just(op_group_value), st.integers(0, 1), st.just("amsgrad"), st.sampled_from([False, True, 0, 1.0])),
    # ints, floats and numpy scalars: a signature must not take 0 (int) for 0.0 or False, nor 1 for True
    st.tuples(st.just(op_group_value), st.integers(0, 1), st.just("momentum"),
              st.sampled_from([0, 0.0, 0.5, 1, np.float32(0.0), np.float32(0.9)])),
    st.tuples(st.just(op_dtype), st.integers(0, 4), st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
    st.tuples(st.just(op_channels_last), st.booleans()),
    st.tuples(st.just(op_resize), st.integers(0, 4)),
    st.tuples(st.just(op_replace_state), st.integers(0, 4)),
    st.tuples(st.just(op_drop_state), st.integers(0, 4)),
    st.tuples(st.just(op_del_entry), st.integers(0, 4),
              st.sampled_from(["master_param", "exp_avg", "momentum_buffer", "step"])),
    st.tuples(st.just(op_unset_entry), st.integers(0, 4)),
    st.tuples(st.just(op_clear_state), st.integers(0, 4)),
    st.tuples(st.just(op_relayout_state), st.integers(0, 4)),
    st.tuples(st.just(op_change_state_in_place), st.integers(0, 4), st.sampled_from(["layout", "dtype"])),
    st.tuples(st.just(op_append_param), st.integers(0, 1), st.integers(0, 9)),
    st.tuples(st.just(op_add_group), st.integers(0, 9)),
    st.tuples(st.just(op_reload)),
)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["adamw", "sgd", "lamb"])
@settings(max_examples=40, deadline=None, derandomize=True)
@given(ops=st.lists(OPS, min_size=3, max_size=10))
def test_any_sequence_of_changes_between_steps_gives_the_full_paths_results(name, device, ops):
    a, b = pair(name, device=device)
    taken = spy_plan(a)
    for step in range(2):  # a plan to start from
        for opt in (a, b):
            op_step(opt, 100 + step)
    for k, (op, *args) in enumerate(ops):
        if op is op_step and args[1] is not None:  # the mask covers the params there are
            args[1] = args[1] + [True] * 9
        both(a, b, lambda opt: op(opt, *args))
        assert_same(snap(a), snap(b))
        both(a, b, lambda opt: op_step(opt, 200 + k))  # each change meets a step (the plan's or a new one)
        assert_same(snap(a), snap(b))
    # two steps with nothing between them: the second is planned, unless the changes left a state that
    # makes every step raise (a resized param's old moments), which both paths then say alike
    del taken[:]
    errors = [both(a, b, lambda opt: op_step(opt, 300 + k)) for k in range(2)]
    assert_same(snap(a), snap(b))
    # (a step that raises in the plan's own checks records nothing: read the record only after a success)
    assert errors[1] is not None or taken[-1]


def test_a_param_without_grad_that_changes_size_moves_the_stochastic_offsets_after_it():
    """The stochastic rounding's offsets count every param, with a grad or not: a param without one whose
    size changes moves the offsets of those after it, which the planned path must see."""
    a, b = pair("adamw", torch.bfloat16, groups=1, master_weights=False, rounding="stochastic", seed=3)
    mask = [False, True, True, True, True]
    for step in range(2):
        for opt in (a, b):
            op_step(opt, step, mask)
    for opt in (a, b):
        opt.param_groups[0]["params"][0].data = torch.zeros(50, dtype=torch.bfloat16)  # had 48 elements
        op_step(opt, 2, mask)
    assert_same(snap(a), snap(b))


def test_a_full_step_that_raises_and_is_undone_gives_the_full_paths_results():
    """A full step that raises (here group 1's bad state, while group 0 was told to drop its masters) drops
    the plan of an earlier step, and once the user undoes both the results are the full path's. Every group's
    state is checked before any is mended, so group 0 keeps its masters through the failed step (before, the
    full path had mended group 0 in place, dropping them, when group 1's state raised)."""
    ref = None
    for planned in (True, False):
        ps = make_params(torch.float16)
        opt = FusedAdamW([{"params": ps[:2]}, {"params": ps[2:]}], lr=1e-2)
        if not planned:
            full_path(opt)
        for step in range(2):
            op_step(opt, step)
        p = opt.param_groups[1]["params"][0]
        good = opt.state[p]["exp_avg"]
        opt.param_groups[0]["master_weights"] = False
        opt.state[p]["exp_avg"] = good.double()
        with pytest.raises(ValueError, match="exp_avg"):
            op_step(opt, 2)
        assert opt.__dict__.get("_mpf_plan") is None  # the full path dropped it before mending anything
        assert "master_param" in opt.state[opt.param_groups[0]["params"][0]]
        opt.param_groups[0]["master_weights"] = None
        opt.state[p]["exp_avg"] = good
        op_step(opt, 3)
        assert "master_param" in opt.state[opt.param_groups[0]["params"][0]]
        if ref is None:
            ref = snap(opt)
        else:
            assert_same(ref, snap(opt))


@pytest.mark.parametrize("name, key, before, after", [
    ("sgd", "momentum", 0, 0.9),  # an int 0, then a float: 0 == False == (0.9 == 0) in Python
    ("sgd", "momentum", 0.0, 1),
    ("adam", "amsgrad", False, 1.0),
    ("adam", "amsgrad", 0, True),
])
def test_a_group_value_of_another_kind_is_another_structure(name, key, before, after):
    a, b = pair(name, groups=1)
    for opt in (a, b):
        opt.param_groups[0][key] = before  # (a constructor may turn 0 into False)
    taken = spy_plan(a)
    for step in range(3):
        if step == 2:
            for opt in (a, b):
                opt.param_groups[0][key] = after
        for opt in (a, b):
            op_step(opt, step)
        assert_same(snap(a), snap(b))
    assert taken == [False, True, False]


@pytest.mark.parametrize("dtype, kw, every_step", [
    (torch.float16, {}, False),  # an FP32 master, written once
    (torch.float16, {}, True),  # ... and every step (weight clipping)
    (torch.float16, dict(rounding="stochastic", seed=7), True),  # the stochastic rule
    (torch.bfloat16, dict(master_weights="remainder"), True),  # a remainder
    (torch.float32, {}, True),  # no master: nothing follows
])
def test_a_param_written_from_outside(dtype, kw, every_step):
    """A clamp_ of a param moves its version counter (the kernels' writes move it by a count the plan
    knows). Where the param has an FP32 master or a remainder, the planned step makes the master follow the
    write (one pass of follow_writes_, before its kernels) and stays planned; the full path does the same
    (_follow_writes). Both paths give the same bits. (It took the full path before: per-param Python every
    step for a model whose params are written every step.)"""
    a, b = pair("adamw", dtype=dtype, **kw)
    taken = spy_plan(a)
    for step in range(5):
        if step == 2 or (every_step and step > 0):
            for opt in (a, b):
                with torch.no_grad():
                    opt.param_groups[1]["params"][1].clamp_(-0.25, 0.25)
        for opt in (a, b):
            op_step(opt, step)
        assert_same(snap(a), snap(b))
    assert taken == [False, True, True, True, True]
    if dtype == torch.float16:  # the clamped param's master holds the clamp
        p = a.param_groups[1]["params"][1]
        assert float(a.state[p]["master_param"].abs().max()) <= 0.25 + 0.01


@pytest.mark.parametrize("how", ["layout", "dtype"])
def test_a_state_tensor_changed_in_place_in_the_second_group(how):
    """The same object, laid out or typed anew through .data: the planned path hands the step to the full
    path before the first group is written (which mends the layout, and refuses the dtype, as it would)."""
    a, b = pair("adamw")
    taken = spy_plan(a)
    for step in range(2):
        for opt in (a, b):
            op_step(opt, step)
    for opt in (a, b):
        op_change_state_in_place(opt, 4, how)  # param 4 is in group 1
    error = both(a, b, lambda opt: op_step(opt, 2))
    assert (error is None) == (how == "layout")
    assert_same(snap(a), snap(b))
    assert taken == [False, True, False]


@pytest.mark.parametrize("name, key, off", [("sgd", "momentum", 0.0), ("adam", "amsgrad", False)])
def test_a_state_the_step_does_not_use_is_not_checked_by_the_plan(name, key, off):
    """A state entry the step leaves alone (SGD's momentum buffer with momentum 0, Adam's max_exp_avg_sq
    without amsgrad), made float64 in place: the operator neither reads nor checks it, so the step is
    planned as the operator takes it, and equals the full path."""
    a, b = pair(name, groups=1, **({"amsgrad": True} if name == "adam" else {}))
    taken = spy_plan(a)
    for opt in (a, b):
        op_step(opt, 0)  # makes the state
        opt.param_groups[0][key] = off
        state = opt.state[opt.param_groups[0]["params"][0]]
        unused = state["momentum_buffer" if name == "sgd" else "max_exp_avg_sq"]
        unused.data = unused.data.double()
    for step in range(1, 4):
        for opt in (a, b):
            op_step(opt, step)
        assert_same(snap(a), snap(b))
    assert taken == [False, False, True, True]


def test_params_given_as_a_tuple_take_the_full_path():
    a, b = pair("adamw")
    taken = spy_plan(a)
    for step in range(3):
        for opt in (a, b):
            op_step(opt, step)
            opt.param_groups[1]["params"] = tuple(opt.param_groups[1]["params"])
        assert_same(snap(a), snap(b))
    assert taken == [False, False, False]


def test_loading_a_state_dict_frees_the_state_it_replaces():
    opt = FusedAdamW(make_params(), lr=1e-2)
    for step in range(2):
        op_step(opt, step)
    saved = copy.deepcopy(opt.state_dict())
    old = weakref.ref(opt.state[opt.param_groups[0]["params"][0]]["exp_avg"])
    opt.load_state_dict(saved)
    gc.collect()
    assert old() is None


# ---- raising before anything is written, on the planned path ----------------------------------------------
class Plain(torch.Tensor):
    """A tensor subclass: the fused optimizers take plain tensors."""


def planned_two_groups(device):
    opt = FusedAdamW([{"params": make_params(device=device)[:2]}, {"params": make_params(seed=3, device=device)[2:]}],
                     lr=1e-2)
    for step in range(2):
        op_step(opt, step)
    set_grads([p for g in opt.param_groups for p in g["params"]], 7)
    assert opt.__dict__.get("_mpf_plan") is not None
    return opt


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", ["sparse grad", "subclass grad", "lr", "param dtype"])
def test_a_bad_second_group_raises_before_the_first_is_written(bad, device):
    opt = planned_two_groups(device)
    p = opt.param_groups[1]["params"][1]
    if bad == "sparse grad":
        p.grad = p.grad.to_sparse()
        expected, match = ValueError, "param 1 of param group 1: sparse gradients"
    elif bad == "subclass grad":
        p.grad = p.grad.as_subclass(Plain)
        expected, match = TypeError, "param 1 of param group 1: the fused optimizers take plain tensors"
    elif bad == "lr":
        opt.param_groups[1]["lr"] = -1.0
        expected, match = ValueError, "Invalid learning rate: -1.0 \\(param group 1\\)"
    else:
        p.data = p.data.to(torch.float64)  # the grad setter checks dtypes; .data does not
        expected, match = ValueError, "param 1 of param group 1: dtype torch.float64 is not supported"
    first = opt.param_groups[0]["params"]
    before = [bits(p) for p in first], [{k: bits(v) for k, v in opt.state[p].items()} for p in first]
    with pytest.raises(expected, match=match):
        opt.step()
    assert_same(before, ([bits(p) for p in first], [{k: bits(v) for k, v in opt.state[p].items()} for p in first]))


@pytest.mark.parametrize("device", DEVICES)
def test_a_grad_laid_out_unlike_its_param_goes_through_the_full_paths_copy(device):
    a, b = pair("adamw", device=device)
    for step in range(2):
        for opt in (a, b):
            op_step(opt, step)
    for opt in (a, b):
        set_grads([p for g in opt.param_groups for p in g["params"]], 9)
        p = opt.param_groups[0]["params"][0]
        p.grad = p.grad.t().contiguous().t()  # same values, column-major
        opt.step(scaling=StepScaling(inv_scale=torch.tensor([1.0], device=device)))  # writes the grad back
        assert p.grad.stride() == (1, 8)
    assert_same(snap(a), snap(b))


# ---- the planned step's operator call ---------------------------------------------------------------------
# The planned path calls torch.ops.mpfused.optim_step_ through the dispatcher from C++ (_C.optim_step_call),
# not through torch.ops' per-argument conversion: everything torch sees of the operator must stay the same.
def planned_adamw(device="cpu", **kw):
    opt = FusedAdamW(make_params(device=device), lr=1e-2, weight_decay=0.1, **kw)
    for step in range(2):
        op_step(opt, step)
    assert opt.__dict__.get("_mpf_plan") is not None
    set_grads([p for g in opt.param_groups for p in g["params"]], 5)
    return opt


def count_direct_calls(monkeypatch):
    """Counts the planned path's calls that _C.optim_step_call made (it returns False where it made none)."""
    import mpfused._ops as ops_module
    made = []
    real = ops_module._C.optim_step_call

    def counted(*args):
        made.append(real(*args))
        return made[-1]

    monkeypatch.setattr(ops_module._C, "optim_step_call", counted)
    return made


@pytest.mark.parametrize("device", DEVICES)
def test_the_planned_call_is_the_operator_as_torch_sees_it(monkeypatch, device):
    """Dispatch modes, the profiler and autograd's version counters see the planned path's operator call as
    they see the full path's, and the result is the full path's."""
    a, b = pair("adamw", device=device)
    for step in range(2):
        for opt in (a, b):
            op_step(opt, step)
    made = count_direct_calls(monkeypatch)
    for opt in (a, b):
        set_grads([p for g in opt.param_groups for p in g["params"]], 5)
    versions = [[p._version for p in g["params"]] for opt in (a, b) for g in opt.param_groups]
    with OpsSeen() as seen:
        a.step()
    assert made == [True, True]  # one call per group, from C++
    assert [op for op in seen.ops if op.startswith("mpfused.")] == ["mpfused.optim_step_.default"] * 2
    b.step()
    after = [[p._version for p in g["params"]] for opt in (a, b) for g in opt.param_groups]
    # the same version counters as after the full path's call through torch.ops
    assert [[x - y for x, y in zip(u, v)] for u, v in zip(after[:2], versions[:2])] == \
        [[x - y for x, y in zip(u, v)] for u, v in zip(after[2:], versions[2:])]
    assert_same(snap(a), snap(b))
    set_grads([p for g in a.param_groups for p in g["params"]], 6)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        a.step()
    assert [e.name for e in prof.events()].count("mpfused::optim_step_") == 2
    assert made == [True] * 4


def test_a_torch_function_mode_sees_the_planned_call(monkeypatch):
    """Where torch.ops would hand the call to __torch_function__, the planned path goes through torch.ops."""
    opt = planned_adamw()
    made = count_direct_calls(monkeypatch)
    taken = spy_plan(opt)
    with FunctionsSeen() as seen:
        opt.step()
    assert taken == [True] and made == []
    assert sum(call.startswith("mpfused.optim_step_") for call in seen.calls) == 1


@pytest.mark.parametrize("scalar", ["found_inf", "lr"])
def test_a_subclass_scalar_sees_the_planned_call(monkeypatch, scalar):
    a, b = (planned_adamw() for _ in range(2))
    for opt in (a, b):
        if scalar == "lr":
            opt.param_groups[0]["lr"] = torch.tensor(1e-2)
            opt.step()  # (a tensor lr is another structure: the full path, then a new plan)
            set_grads([p for g in opt.param_groups for p in g["params"]], 6)
    full_path(b)
    made = count_direct_calls(monkeypatch)
    taken = spy_plan(a)
    Traced.seen = []
    for opt in (a, b):
        if scalar == "lr":
            opt.param_groups[0]["lr"] = torch.tensor(1e-2).as_subclass(Traced)
            opt.step()
        else:
            opt.step(scaling=StepScaling(found_inf=torch.zeros(1).as_subclass(Traced)))
    assert taken == [True] and made == [False]  # C++ declined it, having done nothing
    # the planned call and the full path's
    assert sum(call.startswith("mpfused.optim_step_") for call in Traced.seen) == 2
    assert_same(snap(a), snap(b))


@pytest.mark.parametrize("schedule", ["cosine", "one cycle"])
def test_a_scheduled_lr_keeps_the_plan_and_is_checked_each_step(schedule):
    """A scheduler sets a new lr object every step (OneCycleLR new betas too): the planned path takes it
    (checking only the lr where nothing else changed), equals the full path, and refuses a bad one with
    torch's text before writing anything."""
    a, b = pair("adamw")
    taken = spy_plan(a)
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20) if schedule == "cosine"
              else torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=20) for opt in (a, b)]
    for step in range(6):
        for opt, sched in zip((a, b), scheds):
            op_step(opt, step)
            sched.step()
        assert_same(snap(a), snap(b))
    assert taken == [False] + [True] * 5
    for opt in (a, b):
        opt.param_groups[1]["lr"] = float("inf")
    before = snap(a)
    error = both(a, b, lambda opt: op_step(opt, 7))
    assert error == (ValueError, "Invalid learning rate: inf (param group 1)")
    assert_same(before, snap(a))


def test_a_list_value_changed_in_place_is_checked_again():
    """betas as a list, changed in place: the same object, another value; the step checks it again."""
    opt = planned_adamw()
    opt.param_groups[0]["betas"] = [0.9, 0.999]
    op_step(opt, 3)
    op_step(opt, 4)  # planned, with the list
    opt.param_groups[0]["betas"][1] = 1.0
    before = snap(opt)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1: 1.0"):
        op_step(opt, 5)
    assert_same(before, snap(opt))


def test_a_numpy_integer_seed_changed_between_steps_is_the_one_used():
    """The plan packs the seed: a new seed, numpy's integers included, is another plan (the signature
    compares integers by value), and the planned steps equal the full path's bits."""
    a, b = pair("adamw", torch.bfloat16, groups=1, master_weights=False, rounding="stochastic",
                seed=np.uint64(1))
    taken = spy_plan(a)
    for step in range(4):
        for opt in (a, b):
            if step == 2:
                opt.param_groups[0]["seed"] = np.uint64(2)
            op_step(opt, step)
        assert_same(snap(a), snap(b))
    assert taken == [False, True, False, True]


def test_the_default_device_mode_keeps_the_direct_call(monkeypatch):
    """torch.set_default_device / ``with torch.device(...)`` install a torch function mode that passes every
    call creating no tensor through unchanged: the planned step still calls the operator from C++."""
    opt = planned_adamw()
    made = count_direct_calls(monkeypatch)
    with torch.device("cpu"):
        opt.step()
    assert made == [True]
    with FunctionsSeen(), torch.device("cpu"):  # another mode beside it: torch.ops
        opt.step()
    assert made == [True]


def test_an_unused_state_that_is_a_subclass_sees_every_call():
    """A state the step does not use (SGD's momentum buffer with momentum 0) still goes to the operator; a
    subclass there sees each step's call, as through torch.ops on the full path, so no step is planned."""
    opt = FusedSGD(make_params(), lr=1e-2, momentum=0.9)
    op_step(opt, 0)
    opt.param_groups[0]["momentum"] = 0.0
    p = opt.param_groups[0]["params"][0]
    opt.state[p]["momentum_buffer"] = opt.state[p]["momentum_buffer"].as_subclass(Traced)
    taken = spy_plan(opt)
    Traced.seen = []
    for step in range(1, 4):
        op_step(opt, step)
    assert taken == [False, False, False]
    assert sum(call.startswith("mpfused.optim_step_") for call in Traced.seen) == 3


# ---- the version counters the step's writes move (csrc/torch/optim.cpp) ----------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_views_of_one_buffer_in_two_groups_keep_the_plan(dtype):
    # nn.Parameter(buf[a:b]) shares buf's version counter, which each group's call moves (once a call, not
    # once a view): the plan compares the counters its last step left after every group was written
    flat = torch.zeros(40 * 8, dtype=dtype)
    ps = [torch.nn.Parameter(flat[i * 8:(i + 1) * 8]) for i in range(40)]
    opt = FusedAdamW([{"params": ps[:20]}, {"params": ps[20:], "weight_decay": 0.0}], lr=1e-3)
    taken = spy_plan(opt)
    for step in range(5):
        set_grads(ps, step)
        opt.step()
    assert taken == [False, True, True, True, True]
    before = ps[3]._version
    with torch.no_grad():
        ps[3][0] = 1.0  # a write from outside: the planned step's master follows it
    set_grads(ps, 5)
    opt.step()
    assert taken[-1] is True and ps[3]._version > before
    assert opt.state[ps[3]]["master_param"][0] != 0.0 and abs(opt.state[ps[3]]["master_param"][0] - 1.0) < 0.01


def test_a_full_step_after_planned_ones_does_not_compare_the_masters_again(monkeypatch):
    # the planned steps' own writes moved the counters; the full path that follows takes them as its own
    # (on a GPU a comparison is kernels, which a CUDA-graph capture of that step would keep)
    compared = []
    real = _base._follow_writes

    def follow(followed, seen):
        compared.extend(p for p, master, remainder, _ in followed
                        if seen.get(_base._seen_key(master, remainder)) != _base._seen_value(p))
        return real(followed, seen)

    monkeypatch.setattr(_base, "_follow_writes", follow)
    ps = [torch.nn.Parameter(torch.randn(8).bfloat16()) for _ in range(4)]
    opt = FusedAdam(ps, lr=1e-3)
    taken = spy_plan(opt)
    for step in range(4):
        set_grads(ps, step)
        opt.step()
    assert taken == [False, True, True, True] and len(compared) == 4  # (the first step: masters just made)
    compared.clear()
    opt.param_groups[0]["amsgrad"] = True  # another signature: the full path
    set_grads(ps, 4)
    opt.step()
    assert taken[-1] is False and compared == []
    with torch.no_grad():
        ps[1].add_(1.0)
    opt.param_groups[0]["amsgrad"] = False
    set_grads(ps, 5)
    opt.step()
    assert [p is ps[1] for p in compared] == [True]


def test_a_param_swapped_or_given_new_data_is_followed(monkeypatch):
    # torch.utils.swap_tensors (module.to() and load_state_dict under set_swap_module_params_on_conversion)
    # refuses a tensor that something holds a weak reference to, and gives the param a TensorImpl whose
    # counter may hold any count: the steps note counts by the master, with the param's memory
    monkeypatch.setattr(torch.__future__, "get_swap_module_params_on_conversion", lambda: True)
    m = torch.nn.Linear(4, 2, bias=False).half()
    opt = FusedSGD(m.parameters(), lr=0.0)  # lr 0: the params keep their values, only the masters matter
    taken = spy_plan(opt)
    for step in range(2):
        m.weight.grad = torch.ones_like(m.weight)
        opt.step()
    m.load_state_dict({"weight": torch.full((2, 4), 0.5, dtype=torch.float16)})
    m.weight.grad = torch.ones_like(m.weight)
    opt.step()
    # (the swapped param keeps its memory, with another counter: the planned step follows it)
    assert taken == [False, True, True] and torch.equal(m.weight, torch.full((2, 4), 0.5, dtype=torch.float16))
    m.weight.data = torch.full((2, 4), 0.25, dtype=torch.float16)  # another storage, its own counter kept
    opt.step()
    assert taken[-1] is False and torch.equal(m.weight, torch.full((2, 4), 0.25, dtype=torch.float16))
