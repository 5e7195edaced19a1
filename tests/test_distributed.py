"""mpfused's optimizers and scaler on torch's distributed engines, 2 and 4 gloo ranks on the CPU: FSDP2
(``fully_shard``: DTensor params sharded on dim 0, some ranks holding empty shards), HSDP on a 2x2 mesh
(replicate x shard), DDP, and FSDP1 (``FullyShardedDataParallel`` with ``device_id=cpu``: FlatParameters,
plain tensors, each rank a padded shard; on NCCL too where a machine has a GPU per rank).

Each setup trains the same model on the same data with our FusedAdamW (or FusedSGD) + mpfused.GradScaler +
its fused clip, and with torch's AdamW (SGD) + torch.amp.GradScaler + torch's clip for that setup. Losses,
grad norms and params must agree, the scale must follow the same path, and be equal on every rank; a
forced overflow on one rank must make every rank skip. Bad setups must raise a clear error on every rank
(never hang: each run is bounded by tests/dist_helpers.py).

One spawn per world size runs every case, to stay fast on a 2-core machine."""

from __future__ import annotations

import pytest
import torch

import mpfused
from conftest import cuda_skip_reason
from dist_helpers import run_ranks
from mpfused.optim import FusedAdamW, FusedLAMB, FusedSGD
from tolerances import DIST_BF16_LOSS_RTOL, DIST_BF16_PARAM_ATOL, DIST_NORM_RTOL, OPTIM_FP32_ATOL, OPTIM_LOSS_RTOL

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available in this torch build", allow_module_level=True)

STEPS = 4
MAX_NORM = 0.5
LR = 1e-2
BATCH = 8  # the global batch; each rank takes BATCH // world rows


def _model():
    torch.manual_seed(0)
    # 3 output rows: on 4 ranks the last layer's dim-0 shards are 1, 1, 1 and 0 rows (an empty shard)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def _data(rank, world, steps=STEPS):
    g = torch.Generator().manual_seed(1)
    rows = BATCH // world
    out = []
    for _ in range(steps):
        x, y = torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)
        out.append((x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]))
    return out


def _wrap(kind, world, param_dtype=None, model_dtype=None, round_init=None):
    """The model under one of torch's engines: (model, mesh or None)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    m = _model()
    if model_dtype is not None:
        m = m.to(model_dtype)
    if round_init is not None:  # FP32 params that start from the values a 16-bit model starts from
        m = m.to(round_init).float()
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(m), None
    if kind == "fsdp1":  # FlatParameters: plain tensors, each rank a (padded) shard of the flattened params
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(m, device_id=torch.device(_device(), _rank_gpu())), None
    if kind in ("fsdp2", "hsdp"):
        dev = _device()
        mesh = (init_device_mesh(dev, (world,), mesh_dim_names=("shard",)) if kind == "fsdp2" else
                init_device_mesh(dev, (2, world // 2), mesh_dim_names=("replicate", "shard")))
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else \
            MixedPrecisionPolicy()
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(m, mesh=mesh, mp_policy=mp)
        return m, mesh
    raise ValueError(kind)


def _device():
    """The ranks' device: a GPU per rank under NCCL, else the CPU (gloo)."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _rank_gpu():
    return torch.cuda.current_device() if _device() == "cuda" else None


