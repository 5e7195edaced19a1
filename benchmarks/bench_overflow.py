"""Benchmark of the multi-tensor overflow reduction, ``mpfused.non_finite_check_``.

The list is shaped like a real model's gradients (default: 500 tensors, 100M elements; ``--quick``: 5M)
and measured in FP32, FP16 and BF16 for four tasks, each against torch's way of doing it, in the same
run:

===================== ================================== ==================================================
task                  mpfused                            torch anchors
===================== ================================== ==================================================
check                 ``non_finite_check_(l, found)``    ``_amp_foreach_non_finite_check_and_unscale_``
                                                         with inv_scale = 1 (torch has no check-only op;
                                                         it still writes every value back); a per-tensor
                                                         ``isfinite(t).all()`` loop that never syncs
check + sumsq         ``inv_scale, sumsq=``              torch's check (inv_scale = 1), then
                                                         ``_foreach_norm`` + total norm, as
                                                         ``clip_grad_norm_`` computes it
check + unscale       ``inv_scale, unscale=True``        torch's check with inv_scale != 1
check + unscale       ``inv_scale, unscale=True,``       torch's check with inv_scale != 1, then
+ sumsq               ``sumsq=``                         ``_foreach_norm`` + total norm (GradScaler.unscale_
                                                         followed by clip_grad_norm_)
===================== ================================== ==================================================

Effective bandwidth counts the bytes a task needs: the list read once, plus written once when the task
unscales. It is compared with the read roof of the harness (and, for tasks that write, with the copy
roof), timed in rounds with each dtype's methods so that both see the same machine state; the "roof"
rows show the time the list's bytes would take at those bandwidths. Every timed call, the roofs' included,
follows an untimed read of four times the last cache level (harness.CacheFlush): a call of tens of µs
would otherwise carry the write-backs of whatever ran before it (on an H200 the check paid about 8 µs of
its 62 µs for the dirty lines of the copy roof's ``y.copy_(x)``, which ran before it in 10 rounds of 11). The roofs measured alone at the
start are the machine's anchors in the header and the JSON. The run warns when other processes kept
the cpus busy.

Unscaling writes in place. To keep the data unchanged over many calls, every call that unscales uses
the next of the pair (1/65536, 65536): the list alternates between its values and its values / 65536.
Both factors are powers of two, so FP32 and BF16 values come back exactly (nothing drifts towards zero
or into the subnormal range, where CPU arithmetic can be slower); FP16 values below 4 in magnitude
become FP16 subnormals when divided, are rounded once on the first round trip (in warm-up), and come
back exactly from then on. Tasks that do not unscale use inv_scale = 1/65536 (check + sumsq) or no
scale, and leave the data untouched.

The project's targets, marked PASS/FAIL from the numbers measured in the run (their thresholds and
reasons are rows of benchmarks/goals.py):
(a) CPU: our check alone, as a share of the read roof;
(b) our check + sumsq against torch's check followed by ``_foreach_norm``;
(c) on CUDA, our check launches the number of kernels that the launch planner
    (core/multi_tensor_plan.h) gives for the list: one per list up to a launch's capacity;
(d) CPU, FP16: our check + unscale against torch's ``_amp_foreach_non_finite_check_and_unscale_``;
(e) CPU, FP16: our check + sumsq, as a share of the read roof.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import mpfused
from mpfused._ops import overflow_limits, overflow_planned_launches

from .goals import goal
from .harness import (
    GB,
    CacheFlush,
    RoofProbe,
    Roofs,
    count_cuda_kernels,
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
    sizes_or_error,
    time_interleaved,
    warn_if_busy,
    write_json,
)

NAME = "overflow"
DTYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}
LOSS_SCALE = 65536.0
SEED = 0

TASK_CHECK = "check"
TASK_SUMSQ = "check+sumsq"
TASK_UNSCALE = "check+unscale"
TASK_UNSCALE_SUMSQ = "check+unscale+sumsq"
TASK_WRITES = {TASK_CHECK: False, TASK_SUMSQ: False, TASK_UNSCALE: True, TASK_UNSCALE_SUMSQ: True}

OURS_CHECK = "mpfused non_finite_check_"
OURS_SUMSQ = "mpfused check+sumsq"
OURS_UNSCALE = "mpfused check+unscale"
OURS_UNSCALE_SUMSQ = "mpfused check+unscale+sumsq"
TORCH_CHECK = "torch _amp_foreach_..._unscale_ (inv_scale=1)"
TORCH_LOOP = "torch isfinite(t).all() loop"
TORCH_CHECK_NORM = "torch check (inv_scale=1) -> _foreach_norm"
TORCH_UNSCALE = "torch _amp_foreach_..._unscale_ (1/65536)"
TORCH_UNSCALE_NORM = "torch check (1/65536) -> _foreach_norm"
READ_ROOF_ROW = "read roof: list bytes at x.sum() bandwidth"
COPY_ROOF_ROW = "copy roof: 2x list bytes at y.copy_(x) bandwidth"


# ---- the gradient list --------------------------------------------------------------------------------
def model_like_sizes(n_tensors: int, total: int, seed: int = SEED) -> list[int]:
    """Element counts of ``n_tensors`` gradients that add up to ``total``, shaped like a model's:

    - 1% of the tensors (at least one): embedding / output matrices, 30% of the elements between them;
    - 60%: bias and norm vectors of 256 to 8192 elements;
    - the rest: weight matrices with log-uniform sizes over a 64x range, holding the remaining elements.

    Sizes are arbitrary integers (not multiples of a chunk or a vector width), so every tensor has a
    tail. The order is a fixed shuffle. Deterministic for a given seed.
    """
    rng = random.Random(seed)
    n_large = max(1, n_tensors // 100)
    n_small = (n_tensors * 3) // 5
    n_medium = n_tensors - n_large - n_small
    if n_medium < 1:
        raise ValueError(f"need at least 3 tensors, got {n_tensors}")
    small = [rng.randint(256, 8192) for _ in range(n_small)]
    large_weights = [rng.uniform(0.8, 1.2) for _ in range(n_large)]
    large = [int(0.3 * total * w / sum(large_weights)) for w in large_weights]
    medium_total = total - sum(small) - sum(large)
    if medium_total < 2 * n_medium:
        raise ValueError(f"{total} elements are too few for {n_tensors} tensors")
    medium_weights = [math.exp(rng.uniform(0.0, math.log(64.0))) for _ in range(n_medium)]
    medium = [max(1, int(medium_total * w / sum(medium_weights))) for w in medium_weights]
    medium[-1] += medium_total - sum(medium)
    sizes = large + medium + small
    rng.shuffle(sizes)
    assert sum(sizes) == total and min(sizes) > 0
    return sizes


def make_grads(sizes: list[int], dtype: torch.dtype, device: torch.device, seed: int = SEED) -> list[torch.Tensor]:
    """Standard-normal tensors of the given sizes, generated on ``device`` from a seeded generator."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(n, dtype=dtype, device=device, generator=gen) for n in sizes]



