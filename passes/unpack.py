"""Pass: a tensor unpacked into all its rows is one ``unbind``, as eager Python runs it.

``q, k, v = qkv`` runs ``qkv.unbind(0)`` in eager Python (``Tensor.__iter__``); torch.fx traces it
as ``qkv[0]``, ``qkv[1]``, ``qkv[2]``. Same values, but each selection's backward writes a zero
tensor of ``qkv``'s size and copies its gradient in, and autograd sums the three: a windowed-attention
block wrote 5% more bytes per training step than autocast. With shapes, where the selections
``x[0] .. x[n-1]`` of a tensor whose first dimension is ``n`` are all there, they become
``torch.unbind(x)`` and its items (one backward ``stack``).

Not where an unbind would raise and the selections do not: ``unbind``'s outputs may not be changed in
place, so every use of a selection, followed through ops that can return their input (views,
dropout, ``.to``), must end in an op that makes a new tensor (a GEMM, an elementwise op), never in an
in-place op, an op ampfx has no table entry for, or the graph's output.

Before: ``getitem = qkv[0]; getitem_1 = qkv[1]; getitem_2 = qkv[2]``
After:  ``unbind = torch.unbind(qkv); getitem = unbind[0]; getitem_1 = unbind[1]; getitem_2 = unbind[2]``
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import ops
from ..meta import OUT_INFOS, out_infos
from ..ops import Category
from .classify import is_inplace, op_key
from .context import PassContext

MAKES_NEW = (Category.ALLOW, Category.INFER, Category.DENY)
"""Table categories whose ops return a new tensor (a clear or pass op may return its input itself)."""


def unpack(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Rewrite each tensor's complete set of row selections into one ``unbind`` (see the module docstring)."""
    if not ctx.has_shapes:
        return
    for node in list(gm.graph.nodes):
        rows = _rows(node, gm)
        if rows is not None and all(_safe(g, gm) for g in rows):
            _to_unbind(gm, node, rows)


def _rows(node: fx.Node, gm: fx.GraphModule) -> list[fx.Node] | None:
    """``node[0] .. node[n-1]`` (the getitem nodes, in order) if ``node`` is a tensor whose static first
    dimension ``n`` they all select, each once; else ``None``."""
    infos, val = out_infos(node), node.meta.get("val")
    if not infos or len(infos) != 1 or not infos[0].shape or not isinstance(infos[0].shape[0], int) or (
            val is not None and not isinstance(val, torch.Tensor)):  # one tensor, not a tuple of one
        return None
    n = infos[0].shape[0]
    picks = {}
    for u in node.users:
        if u.op == "call_function" and u.target is operator.getitem and u.args[0] is node and not u.kwargs \
                and type(u.args[1]) is int and -n <= u.args[1] < n:
            picks.setdefault(u.args[1] % n, []).append(u)
        elif is_inplace(u, gm):
            return None  # the tensor itself is written: leave it as written
    if n < 2 or sorted(picks) != list(range(n)) or any(len(v) > 1 for v in picks.values()):
        return None
    rows = [picks[i][0] for i in range(n)]
    # each selection one row: not the items of a tuple holding one tensor (`out, _ = attention(...)`, whose
    # other item is None, shows one tensor's sizes too)
    row = (infos[0].shape[1:], infos[0].dtype)
    if any([(i.shape, i.dtype) for i in out_infos(g) or ()] != [row] for g in rows):
        return None
    return rows


def _safe(start: fx.Node, gm: fx.GraphModule) -> bool:
    """Does every use of ``start`` (through ops that may return their input) end in a new tensor?"""
    seen, stack = set(), [start]
    while stack:
        for u in stack.pop().users:
            if u in seen:
                continue
            seen.add(u)
            if u.op == "output" or is_inplace(u, gm):
                return False
            name = ops.lookup_name(op_key(u, gm)) if u.op in ("call_function", "call_method", "call_module") else None
            entry = ops.ENTRIES.get(name) if name is not None else None
            if entry is None:
                return False
            if entry.category not in MAKES_NEW:
                stack.append(u)
    return True


def _to_unbind(gm: fx.GraphModule, node: fx.Node, rows: list[fx.Node]) -> None:
    with gm.graph.inserting_after(node):
        unbind = gm.graph.call_function(torch.unbind, (node, 0))
    unbind.meta.update({k: v for k, v in rows[0].meta.items() if k == "nn_module_stack"})
    unbind.meta[OUT_INFOS] = tuple(info for g in rows for info in (out_infos(g) or ()))
    if all("val" in g.meta for g in rows):
        unbind.meta["val"] = tuple(g.meta["val"] for g in rows)
    for i, g in enumerate(rows):
        g.args = (unbind, i)
