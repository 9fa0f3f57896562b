"""Call-time guards: a converted module checks every call against what it was converted for.

A captured graph is specialised to its example inputs in ways its outputs on those
inputs cannot show: ``torch.export`` flattens the inputs with the example's pytree
structure (list lengths, dict keys), bakes Python values (``n=3``) into the graph and
fixes the sizes the model's Python depends on (``if x.shape[0] > 4`` keeps batch sizes
5 and up); ``torch.fx`` fixes optional arguments at their defaults; the pad pass pads
GEMM operands to the example's sizes. Every converted graph module carries a frozen
:class:`Signature` of that, built at convert time, and checks each call against it
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
import torch.fx as fx
from torch.utils._pytree import TreeSpec, tree_flatten

from .. import runtime
from ..errors import BakedValueError, GuardError, PolicyError
from ..inputs import ExampleInputs
from ..state import kept_buffers

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
        self._signature = inspect.Signature(  # other calls (into *args / **kwargs): built once
            [inspect.Parameter(n, inspect._ParameterKind(k), default=d) for n, k, d in params])
        self._n = len(params)
        self._symbols = _needs_symbols(signature)
        self._checks = tuple((i, g) for i, g in enumerate(signature.guards) if g is not None)
        self._shallow = {g.name: _shallow(g.spec) for g in signature.guards if g is not None and g.spec is not None}
        self._named = {id(leaf): tuple((s.dim, s.symbol) for s in leaf.sizes if s.symbol is not None)
                       for g in signature.guards if g is not None for leaf in g.leaves if isinstance(leaf, TensorGuard)}

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
        """The value of each parameter, ``_MISSING`` where defaulted; ``None`` if the call does not bind."""
        if len(args) <= self._positional and all(self._keyword.get(k, -1) >= len(args) for k in kwargs):
            values = [*args, *([_MISSING] * (self._n - len(args)))]
            for name, value in kwargs.items():
                values[self._keyword[name]] = value
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


@dataclass(frozen=True)
class Exported:
    """torch.export's view of one graph's user inputs, read from its placeholders (before the
    analyses overwrite their values): per flat input, its sizes (ints where export fixed
    them, sympy symbols where not) or its Python value; the symbols' ranges; and the
    conditions between symbols that no range says."""

    leaves: tuple[Any, ...]
    ranges: tuple[tuple[str, int, int | None], ...]
    relations: tuple[Any, ...]


@dataclass(frozen=True)
class _Value:
    value: Any


def exported(capture: Any) -> Exported | None:
    """The :class:`Exported` facts of an export capture's graph; ``None`` for a graph whose
    placeholders carry no values (torch.fx's)."""
    graph = capture.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if not placeholders or any("val" not in n.meta for n in placeholders):
        return None
    leaves: list[Any] = []
    symbols: dict[Any, Any] = {}  # sympy symbol -> its ShapeEnv
    for n in placeholders:
        v = n.meta["val"]
        if not isinstance(v, torch.Tensor):
            leaves.append(_Value(v))
            continue
        dims = []
        for size in v.shape:
            expr = size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))
            dims.append(int(expr) if expr.is_number else expr)
            if not expr.is_number:
                symbols.update((s, size.node.shape_env) for s in expr.free_symbols)
        leaves.append(tuple(dims))
    ranges, relations = [], []
    for sym, env in symbols.items():
        vr = env.var_to_range.get(sym)
        ranges.append((str(sym), *_bounds(vr)))
    for env in {id(e): e for e in symbols.values()}.values():
        for g in env.guards:
            free = g.expr.free_symbols
            if free and free <= set(symbols) and not _range_only(g.expr):
                relations.append(g.expr)
    return Exported(tuple(leaves), tuple(ranges), tuple(relations))


