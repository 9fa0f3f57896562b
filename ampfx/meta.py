"""The keys ampfx writes into ``node.meta`` and ``gm.meta``, with typed accessors.

One module owns every key, so writer and reader cannot drift apart. Values
stored under them are immutable (``node_copy`` copies meta shallowly):

- ``RECORD`` (``node.meta['ampfx']``): the node's :class:`~ampfx.report.records.Decision`,
  or a :class:`~ampfx.report.records.CastInfo` for a cast ampfx inserted;
- ``TENSOR_META`` (``node.meta['tensor_meta']``, torch's own key, written by shape propagation as
  :class:`torch.fx.passes.shape_prop.ShapeProp` writes it): a
  :class:`~torch.fx.passes.shape_prop.TensorMetadata` for each tensor the node produced before
  conversion, in the shape of its result (tuples, lists and dicts mirrored, other values ``None``).
  It differs from ShapeProp's in three ways: a symbolic size or stride is a sympy expression over
  the names ``dynamic_dims`` gave (``8*batch``), never a ``SymInt`` (the meta holds no
  ``ShapeEnv``, and a graph pickles); every node propagation ran has the key, values that are not
  tensors stand as ``None`` (ShapeProp keeps them, and writes no key for a node without a tensor);
  a value of another class torch's pytree flattens holds the tuple of its tensors' metadata (no
  user class is rebuilt). It describes the graph before conversion: passes do not rewrite it when
  they change a node's dtype or pad it. Read it through :func:`out_infos`;
- ``CALIB``: what calibration saw of the node's output and gradient;
- ``FP8_CALIB``: with ``fp8=``, what calibration saw of a linear layer's GEMM in FP8
  (:class:`~ampfx.passes.calibrate.Fp8Stats`);
- ``SENSITIVITY``: how far rounding the node's result alone to the low dtype moved the output and
  the gradients in calibration (:class:`~ampfx.passes.sensitivity.Errors`), for nodes over the threshold;
- ``LEAF_PARAM_CASTS`` (``gm.meta``): how many parameter copies leaves make per call;
- ``USER_FLOAT32``: why the user asked for the node to stay float32 (it was traced inside
  ``torch.autocast(..., enabled=False)``), written while capturing (:mod:`ampfx.capture.semantics`);
- ``AUTOCAST``: the dtype ``torch.autocast`` would compute the node in (:mod:`ampfx.passes.autocast`),
  copied into ``Decision.autocast`` after the passes;
- ``AUTOCAST_HANDS``: on a kept module's call, the dtype ``torch.autocast`` would hand its float inputs in
  (its own graph's inputs start there: :attr:`ampfx.passes.context.PassContext.autocast_arrive`);
- ``COST_SCALE``: a GEMM's cost condition, the factor of the example inputs' elements from which it pays low;
- ``BETWEEN_LOW``: a GEMM kept float32 by its size alone that pays between low neighbours
  (:class:`BetweenLow`), which painting carries out where its neighbours are low.

>>> import torch.fx as fx
>>> g = fx.Graph(); x = g.placeholder("x")
>>> record(x) is None, out_infos(x) is None
(True, True)
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch.fx as fx
from torch.fx.passes.shape_prop import TensorMetadata

from .report.records import dtype_name

if TYPE_CHECKING:
    import sympy  # imported where a size is symbolic (numel): converting imports it, importing ampfx does not

RECORD = "ampfx"
TENSOR_META = "tensor_meta"
CALIB = "ampfx_calib"
SENSITIVITY = "ampfx_sensitivity"
FP8_CALIB = "ampfx_fp8_calib"
LEAF_PARAM_CASTS = "ampfx_leaf_param_casts"
USER_FLOAT32 = "ampfx_user_float32"
AUTOCAST = "ampfx_autocast"
AUTOCAST_HANDS = "ampfx_autocast_hands"
COST_SCALE = "ampfx_cost_scale"
"""A GEMM node's cost condition (``ampfx.passes.gemm_cost``): the factor of the example inputs' elements from which
it pays in the low dtype (under 1: it does at the example's sizes); the call-time guard plans again across it."""
BETWEEN_LOW = "ampfx_between_low"
"""A GEMM node kept float32 by its size alone that pays between low neighbours (``ampfx.passes.gemm_cost``): a
:class:`BetweenLow`, which painting (``ampfx.passes.between_low``) carries out where its neighbours are low."""


class BetweenLow(NamedTuple):
    """What a GEMM kept float32 alone would be between low neighbours: its decision before (the low dtype), its
    cost condition there (``COST_SCALE``'s), and why it pays there (for its reason)."""

    before: Any
    need: float
    why: str


def record(node: fx.Node) -> Any:
    """The node's Decision or CastInfo, or ``None`` (a node ampfx has not seen)."""
    return node.meta.get(RECORD)


def decision(node: fx.Node) -> Any:
    """The node's record; ``KeyError`` if it has none (every node has one after classify)."""
    return node.meta[RECORD]


def out_infos(node: fx.Node) -> tuple[TensorMetadata, ...] | None:
    """The metadata of each tensor ``node`` produced before conversion, in the order torch's pytree
    flattens its result (``()``: no tensor), or ``None`` without shapes.

    >>> from torch.fx.passes.shape_prop import _extract_tensor_metadata
    >>> import torch
    >>> n = fx.Graph().placeholder("x")
    >>> n.meta[TENSOR_META] = (_extract_tensor_metadata(torch.empty(2, 3, device="meta")), None)
    >>> [(tuple(i.shape), i.dtype) for i in out_infos(n)]
    [((2, 3), torch.float32)]
    """
    if TENSOR_META not in node.meta:
        return None
    found = node.meta[TENSOR_META]
    return (found,) if isinstance(found, TensorMetadata) else tuple(_flat(found))


def _flat(found: Any) -> Any:
    if isinstance(found, TensorMetadata):
        yield found
    elif isinstance(found, (tuple, list)):
        for item in found:
            yield from _flat(item)
    elif isinstance(found, dict):
        for item in found.values():
            yield from _flat(item)


def tensor_meta(node: fx.Node) -> Any:
    """What shape propagation recorded of ``node``'s result, in its shape (a ``TensorMetadata`` for a
    tensor, a tuple of them for a tuple of tensors), or ``None``: read :func:`out_infos` for its tensors."""
    return node.meta.get(TENSOR_META)


def describe(info: TensorMetadata) -> str:
    """How the report writes a tensor: ``dtype[sizes]``.

    >>> import sympy, torch
    >>> batch = sympy.Symbol("batch", integer=True, positive=True)
    >>> describe(TensorMetadata((batch, 3), torch.float16, False, (3, 1), None, False, {}))
    'float16[batch, 3]'
    """
    return f"{dtype_name(info.dtype)}[{', '.join(str(s) for s in info.shape)}]"


def numel(info: TensorMetadata) -> int | sympy.Expr:
    """The number of elements: an int for static sizes, a sympy product for symbolic ones.

    >>> import sympy, torch
    >>> batch = sympy.Symbol("batch", integer=True, positive=True)
    >>> numel(TensorMetadata((batch, 3), torch.float16, False, (3, 1), None, False, {}))
    3*batch
    """
    if not all(isinstance(s, int) for s in info.shape):
        import sympy

        if any(isinstance(s, sympy.Expr) for s in info.shape):
            return sympy.Mul(*info.shape)
    out = 1
    for s in info.shape:
        out *= int(s)
    return out


def calib(node: fx.Node) -> Any:
    """What calibration recorded for ``node``, or ``None``."""
    return node.meta.get(CALIB)


def fp8_calib(node: fx.Node) -> Any:
    """What calibration saw of ``node``'s GEMM in FP8, or ``None``."""
    return node.meta.get(FP8_CALIB)


def sensitivity(node: fx.Node) -> Any:
    """How far rounding ``node`` alone moved the model in calibration, or ``None`` (not found sensitive)."""
    return node.meta.get(SENSITIVITY)


def user_float32(node: fx.Node) -> str | None:
    """Why the user asked for ``node`` to compute in float32, or ``None``."""
    return node.meta.get(USER_FLOAT32)


def leaf_param_casts(gm: fx.GraphModule) -> int:
    """Parameter copies made inside leaves per call of ``gm``."""
    return gm.meta.get(LEAF_PARAM_CASTS, 0)


def node_module_path(node: fx.Node) -> str:
    """The qualified name of the module a node was traced in ('' for the root)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    key, value = list(stack.items())[-1]
    if isinstance(value, tuple):  # torch >= 2.3: key -> (path, type)
        return str(value[0])
    return str(key)
