"""Benchmark of step()'s host overhead on many small DTensor params (FSDP2), gloo on the CPU.

FSDP2 (``torch.distributed.fsdp.fully_shard``) turns every parameter into a DTensor sharded on dim 0 over
the mesh. An optimizer then steps DTensor params with DTensor grads: torch's optimizers pay a CPU cost per
DTensor op (DTensor dispatch and sharding propagation of every foreach/fused op, over every tensor in its
lists), and ``mpfused.optim.FusedAdamW`` checks each param in Python, takes the local shards
(``_local_tensor``) and runs its one fused kernel per group on them. With many small params the kernels
take next to nothing and a step is host overhead; this benchmark measures it.

Setup: ``--world`` processes (default 2; spawn context, gloo, file:// init in a temporary directory, each
with one torch thread) build the same model: ``--params`` small parameters (default 300, 64 to 256
elements each, 1-D to 3-D shapes, odd first dims included so that some shards are uneven) held by modules
of ``PARAMS_PER_MODULE`` params each, every module and the root ``fully_shard``-ed on a 1-D mesh. Each
param gets a DTensor grad with its placements (Shard(0): this rank's ``torch.chunk`` of a seeded global
grad, wrapped with ``DTensor.from_local``).
Rank 0 prints the results of every rank; the processes are joined with a timeout and terminated when one
fails or the run hangs.

===================================== ============================================================
method                                what one timed call does
===================================== ============================================================
mpfused FusedAdamW, DTensor           ``FusedAdamW.step()`` on the DTensor params (ours)
torch AdamW(fused=True), DTensor      ``torch.optim.AdamW(fused=True).step()``: the anchor of goal (a)
torch AdamW(foreach=True), DTensor    the same with foreach=True (torch's default on CUDA; on the CPU
                                      its default is the for-loop: ``--for-loop`` adds that row)
mpfused FusedAdamW, plain             ``FusedAdamW.step()`` on plain tensors shaped like this rank's
                                      local shards (context: ours without DTensors)
torch AdamW(fused=True), plain        torch's fused step on the same plain tensors (context)
mpfused GradScaler iteration          ``scaler.scale(loss); scaler.step(opt);``
                                      ``scaler.update()`` with
                                      ``mpfused.GradScaler("cpu", device_mesh=mesh)`` and FusedAdamW
torch GradScaler iteration            the same with ``torch.amp.GradScaler("cpu")`` and torch's fused AdamW
===================================== ============================================================

The scaler rows (``--no-scaler`` leaves them out) run at scale 1 (``init_scale=1``, no growth), so the
unscaled grads written back are the grads again and every iteration does the same work. Their work differs
by design: ours checks the local shards and reduces found_inf (MAX) over the mesh, one gloo all-reduce per
iteration, so that every rank skips together; torch's checks the grads through DTensor ops and reduces
nothing across ranks. They are reported as INFO, not as a goal.

Timing: each method's optimizer takes a first step apart (state is created lazily), then ``--warmup``
untimed and up to ``--repeats`` timed calls, in rounds over the methods in a shuffled order as the harness's
``time_interleaved`` does (same warm-up and ``--max-seconds`` rule), with one difference: every rank
waits at a barrier before each timed call (outside the timed region). The ranks then start each call
together, so a call with a collective (our scaler's found_inf all-reduce) is charged the collective's
latency and not the other rank's lag, and both ranks compete for the cpus alike in every call. Each
optimizer keeps its own state.

torch's fused AdamW steps a second copy of the model (built the same way); the other methods share ours.
Correctness is checked before timing: the first step of ours and of torch's fused AdamW, from identical
params, grads and fresh state, must agree to 1e-5 relative (params and both moments, on every rank's
shards). After the run: every param finite and each optimizer's step count equal to the steps it took.
The first step of each method (which makes its state, and for torch's DTensor ops fills the sharding
propagation caches, one entry per new shape) is timed apart and shown as "1st step ms" (rank 0).

The project's goal, marked PASS/FAIL from the numbers of the run (threshold and reason in
benchmarks/goals.py): (a) our DTensor step's median time over torch's fused AdamW's, on rank 0, <= 1.0.
The ratio on every rank is printed beside it, and the median of the per-round ratios (each of our calls
over torch's call of the same round), which load that comes and goes between rounds moves less.

CPU only: with ``--device cuda`` (as .ci/gpu_check.sh runs every benchmark) it prints that and exits 0.

``--profile``: after the timing, rank 0 runs ``FusedAdamW.step()`` under cProfile and the run prints the
top functions by own time and by cumulative time (cProfile slows Python calls several-fold: read the
shares, not the absolute times).
"""

