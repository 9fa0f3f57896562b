"""Call-time guards: a converted module checks every call against what it was converted for.

A captured graph is specialised to its example inputs in ways its outputs on those
inputs cannot show: ``torch.export`` flattens the inputs with the example's pytree
structure (list lengths, dict keys), bakes Python values (``n=3``) into the graph and
fixes the sizes the model's Python depends on (``if x.shape[0] > 4`` keeps batch sizes
5 and up); ``torch.fx`` fixes optional arguments at their defaults; the pad pass pads
GEMM operands to the example's sizes. Every converted graph module carries a frozen
:class:`Signature` of that, built at convert time (:mod:`ampfx.capture.guarding`), and checks each call against it
before running its graph (as ``torch.compile``'s guards do). An input outside it raises
:class:`~ampfx.errors.GuardError` naming the input, what the module was converted for,
what it got, and the fix; never a graph built for other inputs.

What is checked, per forward argument:

- the pytree structure of arguments that held tensors in ``example_inputs``;
- each tensor's kind (floating-point, integer, bool, complex): a float model converted
  with integer inputs does not silently take float ones;
- the rank and the sizes a capture or pass specialised: torch.export's static sizes and
  the ranges of its symbolic ones (shared symbols must agree), sizes padding baked in;
- values fixed while tracing (fx's fixed optional arguments, export's Python scalars).

Sizes named in ``dynamic_dims`` are symbolic where the capture allows it, and padding
skips symbolic sizes: ``dynamic_dims`` is the way to accept other sizes.

>>> import torch
>>> sig = Signature("", (("x", 1, _NO_DEFAULT),), (ParamGuard("x", None, (
...     TensorGuard("x", "floating-point", 2, (Size(0, 8, 8, None, "torch.export fixed it"),)),)),))
>>> guard = Guard(sig)
>>> guard((torch.ones(8, 4),), {})
>>> guard((torch.ones(2, 4),), {})
Traceback (most recent call last):
...
ampfx.errors.GuardError: ampfx: input x of the converted module is float32[2, 4]: dim 0 is 2, but it was converted for 8 (torch.export fixed it). Fix: convert again with example inputs of the sizes you call it with.
"""
from __future__ import annotations

import inspect
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch.utils._pytree import TreeSpec, tree_flatten

from ..errors import BakedValueError, GuardError, PlanSizeError

_NO_DEFAULT = inspect.Parameter.empty
_MISSING = object()

# tensor kinds a guard tells apart, first match wins: (name, test on a dtype)
KINDS = (
    ("bool", lambda d: d is torch.bool),
    ("complex", lambda d: d.is_complex),
    ("floating-point", lambda d: d.is_floating_point),
    ("integer", lambda d: True),
)
_DTYPES = tuple({v for v in vars(torch).values() if isinstance(v, torch.dtype)})


def kind_of(dtype: torch.dtype) -> str:
    """``kind_of(torch.bfloat16) == 'floating-point'``; ``kind_of(torch.int64) == 'integer'``."""
    return next(name for name, test in KINDS if test(dtype))


_KIND_DTYPES = {name: frozenset(d for d in _DTYPES if kind_of(d) == name) for name, _ in KINDS}

@dataclass(frozen=True)
class Size:
    """What one dimension must be: ``low <= size <= high`` (``high`` ``None``: unbounded);
    dimensions sharing a ``symbol`` must be equal."""

    dim: int
    low: int
    high: int | None
    symbol: str | None
    why: str
    fix: str = "convert again with example inputs of the sizes you call it with"


@dataclass(frozen=True)
class TensorGuard:
    """A tensor leaf: its kind, and its rank and sizes where something specialised them."""

    path: str
    kind: str
    rank: int | None = None
    sizes: tuple[Size, ...] = ()


@dataclass(frozen=True)
class ValueGuard:
    """A non-tensor leaf baked into the graph: calls must pass an equal value."""

    path: str
    value: Any
    why: str
    fix: str


@dataclass(frozen=True)
class ParamGuard:
    """One forward argument: its pytree structure (``None``: one leaf, no container) and its leaves."""

    name: str
    spec: TreeSpec | None
    leaves: tuple[TensorGuard | ValueGuard | None, ...]


@dataclass(frozen=True)
class Signature:
    """What a converted graph module was built for. ``params`` are ``forward``'s arguments as
    ``(name, inspect kind, default)``; ``guards`` one per argument (``None``: unchecked);
    ``relations`` sympy conditions over size symbols that must hold (torch.export's guards)."""

    module: str
    params: tuple[tuple[str, int, Any], ...]
    guards: tuple[ParamGuard | None, ...]
    relations: tuple[Any, ...] = ()
    scale: "Scale | None" = None