def _bounds(vr: Any) -> tuple[int, int | None]:
    if vr is None:
        return 0, None
    try:
        low = int(vr.lower)
    except (TypeError, ValueError, AttributeError):
        low = 0
    try:
        high = int(vr.upper) if vr.upper.is_integer and vr.upper < 2 ** 62 else None
    except (TypeError, ValueError, AttributeError):
        high = None
    return low, high


def _range_only(expr: Any) -> bool:
    """A comparison of one symbol with a number (the symbol's range holds it)."""
    return len(expr.free_symbols) == 1 and isinstance(expr, sympy.core.relational.Relational) and (
        expr.lhs.is_Symbol and expr.rhs.is_number or expr.rhs.is_Symbol and expr.lhs.is_number)


def _params(fn: Any) -> tuple[tuple[str, int, Any], ...]:
    return tuple((p.name, int(p.kind), p.default) for p in inspect.signature(fn).parameters.values())


def attach(gm: fx.GraphModule, module: Any, capture: Any, inputs: ExampleInputs | None,
           dynamic_dims: dict[int, str] | None, prefix: str, facts: Exported | None, pad: str) -> list[str]:
    """Give ``gm`` (the converted graph of ``module``) the :class:`Guard` of what it was built for
    (see :func:`build`); returns the report's notes on it. Nothing to check: no guard, no cost."""
    sig, notes = build(gm, module, capture, inputs, dynamic_dims, prefix, facts, pad)
    if any(g is not None for g in sig.guards):
        gm.set_guard(Guard(sig))
    return notes


def build(gm: fx.GraphModule, module: Any, capture: Any, inputs: ExampleInputs | None,
          dynamic_dims: dict[int, str] | None, prefix: str, facts: Exported | None,
          pad: str) -> tuple[Signature, list[str]]:
    """The :class:`Signature` of ``gm`` (the converted graph of ``module``) and the report's notes on it.
    ``facts`` come from :func:`exported` before the analyses ran."""
    params = _params(module.forward)
    bound = inputs.bind(module.forward).arguments if inputs is not None else {}
    given = set(inputs.given(module.forward)) if inputs is not None else set()
    baked = facts is not None
    guards: list[ParamGuard | None] = []
    for name, _, _ in params:
        if name in capture.fixed_args:
            value = capture.fixed_args[name]
            guards.append(ParamGuard(name, None, (ValueGuard(name, value, "torch.fx fixed it while tracing",
                                                             f"convert again with example_inputs that give {name}"),)))
        elif name in bound:
            guards.append(_param_guard(name, bound[name], baked))
        else:
            guards.append(None)
    notes = _apply_exported(guards, params, given, facts, dynamic_dims) if facts is not None else []
    if inputs is not None:
        _apply_padded(guards, params, _padded(gm, inputs), pad)
    return Signature(prefix.rstrip("."), params, tuple(guards), facts.relations if facts is not None else ()), notes


def _flatten_with_names(value: Any) -> tuple[list[tuple[str, Any]], TreeSpec]:
    """``value``'s pytree leaves, each with its path in words (``[0]``, ``['mask']``), and its spec.
    torch before 2.3 (the DGL lane's 2.2.1) has no ``tree_flatten_with_path``: leaves are named by
    their place in the flat order there.

    >>> [path for path, _ in _flatten_with_names([torch.ones(1), {"m": torch.ones(1)}])[0]]
    ['[0]', "[1]['m']"]
    """
    try:
        from torch.utils._pytree import keystr, tree_flatten_with_path
    except ImportError:
        leaves, spec = tree_flatten(value)
        return [(f"<leaf {i}>" if not spec.is_leaf() else "", v) for i, v in enumerate(leaves)], spec
    flat, spec = tree_flatten_with_path(value)
    return [(keystr(path), v) for path, v in flat], spec


