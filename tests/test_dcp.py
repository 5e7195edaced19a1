"""Sharded checkpoints of mpfused's optimizer and scaler with torch.distributed.checkpoint (DCP) and
torch.distributed.checkpoint.state_dict (get_state_dict / set_state_dict), FSDP2 on gloo CPU ranks.

The model's sharded params are BF16, so FusedAdamW keeps FP32 masters: they, the moments and the step
counts go into the checkpoint as DTensors (shards) and plain tensors, the scaler's state beside them.

- Same sharding (2 ranks save, 2 ranks load): the resumed run equals the unbroken one bit for bit:
  losses, params, masters, scale and skipped steps.
- Resharding (4 ranks save, 2 ranks load): the resumed run follows the unbroken 4-rank run to the
  tolerance of a different reduction order (the per-rank batch and the gradient reduction change)."""

from __future__ import annotations

import os

import pytest
import torch

import mpfused
from dist_helpers import run_ranks
from mpfused.optim import FusedAdamW
from tolerances import DIST_BF16_LOSS_RTOL, DIST_BF16_PARAM_ATOL

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available in this torch build", allow_module_level=True)

STEPS, SAVE_AT, OVERFLOW_AT = 6, 3, 1
BATCH = 8
LR = 1e-2


def _build(world, seed=0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(torch.bfloat16)
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = FusedAdamW(model.parameters(), lr=LR, weight_decay=0.1)
    scaler = mpfused.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    return model, opt, scaler


def _step(model, opt, scaler, step, rank, world):
    """One iteration on this rank's part of the global batch; returns the global loss (a mean over ranks)."""
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)
    rows = BATCH // world
    x, y = x[rank * rows:(rank + 1) * rows].to(torch.bfloat16), y[rank * rows:(rank + 1) * rows]
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    if step == OVERFLOW_AT and rank == 0:
        next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("nan")
    scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


def _snapshot(model, opt, scaler):
    params = [p.full_tensor().float() for p in model.parameters()]
    masters = [opt.state[p]["master_param"].full_tensor() for p in model.parameters()]
    return dict(params=params, masters=masters, scale=scaler.get_scale(), skipped=scaler.skipped_steps)


def _save(model, opt, scaler, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "scaler": scaler.state_dict()}, checkpoint_id=path)


def _load(model, opt, scaler, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd, "scaler": scaler.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    scaler.load_state_dict(sd["scaler"])


def _unbroken(rank, world, path):
    """Train, save at SAVE_AT, go on to STEPS: the resumed runs' reference."""
    model, opt, scaler = _build(world)
    losses = []
    for step in range(STEPS):
        if step == SAVE_AT:
            _save(model, opt, scaler, path)
        losses.append(_step(model, opt, scaler, step, rank, world))
    return dict(losses=losses[SAVE_AT:], **_snapshot(model, opt, scaler))


def _resumed(rank, world, path):
    """Fresh objects (another init), the checkpoint loaded, the steps after SAVE_AT."""
    from torch.distributed.tensor import DTensor

    model, opt, scaler = _build(world, seed=123)
    _load(model, opt, scaler, path)
    placements_ok = all(
        isinstance(opt.state[p][k], DTensor) and opt.state[p][k].placements == p.placements
        and opt.state[p][k].dtype == torch.float32 for p in model.parameters()
        for k in ("exp_avg", "exp_avg_sq", "master_param"))
    losses = [_step(model, opt, scaler, step, rank, world) for step in range(SAVE_AT, STEPS)]
    return dict(losses=losses, placements_ok=placements_ok, **_snapshot(model, opt, scaler))


def _two_ranks(rank, world, resharded_path, same_path):
    same = _unbroken(rank, world, same_path)
    return dict(same_unbroken=same, same_resumed=_resumed(rank, world, same_path),
                resharded=_resumed(rank, world, resharded_path))


def test_dcp_save_on_4_load_on_2(tmp_path):
    four, same = str(tmp_path / "four_ranks"), str(tmp_path / "two_ranks")
    unbroken4 = run_ranks(_unbroken, 4, four)[0]
    # the FP32 masters are in the checkpoint, beside the moments
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(four).read_metadata().state_dict_metadata
    for name in ("master_param", "exp_avg", "exp_avg_sq", "step"):
        assert any(k.startswith("optim.state.") and k.endswith("." + name) for k in keys), (name, sorted(keys)[:8])
    assert any(k.startswith("scaler") for k in keys), sorted(keys)
    two = run_ranks(_two_ranks, 2, four, same)
    for rank, r in enumerate(two):
        # same sharding: bit for bit
        a, b = r["same_unbroken"], r["same_resumed"]
        assert b["placements_ok"], rank
        assert a["losses"] == b["losses"], (rank, a["losses"], b["losses"])
        assert a["scale"] == b["scale"] and a["skipped"] == b["skipped"] == 1, (rank, a["scale"], b["scale"])
        for key in ("params", "masters"):
            for p, q in zip(a[key], b[key]):
                assert torch.equal(p, q), (rank, key)
        # resharded: 4 ranks' run resumed on 2
        c = r["resharded"]
        assert c["placements_ok"], rank
        assert c["scale"] == unbroken4["scale"] and c["skipped"] == unbroken4["skipped"] == 1
        torch.testing.assert_close(torch.tensor(c["losses"]), torch.tensor(unbroken4["losses"]),
                                   rtol=DIST_BF16_LOSS_RTOL, atol=0)
        for p, q in zip(c["masters"], unbroken4["masters"]):
            torch.testing.assert_close(p, q, rtol=0, atol=DIST_BF16_PARAM_ATOL)
    assert os.path.isdir(four) and os.path.isdir(same)


# ---- remainders between plain and FSDP2 params ---------------------------------------------------------------
def _remainder_model(fsdp_world=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 6).to(torch.bfloat16)  # (6 rows: uneven shards on 4 ranks too)
    if fsdp_world is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (fsdp_world,)))
    return model, FusedAdamW(model.parameters(), lr=1e-2, master_weights="remainder")


