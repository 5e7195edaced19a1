"""benchmarks/harness.py's timing loop: the order of the calls in each round, and the cache flush before
each timed call. The numbers the benchmarks report depend on what ran just before each call (a GPU
kernel of tens of µs pays for the dirty lines its predecessor left in L2), so the order is part of what
they measure. And the command line: bad sizes and paths refused before anything is measured."""

import argparse
import time
from collections import Counter

import pytest
import torch

from benchmarks import harness as h
from benchmarks.bench_optim import parse_count

CPU = torch.device("cpu")


def test_each_round_is_a_permutation_and_reruns_repeat_it():
    orders = h.round_orders(11, 50)
    assert len(orders) == 50
    assert all(sorted(o) == list(range(11)) for o in orders)
    assert orders == h.round_orders(11, 50)
    assert len({tuple(o) for o in orders}) > 40  # shuffled afresh, not one order rotated


def predecessors(calls, target):
    """Which callable ran just before each timed call of `target` in a sequence of names."""
    return Counter(calls[i - 1] for i in range(1, len(calls)) if calls[i] == target)


def recording_fns(n, calls):
    def make(i):
        return lambda: calls.append(i)
    return [make(i) for i in range(n)]


def test_no_callable_always_follows_the_same_one():
    # The cyclic order it replaces had callable i right after callable i - 1 in all rounds but one in n.
    n, rounds = 11, 50
    calls: list = []
    h.time_interleaved(recording_fns(n, calls), CPU, warmup=0, repeats=rounds)
    assert Counter(calls) == {i: rounds for i in range(n)}
    for target in range(n):
        before = predecessors(calls, target)
        assert len(before) >= n // 2, (target, before)
        assert max(before.values()) <= rounds // 4, (target, before)


def test_flush_runs_before_every_timed_call_and_not_before_the_warm_up():
    calls: list = []
    flushes = []

    def flush():
        flushes.append(len(calls))
        calls.append("flush")

    timings = h.time_interleaved(recording_fns(3, calls), CPU, warmup=2, repeats=4, flush=flush)
    assert [len(t.samples_s) for t in timings] == [4, 4, 4]
    warm_up, timed = calls[:6], calls[6:]
    assert "flush" not in warm_up
    assert len(timed) == 2 * 12
    assert all(timed[k] == "flush" and timed[k + 1] != "flush" for k in range(0, len(timed), 2))


def test_fewer_repeats_for_a_slow_callable_keep_the_others_whole():
    calls: list = []
    fns = recording_fns(3, calls)

    def slow():
        time.sleep(0.02)
        calls.append("slow")

    timings = h.time_interleaved(fns + [slow], CPU, warmup=1, repeats=10, max_seconds=0.05, min_repeats=3)
    assert [len(t.samples_s) for t in timings[:3]] == [10, 10, 10]
    assert 3 <= len(timings[3].samples_s) < 10


def test_cache_flush_reads_a_buffer_beyond_the_last_cache_level():
    llc = h.last_level_cache_bytes(CPU)
    assert llc >= 0
    flush = h.CacheFlush(CPU)
    expected = (min(max(4 * llc, h.CacheFlush.MIN_BYTES), h.CacheFlush.MAX_BYTES) if llc > 0
                else h.CacheFlush.UNKNOWN_CACHE_BYTES)
    assert expected - 4 < flush.nbytes <= expected
    assert float(flush()) == flush.x.numel()  # a read of every element (ones)
    assert flush.calls == 1
    assert f"{flush.nbytes / 2**20:.0f} MiB" in flush.describe()
    small = h.CacheFlush(CPU, nbytes=4096)
    assert small.nbytes == 4096


def test_cache_sizes_from_sysfs_and_a_flush_where_none_is_known(monkeypatch):
    assert h.parse_cache_size("32768K\n") == 32 * 2**20
    assert h.parse_cache_size("2M") == 2 * 2**20
    assert h.parse_cache_size("512") == 512
    assert h.parse_cache_size("unknown") == 0
    monkeypatch.setattr(h, "last_level_cache_bytes", lambda device: 0)
    assert h.CacheFlush(CPU).nbytes == h.CacheFlush.UNKNOWN_CACHE_BYTES


def test_the_cpu_last_level_is_counted_once_per_instance(tmp_path):
    # Two CCDs of two cores: an L3 of 32 MiB each, shared within the CCD; private L2 and L1.
    def cache(cpu, index, level, kind, size, shared):
        d = tmp_path / f"cpu{cpu}" / "cache" / f"index{index}"
        d.mkdir(parents=True)
        for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
            (d / name).write_text(f"{value}\n")

    for cpu in range(4):
        cache(cpu, 0, 1, "Data", "48K", cpu)
        cache(cpu, 1, 1, "Instruction", "32K", cpu)
        cache(cpu, 2, 2, "Unified", "1024K", cpu)
        cache(cpu, 3, 3, "Unified", "32768K", "0-1" if cpu < 2 else "2-3")
    assert h.last_level_cache_bytes(CPU, sysfs=tmp_path) == 64 * 2**20
    assert h.last_level_cache_bytes(CPU, sysfs=tmp_path / "absent") == 0


def _parser():
    return h.make_parser("test")


def _fails(capsys, argv, match):
    with pytest.raises(SystemExit) as e:
        h.parse_args(_parser(), repeats={"cpu": 1, "cuda": 1}, warmup={"cpu": 0, "cuda": 0}, argv=argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert match in err, err


def test_bad_arguments_are_refused_before_anything_is_measured(capsys, tmp_path):
    # a --json path that cannot be written once failed after the whole run, its results lost
    _fails(capsys, ["--device", "cpu", "--json", str(tmp_path)], "is a directory")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _fails(capsys, ["--device", "cpu", "--json", str(blocker / "out.json")], "is not a directory")
    _fails(capsys, ["--device", "cpu", "--max-seconds", "0"], "--max-seconds must be > 0")
    args = h.parse_args(_parser(), repeats={"cpu": 1, "cuda": 1}, warmup={"cpu": 0, "cuda": 0},
                        argv=["--device", "cpu", "--json", str(tmp_path / "new" / "out.json")])
    assert args.json.endswith("out.json")  # a parent yet to be made is fine (write_json makes it)


def test_sizes_are_positive_and_make_a_list(capsys):
    assert h.positive_int("7") == 7 and parse_count("2E6") == parse_count("2e6") == 2_000_000
    for bad in ("0", "-5", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            h.positive_int(bad)
    assert len(h.sizes_or_error(_parser(), 5, 100_000, "--tensors")) == 5
    for tensors, total, match in ((2, 10**6, "need at least 3 tensors"), (1000, 2000, "too few")):
        with pytest.raises(SystemExit):
            h.sizes_or_error(_parser(), tensors, total, "--tensors/--params")
        assert match in capsys.readouterr().err
