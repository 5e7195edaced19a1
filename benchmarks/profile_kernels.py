"""Nsight Compute profiles of the kernels behind issue 11's missed goals, for a short GPU window.

``bash .ci/gpu_check.sh profile [WORKLOAD...]`` (``make gpu-check-profile``) runs, for each workload, one
process of ``python -m benchmarks.profile_kernels run WORKLOAD`` under ``ncu``, which profiles the first
launch of the workload's kernel (``--kernel-name regex:KERNEL --launch-count 1``) with the sections that
answer "why below the roof": SpeedOfLight (duration, DRAM and SM throughput), LaunchStats (registers,
shared memory), Occupancy (theoretical and achieved), MemoryWorkloadAnalysis, WarpStateStats (cycles per
issued instruction) and ComputeWorkloadAnalysis (IPC). Then ``summarize`` reads the CSV files ncu wrote and
prints one row per workload, and writes them as JSON.

Each workload launches its kernel once, on sizes that keep ncu's replays short (tens of MB to a few
hundred). ncu flushes the caches before each replay pass and, by default, locks the clocks at base: its
durations are not the benchmarks' (``bench_*`` measure those); its percentages of the peaks are what the
profile is for.

    python -m benchmarks.profile_kernels list                  the workloads and their kernels
    python -m benchmarks.profile_kernels run WORKLOAD          the workload once (under ncu)
    python -m benchmarks.profile_kernels summarize CSV... [--json PATH]
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch


@dataclass(frozen=True)
class Workload:
    kernel: str  # the regex ncu selects the kernel by (its function name)
    goal: str    # the goal it misses (or the pair it belongs to)
    run: Callable[[torch.device], None]
    # why the workload cannot run on this machine, or None (default: it can wherever there is a GPU)
    unavailable: Callable[[], Optional[str]] = lambda: None


def _sizes(total: int, n: int = 300) -> list[int]:
    """n tensor sizes summing to total, of mixed magnitudes (the benchmarks' lists in small)."""
    from benchmarks.bench_overflow import model_like_sizes

    return model_like_sizes(n, total)


def _check(dtype: torch.dtype) -> Callable[[torch.device], None]:
    def run(device: torch.device) -> None:
        import mpfused

        gen = torch.Generator(device=device).manual_seed(0)
        grads = [torch.randn(n, dtype=dtype, device=device, generator=gen) for n in _sizes(64 << 20)]
        mpfused.non_finite_check_(grads, torch.zeros(1, device=device))

    return run


def _adamw(master_weights: bool, rounding: str, dtype: torch.dtype = torch.float16) -> Callable[[torch.device], None]:
    def run(device: torch.device) -> None:
        from mpfused.optim import FusedAdamW

        gen = torch.Generator(device=device).manual_seed(0)
        params = []
        for n in _sizes(32 << 20):
            p = torch.nn.Parameter(torch.randn(n, device=device, generator=gen).to(dtype))
            p.grad = torch.randn(n, device=device, generator=gen).to(dtype)
            params.append(p)
        opt = FusedAdamW(params, lr=1e-3, master_weights=master_weights,
                         **({} if master_weights else {"rounding": rounding}))
        if master_weights:
            # as bench_optim's O2 pipeline steps (and GradScaler.step does): the kernel unscales the grads,
            # honours found_inf and writes the unscaled grads back. Without them it profiles a variant with
            # fewer bytes than the one the O2 goal measures.
            opt.grad_scale = torch.full((), 1024.0, device=device)
            opt.found_inf = torch.zeros((), device=device)
        opt.step()

    return run


def _gemm(device: torch.device) -> None:
    import mpfused

    gen = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(4096, 4096, device=device, generator=gen).half() for _ in range(2))
    mpfused.gemm(a, b)


def _hopper_unavailable(kernel: str) -> Callable[[], Optional[str]]:
    """Why MPFUSED_GEMM_KERNEL=kernel ('wgmma', 'wgmma-cluster') would not take that Hopper kernel here (then ncu
    would find no launch of it)."""

    def why() -> Optional[str]:
        import os

        from mpfused import _ops

        if not torch.cuda.is_available():
            return "no CUDA device"
        os.environ["MPFUSED_GEMM_KERNEL"] = kernel
        try:
            if _ops._C.gemm_cuda_kernel(torch.cuda.current_device()) == kernel:
                return None
        finally:
            del os.environ["MPFUSED_GEMM_KERNEL"]
        return "the Hopper GEMM kernel needs compute capability 9.0 and a build whose TORCH_CUDA_ARCH_LIST names 9.0"

    return why


