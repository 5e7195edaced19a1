"""mpfused.amp.initialize: the O0-O3 table, overrides, input/output casting, optimizer conversion (same
hyperparameters, param groups and state), errors, and O2 tracking O0."""

import copy
import dataclasses
import inspect
from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mpfused import amp
from mpfused.optim import FusedAdam, FusedAdamW, FusedSGD
from mpfused.optim._base import join_master, split_master
from tolerances import AMP_O2_VS_O0_LOSS_ATOL, OPTIM_FP32_ATOL

LEVELS = ["O0", "O1", "O2", "O3"]
LOWP = [torch.float16, torch.bfloat16]
NORM_TYPES = (nn.BatchNorm1d, nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm1d)


class Net(nn.Module):
    """Linear layers around every kind of normalization layer amp keeps in FP32."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.bn = nn.BatchNorm1d(16)
        self.ln = nn.LayerNorm(16)
        self.gn = nn.GroupNorm(4, 16)
        self.inorm = nn.InstanceNorm1d(16, affine=True)
        self.fc2 = nn.Linear(16, 5)

    def forward(self, x):
        h = F.gelu(self.ln(self.bn(self.fc1(x))))
        h = self.gn(h)
        h = self.inorm(h.unsqueeze(-1).expand(-1, -1, 3)).mean(-1)
        return self.fc2(h)


def net(device, seed=0):
    torch.manual_seed(seed)
    return Net().to(device)


def batch(device, n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 12, generator=g).to(device), torch.randint(0, 5, (n,), generator=g).to(device)


def iteration(model, opt, scaler, x, y):
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss.item()


def is_norm(module):
    return isinstance(module, NORM_TYPES)


# ---- the table --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("level", LEVELS)
def test_level_table(device, level, dtype):
    model = net(device)
    params_before = list(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, scaler = amp.initialize(model, opt, level, dtype=dtype)

    # Parameter objects are kept (cast in place); the torch optimizer became the fused one.
    assert all(a is b for a, b in zip(model.parameters(), params_before))
    assert type(opt) is FusedAdamW
    cast = level in ("O2", "O3")
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if not cast or (level == "O2" and is_norm(module)):
                assert p.dtype == torch.float32, (level, module)
            else:
                assert p.dtype == dtype, (level, module)
    bn = model.bn
    assert bn.running_mean.dtype == (dtype if level == "O3" else torch.float32)
    assert bn.num_batches_tracked.dtype == torch.int64

    # The scaler: dynamic at O1/O2, disabled (scale 1) at O0/O3.
    if level in ("O1", "O2"):
        assert scaler.is_enabled() and scaler.get_scale() == 2.0**16 and scaler.state_dict()["dynamic"] is True
    else:
        assert not scaler.is_enabled() and scaler.get_scale() == 1.0

    props = amp.properties(model)
    assert props.opt_level == level and props.dtype == dtype
    assert props.master_weights is (level == "O2")
    assert props.keep_batchnorm_fp32 is {"O0": None, "O1": None, "O2": True, "O3": False}[level]

    x, y = batch(device)
    out = model(x)
    assert out.dtype == (dtype if level == "O3" else torch.float32)
    losses = [iteration(model, opt, scaler, x, y) for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))

    # FP32 master copies exactly for the low-precision params, and only at O2.
    for p in model.parameters():
        state = opt.state[p]
        if level == "O2" and p.dtype == dtype:
            assert state["master_param"].dtype == torch.float32
            assert torch.equal(state["master_param"].to(dtype), p)
        else:
            assert "master_param" not in state
        assert state["exp_avg"].dtype == torch.float32


def test_o1_runs_forward_under_autocast_and_returns_fp32(device):
    seen = {}

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            seen["autocast"] = torch.is_autocast_enabled(x.device.type)
            seen["autocast_dtype"] = torch.get_autocast_dtype(x.device.type)
            out = self.fc(x)
            seen["linear_out"] = out.dtype
            return out, {"int": torch.arange(3, device=x.device)}

    for dtype in LOWP:
        torch.manual_seed(0)
        model, _, _ = amp.initialize(Probe().to(device), None, "O1", dtype=dtype)
        out, extra = model(torch.randn(2, 4, device=device))
        assert seen == {"autocast": True, "autocast_dtype": dtype, "linear_out": dtype}
        assert out.dtype == torch.float32 and extra["int"].dtype == torch.int64
        assert not torch.is_autocast_enabled(device)  # the context was left
        assert model.fc.weight.dtype == torch.float32


def test_o1_takes_the_autocast_device_from_the_model_at_each_call(device, monkeypatch):
    # a model moved after initialize (initialize on the CPU, then .cuda()) must not run under the CPU's
    # autocast, which would leave its CUDA forward in FP32, silently
    model, _, _ = amp.initialize(net(device), None, "O1")
    asked = []
    real = amp._model_device
    monkeypatch.setattr(amp, "_model_device", lambda m: asked.append(m) or real(m))
    for _ in range(2):
        model(batch(device)[0])
    assert asked == [model, model]


@pytest.mark.parametrize("level", LEVELS)
def test_the_forward_keeps_its_signature_and_name(device, level):
    # The Hugging Face Trainer keeps the dataset columns that inspect.signature(model.forward) names: a
    # (*args, **kwargs) wrapper would drop them all
    class Named(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, input_ids, attention_mask=None, labels=None):
            return self.fc(input_ids)

    model, _, _ = amp.initialize(Named().to(device), None, level)
    want = inspect.signature(Named().forward)
    for m in (model, copy.deepcopy(model)):
        assert inspect.signature(m.forward) == want and m.forward.__name__ == "forward"
    if level != "O0":  # (the wrapper's class reads as a class)
        assert "module" in inspect.signature(type(model.forward)).parameters
    assert model(torch.randn(2, 4, device=device)).shape == (2, 3)


def test_a_replaced_optimizer_refuses_to_step(device):
    model = net(device)
    old = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, scaler = amp.initialize(model, old, "O2")
    iteration(model, opt, scaler, *batch(device))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="this AdamW was replaced by the FusedAdamW that mpfused.amp.initialize returned"):
        old.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    copy.deepcopy(old)  # still an optimizer object
    # an LR scheduler attached to it afterwards (torch's wraps optimizer.step.__func__) gets the same error
    torch.optim.lr_scheduler.StepLR(old, step_size=1)
    with pytest.raises(RuntimeError, match="was replaced by the FusedAdamW"):
        old.step()


Pair = namedtuple("Pair", "a b")


@dataclasses.dataclass(frozen=True)
class Box:  # (a model output as a dataclass, e.g. a frozen one)
    t: torch.Tensor
    n: int


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_inputs_cast_to_dtype_and_outputs_back_to_fp32_through_nesting(device, level):
    seen = {}

    class Nested(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, pair, items, *, extra, ids):
            seen.update(x=x.dtype, a=pair.a.dtype, b=pair.b.dtype, item0=items[0].dtype, d=items[1]["d"].dtype,
                        box=items[2].t.dtype, extra=extra.dtype, ids=ids.dtype, pair_type=type(pair),
                        items_type=type(items))
            h = self.fc(x)
            return OrderedDict(out=h, pair=Pair(h, ids), parts=[h.double(), (h, 3)], box=Box(h, 7))

    dtype = torch.float16
    model, _, _ = amp.initialize(Nested().to(device), None, level, dtype=dtype)
    f32 = torch.randn(2, 4, device=device)
    box_in = Box(f32.double(), 7)
    out = model(f32, Pair(f32.double(), f32.bfloat16()), [f32, {"d": f32}, box_in], extra=f32,
                ids=torch.arange(2, device=device))
    # Every floating input arrives in dtype (float64 and bfloat16 included); integer ones are untouched.
    keys = ("x", "a", "b", "item0", "d", "box", "extra")
    assert {k: seen[k] for k in keys} == dict.fromkeys(keys, dtype)
    assert box_in.t.dtype == torch.float64  # (a dataclass is cast in a copy: the caller's is left as it is)
    assert type(out["box"]) is Box and out["box"].t.dtype == (torch.float32 if level == "O2" else dtype)
    assert out["box"].n == 7
    assert seen["ids"] == torch.int64 and seen["pair_type"] is Pair and seen["items_type"] is list
    assert type(out) is OrderedDict and type(out["pair"]) is Pair
    expected = torch.float32 if level == "O2" else dtype
    assert out["out"].dtype == expected and out["pair"].a.dtype == expected and out["parts"][1][0].dtype == expected
    assert out["pair"].b.dtype == torch.int64 and out["parts"][1][1] == 3
    assert out["parts"][0].dtype == torch.float64  # not a low-precision output: left alone
    # The FP32 output is the low-precision value, exactly.
    assert torch.equal(out["out"], model.fc(f32.to(dtype)).float())


def test_o2_norm_layers_compute_in_fp32_and_hand_back_dtype(device):
    seen = []

    class RecordingLN(nn.LayerNorm):
        def forward(self, x):
            seen.append((x.dtype, self.weight.dtype))
            return super().forward(x)

    model = nn.Sequential(nn.Linear(6, 8), RecordingLN(8), nn.Linear(8, 2)).to(device)
    for dtype in LOWP:
        seen.clear()
        m, _, _ = amp.initialize(copy.deepcopy(model), None, "O2", dtype=dtype)
        hidden = []
        m[1].register_forward_hook(lambda mod, args, out: hidden.append(out.dtype))
        m(torch.randn(3, 6, device=device))
        assert seen == [(torch.float32, torch.float32)]
        assert hidden == [dtype]  # the next layer gets dtype


# ---- overrides --------------------------------------------------------------------------------------
def test_keep_batchnorm_fp32_overrides(device):
    model, _, _ = amp.initialize(net(device), None, "O2", keep_batchnorm_fp32=False)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert model.bn.running_var.dtype == torch.float16
    model, _, _ = amp.initialize(net(device), None, "O3", keep_batchnorm_fp32=True)
    for module in model.modules():
        for p in module.parameters(recurse=False):
            assert p.dtype == (torch.float32 if is_norm(module) else torch.float16)
    assert model(batch(device)[0]).dtype == torch.float16  # O3 outputs stay in dtype
    with pytest.raises(ValueError, match="keep_batchnorm_fp32=False cannot hold at O1"):
        amp.initialize(net(device), None, "O1", keep_batchnorm_fp32=False)
    model, _, _ = amp.initialize(net(device), None, "O1", keep_batchnorm_fp32=True)  # trivially true
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("level,master_weights,expect", [("O2", False, False), ("O3", True, True)])
def test_master_weights_override(device, level, master_weights, expect):
    model = net(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt, scaler = amp.initialize(model, opt, level, master_weights=master_weights)
    assert amp.properties(model).master_weights is expect
    x, y = batch(device)
    iteration(model, opt, scaler, x, y)
    low = [p for p in model.parameters() if p.dtype == torch.float16]
    assert low and all(("master_param" in opt.state[p]) is expect for p in low)


def fc1_first(model, **first):
    return [{"params": [model.fc1.weight, model.fc1.bias], **first},
            {"params": [p for n, p in model.named_parameters() if not n.startswith("fc1.")]}]


def test_a_group_that_chose_its_master_weights_keeps_them(device):
    """A fused optimizer's group with its own master_weights (here False with stochastic rounding: 12 bytes
    a param) keeps it at O2; the default groups take the level's FP32 masters. initialize's master_weights=
    sets every group."""
    model = net(device)
    opt = FusedAdamW(fc1_first(model, master_weights=False, rounding="stochastic", seed=3), lr=1e-2)
    model, opt, scaler = amp.initialize(model, opt, "O2", dtype=torch.bfloat16)
    assert [g["master_weights"] for g in opt.param_groups] == [False, True]
    before = model.fc1.weight.detach().clone()
    train_steps(model, opt, 3, scaler=scaler)
    assert "master_param" not in opt.state[model.fc1.weight] and not torch.equal(model.fc1.weight, before)
    assert "master_param" in opt.state[model.fc2.weight]
    model = net(device)
    opt = FusedAdamW(fc1_first(model, master_weights=False), lr=1e-2)
    model, opt, _ = amp.initialize(model, opt, "O2", dtype=torch.bfloat16, master_weights=True)
    assert [g["master_weights"] for g in opt.param_groups] == [True, True]
    assert "master_param" in opt.state[model.fc1.weight]


def test_a_remainder_group_starts_from_the_exact_fp32_values(device):
    """A group set to master_weights="remainder" keeps it at O2 with BF16: its param and remainder hold the
    exact FP32 values (not the rounded params), so training is bit for bit the FP32-master run."""
    def run(first):
        model = net(device)
        opt = FusedAdamW(fc1_first(model), lr=1e-2)
        opt.param_groups[0]["master_weights"] = first  # (the constructor refuses it for the FP32 params)
        fp32 = model.fc1.weight.detach().clone()
        model, opt, scaler = amp.initialize(model, opt, "O2", dtype=torch.bfloat16)
        state = opt.state[model.fc1.weight]
        if first == "remainder":
            assert set(state) == {"master_remainder"} and opt.param_groups[0]["master_weights"] == "remainder"
            assert torch.equal(join_master(model.fc1.weight, state["master_remainder"]), fp32)
        losses = train_steps(model, opt, 4, scaler=scaler)
        return losses, [p.detach().clone() for p in model.parameters()]

    (rem_losses, rem_params), (ref_losses, ref_params) = run("remainder"), run(True)
    assert rem_losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(rem_params, ref_params))


def test_a_remainder_group_with_an_fp16_model_raises_before_anything_changes(device):
    model = net(device)
    opt = FusedAdamW(fc1_first(model), lr=1e-2)
    opt.param_groups[0]["master_weights"] = "remainder"
    with pytest.raises(ValueError, match="param group 0 of the optimizer has master_weights='remainder'"):
        amp.initialize(model, opt, "O2")
    assert all(p.dtype == torch.float32 for p in model.parameters()) and not opt.state


def test_a_kept_group_is_checked_before_anything_changes(device):
    """A group's own master_weights is checked with the rest, before the cast: a value the optimizer would refuse
    at its first step, 'remainder' beside stochastic rounding, and 'remainder' over a normalization layer's params,
    which O2 keeps in FP32."""
    cases = [(dict(master_weights="yes"), "Invalid master_weights"),
             (dict(master_weights="remainder", rounding="stochastic"), "cannot be combined with master_weights='remainder'")]
    for first, match in cases:
        model = net(device)
        opt = FusedAdamW(fc1_first(model), lr=1e-2)
        opt.param_groups[0].update(first)
        with pytest.raises(ValueError, match=match):
            amp.initialize(model, opt, "O2", dtype=torch.bfloat16)
        assert all(p.dtype == torch.float32 for p in model.parameters()) and not opt.state
    model = net(device)
    opt = FusedAdamW([{"params": [model.fc1.weight, model.bn.weight]},
                      {"params": [p for n, p in model.named_parameters() if n not in ("fc1.weight", "bn.weight")]}],
                     lr=1e-2)
    opt.param_groups[0]["master_weights"] = "remainder"
    with pytest.raises(ValueError, match=r"param 1 of param group 0 of the optimizer \('bn.weight'\) belongs to a "
                                         "normalization layer"):
        amp.initialize(model, opt, "O2", dtype=torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in model.parameters()) and not opt.state
    # with the normalization layers cast too, the group is BF16 throughout
    model, opt, scaler = amp.initialize(model, opt, "O2", dtype=torch.bfloat16, keep_batchnorm_fp32=False)
    train_steps(model, opt, 2, scaler=scaler)
    assert "master_remainder" in opt.state[model.bn.weight]


def test_split_master_is_join_masters_inverse():
    bits = torch.cat([torch.randint(-2**31, 2**31, (100_000,), generator=torch.Generator().manual_seed(0),
                                    dtype=torch.int64),
                      torch.tensor([0x7F7F8000, 0x3F808000, -0x407F8000, 0x7F800000, 0x00008000, 0x7FC00001])])
    m = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
    p = torch.empty_like(m, dtype=torch.bfloat16)
    hi, lo = split_master(m, p)
    back = join_master(hi, lo)
    finite = ~m.isnan()
    assert torch.equal(back[finite].view(torch.int32), m[finite].view(torch.int32))
    assert back[~finite].isnan().all() and (hi[~finite].view(torch.int16) == 0x7FC0).all()
    # ties go away from zero (so that the remainder fits 16 bits): 1 + 2^-8 is halfway
    assert hi[-5].item() == 1.0 + 2.0 ** -7 and lo[-5].item() == -0x8000


@pytest.mark.parametrize("level", LEVELS)
def test_loss_scale_overrides(device, level):
    x, y = batch(device)
    # A static scale: kept through steps, not grown.
    model = net(device)
    model, opt, scaler = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), level, loss_scale=128.0)
    assert scaler.is_enabled() and scaler.state_dict()["dynamic"] is False and amp.properties(model).loss_scale == 128.0
    assert scaler.scale(torch.ones((), device=device)).item() == 128.0
    for _ in range(3):
        iteration(model, opt, scaler, x, y)
    assert scaler.get_scale() == 128.0
    # "dynamic" at every level, including O0 and O3.
    model = net(device)
    model, opt, scaler = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), level,
                                        loss_scale="dynamic")
    assert scaler.is_enabled() and scaler.state_dict()["dynamic"] is True
    # 1 (an int is fine): the scaler is a pass-through.
    model = net(device)
    model, opt, scaler = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), level, loss_scale=1)
    loss = torch.tensor(3.0, device=device)
    assert not scaler.is_enabled() and scaler.scale(loss) is loss and scaler.get_scale() == 1.0
    iteration(model, opt, scaler, x, y)


def test_dynamic_scaler_skips_an_overflowing_step_at_o2(device):
    model = net(device)
    model, opt, scaler = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2")
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(device)
    opt.zero_grad(set_to_none=True)
    scaler.scale(F.cross_entropy(model(x), y) * 1e10).backward()  # overflows FP16 gradients
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ---- optimizer conversion ---------------------------------------------------------------------------
CONVERSIONS = {
    "adam-amsgrad": (torch.optim.Adam, FusedAdam, dict(lr=2e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1,
                                                        amsgrad=True)),
    "adamw-maximize": (torch.optim.AdamW, FusedAdamW, dict(lr=1e-3, weight_decay=0.05, maximize=True)),
    "sgd-nesterov": (torch.optim.SGD, FusedSGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    "sgd-dampening": (torch.optim.SGD, FusedSGD, dict(lr=0.05, momentum=0.8, dampening=0.3)),
}


def two_groups(model, kw):
    return [{"params": [model.fc1.weight, model.fc1.bias], "lr": kw["lr"] / 2, "name": "first"},
            {"params": [p for n, p in model.named_parameters() if not n.startswith("fc1.")]}]


def train_steps(model, opt, n, seed=2, scaler=None):
    losses = []
    for i in range(n):
        x, y = batch(next(model.parameters()).device, seed=seed + i)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).float(), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("case", sorted(CONVERSIONS))
def test_conversion_keeps_hyperparameters_groups_and_state_and_continues_like_torch(device, case):
    torch_cls, fused_cls, kw = CONVERSIONS[case]
    model = net(device)
    opt = torch_cls(two_groups(model, kw), **kw)
    train_steps(model, opt, 3)
    reference_model = copy.deepcopy(model)
    reference = torch_cls(two_groups(reference_model, kw), **kw)
    reference.load_state_dict(copy.deepcopy(opt.state_dict()))  # (the fused one takes over opt's tensors)
    torch_groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    torch_state = {p: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
                   for p in model.parameters()}

    model, fused, scaler = amp.initialize(model, opt, "O0")
    assert type(fused) is fused_cls
    assert len(fused.param_groups) == 2
    for group, expected in zip(fused.param_groups, torch_groups):
        for key, value in expected.items():
            assert group[key] == value, key
    assert fused.param_groups[0]["name"] == "first" and fused.param_groups[0]["lr"] == kw["lr"] / 2
    assert [p for g in fused.param_groups for p in g["params"]] == [p for g in opt.param_groups for p in g["params"]]
    for p in model.parameters():
        for key, value in torch_state[p].items():
            if key == "step" and fused_cls is FusedSGD:
                continue
            # (torch keeps a non-capturable step on the host, ours on the params' device: compare the values)
            assert torch.equal(torch.as_tensor(fused.state[p][key]).float().cpu(),
                               torch.as_tensor(value).float().cpu()), key

    # It continues the trajectory torch would have taken. Both optimizers are fed the reference model's
    # gradients: this model's forward (batch-8 BatchNorm, InstanceNorm over three equal values) amplifies
    # a one-ulp weight difference about 100x per step into the gradients, so free-running trajectories
    # drift apart by more than the optimizer's own rounding on some CPUs (the BLAS rounds differently).
    assert not scaler.is_enabled()
    ours, ref = [], []
    for i in range(20):
        x, y = batch(device, seed=50 + i)
        for m, o, losses in ((model, fused, ours), (reference_model, reference, ref)):
            o.zero_grad(set_to_none=True)
            loss = F.cross_entropy(m(x).float(), y)
            loss.backward()  # (O0's scaler is disabled: its scale is 1)
            losses.append(loss.item())
        for a, b in zip(model.parameters(), reference_model.parameters()):
            a.grad.copy_(b.grad)
        scaler.step(fused)
        scaler.update()
        reference.step()
    for a, b in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=OPTIM_FP32_ATOL)
    assert ours == pytest.approx(ref, rel=1e-4)
    assert abs(ours[-1] - ours[0]) > 1e-3


@pytest.mark.parametrize("dtype", LOWP)
def test_o2_conversion_takes_the_exact_fp32_values_as_masters(device, dtype):
    model = net(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_steps(model, opt, 2)
    fp32 = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    model, fused, _ = amp.initialize(model, opt, "O2", dtype=dtype)
    for n, p in model.named_parameters():
        state = fused.state[p]
        assert torch.equal(state["exp_avg"], moments[n])
        if p.dtype == dtype:
            assert torch.equal(state["master_param"], fp32[n])  # not the rounded param
            assert not torch.equal(p.float(), fp32[n])          # (the rounding did change it)
        else:
            assert torch.equal(p, fp32[n]) and "master_param" not in state


def test_a_fused_optimizer_is_kept_and_gets_exact_masters(device):
    model = net(device)
    fp32 = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = FusedSGD(model.parameters(), lr=0.1, momentum=0.9)
    model, out, _ = amp.initialize(model, opt, "O2")
    assert out is opt
    assert all(torch.equal(opt.state[p]["master_param"], fp32[n])
               for n, p in model.named_parameters() if p.dtype == torch.float16)


def test_lists_of_optimizers_and_none(device):
    model = net(device)
    first = torch.optim.SGD(model.fc1.parameters(), lr=0.1)
    second = FusedAdam([p for n, p in model.named_parameters() if not n.startswith("fc1.")])
    m, opts, scaler = amp.initialize(model, [first, second], "O2")
    assert type(opts) is list and type(opts[0]) is FusedSGD and opts[1] is second
    x, y = batch(device)
    opts[0].zero_grad()
    opts[1].zero_grad()
    scaler.scale(F.cross_entropy(m(x), y)).backward()
    for o in opts:
        scaler.step(o)
    scaler.update()
    assert all("master_param" in o.state[p] for o in opts for g in o.param_groups for p in g["params"]
               if p.dtype == torch.float16)
    model = net(device)
    _, opts, _ = amp.initialize(model, (torch.optim.Adam(model.parameters()),), "O1")
    assert type(opts) is tuple and len(opts) == 1 and type(opts[0]) is FusedAdam
    _, none, scaler = amp.initialize(net(device), None, "O2")
    assert none is None and scaler.is_enabled()


def test_a_non_convertible_optimizer_is_kept_where_no_masters_are_needed(device):
    for level, kwargs in (("O1", {}), ("O3", {}), ("O2", {"master_weights": False})):
        model = net(device)
        opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
        model, out, scaler = amp.initialize(model, opt, level, **kwargs)
        assert out is opt
        x, y = batch(device)
        iteration(model, out, scaler, x, y)


def test_an_optimizer_over_a_sparse_embedding(device):
    """The fused optimizers take no sparse gradients: a torch.optim.SGD over an nn.Embedding(sparse=True) is
    kept where no masters are needed, and trains the embedding as in torch; where masters are needed, and
    for a fused optimizer over it, initialize raises before anything changes (it once converted the SGD,
    whose first step then failed, the model already cast and the old optimizer disabled)."""
    def model_and_sgd():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2)).to(device)
        return model, torch.optim.SGD(model.parameters(), lr=0.5)

    tokens = torch.tensor([1, 2, 2], device=device)
    for level, kwargs in (("O0", {}), ("O1", {}), ("O3", {}), ("O2", {"master_weights": False})):
        model, opt = model_and_sgd()
        model, out, scaler = amp.initialize(model, opt, level, dtype=torch.bfloat16, **kwargs)
        assert out is opt
        before = model[0].weight.detach().clone()
        scaler.scale(model(tokens).float().sum()).backward()
        assert model[0].weight.grad.is_sparse
        scaler.step(out)
        scaler.update()
        assert (model[0].weight != before).any(1).nonzero().flatten().tolist() == [1, 2], level
    # a frozen sparse embedding has no grad: nothing to refuse
    model, _ = model_and_sgd()
    model[0].weight.requires_grad_(False)
    model, out, _ = amp.initialize(model, FusedSGD(model.parameters(), lr=0.5), "O2", dtype=torch.bfloat16)
    assert isinstance(out, FusedSGD)
    for make, level in ((lambda m: torch.optim.SGD(m.parameters(), lr=0.5), "O2"),
                        (lambda m: FusedSGD(m.parameters(), lr=0.5), "O1")):
        model, _ = model_and_sgd()
        with pytest.raises(ValueError, match=r"updates '0.weight', the weight of an embedding with sparse=True"):
            amp.initialize(model, make(model), level, dtype=torch.bfloat16)
        assert all(p.dtype == torch.float32 for p in model.parameters()) and amp.properties(model) is None


def test_deepcopy_and_state_dict_of_an_initialized_model(device):
    model, _, _ = amp.initialize(net(device), None, "O2")
    keys = set(net(device).state_dict())
    assert set(model.state_dict()) == keys
    x = batch(device)[0]
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.zero_()
    model.eval()
    clone.eval()
    out, out_clone = model(x), clone(x)
    assert out.dtype == out_clone.dtype == torch.float32
    assert not torch.equal(out, out_clone)  # the copy's forward runs the copy, not the original
    assert amp.properties(clone) == amp.properties(model)


def test_an_lr_scheduler_made_before_initialize_warns(device):
    model = net(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    with pytest.warns(UserWarning, match="Create LR schedulers after amp.initialize"):
        amp.initialize(model, opt, "O2")


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_the_hooks_of_a_replaced_optimizer_are_the_fused_ones_and_the_replacement_runs_none(device, level):
    """Hooks registered on the torch optimizer that initialize replaces carry over to the fused one (an EMA in
    a step post-hook kept running; they were dropped, in silence), their handles still remove them, and the
    hand-over runs none of them (a state_dict post-hook that edits the dict would have edited what the fused
    optimizer loads: here one that would empty the state)."""
    model = net(device)
    old = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = batch(device)
    F.cross_entropy(model(x), y).backward()
    old.step()  # state to hand over
    calls = []
    old.register_step_pre_hook(lambda o, a, k: calls.append(("step_pre", o)))
    post = old.register_step_post_hook(lambda o, a, k: calls.append(("step_post", o)))
    old.register_state_dict_pre_hook(lambda o: calls.append(("sd_pre", o)))

    def shrink(o, sd):
        calls.append(("sd_post", o))
        sd["state"].clear()
    old.register_state_dict_post_hook(shrink)
    old.register_load_state_dict_pre_hook(lambda o, sd: calls.append(("lsd_pre", o)))
    old.register_load_state_dict_post_hook(lambda o: calls.append(("lsd_post", o)))
    model, opt, scaler = amp.initialize(model, old, level)
    assert calls == [] and isinstance(opt, FusedAdamW)
    assert all("exp_avg" in opt.state[p] for p in model.parameters())  # the edit-on-save hook did not run
    iteration(model, opt, scaler, *batch(device))
    assert calls == [("step_pre", opt), ("step_post", opt)]
    calls.clear()
    sd = opt.state_dict()
    assert [c[0] for c in calls] == ["sd_pre", "sd_post"] and sd["state"] == {}
    opt.load_state_dict(sd)
    assert [c[0] for c in calls] == ["sd_pre", "sd_post", "lsd_pre", "lsd_post"]
    post.remove()
    calls.clear()
    iteration(model, opt, scaler, *batch(device))
    assert calls == [("step_pre", opt)]


# ---- errors -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,error,match", [
    (dict(opt_level="O4"), ValueError, "unknown opt_level 'O4'"),
    (dict(opt_level="o2"), ValueError, "unknown opt_level"),
    (dict(opt_level=2), ValueError, "unknown opt_level"),
    (dict(dtype=torch.float32), ValueError, "dtype must be torch.float16 or torch.bfloat16"),
    (dict(dtype="float16"), ValueError, "dtype must be"),
    (dict(loss_scale=0), ValueError, "loss_scale must be a positive"),
    (dict(loss_scale=-2.0), ValueError, "loss_scale must be a positive"),
    (dict(loss_scale=float("inf")), ValueError, "loss_scale must be a positive"),
    (dict(loss_scale=float("nan")), ValueError, "loss_scale must be a positive"),
    (dict(loss_scale="static"), ValueError, "loss_scale must be \"dynamic\""),
    (dict(loss_scale=True), ValueError, "loss_scale must be \"dynamic\""),
    (dict(loss_scale=torch.tensor(2.0)), ValueError, "loss_scale must be \"dynamic\""),
    (dict(loss_scale=np.float32("nan")), ValueError, "loss_scale must be a positive"),
    # stored as the float32 scale, 1e-46 is 0 and 1e-40 a subnormal whose inverse is inf
    (dict(loss_scale=1e-46), ValueError, "loss_scale must be a positive"),
    (dict(loss_scale=1e-40), ValueError, "loss_scale must be a positive"),
    (dict(master_weights="yes"), ValueError, "master_weights must be None, True or False"),
    (dict(keep_batchnorm_fp32=1), ValueError, "keep_batchnorm_fp32 must be None, True or False"),
    (dict(opt_level="O1", master_weights=True), ValueError, "master_weights=True has no meaning at O1"),
    (dict(opt_level="O0", master_weights=True), ValueError, "master_weights=True has no meaning at O0"),
])
def test_bad_arguments_raise_before_anything_changes(device, kwargs, error, match):
    model = net(device)
    opt = torch.optim.Adam(model.parameters())
    kwargs = dict(opt_level="O2") | kwargs
    with pytest.raises(error, match=match):
        amp.initialize(model, opt, **kwargs)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert amp.properties(model) is None and "forward" not in model.__dict__


def test_unsupported_optimizer_for_o2_raises_and_changes_nothing(device):
    model = net(device)
    opt = torch.optim.RMSprop(model.parameters())
    with pytest.raises(ValueError, match="RMSprop cannot be converted"):
        amp.initialize(model, opt, "O2")
    with pytest.raises(ValueError, match="RMSprop cannot be converted"):
        amp.initialize(model, opt, "O3", master_weights=True)

    class MyAdam(torch.optim.Adam):  # a subclass may change step(): not converted silently
        pass

    with pytest.raises(ValueError, match="MyAdam cannot be converted"):
        amp.initialize(model, MyAdam(model.parameters()), "O2")
    with pytest.raises(ValueError, match="differentiable=True"):
        amp.initialize(model, torch.optim.Adam(model.parameters(), differentiable=True), "O1")
    assert all(p.dtype == torch.float32 for p in model.parameters()) and amp.properties(model) is None


@pytest.mark.parametrize("level", ["O0", "O2"])
def test_what_the_fused_step_would_refuse_is_refused_before_anything_changes(device, level):
    """A torch optimizer that a fused one cannot continue (a complex param: torch's Adam steps it; a group's
    hyperparameter set after construction, which torch never checks): refused by initialize, where the fused
    step refused it only after the model was cast and the torch optimizer replaced."""
    class Complex(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)
            self.w = nn.Parameter(torch.randn(2, dtype=torch.complex64))

        def forward(self, x):
            return (self.lin(x) * (self.w * self.w.conj()).real).sum()

    model = Complex().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="param 0 of param group 0: .* got torch.complex64"):
        amp.initialize(model, opt, level)
    assert model.lin.weight.dtype == torch.float32 and amp.properties(model) is None
    model(torch.randn(3, 4, device=device)).backward()
    opt.step()  # still torch's, still stepping
    for key, value, match in [("lr", -1.0, "Invalid learning rate: -1.0"), ("betas", (1.5, 0.9), "Invalid beta"),
                              ("weight_decay", float("nan"), "Invalid weight_decay value: nan")]:
        model = net(device)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        opt.param_groups[0][key] = value
        with pytest.raises(ValueError, match=match):
            amp.initialize(model, opt, level)
        assert all(p.dtype == torch.float32 for p in model.parameters()) and amp.properties(model) is None
        opt.param_groups[0][key] = dict(lr=0.1, betas=(0.9, 0.999), weight_decay=0.01)[key]
        opt.step()


def test_optimizer_over_foreign_params_raises(device):
    model = net(device)
    stranger = nn.Parameter(torch.zeros(3, device=device))
    opt = torch.optim.SGD([{"params": model.parameters()}, {"params": [stranger]}], lr=0.1)
    with pytest.raises(ValueError, match="param 0 of param group 1 .* is not a parameter of the model"):
        amp.initialize(model, opt, "O2")
    with pytest.raises(ValueError, match="optimizer 1: param 0 of param group 1"):
        amp.initialize(model, [torch.optim.SGD(model.parameters(), lr=0.1), opt], "O1")
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_numpy_loss_scale_is_taken(device):
    _, _, scaler = amp.initialize(net(device), None, "O2", loss_scale=np.float32(128))
    assert scaler.get_scale() == 128.0


def test_the_same_optimizer_twice_raises(device):
    model = net(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="optimizer 1 is the same object as optimizer 0"):
        amp.initialize(model, [opt, opt], "O2")
    assert all(p.dtype == torch.float32 for p in model.parameters()) and amp.properties(model) is None


def test_a_param_tied_between_a_norm_and_another_module_raises(device):
    """O2 keeps norms FP32 and casts the rest: a param that is both would break one of them."""
    for first_norm in (True, False):
        ln, lin = nn.LayerNorm(4, device=device), nn.Linear(4, 4, device=device)
        lin.bias = ln.weight
        model = nn.Sequential(ln, lin) if first_norm else nn.Sequential(lin, ln)
        with pytest.raises(ValueError, match=r"parameter '\d.weight' of a normalization layer is also '\d.bias'"):
            amp.initialize(model, None, "O2")
        assert all(p.dtype == torch.float32 for p in model.parameters()) and amp.properties(model) is None
    model, _, _ = amp.initialize(nn.Sequential(ln, lin), None, "O2", keep_batchnorm_fp32=False)  # all cast: fine
    assert lin.weight.dtype == torch.float16 and lin.bias is ln.weight


class HeldNorm(nn.Module):
    """A norm whose params a ParameterList also holds (e.g. the params without weight decay)."""

    def __init__(self, device, list_first):
        super().__init__()
        ln = nn.LayerNorm(4, device=device)
        if list_first:
            self.held = nn.ParameterList([ln.weight, ln.bias])
        self.lin, self.ln = nn.Linear(4, 4, device=device), ln
        if not list_first:
            self.held = nn.ParameterList([ln.weight, ln.bias])

    def forward(self, x):
        return self.ln(self.lin(x))


def test_a_norms_params_held_in_a_parameter_list_stay_fp32(device):
    """Not a tie, and the norm's params stay FP32 whether the list or the norm comes first."""
    for list_first in (True, False):
        model = HeldNorm(device, list_first)
        amp.initialize(model, None, "O2")
        assert model.ln.weight.dtype == model.ln.bias.dtype == torch.float32
        assert model.lin.weight.dtype == torch.float16
        assert model(torch.randn(2, 4, device=device)).dtype == torch.float32