def _param_guard(name: str, value: Any, baked: bool) -> ParamGuard | None:
    """Structure and leaves of one argument's example value: tensors get their kind; other leaves
    are baked values under torch.export (torch.fx keeps them as inputs of its graph)."""
    flat, spec = _flatten_with_names(value)
    holds_tensor = any(isinstance(v, torch.Tensor) for _, v in flat)
    if not holds_tensor and not baked:
        return None
    leaves = []
    for path, v in flat:
        where = name + path
        if isinstance(v, torch.Tensor):
            leaves.append(TensorGuard(where, kind_of(v.dtype)))
        elif baked:
            leaves.append(ValueGuard(where, v, "torch.export baked this value into its graph",
                                     "convert again with example_inputs giving this value (each value needs its "
                                     "own conversion)"))
        else:
            leaves.append(None)
    return ParamGuard(name, None if spec.is_leaf() else spec, tuple(leaves))


def _apply_exported(guards: list[ParamGuard | None], params: tuple, given: set[str], f: Exported,
                    dynamic_dims: dict[int, str] | None) -> list[str]:
    """Put torch.export's sizes on the tensor guards (flat inputs follow the given arguments in
    ``forward``'s order); the notes for ``dynamic_dims`` that export fixed."""
    slots = [(i, j) for i, (name, _, _) in enumerate(params) if name in given and guards[i] is not None
             for j in range(len(guards[i].leaves))]
    if len(slots) != len(f.leaves):
        return [f"torch.export's {len(f.leaves)} inputs could not be matched to the example's {len(slots)} "
                "leaves: tensor sizes are not guarded beyond their kinds"]
    ranges = {name: (low, high) for name, low, high in f.ranges}
    notes = []
    for (i, j), dims in zip(slots, f.leaves):
        leaf = guards[i].leaves[j]
        if not isinstance(leaf, TensorGuard) or isinstance(dims, _Value):
            continue
        sizes = [*leaf.sizes, *(_export_size(d, size, ranges) for d, size in enumerate(dims))]
        named = [d % len(dims) for d in (dynamic_dims or {}) if -len(dims) <= d < len(dims)]
        notes += [f"dynamic_dims names dim {d} of {leaf.path}, but torch.export fixed it to {dims[d]} (the model's "
                  "Python needs that size, or the example's size is 0 or 1): calls with other sizes raise GuardError"
                  for d in named if isinstance(dims[d], int)]
        _replace_leaf(guards, i, j, TensorGuard(leaf.path, leaf.kind, len(dims), tuple(dict.fromkeys(s for s in sizes
                                                                                               if s))))
    return notes


def _export_size(dim: int, size: Any, ranges: dict[str, tuple[int, int | None]]) -> Size | None:
    if isinstance(size, int):
        if size in (0, 1):
            return Size(dim, size, size, None, "torch.export specialises sizes 0 and 1 of its example",
                        f"convert with an example of size 2 or more in dim {dim} (or of the size you call it with)")
        return Size(dim, size, size, None, "torch.export specialised it")
    if size.is_Symbol:
        low, high = ranges.get(str(size), (0, None))
        if low <= 0 and high is None:
            return Size(dim, 0, None, str(size), "")  # only shared-symbol agreement to check
        return Size(dim, low, high, str(size), f"torch.export's graph holds for sizes {low}..{high or ''} only (the "
                    "model's Python depends on this size, and sizes 0 and 1 are specialised)",
                    "convert again with an example in the range you call it with (an example of size 1 for calls "
                    "of size 1)")
    return None  # a derived size (2*s0): the relations and the other sizes cover it


def _replace_leaf(guards: list[ParamGuard | None], i: int, j: int, leaf: TensorGuard) -> None:
    g = guards[i]
    guards[i] = ParamGuard(g.name, g.spec, (*g.leaves[:j], leaf, *g.leaves[j + 1:]))


