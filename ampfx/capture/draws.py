"""Random draws a traced forward makes, and the ones its graph may keep.

A forward that draws a number and branches on it (layerdrop,
``if self.training and torch.rand(()) < self.layerdrop: continue``) cannot be one graph: the graph
would take the branch of the draw made while tracing on every call. But where the comparison gives
the same answer for every value the draw can take (``layerdrop = 0.0``: ``rand < 0.0`` is never
true; ``rand > 1.0`` neither), the branch depends on the attribute alone, which the graph fixes as
it fixes any attribute its code reads (:mod:`ampfx.runtime.fixed` checks it at every call, and a
change converts again).

While :class:`Drawing` is active (around one torch.fx trace), a draw of one number,

- ``torch.rand(())`` (any size of one element; concrete arguments, no ``generator`` or ``out``):
  values in [0, 1), returned as a :class:`DrawnTensor`;
- Python's ``random.random()`` and ``random.uniform(a, b)``, numpy's ``np.random.rand()``,
  ``random()``, ``random_sample()``, ``ranf()``, ``sample()`` and ``uniform(low, high)`` without a
  size, returning a :class:`DrawnFloat`

(each looked up on its module at the call, as ``torch.rand(())`` and ``random.uniform(0, 1)`` are),

is a :class:`Draw` that knows its range. A comparison of a draw with a Python number whose answer
is the same over that range returns that answer (a bool tensor for a tensor draw); ``.item()`` and
``float()`` of a tensor draw give a :class:`DrawnFloat` of the same draw. Any other use (arithmetic,
``bool``, a comparison that could go either way, a draw reaching the graph as a constant) makes the
draw *free*, and a trace with a free draw is not used (:attr:`Drawing.free`). A tensor draw stays in
the graph as its own ``torch.rand`` call, its value unused: the graph draws what the model draws, so
the dropout masks after it are the model's. The graph does not draw from Python's or numpy's
generators (a layer skip cannot depend on their draws; other users of those generators see a
different sequence than under the model's own Python).

Every draw seen here runs with its generator's state put back, so a draw from anything else
(``from random import random``, ``torch.rand(8) < p``, ``torch.empty(1).uniform_()``) still changes
a generator's state, and the ladder rejects that trace as before
(:func:`ampfx.state.kept_random`). A :class:`DrawnFloat` holds NaN as its C-level value: code that
reads it without Python's methods (``torch.tensor(draw)``, ``math.log(draw)``) gets NaN, never a
plausible number.

>>> import torch, torch.nn as nn
>>> from ampfx.capture.tracer import AmpTracer
>>> class Skip(nn.Module):
...     def __init__(self, p):
...         super().__init__()
...         self.fc, self.layerdrop = nn.Linear(2, 2), p
...     def forward(self, x):
...         if torch.rand(()) < self.layerdrop:
...             return x
...         return self.fc(x)
>>> tracer = AmpTracer()
>>> graph = tracer.trace(Skip(0.0))
>>> tracer.drawing.free, [n.target.__name__ for n in graph.nodes if n.op == "call_function"]
((), ['rand', 'linear'])
>>> tracer = AmpTracer()
>>> _ = tracer.trace(Skip(0.5))
>>> print(*tracer.drawing.free)
torch.rand at the root module: compared with 0.5, which a draw in [0, 1) may be on either side of
"""
from __future__ import annotations

import contextlib
import math
import operator
import random
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves, tree_map

_COMPARISONS: dict[Any, str] = {}
for _name in ("lt", "le", "gt", "ge", "eq", "ne"):
    for _fn in (getattr(torch.Tensor, _name), getattr(torch.Tensor, f"__{_name}__"), getattr(torch, _name)):
        _COMPARISONS[_fn] = _name
for _alias, _name in (("less", "lt"), ("less_equal", "le"), ("greater", "gt"), ("greater_equal", "ge"),
                      ("not_equal", "ne")):
    for _owner in (torch.Tensor, torch):
        if hasattr(_owner, _alias):
            _COMPARISONS[getattr(_owner, _alias)] = _name
_FLIPPED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}
_TO_FLOAT = (torch.Tensor.item, torch.Tensor.__float__)
_NUMPY_UNIT = ("rand", "random", "random_sample", "ranf", "sample")
"""numpy.random's draws in [0, 1) (without arguments: one float)."""


@dataclass(eq=False)
class Draw:
    """One number drawn while tracing: where, by what, and the values it can take (``[lo, hi)``, or
    ``[lo, hi]`` when ``closed``)."""

    what: str
    where: str
    lo: float = 0.0
    hi: float = 1.0
    closed: bool = False
    tensor: torch.Tensor | None = None  # a tensor draw's plain value

    def answer(self, op: str, p: float) -> bool | None:
        """``draw <op> p`` for every value the draw can take, or ``None`` where it depends on the value.

        >>> d = Draw("torch.rand", "")
        >>> d.answer("lt", 0.0), d.answer("gt", 1.0), d.answer("ge", 0.0), d.answer("lt", 0.5)
        (False, False, True, None)
        """
        below = self.hi < p or (self.hi == p and not self.closed)  # every value < p
        at_most = self.hi <= p  # every value <= p
        never_eq = p < self.lo or p > self.hi or (p == self.hi and not self.closed)
        known = {"lt": (True if below else False if self.lo >= p else None),
                 "le": (True if at_most else False if self.lo > p else None),
                 "gt": (True if self.lo > p else False if at_most else None),
                 "ge": (True if self.lo >= p else False if below else None),
                 "eq": (False if never_eq else None),
                 "ne": (True if never_eq else None)}
        return known[op]

    def describe(self) -> str:
        return f"{self.what} at {repr(self.where) if self.where else 'the root module'}"

    def span(self) -> str:
        return f"[{self.lo:g}, {self.hi:g}{']' if self.closed else ')'}"