from __future__ import annotations

import cProfile
import datetime
import io
import math
import os
import pstats
import queue
import shutil
import statistics
import sys
import gc
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch

from .goals import goal
from .harness import (
    Timing,
    cpu_busy_fraction,
    json_path,
    machine_info,
    make_parser,
    measure_roofs,
    parse_args,
    positive_int,
    print_header,
    print_table,
    print_text,
    round_orders,
    warn_if_busy,
    write_json,
)

NAME = "dist"
SEED = 0
LR = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 1e-2
GRAD_STD = 1e-3
DEFAULT_PARAMS = 300
QUICK_PARAMS = 60
PARAMS_PER_MODULE = 10
MIN_NUMEL, MAX_NUMEL = 64, 256
DEFAULT_WORLD = 2
DEFAULT_TIMEOUT_S = 300.0
CHECK_RTOL = 1e-5
CHECK_ATOL = 1e-9
PROFILE_STEPS = 200
PROFILE_LINES = 25

OURS = "mpfused FusedAdamW.step(), DTensor"
TORCH_FUSED = "torch AdamW(fused=True).step(), DTensor"
TORCH_FOREACH = "torch AdamW(foreach=True).step(), DTensor"
TORCH_LOOP = "torch AdamW(foreach=False).step(), DTensor"
OURS_PLAIN = "mpfused FusedAdamW.step(), plain local-shard tensors"
TORCH_FUSED_PLAIN = "torch AdamW(fused=True).step(), plain local-shard tensors"
OURS_SCALER = "mpfused GradScaler(device_mesh).step + update, FusedAdamW, DTensor"
TORCH_SCALER = "torch.amp GradScaler.step + update, AdamW(fused=True), DTensor"
ANCHOR_FUSED, ANCHOR_FOREACH, ANCHOR_SCALER = "torch fused", "torch foreach", "torch scaler"