@dataclass(frozen=True)
class Scale:
    """The sizes a graph's plan holds for (:mod:`ampfx.passes.gemm_cost`): a call whose tensors hold, in all,
    ``low * elements`` elements or more and fewer than ``high * elements`` (``elements``: the example inputs') keeps
    every size-dependent dtype decision as it was made; past either end a GEMM node changes dtype (``below`` /
    ``above`` name one), and the call plans the graph again (:class:`PlanSizeError`).

    >>> s = Scale(elements=1000, low=0.5, high=4.0, below="linear", above="linear_1")
    >>> s.check(2000), s.check(4000) is not None, s.check(100) is not None
    (None, True, True)
    """

    elements: int
    low: float
    high: float
    below: str = ""
    above: str = ""

    def holds(self, n: int) -> bool:
        """Do ``n`` elements keep the plan? (Two comparisons: the call-time check.)"""
        return self.low * self.elements <= n < self.high * self.elements

    def check(self, n: int) -> str | None:
        """``None`` where ``n`` elements keep the plan, else what crossed (for the error and the log)."""
        if self.holds(n):
            return None
        side, node = ("under", self.below) if n < self.low * self.elements else ("past", self.above)
        return (f"the call's tensors hold {n:,} elements, {n / self.elements:.3g}x the {self.elements:,} the plan was "
                f"made for: {side} the size from which {node} pays in the low dtype")


class Guard:
    """The call-time check of a :class:`Signature`: ``guard(args, kwargs)`` returns ``None`` or
    raises :class:`~ampfx.errors.GuardError`. Pickles as its signature."""

    def __init__(self, signature: Signature) -> None:
        self.signature = signature
        params = signature.params
        kinds = [kind for _, kind, _ in params]
        # forward's leading positional parameters, and those a keyword can name: a call within them binds here
        self._positional = next((i for i, k in enumerate(kinds) if k not in (0, 1)), len(kinds))
        self._keyword = {name: i for i, (name, kind, _) in enumerate(params) if kind in (1, 3)}
        self._names = frozenset(name for name, _, _ in params)
        self._varkw = next((i for i, k in enumerate(kinds) if k == 4), None)  # forward's **kwargs
        self._signature = inspect.Signature(  # other calls (into *args / **kwargs): built once
            [inspect.Parameter(n, inspect._ParameterKind(k), default=d) for n, k, d in params])
        self._n = len(params)
        self._symbols = _needs_symbols(signature)
        self._checks = tuple((i, g) for i, g in enumerate(signature.guards) if g is not None)
        self._shallow = {g.name: _shallow(g.spec) for g in signature.guards if g is not None and g.spec is not None}
        self._named = {id(leaf): tuple((s.dim, s.symbol) for s in leaf.sizes if s.symbol is not None)
                       for g in signature.guards if g is not None for leaf in g.leaves if isinstance(leaf, TensorGuard)}
        self._scale = getattr(signature, "scale", None)  # (a signature pickled before it had one)

    def __reduce__(self) -> tuple:
        return (Guard, (self.signature,))

    def __call__(self, args: tuple, kwargs: dict) -> None:
        if not kwargs and len(args) == self._n == self._positional:
            values = args
        else:
            values = self._bind(args, kwargs)
            if values is None:
                return  # a call the module's own signature rejects: it raises its TypeError
        seen = [] if self._symbols else None
        for i, g in self._checks:
            value = values[i]
            if value is _MISSING:
                continue
            if g.spec is None:
                _check_leaf(self, g.leaves[0], value)
                leaves = (value,)
            else:
                leaves = self._leaves(g, value)
                for leaf_guard, leaf in zip(g.leaves, leaves):
                    if leaf_guard is not None:
                        _check_leaf(self, leaf_guard, leaf)
            if seen is not None:
                seen.append((g, leaves))
        if seen is not None:
            _check_symbols(self, seen)
        if self._scale is not None:
            n = elements(values)
            if not self._scale.holds(n):
                where = f" {self.signature.module!r}" if self.signature.module else ""
                raise PlanSizeError(f"ampfx: converted module{where}: {self._scale.check(n)} (planned again for these "
                                    "sizes)")

    def _leaves(self, g: ParamGuard, value: Any) -> Any:
        """The leaves of ``value``, which must have ``g``'s structure (a ``dict`` and an ``OrderedDict`` with
        the same keys in the same order are the same structure: :func:`_by_key`)."""
        shallow = self._shallow[g.name]
        if shallow is not None and _BY_KEY.get(type(value), type(value)) is shallow[0] and (
                len(value) == shallow[1] if shallow[0] is not dict else list(value) == shallow[1]):
            return list(value.values()) if shallow[0] is dict else value
        leaves, spec = tree_flatten(value)
        if spec != g.spec and _by_key(spec) != _by_key(g.spec):
            self.fail(g.name, _describe_spec(spec), f"a {_describe_spec(g.spec)}", "its structure was traced",
                      "call it with inputs of the structure of its example_inputs, or convert again with "
                      "example_inputs of this structure")
        return leaves

    def _bind(self, args: tuple, kwargs: dict) -> list[Any] | None:
        """The value of each parameter, ``_MISSING`` where defaulted; ``None`` if the call does not bind. A call
        within forward's leading positional parameters, naming the others or (where forward has ``**kwargs``) names
        it has not, binds here as :meth:`inspect.Signature.bind` would bind it; any other goes through that."""
        if len(args) <= self._positional:
            values: list[Any] | None = [*args, *([_MISSING] * (self._n - len(args)))]
            extra = {}
            for name, value in kwargs.items():
                i = self._keyword.get(name, -1)
                if i >= len(args):
                    values[i] = value
                elif self._varkw is not None and name not in self._names:
                    extra[name] = value
                else:
                    values = None
                    break
            if values is not None:
                if extra:
                    values[self._varkw] = extra
                return values
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError:
            return None
        return [bound.arguments.get(n, _MISSING) for n, _, _ in self.signature.params]

    def fail(self, path: str, got: str, expected: str, why: str, fix: str,
             error: type[GuardError] = GuardError) -> None:
        where = f" at {self.signature.module!r}" if self.signature.module else ""
        raise error(f"ampfx: input {path} of the converted module{where} is {got}, but it was converted "
                         f"for {expected} ({why}). Fix: {fix}.")


