"""The keys ampfx writes into ``node.meta`` and ``gm.meta``, with typed accessors.

One module owns every key, so writer and reader cannot drift apart. Values
stored under them are immutable (``node_copy`` copies meta shallowly):

- ``RECORD`` (``node.meta['ampfx']``): the node's :class:`~ampfx.report.records.Decision`,
  or a :class:`~ampfx.report.records.CastInfo` for a cast ampfx inserted;
- ``OUT_INFOS``: a tuple of :class:`~ampfx.passes.shapes.TensorInfo`, the dtype and
  sizes of each tensor the node produced before conversion (shape propagation);
- ``CALIB``: what calibration saw of the node's output and gradient;
- ``SENSITIVITY``: how far rounding the node's result alone to the low dtype moved the output and
  the gradients in calibration (:class:`~ampfx.passes.sensitivity.Errors`), for nodes over the threshold;
- ``LEAF_PARAM_CASTS`` (``gm.meta``): how many parameter copies leaves make per call;
- ``USER_FLOAT32``: why the user asked for the node to stay float32 (it was traced inside
  ``torch.autocast(..., enabled=False)``), written while capturing (:mod:`ampfx.capture.semantics`);
- ``AUTOCAST``: the dtype ``torch.autocast`` would compute the node in (:mod:`ampfx.passes.autocast`),
  copied into ``Decision.autocast`` after the passes;
- ``AUTOCAST_HANDS``: on a kept module's call, the dtype ``torch.autocast`` would hand its float inputs in
  (its own graph's inputs start there: :attr:`ampfx.passes.context.PassContext.autocast_arrive`).

>>> import torch.fx as fx
>>> g = fx.Graph(); x = g.placeholder("x")
>>> record(x) is None, out_infos(x) is None
(True, True)
"""
from __future__ import annotations

from typing import Any

import torch.fx as fx

RECORD = "ampfx"
OUT_INFOS = "ampfx_out"
CALIB = "ampfx_calib"
SENSITIVITY = "ampfx_sensitivity"
LEAF_PARAM_CASTS = "ampfx_leaf_param_casts"
USER_FLOAT32 = "ampfx_user_float32"
AUTOCAST = "ampfx_autocast"
AUTOCAST_HANDS = "ampfx_autocast_hands"


def record(node: fx.Node) -> Any:
    """The node's Decision or CastInfo, or ``None`` (a node ampfx has not seen)."""
    return node.meta.get(RECORD)


def decision(node: fx.Node) -> Any:
    """The node's record; ``KeyError`` if it has none (every node has one after classify)."""
    return node.meta[RECORD]


def out_infos(node: fx.Node) -> tuple | None:
    """The dtype and sizes of each tensor ``node`` produced before conversion, or ``None`` without shapes."""
    return node.meta.get(OUT_INFOS)


def calib(node: fx.Node) -> Any:
    """What calibration recorded for ``node``, or ``None``."""
    return node.meta.get(CALIB)


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