def _full(t):
    # a copy: on one rank full_tensor() may give the local shard itself
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _train(kind, world, rank, ours, optim="adamw", param_dtype=None, overflow_rank=None, overflow_step=None,
           scaler_mesh=False, model_dtype=None, master_weights=None, round_init=None, planned=True, rounding=None):
    """A few clipped, scaled steps; returns losses, norms, scales, skipped steps, the params' full values,
    whether a step left every param unchanged (per step) and, for ours, whether it took the planned path
    (``planned=False``: never: the full path as the reference for the planned one)."""
    model, mesh = _wrap(kind, world, param_dtype, model_dtype, round_init)
    params = list(model.parameters())
    device = _device()
    if optim == "adamw":
        kw = dict(master_weights=master_weights) if ours else {}
        if rounding:
            kw.update(rounding=rounding, seed=11)
        opt = (FusedAdamW if ours else torch.optim.AdamW)(params, lr=LR, weight_decay=0.1, **kw)
    else:
        opt = (FusedSGD if ours else torch.optim.SGD)(params, lr=LR * 10, momentum=0.9)
    took_plan = []
    if ours:
        planned_step = opt._planned_step

        def spy(scaling):
            took_plan.append(planned and planned_step(scaling))
            return took_plan[-1]

        opt._planned_step = spy
    if ours:
        kw = {}
        if kind == "ddp":
            kw = dict(process_group=dist.group.WORLD, grad_sharding="replicated")
        elif kind == "fsdp1":
            kw = dict(process_group=dist.group.WORLD, grad_sharding="sharded")
        elif scaler_mesh:
            kw = dict(device_mesh=mesh)
        scaler = mpfused.GradScaler(device, init_scale=2.0**10, growth_interval=2, **kw)
    elif kind == "fsdp1":  # torch's scaler for FSDP1: found_inf all-reduced over the ranks
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(device, init_scale=2.0**10, growth_interval=2)
    else:
        scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=2)
    from torch.distributed.tensor.debug import CommDebugMode

    losses, norms, scales, unchanged, collectives = [], [], [], [], []
    for step, (x, y) in enumerate(_data(rank, world)):
        x, y = x.to(device, model_dtype or torch.float32), y.to(device)
        before = [_full(p) for p in params]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if step == overflow_step and rank == overflow_rank:
            g = params[0].grad
            (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] = float("inf")
        if ours:
            with CommDebugMode() as comm:
                norm = scaler.clip_grad_norm_(opt, MAX_NORM)
            collectives.append(comm.get_total_counts())
        else:
            scaler.unscale_(opt)
            clip = model.clip_grad_norm_ if kind == "fsdp1" else lambda n: torch.nn.utils.clip_grad_norm_(params, n)
            norm = _full(clip(MAX_NORM))
        with CommDebugMode() as comm:
            scaler.step(opt)
        if ours:
            collectives[-1] += comm.get_total_counts() * 1000  # the step's own: none expected
        scaler.update()
        losses.append(loss.item())
        norms.append(float(norm))
        scales.append(scaler.get_scale())
        unchanged.append(all(torch.equal(a, _full(b)) for a, b in zip(before, params)))
    skipped = scaler.skipped_steps if ours else None
    masters = [_full(opt.state[p]["master_param"]) if "master_param" in opt.state[p] else None for p in params]
    return dict(losses=losses, norms=norms, scales=scales, unchanged=unchanged, skipped=skipped,
                collectives=collectives, params=[_full(p).float().cpu() for p in params], masters=masters,
                dtypes={_full(p).dtype for p in params}, opt=opt, took_plan=took_plan)


def _compare(case, a, b):
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=OPTIM_LOSS_RTOL, atol=0,
                               msg=lambda m: f"{case}: losses: {m}")
    torch.testing.assert_close(torch.tensor(a["norms"]), torch.tensor(b["norms"]), rtol=DIST_NORM_RTOL, atol=0,
                               msg=lambda m: f"{case}: grad norms: {m}")
    assert a["scales"] == b["scales"], (case, a["scales"], b["scales"])
    for p, q in zip(a["params"], b["params"], strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=OPTIM_FP32_ATOL, msg=lambda m: f"{case}: params: {m}")


def _bad_setups(rank, world):
    """Every bad setup raises the same clear error on every rank (returned as text), before any collective
    that could leave another rank waiting."""
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    model, mesh = _wrap("fsdp2", world)
    plain = torch.nn.Parameter(torch.zeros(3))
    dparams = list(model.parameters())

    def err(name, fn):
        try:
            fn()
        except (ValueError, TypeError, NotImplementedError) as e:
            out[name] = f"{type(e).__name__}: {e}"
        else:
            out[name] = None

    err("mixed group", lambda: FusedAdamW(dparams + [plain], lr=LR))
    opt = FusedAdamW(dparams[:-1], lr=LR)
    err("mixed group added", lambda: opt.add_param_group({"params": [plain, dparams[-1]]}))
    opt.add_param_group({"params": [dparams[-1]]})
    err("lamb sharded", lambda: FusedLAMB(dparams, lr=LR))
    err("mesh and process_group", lambda: mpfused.GradScaler("cpu", device_mesh=mesh, process_group=dist.group.WORLD,
                                                             grad_sharding="sharded"))
    x, y = _data(rank, world)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    # a mesh the scaler was not told of: it names a sub-mesh of world/2 ranks, the grads span all ranks
    sub = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("a", "b"))["a"]
    scaler = mpfused.GradScaler("cpu", device_mesh=sub)
    scaler.scale(torch.ones(()))
    err("untold mesh", lambda: scaler.clip_grad_norm_(opt, 1.0))
    scaler = mpfused.GradScaler("cpu", process_group=dist.group.WORLD, grad_sharding="sharded")
    scaler.scale(torch.ones(()))
    err("process_group with DTensor grads", lambda: scaler.unscale_(opt))
    before = [_full(p) for p in dparams]
    # a grad whose placements differ from its param's
    from torch.distributed.tensor import Replicate
    g0 = dparams[0].grad
    dparams[0].grad = g0.redistribute(g0.device_mesh, [Replicate()])
    err("grad placements", lambda: opt.step())
    out["untouched"] = all(torch.equal(a, _full(b)) for a, b in zip(before, dparams)) and not opt.state
    dparams[0].grad = g0
    # the same once steps have been planned: the planned path refuses the grad, the full path says why
    planned = FusedAdamW(dparams, lr=LR)
    for _ in range(2):
        planned.step()
    out["planned"] = planned.__dict__.get("_mpf_plan") is not None
    before = [_full(p) for p in dparams]
    dparams[0].grad = g0.redistribute(g0.device_mesh, [Replicate()])
    err("grad placements, planned", lambda: planned.step())
    out["untouched planned"] = all(torch.equal(a, _full(b)) for a, b in zip(before, dparams))
    dparams[0].grad = g0
    dist.barrier()  # every rank got here: nothing hung
    return out