def _remainder_train(model, opt, steps):
    for s in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


def _whole_remainders(model, opt):
    """Each param's remainder as a plain int16 tensor (a DTensor's gathered as int32: no int16 collectives)."""
    out = []
    for p in model.parameters():
        r = opt.state[p]["master_remainder"]
        out.append(r.to(torch.int32).full_tensor().to(torch.int16) if hasattr(r, "full_tensor") else r.clone())
    return out


def _fsdp_remainders_save(rank, world, path):
    model, opt = _remainder_model(world)
    _remainder_train(model, opt, 3)
    _save_model_opt(model, opt, path)
    return _whole_remainders(model, opt)


def _fsdp_remainders_load(rank, world, path):
    model, opt = _remainder_model(world)
    _remainder_train(model, opt, 1)  # (states to load into)
    _load_model_opt(model, opt, path)
    return _whole_remainders(model, opt)


def _save_model_opt(model, opt, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _load_model_opt(model, opt, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def test_dcp_remainders_move_between_fsdp2_and_plain_params_bit_for_bit(tmp_path):
    """A master_weights="remainder" checkpoint saved by FSDP2 ranks loads into a plain model (resharding to
    one process for export or fine-tuning), and a plain one into FSDP2 ranks, with every remainder's bits.
    DCP converts a saved dtype into the destination's value by value: when a plain param's remainder was
    int16 and a DTensor's its bfloat16 view, the remainders came back as 0 one way and as other bits the
    other, and the masters lost their low halves silently."""
    import warnings

    sharded, plain = str(tmp_path / "fsdp2"), str(tmp_path / "plain")
    saved = run_ranks(_fsdp_remainders_save, 2, sharded)[0]
    assert any(bool(r.ne(0).any()) for r in saved)
    model, opt = _remainder_model()
    _remainder_train(model, opt, 1)
    with warnings.catch_warnings():  # (DCP without a process group says it runs on one process)
        warnings.simplefilter("ignore")
        _load_model_opt(model, opt, sharded)
    for got, want in zip(_whole_remainders(model, opt), saved):
        assert got.dtype == torch.int16 and torch.equal(got, want)

    model, opt = _remainder_model()
    _remainder_train(model, opt, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _save_model_opt(model, opt, plain)
    want = _whole_remainders(model, opt)
    for rank_result in run_ranks(_fsdp_remainders_load, 2, plain):
        for got, w in zip(rank_result, want):
            assert torch.equal(got, w)
