"""Arming: the one place a converted graph module's runtime state is written.

Conversion decides; it writes nothing a call reads. :func:`ampfx.rewrite.convert_graph` leaves each graph module
its frozen :class:`~ampfx.runtime.entries.GraphPlan` (where it sits, what its graph fixed, its argument and size
guard, how it reads each parameter; the tree adds how it hands values and its other training mode), the view
binds what the graph fixed to the model's modules, and the last stage of a conversion calls :func:`arm` once per
graph module with the plan and what the conversion made around it: the bound check of fixed values, the
convert-again callable, the structure follower, the weight copies. After that only the runtime's own methods
change its state, as calls ask (:class:`~ampfx.runtime.entries.Runtime`: an entry made, a structure change heard).

>>> import torch, ampfx
>>> amp = ampfx.convert(torch.nn.Linear(4, 2), "bf16", gemm_min_flops=0)
>>> rt = amp.__dict__["_ampfx_runtime"]
>>> rt.plan.where, rt.plan.low, [(u.path, u.how) for u in rt.plan.reads]
('', torch.bfloat16, [('weight', 'cast'), ('bias', 'as_is')])
>>> sorted(ARMED)
['alt', 'check', 'fixed', 'guard', 'linked', 'reconvert', 'weights']
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch.nn as nn

from .entries import CALL_STEPS, GraphPlan, Runtime
from .graph_module import AmpGraphModule

ARMED = frozenset({*(step.field for step in CALL_STEPS), "alt", "reconvert"})
"""What arming sets: each call step (:data:`~ampfx.runtime.entries.CALL_STEPS`) and the two entries' makers. Beside
the plan (whose ``guard`` and ``linked`` are the steps of those names) a conversion gives a graph module the check
of what its graph fixed, bound to the model (``fixed``, :mod:`ampfx.runtime.fixed`), its other training mode as
viewed (``alt``), the convert-again callable (``reconvert``, :class:`ampfx.runtime.view.Reconvert`), the structure
follower (``check``, the root's: :mod:`ampfx.runtime.follow`), and the weight copies (``weights``:
:mod:`ampfx.runtime.weight_cache`, training mode's cache or ``mode="inference"``'s copies)."""


def plan(gm: AmpGraphModule, made: GraphPlan) -> None:
    """Leave ``made`` on ``gm`` until it is armed (the tree replaces it with a new frozen record as it learns how
    the graph hands values and its other training mode)."""
    gm.__dict__["_ampfx_plan"] = made


def amend(gm: AmpGraphModule, **changes: Any) -> None:
    """Replace ``gm``'s plan, not yet armed, with one that differs by ``changes``."""
    gm.__dict__["_ampfx_plan"] = dataclasses.replace(gm.__dict__["_ampfx_plan"], **changes)


def arm(gm: nn.Module, **steps: Any) -> None:
    """Arm ``gm``: the only writer of a converted module's runtime state at conversion. A graph module armed for
    the first time takes its plan (popped from the module, kept as ``Runtime.plan``, its other training mode as
    the entry that waits for it); ``steps`` (:data:`ARMED`) set the call steps and entries; the call then runs the
    steps that are on (:data:`ampfx.runtime.entries.CALL_STEPS`). A module that is no graph module (the model's
    Python around converted children, a :class:`~ampfx.runtime.view.Mirror`) takes only the structure check."""
    unknown = set(steps) - ARMED
    if unknown:
        raise TypeError(f"arm() got {sorted(unknown)}; it arms {sorted(ARMED)}")
    if not isinstance(gm, AmpGraphModule):
        if set(steps) - {"check"}:
            raise TypeError(f"arm(): {type(gm).__name__} is no converted graph module; only its check can be armed")
        object.__setattr__(gm, "_ampfx_check", steps.get("check"))
        return
    rt: Runtime = gm._rt
    made = gm.__dict__.pop("_ampfx_plan", None)
    if made is not None:
        rt.plan = dataclasses.replace(made, other=None)  # the other mode is an entry from now on
        rt.where, rt.arrive, rt.low_dtype = made.where, made.arrive, made.low
        rt.recorded, rt.own_hooks, rt.guard, rt.linked = made.recorded, made.own_hooks, made.guard, made.linked
        if made.other is not None and "alt" not in steps:
            rt.alt = (made.other.mode, made.other)
    for field, value in steps.items():
        setattr(rt, field, value)
    if rt.dispatched():
        gm._install_dispatch()