def _stochastic_and_loading(rank, world):
    """Sharding-invariant results: a step with rounding='stochastic' keys each element's random bits by its
    index in the global param, so the full params after the step do not depend on the number of ranks;
    and a plain (unsharded) state dict loaded into a sharded optimizer is cut into this rank's shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full_p, full_g = _sr_inputs()
    params = [torch.nn.Parameter(distribute_tensor(p, mesh, [Shard(0)])) for p in full_p]
    for p, g in zip(params, full_g):
        p.grad = distribute_tensor(g, mesh, [Shard(0)])
    opt = FusedAdamW(params, lr=1e-3, rounding="stochastic", seed=7)
    opt.step()
    stepped = [p.full_tensor() for p in params]
    # a plain optimizer's state dict (same params, one step) loaded into this sharded one
    plain = [torch.nn.Parameter(p.clone()) for p in full_p]
    for p, g in zip(plain, full_g):
        p.grad = g.clone()
    ref = FusedAdamW(plain, lr=1e-3)
    ref.step()
    ref.step()
    opt.load_state_dict(ref.state_dict())
    loaded = [{k: v.full_tensor() for k, v in opt.state[p].items() if k != "step"} for p in params]
    kinds = {type(v).__name__ for p in params for k, v in opt.state[p].items() if k != "step"}
    # a drawn seed (seed=None) is this rank's own draw: ranks that seed torch each their own way (dropout,
    # augmentation) would round apart, so drawing one under torch.distributed warns (agreeing on one would need
    # a collective in the constructor, which hangs a rank that builds its optimizer alone)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FusedAdamW([torch.nn.Parameter(full_p[0].to(torch.bfloat16))], lr=1e-3, rounding="stochastic")
        FusedAdamW([torch.nn.Parameter(full_p[0].to(torch.bfloat16))], lr=1e-3, rounding="stochastic", seed=3)
    warned = sum("pass the same seed= on every rank" in str(w.message) for w in caught)
    return dict(stepped=stepped, loaded=loaded, kinds=kinds, warned=warned)


def _edge_cases(rank, world):
    """What a review found: every rank overflowing at once with torch's fused AdamW driven by our scaler
    (torch skips only for a flag of exactly 1, so the reduced flag must be 1, not a count of ranks); a rank
    without grads still joins every collective of a clip, with a given mesh or without; int16 remainders
    and channels_last shards through the state-dict load paths."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    out = {}
    x, y = _data(rank, world)[0]
    for kind in ("fsdp2", "sharded-pg"):
        if kind == "fsdp2":
            model, _ = _wrap("fsdp2", world)
            params = list(model.parameters())
            scaler = mpfused.GradScaler("cpu", init_scale=2.0**10)
        else:  # each rank owns every world-th param, as a ZeRO optimizer does
            model = _model()
            params = [p for i, p in enumerate(model.parameters()) if i % world == rank]
            scaler = mpfused.GradScaler("cpu", init_scale=2.0**10, process_group=dist.group.WORLD,
                                        grad_sharding="sharded")
        opt = torch.optim.AdamW(params, lr=LR, fused=True)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        g = params[0].grad
        (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] = float("inf")  # on every rank
        before = [_full(p) for p in params]
        scaler.clip_grad_norm_(opt, MAX_NORM)
        scaler.step(opt)
        found = scaler.found_inf().item()
        scaler.update()
        out[("all overflow", kind)] = (found, scaler.get_scale(),
                                       all(torch.equal(a, _full(b)) for a, b in zip(before, params)))
    for told in (True, False):
        model, mesh = _wrap("fsdp2", world)
        opt = FusedAdamW(model.parameters(), lr=LR)
        scaler = mpfused.GradScaler("cpu", device_mesh=mesh if told else None)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if rank == world - 1:
            opt.zero_grad()  # this rank holds no grad at all
        local = sum(float(p.grad.to_local().double().square().sum()) for p in model.parameters() if p.grad is not None)
        expected = torch.tensor(local / scaler.get_scale() ** 2, dtype=torch.float64)
        dist.all_reduce(expected)
        norm = scaler.clip_grad_norm_(opt, MAX_NORM).item()
        scaler.step(opt)
        scaler.update()
        out[("no grads on one rank", told)] = (norm, expected.sqrt().item())
    # int16 remainders: a sharded state dict into an unsharded optimizer (a gather) and into replicated
    # params (a redistribution): gloo has no int16 collectives, the loader moves them as int32
    mesh = init_device_mesh("cpu", (world,))
    full_p, full_g = _sr_inputs()
    sharded = [torch.nn.Parameter(distribute_tensor(p, mesh, [Shard(0)])) for p in full_p]
    for p, g in zip(sharded, full_g):
        p.grad = distribute_tensor(g, mesh, [Shard(0)])
    opt = FusedAdamW(sharded, lr=1e-3, master_weights="remainder")
    opt.step()
    opt.step()
    sd = opt.state_dict()
    whole = lambda v: v.to(torch.int32).full_tensor().to(torch.int16) if v.dtype == torch.int16 else v.full_tensor()  # noqa: E731
    want = [{k: whole(v) for k, v in opt.state[p].items() if k != "step"} for p in sharded]
    plain = FusedAdamW([torch.nn.Parameter(p.clone()) for p in full_p], lr=1e-3, master_weights="remainder")
    plain.load_state_dict(sd)
    replicated = [torch.nn.Parameter(distribute_tensor(p, mesh, [Replicate()])) for p in full_p]
    rep_opt = FusedAdamW(replicated, lr=1e-3, master_weights="remainder")
    rep_opt.load_state_dict(sd)
    out["remainder loads"] = all(
        torch.equal(plain.state[q][k], w[k]) and torch.equal(rep_opt.state[r][k].to_local(), w[k])
        and plain.state[q][k].dtype == w[k].dtype
        for q, r, w in zip(plain.param_groups[0]["params"], replicated, want) for k in w)
    # torch's full optimizer state dict of FSDP2 params gathers every entry: the remainders too, which
    # state_dict() gives as bfloat16 views of their int16 bits (an int16 DTensor raised "Invalid scalar type"
    # in gloo's all-gather); set_optimizer_state_dict takes them back as int16 shards
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    torch.manual_seed(0)
    bf16 = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Linear(10, 3)).to(torch.bfloat16)
    from torch.distributed.fsdp import fully_shard
    fully_shard(bf16, mesh=mesh)
    bopt = FusedAdamW(bf16.parameters(), lr=1e-3, master_weights="remainder")
    bf16(x.to(torch.bfloat16)).float().square().sum().backward()
    bopt.step()
    full = get_optimizer_state_dict(bf16, bopt, options=StateDictOptions(full_state_dict=True))
    gathered = [full["state"][name]["master_remainder"] for name in sorted(full["state"])]
    mine = [whole(bopt.state[p]["master_remainder"]) for _, p in sorted(
        (n, p) for n, p in bf16.named_parameters())]
    fresh = FusedAdamW(bf16.parameters(), lr=1e-3, master_weights="remainder")
    bopt.zero_grad()  # (torch makes the fresh optimizer's state with a step of its own only where no param has a grad)
    set_optimizer_state_dict(bf16, fresh, full, options=StateDictOptions(full_state_dict=True))
    out["remainder full state dict"] = (
        all(a.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b) for a, b in zip(gathered, mine))
        and all(bopt.state_dict()["state"][k]["master_remainder"].to_local().data_ptr()
                == bopt.state[p]["master_remainder"].to_local().data_ptr()  # a view: no copy
                for k, p in enumerate(bf16.parameters()))
        and all(fresh.state[p]["master_remainder"].dtype == torch.int16
                and torch.equal(fresh.state[p]["master_remainder"].to_local(), bopt.state[p]["master_remainder"].to_local())
                for p in bf16.parameters()))
    # a write through DTensor params that keep FP32 masters (a model state dict loaded after the first step,
    # as DCP's get_state_dict then set_model_state_dict do): the masters follow it, on the planned path and
    # the full one (the step once recomputed from the stale masters and undid the load, in silence: a write
    # through a DTensor moves the DTensor's version counter, not its shard's)
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    follows = []
    for planned in (True, False):
        torch.manual_seed(0)
        lin = torch.nn.Linear(6, 4).to(torch.bfloat16)
        fully_shard(lin, mesh=mesh)
        lopt = FusedAdamW(lin.parameters(), lr=1e-6)
        for k in range(3):
            if k == 1:
                set_model_state_dict(lin, {"weight": torch.full((4, 6), 3.0, dtype=torch.bfloat16),
                                           "bias": torch.full((4,), -2.0, dtype=torch.bfloat16)},
                                     options=StateDictOptions(full_state_dict=True))
            if not planned:
                lopt.__dict__["_mpf_plan"] = None
            lin(x.to(torch.bfloat16)).float().sum().backward()
            lopt.step()
            lopt.zero_grad()
        follows.append(torch.equal(lin.weight.full_tensor(), torch.full((4, 6), 3.0, dtype=torch.bfloat16))
                       and torch.equal(lin.bias.full_tensor(), torch.full((4,), -2.0, dtype=torch.bfloat16)))
    out["dtensor writes followed"] = follows
    # a state entry set over another's memory on FSDP2 params: named on every rank before anything is written
    # (the overlap check compares the local shards: a DTensor's own data pointer is 0)
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 4)
    fully_shard(lin, mesh=mesh)
    aopt = FusedAdamW(lin.parameters(), lr=1e-3)
    lin(x).sum().backward()
    aopt.step()
    st = aopt.state[lin.weight]
    st["exp_avg"] = st["exp_avg_sq"]
    before = lin.weight.full_tensor().clone()
    lin(x).sum().backward()
    try:
        aopt.step()
        out["dtensor state overlap"] = "no error"
    except ValueError as e:
        out["dtensor state overlap"] = ("are over the same memory" in str(e), torch.equal(before, lin.weight.full_tensor()))
    # a channels_last DTensor param whose state comes from a plain state dict: the shards take its layout
    full = torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last)
    rows = full.shape[0] // world if world <= full.shape[0] else 0
    ref_p = torch.nn.Parameter(full.clone())
    ref_p.grad = torch.ones_like(full)
    ref = FusedAdamW([ref_p], lr=1e-3)
    ref.step()
    piece = ref_p.detach().clone()[rank * rows:(rank + 1) * rows]  # the params after that step, sharded
    p = torch.nn.Parameter(DTensor.from_local(piece, mesh, [Shard(0)], shape=full.shape, stride=full.stride()))
    opt = FusedAdamW([p], lr=1e-3)
    opt.load_state_dict(ref.state_dict())
    p.grad = DTensor.from_local(torch.ones_like(piece), mesh, [Shard(0)], shape=full.shape, stride=full.stride())
    opt.step()
    ref.step()
    mine = slice(rank * rows, (rank + 1) * rows)  # (compared shard by shard: gloo gathers dense memory only)
    from mpfused._layout import same_layout

    out["channels_last load"] = (same_layout(opt.state[p]["exp_avg"].to_local(), p.to_local())
                                 and not opt.state[p]["exp_avg"].to_local().is_contiguous()
                                 and torch.equal(p.to_local(), ref_p.detach()[mine])
                                 and torch.equal(opt.state[p]["exp_avg_sq"].to_local(), ref.state[ref_p]["exp_avg_sq"][mine]))
    return out


