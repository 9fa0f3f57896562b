"""Build a small GraphModule and a PassContext, and run a prefix of the pipeline on it.

The pass tests call the passes directly (no ``ampfx.convert``): build a graph
from a tiny function or module with :func:`graph`, then :func:`run` the passes
up to and including the one under test, and read the records with :func:`rec`.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from ampfx import Policy, meta
from ampfx.passes import PIPELINE, PassContext, shapes


def graph(root: Callable | torch.nn.Module | fx.GraphModule) -> fx.GraphModule:
    """A GraphModule of ``root`` (``torch.fx.symbolic_trace``; a GraphModule is returned as is)."""
    return root if isinstance(root, fx.GraphModule) else fx.symbolic_trace(root)


def context(gm: fx.GraphModule, example_inputs: Any = None, *, dtype: torch.dtype = torch.bfloat16,
            dynamic_dims: dict[int, str] | None = None, device: str = "cpu", policy: Policy | None = None,
            **policy_options: Any) -> PassContext:
    """Propagate shapes when ``example_inputs`` are given, then the frozen context the passes share.
    ``policy`` is used as given; otherwise one is built from ``dtype`` and ``policy_options``,
    with device probes off unless asked for (each pass is tested on its own)."""
    if policy is None:
        policy_options.setdefault("probe", False)
        policy = Policy(dtype, **policy_options)
    symbols = None
    if example_inputs is not None:
        _, _, symbols = shapes.propagate(gm, example_inputs, dynamic_dims)
    return PassContext(policy, device=device, symbols=symbols)


def run(root: Callable | torch.nn.Module | fx.GraphModule, example_inputs: Any = None, *,
        upto: Callable | None = None, **options: Any) -> tuple[fx.GraphModule, PassContext]:
    """Trace ``root``, build its context (:func:`context` options) and run the
    pipeline up to and including the pass ``upto`` (default: all of it).
    After a pass that rewrites the graph the module is linted and recompiled."""
    gm = graph(root)
    ctx = context(gm, example_inputs, **options)
    run_passes(gm, ctx, upto)
    return gm, ctx


def run_passes(gm: fx.GraphModule, ctx: PassContext, upto: Callable | None = None,
               start: Callable | None = None) -> None:
    """Run the pipeline's passes from ``start`` through ``upto`` on ``gm``."""
    first = PIPELINE.index(start) if start is not None else 0
    last = PIPELINE.index(upto) if upto is not None else len(PIPELINE) - 1
    for pass_ in PIPELINE[first:last + 1]:
        pass_(gm, ctx)
    gm.graph.lint()
    gm.recompile()


def node(gm: fx.GraphModule, name: str) -> fx.Node:
    """The node called ``name``."""
    for n in gm.graph.nodes:
        if n.name == name:
            return n
    raise KeyError(f"no node {name!r}; nodes: {[n.name for n in gm.graph.nodes]}")


def rec(gm: fx.GraphModule, name: str) -> Any:
    """The record (Decision or CastInfo) of the node called ``name``."""
    return meta.decision(node(gm, name))


def calls(gm: fx.GraphModule, target: Any) -> list[fx.Node]:
    """The ``call_function`` nodes calling ``target``, in graph order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


class Weights(nn.Module):
    """``fn(self, x)`` with 4x4 weights ``w`` and ``v`` and a bias ``b``."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.w, self.v = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
        self.b = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return self.fn(self, x)
