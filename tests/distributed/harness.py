"""Run a function on 2 CPU ranks with gloo, each collective and each wait bounded.

:func:`run` spawns the ranks (``torch.multiprocessing``, spawn), gives every rank a process
group whose collectives time out (``init_process_group(timeout=...)``), reads each rank's
result from a queue with a deadline, and joins with a deadline: a rank that raises fails the
test with its traceback, and a rank that hangs fails it when the deadline passes, instead of
hanging CI.
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


class RankFailed(AssertionError):
    """A rank raised (its traceback is the message), or hung past the deadline."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, results: Any, timeout: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from ampfx.ops import device_cost, gemm_cost  # tiny models: every GEMM low, as the tests' conftest has it
    gemm_cost.BREAK_EVEN.clear()
    device_cost.measure_on(())  # and nothing measured
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        # plain pickle: tensors by value (a queue would share their storage, gone when the rank exits)
        results.put((rank, True, pickle.dumps(fn(rank, world, *args))))
    except BaseException:  # noqa: BLE001 - sent to the test, which fails with it
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(fn: Callable, *args: Any, world: int = 2, deadline: float = 240.0,
        collective_timeout: float = COLLECTIVE_TIMEOUT.total_seconds()) -> list[Any]:
    """``[fn(rank, world, *args) for each rank]``, run in ``world`` processes; :class:`RankFailed`
    when a rank raises or the results are not all in within ``deadline`` seconds."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, results, collective_timeout), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    end = time.monotonic() + deadline
    try:
        while len(got) < world:
            try:  # a second at a time: a rank that dies before it can answer (an import error) fails this at once
                rank, ok, value = results.get(timeout=max(0.1, min(1.0, end - time.monotonic())))
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
                if dead:
                    raise RankFailed(f"ranks {dead} (rank, exit code) exited without a result (their stderr is "
                                     "above)") from None
                if time.monotonic() < end:
                    continue
                raise RankFailed(f"ranks {sorted(set(range(world)) - set(got))} gave no result within {deadline:.0f} s "
                                 "(hung in a collective?)") from None
            if not ok:
                raise RankFailed(f"rank {rank} raised:\n{value}")
            got[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=max(1.0, end - time.monotonic()) if len(got) == world else 1.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return [got[r] for r in range(world)]