def _sr_inputs():
    g = torch.Generator().manual_seed(5)
    # dim 0 of 7 and 3 rows: uneven shards on 2 and 4 ranks, and an empty one on 4
    shapes = [(7, 5), (3,), (2, 4)]
    full_p = [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]
    full_g = [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]
    return full_p, full_g


def _compiled_steps(rank, world):
    """torch.compile(opt.step) over FSDP2 params (dynamo's eager backend: what is traced, not inductor's code),
    FP32 and BF16, against the eager step: the params after two steps, or the error. (The step compared a
    DTensor grad's stride() with its param's, which dynamo could not trace: an AssertionError on every rank.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        params = []
        for compiled in (True, False):
            m = _model().to(dtype)
            fully_shard(m, mesh=init_device_mesh("cpu", (world,)))
            opt = FusedAdamW(m.parameters(), lr=LR, weight_decay=0.1)
            step = torch.compile(opt.step, backend="eager") if compiled else opt.step
            for x, y in _data(rank, world, steps=2):
                torch.nn.functional.mse_loss(m(x.to(dtype)).float(), y).backward()
                try:
                    step()
                except Exception as e:  # noqa: BLE001 - reported by the test
                    return {dtype: f"{type(e).__name__}: {e}"}
                opt.zero_grad()
            params.append([p.full_tensor().detach() for p in m.parameters()])
        out[dtype] = all(torch.equal(a, b) for a, b in zip(*params))
    torch._dynamo.reset()
    return out


def _cases(rank, world):
    out = {"sharding-invariant": _stochastic_and_loading(rank, world), "edge": _edge_cases(rank, world)}
    if world == 2:
        out["compiled"] = _compiled_steps(rank, world)
    kinds = ["fsdp2", "ddp", "fsdp1"] + (["hsdp"] if world == 4 else [])
    for kind in kinds:
        for ours in (True, False):
            out[(kind, ours)] = _train(kind, world, rank, ours, scaler_mesh=kind == "hsdp")
        # every rank skips when one rank's grads overflow, and backs off its scale alike
        out[(kind, "overflow")] = _train(kind, world, rank, True, overflow_rank=world - 1, overflow_step=1,
                                         scaler_mesh=kind == "hsdp")
    for ours in (True, False):
        out[("fsdp2-sgd", ours)] = _train("fsdp2", world, rank, ours, optim="sgd")
        # FSDP2 mixed precision: FP32 sharded params, BF16 or FP16 compute, FP32 gradient reduction
        out[("fsdp2-bf16", ours)] = _train("fsdp2", world, rank, ours, param_dtype=torch.bfloat16)
        out[("fsdp2-fp16", ours)] = _train("fsdp2", world, rank, ours, param_dtype=torch.float16)
    # BF16 sharded params (BF16 compute, FP32 reduction): with our FP32 masters, and without; the reference
    # is torch on FP32 params that start from the same BF16 values
    out["fsdp2-bf16-init"] = _train("fsdp2", world, rank, False, param_dtype=torch.bfloat16, round_init=torch.bfloat16)
    # the planned step on DTensor params (local shards) against the full path, bit for bit
    for kind in ["fsdp2"] + (["hsdp"] if world == 4 else []):
        out[(kind, "full path")] = _train(kind, world, rank, True, scaler_mesh=kind == "hsdp", planned=False)
    for planned in (True, False):
        out[("fsdp2-bf16-sr", planned)] = _train("fsdp2", world, rank, True, model_dtype=torch.bfloat16,
                                                 master_weights=False, rounding="stochastic", planned=planned)
    for mw in (None, False):
        out[("fsdp2-bf16-params", mw)] = _train("fsdp2", world, rank, True, model_dtype=torch.bfloat16,
                                                master_weights=mw)
    for r in out.values():
        r.pop("opt", None)
    out["bad"] = _bad_setups(rank, world)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def runs(request):
    world = request.param
    return world, run_ranks(_cases, world)


def test_fsdp2_hsdp_ddp_fsdp1_match_torch(runs):
    world, results = runs
    for rank, r in enumerate(results):
        for kind in ("fsdp2", "ddp", "fsdp1", "fsdp2-sgd") + (("hsdp",) if world == 4 else ()):
            _compare(f"{kind} rank {rank}", r[(kind, True)], r[(kind, False)])
    # the collectives of an iteration: the fused clip reduces found_inf and the sum of squares together
    # (FSDP2: one SUM; HSDP: a SUM in the shard group and a MAX across replicas; DDP: the MAX of found_inf
    # alone, replicated grads hold the global norm; FSDP1, grad_sharding="sharded": one SUM of both), and the
    # optimizer step has none (x1000 in the count)
    expect = {"fsdp2": 1, "ddp": 1, "fsdp1": 1, "fsdp2-sgd": 1, "hsdp": 2}
    for r in results:
        for kind, n in expect.items():
            if (kind, True) in r:
                assert r[(kind, True)]["collectives"] == [n] * STEPS, (kind, r[(kind, True)]["collectives"])
    for kind in ("fsdp2", "ddp", "fsdp1") + (("hsdp",) if world == 4 else ()):
        # the norm is global and the scale the same on every rank; the params are the same model (FSDP1's
        # are each rank's own shard of the flattened params)
        for r in results[1:]:
            assert r[(kind, True)]["norms"] == results[0][(kind, True)]["norms"], kind
            assert r[(kind, True)]["scales"] == results[0][(kind, True)]["scales"], kind
            if kind != "fsdp1":
                for p, q in zip(r[(kind, True)]["params"], results[0][(kind, True)]["params"]):
                    assert torch.equal(p, q), kind


def test_the_planned_step_on_dtensors_equals_the_full_path(runs):
    """FSDP2 and HSDP (DTensor params): from the second step on, step() takes the planned path on the local
    shards, and gives the full path's bits (FP32 params; BF16 params rounded stochastically, no masters)."""
    world, results = runs
    for rank, r in enumerate(results):
        pairs = [((kind, True), (kind, "full path")) for kind in ["fsdp2"] + (["hsdp"] if world == 4 else [])]
        pairs.append((("fsdp2-bf16-sr", True), ("fsdp2-bf16-sr", False)))
        for planned, full in pairs:
            a, b = r[planned], r[full]
            assert a["took_plan"] == [False] + [True] * (STEPS - 1), (planned, rank, a["took_plan"])
            assert not any(b["took_plan"]), (full, rank)
            assert a["losses"] == b["losses"] and a["norms"] == b["norms"], (planned, rank)
            for p, q in zip(a["params"], b["params"], strict=True):
                assert torch.equal(p, q), (planned, rank)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fsdp2_low_precision_compute_matches_torch(runs, dtype):
    """MixedPrecisionPolicy(param_dtype=bf16 or fp16, reduce_dtype=fp32): the same 16-bit forward on both
    sides, FP32 sharded params (FP16's finer grid keeps within BF16's bounds)."""
    _, results = runs
    for rank, r in enumerate(results):
        a, b = r[(f"fsdp2-{dtype}", True)], r[(f"fsdp2-{dtype}", False)]
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=DIST_BF16_LOSS_RTOL,
                                   atol=0)
        assert a["scales"] == b["scales"]
        for p, q in zip(a["params"], b["params"]):
            torch.testing.assert_close(p, q, rtol=0, atol=DIST_BF16_PARAM_ATOL)


