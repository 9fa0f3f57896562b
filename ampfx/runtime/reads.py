"""How a converted graph reads each parameter: the one scan of a graph for the dtypes its parameters are read in.

The planner scans each converted graph once (:func:`scan`: the table its :class:`~ampfx.runtime.entries.GraphPlan`
keeps). Three things read that table, with the parameters the graph module holds then (:func:`reads`): the weight cache (:mod:`ampfx.runtime.weight_cache`: the parameters cast to
the low dtype, and how many times a call), the copies of ``mode="inference"`` (:mod:`ampfx.runtime.inference`: the
parameters every read of which is a cast to the low dtype) and FSDP2's gather dtype
(:mod:`ampfx.integrations.fsdp`: per parameter, low only where every read is): one :class:`Read` per use.

>>> import torch, ampfx
>>> amp = ampfx.convert(torch.nn.Linear(4, 2), "bf16", gemm_min_flops=0, weight_cache=False)
>>> [(r.path, r.how, r.dtype, r.by) for r in reads(amp, torch.bfloat16)]   # the bias is added in float32
[('weight', 'cast', torch.bfloat16, 'linear'), ('bias', 'as_is', None, 'add')]
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn as nn
from torch.nn.utils import parametrize

from .. import runtime
from .entries import plan_of
from .graph_module import AmpGraphModule

HOW = ("cast", "cast_pad", "module_low", "module_float32", "module", "as_is", "unused")
"""How a read takes a parameter: a :func:`ampfx.runtime.cast` or :func:`ampfx.runtime.cast_pad` of its
``get_attr`` (to :attr:`Read.dtype`); a module the graph reads as a whole run in the low dtype
(:func:`ampfx.runtime.call_module_low`, its parametrized modules aside) or kept float32; a module's own forward
(``call_module``, or a whole module read otherwise); any other use of its ``get_attr``; a ``get_attr`` nothing uses."""


@dataclass(frozen=True, eq=False)
class Read:
    """One use of ``param`` by the graph: ``how`` (:data:`HOW`) and the ``dtype`` it gives (``None``: as it is);
    ``path``: the ``get_attr`` (or module) target; ``owner`` / ``name``: the parameter dict the graph reads it from and
    its key there (``None`` for a module's reads); ``by``: what reads it, in words."""

    param: nn.Parameter
    path: str
    how: str
    dtype: torch.dtype | None
    by: str
    owner: dict | None = None
    name: str = ""

    def takes(self, low: torch.dtype) -> bool:
        """Does this read take the parameter in ``low`` whole (a cast to it, or a module run in it; a padded cast
        reads a larger tensor)? A parameter every read of which does is read in ``low`` (FSDP2 gathers it so,
        :attr:`ampfx.Plan.reads` says so)."""
        return self.how in ("cast", "module_low") and self.dtype == low


@dataclass(frozen=True)
class Use:
    """One row of a graph's table of parameter reads (:attr:`ampfx.runtime.entries.GraphPlan.reads`): the
    ``get_attr`` or module ``path`` read, ``how`` (:data:`HOW`), the ``dtype`` it gives, ``by`` what, in words;
    ``module``: ``path`` names a module whose own parameters (:func:`own`) are read so."""

    path: str
    how: str
    dtype: torch.dtype | None
    by: str
    module: bool = False


def scan(gm: fx.GraphModule, low: torch.dtype) -> tuple[Use, ...]:
    """The table of every use of a parameter in ``gm``'s graph, in graph order (a converted module the graph calls
    reads its own, in its own graph: none of those); ``low``: the conversion's low dtype (a module run low is read
    in it). The planner's (:func:`ampfx.rewrite.convert_graph`): it scans the finished graph once."""
    return tuple(_uses(gm, low))


def reads(gm: fx.GraphModule, low: torch.dtype) -> list[Read]:
    """Every use of a parameter in ``gm``'s graph, in graph order, read from its plan's table
    (:attr:`ampfx.runtime.entries.GraphPlan.reads`) with the parameters ``gm`` holds now; a graph module with no
    plan (loaded from a pickle made before plans held one) is scanned."""
    plan = plan_of(gm)
    table = plan.reads if plan is not None else scan(gm, low)
    out = []
    for use in table:
        try:
            value = operator.attrgetter(use.path)(gm)
        except AttributeError:  # no longer there (a module replaced since): its graph is converted again
            continue
        if use.module:
            out += [Read(p, use.path, use.how, use.dtype, use.by) for p in own(value)]
        elif isinstance(value, nn.Parameter):
            owner_path, _, leaf = use.path.rpartition(".")
            holder = gm.get_submodule(owner_path) if owner_path else gm
            owner = holder._parameters if holder._parameters.get(leaf) is value else None
            out.append(Read(value, use.path, use.how, use.dtype, use.by, owner, leaf))
    return out


def _uses(gm: fx.GraphModule, low: torch.dtype) -> Iterator[Use]:
    for node in gm.graph.nodes:
        if node.op == "call_module":
            yield Use(str(node.target), "module", None, f"{node.target}'s own forward", module=True)
        if node.op != "get_attr":
            continue
        target = str(node.target)
        try:
            value = operator.attrgetter(target)(gm)
        except AttributeError:  # a constant the graph holds outside the module tree (a generator the model owns)
            continue
        if isinstance(value, nn.Parameter):
            if not node.users:
                yield Use(target, "unused", None, "nothing")
            for user in node.users:
                how = {runtime.cast: "cast", runtime.cast_pad: "cast_pad"}.get(user.target, "as_is") \
                    if user.op == "call_function" and user.args[0] is node else "as_is"
                if how == "as_is":
                    yield Use(target, how, None, users_of(user))
                else:
                    yield Use(target, how, user.args[1], users(user))
        elif isinstance(value, nn.Module):
            for user in node.users:
                if user.target is runtime.call_module_low and not any(parametrize.is_parametrized(m)
                                                                         for m in value.modules()):
                    how, dtype, by = "module_low", user.args[1], f"{target} run in {_name(user.args[1])}"
                elif user.target is runtime.call_module_float32:
                    how, dtype, by = "module_float32", torch.float32, f"{target} (kept float32)"
                elif user.target is runtime.call_module_low:
                    how, dtype, by = "module_float32", torch.float32, f"{target}'s parametrization"
                else:
                    how, dtype, by = "module", None, f"{target}'s own forward"
                yield Use(target, how, dtype, by, module=True)


def own(module: nn.Module) -> Iterator[nn.Parameter]:
    """The parameters ``module``'s own Python reads: those of its tree but of the converted modules in it (each
    reads its own in its graph)."""
    if isinstance(module, AmpGraphModule):
        return
    yield from module.parameters(recurse=False)
    for child in module.children():
        yield from own(child)


def users_of(node: fx.Node) -> str:
    """A node, as a reason names it: its function's name, else its own."""
    return getattr(node.target, "__name__", str(node.target)) if node.op == "call_function" else node.name


def users(node: fx.Node) -> str:
    """What uses ``node``, as a reason names it."""
    return ", ".join(sorted({users_of(u) for u in node.users})) or "nothing"


def _name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")
