"""Benchmark of stochastic rounding, ``mpfused.round_stochastic`` (FP32 -> FP16/BF16).

One large FP32 tensor (default 64M elements; ``--quick``: 4M) is rounded into a preallocated FP16 or BF16
tensor (``out=``), against these anchors measured in the same run, timed in rounds with it, each call after
an untimed read of four times the last cache level (harness.CacheFlush):

- the copy roof: ``y.copy_(x)`` between FP32 buffers, as bytes read + written per second (harness);
- torch's round-to-nearest conversion of the same tensor into the same output, ``y.copy_(x)``: the same
  bytes with no random numbers;
- stochastic rounding composed of torch ops, as a user without mpfused would write it for BF16: 16 random
  bits per element from ``torch.randint``, added to the FP32 bit pattern, truncated
  (``((x.view(int32) + r) >> 16).to(int16).view(bfloat16)``, NaN not handled): BF16 only, since FP16
  needs more than an add;
- the generator alone: the random bits of 1M elements (the extension's ``philox_words``, int32 out, 4 MB:
  cache-resident), elements per second, timed in the same rounds as the first dtype's methods: what the
  random bits cost, whatever the memory could do. Not a strict ceiling: it stores a 4-byte word per element,
  where the rounding keeps its 16 bits in registers (on avx512 the rounding has measured faster).

Bytes per element: 4 read + 2 written. The targets (rows of benchmarks/goals.py), PASS/FAIL from this run:
(a) round_stochastic as a share of the copy roof;
(b) round_stochastic against torch's composite stochastic rounding (BF16).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

import mpfused

from .goals import goal
from .harness import (
    GB,
    CacheFlush,
    RoofProbe,
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
    time_interleaved,
    warn_if_busy,
    write_json,
)

NAME = "random"
DTYPES = {"FP16": torch.float16, "BF16": torch.bfloat16}
SEED = 1234
OURS = "mpfused round_stochastic(out=)"
TORCH_RNE = "torch y.copy_(x) (round to nearest)"
TORCH_SR = "torch randint + add + shift (BF16 SR)"
GENERATOR = "generator alone: bits of 1M elements, in cache"


def torch_sr_bf16(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    r = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device)
    return out.copy_(((x.view(torch.int32) + r) >> 16).to(torch.int16).view(torch.bfloat16))


def check_agreement(x: torch.Tensor, dtype: torch.dtype) -> None:
    """Before timing: every result is one of the two neighbours of its input, i.e. its bit pattern is the
    round-to-nearest one or next to it. Syncs; never in a timed region."""
    part = x[: 1 << 20]
    y = mpfused.round_stochastic(part, dtype, seed=SEED).view(torch.int16).int()
    near = part.to(dtype).view(torch.int16).int()
    if not bool(((y - near).abs() <= 1).all()):
        raise RuntimeError(f"{dtype}: round_stochastic left the neighbours of its inputs")


def main() -> None:
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--elements", type=positive_int, default=None, help="elements (default 64M, or 4M with --quick)")
    args = parse_args(parser, repeats={"cpu": 10, "cuda": 50}, warmup={"cpu": 1, "cuda": 5})
    device: torch.device = args.device
    n = args.elements or ((1 << 22) if args.quick else (1 << 26))

    machine = machine_info(device)
    roofs = measure_roofs(device, warmup=max(1, args.warmup), repeats=max(5, args.repeats))
    print_header(NAME, machine, roofs)
    print_text(f"x: {n / 1e6:.1f}M float32 elements, randn * 1e-3; {args.warmup} warm-up + up to {args.repeats} "
               f"timed calls per method, in rounds with the roof probe")

    gen_n = 1 << 20
    words = torch.empty(gen_n, dtype=torch.int32, device=device)  # the operator writes the bits here
    generate = lambda: torch.ops.mpfused.philox_words_(SEED, 0, 0, 0, words)  # noqa: E731
    gen = None  # timed in the first dtype's rounds, beside the probe and the methods (a busy machine alike)

    gen_x = torch.Generator(device=device).manual_seed(SEED)
    x = torch.randn(n, device=device, generator=gen_x) * 1e-3
    probe = RoofProbe(device)
    flush = CacheFlush(device)  # each call of 0.1 ms on a GPU would pay for the dirty L2 lines of the one before
    print_text(flush.describe())
    records: list[dict[str, Any]] = []
    for name, dtype in DTYPES.items():
        out = torch.empty(n, dtype=dtype, device=device)
        check_agreement(x, dtype)
        methods = [(OURS, lambda: mpfused.round_stochastic(x, dtype, seed=SEED, out=out)),
                   (TORCH_RNE, lambda: out.copy_(x))]
        if dtype == torch.bfloat16:
            methods.append((TORCH_SR, lambda: torch_sr_bf16(x, out)))
        extra = [generate] if gen is None else []
        copy, *timings = time_interleaved([probe.copy] + [fn for _, fn in methods] + extra, device,
                                          warmup=args.warmup, repeats=args.repeats, max_seconds=args.max_seconds,
                                          flush=flush)
        if extra:
            gen = timings.pop()
        roof_bps = 2 * probe.buffer_bytes / copy.median
        for (method, _), t in zip(methods, timings):
            bps = 6 * n / t.median
            records.append({"dtype": name, "method": method, "elements": n, "timing": t.to_dict(),
                            "elements_per_s": n / t.median, "GBps": bps / GB, "copy_roof_GBps": roof_bps / GB,
                            "pct_copy_roof": 100.0 * bps / roof_bps})
        del out
    gen_eps = gen_n / gen.median
    flush_bytes = flush.nbytes
    del probe, flush
    machine["cpu_busy_after_run"] = cpu_busy_fraction()
    warn_if_busy(machine["cpu_busy_after_run"], "just after this run")

    rows = []
    for r in records:
        t = r["timing"]
        rows.append([r["dtype"], r["method"], f"{t['median_s'] * 1e3:.2f}", f"{t['iqr_s'] * 1e3:.2f}", str(t["repeats"]),
                     f"{r['elements_per_s'] / 1e9:.2f}", f"{r['GBps']:.1f}", f"{r['pct_copy_roof']:.0f}%"])
    rows.append(["-", GENERATOR, f"{gen.median * 1e3:.3f}", f"{gen.iqr * 1e3:.3f}", str(len(gen.samples_s)),
                 f"{gen_eps / 1e9:.2f}", "", ""])
    print_table(f"stochastic rounding on {device.type}: 6 bytes per element (4 read, 2 written)",
                ["dtype", "method", "median ms", "IQR ms", "n", "Gelem/s", "GB/s", "% copy roof"], rows)

    targets = []
    ga, gb = goal(NAME, "(a)"), goal(NAME, "(b)")
    for name in DTYPES:
        ours = next(r for r in records if r["dtype"] == name and r["method"] == OURS)
        rne = next(r for r in records if r["dtype"] == name and r["method"] == TORCH_RNE)
        value = ours["pct_copy_roof"]
        targets.append({"goal": ga.title, "dtype": name, "value": value, "threshold": ga.text(),
                        "met": ga.met(value) if ga.applies(device, name) else None,
                        "anchors": {"torch RNE % copy roof": rne["pct_copy_roof"],
                                    "generator Gelem/s": gen_eps / 1e9,
                                    "generator / roof (elements)": gen_eps / (ours["copy_roof_GBps"] * GB / 6)}})
    ours = next(r for r in records if r["dtype"] == "BF16" and r["method"] == OURS)
    composite = next(r for r in records if r["dtype"] == "BF16" and r["method"] == TORCH_SR)
    ratio = composite["timing"]["median_s"] / ours["timing"]["median_s"]
    targets.append({"goal": gb.title, "dtype": "BF16", "value": ratio, "threshold": gb.text(),
                    "met": gb.met(ratio) if gb.applies(device, "BF16") else None})
    rows = []
    for t in targets:
        shown = f"{t['value']:.0f}%" if "roof" in t["goal"] else f"{t['value']:.1f}x"
        verdict = "INFO" if t["met"] is None else ("PASS" if t["met"] else "FAIL")
        extra = ""
        if "anchors" in t:
            a = t["anchors"]
            extra = (f"torch RNE at {a['torch RNE % copy roof']:.0f}%; generator alone {a['generator Gelem/s']:.2f} "
                     f"Gelem/s = {100 * a['generator / roof (elements)']:.0f}% of the roof's elements/s")
        rows.append([t["goal"], t["dtype"], shown, t["threshold"], verdict, extra])
    print_table("targets", ["goal", "dtype", "measured", "target", "verdict", "anchors"], rows)

    path: Optional[Path] = json_path(args, NAME)
    if path is not None:
        write_json(path, machine, roofs, records, targets=targets,
                   generator={"elements": gen_n, "timing": gen.to_dict(), "elements_per_s": gen_eps},
                   config={"elements": n, "seed": SEED, "quick": args.quick, "flush_bytes": flush_bytes})
        print_text(f"wrote {path}")


if __name__ == "__main__":
    main()
