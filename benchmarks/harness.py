"""Shared benchmark harness for mpfused: timing, machine description, memory roofs, tables and JSON.

Every benchmark script in this directory uses the same pieces, so its numbers can be compared across
scripts and machines:

- :func:`time_interleaved` / :func:`time_fn` time callables (warm-up, then repeats in rounds of one call
  each, in a shuffled order; optionally a :class:`CacheFlush` before each timed call; CUDA events on a
  GPU, ``perf_counter`` on the CPU) and return every sample with median and spread.
- :func:`machine_info` describes where the numbers were taken.
- :func:`measure_roofs` measures the device's memory roofs (copy and read bandwidth on a buffer much
  larger than any cache). Results are expressed against these anchors ("% of read roof"), measured in
  the same run, rather than against a datasheet figure. A :class:`RoofProbe` measures them again
  interleaved with the callables they anchor (:func:`time_interleaved`): on a shared or virtual
  machine the bandwidth can move by tens of percent within seconds. :func:`cpu_busy_fraction` and
  :func:`warn_if_busy` flag other processes competing for the machine.
- :func:`print_table` prints a result table (``rich`` when installed, plain text otherwise).
- :func:`make_parser` / :func:`parse_args` give every script the same command line, and
  :func:`write_json` writes ``{"machine", "roofs", "results", ...}`` for ``--json``.

Scripts are run from the repository root as ``python -m benchmarks.bench_x`` (mpfused built in place
there, or installed); they import this module as ``from .harness import ...`` and their goals from
``goals.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

import mpfused

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# Roof buffer sizes: far beyond every cache level (the H100's L2 is 50 MB), while keeping host memory
# use modest (the roof needs two buffers of this size).
CPU_ROOF_BYTES = 400 * 10**6
CUDA_ROOF_BYTES = 2 * 2**30

GB = 1e9


# ---- timing -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    """Wall-clock samples of one measured callable, in seconds, with summary statistics."""

    samples_s: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def min(self) -> float:
        return min(self.samples_s)

    @property
    def max(self) -> float:
        return max(self.samples_s)

    @property
    def iqr(self) -> float:
        """Interquartile range (0 with fewer than two samples)."""
        if len(self.samples_s) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.samples_s, n=4, method="inclusive")
        return q3 - q1

    @property
    def stdev(self) -> float:
        """Sample standard deviation (0 with fewer than two samples)."""
        return statistics.stdev(self.samples_s) if len(self.samples_s) > 1 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "median_s": self.median,
            "min_s": self.min,
            "max_s": self.max,
            "iqr_s": self.iqr,
            "stdev_s": self.stdev,
            "repeats": len(self.samples_s),
            "samples_s": list(self.samples_s),
        }


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def round_orders(n: int, rounds: int, seed: int = 0) -> list[list[int]]:
    """The order of the ``n`` callables in each of ``rounds`` rounds of :func:`time_interleaved`: a
    permutation shuffled afresh every round (seeded, so a rerun repeats it). A fixed cyclic order, even
    started one callable further on each round, has callable i follow callable i - 1 in all but one
    round of n, and so inherit the same machine state every time: on an H200 the overflow check (62 µs)
    always ran right after the copy roof's 2 GiB ``y.copy_(x)`` and paid about 8 µs for the dirty lines
    that copy left in L2 (54 µs in the one round of 11 where something else came before it)."""
    rng = random.Random(seed)
    orders = []
    for _ in range(rounds):
        order = list(range(n))
        rng.shuffle(order)
        orders.append(order)
    return orders


def last_level_cache_bytes(device: torch.device, sysfs: Path = Path("/sys/devices/system/cpu")) -> int:
    """The size of the device's last cache level: the GPU's L2, or on the CPU the total of its last level
    over the machine (each distinct instance counted once: an EPYC has one L3 per CCD, and a threaded read
    spreads over them all), from sysfs (0 where neither says)."""
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))
    levels: dict[int, dict[str, int]] = {}  # level -> {the CPUs sharing an instance: its size}
    for index in sysfs.glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = int((index / "level").read_text())
            levels.setdefault(level, {})[(index / "shared_cpu_list").read_text().strip()] = parse_cache_size(
                (index / "size").read_text())
        except (OSError, ValueError):
            continue
    return sum(levels[max(levels)].values()) if levels else 0


def parse_cache_size(text: str) -> int:
    """Bytes of a sysfs cache size ("32768K", "2M", "512"); 0 for anything else."""
    m = re.fullmatch(r"(\d+)([KMG]?)", text.strip())
    return int(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2)] if m else 0


class CacheFlush:
    """An untimed call for :func:`time_interleaved`'s ``flush``: reads (``x.sum()``) a buffer four times
    the last cache level (at least 64 MiB, at most 2 GiB), which evicts every line an earlier call left, writing back the
    dirty ones, and leaves only clean lines behind. Each timed call then starts from the same cache
    state whatever ran before it. For callables short enough that a cache's worth of write-backs is a
    visible part of their time (tens of µs on a GPU); it reads only, so it adds no dirty lines itself."""

    MIN_BYTES = 64 * 2**20
    MAX_BYTES = 2 * 2**30
    UNKNOWN_CACHE_BYTES = 256 * 2**20  # where the cache size is not known: above any L2 or L3 we expect to meet

    def __init__(self, device: torch.device, nbytes: Optional[int] = None) -> None:
        if nbytes is None:
            llc = last_level_cache_bytes(device)
            nbytes = min(max(4 * llc, self.MIN_BYTES), self.MAX_BYTES) if llc > 0 else self.UNKNOWN_CACHE_BYTES
        self.x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        self.nbytes = self.x.numel() * 4
        self.calls = 0

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        return self.x.sum()

    def describe(self) -> str:
        return f"each timed call follows an untimed read of {self.nbytes / 2**20:.0f} MiB (CacheFlush)"


def time_interleaved(fns: Sequence[Callable[[], object]], device: torch.device, *, warmup: int, repeats: int,
                     max_seconds: Optional[float] = None, min_repeats: int = 3,
                     flush: Optional[Callable[[], object]] = None) -> list[Timing]:
    """Times several callables in alternation and returns one :class:`Timing` per callable.

    Each callable gets ``warmup`` untimed calls, then the timed calls go in rounds: one call of each
    callable per round, in an order shuffled afresh each round (:func:`round_orders`), so that no
    callable always follows the same one and inherits its cache and allocator state (after a roof
    probe's copy, a cache full of dirty lines). Slow drifts of the machine (other tenants of a virtual
    machine, clocks) then affect every callable alike, and ratios between them stay meaningful where
    timing them one after the other could be tens of percent off. With ``flush`` (a :class:`CacheFlush`),
    every timed call follows an untimed call of it, so every call starts from the same cache state.

    With ``max_seconds``, a callable whose warm-up shows that ``repeats`` calls would take longer than
    that is timed in fewer rounds, but in at least ``min_repeats`` (or ``repeats`` if smaller). The
    warm-up estimate includes first-call costs, so it errs towards fewer calls.

    On CUDA each call is bracketed by a pair of CUDA events recorded on the current stream; the calls
    are queued back to back, and the host synchronises only after the warm-up (so warm-up work is not
    counted) and after the last timed call (to read the events). A call's time is therefore the device
    time between its events, which includes any gap where the device waited for the host to enqueue
    work: launch-bound callables are charged for their launches (a flush queued before them gives the
    host a head start of the flush's device time, so leave it out where host time is measured). On the
    CPU each call is timed with ``time.perf_counter``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    counts = []
    for fn in fns:
        t0 = time.perf_counter()
        for _ in range(warmup):
            fn()
        synchronize(device)
        count = repeats
        if max_seconds is not None and warmup > 0:
            per_call = (time.perf_counter() - t0) / warmup
            count = max(min(min_repeats, repeats), min(repeats, int(max_seconds / per_call)))
        counts.append(count)

    on_cuda = device.type == "cuda"
    samples: list[list] = [[] for _ in fns]  # CUDA: (start, end) event pairs; CPU: seconds
    for round_, order in enumerate(round_orders(len(fns), max(counts))):
        for i in order:
            if round_ >= counts[i]:
                continue
            fn, out = fns[i], samples[i]
            if flush is not None:
                flush()  # queued before the start event on CUDA; done when it returns on the CPU
            if on_cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                out.append((start, end))
            else:
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
    if on_cuda:
        torch.cuda.synchronize(device)
        return [Timing(tuple(start.elapsed_time(end) / 1e3 for start, end in out)) for out in samples]
    return [Timing(tuple(out)) for out in samples]


def time_fn(fn: Callable[[], object], device: torch.device, *, warmup: int, repeats: int,
            max_seconds: Optional[float] = None, min_repeats: int = 3) -> Timing:
    """Times one callable: :func:`time_interleaved` with a single callable."""
    return time_interleaved([fn], device, warmup=warmup, repeats=repeats, max_seconds=max_seconds,
                            min_repeats=min_repeats)[0]


def count_cuda_kernels(fn: Callable[[], object], device: torch.device,
                       names: Optional[dict[str, int]] = None) -> Optional[int]:
    """Number of CUDA kernels one call of ``fn`` launches, counted with ``torch.profiler`` (memsets and
    memcpys excluded). None on a device other than CUDA. ``names``, where given, gets each kernel's name
    and how often it ran."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    count = 0
    events = prof.events()
    # A record_function range (the optimizers' "Optimizer.step#...") is mirrored on the GPU's timeline as a
    # user annotation with the CPU range's name: not a kernel (the H200 run of 2026-11-27 counted one).
    cpu_names = {e.name for e in events if e.device_type != torch.autograd.DeviceType.CUDA}
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if getattr(event, "is_user_annotation", False) or event.name in cpu_names:
            continue
        activity = getattr(event, "activity_type", None)
        if activity is not None:
            kernel = activity == "kernel"
        else:  # older torch: no activity type on the event, tell kernels apart by name
            kernel = not event.name.startswith(("Memset", "Memcpy", "Context Sync"))
        count += kernel
        if kernel and names is not None:
            names[event.name] = names.get(event.name, 0) + 1
    return count


# ---- machine description ------------------------------------------------------------------------------
def _cpu_model() -> Optional[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _nvidia_driver_version() -> Optional[str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.strip().splitlines()
    return lines[0].strip() if lines else None


def cpu_busy_fraction(interval_s: float = 0.5) -> Optional[float]:
    """Fraction of all cpus' time spent busy (not idle or waiting for I/O) over the next ``interval_s``
    seconds, from /proc/stat; None where that is not available. Called while the benchmark itself is
    idle, it measures the other processes competing for the machine."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat", encoding="utf-8") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields), idle

    try:
        total0, idle0 = sample()
        time.sleep(interval_s)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    return round(1.0 - (idle1 - idle0) / total, 3) if total > 0 else None