# ---- the measured methods -----------------------------------------------------------------------------
class ScaleToggle:
    """Hands out 1/LOSS_SCALE and LOSS_SCALE in turn, so that a list unscaled in place by every call
    alternates between two states instead of drifting to zero (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self._scales = (scalar(1.0 / LOSS_SCALE, device), scalar(LOSS_SCALE, device))
        self._next = 0

    def __call__(self) -> torch.Tensor:
        scale = self._scales[self._next]
        self._next ^= 1
        return scale


def scalar(value: float, device: torch.device) -> torch.Tensor:
    """A one-element float32 tensor, the form of found_inf, inv_scale and sumsq."""
    return torch.full((1,), value, dtype=torch.float32, device=device)


def torch_total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm as ``torch.nn.utils.clip_grad_norm_`` computes it (FP32 accumulation, as in
    mpfused's sum of squares)."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors, 2.0, dtype=torch.float32)))


STAND_IN_NOTE = ("torch has no _amp_foreach_non_finite_check_and_unscale_ for this dtype on this device: its "
                 "foreach equivalent stands in (_foreach_norm(inf) -> isfinite -> flag, _foreach_mul_)")


def torch_amp_unscale(device: torch.device, dtype: torch.dtype) -> Callable[..., None]:
    """torch's ``_amp_foreach_non_finite_check_and_unscale_`` where it has ``dtype`` on ``device``; else (BF16
    on CUDA: torch 2.11 raises NotImplementedError) the same job from torch's foreach ops: ``_foreach_norm``
    of order inf (inf/NaN propagate), ``isfinite``, the flag raised on the device, ``_foreach_mul_`` by the
    inverse scale. Which one runs is printed."""
    probe = torch.ones(1, dtype=dtype, device=device)
    try:
        torch._amp_foreach_non_finite_check_and_unscale_([probe], scalar(0.0, device), scalar(1.0, device))
        return torch._amp_foreach_non_finite_check_and_unscale_
    except NotImplementedError as e:
        print_text(f"{dtype} on {device.type}: torch's amp kernel is missing ({str(e).splitlines()[0]}); the torch "
                   "rows run its foreach equivalent (_foreach_norm(inf) -> isfinite -> flag, _foreach_mul_)")

    def foreach_equivalent(grads: list[torch.Tensor], found: torch.Tensor, inv: torch.Tensor) -> None:
        norms = torch._foreach_norm(grads, float("inf"))
        bad = torch.stack(norms).isfinite().all().logical_not()
        torch.maximum(found, bad.to(found.dtype), out=found)
        # The scale in the grads' dtype: torch's fast foreach path needs the dtypes to match (an FP32 scalar
        # on a BF16 list takes one mul_ per tensor). Exact for the powers of two the benchmarks use, so the
        # products round as the amp kernel's FP32 ones do.
        torch._foreach_mul_(grads, inv.reshape(()).to(grads[0].dtype) if grads else inv.reshape(()))
    foreach_equivalent.stand_in = STAND_IN_NOTE
    return foreach_equivalent


@dataclass(frozen=True)
class Method:
    """One measured way of doing a task on the list."""

    task: str
    name: str
    fn: Callable[[], object]
    note: str = ""


def make_methods(grads: list[torch.Tensor], device: torch.device) -> list[Method]:
    """Every measured method, in table order. Flags and accumulators are allocated once, here."""
    found = scalar(0.0, device)
    found_bool = torch.zeros((), dtype=torch.bool, device=device)
    sumsq = scalar(0.0, device)
    one = scalar(1.0, device)
    inv = scalar(1.0 / LOSS_SCALE, device)
    amp_unscale = torch_amp_unscale(device, grads[0].dtype if grads else torch.float32)
    stand_in = getattr(amp_unscale, "stand_in", "")
    toggle = ScaleToggle(device)

    def isfinite_loop() -> None:
        for t in grads:  # the flag stays on the device: no host sync per tensor
            found_bool.logical_or_(torch.isfinite(t).all().logical_not_())

    def torch_check_norm() -> torch.Tensor:
        amp_unscale(grads, found, one)
        return torch_total_norm(grads)

    def torch_unscale_norm() -> torch.Tensor:
        amp_unscale(grads, found, toggle())
        return torch_total_norm(grads)

    return [
        Method(TASK_CHECK, OURS_CHECK, lambda: mpfused.non_finite_check_(grads, found)),
        Method(TASK_CHECK, TORCH_CHECK, lambda: amp_unscale(grads, found, one), stand_in),
        Method(TASK_CHECK, TORCH_LOOP, isfinite_loop),
        Method(TASK_SUMSQ, OURS_SUMSQ, lambda: mpfused.non_finite_check_(grads, found, inv, sumsq=sumsq)),
        Method(TASK_SUMSQ, TORCH_CHECK_NORM, torch_check_norm, stand_in),
        Method(TASK_UNSCALE, OURS_UNSCALE, lambda: mpfused.non_finite_check_(grads, found, toggle(), unscale=True)),
        Method(TASK_UNSCALE, TORCH_UNSCALE, lambda: amp_unscale(grads, found, toggle()), stand_in),
        Method(TASK_UNSCALE_SUMSQ, OURS_UNSCALE_SUMSQ,
               lambda: mpfused.non_finite_check_(grads, found, toggle(), unscale=True, sumsq=sumsq)),
        Method(TASK_UNSCALE_SUMSQ, TORCH_UNSCALE_NORM, torch_unscale_norm, stand_in),
    ]


def check_agreement(grads: list[torch.Tensor], device: torch.device, dtype_name: str) -> None:
    """Before timing: mpfused and torch agree on the list (no inf/NaN, same sum of squares), so the
    benchmark measures working code. Syncs the host; never inside a timed region."""
    found = scalar(0.0, device)
    sumsq = scalar(0.0, device)
    mpfused.non_finite_check_(grads, found, scalar(1.0, device), sumsq=sumsq)
    expected = float(torch_total_norm(grads).double() ** 2)
    if found.item() != 0.0 or not math.isclose(sumsq.item(), expected, rel_tol=1e-3):
        raise RuntimeError(f"{dtype_name}: mpfused found_inf={found.item()} sumsq={sumsq.item()}, "
                           f"torch sum of squares {expected}")


# ---- measurement and report ---------------------------------------------------------------------------
def measure_dtype(dtype_name: str, sizes: list[int], args: argparse.Namespace,
                  probe: RoofProbe, flush: CacheFlush) -> tuple[Roofs, list[dict[str, Any]]]:
    """Times every method on a freshly generated list of ``dtype_name``, interleaved with the roof
    probe, and returns the roofs so measured and one record per method."""
    device = args.device
    grads = make_grads(sizes, DTYPES[dtype_name], device)
    check_agreement(grads, device, dtype_name)
    list_bytes = sum(t.numel() * t.element_size() for t in grads)
    methods = make_methods(grads, device)
    read, copy, *timings = time_interleaved([probe.read, probe.copy] + [m.fn for m in methods], device,
                                            warmup=args.warmup, repeats=args.repeats, max_seconds=args.max_seconds,
                                            flush=flush)
    roofs = probe.roofs(read, copy)
    records = []
    for method, timing in zip(methods, timings):
        writes = TASK_WRITES[method.task]
        task_bytes = list_bytes * (2 if writes else 1)
        bps = task_bytes / timing.median
        records.append({
            "dtype": dtype_name,
            "task": method.task,
            "method": method.name,
            "tensors": len(grads),
            "elements": sum(sizes),
            "list_bytes": list_bytes,
            "task_bytes": task_bytes,
            "timing": timing.to_dict(),
            "elements_per_s": sum(sizes) / timing.median,
            "GBps": bps / GB,
            "read_roof_GBps": roofs.read_Bps / GB,
            "copy_roof_GBps": roofs.copy_Bps / GB,
            "pct_read_roof": 100.0 * bps / roofs.read_Bps,
            "pct_copy_roof": 100.0 * bps / roofs.copy_Bps if writes else None,
            "kernels_per_call": count_cuda_kernels(method.fn, device),
            **({"note": method.note} if method.note else {}),
        })
    grads.clear()  # the methods' closures share this list: peak memory stays at one dtype's list
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return roofs, records


def find(records: list[dict[str, Any]], dtype: str, method: str) -> dict[str, Any]:
    return next(r for r in records if r["dtype"] == dtype and r["method"] == method)


def print_results(records: list[dict[str, Any]], roofs_by_dtype: dict[str, Roofs], device: torch.device) -> None:
    columns = ["dtype", "task", "method", "median ms", "IQR ms", "min ms", "n", "Gelem/s", "GB/s",
               "% read roof", "% copy roof"]
    on_cuda = device.type == "cuda"
    if on_cuda:
        columns.append("kernels/call")
    rows = []
    for dtype_name, roofs in roofs_by_dtype.items():
        of_dtype = [r for r in records if r["dtype"] == dtype_name]
        list_bytes, elements = of_dtype[0]["list_bytes"], of_dtype[0]["elements"]
        for label, bps, pct_read, pct_copy, n, bytes_ in (
            (READ_ROOF_ROW, roofs.read_Bps, 100.0, None, len(roofs.read.samples_s), list_bytes),
            (COPY_ROOF_ROW, roofs.copy_Bps, 100.0 * roofs.copy_Bps / roofs.read_Bps, 100.0,
             len(roofs.copy.samples_s), 2 * list_bytes),
        ):
            seconds = bytes_ / bps
            rows.append([dtype_name, "roof", label, f"{seconds * 1e3:.3f}", "", "", str(n),
                         f"{elements / seconds / 1e9:.2f}", f"{bps / GB:.1f}", f"{pct_read:.1f}",
                         "" if pct_copy is None else f"{pct_copy:.1f}"] + ([""] if on_cuda else []))
        for r in of_dtype:
            t = r["timing"]
            row = [r["dtype"], r["task"], r["method"], f"{t['median_s'] * 1e3:.3f}", f"{t['iqr_s'] * 1e3:.3f}",
                   f"{t['min_s'] * 1e3:.3f}", str(t["repeats"]), f"{r['elements_per_s'] / 1e9:.2f}",
                   f"{r['GBps']:.1f}", f"{r['pct_read_roof']:.1f}",
                   "" if r["pct_copy_roof"] is None else f"{r['pct_copy_roof']:.1f}"]
            if on_cuda:
                row.append(str(r["kernels_per_call"]))
            rows.append(row)
    numeric = [False, False, False] + [True] * (len(columns) - 3)
    print_table(f"Overflow reduction on {device.type}: median of n timed calls; roofs timed interleaved with "
                "each dtype's methods", columns, rows, numeric)


def evaluate_targets(records: list[dict[str, Any]], device: torch.device, planned: int) -> list[dict[str, Any]]:
    """The project's targets, from the measured records. A verdict is PASS, FAIL, or INFO where the
    project sets no target for this device or the line is context for one."""
    targets = []

    def add(label: str, dtype_name: str, value: float, fmt: str, threshold: Optional[int] = None) -> None:
        g = goal(NAME, label)
        verdict = ("PASS" if g.met(value, threshold) else "FAIL") if g.applies(device, dtype_name) else "INFO"
        targets.append({"target": g.title, "dtype": dtype_name, "measured": fmt.format(value),
                        "threshold": g.text(threshold), "verdict": verdict, "value": value})

    for dtype_name in DTYPES:
        add("(a)", dtype_name, find(records, dtype_name, OURS_CHECK)["pct_read_roof"], "{:.1f}%")
        speedup = (find(records, dtype_name, TORCH_CHECK_NORM)["timing"]["median_s"]
                   / find(records, dtype_name, OURS_SUMSQ)["timing"]["median_s"])
        add("(b)", dtype_name, speedup, "{:.2f}x")
        same_work = (find(records, dtype_name, TORCH_UNSCALE_NORM)["timing"]["median_s"]
                     / find(records, dtype_name, OURS_UNSCALE_SUMSQ)["timing"]["median_s"])
        targets.append({
            "target": "    context: check+unscale+sumsq vs torch unscale -> _foreach_norm (both write)",
            "dtype": dtype_name, "measured": f"{same_work:.2f}x", "threshold": "", "verdict": "INFO",
            "value": same_work,
        })
        unscale_ratio = (find(records, dtype_name, TORCH_UNSCALE)["timing"]["median_s"]
                         / find(records, dtype_name, OURS_UNSCALE)["timing"]["median_s"])
        add("(d)", dtype_name, unscale_ratio, "{:.2f}x")
        add("(e)", dtype_name, find(records, dtype_name, OURS_SUMSQ)["pct_read_roof"], "{:.1f}%")
        if device.type == "cuda":
            add("(c)", dtype_name, find(records, dtype_name, OURS_CHECK)["kernels_per_call"], "{}", planned)
    return targets


def print_targets(targets: list[dict[str, Any]], device: torch.device, planned: int, limits: dict[str, int],
                  quick: bool) -> None:
    rows = [[t["target"], t["dtype"], t["measured"], t["threshold"], t["verdict"]] for t in targets]
    print_table("Project targets", ["target", "dtype", "measured", "target value", "verdict"], rows,
                [False, False, True, False, False])
    if device.type == "cuda":
        print_text(f"(c) planned launches: {planned} for this list, at {limits['max_tensors']} tensors and "
                   f"{limits['max_items']} chunks of {limits['chunk_size']} elements per launch")
    else:
        print_text("(c) kernel launches: measured on CUDA only")
    decided = [t for t in targets if t["verdict"] in ("PASS", "FAIL")]
    passed = sum(t["verdict"] == "PASS" for t in decided)
    print_text(f"targets: {passed}/{len(decided)} PASS")
    if quick:
        print_text("--quick: on a list this small, per-call and per-tensor costs weigh more than at the "
                   "default size, which the targets are meant for")


def main() -> None:
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=positive_int, default=500, help="tensors in the list (default 500)")
    parser.add_argument("--elements", type=positive_int, default=None,
                        help="elements in the list (default 100M, or 5M with --quick)")
    args = parse_args(parser, repeats={"cpu": 10, "cuda": 50}, warmup={"cpu": 1, "cuda": 5})
    device: torch.device = args.device
    elements = args.elements or (5_000_000 if args.quick else 100_000_000)
    sizes = sizes_or_error(parser, args.tensors, elements, "--tensors/--elements")
    limits = overflow_limits(device.type)
    planned = overflow_planned_launches(sizes, device.type)

    machine = machine_info(device)
    roofs = measure_roofs(device, warmup=max(1, args.warmup), repeats=max(5, args.repeats))
    print_header(NAME, machine, roofs)
    print_text(f"list: {len(sizes)} tensors, {elements / 1e6:.1f}M elements (largest {max(sizes):,}, "
               f"median {sorted(sizes)[len(sizes) // 2]:,}, smallest {min(sizes):,}); "
               f"{args.warmup} warm-up + up to {args.repeats} timed calls per method, "
               f"at most ~{args.max_seconds:g} s each (at least 3 calls)")

    probe = RoofProbe(device)
    flush = CacheFlush(device)
    print_text(flush.describe())
    roofs_by_dtype: dict[str, Roofs] = {}
    records: list[dict[str, Any]] = []
    for dtype_name in DTYPES:
        roofs_by_dtype[dtype_name], of_dtype = measure_dtype(dtype_name, sizes, args, probe, flush)
        records += of_dtype
    flush_bytes = flush.nbytes
    del probe, flush
    machine["cpu_busy_after_run"] = cpu_busy_fraction()
    warn_if_busy(machine["cpu_busy_after_run"], "just after this run")
    print_results(records, roofs_by_dtype, device)
    targets = evaluate_targets(records, device, planned)
    print_targets(targets, device, planned, limits, args.quick)

    out: Optional[Path] = json_path(args, NAME)
    if out is not None:
        config = {"tensors": len(sizes), "elements": elements, "sizes": sizes, "seed": SEED,
                  "loss_scale": LOSS_SCALE, "quick": args.quick, "warmup": args.warmup, "max_repeats": args.repeats,
                  "max_seconds": args.max_seconds, "flush_bytes": flush_bytes,
                  "overflow_limits": limits, "planned_launches": planned}
        write_json(out, machine, roofs, records, config=config, targets=targets,
                   roofs_interleaved={name: r.to_dict() for name, r in roofs_by_dtype.items()})
        print_text(f"wrote {out}")


if __name__ == "__main__":
    main()