def elements(values: Any) -> int:
    """The elements of the tensors in ``values`` (a call's arguments), all together (a tensor argument counted
    without flattening: the call-time check of every graph with a size decision)."""
    n = 0
    for value in values:
        if isinstance(value, torch.Tensor):
            n += value.numel()
        elif value is not None and value is not _MISSING and not isinstance(value, (bool, int, float, str)):
            n += sum(t.numel() for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return n


def _children(spec: TreeSpec) -> list[TreeSpec]:
    """A spec's child specs: ``children()`` (torch 2.3+; ``children_specs`` is deprecated there) or
    the ``children_specs`` field (torch 2.2, the DGL lane)."""
    return list(spec.children()) if hasattr(spec, "children") else spec.children_specs


def _shallow(spec: TreeSpec) -> tuple[type, Any] | None:
    """``(list, 3)`` / ``(dict, keys)`` for a list, tuple, dict or ``OrderedDict`` of leaves (checked without
    flattening)."""
    children = _children(spec)
    kind = _BY_KEY.get(spec.type, spec.type)
    if kind not in (list, tuple, dict) or not all(c.is_leaf() for c in children):
        return None
    return kind, (list(spec.context) if kind is dict else len(children))


_BY_KEY = {OrderedDict: dict}
"""Mappings a converted graph reads by key alone, as the ``dict`` they are: its code indexes them
(``x['a']``, torch.fx) or flattens them by the keys of its example (torch.export's ``in_spec``), in the
example's key order, so an ``OrderedDict`` and a ``dict`` with the same keys in the same order give
it the same values. (Other ``dict`` subclasses, an HF ``ModelOutput``, a ``defaultdict``, carry
behaviour of their own and must match.)"""


def read_by_key(spec: TreeSpec) -> TreeSpec:
    """``spec`` (an exported graph's input spec) with each ``OrderedDict`` a ``dict``: the graph's code then
    takes either, reading the values by the example's keys (``torch.fx._pytree``'s ``dict`` rule; its
    ``OrderedDict`` rule asks for the type itself), and its guard decides which values it takes (:data:`_BY_KEY`).

    >>> from collections import OrderedDict
    >>> read_by_key(tree_flatten([OrderedDict(a=1)])[1])
    TreeSpec(list, None, [TreeSpec(dict, ['a'], [*])])
    """
    if spec.is_leaf():
        return spec
    return TreeSpec(_BY_KEY.get(spec.type, spec.type), spec.context, [read_by_key(c) for c in _children(spec)])


def _by_key(spec: TreeSpec | None) -> Any:
    """``spec`` as nested tuples, an ``OrderedDict`` as a ``dict`` (:data:`_BY_KEY`): what a converted graph
    can tell apart.

    >>> from collections import OrderedDict
    >>> flat = lambda v: tree_flatten(v)[1]
    >>> _by_key(flat(OrderedDict(a=1, b=2))) == _by_key(flat({"a": 1, "b": 2}))
    True
    >>> _by_key(flat(OrderedDict(a=1, b=2))) == _by_key(flat({"b": 2, "a": 1}))
    False
    """
    if spec is None or spec.is_leaf():
        return None
    return _BY_KEY.get(spec.type, spec.type), spec.context, tuple(_by_key(c) for c in _children(spec))


def _check_leaf(guard: Guard, g: TensorGuard | ValueGuard, value: Any) -> None:
    if type(g) is ValueGuard:
        if not _same_value(value, g.value):
            guard.fail(g.path, _short(value), repr(g.value), g.why, g.fix, error=BakedValueError)
        return
    if not isinstance(value, torch.Tensor):
        guard.fail(g.path, _short(value), f"{_a(g.kind)} {g.kind} tensor", "it was a tensor in example_inputs",
                   "pass a tensor, or convert again with example_inputs giving this value")
    if value.dtype not in _KIND_DTYPES[g.kind]:
        guard.fail(g.path, _short(value), f"{_a(g.kind)} {g.kind} tensor", "the conversion decided each op's dtype "
                   f"for it", f"convert again with example_inputs holding {_a(kind_of(value.dtype))} "
                   f"{kind_of(value.dtype)} tensor here")
    if g.rank is None:
        return
    if value.ndim != g.rank:
        guard.fail(g.path, _short(value), f"a tensor of rank {g.rank}", "its sizes were specialised",
                   f"convert again with example_inputs of rank {value.ndim} here")
    shape = value.shape
    for s in g.sizes:
        n = shape[s.dim]
        if n < s.low or (s.high is not None and n > s.high):
            _fail_size(guard, g.path, value, s)


def _fail_size(guard: Guard, path: str, value: torch.Tensor, s: Size) -> None:
    want = str(s.low) if s.high == s.low else f"sizes {s.low}..{'' if s.high is None else s.high}"
    guard.fail(path, f"{_short(value)}: dim {s.dim} is {value.shape[s.dim]}", want, s.why, s.fix)


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - uncomparable values are different values
        return False


def _needs_symbols(sig: Signature) -> bool:
    """Do sizes of the same symbol appear twice, or relations exist (then calls bind symbols)?"""
    seen: list[str] = [s.symbol for g in sig.guards if g is not None for leaf in g.leaves
                       if isinstance(leaf, TensorGuard) for s in leaf.sizes if s.symbol is not None]
    return bool(sig.relations) or len(seen) != len(set(seen))


def _check_symbols(guard: Guard, seen: list[tuple[ParamGuard, Any]]) -> None:
    """Sizes sharing a symbol agree, and the relations between symbols hold."""
    bound: dict[str, tuple[int, TensorGuard, int]] = {}
    for g, leaves in seen:
        for leaf_guard, leaf in zip(g.leaves, leaves):
            for dim, symbol in guard._named.get(id(leaf_guard), ()):
                n = leaf.shape[dim]
                first = bound.setdefault(symbol, (n, leaf_guard, dim))
                if first[0] != n:
                    guard.fail(leaf_guard.path, f"{_short(leaf)}: dim {dim} is {n}",
                               f"the size of {first[1].path} dim {first[2]} ({first[0]})",
                               "torch.export found the model needs them equal", "call it with equal sizes there")
    for rel in guard.signature.relations:
        free = rel.free_symbols
        if all(str(s) in bound for s in free) and \
                not bool(rel.xreplace({s: sympy.Integer(bound[str(s)][0]) for s in free})):
            where = ", ".join(f"{bound[str(s)][1].path} dim {bound[str(s)][2]} = {bound[str(s)][0]}" for s in free)
            guard.fail("sizes", where, f"sizes where {rel} holds", "torch.export's graph holds only there",
                       "convert again with example inputs of the sizes you call it with")


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')}{list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _describe_spec(spec: TreeSpec | None) -> str:
    """``list of 3`` / ``dict with keys ['a', 'b']`` / ``single value``; nested containers in full."""
    if spec is None or spec.is_leaf():
        return "single value"
    name = getattr(spec.type, "__name__", str(spec.type))
    if spec.type is dict:
        return f"dict with keys {list(spec.context)}"
    if all(c.is_leaf() for c in _children(spec)):
        return f"{name} of {len(_children(spec))}"
    return f"{name} {spec}".replace("\n", " ")


# ---------------------------------------------------------------------------------------------------------------
# Convert time: what the capture and the passes specialised, as a Signature