def test_fsdp2_bf16_params_with_and_without_fp32_masters(runs):
    """BF16 sharded params: our FP32 masters (DTensor shards) follow torch's FP32-param run with BF16
    compute (the grads differ only by their BF16 rounding) and each param is its master rounded; without
    masters the BF16 params drift further from it (updates below half a BF16 ulp are lost)."""
    _, results = runs
    for rank, r in enumerate(results):
        ref = r["fsdp2-bf16-init"]["params"]
        with_m, without = r[("fsdp2-bf16-params", None)], r[("fsdp2-bf16-params", False)]
        assert with_m["dtypes"] == without["dtypes"] == {torch.bfloat16}
        assert all(m is None for m in without["masters"])
        err_with = err_without = 0.0
        for m, p, q, w in zip(with_m["masters"], with_m["params"], ref, without["params"]):
            assert m.dtype == torch.float32
            assert torch.equal(m.to(torch.bfloat16).float(), p), rank  # the param is its master, rounded
            torch.testing.assert_close(m, q, rtol=0, atol=DIST_BF16_PARAM_ATOL)
            err_with = max(err_with, (m - q).abs().max().item())
            err_without = max(err_without, (w - q).abs().max().item())
        assert err_without > err_with, (rank, err_without, err_with)


def test_stochastic_rounding_and_state_loading_do_not_depend_on_sharding(runs):
    _, results = runs
    full_p, full_g = _sr_inputs()
    plain = [torch.nn.Parameter(p.clone()) for p in full_p]
    for p, g in zip(plain, full_g):
        p.grad = g.clone()
    opt = FusedAdamW(plain, lr=1e-3, rounding="stochastic", seed=7)
    opt.step()
    ref = FusedAdamW([torch.nn.Parameter(p.clone()) for p in full_p], lr=1e-3)
    for p, g in zip(ref.param_groups[0]["params"], full_g):
        p.grad = g.clone()
    ref.step()
    ref.step()
    for rank, r in enumerate(results):
        inv = r["sharding-invariant"]
        for a, b in zip(inv["stepped"], plain):
            assert torch.equal(a, b.detach()), rank  # bit for bit, whatever the sharding
        assert inv["kinds"] == {"DTensor"}, inv["kinds"]
        assert inv["warned"] == 1, rank  # the drawn seed, not the given one
        for loaded, p in zip(inv["loaded"], ref.param_groups[0]["params"]):
            assert set(loaded) == {"exp_avg", "exp_avg_sq", "master_param"}
            for k, v in loaded.items():
                assert torch.equal(v, ref.state[p][k]), (rank, k)