def test_other_bad_inputs(device):
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        amp.initialize([nn.Linear(2, 2)], None, "O2")
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        amp.initialize(net(device), "adam", "O2")
    with pytest.raises(ValueError, match="expects an FP32 model, but parameter 'fc1.weight' is torch.float16"):
        amp.initialize(net(device).half(), None, "O2")
    model, _, _ = amp.initialize(net(device), None, "O2")
    with pytest.raises(RuntimeError, match="already initialized"):
        amp.initialize(model, None, "O2")


# ---- O2 tracks O0 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", LOWP)
def test_o2_tracks_o0_over_100_steps(device, dtype):
    """A small MLP with LayerNorm and BatchNorm on a fixed teacher task, AdamW, 100 steps, the same data:
    O2's loss stays within AMP_O2_VS_O0_LOSS_ATOL of O0's at every step (see tolerances.py), while the
    loss itself falls by far more than that, and a 10% larger lr alone moves O0 by more than that."""
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.BatchNorm1d(64),
                             nn.GELU(), nn.Linear(64, 10)).to(device)

    g = torch.Generator().manual_seed(3)
    teacher = torch.randn(32, 10, generator=g)
    data = []
    for _ in range(100):
        x = torch.randn(64, 32, generator=g)
        data.append((x.to(device), (x @ teacher).argmax(1).to(device)))

    def run(level, lr=1e-3):
        model = build()
        model, opt, scaler = amp.initialize(model, torch.optim.AdamW(model.parameters(), lr=lr), level, dtype=dtype)
        return [iteration(model, opt, scaler, x, y) for x, y in data]

    o0, o2 = run("O0"), run("O2")
    tol = AMP_O2_VS_O0_LOSS_ATOL[dtype]
    gaps = [abs(a - b) for a, b in zip(o0, o2)]
    assert max(gaps) <= tol, (max(gaps), tol)
    assert o0[0] - o0[-1] > 100 * tol
    assert max(abs(a - b) for a, b in zip(o0, run("O0", lr=1.1e-3))) > 5 * tol


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_a_data_parallel_replica_computes_with_its_own_params(level):
    """nn.DataParallel replicates a module with _replicate_for_data_parallel (a shallow copy of its __dict__) and
    gives each replica the params broadcast to its device. The casting forward amp sets on the instance went
    along unchanged, so every replica ran the original module on the original (device 0) params. The steps
    torch.nn.parallel.replicate takes, on the CPU: a replica whose params are zeros must output zeros."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    model = amp.initialize(model, None, level, dtype=torch.bfloat16)[0]
    x = torch.randn(3, 4)
    want = model(x)
    replicas = {}
    for name, m in model.named_modules():
        r = m._replicate_for_data_parallel()
        for pname, p in m._parameters.items():  # (replicate's broadcast copies, here zeros)
            r._parameters[pname] = None if p is None else torch.zeros_like(p)
        replicas[name] = r
    for name, r in replicas.items():  # the children of each replica are the replicas (replicate's wiring)
        for child in list(r._modules):
            r._modules[child] = replicas[f"{name}.{child}" if name else child]
    root = replicas[""]
    root.eval()  # (BatchNorm's running statistics are the original's buffers: eval reads them alone)
    out = root(x)
    assert out.dtype == want.dtype and not torch.equal(want, torch.zeros_like(want))
    assert torch.equal(out, torch.zeros_like(out)), out
    assert torch.equal(model(x), want)  # the original is untouched


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_an_initialized_model_exports(level):
    """torch.export (non-strict) reads the forward's __code__ for its reports: the casting forward had none and
    export raised AttributeError. The exported program computes what the model does, casts included."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    model = amp.initialize(model, None, level, dtype=torch.bfloat16)[0].eval()
    x = torch.randn(3, 4)
    out = torch.export.export(model, (x,)).module()(x)
    assert out.dtype == model(x).dtype and torch.equal(out, model(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("optim", ["adamw", "adam", "fused"])
@pytest.mark.parametrize("case", ["stepped", "frozen", "step0"])
def test_a_checkpoint_loaded_before_initialize_keeps_its_masters(dtype, optim, case):
    """A fresh FP32 model and optimizer, the checkpoint of an O2 run loaded into them, then amp.initialize:
    initialize replaced the loaded FP32 masters with the loaded low-precision weights (and a FusedAdamW's
    load over FP32 params dropped them before), so the resumed run lost the masters' low bits. It is now
    bit-identical to the unbroken one, as loading after initialize is.
    A param in the optimizer that has not stepped ("frozen", as in fine-tuning; or every param of a
    checkpoint taken before the first step, "step0") has an entry with its master alone, and
    torch.optim.Adam(W).load_state_dict read the step of every entry: KeyError 'step'. Such an entry is now
    saved with step 0."""
    import io
    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.randn(8, 4)
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "fused": FusedAdamW}[optim]

    def build():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        if case == "frozen":
            m[1].weight.requires_grad_(False)  # yet in the optimizer
        return m, cls(m.parameters(), lr=1e-3)

    def step(m, opt, sc):
        opt.zero_grad()
        sc.scale(F.mse_loss(m(x).float(), y)).backward()
        sc.step(opt)
        sc.update()

    m, opt = build()
    m, opt, sc = amp.initialize(m, opt, "O2", dtype=dtype)
    for _ in range(0 if case == "step0" else 3):
        step(m, opt, sc)
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "scaler": sc.state_dict()}, buf)
    if case != "stepped":  # the entry that holds a master alone says step 0; the live one is left as it is
        assert "step" not in opt.state[m[1].weight]
        assert sorted(torch.load(io.BytesIO(buf.getvalue()), weights_only=True)["opt"]["state"][2]) == [
            "master_param", "step"]
    for _ in range(3):
        step(m, opt, sc)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    m2, opt2 = build()
    m2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    m2, opt2, sc2 = amp.initialize(m2, opt2, "O2", dtype=dtype)
    assert torch.equal(opt2.state[m2[0].weight]["master_param"], ck["opt"]["state"][0]["master_param"])
    sc2.load_state_dict(ck["scaler"])
    for _ in range(3):
        step(m2, opt2, sc2)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))
    for p, q in zip(m.parameters(), m2.parameters()):
        for key in ("master_param", "exp_avg", "exp_avg_sq"):
            if key in opt.state[p]:
                assert torch.equal(opt.state[p][key], opt2.state[q][key]), key
        assert float(opt.state[p].get("step", 0)) == float(opt2.state[q].get("step", 0))