def _gemm_wgmma(kernel: str) -> Callable[[torch.device], None]:
    def run(device: torch.device) -> None:
        import os

        os.environ["MPFUSED_GEMM_KERNEL"] = kernel  # that Hopper kernel (this workload's process only)
        _gemm(device)

    return run


def _convert(device: torch.device) -> None:
    import mpfused.fixed_point as fp

    x = torch.randn(32 << 20, device=device, generator=torch.Generator(device=device).manual_seed(0))
    fp.quantize(x, 2, 14, rounding="stochastic", seed=1, out=torch.empty_like(x))


def _macc_tensor_cores(device: torch.device) -> None:
    import mpfused.fixed_point as fp

    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randint(-(1 << 15), 1 << 15, (2048, 2048), generator=gen, dtype=torch.int32).to(torch.int16).to(device)
            for _ in range(2))
    fp.matmul(a, b, (4, 12), (4, 12), (8, 8))


def _macc_unavailable() -> Optional[str]:
    if not torch.cuda.is_available():
        return "no CUDA device"
    from mpfused import _ops

    if _ops._C.fixed_matmul_cuda_kernel(torch.cuda.current_device()) != "tensor-cores":
        return "this GPU or build has no integer tensor-core MACC (compute capability 7.2+)"
    return None


# In the order a short window should take them: the largest gaps first.
WORKLOADS: dict[str, Workload] = {
    "adamw-fp16-stochastic": Workload("optim_kernel", "stochastic / nearest step <= 1.10", _adamw(False, "stochastic")),
    "adamw-fp16-nearest": Workload("optim_kernel", "stochastic / nearest step <= 1.10", _adamw(False, "nearest")),
    # the same bytes as FP16's nearest step, which reached 89% of the copy roof on an H200 where this took 69%
    "adamw-bf16-nearest": Workload("optim_kernel", "stochastic / nearest step <= 1.10",
                                   _adamw(False, "nearest", torch.bfloat16)),
    "adamw-o2-fp16": Workload("optim_kernel", "O2 AdamW >= 90% of the copy roof", _adamw(True, "nearest")),
    "check-fp16": Workload("overflow_kernel", "check >= 85% of the read roof", _check(torch.float16)),
    "check-fp32": Workload("overflow_kernel", "check >= 85% of the read roof", _check(torch.float32)),
    "gemm-fp16-4096": Workload("gemm_kernel", "WMMA GEMM >= 50% of cuBLAS", _gemm),
    "gemm-fp16-4096-wgmma": Workload("gemm_sm90_kernel", "Hopper GEMM >= 50% of cuBLAS", _gemm_wgmma("wgmma"),
                                     _hopper_unavailable("wgmma")),
    "gemm-fp16-4096-wgmma-cluster": Workload("gemm_sm90_kernel", "Hopper GEMM >= 50% of cuBLAS",
                                             _gemm_wgmma("wgmma-cluster"), _hopper_unavailable("wgmma-cluster")),
    "convert-stochastic": Workload("quantize_kernel", "Convert >= 85% of the copy roof", _convert),
    # not a goal: the first profile of the fixed-point MACC on the integer tensor cores (tensor-pipe use, shared
    # memory wavefronts, occupancy at 168 registers)
    "macc-int16-tensor-cores": Workload("matmul_tc_kernel", "INFO: fixed-point MACC on the integer tensor cores",
                                        _macc_tensor_cores, _macc_unavailable),
}

# ncu's section names, and the metrics of its details page the summary keeps (name in the CSV -> column). A
# name may appear in several sections ("Memory Throughput": a % of the peak in SpeedOfLight, bytes per second
# in MemoryWorkloadAnalysis): a column whose name ends in "%" takes the first row of its metric in %, the
# others the metric's first row.
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "MemoryWorkloadAnalysis", "WarpStateStats",
            "ComputeWorkloadAnalysis")