def _number(value: Any) -> float | None:
    """``value`` as a float if it is a Python number that is not itself a draw (a module's float
    attribute, tagged for lifting, counts: reading it notes that the code used its value)."""
    if isinstance(value, bool) or (isinstance(value, (int, float)) and not isinstance(value, DrawnFloat)):
        return float(value)
    return None


class Drawing:
    """Draws seen while one torch.fx trace runs (see the module docstring). ``free``: one line per
    draw the trace's Python used in a way a graph cannot keep; ``kept``: the draws whose comparisons
    all had one answer."""

    def __init__(self, tracer: fx.Tracer) -> None:
        self.tracer = tracer
        self.draws: list[Draw] = []
        self.free: tuple[str, ...] = ()
        self._patched: list[tuple[Any, str, Any]] = []
        self.thread: int | None = None  # the thread whose draws are seen (set by __enter__)

    def __enter__(self) -> Drawing:
        self.thread = threading.get_ident()  # draws in other threads are theirs (ampfx.threads)
        homes = [(random, ("random",), "uniform")]
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            homes.append((numpy.random, _NUMPY_UNIT, "uniform"))
        with contextlib.ExitStack() as undo:  # a patch that fails undoes those made before it
            undo.callback(self._unpatch)
            self._patch(torch, "rand", self._torch_draw)
            for home, units, between in homes:
                for name in (*units, between):
                    original = getattr(home, name, None)
                    if original is not None:
                        self._patch(home, name, self._python_draw(home, name, original, name == between))
            undo.pop_all()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._unpatch()

    def _patch(self, home: Any, name: str, value: Any) -> None:
        self._patched.append((home, name, getattr(home, name)))
        setattr(home, name, value)

    def _unpatch(self) -> None:
        for home, name, original in reversed(self._patched):
            setattr(home, name, original)
        self._patched.clear()

    def note_free(self, draw: Draw, why: str) -> None:
        line = f"{draw.describe()}: {why}"
        if line not in self.free:
            self.free = (*self.free, line)

    def passed(self, value: Any) -> None:
        """``value`` reaches the graph as a constant (``tracer.create_arg``): a draw there is free."""
        if isinstance(value, (DrawnFloat, DrawnTensor)):
            self.note_free(value._ampfx_draw, "its value reaches the graph as a constant")

    def _where(self) -> str:
        where = getattr(self.tracer, "_current_path", None)
        return where() if callable(where) else ""

    # ------------------------------------------------------------------ torch
    def _torch_draw(self, *args: Any, **kwargs: Any) -> Any:
        """``torch.rand``: one element drawn with concrete arguments becomes a :class:`DrawnTensor` and a node."""
        original = next(o for h, n, o in self._patched if h is torch and n == "rand")
        concrete = not any(isinstance(a, fx.Proxy) for a in tree_leaves((args, kwargs)))
        if not concrete or {"generator", "out", "names"} & kwargs.keys() or threading.get_ident() != self.thread:
            return original(*args, **kwargs)
        device = torch.device(kwargs.get("device") or "cpu")
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
            value = original(*args, **kwargs)
        if value.numel() != 1:
            return original(*args, **kwargs)  # a draw of many numbers: not ours (the ladder sees it drew)
        draw = Draw("torch.rand", self._where(), tensor=value)
        self.draws.append(draw)
        self.tracer.create_proxy("call_function", original, args, kwargs)  # the graph draws it too
        return DrawnTensor.of(value, draw, self)

    def _compare(self, draw: Draw, op: str, other: Any) -> bool | None:
        p = _number(other)
        answer = draw.answer(op, p) if p is not None else None
        if answer is None:
            self.note_free(draw, f"compared with {other!r}, which a draw in {draw.span()} may be on either side of"
                           if p is not None else f"compared with a {type(other).__name__}")
        return answer

    # ------------------------------------------------------------------ Python and numpy
    def _python_draw(self, home: Any, name: str, original: Callable, between: bool) -> Callable:
        label = f"{getattr(home, '__name__', 'random')}.{name}"

        def draw(*args: Any, **kwargs: Any) -> Any:
            bounds = _bounds(args, kwargs) if between else (0.0, 1.0, False) if not args and not kwargs else None
            if bounds is None or threading.get_ident() != self.thread:
                return original(*args, **kwargs)
            with _kept_state(home):
                value = original(*args, **kwargs)
            if not isinstance(value, float):
                return value
            lo, hi, closed = bounds
            d = Draw(label, self._where(), lo, hi, closed)
            self.draws.append(d)
            return DrawnFloat.of(value, d, self)
        return draw

    @property
    def kept(self) -> tuple[Draw, ...]:
        return tuple(self.draws) if not self.free else ()


