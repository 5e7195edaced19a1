"""Benchmark of fixed point <IL,FL> (``mpfused.fixed_point``): Convert's throughput and the MACC.

Convert (``quantize``: float32 in, float32 values out; ``encode``: float32 in, int16 codes out) of a large
standard-normal tensor, with round-to-nearest and with stochastic rounding (Philox words drawn on the fly),
against anchors measured in the same run, in rounds with our calls, each call after an untimed read of four
times the last cache level (harness.CacheFlush). Two ways of calling it:

- into an output that exists already (``out=``), against torch's ``y.copy_(x)`` of the same 4 + 4 bytes per
  element between preallocated buffers: a copy at the memory's speed, the roof the goals use (as
  bench_random measures ``round_stochastic(out=)`` against a copy). The goals are decided here: they ask
  whether the kernel keeps up with memory. Where that copy runs at less than half the speed of the
  harness's own probe (a busy machine), the verdict is INVALID rather than PASS or FAIL;
- allocating its output, against ``x.clone()`` (4 + 4 bytes into a new tensor) and ``x.to(torch.float16)``
  (4 + 2 bytes): INFO. Every call then pays for the first touch of the new tensor's pages. On a VM with
  4 KB pages that costs most of ``x.clone()``'s time (it runs at about a quarter of the copy roof) and
  does not overlap the rounding's arithmetic; torch's ``THP_MEM_ALLOC_ENABLE=1`` (huge pages for large CPU
  tensors) removes most of it, for our calls and torch's alike.

The copy roof of the harness (400 MB buffers) is printed for context.

The MACC: ``matmul`` of int16 codes of <4,12> (standard normal values quantized, as a layer's weights and
activations are; M = K = N, default 512 on the CPU, 4096 on CUDA) rounded into <10,6> (wide enough that no
output saturates: the run checks it, so the agreement check covers the rounding), against ``torch.matmul`` of
the same codes as int64 (CPU only: CUDA has none) and as float64 tensors (both exact at these sizes), INFO only: torch has no fixed-point product, and ours also rounds and saturates every
output. On CUDA both of our kernels run (the integer tensor cores, the default, and the CUDA cores:
MPFUSED_FIXED_MATMUL_KERNEL), and torch's 8-bit ``torch._int_mm`` is shown for scale.

Goals (benchmarks/goals.py): (a) quantize with round-to-nearest and (b) with stochastic rounding into a
preallocated output, each at least 85% of the same-bytes preallocated copy's throughput on the CPU.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from mpfused import _ops
from mpfused import fixed_point as fxp

from .goals import goal
from . import harness as h

NAME = "fixed_point"
FMT = (4, 12)      # the quantized format (WL 16)
OUT_FMT = (10, 6)  # the MACC's output format: |sum| ~ sqrt(K) <= 64 of a range of 512
SEED = 0
MIN_ANCHOR_PCT = 50.0  # the same-bytes copy at least at half the roof probe's speed, or the run is invalid


def quantize_methods(x: torch.Tensor) -> list[tuple[str, str, int, Any]]:
    """(name, anchor name or "", bytes per element, callable) for Convert and its anchors."""
    y, q, c = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x, dtype=torch.int16)
    return [
        ("anchor y.copy_(x), preallocated", "", 8, lambda: y.copy_(x)),
        ("quantize nearest (f32 -> f32, out=)", "anchor y.copy_(x), preallocated", 8,
         lambda: fxp.quantize(x, *FMT, out=q)),
        ("quantize stochastic (f32 -> f32, out=)", "anchor y.copy_(x), preallocated", 8,
         lambda: fxp.quantize(x, *FMT, rounding="stochastic", seed=SEED, out=q)),
        ("encode stochastic (f32 -> int16, out=)", "", 6,
         lambda: fxp.encode(x, *FMT, rounding="stochastic", seed=SEED, out=c)),
        ("anchor x.clone()", "", 8, lambda: x.clone()),
        ("anchor x.to(float16)", "", 6, lambda: x.to(torch.float16)),
        ("quantize nearest (f32 -> f32)", "anchor x.clone()", 8, lambda: fxp.quantize(x, *FMT)),
        ("quantize stochastic (f32 -> f32)", "anchor x.clone()", 8,
         lambda: fxp.quantize(x, *FMT, rounding="stochastic", seed=SEED)),
        ("encode nearest (f32 -> int16)", "anchor x.to(float16)", 6, lambda: fxp.encode(x, *FMT)),
        ("encode stochastic (f32 -> int16)", "anchor x.to(float16)", 6,
         lambda: fxp.encode(x, *FMT, rounding="stochastic", seed=SEED)),
    ]


def with_macc_kernel(kernel: str, fn: Any) -> Any:
    """fn, called with MPFUSED_FIXED_MATMUL_KERNEL=kernel (read at each call)."""
    def call() -> Any:
        old = os.environ.get("MPFUSED_FIXED_MATMUL_KERNEL")
        os.environ["MPFUSED_FIXED_MATMUL_KERNEL"] = kernel
        try:
            return fn()
        finally:
            if old is None:
                del os.environ["MPFUSED_FIXED_MATMUL_KERNEL"]
            else:
                os.environ["MPFUSED_FIXED_MATMUL_KERNEL"] = old
    return call


def matmul_methods(size: int, device: torch.device) -> tuple[list[tuple[str, Any]], str]:
    """The MACC's timed calls, and the name of the anchor the table divides by."""
    gen = torch.Generator().manual_seed(SEED)
    # Codes of standard normal values (full-range random codes would make nearly every output of <10,6> or
    # <8,8> saturate, leaving the rounding unchecked)
    a, b = (fxp.encode(torch.randn(size, size, generator=gen), *FMT).to(device) for _ in range(2))
    a64, b64, af, bf = a.long(), b.long(), a.double(), b.double()
    # Agreement before timing: our nearest-rounded result against the exact product rounded the same way. The
    # float64 product is exact here (|sum| <= K 2^30 < 2^53), and fast on both devices.
    if size * 2 ** 30 >= 2 ** 53:
        raise ValueError(f"--size {size}: the float64 reference would not be exact")
    exact = (af @ bf).long()
    shift = FMT[1] * 2 - OUT_FMT[1]
    floor, rem = exact >> shift, exact & ((1 << shift) - 1)
    unclamped = floor + (rem > (1 << (shift - 1))).long()
    ref = unclamped.clamp(-(1 << 15), (1 << 15) - 1)
    saturated = (unclamped != ref).double().mean().item()
    if saturated > 1e-3:
        raise RuntimeError(f"--size {size}: {saturated:.2%} of the MACC's outputs saturate <{OUT_FMT[0]},"
                           f"{OUT_FMT[1]}>, so the agreement check would not cover the rounding")
    kernels: list[tuple[Optional[str], str]] = [(None, "")]
    if device.type == "cuda":  # both of ours where the GPU has integer tensor cores, else the CUDA-core one alone
        kernels = [("cuda-cores", "CUDA cores")]
        index = device.index if device.index is not None else torch.cuda.current_device()
        if _ops._C.fixed_matmul_cuda_kernel(index) == "tensor-cores":
            kernels.insert(0, ("tensor-cores", "tensor cores"))
    methods = []
    for kernel, label in kernels:
        tag = f", {label}" if label else ""
        near = lambda: fxp.matmul(a, b, FMT, FMT, OUT_FMT)
        sto = lambda: fxp.matmul(a, b, FMT, FMT, OUT_FMT, rounding="stochastic", seed=SEED)
        if kernel is not None:
            near, sto = with_macc_kernel(kernel, near), with_macc_kernel(kernel, sto)
        if not torch.equal(near().long(), ref):
            raise RuntimeError(f"fixed-point matmul{tag} disagrees with the exact reference")
        methods += [(f"matmul nearest (int16 codes{tag})", near), (f"matmul stochastic (int16 codes{tag})", sto)]
    if device.type == "cpu":  # ("addmm_cuda" is not implemented for int64: no such anchor on CUDA)
        methods.append(("torch int64 matmul", lambda: a64 @ b64))
        anchor = "torch int64 matmul"
    else:
        anchor = "torch float64 matmul"
        # torch's own integer GEMM multiplies 8-bit codes (int32 sums): half the bits of each operand, a quarter of
        # the digit products of ours; shown for scale.
        a8, b8 = (a >> 8).to(torch.int8), (b >> 8).to(torch.int8).t().contiguous().t()
        try:  # (its shape and layout rules vary across torch versions: left out where it refuses)
            torch._int_mm(a8, b8)
            methods.append(("torch._int_mm (int8 codes, int32 sums)", lambda: torch._int_mm(a8, b8)))
        except (RuntimeError, AttributeError) as e:
            h.print_text(f"torch._int_mm left out: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    return methods + [("torch float64 matmul", lambda: af @ bf)], anchor


def main() -> None:
    parser = h.make_parser(__doc__.splitlines()[0])
    parser.add_argument("--elements", type=h.positive_int, default=None, help="elements quantized (default 32M, 4M with --quick)")
    parser.add_argument("--size", type=h.positive_int, default=None,
                        help="M = K = N of the MACC (default 512 on the CPU, 4096 on CUDA; 128 with --quick)")
    args = h.parse_args(parser, repeats={"cpu": 10, "cuda": 50}, warmup={"cpu": 2, "cuda": 5})
    device: torch.device = args.device
    n = args.elements or (4_000_000 if args.quick else 32_000_000)
    size = args.size or (128 if args.quick else 4096 if device.type == "cuda" else 512)

    machine = h.machine_info(device)
    roofs = h.measure_roofs(device, warmup=max(1, args.warmup), repeats=max(5, args.repeats))
    h.print_header(NAME, machine, roofs)
    h.print_text(f"Convert of {n / 1e6:.0f}M float32 elements to <{FMT[0]},{FMT[1]}>; MACC {size}^3 of <{FMT[0]},{FMT[1]}> "
               f"codes into <{OUT_FMT[0]},{OUT_FMT[1]}>; {args.warmup} warm-up + up to {args.repeats} timed calls")

    x = torch.randn(n, generator=torch.Generator().manual_seed(SEED)).to(device) * 4
    probe = h.RoofProbe(device)
    methods = quantize_methods(x)
    flush = h.CacheFlush(device)  # calls of 50-300 µs on a GPU would pay for the dirty L2 lines of the one before
    h.print_text(flush.describe())
    copy_t, *timings = h.time_interleaved([probe.copy] + [m[3] for m in methods], device, warmup=args.warmup,
                                        repeats=args.repeats, max_seconds=args.max_seconds, flush=flush)
    copy_roof = 2 * probe.buffer_bytes / copy_t.median
    flush_bytes = flush.nbytes
    del probe, flush
    records: list[dict[str, Any]] = []
    by_name = {}
    for (name, anchor, per_elem, _), t in zip(methods, timings):
        bps = n * per_elem / t.median
        by_name[name] = bps
        records.append({"task": "convert", "method": name, "anchor": anchor or None, "elements": n,
                        "bytes": n * per_elem, "timing": t.to_dict(), "GBps": bps / h.GB,
                        "pct_copy_roof": 100 * bps / copy_roof})
    for r in records:
        r["pct_anchor"] = 100 * by_name[r["method"]] / by_name[r["anchor"]] if r["anchor"] else None
    rows = [["copy roof: y.copy_(x) of 400 MB, preallocated", f"{copy_t.median * 1e3:.3f}", f"{copy_roof / h.GB:.1f}",
             "100.0", "", ""]]
    for r in records:
        t = r["timing"]
        rows.append([r["method"], f"{t['median_s'] * 1e3:.3f}", f"{r['GBps']:.1f}", f"{r['pct_copy_roof']:.1f}",
                     "" if r["pct_anchor"] is None else f"{r['pct_anchor']:.1f}", r["anchor"] or ""])
    h.print_table(f"Convert on {device.type}: median ms; GB/s of the bytes each call must move", [
        "method", "median ms", "GB/s", "% copy roof", "% anchor", "anchor"], rows,
        [False, True, True, True, True, False])

    mm, anchor_name = matmul_methods(size, device)
    mm_t = h.time_interleaved([m[1] for m in mm], device, warmup=args.warmup, repeats=args.repeats,
                            max_seconds=args.max_seconds)
    macs = size ** 3
    anchor = next(t.median for (name, _), t in zip(mm, mm_t) if name == anchor_name)
    mm_rows = []
    for (name, _), t in zip(mm, mm_t):
        records.append({"task": "matmul", "method": name, "size": size, "timing": t.to_dict(),
                        "GMACps": macs / t.median / 1e9, "anchor": anchor_name, "speed_vs_anchor": anchor / t.median})
        mm_rows.append([name, f"{t.median * 1e3:.2f}", f"{macs / t.median / 1e9:.2f}", f"{anchor / t.median:.2f}x"])
    h.print_table(f"MACC {size}x{size}x{size} on {device.type} (INFO)", ["method", "median ms", "GMAC/s", f"vs {anchor_name}"],
                mm_rows, [False, True, True, True])

    targets = []
    # The goals compare with the same-bytes copy measured beside them. If that copy itself ran far below
    # the harness's probe (another process took the memory or the cores), every call ran at the machine's
    # pace rather than its own and the ratio means nothing: the verdict says so instead of PASS or FAIL.
    anchor_pct = next(r["pct_copy_roof"] for r in records if r["method"] == "anchor y.copy_(x), preallocated")
    for label, method in (("(a)", "quantize nearest (f32 -> f32, out=)"),
                          ("(b)", "quantize stochastic (f32 -> f32, out=)")):
        g = goal(NAME, label)
        value = next(r["pct_anchor"] for r in records if r["method"] == method)
        verdict = ("PASS" if g.met(value) else "FAIL") if g.applies(device) else "INFO"
        if verdict != "INFO" and anchor_pct < MIN_ANCHOR_PCT:
            verdict = f"INVALID (the copy anchor ran at {anchor_pct:.0f}% of the roof probe)"
        targets.append({"target": g.title, "measured": f"{value:.1f}%", "threshold": g.text(), "verdict": verdict,
                        "value": value})
    h.print_table("Project targets", ["target", "measured", "target value", "verdict"],
                [[t["target"], t["measured"], t["threshold"], t["verdict"]] for t in targets], [False, True, False, False])
    decided = [t for t in targets if t["verdict"] in ("PASS", "FAIL")]
    h.print_text(f"targets: {sum(t['verdict'] == 'PASS' for t in decided)}/{len(decided)} PASS")
    machine["cpu_busy_after_run"] = h.cpu_busy_fraction()
    h.warn_if_busy(machine["cpu_busy_after_run"], "just after this run")

    out: Optional[object] = h.json_path(args, NAME)
    if out is not None:
        h.write_json(out, machine, roofs, records, targets=targets, copy_roof_interleaved_GBps=copy_roof / h.GB,
                   config={"elements": n, "size": size, "fmt": FMT, "out_fmt": OUT_FMT, "seed": SEED,
                           "quick": args.quick, "warmup": args.warmup, "max_repeats": args.repeats,
                           "flush_bytes": flush_bytes})
        h.print_text(f"wrote {out}")


if __name__ == "__main__":
    main()