COLUMNS = {
    "Duration": "duration",
    "DRAM Throughput": "DRAM %",
    "Memory Throughput": "memory %",
    "Compute (SM) Throughput": "SM %",
    "Registers Per Thread": "registers",
    "Theoretical Occupancy": "theoretical occupancy %",
    "Achieved Occupancy": "achieved occupancy %",
    "Warp Cycles Per Issued Instruction": "cycles per issue",
    "Executed Ipc Active": "IPC",
    "Issue Slots Busy": "issue slots %",
    "Static Shared Memory Per Block": "static smem",
}


def parse_ncu_csv(text: str) -> list[dict[str, Any]]:
    """The kernels of an ``ncu --csv --page details`` output (other lines, such as ``==PROF==`` messages or
    the program's own output, are skipped): per kernel its name and {metric name: (value, unit)}, in the
    order ncu profiled them; a metric's rows are listed in the order of the sections."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID",')), None)
    if start is None:
        return []
    kernels: dict[str, dict[str, Any]] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if not row.get("ID") or row.get("Metric Name") is None:
            continue
        k = kernels.setdefault(row["ID"], {"kernel": row.get("Kernel Name", ""), "metrics": {}})
        value = (row.get("Metric Value", ""), row.get("Metric Unit", ""))
        k["metrics"].setdefault(row["Metric Name"], []).append(value)
    return list(kernels.values())


def _number(text: str) -> Optional[float]:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarize(paths: list[Path]) -> list[dict[str, Any]]:
    """One row per CSV file (``profile-WORKLOAD.csv``): the workload, its kernel and the kept metrics; a file
    with no kernel in it, or none at all (ncu failed, or the filter matched nothing), gives a row that says
    so."""
    rows = []
    for path in paths:
        name = path.stem.removeprefix("profile-")
        kernels = parse_ncu_csv(path.read_text(errors="replace")) if path.is_file() else []
        row: dict[str, Any] = {"workload": name}
        if not kernels:
            row["error"] = "no kernel profiled (see the log beside it)" if path.is_file() else "ncu wrote no file"
        else:
            k = kernels[0]
            row["kernel"] = k["kernel"]
            for metric, column in COLUMNS.items():
                found = [(v, u) for v, u in k["metrics"].get(metric, []) if u == "%" or not column.endswith("%")]
                if not found:
                    continue
                value, unit = found[0]
                num = _number(value)
                row[column] = num if num is not None else value
                if unit and not column.endswith("%") and column not in ("registers", "IPC"):
                    row[column + " unit"] = unit
        rows.append(row)
    return rows


def _print_rows(rows: list[dict[str, Any]]) -> None:
    columns = ["workload"] + list(COLUMNS.values())
    print("\t".join(columns))
    for row in rows:
        if "error" in row:
            print(f"{row['workload']}\t{row['error']}")
            continue
        cells = [row["workload"]]
        for c in COLUMNS.values():
            v = row.get(c, "")
            unit = row.get(c + " unit", "")
            cells.append((f"{v:g} {unit}" if unit else f"{v:g}") if isinstance(v, float) else str(v))
        print("\t".join(cells))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_kernels", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the workloads: name, kernel regex, goal, and why it cannot run here (empty: it can)")
    run = sub.add_parser("run", help="one workload, once, on CUDA")
    run.add_argument("workload", choices=list(WORKLOADS))
    summ = sub.add_parser("summarize", help="a table of ncu's CSV files")
    summ.add_argument("csv", nargs="+", type=Path)
    summ.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.cmd == "list":
        for name, w in WORKLOADS.items():
            why = w.unavailable() if torch.cuda.is_available() else "no CUDA device"  # (every workload runs on CUDA)
            print(f"{name}\t{w.kernel}\t{w.goal}\t{why or ''}")
        return 0
    if args.cmd == "run":
        if not torch.cuda.is_available():
            print("profile_kernels run: needs a CUDA device", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        WORKLOADS[args.workload].run(device)
        torch.cuda.synchronize(device)
        return 0
    rows = summarize(args.csv)
    _print_rows(rows)
    if args.json is not None:
        args.json.write_text(json.dumps({"sections": list(SECTIONS), "rows": rows}, indent=1))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