def _apply_padded(guards: list[ParamGuard | None], params: tuple, padded: dict, pad: str) -> None:
    """Fix the sizes padding baked in (``padded``: ``(argument, leaf) -> (rank, {dim: size})``)."""
    index = {name: i for i, (name, _, _) in enumerate(params)}
    for (name, j), (rank, sizes) in padded.items():
        i = index.get(name)
        g = guards[i] if i is not None else None
        leaf = g.leaves[j] if g is not None and j < len(g.leaves) else None
        if not isinstance(leaf, TensorGuard):
            continue
        extra = tuple(Size(d, n, n, None, f"pad='{pad}' padded a GEMM operand to the example's sizes",
                           f"give dynamic_dims={{{d}: 'name'}} (padding skips symbolic sizes), pad='never', or "
                           "convert again with example inputs of the sizes you call it with")
                      for d, n in sorted(sizes.items()))
        _replace_leaf(guards, i, j, TensorGuard(leaf.path, leaf.kind, rank, tuple(dict.fromkeys((*leaf.sizes, *extra)))))


def _pads(gm: fx.GraphModule) -> list[fx.Node]:
    """The ``cast_pad`` nodes whose operand is not a parameter (or a cast of one): their sizes came
    from the example inputs, or from constants."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not runtime.cast_pad or not isinstance(n.args[0], fx.Node):
            continue
        src = n.args[0]
        while src.op == "call_function" and src.target is runtime.cast and isinstance(src.args[0], fx.Node):
            src = src.args[0]
        if src.op != "get_attr":
            out.append(n)
    return out


def _padded(gm: fx.GraphModule, inputs: ExampleInputs) -> dict[tuple[str, int], tuple[int, dict[int, int]]]:
    """Which input sizes the pad pass baked into ``gm``: ``(argument, leaf) -> (rank, {dim: size})``.

    The graph runs once more on fake tensors with every input size symbolic; the sizes each
    padded operand had are then expressions over input sizes. A constant one that depends on
    the inputs came through sizes torch specialised (0, 1, or equal to a weight's): those are
    fixed. If the run fails, every size of every input is fixed."""
    pads = _pads(gm)
    if not pads:
        return {}
    names = list(inspect.signature(gm.forward).parameters)
    values = inputs.positional(gm)
    leaves = {(name, j): t for name, v in zip(names, values)
              for j, t in enumerate(tree_flatten(v)[0]) if isinstance(t, torch.Tensor)}
    out: dict[tuple[str, int], tuple[int, dict[int, int]]] = {}

    def fix(key: tuple[str, int], dims: Any) -> None:
        t = leaves[key]
        out.setdefault(key, (t.dim(), {}))[1].update({d: int(t.shape[d]) for d in dims})

    try:
        try:
            where, env = _symbolic_run(gm, names, values)
        except Exception:  # noqa: BLE001 - cannot tell which sizes feed the padding: fix them all
            for key, t in leaves.items():
                fix(key, range(t.dim()))
            return out
        for n in pads:
            _fix_operand(n, where, env, leaves, fix)
    finally:
        for n in gm.graph.nodes:
            n.meta.pop("val", None)
    return out


def _fix_operand(pad: fx.Node, where: dict, env: Any, leaves: dict, fix: Any) -> None:
    """Fix the input sizes the padded trailing sizes of ``pad``'s operand come from."""
    val = pad.args[0].meta.get("val")
    if not isinstance(val, torch.Tensor):
        for key, t in leaves.items():
            fix(key, range(t.dim()))
        return
    for size in val.shape[val.dim() - len(pad.args[2]):]:
        expr = size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))
        for sym in expr.free_symbols & set(where):
            fix(where[sym][0], [where[sym][1]])
        if expr.is_number and _reads_inputs(pad.args[0]):
            for sym, value in env.replacements.items():
                if sym in where and value.is_number:
                    fix(where[sym][0], [where[sym][1]])
            for key, t in leaves.items():
                fix(key, [d for d in range(t.dim()) if t.shape[d] in (0, 1)])


def _reads_inputs(node: fx.Node) -> bool:
    """Does ``node`` depend on a placeholder?"""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n.op == "placeholder":
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