def _gpu_info(device: torch.device) -> Optional[dict[str, Any]]:
    if not torch.cuda.is_available():
        return None
    index = device.index if device.type == "cuda" and device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {
        "index": index,
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "memory_GiB": round(props.total_memory / 2**30, 1),
        "multiprocessors": props.multi_processor_count,
        "driver_version": _nvidia_driver_version(),
        "cuda_runtime_torch": torch.version.cuda,
    }


def machine_info(device: torch.device) -> dict[str, Any]:
    """Where the numbers were taken: CPU, thread counts, versions, mpfused build and GPU (if any)."""
    try:
        usable_cpus: Optional[int] = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable_cpus = None
    try:
        load_average: Optional[list[float]] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load_average = None
    return {
        "device": str(device),
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable_cpus,
        "torch_num_threads": torch.get_num_threads(),
        "load_average_1_5_15m": load_average,
        "cpu_busy_before_run": cpu_busy_fraction(),
        "torch_version": torch.__version__,
        "mpfused_build": mpfused.build_info(),
        "gpu": _gpu_info(device),
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# ---- memory roofs -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Roofs:
    """Measured memory bandwidth of one device, in bytes per second, from median times.

    - read: ``x.sum()`` over a float32 buffer; bytes = the buffer's size.
    - copy: ``y.copy_(x)`` between two such buffers; bytes = read + written (2x the buffer). On a CPU
      the hardware may also read ``y`` before writing it (write-allocate); that traffic is not counted.
    """

    buffer_bytes: int
    read: Timing
    copy: Timing

    @property
    def read_Bps(self) -> float:
        return self.buffer_bytes / self.read.median

    @property
    def copy_Bps(self) -> float:
        return 2 * self.buffer_bytes / self.copy.median

    def to_dict(self) -> dict[str, Any]:
        return {
            "buffer_bytes": self.buffer_bytes,
            "read_GBps": self.read_Bps / GB,
            "copy_GBps": self.copy_Bps / GB,
            "read_method": "x.sum() on a float32 buffer; bytes read / median time",
            "copy_method": "y.copy_(x) between float32 buffers; (bytes read + bytes written) / median time",
            "read": self.read.to_dict(),
            "copy": self.copy.to_dict(),
        }


class RoofProbe:
    """The buffers of the roof measurement and the two callables measured on them: :meth:`read`
    (``x.sum()``) and :meth:`copy` (``y.copy_(x)``). Keep one alive to measure the roofs interleaved with
    other callables (:func:`time_interleaved`), so that both see the same machine state."""

    def __init__(self, device: torch.device, buffer_bytes: Optional[int] = None) -> None:
        """Buffers of ``buffer_bytes`` each (default 400 MB on the CPU, 2 GiB on CUDA)."""
        if buffer_bytes is None:
            buffer_bytes = CUDA_ROOF_BYTES if device.type == "cuda" else CPU_ROOF_BYTES
        self.x = torch.ones(buffer_bytes // 4, dtype=torch.float32, device=device)
        self.y = torch.zeros_like(self.x)
        self.buffer_bytes = self.x.numel() * 4

    def read(self) -> torch.Tensor:
        return self.x.sum()

    def copy(self) -> torch.Tensor:
        return self.y.copy_(self.x)

    def roofs(self, read: Timing, copy: Timing) -> Roofs:
        """The roofs from timings of :meth:`read` and :meth:`copy`."""
        return Roofs(buffer_bytes=self.buffer_bytes, read=read, copy=copy)


def measure_roofs(device: torch.device, *, warmup: int, repeats: int, buffer_bytes: Optional[int] = None) -> Roofs:
    """Measures the read and copy roofs of ``device`` on their own (see :class:`RoofProbe`); the buffers
    are freed before returning."""
    probe = RoofProbe(device, buffer_bytes)
    read, copy = time_interleaved([probe.read, probe.copy], device, warmup=warmup, repeats=repeats)
    roofs = probe.roofs(read, copy)
    del probe
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return roofs


# ---- output -------------------------------------------------------------------------------------------
def _console() -> Any:
    from rich.console import Console

    # Piped output would otherwise be cut to 80 columns and wrap the tables.
    return Console(width=None if sys.stdout.isatty() else 200)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]],
                numeric: Sequence[bool] = ()) -> None:
    """Prints ``rows`` (cells already formatted, or anything ``str()`` renders) under ``columns``.
    ``numeric[i]`` right-aligns column i. Uses ``rich`` when installed, plain text otherwise."""
    align_right = [i < len(numeric) and numeric[i] for i in range(len(columns))]
    cells = [[str(c) for c in row] for row in rows]
    try:
        from rich.table import Table
    except ImportError:
        widths = [max([len(col)] + [len(r[i]) for r in cells]) for i, col in enumerate(columns)]

        def line(values: Sequence[str]) -> str:
            return "  ".join(v.rjust(w) if right else v.ljust(w)
                             for v, w, right in zip(values, widths, align_right)).rstrip()

        print(f"\n{title}")
        print(line(columns))
        print("  ".join("-" * w for w in widths))
        for r in cells:
            print(line(r))
        return
    table = Table(title=title, title_justify="left")
    for col, right in zip(columns, align_right):
        table.add_column(col, justify="right" if right else "left", no_wrap=True)
    for r in cells:
        table.add_row(*r)
    _console().print(table)


