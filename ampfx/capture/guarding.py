"""Building a converted graph's argument guard at conversion time (:func:`attach`): what each input of the
captured graph must be at call time (its kind, its sizes, the values fixed while tracing, the ranges
torch.export proved), from the example inputs, the capture and the padding the passes did. The guard itself,
the call-time check, is :class:`ampfx.runtime.guards.Guard`; this module builds it and runs only at conversion.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.utils._pytree import TreeSpec, tree_flatten

from .. import runtime
from ..errors import PolicyError
from ..inputs import ExampleInputs
from ..meta import COST_SCALE
from ..runtime.guards import (Guard, ParamGuard, Scale, Signature, Size, TensorGuard, ValueGuard, _short, elements,
                              kind_of)
from ..state import kept_buffers


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
           dynamic_dims: dict[int, str] | None, prefix: str, facts: Exported | None,
           pad: str) -> tuple[Guard | None, list[str]]:
    """The :class:`Guard` of what ``gm`` (the converted graph of ``module``) was built for (see :func:`build`),
    for its plan, and the report's notes on it. Nothing to check: no guard (``None``), no cost."""
    sig, notes = build(gm, module, capture, inputs, dynamic_dims, prefix, facts, pad)
    return (Guard(sig) if any(g is not None for g in sig.guards) or sig.scale is not None else None), notes


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
    return Signature(prefix.rstrip("."), params, tuple(guards), facts.relations if facts is not None else (),
                     scale=_scale(gm, inputs)), notes


def _scale(gm: fx.GraphModule, inputs: ExampleInputs | None) -> Scale | None:
    """The sizes ``gm``'s plan holds for (:class:`Scale`), from the conditions its GEMM nodes recorded
    (``node.meta['ampfx_cost_scale']``: the factor of the example inputs' elements from which each pays low);
    ``None`` where none did."""
    needs = [(n.meta[COST_SCALE], n.name) for n in gm.graph.nodes if COST_SCALE in n.meta]
    if inputs is None or not needs:
        return None
    total = elements(inputs.tensors())
    paying = [(need, name) for need, name in needs if need <= 1]
    losing = [(need, name) for need, name in needs if need > 1]
    low, below = max(paying) if paying else (0.0, "")
    high, above = min(losing) if losing else (math.inf, "")
    if total <= 0 or (low <= 0 and high == math.inf):
        return None
    return Scale(total, low, high, below, above)


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
