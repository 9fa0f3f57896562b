"""Pass: record the dtype and shape of every node's output from example inputs.

With ``example_inputs`` the graph is run on ``meta`` tensors, or on
``FakeTensor``s when sizes are symbolic or meta propagation fails (no real
arithmetic, no activation memory either way), and each node gets torch's
``node.meta['tensor_meta']``: a ``TensorMetadata`` per tensor in its output,
as :class:`torch.fx.passes.shape_prop.ShapeProp` records it (the differences,
symbolic sizes as named sympy expressions among them, are listed in
:mod:`ampfx.meta`). If fake propagation fails (a leaf that cannot run on fake
tensors), the graph runs for real on the example inputs in eval mode under
``no_grad``, and the report says so. Buffers are restored afterwards either
way (a batch-norm leaf counts its batches even on fake tensors).
Without example inputs no node gets ``tensor_meta`` and the passes use the
conservative defaults (graph inputs are assumed float32; casts check the
dtype at run time).

torch's ``node.meta['val']`` (a fake tensor per value, as torch.export leaves it) is not what
the passes read: the meta and real runs make no fake tensors, a fake tensor keeps its
``FakeTensorMode`` and ``ShapeEnv`` alive with the converted module, and a graph holding
fake tensors does not pickle. It is removed after the passes.

Before: ``linear = torch._C._nn.linear(x, w, b)`` with ``meta = {}``.
After:  same graph, ``linear.meta['tensor_meta']`` is ``TensorMetadata(shape=torch.Size([8, 4]),
dtype=torch.float32, ...)``; ``meta.describe(meta.out_infos(linear)[0]) == "float32[8, 4]"``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import sympy
from torch.fx.immutable_collections import immutable_dict
from torch.fx.passes.shape_prop import TensorMetadata, _extract_tensor_metadata
from torch.utils._pytree import tree_leaves

try:
    from torch.utils._pytree import tree_is_leaf
except ImportError:  # torch < 2.3 (the DGL lane's 2.2): the same test under its private name
    from torch.utils._pytree import _is_leaf as tree_is_leaf

from .. import libraries, ops
from ..inputs import ExampleInputs
from ..meta import TENSOR_META
from ..ops.shape_memo import ShapeMemo
from ..state import copy_tree, kept_attributes, kept_buffers, kept_rng, kept_transforms, modes


@dataclass
class Symbols:
    """The symbolic sizes of one conversion: display symbol -> value range (from torch's ShapeEnv)."""

    ranges: dict = field(default_factory=dict)
    rename: dict = field(default_factory=dict)  # ShapeEnv symbol -> display symbol
    hints: dict = field(default_factory=dict)  # display symbol -> its value in the example inputs

    def at_example(self, expr: Any) -> Any:
        """``expr`` at the example inputs' sizes (a number), or ``None`` where a symbol has no example value."""
        expr = sympy.sympify(expr)
        if expr.is_number:
            return expr
        value = sympy.sympify(expr.xreplace(self.hints))
        return value if value.is_number else None

    def size(self, s: Any) -> int | sympy.Expr:
        if isinstance(s, torch.SymInt):
            expr = s.node.expr
            return int(expr) if expr.is_number else expr.xreplace(self.rename)
        return int(s)

    def bounds(self, expr: int | sympy.Expr) -> tuple[Any, Any]:
        """Lower and upper bound of a size over every value its symbols may take."""
        if not isinstance(expr, sympy.Expr) or expr.is_number:
            return int(expr), int(expr)
        from torch.utils._sympy.value_ranges import bound_sympy

        vr = bound_sympy(expr, self.ranges)
        return vr.lower, vr.upper


def _record(node: fx.Node, value: Any, symbols: Symbols) -> None:
    node.meta[TENSOR_META] = _mirror(value, symbols)


def _mirror(value: Any, symbols: Symbols) -> Any:
    """``value`` with each tensor replaced by its ``TensorMetadata`` (symbolic sizes named), the
    tuples, lists and dicts torch's pytree flattens mirrored (immutable), and any other value ``None``,
    or the tuple of the tensors torch's pytree finds in it (another class it flattens). No class of
    the user's is rebuilt; the tensors are those, and in the order, torch's pytree flattens."""
    if isinstance(value, torch.Tensor):
        return _metadata(value, symbols)
    if isinstance(value, (tuple, list)) and not tree_is_leaf(value):
        return tuple(_mirror(v, symbols) for v in value)
    if isinstance(value, dict) and not tree_is_leaf(value):
        return immutable_dict((k, _mirror(v, symbols)) for k, v in value.items())
    inside = tuple(_metadata(t, symbols) for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return inside or None


def _metadata(t: torch.Tensor, symbols: Symbols) -> TensorMetadata:
    found = _extract_tensor_metadata(t)
    shape = tuple(symbols.size(s) for s in found.shape)
    return found._replace(shape=torch.Size(shape) if all(isinstance(s, int) for s in shape) else shape,
                          stride=tuple(symbols.size(s) for s in found.stride))


def propagate(gm: fx.GraphModule, example_inputs: Any,
              dynamic_dims: dict[int, str] | None = None) -> tuple[str, str, Symbols]:
    """Annotate every node; returns ``(method, note, symbols)`` with method
    ``"fake"`` or ``"real"``. ``dynamic_dims`` (``{0: "batch"}``) makes those
    dimensions of every tensor input symbolic, named as given."""
    args = ExampleInputs.of(example_inputs).positional(gm)
    forget(gm)  # torch.export's own, with its ShapeEnv's sizes: every node gets ours
    # leaves may update buffers in place (batch-norm counters) and fill caches (with fake tensors)
    with kept_buffers(gm), kept_attributes(gm, bookkeeping=False):
        return _propagate(gm, args, dynamic_dims or {})


def forget(gm: fx.GraphModule) -> None:
    """Remove every node's ``tensor_meta``: the graph has no shapes (torch.export writes its own)."""
    for node in gm.graph.nodes:
        node.meta.pop(TENSOR_META, None)


def _fake_inputs(mode: Any, args: list[Any], dynamic_dims: dict[int, str], symbols: Symbols) -> list[Any]:
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    out = []
    for a in args:
        if not isinstance(a, torch.Tensor):
            out.append(a)
            continue
        dims = [(d % a.dim()) for d in dynamic_dims if -a.dim() <= d < a.dim()] if a.dim() else []
        if not dims:
            out.append(mode.from_tensor(a))
            continue
        context = StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC if i in dims else DimDynamic.STATIC for i in range(a.dim())])
        fake = mode.from_tensor(a, symbolic_context=context)
        for d, name in dynamic_dims.items():
            if -a.dim() <= d < a.dim() and isinstance(fake.shape[d], torch.SymInt):
                raw = fake.shape[d].node.expr
                named = sympy.Symbol(name, integer=True, positive=True)
                symbols.rename[raw] = named
                symbols.ranges[named] = mode.shape_env.var_to_range[raw]
                symbols.hints.setdefault(named, int(a.shape[d]))
        out.append(fake)
    return out