def print_text(text: str) -> None:
    """Prints a line through the same console as the tables (plain ``print`` without ``rich``)."""
    try:
        console = _console()
    except ImportError:
        print(text)
        return
    console.print(text, markup=False, highlight=False)


def warn_if_busy(busy: Optional[float], when: str) -> None:
    """Prints a warning when other processes kept more than 10% of the cpus busy (see
    :func:`cpu_busy_fraction`): the numbers are then slower and noisier than the hardware allows."""
    if busy is not None and busy > 0.1:
        print_text(f"  WARNING: other processes kept {busy:.0%} of the cpus busy {when}: they compete for cpu "
                   "time and memory bandwidth, so the numbers of this run may be slower and noisier than "
                   "the hardware allows")


def print_header(name: str, machine: dict[str, Any], roofs: Roofs) -> None:
    """Prints the machine summary and the measured roofs that the results are expressed against."""
    gpu = machine["gpu"]
    where = (f"{gpu['name']} (driver {gpu['driver_version']}, CUDA {gpu['cuda_runtime_torch']})"
             if machine["device"].startswith("cuda") and gpu else machine["cpu_model"])
    print_text(f"{name} on {machine['device']}: {where}")
    build = machine["mpfused_build"]
    print_text(f"  cpus {machine['usable_cpus']}/{machine['logical_cpus']} usable, torch threads "
               f"{machine['torch_num_threads']}, torch {machine['torch_version']}, python "
               f"{machine['python_version']}, mpfused {build['version']} (built against torch "
               f"{build['torch_version']}, CUDA {build['cuda_version']}, OpenMP {build['openmp']}), "
               f"{machine['date_utc']}")
    if machine["device"] == "cpu":
        print_text(f"  CPU path measured: {build['cpu_isa']} (MPFUSED_CPU_ISA; supported here: "
                   f"{build['cpu_isa_supported']})")
    warn_if_busy(machine["cpu_busy_before_run"], "just before this run")
    print_text(f"  roofs ({roofs.buffer_bytes / 1e6:.0f} MB buffers, median of {len(roofs.read.samples_s)}): "
               f"read {roofs.read_Bps / GB:.1f} GB/s (x.sum), copy {roofs.copy_Bps / GB:.1f} GB/s "
               f"(y.copy_(x), read + write)")