# ---- the model ----------------------------------------------------------------------------------------
def param_shapes(count: int, seed: int = SEED) -> list[tuple[int, ...]]:
    """``count`` shapes of MIN_NUMEL..MAX_NUMEL elements, cycling 1-D, 2-D, 3-D (seeded). First dims are
    >= 2, odd ones included: with two ranks every shard holds rows, some one row more than the other."""
    gen = torch.Generator().manual_seed(seed)

    def rand(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    shapes = []
    for i in range(count):
        kind = i % 3
        if kind == 0:
            shapes.append((rand(MIN_NUMEL, MAX_NUMEL),))
            continue
        inner = (rand(4, 32),) if kind == 1 else (rand(2, 8), rand(2, 8))
        row = math.prod(inner)
        shapes.append((rand(max(2, -(-MIN_NUMEL // row)), MAX_NUMEL // row),) + inner)
    return shapes


class ParamBag(torch.nn.Module):
    """A module holding a few parameters (what fully_shard groups into one FSDPParamGroup)."""

    def __init__(self, shapes: list[tuple[int, ...]], gen: torch.Generator) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.1) for s in shapes])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # never run: the benchmark sets grads directly
        return x


def build_model(shapes: list[tuple[int, ...]], mesh) -> list[torch.nn.Parameter]:
    """The params of a model of ParamBags, every bag and the root fully_shard-ed on ``mesh``, each with a
    DTensor grad (Shard(0), as the param). The same values on every call and every rank (seeded)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    gen = torch.Generator().manual_seed(SEED)
    bags = [ParamBag(shapes[i:i + PARAMS_PER_MODULE], gen) for i in range(0, len(shapes), PARAMS_PER_MODULE)]
    model = torch.nn.Sequential(*bags)
    for bag in bags:
        fully_shard(bag, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    grad_gen = torch.Generator().manual_seed(SEED + 1)
    rank, world = mesh.get_local_rank(), mesh.size()
    for p in params:
        # this rank's piece of a seeded global grad, cut as DTensor's Shard(0) cuts (torch.chunk): no
        # communication (distribute_tensor would scatter, one collective per param)
        assert tuple(p.placements) == (Shard(0),), p.placements
        full = torch.randn(p.shape, generator=grad_gen) * GRAD_STD
        chunks = torch.chunk(full, world, dim=0)
        piece = chunks[rank] if rank < len(chunks) else full[:0]
        local = p.to_local()
        assert piece.shape == local.shape, (piece.shape, local.shape)
        p.grad = DTensor.from_local(piece.contiguous(), p.device_mesh, p.placements, run_check=False,
                                    shape=p.shape, stride=p.stride())
    return params


def plain_like(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Plain params and grads with the values of the DTensor params' local shards (this rank's)."""
    out = []
    for p in params:
        q = torch.nn.Parameter(p.to_local().detach().clone())
        q.grad = p.grad.to_local().detach().clone()
        out.append(q)
    return out


# ---- timing -------------------------------------------------------------------------------------------
def time_aligned(fns: list[Callable[[], object]], *, warmup: int, repeats: int, max_seconds: Optional[float],
                 min_repeats: int = 3) -> list[Timing]:
    """The harness's ``time_interleaved`` on the CPU with a barrier of all ranks before each timed call (see
    the module docstring). The repeat count of a method is agreed between the ranks (the minimum), so that
    every rank makes the same calls and meets the same barriers."""
    import torch.distributed as dist

    counts = []
    for fn in fns:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(warmup):
            fn()
        count = repeats
        if max_seconds is not None and warmup > 0:
            per_call = (time.perf_counter() - t0) / warmup
            count = max(min(min_repeats, repeats), min(repeats, int(max_seconds / per_call)))
        agreed = torch.tensor([count], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        counts.append(int(agreed))
    samples: list[list[float]] = [[] for _ in fns]
    # round_orders is seeded: every rank calls the methods in the same order, as the barriers need
    for round_, order in enumerate(round_orders(len(fns), max(counts))):
        for i in order:
            fn, count, out = fns[i], counts[i], samples[i]
            if round_ >= count:
                continue
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return [Timing(tuple(out)) for out in samples]


# ---- the worker ---------------------------------------------------------------------------------------
class Measured:
    """One measured method on this rank: its callable, its optimizer (for the step count) and its calls."""

    def __init__(self, name: str, kind: str, fn: Callable[[], object], opt: torch.optim.Optimizer,
                 params: list, anchor: Optional[str] = None) -> None:
        self.name, self.kind, self.opt, self.params, self.anchor = name, kind, opt, params, anchor
        self.calls = 0
        self._fn = fn

    def __call__(self) -> None:
        self.calls += 1
        self._fn()

    def steps(self) -> Optional[float]:
        state = self.opt.state.get(self.params[0], {})
        step = state.get("step")
        return None if step is None else float(step.to_local() if hasattr(step, "to_local") else step)


def check_agreement(ours: torch.optim.Optimizer, ours_params: list, theirs: torch.optim.Optimizer,
                    torch_params: list) -> float:
    """After one step of ours and of torch's fused AdamW from the same params, grads and fresh state (on two
    copies of the model): params and moments agree to CHECK_RTOL on this rank's shards. Returns the largest
    relative difference seen; raises when they disagree."""
    worst = 0.0
    for i, (a, b) in enumerate(zip(ours_params, torch_params)):
        pairs = [("param", a, b)] + [(k, ours.state[a][k], theirs.state[b][k]) for k in ("exp_avg", "exp_avg_sq")]
        for what, x, y in pairs:
            x, y = x.detach().to_local(), y.detach().to_local()
            if x.numel():
                worst = max(worst, float(((x - y).abs() / y.abs().clamp_min(CHECK_ATOL)).max()))
            torch.testing.assert_close(x, y, rtol=CHECK_RTOL, atol=CHECK_ATOL,
                                       msg=lambda m, i=i, what=what: f"param {i} {what}: ours vs torch fused AdamW: {m}")
    return worst


def scaler_methods(params: list, mesh) -> list[Measured]:
    """A GradScaler iteration (step + update) with ours and with torch's, at scale 1 (see the docstring)."""
    import mpfused
    from mpfused.optim import FusedAdamW

    kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    scale_kw = dict(init_scale=1.0, growth_interval=10**9)
    ours_opt = FusedAdamW(params, **kw)
    ours_scaler = mpfused.GradScaler("cpu", device_mesh=mesh, **scale_kw)
    torch_opt = torch.optim.AdamW(params, fused=True, **kw)
    torch_scaler = torch.amp.GradScaler("cpu", **scale_kw)

    loss = torch.ones(())

    def iteration(scaler, opt) -> Callable[[], None]:
        def run() -> None:
            scaler.scale(loss)  # what backward would scale: it also makes the scale lazily on the first call
            scaler.step(opt)
            scaler.update()
        return run
    return [Measured(OURS_SCALER, "DTensor", iteration(ours_scaler, ours_opt), ours_opt, params),
            Measured(TORCH_SCALER, "DTensor", iteration(torch_scaler, torch_opt), torch_opt, params,
                     anchor=ANCHOR_SCALER)]


def profile_ours(opt: torch.optim.Optimizer) -> str:
    """cProfile of PROFILE_STEPS calls of ``opt.step()``: the top functions by own and by cumulative time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(PROFILE_STEPS):
        opt.step()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.strip_dirs()
    print(f"cProfile of {PROFILE_STEPS} FusedAdamW.step() calls on rank 0, top {PROFILE_LINES} by own time:", file=out)
    stats.sort_stats("tottime").print_stats(PROFILE_LINES)
    print("... and by cumulative time:", file=out)
    stats.sort_stats("cumulative").print_stats(PROFILE_LINES)
    return out.getvalue()


def worker(rank: int, world: int, init_file: str, config: dict, results) -> None:
    """One rank: builds the model, checks agreement, times the methods; rank 0 puts every rank's results in
    ``results``. Any failure is put there too (with the rank and its traceback), and the rank exits with 1."""
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        phases = {}
        t0 = time.perf_counter()
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=config["collective_timeout_s"]))
        from torch.distributed.device_mesh import init_device_mesh

        from mpfused.optim import FusedAdamW

        mesh = init_device_mesh("cpu", (world,))
        shapes = param_shapes(config["params"])
        phases["init"] = time.perf_counter() - t0
        t0 = time.perf_counter()

        # Two copies of the model: torch's fused AdamW steps its own, so that its first step and ours start
        # from identical params, grads and fresh state (the check); the other methods share ours.
        kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
        params, torch_params = build_model(shapes, mesh), build_model(shapes, mesh)
        plain = plain_like(params)
        ours = FusedAdamW(params, **kw)
        fused = torch.optim.AdamW(torch_params, fused=True, **kw)
        foreach = torch.optim.AdamW(params, foreach=True, **kw)
        ours_plain = FusedAdamW(plain, **kw)
        fused_plain = torch.optim.AdamW(plain, fused=True, **kw)
        methods = [Measured(OURS, "DTensor", ours.step, ours, params),
                   Measured(TORCH_FUSED, "DTensor", fused.step, fused, torch_params, anchor=ANCHOR_FUSED),
                   Measured(TORCH_FOREACH, "DTensor", foreach.step, foreach, params, anchor=ANCHOR_FOREACH),
                   Measured(OURS_PLAIN, "plain", ours_plain.step, ours_plain, plain),
                   Measured(TORCH_FUSED_PLAIN, "plain", fused_plain.step, fused_plain, plain)]
        if config["for_loop"]:
            loop = torch.optim.AdamW(params, foreach=False, **kw)
            methods.append(Measured(TORCH_LOOP, "DTensor", loop.step, loop, params))
        if config["scaler"]:
            methods += scaler_methods(params, mesh)
        phases["build"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        first_s = []
        for i, m in enumerate(methods):  # the first step makes the state: untimed in the table, reported apart
            dist.barrier()
            t1 = time.perf_counter()
            m()
            first_s.append(time.perf_counter() - t1)
            if i == 1:  # ours and torch fused have each taken one step from the same state
                worst = check_agreement(ours, params, fused, torch_params)
        phases["first steps"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        timings = time_aligned(methods, warmup=config["warmup"], repeats=config["repeats"],
                               max_seconds=config["max_seconds"])
        phases["timing"] = time.perf_counter() - t0
        finite = all(bool(torch.isfinite(p.to_local()).all()) for p in params + torch_params) and \
            all(bool(torch.isfinite(p).all()) for p in plain)
        records = [{"method": m.name, "params_kind": m.kind, "anchor": m.anchor, "timing": t.to_dict(),
                    "first_step_s": first, "calls": m.calls, "step_count": m.steps()}
                   for m, t, first in zip(methods, timings, first_s)]
        local_numel = sum(p.to_local().numel() for p in params)
        mine = {"rank": rank, "records": records, "finite_after": finite, "agreement_max_rel_diff": worst,
                "local_numel": local_numel}
        gathered: Optional[list] = [None] * world if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        profile = profile_ours(ours) if rank == 0 and config["profile"] else None
        dist.barrier()
        if rank == 0:
            results.put(("ok", {"ranks": gathered, "profile": profile, "phases_s": phases,
                                "global_numel": sum(p.numel() for p in params),
                                "torch_threads": torch.get_num_threads()}))
        gc.collect()  # FSDP2's reference cycles hold the group: collect them before it goes (see the example)
        dist.destroy_process_group()
    except BaseException:
        results.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        sys.exit(1)


def run_workers(world: int, config: dict, timeout_s: float) -> dict:
    """Spawns the ranks and returns rank 0's results; on a failure or after ``timeout_s`` every rank still
    running is terminated and a RuntimeError raised."""
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="mpfused_bench_dist_")
    procs = [ctx.Process(target=worker, args=(rank, world, os.path.join(tmp, "init"), config, results), daemon=True)
             for rank in range(world)]
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        while True:
            try:
                status, payload = results.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    codes = {r: p.exitcode for r, p in enumerate(procs)}
                    raise RuntimeError(f"a rank exited without a result (exit codes {codes})")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no result after {timeout_s:.0f} s (--timeout): the ranks were terminated")
                continue
            if status == "error":
                raise RuntimeError(payload)
            break
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        return payload
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5.0)
        shutil.rmtree(tmp, ignore_errors=True)


# ---- report -------------------------------------------------------------------------------------------
def fmt_ratio(x: Optional[float]) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.2f}"


def ratios(ranks: list[dict]) -> dict[str, dict[str, list[float]]]:
    """Per method, its median time over each anchor's, per rank: {method: {anchor: [rank 0, rank 1, ...]}}."""
    out: dict[str, dict[str, list[float]]] = {}
    for r in ranks:
        by_anchor = {rec["anchor"]: rec["timing"]["median_s"] for rec in r["records"] if rec["anchor"]}
        for rec in r["records"]:
            for anchor, t in by_anchor.items():
                out.setdefault(rec["method"], {}).setdefault(anchor, []).append(rec["timing"]["median_s"] / t)
    return out


def print_results(payload: dict, n_params: int) -> tuple[list[dict], dict]:
    ranks = payload["ranks"]
    rank0 = ranks[0]
    rel = ratios(ranks)
    columns = ["method", "params", "median ms", "IQR ms", "n", "µs/param", "ms, each rank", "1st step ms",
               f"/ {ANCHOR_FUSED}", f"/ {ANCHOR_FOREACH}", f"/ {ANCHOR_SCALER}"]
    rows = []
    records = []
    for i, rec in enumerate(rank0["records"]):
        t = rec["timing"]
        per_rank = [r["records"][i]["timing"]["median_s"] for r in ranks]
        step_methods = rec["method"] not in (OURS_SCALER, TORCH_SCALER)
        anchors = [ANCHOR_FUSED, ANCHOR_FOREACH] if step_methods else [ANCHOR_SCALER]
        cells = []
        for a in (ANCHOR_FUSED, ANCHOR_FOREACH, ANCHOR_SCALER):
            cells.append(" / ".join(fmt_ratio(x) for x in rel[rec["method"]][a]) if a in anchors else "")
        rows.append([rec["method"], rec["params_kind"], f"{t['median_s'] * 1e3:.3f}", f"{t['iqr_s'] * 1e3:.3f}",
                     str(t["repeats"]), f"{t['median_s'] * 1e6 / n_params:.2f}",
                     " / ".join(f"{x * 1e3:.3f}" for x in per_rank), f"{rec['first_step_s'] * 1e3:.0f}"] + cells)
        records.append(dict(rec, per_param_us=t["median_s"] * 1e6 / n_params,
                            median_s_per_rank=per_rank,
                            time_over_anchor_per_rank={a: rel[rec["method"]][a] for a in anchors}))
    print_table(f"step() host time, {n_params} small DTensor params (FSDP2, Shard(0), {len(ranks)} ranks, gloo, CPU): "
                "median of n calls on rank 0; ratios: median / the anchor's, rank 0 / rank 1 (< 1: faster)",
                columns, rows, [False, False] + [True] * (len(columns) - 2))
    return records, rel


def paired_ratio(records: list[dict], method: str, anchor: str) -> Optional[float]:
    """The median over the timing rounds of (method's time / anchor's time in the same round): less
    sensitive than the ratio of medians to load that comes and goes between rounds."""
    a = next((r for r in records if r["method"] == method), None)
    b = next((r for r in records if r["method"] == anchor), None)
    if a is None or b is None:
        return None
    pairs = [x / y for x, y in zip(a["timing"]["samples_s"], b["timing"]["samples_s"]) if y > 0]
    return statistics.median(pairs) if pairs else None


def evaluate_targets(rel: dict, records: list[dict], ranks: list[dict]) -> list[dict]:
    targets = []
    g = goal(NAME, "(a)")
    value = rel.get(OURS, {}).get(ANCHOR_FUSED, [None])[0]
    verdict = "N/A" if value is None else ("PASS" if g.met(value) else "FAIL")
    paired = [paired_ratio(r["records"], OURS, TORCH_FUSED) for r in ranks]
    targets.append({"target": g.title, "measured": "n/a" if value is None else
                    f"{value:.2f} (each rank: {' / '.join(fmt_ratio(x) for x in rel[OURS][ANCHOR_FUSED])}; "
                    f"per-round: {' / '.join(fmt_ratio(x) for x in paired)})",
                    "threshold": g.text(), "verdict": verdict, "value": value, "per_round_ratio_per_rank": paired})
    if OURS_SCALER in rel:
        x = rel[OURS_SCALER][ANCHOR_SCALER][0]
        targets.append({"target": "GradScaler iteration: ours (with the found_inf all-reduce) / torch's",
                        "measured": f"{x:.2f}", "threshold": "context", "verdict": "INFO", "value": x})
    median = {r["method"]: r["timing"]["median_s"] for r in records}
    for dtensor, plain, target, whose in (
            (OURS, OURS_PLAIN, "our step on DTensors / our step on the same plain tensors", "ours"),
            (TORCH_FUSED, TORCH_FUSED_PLAIN, "torch fused step on DTensors / on the same plain tensors", "torch's")):
        if dtensor in median and plain in median:  # the DTensor cost of each step
            x = median[dtensor] / median[plain]
            targets.append({"target": target, "measured": f"{x:.2f}", "threshold": f"context: the DTensor cost of {whose}",
                            "verdict": "INFO", "value": x})
    rows = [[t["target"], t["measured"], t["threshold"], t["verdict"]] for t in targets]
    print_table("Project targets", ["target", "measured (rank 0)", "target value", "verdict"], rows,
                [False, True, False, False])
    decided = [t for t in targets if t["verdict"] in ("PASS", "FAIL")]
    print_text(f"targets: {sum(t['verdict'] == 'PASS' for t in decided)}/{len(decided)} PASS")
    return targets


def print_checks(payload: dict) -> bool:
    ok = True
    for r in payload["ranks"]:
        if not r["finite_after"]:
            ok = False
            print_text(f"  CHECK FAILED rank {r['rank']}: non-finite params after the run")
        for rec in r["records"]:
            # every call (first step, warm-up, timed) is one step: the scaler rows at scale 1 never skip
            if rec["step_count"] is not None and rec["step_count"] != rec["calls"]:
                ok = False
                print_text(f"  CHECK FAILED rank {r['rank']} {rec['method']}: step count {rec['step_count']} != "
                           f"{rec['calls']} calls")
    if ok:
        worst = max(r["agreement_max_rel_diff"] for r in payload["ranks"])
        print_text(f"checks: one step of ours matched torch's fused AdamW (params, exp_avg, exp_avg_sq) to "
                   f"rtol {CHECK_RTOL:g} on every rank (largest relative difference {worst:.1e}); after the run every "
                   "param finite and every step count equal to the steps taken")
    return ok


def main() -> None:
    parser = make_parser(__doc__.splitlines()[0])
    parser.set_defaults(device="cpu")
    parser.add_argument("--params", type=positive_int, default=None,
                        help=f"DTensor params in the model (default {DEFAULT_PARAMS}, {QUICK_PARAMS} with --quick)")
    parser.add_argument("--world", type=int, default=DEFAULT_WORLD, help=f"ranks (default {DEFAULT_WORLD})")
    parser.add_argument("--no-scaler", dest="scaler", action="store_false", help="leave out the GradScaler rows")
    parser.add_argument("--for-loop", action="store_true",
                        help="add torch's for-loop AdamW (foreach=False, torch's default on the CPU; slow on DTensors)")
    parser.add_argument("--profile", action="store_true",
                        help=f"cProfile {PROFILE_STEPS} steps of ours on rank 0 and print the top functions")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds before the ranks are terminated (default {DEFAULT_TIMEOUT_S:g})")
    args = parse_args(parser, repeats={"cpu": 60, "cuda": 60}, warmup={"cpu": 5, "cuda": 5})
    if args.device.type != "cpu":
        # .ci/gpu_check.sh runs every benchmark with --device cuda: there is nothing of this one to measure
        print_text("bench_dist measures the CPU only (gloo ranks): --device cuda skipped; run it without --device")
        return
    if args.world < 1 or (args.params is not None and args.params < 1):
        parser.error("--world and --params must be >= 1")
    n_params = args.params or (QUICK_PARAMS if args.quick else DEFAULT_PARAMS)
    if args.quick:
        args.repeats = min(args.repeats, 20)

    machine = machine_info(args.device)
    roofs = measure_roofs(args.device, warmup=1, repeats=5)
    print_header(NAME, machine, roofs)
    shapes = param_shapes(n_params)
    numels = sorted(math.prod(s) for s in shapes)
    print_text(f"model: {n_params} params in {math.ceil(n_params / PARAMS_PER_MODULE)} fully_shard-ed modules of "
               f"{PARAMS_PER_MODULE} (+ the root), {sum(numels):,} elements ({numels[0]} to {numels[-1]} per param, "
               f"median {numels[len(numels) // 2]}), 1-D/2-D/3-D shapes, Shard(0) over {args.world} ranks; {args.world} "
               f"processes (gloo, 1 torch thread each); {args.warmup} warm-up + up to {args.repeats} timed calls per "
               f"method, at most ~{args.max_seconds:g} s each, barrier-aligned rounds in a shuffled order")
    config = {"params": n_params, "scaler": args.scaler, "for_loop": args.for_loop, "profile": args.profile,
              "warmup": args.warmup, "repeats": args.repeats, "max_seconds": args.max_seconds,
              "collective_timeout_s": max(30.0, args.timeout)}
    t0 = time.perf_counter()
    try:
        payload = run_workers(args.world, config, args.timeout)
    except RuntimeError as e:
        print_text(f"FAILED: {e}")
        sys.exit(1)
    wall = time.perf_counter() - t0
    machine["cpu_busy_after_run"] = cpu_busy_fraction()
    warn_if_busy(machine["cpu_busy_after_run"], "just after this run")
    phases = ", ".join(f"{k} {v:.1f} s" for k, v in payload["phases_s"].items())
    print_text(f"ranks ran {wall:.1f} s (rank 0: {phases}; the rest is spawning and imports); "
               f"{payload['global_numel']:,} elements in all, rank 0 holds {payload['ranks'][0]['local_numel']:,}")

    records, rel = print_results(payload, n_params)
    checks_ok = print_checks(payload)
    targets = evaluate_targets(rel, records, payload["ranks"])
    busy = max((b for b in (machine["cpu_busy_before_run"], machine["cpu_busy_after_run"]) if b is not None),
               default=None)
    if busy is not None and busy > 0.1:
        print_text(f"  NOTE: other processes kept up to {busy:.0%} of the cpus busy around this run: with two ranks "
                   "on a two-core machine they take a rank's core, so the times and ratios are noisy")
    if payload["profile"]:
        print_text(payload["profile"])

    out: Optional[Path] = json_path(args, NAME)
    if out is not None:
        cfg = {"params": n_params, "world": args.world, "shapes": [list(s) for s in shapes],
               "params_per_module": PARAMS_PER_MODULE, "seed": SEED, "lr": LR, "betas": list(BETAS), "eps": EPS,
               "weight_decay": WEIGHT_DECAY, "grad_std": GRAD_STD, "warmup": args.warmup, "max_repeats": args.repeats,
               "max_seconds": args.max_seconds, "scaler": args.scaler, "for_loop": args.for_loop, "quick": args.quick,
               "torch_threads_per_rank": payload["torch_threads"], "backend": "gloo",
               "timing": "rounds in a shuffled order (harness.round_orders), barrier of all ranks before each timed call (outside the timed region)"}
        write_json(out, machine, roofs, records, config=cfg, targets=targets, checks_ok=checks_ok,
                   per_rank=[{k: v for k, v in r.items() if k != "records"} for r in payload["ranks"]],
                   records_per_rank=[r["records"] for r in payload["ranks"]], phases_s=payload["phases_s"],
                   profile=payload["profile"])
        print_text(f"wrote {out}")
    if not checks_ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