def test_a_compiled_step_over_fsdp2_params_equals_the_eager_one(runs):
    world, results = runs
    if world != 2:
        pytest.skip("run on the 2-rank mesh only (one compile per rank and dtype)")
    for rank, r in enumerate(results):
        assert r["compiled"] == {torch.float32: True, torch.bfloat16: True}, (rank, r["compiled"])


def test_review_edge_cases(runs):
    _, results = runs
    for rank, r in enumerate(results):
        e = r["edge"]
        for kind in ("fsdp2", "sharded-pg"):
            # the flag torch's fused AdamW reads is 1; nothing was written; the scale backed off
            assert e[("all overflow", kind)] == (1.0, 512.0, True), (rank, kind, e[("all overflow", kind)])
        for told in (True, False):
            norm, expected = e[("no grads on one rank", told)]
            assert norm == pytest.approx(expected, rel=DIST_NORM_RTOL), (rank, told, norm, expected)
        assert e["remainder loads"], rank
        assert e["remainder full state dict"], rank
        assert e["dtensor writes followed"] == [True, True], rank
        assert e["dtensor state overlap"] == (True, True), rank
        assert e["channels_last load"], rank


def test_overflow_on_one_rank_skips_every_rank(runs):
    world, results = runs
    for kind in ("fsdp2", "ddp", "fsdp1") + (("hsdp",) if world == 4 else ()):
        scales = {tuple(r[(kind, "overflow")]["scales"]) for r in results}
        assert len(scales) == 1, (kind, scales)  # the same scale on every rank, every step
        for rank, r in enumerate(results):
            o = r[(kind, "overflow")]
            assert o["unchanged"] == [False, True, False, False], (kind, rank, o["unchanged"])
            assert o["skipped"] == 1, (kind, rank)
            # step 0 clean, step 1 overflows: 1024 -> 512, then two clean steps grow it back (interval 2)
            assert o["scales"] == [1024.0, 512.0, 512.0, 1024.0], (kind, rank, o["scales"])


