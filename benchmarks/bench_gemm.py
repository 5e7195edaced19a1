"""Benchmark of the FP16/BF16 GEMM with FP32 accumulation, ``mpfused.gemm``, and of ``mpfused.nn.FusedLinear``.

Sections (every method of a problem is timed in rounds with the others, a shuffled order each round, in the
same run):

=============== ===================================== =======================================================
section         mpfused                               anchors (same run, same inputs)
=============== ===================================== =======================================================
square          ``mpfused.gemm(a, b)``, FP16 and      ``torch.matmul(a, b)`` on the same FP16/BF16 inputs
                BF16, output in the input dtype       (cuBLAS on CUDA); on the CPU also ``torch.matmul`` on
                                                      the FP32 copies of the inputs (torch's FP32 GEMM)
transformer     as above, (M, N, K) = (8192, 4096,    ``torch.matmul`` (cuBLAS); CUDA only
                4096) and (8192, 11008, 4096)
linear+gelu     ``mpfused.gemm(x, w.t(), bias=b,      torch's unfused pair ``F.gelu(F.linear(x, w, b),
                activation="gelu")`` (the fused       approximate="tanh")`` in the same dtype; on the CPU
                epilogue), and ``FusedLinear(...,     also the pair in FP32
                activation="gelu")`` forward
=============== ===================================== =======================================================

torch's FP16 matmul on the CPU takes seconds (1024^3) to minutes (2048^3) a call: from 1024^3 up it is
timed once, without warm-up, after the other methods (its n column shows 1); a default CPU run takes
about 4 minutes, most of it in that one call.

Sizes: square 256 to 2048 on the CPU, 1024 to 8192 on CUDA (``--quick``: the two smallest); linear+gelu
on the CPU a (1024 tokens, 1024 in, 1024 out) layer, on CUDA outputs 4096x4096 with K = 256, 512, 1024
and 8192x8192 with K = 1024. Throughput is 2 M N K / median time (GFLOP/s on the CPU, TFLOPS on CUDA).
All timed calls are forward only, under ``torch.no_grad()``.

On the CPU our product is ATen's FP32 GEMM of the exactly widened inputs (the issue allows it: the CPU
is not the product), plus the widening and our epilogue; torch's own FP16 GEMM on a CPU without native
FP16 arithmetic is a slow fallback (about 0.4 to 2.4 GFLOP/s), its BF16 GEMM may use oneDNN's native
BF16 kernels where the CPU has them. Before timing, the run checks that our result is exact on
small-integer inputs of each dtype (so a broken build cannot post numbers).

The project's targets, marked PASS/FAIL from the numbers measured in the run (their thresholds, sizes and
reasons are rows of benchmarks/goals.py):
(a) CPU: ours against torch's FP16 matmul, FP16 inputs, at the largest square size;
(b) CPU: ours against torch's FP32 matmul, FP16 and BF16 inputs, at the same size;
(c) CUDA: ours against cuBLAS's throughput at 4096^3 FP16;
(d) CUDA: fused bias+GELU against torch's unfused linear + gelu for outputs of 4096x4096 and up with
    K <= 1024 (every such shape measured, FP16 and BF16).
A target for the other device is shown as INFO, one whose size was not measured (``--quick``) as N/A.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

import mpfused
from mpfused import _ops
from mpfused.nn import FusedLinear

from .goals import goal
from .harness import (
    cpu_busy_fraction,
    json_path,
    machine_info,
    make_parser,
    measure_roofs,
    parse_args,
    print_header,
    print_table,
    print_text,
    time_fn,
    time_interleaved,
    warn_if_busy,
    write_json,
)

NAME = "gemm"
SEED = 0
DTYPES = {"FP16": torch.float16, "BF16": torch.bfloat16}
SQUARE = {"cpu": [256, 512, 1024, 2048], "cuda": [1024, 2048, 4096, 8192]}
TRANSFORMER = [(8192, 4096, 4096), (8192, 11008, 4096)]  # (M, N, K), CUDA only
LINEAR_GELU = {"cpu": [(1024, 1024, 1024)], "cuda": [(4096, 4096, 256), (4096, 4096, 512), (4096, 4096, 1024),
                                                      (8192, 8192, 1024)]}  # (tokens M, out N, in K)

OURS = "mpfused.gemm"
OURS_FUSED = "mpfused.gemm bias+gelu"
OURS_LINEAR = "FusedLinear(gelu) forward"
TORCH_LOWP = "torch.matmul (same dtype)"
# The Hopper kernel (MPFUSED_GEMM_KERNEL=wgmma, compute capability 9.0 and a build naming 9.0), and the same in
# clusters of two CTAs that share B's tiles (wgmma-cluster): each timed in a round of its own with the environment
# variable set throughout, beside its own cuBLAS anchors (the cluster kernel's round skips the transformer shapes).
HOPPER_KERNELS = {"wgmma": "Hopper kernel", "wgmma-cluster": "Hopper kernel in 2-CTA clusters"}


def hopper_methods(kernel: str) -> dict[str, str]:
    """The method names of a Hopper kernel's round: ours, ours fused, and the two anchors timed beside them."""
    label = HOPPER_KERNELS[kernel]
    return {"ours": f"mpfused.gemm, {label} (MPFUSED_GEMM_KERNEL={kernel})", "fused": f"mpfused.gemm bias+gelu, {label}",
            "lowp": f"torch.matmul (same dtype), timed beside the {label}",
            "pair": f"F.linear + F.gelu (same dtype), timed beside the {label}"}