class _MetaProp(fx.Interpreter):
    """Runs the graph on ``meta`` tensors: shapes and dtypes only, no data, no
    change to the model (leaves run with meta copies of their state)."""

    def __init__(self, gm: fx.GraphModule, symbols: Symbols) -> None:
        super().__init__(gm)
        self.symbols = symbols
        self.copies: dict[int, torch.Tensor] = {}
        self.twins: dict[int, torch.nn.Module] = {}
        self.memo = ShapeMemo()

    def meta(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device.type != "meta":
            if id(value) not in self.copies:
                self.copies[id(value)] = torch.empty_strided(
                    value.shape, value.stride(), dtype=value.dtype, device="meta").requires_grad_(value.requires_grad)
            return self.copies[id(value)]
        return value

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self.meta(super().get_attr(target, args, kwargs))

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        mod = self.fetch_attr(target)
        key = self.memo.key_of_module(mod, args, kwargs)
        found = self.memo.find(key)
        if found is not None:
            return found
        twin = self.twins.get(id(mod))
        if twin is None:  # a copy of the module whose parameters and buffers are meta tensors
            twin = self.twins[id(mod)] = copy_tree(mod)
            for sub in twin.modules():
                sub._parameters = {k: self.meta(v) for k, v in sub._parameters.items()}
                sub._buffers = {k: self.meta(v) for k, v in sub._buffers.items()}
        state = self.memo.state_of(twin)  # also where the call has no key: a change shows in later calls
        found = twin(*args, **kwargs)
        self.memo.keep(key, found, args, kwargs, twin, state)
        return found

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self._memo_call(target, args, kwargs, super().call_function)

    def call_method(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self._memo_call(target, args, kwargs, super().call_method)

    def _memo_call(self, target: Any, args: Any, kwargs: Any, run: Any) -> Any:
        """A repeated call with the same sizes reuses its result (:class:`~ampfx.ops.shape_memo.ShapeMemo`)."""
        if target in ops.TRANSFORM_CALLS:
            return run(target, args, kwargs)  # a transform's level (vmap in an exported graph): never a memo's
        key = self.memo.key_of_call(target, args, kwargs)
        found = self.memo.find(key)
        if found is None:
            found = run(target, args, kwargs)
            self.memo.keep(key, found, args, kwargs)
        return found

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        _record(n, result, self.symbols)
        return result


def _propagate(gm: fx.GraphModule, args: list[Any], dynamic_dims: dict[int, str]) -> tuple[str, str, Symbols]:
    symbols = Symbols()
    real_only = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"
                 and not libraries.runs_on_fake_tensors(gm.get_submodule(str(n.target)))]
    if real_only:  # DGL's kernels take tensors through DLPack: meta/fake tensors crash them
        return _run_real(gm, args, dynamic_dims, symbols, f"ran the example inputs for real: leaves "
                         f"{', '.join(real_only[:3])}{' ...' if len(real_only) > 3 else ''} cannot run on "
                         "meta or fake tensors")
    if not dynamic_dims:
        try:
            prop = _MetaProp(gm, symbols)
            with kept_transforms(), torch.no_grad():
                prop.run(*[prop.meta(a) for a in args])
            return "meta", "shapes from meta-tensor propagation (no real compute)", symbols
        except Exception:  # noqa: BLE001 - fake tensors handle more (data-dependent leaves fail on both)
            pass
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp

        mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv() if dynamic_dims else None)
        fake_args = _fake_inputs(mode, args, dynamic_dims, symbols)
        with kept_transforms():
            FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fake_args)
        for node in gm.graph.nodes:
            if "val" in node.meta:
                _record(node, node.meta["val"], symbols)
        names = ", ".join(f"{k}: {v}" for k, v in symbols.ranges.items())
        return "fake", "shapes from FakeTensor propagation (no real compute)" + (
            f"; symbolic sizes {names}" if names else ""), symbols
    except Exception as e:  # noqa: BLE001 - any failure falls back to real execution
        symbols = Symbols()
        note = f"FakeTensor propagation failed ({type(e).__name__}: {str(e)[:200]}); ran the example inputs for real"
    return _run_real(gm, args, dynamic_dims, symbols, note)


def _run_real(gm: fx.GraphModule, args: list[Any], dynamic_dims: dict[int, str], symbols: Symbols,
              note: str) -> tuple[str, str, Symbols]:
    """Run the graph on the example inputs (eval mode, no grad) and record every node's output."""
    with modes(gm, training=False), torch.no_grad(), kept_rng(*gm.parameters()), kept_transforms():
        interp = fx.Interpreter(gm)
        env_run = interp.run_node

        def run_node(n: fx.Node) -> Any:
            result = env_run(n)
            _record(n, result, symbols)
            return result

        interp.run_node = run_node
        try:
            interp.run(*args)
        except Exception as e:
            raise ValueError(f"the model does not run on example_inputs ({type(e).__name__}: {e}); give "
                             "inputs it accepts, as a tuple of positional or a dict of keyword inputs") from e
    if dynamic_dims:
        note += "; dynamic_dims ignored (sizes are the example's)"
    return "real", note, symbols