def test_bad_setups_raise_clear_errors_on_every_rank(runs):
    _, results = runs
    expect = {
        "mixed group": ("ValueError", "mixes DTensor and plain params"),
        "mixed group added": ("ValueError", "mixes DTensor and plain params"),
        "lamb sharded": ("NotImplementedError", "whole-tensor norms"),
        "mesh and process_group": ("ValueError", "not both"),
        "untold mesh": ("ValueError", "a mesh this scaler was not told of"),
        "process_group with DTensor grads": ("ValueError", "device_mesh=mesh"),
        "grad placements": ("ValueError", "same mesh and placements"),
        "grad placements, planned": ("ValueError", "same mesh and placements"),
    }
    for rank, r in enumerate(results):
        bad = r["bad"]
        for name, (kind, text) in expect.items():
            assert bad[name] is not None, (rank, name, "no error")
            assert bad[name].startswith(kind) and text in bad[name], (rank, name, bad[name])
        assert bad["untouched"], rank
        assert bad["planned"] and bad["untouched planned"], rank


def _nccl_cases(rank, world):
    out = {}
    for kind in ("fsdp2", "fsdp1"):
        for ours in (True, False):
            out[(kind, ours)] = _train(kind, world, rank, ours)
        out[(kind, "overflow")] = _train(kind, world, rank, True, overflow_rank=world - 1, overflow_step=1)
    for ours in (True, False):
        out[("fsdp2-bf16", ours)] = _train("fsdp2", world, rank, ours, param_dtype=torch.bfloat16)
    for r in out.values():
        r.pop("opt", None)
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("world", [1, 2, 4])
def test_fsdp_on_nccl_matches_torch(world):
    """FSDP2 (FP32 and BF16 compute) and FSDP1 with a GPU per rank over NCCL, as the gloo runs above check
    them on the CPU: our CUDA kernels on CUDA DTensor shards and flat params against torch's AdamW, clip and
    scaler; an overflow on the last rank skips every rank. On a one-GPU machine one rank: the CUDA kernels
    on DTensors and FSDP1's flat params (which FSDP1 leaves unsharded, NO_SHARD, on one rank), the scaler's
    NCCL all-reduce for FSDP1; sharded and padded shards across GPUs need 2 or 4."""
    reason = cuda_skip_reason()
    if reason is None and (torch.cuda.device_count() < world or not dist.is_nccl_available()):
        reason = f"NCCL with a GPU per rank: {world} rank(s), {torch.cuda.device_count()} GPU(s) here"
    if reason is not None:
        pytest.skip(reason)
    # under the GPU check's 180 s per test (pytest-timeout), so that run_ranks still kills the ranks itself
    results = run_ranks(_nccl_cases, world, backend="nccl", timeout=150)
    for rank, r in enumerate(results):
        for kind in ("fsdp2", "fsdp1"):
            _compare(f"{kind} rank {rank}", r[(kind, True)], r[(kind, False)])
            o = r[(kind, "overflow")]
            assert o["unchanged"] == [False, True, False, False] and o["skipped"] == 1, (kind, rank, o)
            assert o["scales"] == results[0][(kind, "overflow")]["scales"] == [1024.0, 512.0, 512.0, 1024.0]
            assert r[(kind, True)]["norms"] == results[0][(kind, True)]["norms"], (kind, rank)
        a, b = r[("fsdp2-bf16", True)], r[("fsdp2-bf16", False)]
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=DIST_BF16_LOSS_RTOL,
                                   atol=0)
        assert a["scales"] == b["scales"]
        for p, q in zip(a["params"], b["params"]):
            torch.testing.assert_close(p, q, rtol=0, atol=DIST_BF16_PARAM_ATOL)