TORCH_FP32 = "torch.matmul FP32"
TORCH_PAIR = "F.linear + F.gelu (same dtype)"
TORCH_PAIR_FP32 = "F.linear + F.gelu FP32"


def check_exact(device: torch.device) -> None:
    """Small integers: every product and sum is exact, so ours must equal the float64 product bit for bit (with
    the kernel MPFUSED_GEMM_KERNEL selects)."""
    gen = torch.Generator().manual_seed(SEED)
    for dtype in DTYPES.values():
        a = torch.randint(-3, 4, (67, 129), generator=gen).to(dtype).to(device)
        b = torch.randint(-3, 4, (45, 129), generator=gen).to(dtype).to(device).t()
        want = (a.double().cpu() @ b.double().cpu()).to(dtype)
        got = mpfused.gemm(a, b).cpu()
        if not torch.equal(got, want):
            raise SystemExit(f"agreement check failed: mpfused.gemm differs from the exact product ({dtype})")


def randn(shape, dtype, device, gen, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def measure(section: str, shape: tuple, dtype_name: str, methods: list[tuple[str, Callable[[], object], bool]],
            args, device: torch.device, single: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Times the methods in rounds (harness.time_interleaved); returns one record per method. methods:
    (name, fn, is_anchor). The methods named in ``single`` take seconds to minutes a call: each is timed
    once, without warm-up, after the others."""
    m, n, k = shape
    flop = 2.0 * m * n * k
    with torch.no_grad():
        fast = [fn for name, fn, _ in methods if name not in single]
        timed = iter(time_interleaved(fast, device, warmup=args.warmup, repeats=args.repeats,
                                      max_seconds=args.max_seconds))
        timings = [time_fn(fn, device, warmup=0, repeats=1) if name in single else next(timed)
                   for name, fn, _ in methods]
    anchor_time = {name: t.median for (name, _, anchor), t in zip(methods, timings) if anchor}
    records = []
    for (name, _, anchor), t in zip(methods, timings):
        records.append({
            "section": section, "shape_mnk": list(shape), "dtype": dtype_name, "method": name, "anchor": anchor,
            "timing": t.to_dict(), "flop": flop, "gflops": flop / t.median / 1e9,
            "speedup_vs": {a: at / t.median for a, at in anchor_time.items() if a != name},
        })
    return records


def gemm_methods(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> list:
    methods = [(OURS, lambda: mpfused.gemm(a, b), False), (TORCH_LOWP, lambda: torch.matmul(a, b), True)]
    if device.type == "cpu":
        a32, b32 = a.float(), b.float()
        methods.append((TORCH_FP32, lambda: torch.matmul(a32, b32), True))
    return methods


def linear_gelu_methods(shape: tuple, dtype: torch.dtype, device: torch.device, gen) -> list:
    m, n, k = shape
    x = randn((m, k), dtype, device, gen)
    layer = FusedLinear(k, n, activation="gelu", device=device, dtype=dtype)
    w, bias = layer.weight.detach(), layer.bias.detach()
    methods = [
        (OURS_FUSED, lambda: mpfused.gemm(x, w.t(), bias=bias, activation="gelu"), False),
        (OURS_LINEAR, lambda: layer(x), False),
        (TORCH_PAIR, lambda: F.gelu(F.linear(x, w, bias), approximate="tanh"), True),
    ]
    if device.type == "cpu":
        x32, w32, b32 = x.float(), w.float(), bias.float()
        methods.append((TORCH_PAIR_FP32, lambda: F.gelu(F.linear(x32, w32, b32), approximate="tanh"), True))
    return methods


@contextlib.contextmanager
def gemm_kernel(name: Optional[str]):
    """MPFUSED_GEMM_KERNEL set to name (None: unset) for the block."""
    before = os.environ.get("MPFUSED_GEMM_KERNEL")
    if name is None:
        os.environ.pop("MPFUSED_GEMM_KERNEL", None)
    else:
        os.environ["MPFUSED_GEMM_KERNEL"] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("MPFUSED_GEMM_KERNEL", None)
        else:
            os.environ["MPFUSED_GEMM_KERNEL"] = before


def hopper_kernel_available(device: torch.device, kernel: str = "wgmma") -> bool:
    """Whether aligned operands take that Hopper kernel on this device under MPFUSED_GEMM_KERNEL=kernel."""
    if device.type != "cuda":
        return False
    with gemm_kernel(kernel):
        return _ops._C.gemm_cuda_kernel(torch.cuda.current_device()) == kernel


def run_sections(args, device: torch.device, hopper: Optional[str] = None) -> list[dict[str, Any]]:
    """Every problem with the default kernel and its anchors, or (hopper: 'wgmma', 'wgmma-cluster') that Hopper
    kernel beside cuBLAS alone."""
    gen = torch.Generator().manual_seed(SEED)
    on_cuda = device.type == "cuda"
    squares = SQUARE[device.type][:2] if args.quick else SQUARE[device.type]
    records: list[dict[str, Any]] = []
    problems = [("square", (s, s, s)) for s in squares]
    if on_cuda and not args.quick and hopper != "wgmma-cluster":
        problems += [("transformer", shape) for shape in TRANSFORMER]
    names = hopper_methods(hopper) if hopper else {}
    for section, (m, n, k) in problems:
        for dtype_name, dtype in DTYPES.items():
            a, b = randn((m, k), dtype, device, gen), randn((k, n), dtype, device, gen)
            print_text(f"[{section}] {m}x{n}x{k} {dtype_name} ...")
            # torch's FP16 GEMM on the CPU: ~3.5 s a call at 1024^3 here, ~100 s at 2048^3: timed once.
            single = (TORCH_LOWP,) if not on_cuda and dtype == torch.float16 and m * n * k >= 1024**3 else ()
            if not hopper:
                with gemm_kernel(None):
                    records += measure(section, (m, n, k), dtype_name, gemm_methods(a, b, device), args, device,
                                       single)
            else:
                with gemm_kernel(hopper):
                    records += measure(section, (m, n, k), dtype_name,
                                       [(names["ours"], lambda: mpfused.gemm(a, b), False),
                                        (names["lowp"], lambda: torch.matmul(a, b), True)], args, device)
            del a, b
            if on_cuda:
                torch.cuda.empty_cache()
    shapes = LINEAR_GELU[device.type][:1] if args.quick else LINEAR_GELU[device.type]
    for shape in shapes:
        for dtype_name, dtype in DTYPES.items():
            print_text(f"[linear+gelu] {shape[0]} tokens x {shape[2]} in -> {shape[1]} out {dtype_name} ...")
            methods = linear_gelu_methods(shape, dtype, device, gen)
            if not hopper:
                with gemm_kernel(None):
                    records += measure("linear+gelu", shape, dtype_name, methods, args, device)
            else:
                fused, pair = methods[0][1], methods[2][1]
                with gemm_kernel(hopper):
                    records += measure("linear+gelu", shape, dtype_name,
                                       [(names["fused"], fused, False), (names["pair"], pair, True)], args, device)
            if on_cuda:
                torch.cuda.empty_cache()
    return records


def print_results(records: list[dict[str, Any]], device: torch.device) -> None:
    on_cuda = device.type == "cuda"
    unit, scale = ("TFLOPS", 1e3) if on_cuda else ("GFLOP/s", 1.0)
    for section in dict.fromkeys(r["section"] for r in records):
        of_section = [r for r in records if r["section"] == section]
        anchors = list(dict.fromkeys(r["method"] for r in of_section if r["anchor"]))
        rows = []
        for r in of_section:
            t = r["timing"]
            rows.append(["x".join(map(str, r["shape_mnk"])), r["dtype"], r["method"], f"{t['median_s'] * 1e3:.2f}",
                         f"{t['iqr_s'] * 1e3:.2f}", str(t["repeats"]), f"{r['gflops'] / scale:.2f}"]
                        + [f"{r['speedup_vs'][a]:.2f}x" if a in r["speedup_vs"] else "" for a in anchors])
        columns = ["M x N x K", "dtype", "method", "median ms", "IQR ms", "n", unit] + [f"vs {a}" for a in anchors]
        print_table(f"{section} on {device.type}: median of n timed calls", columns, rows,
                    [False, False, False, True, True, True, True] + [True] * len(anchors))


def find(records, section, shape, dtype_name, method) -> Optional[dict]:
    return next((r for r in records if r["section"] == section and tuple(r["shape_mnk"]) == tuple(shape)
                 and r["dtype"] == dtype_name and r["method"] == method), None)


def evaluate_targets(records: list[dict[str, Any]], device: torch.device) -> list[dict[str, Any]]:
    targets: list[dict[str, Any]] = []

    def add(label, where, section, shape, dtype_name, ours, anchor):
        """Goal ``label``: ours vs ``anchor`` on one measured problem (a ratio of their median times)."""
        g = goal(NAME, label)
        rec = find(records, section, shape, dtype_name, ours) if g.applies(device) else None
        value = None if rec is None else rec["speedup_vs"].get(anchor)
        if not g.applies(device):
            verdict, measured = "INFO", "other device"
        elif value is None:
            verdict, measured = "N/A", "not measured in this run"
        else:
            verdict, measured = "PASS" if g.met(value) else "FAIL", f"{value:.2f}x"
        targets.append({"target": g.title, "where": where, "measured": measured, "threshold": g.text(),
                        "verdict": verdict, "value": value})

    def square(label, dtype_name, anchor):
        size = goal(NAME, label).at
        add(label, f"{size}^3 {dtype_name}", "square", (size,) * 3, dtype_name, OURS, anchor)

    square("(a)", "FP16", TORCH_LOWP)
    for dtype_name in DTYPES:
        square("(b)", dtype_name, TORCH_FP32)
    square("(c)", "FP16", TORCH_LOWP)
    hoppers = {kernel: hopper_methods(kernel) for kernel in HOPPER_KERNELS}
    for kernel, names in hoppers.items():
        if any(r["method"] == names["ours"] for r in records):
            size = goal(NAME, "(c)").at
            add("(c)", f"{size}^3 FP16, {HOPPER_KERNELS[kernel]}", "square", (size,) * 3, "FP16", names["ours"],
                names["lowp"])
    for m, n, k in LINEAR_GELU["cuda"]:
        for dtype_name in DTYPES:
            add("(d)", f"{m}x{n}, K={k} {dtype_name}", "linear+gelu", (m, n, k), dtype_name, OURS_FUSED, TORCH_PAIR)
            for kernel, names in hoppers.items():
                if any(r["method"] == names["fused"] for r in records):
                    add("(d)", f"{m}x{n}, K={k} {dtype_name}, {HOPPER_KERNELS[kernel]}", "linear+gelu", (m, n, k),
                        dtype_name, names["fused"], names["pair"])
    return targets


def print_targets(targets: list[dict[str, Any]]) -> None:
    rows = [[t["target"], t["where"], t["measured"], t["threshold"], t["verdict"]] for t in targets]
    print_table("Project targets", ["target", "where", "measured", "target value", "verdict"], rows,
                [False, False, True, False, False])
    decided = [t for t in targets if t["verdict"] in ("PASS", "FAIL")]
    print_text(f"targets: {sum(t['verdict'] == 'PASS' for t in decided)}/{len(decided)} PASS (INFO: a target for "
               "the other device; N/A: a size this run did not measure)")


def main() -> None:
    parser = make_parser(__doc__.splitlines()[0])
    args = parse_args(parser, repeats={"cpu": 5, "cuda": 30}, warmup={"cpu": 1, "cuda": 5})
    device: torch.device = args.device
    machine = machine_info(device)
    roofs = measure_roofs(device, warmup=max(1, args.warmup), repeats=5)
    print_header(NAME, machine, roofs)
    print_text(f"{args.warmup} warm-up + up to {args.repeats} timed calls per method, at most ~{args.max_seconds:g} s "
               "each (at least 3 calls), in shuffled rounds within each problem")
    with gemm_kernel(None):
        check_exact(device)
    print_text("agreement check: mpfused.gemm equals the exact product on small-integer FP16 and BF16 inputs")
    records = run_sections(args, device)
    out = json_path(args, NAME)
    config = {"seed": SEED, "quick": args.quick, "warmup": args.warmup, "max_repeats": args.repeats,
              "max_seconds": args.max_seconds, "square": SQUARE[device.type],
              "transformer": TRANSFORMER if device.type == "cuda" else [],
              "linear_gelu_mnk": LINEAR_GELU[device.type], "torch_num_threads": torch.get_num_threads()}
    for kernel, label in HOPPER_KERNELS.items():
        if hopper_kernel_available(device, kernel):
            # The Hopper kernels have not run on a GPU before: the results so far are saved first, so that a fault
            # in their rounds (which loses the process's CUDA context) keeps them.
            if out is not None:
                write_json(out, machine, roofs, records, config=config, targets=evaluate_targets(records, device))
            print_text(f"the {label} (MPFUSED_GEMM_KERNEL={kernel}): agreement check, then rounds of its own beside "
                       "cuBLAS")
            with gemm_kernel(kernel):
                check_exact(device)
            records += run_sections(args, device, hopper=kernel)
        elif device.type == "cuda":
            print_text(f"the {label} (MPFUSED_GEMM_KERNEL={kernel}): not available here (needs compute capability 9.0 "
                       "and a build whose TORCH_CUDA_ARCH_LIST names 9.0)")
    machine["cpu_busy_after_run"] = cpu_busy_fraction()
    warn_if_busy(machine["cpu_busy_after_run"], "just after this run")
    print_results(records, device)
    targets = evaluate_targets(records, device)
    print_targets(targets)
    if out is not None:
        write_json(out, machine, roofs, records, config=config, targets=targets)
        print_text(f"wrote {out}")


if __name__ == "__main__":
    main()
