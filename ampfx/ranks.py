"""Do the ranks of a multi-process run convert a model to the same plan? Checked through the process group's store.

DDP averages gradients each rank computed with its own plan, and FSDP2 gathers each weight in the dtype the plan
reads it in: ranks whose plans differ (converted on example batches of other sizes, so that a GEMM is over the
device's break-even on one rank and under it on another; an ``AMPFX_*`` variable set on one rank only) would train
apart in silence or hang in a gather. So in a run of several processes (``torch.distributed`` initialised, world
size over 1) each :func:`ampfx.convert` publishes its plan (each node's dtype) in the default process group's
store, under the number of the conversion in its process, and each rank other than 0 compares its plan with rank
0's: a difference raises :class:`ampfx.errors.PlanMismatchError` naming the first node that differs, both dtypes
and the fix. The store is not a collective: rank 0 never waits, and another rank waits at most :data:`WAIT_S` for
rank 0's plan, then says once that it could not compare (a rank that converts alone never hangs).

Plans made again at a call (a value the graph fixed changed, sizes crossed a break-even) are each rank's own and
are not compared: their numbers are right, and the gradients DDP averages are float32 on every rank.
"""
from __future__ import annotations

import datetime
import itertools
import json
from typing import Any, Callable

import torch

from .errors import PlanMismatchError, warn_user

WAIT_S = 180.0
"""How long a rank other than 0 waits for rank 0's plan of the same conversion before it gives up comparing (rank 0
may convert a large model more slowly)."""

_NUMBERS = itertools.count()  # conversions compared in this process, in order (the same order on every rank)


def _store() -> Any:
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return dist.distributed_c10d._get_default_store()


def plan_of(records: Any) -> list[list[str]]:
    """A plan as the ranks compare it: ``[module, node, dtype]`` of each decision, in graph order."""
    return [[r.module, r.node, str(r.dtype).replace("torch.", "")] for r in records]


def agree(records: Any, what: str, say: Callable[[str], None] = warn_user) -> None:
    """In a run of several processes, publish this conversion's plan (:func:`plan_of` of ``records``) and, on a rank
    other than 0, compare it with rank 0's (see the module docstring); ``what`` names the model in messages. Nothing
    where torch.distributed runs one process or none."""
    store = _store()
    if store is None:
        return
    rank = torch.distributed.get_rank()
    key = f"ampfx/plan/{next(_NUMBERS)}"
    mine = plan_of(records)
    if rank == 0:
        store.set(key, json.dumps(mine))
        return
    try:
        store.wait([key], datetime.timedelta(seconds=WAIT_S))
        theirs = json.loads(store.get(key))
    except (RuntimeError, ValueError) as e:  # DistStoreError (a RuntimeError): rank 0 made no such conversion
        say(f"ampfx: rank {rank} could not compare its plan of {what} with rank 0's (none came within {WAIT_S:.0f} "
            f"s: {str(e).splitlines()[0][:120]}); convert the model on every rank, in the same order")
        return
    if theirs != mine:
        raise PlanMismatchError(_difference(mine, theirs, rank, what))


def _difference(mine: list, theirs: list, rank: int, what: str) -> str:
    """The message of a :class:`PlanMismatchError`: the first node whose dtype differs (or the first that only one
    rank's plan has)."""
    fix = ("give every rank example inputs of the same sizes (the size decisions follow them) and the same policy "
           "and AMPFX_* variables; or fix the GEMM break-even with gemm_min_flops / gemm_min_rows")
    for m, t in zip(mine, theirs):
        if m != t:
            if m[:2] == t[:2]:
                return (f"rank {rank} converted {what} to another plan than rank 0: node {m[1]!r} (module "
                        f"{m[0] or '<root>'!r}) runs in {m[2]} on rank {rank}, in {t[2]} on rank 0; {fix}")
            return (f"rank {rank} converted {what} to another graph than rank 0: node {m[1]!r} on rank {rank} where "
                    f"rank 0 has {t[1]!r}; {fix}")
    return (f"rank {rank} converted {what} to a plan of {len(mine)} nodes, rank 0 to one of {len(theirs)}; {fix}")
