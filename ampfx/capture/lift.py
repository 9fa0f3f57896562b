"""Float attributes a traced forward passes straight to ops are read at every call, not fixed.

``x / self.temperature``, ``drop_path(x, self.drop_prob, ...)``, ``F.layer_norm(..., eps=self.eps)``:
torch.fx records the float's value in the graph, and a schedule that changes it after conversion
would need a new conversion each time (:mod:`ampfx.runtime.fixed` notices the change). While
:class:`Lifting` is active (around one ``torch.fx`` trace), every read of a float attribute of a
module of the traced tree (outside torch) that the low dtype can hold returns a :class:`Tagged` float (a ``float`` that remembers where it was
read and notices any Python use of it: arithmetic, comparisons, ``bool``, formatting).
:meth:`Lifting.arg` turns a tagged float that reaches the graph as an argument into a ``get_attr``
node reading the attribute at call time. An attribute is *lifted* when every read of it reached
the graph that way and none was used in Python (where its value would have decided a branch or
been folded into another constant); lifted attributes need no guard. Every other read stays a
constant in the graph, and :mod:`ampfx.runtime.fixed` guards it.

>>> import torch, torch.nn as nn, torch.fx as fx
>>> class Scaled(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.t, self.p = 2.0, 0.5
...     def forward(self, x):
...         keep = 1 - self.p          # used in Python: fixed (and guarded)
...         return x / self.t * keep  # passed to the op: read at every call
>>> from ampfx.capture.tracer import AmpTracer
>>> tracer = AmpTracer()
>>> graph = tracer.trace(Scaled())
>>> sorted(tracer.lifting.lifted()), [n.target for n in graph.nodes if n.op == "get_attr"]
([('', 't')], ['t'])
"""
from __future__ import annotations

import threading
from typing import Any

import torch.fx as fx
import torch.nn as nn

from .draws import DrawnFloat

_ORIGINAL = nn.Module.__getattribute__


class Tagged(float):
    """A float read from a module attribute while tracing; ``_ampfx_lifting`` is told of any Python use."""

    _ampfx_where: tuple[str, str]
    _ampfx_lifting: Lifting

    def _used(self) -> None:
        self._ampfx_lifting.used.add(self._ampfx_where)


def _noting(name: str) -> Any:
    method = getattr(float, name)

    def use(self: Tagged, *args: Any) -> Any:
        self._used()
        if any(isinstance(a, DrawnFloat) for a in args):
            return NotImplemented  # the draw's own method answers (float's would read the draw as NaN)
        return method(self, *args)
    use.__name__ = name
    return use


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
              "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__", "__rpow__", "__divmod__",
              "__rdivmod__", "__neg__", "__pos__", "__abs__", "__bool__", "__int__", "__trunc__", "__floor__",
              "__ceil__", "__round__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__",
              "__format__", "__str__", "__repr__", "__float__", "__index__", "as_integer_ratio", "is_integer",
              "hex", "conjugate", "__getnewargs__", "__reduce__", "__reduce_ex__"):
    if hasattr(float, _name):
        setattr(Tagged, _name, _noting(_name))


class Lifting:
    """Tags the float attributes of ``root``'s modules while active (see the module docstring)."""

    def __init__(self, root: nn.Module, largest: float = float("inf")) -> None:
        # torch's own modules keep their constants in the graph (their eps, momentum, dropout rate), guarded
        modules = list(root.named_modules(remove_duplicate=False))
        self.every = {id(m): path for path, m in modules}
        self.paths = {id(m): path for path, m in modules if not type(m).__module__.startswith("torch.")}
        self.seen: set[tuple[str, str]] = set()  # every plain attribute the traced code read, by module path
        self.largest = largest  # a float the low dtype cannot hold stays a constant (ops are kept float32 for it)
        self.reads: dict[tuple[str, str], list[Tagged]] = {}
        self.passed: set[int] = set()  # ids of tagged reads that reached the graph
        self.used: set[tuple[str, str]] = set()

    def __enter__(self) -> Lifting:
        paths, every, reads, seen, lifting = self.paths, self.every, self.reads, self.seen, self
        thread = threading.get_ident()  # reads in other threads are theirs (ampfx.threads)

        def getattribute(module: nn.Module, name: str) -> Any:
            value = _ORIGINAL(module, name)
            if name[0] == "_" or name == "training" or type(value) not in _PLAIN:
                return value
            where = every.get(id(module))
            if where is None or name not in _ORIGINAL(module, "__dict__") or threading.get_ident() != thread:
                return value
            if type(value) is float and -lifting.largest <= value <= lifting.largest and id(module) in paths:
                tagged = Tagged(value)
                tagged._ampfx_where, tagged._ampfx_lifting = (where, name), lifting
                reads.setdefault((where, name), []).append(tagged)
                return tagged
            seen.add((where, name))
            return value

        nn.Module.__getattribute__ = getattribute
        return self

    def __exit__(self, *exc: Any) -> None:
        nn.Module.__getattribute__ = _ORIGINAL

    def arg(self, tracer: fx.Tracer, value: Tagged) -> fx.Node:
        """The ``get_attr`` node reading ``value``'s attribute at call time (one per attribute)."""
        self.passed.add(id(value))
        path, name = value._ampfx_where
        target = f"{path}.{name}" if path else name
        nodes = tracer.__dict__.setdefault("_ampfx_lifted", {})
        if target not in nodes:
            nodes[target] = tracer.create_node("get_attr", target, (), {})
        return nodes[target]

    def fixed(self) -> frozenset[tuple[str, str]]:
        """``(module path, attribute)`` of the float attributes read and not lifted: constants of the graph,
        guarded whatever code read them (a helper the forward's bytecode does not name)."""
        return frozenset(self.reads) - self.lifted()

    def lifted(self) -> frozenset[tuple[str, str]]:
        """``(module path, attribute)`` of the attributes read at call time only (no guard needed)."""
        return frozenset(where for where, tags in self.reads.items()
                         if where not in self.used and all(id(t) in self.passed for t in tags))


_PLAIN = (float, int, bool, str, type(None), tuple)
"""The values whose reads :class:`Lifting` notes (a float may be lifted; the rest are constants of the graph)."""