def _symbolic_run(gm: fx.GraphModule, names: list[str], values: list[Any]) -> tuple[dict, Any]:
    """Run ``gm`` on fake tensors whose every size is a symbol; ``({symbol: ((argument, leaf), dim)}, ShapeEnv)``.
    Leaves each node's fake output in ``node.meta['val']`` (the caller removes them)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    from torch.utils._pytree import tree_unflatten

    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    where: dict[Any, tuple[tuple[str, int], int]] = {}
    fakes = []
    for name, v in zip(names, values):
        flat, spec = tree_flatten(v)
        made = []
        for j, leaf in enumerate(flat):
            if isinstance(leaf, torch.Tensor) and leaf.dim():
                context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * leaf.dim())
                leaf = mode.from_tensor(leaf, symbolic_context=context)
                where.update((s.node.expr, ((name, j), d)) for d, s in enumerate(leaf.shape)
                             if isinstance(s, torch.SymInt) and s.node.expr.is_Symbol)
            made.append(leaf)
        fakes.append(tree_unflatten(made, spec))
    with kept_buffers(gm):
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    return where, mode.shape_env


def check_dynamic_dims(dynamic_dims: Any, inputs: ExampleInputs) -> None:
    """Raise :class:`~ampfx.errors.PolicyError` unless ``dynamic_dims`` maps dimensions that the
    example's tensors have (negative ones count from the end) to size names, and some tensor
    is at least 2 long there (torch specialises sizes 0 and 1).

    >>> check_dynamic_dims({0: "batch", -1: "seq"}, ExampleInputs.of(torch.ones(4, 3)))
    >>> check_dynamic_dims({5: "b"}, ExampleInputs.of(torch.ones(4, 3)))
    Traceback (most recent call last):
    ...
    ampfx.errors.PolicyError: dynamic_dims names dim 5, but the example inputs' tensors have at most 2 dimensions (float32[4, 3]); name a dim in -2..1, e.g. dynamic_dims={0: 'batch'}
    """
    from collections.abc import Mapping

    if not isinstance(dynamic_dims, Mapping):
        raise PolicyError(f"dynamic_dims must be a dict {{dim: name}}, e.g. {{0: 'batch'}}; got {_short(dynamic_dims)}")
    tensors = inputs.tensors()
    if not tensors and dynamic_dims:
        raise PolicyError("dynamic_dims names dimensions of example_inputs' tensors, but they hold none")
    rank = max((t.dim() for t in tensors), default=0)
    shapes = ", ".join(_short(t) for t in tensors[:4]) + (" ..." if len(tensors) > 4 else "")
    for dim, name in dynamic_dims.items():
        if type(dim) is not int:
            raise PolicyError(f"dynamic_dims keys are dimension numbers (int); got {dim!r}, e.g. {{0: 'batch'}}")
        if not isinstance(name, str) or not name.isidentifier():
            raise PolicyError(f"dynamic_dims[{dim}] must name the size with an identifier string such as 'batch'; "
                              f"got {name!r}")
        if not -rank <= dim < rank:
            raise PolicyError(f"dynamic_dims names dim {dim}, but the example inputs' tensors have at most {rank} "
                              f"dimensions ({shapes}); name a dim in {-rank}..{rank - 1}, e.g. dynamic_dims={{0: 'batch'}}")
        sizes = [int(t.shape[dim]) for t in tensors if -t.dim() <= dim < t.dim()]
        if max(sizes) < 2:
            raise PolicyError(f"dynamic_dims names dim {dim} ({name!r}), but the example's size there is {max(sizes)}, "
                              "which torch specialises: give an example of size 2 or more in that dimension")
    for t in tensors:
        named = [d % t.dim() for d in dynamic_dims if t.dim() and -t.dim() <= d < t.dim()]
        if len(named) != len(set(named)):
            raise PolicyError(f"dynamic_dims names one dimension of {_short(t)} twice ({sorted(dynamic_dims)}): "
                              "give each dimension once")
