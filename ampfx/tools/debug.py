"""Overflow hunting: which node first produced inf or NaN, in what dtype, from which inputs.

``ampfx.debug(amp)`` returns a module that runs a converted module's graph
node by node (sharing its parameters) and, at the first node in graph order
whose output holds inf or NaN while its inputs were finite, raises
:class:`NonFiniteError` naming the node, its op and module, its dtype and the
ranges of its inputs. Gradients are watched too: the first node whose output
gradient turns non-finite during ``backward()`` is named the same way.

>>> import torch, ampfx
>>> m = torch.nn.Sequential(torch.nn.Linear(4, 4))
>>> with torch.no_grad():
...     _ = m[0].weight.fill_(3e4)
>>> amp = ampfx.convert(m, "fp16", example_inputs=(torch.ones(2, 4),))
>>> try:
...     ampfx.debug(amp)(torch.ones(2, 4))
... except ampfx.NonFiniteError as e:
...     print(e.node, e.dtype)
linear torch.float16
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from ..errors import NonFiniteError
from ..inputs import ExampleInputs
from ..meta import record
from ..report.records import Decision, dtype_name


def _finite(value: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tree_leaves(value)
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def _ranges(values: list[Any]) -> list[str]:
    out = []
    for v in values:
        for t in tree_leaves(v):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                a = t.detach().abs().float()
                out.append(f"{dtype_name(t.dtype)}{list(t.shape)} max|x|={a.max():.3g}")
    return out


class _Watch(fx.Interpreter):
    def run_node(self, n: fx.Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        out = super().run_node(n)
        d = record(n)
        decision = d if isinstance(d, Decision) else None
        label = dict(op=decision.op if decision else str(n.target), module=decision.module if decision else "",
                     dtype=decision.dtype if decision else None)
        if n.op not in ("placeholder", "output") and not _finite(out) and _finite([args, kwargs]):
            raise NonFiniteError(n.name, label["op"], label["module"], label["dtype"], _ranges([args, kwargs]),
                                 "forward")
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                def hook(g: torch.Tensor, n: fx.Node = n, label: dict = label) -> None:
                    if not _finite(g):
                        raise NonFiniteError(n.name, label["op"], label["module"], g.dtype, _ranges([g]),
                                             "backward (gradient of its output)")
                t.register_hook(hook)
        return out


class Debugged(torch.nn.Module):
    """Runs ``gm`` under watch; shares its parameters (see module docstring)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__()
        self.gm = gm

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _Watch(self.gm).run(*ExampleInputs(args, kwargs).positional(self.gm))


def debug(amp: torch.nn.Module) -> Debugged:
    """Wrap a converted module (the result of :func:`ampfx.convert`) for overflow hunting."""
    if not isinstance(amp, fx.GraphModule):
        raise TypeError(f"ampfx.tools.debug takes a module returned by ampfx.convert that is one graph; got "
                        f"{type(amp).__name__} (converted part by part: debug its GraphModule children)")
    return Debugged(amp)
