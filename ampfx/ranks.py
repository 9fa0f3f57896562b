"""Do the ranks of a multi-process run convert a model to the same plan? Checked through the process group's store.

DDP averages gradients each rank computed with its own plan, and FSDP2 gathers each weight in the dtype the plan
reads it in: ranks whose plans differ (converted on example batches of other sizes, so that a GEMM is over the
device's break-even on one rank and under it on another; an ``AMPFX_*`` variable set on one rank only) would train
apart in silence or hang in a gather. So in a run of several processes (``torch.distributed`` initialised, world
size over 1) each :func:`ampfx.convert` publishes its plan (each node's dtype) in the default process group's
store, under the model's fingerprint (its class and its parameters' names and shapes) and the number of conversions
of such a model so far in its process, and each rank other than 0 compares its plan with rank 0's of the same:
a difference raises :class:`ampfx.errors.PlanMismatchError` naming the first node that differs, both dtypes and the
fix. The store is not a collective: rank 0 never waits, and another rank waits at most :data:`WAIT_S` for rank 0's
plan, then says once per model that it could not compare and never waits for that model again (a model only some
ranks convert, as a pipeline stage, costs one wait). Only the ranks that differ raise; a launcher such as
``torchrun`` then stops the others.

Plans made again at a call (a value the graph fixed changed, sizes crossed a break-even) are each rank's own and
are not compared: their numbers are right, and the gradients DDP averages are float32 on every rank.
"""
from __future__ import annotations

import datetime
import hashlib
import json
from typing import Any, Callable

import torch

from .errors import PlanMismatchError, warn_user

WAIT_S = 60.0
"""How long a rank other than 0 waits for rank 0's plan of the same model before it gives up comparing it (rank 0
may convert a large model more slowly)."""

_SEEN: dict[str, int] = {}  # conversions of each model fingerprint so far in this process
_ALONE: set[str] = set()  # fingerprints rank 0 did not plan in time: not waited for again


def fingerprint(model: Any) -> str:
    """The model as the ranks pair their conversions: its class and its parameters' names and shapes, hashed."""
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()] if hasattr(model, "named_parameters") else []
    text = f"{type(model).__module__}.{type(model).__qualname__}|{named}"
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _store() -> Any:
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return dist.distributed_c10d._get_default_store()


def plan_of(records: Any) -> list[list[str]]:
    """A plan as the ranks compare it: ``[module, node, dtype]`` of each decision, in graph order."""
    return [[r.module, r.node, str(r.dtype).replace("torch.", "")] for r in records]


def agree(model: Any, records: Any, say: Callable[[str], None] = warn_user) -> None:
    """In a run of several processes, publish the plan of this conversion of ``model`` (:func:`plan_of` of
    ``records``) and, on a rank other than 0, compare it with rank 0's (see the module docstring). Nothing where
    torch.distributed runs one process or none."""
    store = _store()
    if store is None:
        return
    rank, what, mark = torch.distributed.get_rank(), type(model).__name__, fingerprint(model)
    count = _SEEN[mark] = _SEEN.get(mark, -1) + 1
    key = f"ampfx/plan/{mark}/{count}"
    mine = plan_of(records)
    if rank == 0:
        store.set(key, json.dumps(mine))
        return
    if mark in _ALONE:
        return
    try:
        store.wait([key], datetime.timedelta(seconds=WAIT_S))
        theirs = json.loads(store.get(key))
    except (RuntimeError, ValueError) as e:  # DistStoreError (a RuntimeError): rank 0 made no such conversion
        _ALONE.add(mark)
        say(f"ampfx: rank {rank} could not compare its plan of {what} with rank 0's (rank 0 planned no such model "
            f"within {WAIT_S:.0f} s: {str(e).splitlines()[0][:120]}); not compared again for this model")
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