def json_path(args: argparse.Namespace, name: str) -> Optional[Path]:
    """Where ``--json`` asks the results to go: None without ``--json``, the given path, or
    ``benchmarks/results/<name>_<device>_<what>.json`` when ``--json`` has no path: on the CPU one file per
    CPU code path (``<name>_cpu_avx512.json``), on CUDA one per GPU model (``<name>_cuda_nvidia-h100-80gb-hbm3.json``:
    the device name, lowercased, with every other character than a letter or digit as ``-``)."""
    if args.json is None:
        return None
    if args.json:
        return Path(args.json)
    if args.device.type == "cpu":
        import mpfused

        return RESULTS_DIR / f"{name}_cpu_{mpfused.build_info()['cpu_isa']}.json"
    gpu = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(args.device).lower()).strip("-")
    return RESULTS_DIR / f"{name}_{args.device.type}_{gpu}.json"


def write_json(path: Path, machine: dict[str, Any], roofs: Roofs, results: Sequence[dict[str, Any]],
               **extra: Any) -> Path:
    """Writes ``{"machine", "roofs", "results", **extra}`` to ``path`` (parents created) and returns it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"machine": machine, "roofs": roofs.to_dict(), "results": list(results), **extra}
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return path


# ---- command line -------------------------------------------------------------------------------------
def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (sizes, counts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def check_json_path(parser: argparse.ArgumentParser, text: str) -> None:
    """--json PATH, checked before anything is measured (a bad path once failed after the whole run, its
    results lost): not a directory, and its nearest existing parent a writable directory."""
    path = Path(text)
    if path.is_dir():
        parser.error(f"--json {text}: is a directory; give a file path")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        parser.error(f"--json {text}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        parser.error(f"--json {text}: cannot write in {parent}")


def sizes_or_error(parser: argparse.ArgumentParser, tensors: int, total: int, options: str) -> list[int]:
    """bench_overflow.model_like_sizes(tensors, total), or an argparse error naming ``options`` where the
    two do not make a list (fewer than 3 tensors, too few elements for them), before anything is measured."""
    from .bench_overflow import model_like_sizes

    try:
        return model_like_sizes(tensors, total)
    except ValueError as e:
        parser.error(f"{options}: {e}")


def make_parser(description: str) -> argparse.ArgumentParser:
    """The options every benchmark shares. ``--repeats`` and ``--warmup`` default to None so that the
    script can choose per device (see :func:`parse_args`)."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{Path(sys.argv[0]).stem}", description=description)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="device to measure (default: cuda if available, else cpu)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per measurement")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls before each measurement")
    parser.add_argument("--max-seconds", type=float, default=2.0,
                        help="time budget per measurement: slower callables get fewer repeats, at least 3 "
                             "(default 2.0)")
    parser.add_argument("--json", nargs="?", const="", default=None, metavar="PATH",
                        help="write the results as JSON (default path: benchmarks/results/<name>_<device>.json, <name>_cpu_<CPU path>.json on the CPU)")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    return parser


def parse_args(parser: argparse.ArgumentParser, *, repeats: dict[str, int], warmup: dict[str, int],
               argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses the command line. ``args.device`` becomes a ``torch.device``; ``repeats`` and ``warmup``
    map a device type to its default. Asking for CUDA without a GPU or without mpfused's CUDA kernels
    is an error, not a silent fallback to the CPU."""
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device")
        if not mpfused.has_cuda_kernels():
            parser.error("mpfused was built without CUDA kernels: rebuild it with CUDA, or pass --device cpu")
    args.device = torch.device(args.device)
    if args.repeats is None:
        args.repeats = repeats[args.device.type]
    if args.warmup is None:
        args.warmup = warmup[args.device.type]
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    if not args.max_seconds > 0:
        parser.error(f"--max-seconds must be > 0, got {args.max_seconds}")
    if args.json:
        check_json_path(parser, args.json)
    return args

