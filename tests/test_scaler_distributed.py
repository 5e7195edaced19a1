"""mpfused.GradScaler with a process_group (gloo, CPU processes): replicated gradients (DDP) and sharded
ones (each rank owns a part of the params, as in ZeRO/FSDP), with 2 and 4 ranks. The norm returned by
clip_grad_norm_ and the clipped step must equal torch's clip_grad_norm_ on the whole, unsharded model;
every rank skips together when one rank's gradients overflow.

One spawn per world size runs every case, to stay fast on a 2-core machine."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mpfused
from mpfused.optim import FusedSGD
from tolerances import DIST_NORM_RTOL, DIST_PARAM_ATOL

MAX_NORM = 0.5


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _batch(world):
    g = torch.Generator().manual_seed(1)
    return torch.randn(4 * world, 6, generator=g), torch.randn(4 * world, 3, generator=g)


def _reference(world):
    """torch alone, one process: the whole model on the whole batch, clip_grad_norm_, one SGD step."""
    m = _model()
    x, y = _batch(world)
    torch.nn.functional.mse_loss(m(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)
    with torch.no_grad():
        for p in m.parameters():
            p -= p.grad
    return norm.item(), [p.detach().clone() for p in m.parameters()]


def _run(scaler, opt, loss, overflow=False, drop_grads=False):
    opt.zero_grad()
    scaler.scale(loss * (float("inf") if overflow else 1.0)).backward()
    if drop_grads:  # this rank's shard got no gradient
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = None
    norm = scaler.clip_grad_norm_(opt, MAX_NORM)
    scaler.step(opt)
    scaler.update()
    return norm.item()


def _worker(rank, world, init_file, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        out = {}
        x, y = _batch(world)
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        for opt_name, ctor in (("fused", FusedSGD), ("torch", torch.optim.SGD)):
            # DDP: each rank its part of the batch; DDP averages the grads, so every rank holds the
            # whole model's gradient and the local norm is already the global one.
            ddp = torch.nn.parallel.DistributedDataParallel(_model())
            opt = ctor(ddp.parameters(), lr=1.0)
            scaler = mpfused.GradScaler("cpu", init_scale=64.0, process_group=dist.group.WORLD,
                                        grad_sharding="replicated")
            norm = _run(scaler, opt, torch.nn.functional.mse_loss(ddp(xs), ys))
            out[("replicated", opt_name)] = (norm, [p.detach().clone() for p in ddp.module.parameters()])
            # Sharded: every rank computes the whole batch's gradient but owns (and steps) only every
            # world-th param, as a ZeRO optimizer does; the squares are summed over the ranks.
            m = _model()
            owned = [p for i, p in enumerate(m.parameters()) if i % world == rank]
            opt = ctor(owned, lr=1.0)
            scaler = mpfused.GradScaler("cpu", init_scale=64.0, process_group=dist.group.WORLD, grad_sharding="sharded")
            norm = _run(scaler, opt, torch.nn.functional.mse_loss(m(x), y))
            out[("sharded", opt_name)] = (norm, {i: p.detach().clone() for i, p in enumerate(m.parameters())
                                                 if i % world == rank})
            # Only the last rank overflows: every rank skips and backs off.
            before = [p.detach().clone() for p in owned]
            _run(scaler, opt, torch.nn.functional.mse_loss(m(x), y), overflow=rank == world - 1)
            out[("skip", opt_name)] = (scaler.get_scale(), all(torch.equal(a, b) for a, b in zip(before, owned)),
                                       scaler.skipped_steps)
            # The last rank's shard gets no gradient: it still joins every collective (no hang), and all
            # ranks clip by the norm of the other shards' gradients.
            m = _model()
            opt = ctor([p for i, p in enumerate(m.parameters()) if i % world == rank], lr=1.0)
            scaler = mpfused.GradScaler("cpu", init_scale=64.0, process_group=dist.group.WORLD, grad_sharding="sharded")
            out[("no-grad shard", opt_name)] = _run(scaler, opt, torch.nn.functional.mse_loss(m(x), y),
                                                   drop_grads=rank == world - 1)
        results[rank] = out
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_clip_norm_and_skip_with_replicated_and_sharded_grads(tmp_path, world):
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(world, str(tmp_path / "init"), results), nprocs=world, join=True)
    ref_norm, ref_params = _reference(world)
    m = _model()
    torch.nn.functional.mse_loss(m(_batch(world)[0]), _batch(world)[1]).backward()
    others_norm = torch.stack([p.grad.norm() for i, p in enumerate(m.parameters()) if i % world != world - 1]).norm()
    for rank in range(world):
        r = results[rank]
        for opt_name in ("fused", "torch"):
            norm, params = r[("replicated", opt_name)]
            assert norm == pytest.approx(ref_norm, rel=DIST_NORM_RTOL), (rank, opt_name)
            for p, q in zip(params, ref_params):
                torch.testing.assert_close(p, q, rtol=DIST_NORM_RTOL, atol=DIST_PARAM_ATOL)
            norm, owned = r[("sharded", opt_name)]
            assert norm == pytest.approx(ref_norm, rel=DIST_NORM_RTOL), (rank, opt_name)
            for i, p in owned.items():
                torch.testing.assert_close(p, ref_params[i], rtol=DIST_NORM_RTOL, atol=DIST_PARAM_ATOL)
            assert r[("skip", opt_name)] == (32.0, True, 1)
            assert r[("no-grad shard", opt_name)] == pytest.approx(others_norm.item(), rel=DIST_NORM_RTOL)
