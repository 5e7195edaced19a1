"""Running a test body on several gloo ranks (CPU processes), bounded in time.

``run_ranks(body, world, *args)`` spawns ``world`` processes; each initialises a gloo process group
(file rendezvous, a collective timeout well under the test's), calls ``body(rank, world, *args)`` and
sends back its (picklable) result or its traceback. The parent waits at most ``timeout`` seconds in all:
a rank that fails fails the test with its traceback, a rank that hangs is killed and fails the test, and
no process outlives the call. ``body`` must be a module-level function (spawn pickles it by name)."""

from __future__ import annotations

import datetime
import gc
import os
import queue as queue_mod
import tempfile
import time
import traceback

import multiprocessing as mp
import pickle

# The longest a collective may wait for a peer before gloo raises: a rank that raised early (a bad setup
# raising on one rank only would be a bug) turns into an error on the others, not a hang.
COLLECTIVE_TIMEOUT_S = 60


def _entry(body, rank, world, init_file, results, args, backend):
    import torch
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per rank, chosen before NCCL makes its communicator
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        try:
            out = body(rank, world, *args)
        finally:
            # FSDP2's modules hold the process group in reference cycles: collected only at interpreter
            # exit, after gloo's threads can take the GIL, they abort the process now and then. Collect
            # them while the group is alive.
            gc.collect()
            dist.destroy_process_group()
        # by value (plain pickle): torch's queue would share tensors through memory that dies with this process
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(body, world: int, *args, timeout: float = 240.0, backend: str = "gloo") -> list:
    """``body(rank, world, *args)`` on ``world`` ranks (gloo, or ``backend``); returns the results in rank
    order."""
    ctx = mp.get_context("spawn")  # a fresh interpreter per rank: no state forked from pytest
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_entry, args=(body, r, world, init_file, results, args, backend), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        got: dict = {}
        errors: dict = {}
        try:
            while len(got) + len(errors) < world:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    rank, status, value = results.get(timeout=min(left, 1.0))
                except queue_mod.Empty:
                    if all(p.exitcode is not None for p in procs):
                        break  # every rank has exited and nothing more is coming (a rank that crashed)
                    continue
                if status == "ok":
                    got[rank] = pickle.loads(value)
                else:
                    errors[rank] = value
        finally:
            for p in procs:
                p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
    if errors:
        raise AssertionError("\n".join(f"rank {r} failed:\n{tb}" for r, tb in sorted(errors.items())))
    missing = [r for r in range(world) if r not in got]
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        raise AssertionError(f"ranks {missing} did not report within {timeout:.0f} s (still running when killed: "
                             f"{alive}; exit codes {codes})")
    return [got[r] for r in range(world)]