def _bounds(args: tuple, kwargs: dict) -> tuple[float, float, bool] | None:
    """``uniform(a, b)``'s range from Python numbers (``low=0.0, high=1.0`` by default: numpy's
    keywords), else ``None``. Rounding may give ``b`` itself: the range is closed."""
    names = ("low", "high") if "low" in kwargs or "high" in kwargs else ("a", "b")
    if len(args) > 2 or set(kwargs) - set(names):
        return None
    values = [*args, *(kwargs[n] for n in names[len(args):] if n in kwargs)]
    values += [0.0, 1.0][len(values):]
    a, b = (_number(v) for v in values)
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return None
    return min(a, b), max(a, b), True


@contextlib.contextmanager
def _kept_state(home: Any) -> Iterator[None]:
    """``home``'s generator (Python's ``random`` or ``numpy.random``) put back after the block."""
    state = home.getstate() if home is random else home.get_state()
    try:
        yield
    finally:
        (home.setstate if home is random else home.set_state)(state)


class DrawnTensor(torch.Tensor):
    """A tensor drawn while tracing (see the module docstring): a comparison with one answer over the draw's
    range gives that answer as a bool tensor, ``.item()`` and ``float()`` a :class:`DrawnFloat`; any other
    use frees the draw and runs on the plain tensor."""

    _ampfx_draw: Draw
    _ampfx_drawing: Drawing

    @classmethod
    def of(cls, value: torch.Tensor, draw: Draw, drawing: Drawing) -> DrawnTensor:
        with torch._C.DisableTorchFunctionSubclass():
            out = value.as_subclass(cls)
        out._ampfx_draw, out._ampfx_drawing = draw, drawing
        return out

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        drawn = [a for a in tree_leaves((args, kwargs)) if isinstance(a, DrawnTensor)]
        first = drawn[0]
        draw, drawing = first._ampfx_draw, first._ampfx_drawing
        plain = tree_map(lambda a: a._ampfx_draw.tensor if isinstance(a, DrawnTensor) else a, (args, kwargs))
        if func in _TO_FLOAT and len(args) == 1 and not kwargs:
            return DrawnFloat.of(func(*plain[0]), draw, drawing)
        op = _COMPARISONS.get(func)
        if op is not None and len(drawn) == 1 and len(args) == 2 and not kwargs:
            other, flip = (args[1], False) if args[0] is first else (args[0], True)
            answer = drawing._compare(draw, _FLIPPED[op] if flip else op, other)
            if answer is not None:
                return torch.full(draw.tensor.shape, answer, dtype=torch.bool, device=draw.tensor.device)
        else:
            for d in dict.fromkeys(a._ampfx_draw for a in drawn):
                drawing.note_free(d, f"used by {getattr(func, '__name__', func)}, not only compared")
        return func(*plain[0], **plain[1])


class DrawnFloat(float):
    """A Python number drawn while tracing (see the module docstring): NaN to C code, its drawn value to
    Python's methods; a comparison with one answer over the draw's range gives that answer, any other
    use frees the draw."""

    _ampfx_value: float
    _ampfx_draw: Draw
    _ampfx_drawing: Drawing

    @classmethod
    def of(cls, value: float, draw: Draw, drawing: Drawing) -> DrawnFloat:
        out = super().__new__(cls, math.nan)
        out._ampfx_value, out._ampfx_draw, out._ampfx_drawing = float(value), draw, drawing
        return out


def _comparing(op: str) -> Callable:
    compare = getattr(operator, op)

    def method(self: DrawnFloat, other: Any) -> Any:
        answer = self._ampfx_drawing._compare(self._ampfx_draw, op, other)
        return answer if answer is not None else compare(self._ampfx_value, other)
    method.__name__ = f"__{op}__"
    return method


def _freeing(name: str) -> Callable:
    def method(self: DrawnFloat, *args: Any) -> Any:
        self._ampfx_drawing.note_free(self._ampfx_draw, f"used by {name}, not only compared")
        plain = [a._ampfx_value if isinstance(a, DrawnFloat) else a for a in args]
        return getattr(self._ampfx_value, name)(*plain)
    method.__name__ = name
    return method


for _op in _FLIPPED:
    setattr(DrawnFloat, f"__{_op}__", _comparing(_op))
for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
              "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__", "__rpow__", "__divmod__",
              "__rdivmod__", "__neg__", "__pos__", "__abs__", "__bool__", "__int__", "__trunc__", "__floor__",
              "__ceil__", "__round__", "__hash__", "__format__", "__str__", "__repr__", "__float__", "__index__",
              "as_integer_ratio", "is_integer", "hex", "conjugate", "__getnewargs__", "__reduce__", "__reduce_ex__"):
    if hasattr(float, _name):
        setattr(DrawnFloat, _name, _freeing(_name))
