"""Pass: a tensor unpacked into all its rows is one ``unbind``, as eager Python runs it.

``q, k, v = qkv`` runs ``qkv.unbind(0)`` in eager Python (``Tensor.__iter__``); torch.fx traces it
as ``qkv[0]``, ``qkv[1]``, ``qkv[2]``. Same values, but each selection's backward writes a zero
tensor of ``qkv``'s size and copies its gradient in, and autograd sums the three: a windowed-attention
block wrote 5% more bytes per training step than autocast. With shapes, where the selections
``x[0] .. x[n-1]`` of a tensor whose first dimension is ``n`` are all there, they become
``torch.unbind(x)`` and its items (one backward ``stack``).

Not where an unbind would raise and the selections do not: ``unbind``'s outputs may not be changed in
place, nor may their base, so every use of a selection, followed through ops that can return their
input (views, dropout, ``.to``), must end in an op that makes a new tensor (a GEMM, an elementwise op),
never in an in-place op, an op ampfx has no table entry for (a leaf of a class defined outside torch
counts as one), or the graph's output; and no view of the tensor's base may be written in place.
Negative indices are left as written (``x[-1]`` is the last row at every size).

Before: ``getitem = qkv[0]; getitem_1 = qkv[1]; getitem_2 = qkv[2]``
After:  ``unbind = torch.unbind(qkv); getitem = unbind[0]; getitem_1 = unbind[1]; getitem_2 = unbind[2]``
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.passes.shape_prop import TensorMetadata

from .. import ops
from ..meta import TENSOR_META, out_infos, tensor_meta
from ..ops import Category
from .nodes import is_inplace, op_key, view_group
from .context import PassContext

MAKES_NEW = (Category.ALLOW, Category.INFER, Category.DENY)
"""Table categories whose ops return a new tensor (a clear or pass op may return its input itself)."""


def unpack(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Rewrite each tensor's complete set of row selections into one ``unbind`` (see the module docstring)."""
    if not ctx.has_shapes:
        return
    for node in list(gm.graph.nodes):
        rows = _rows(node, gm)
        if rows is not None and _unwritten(node, gm) and all(_safe(g, gm) for g in rows):
            _to_unbind(gm, node, rows)


def _rows(node: fx.Node, gm: fx.GraphModule) -> list[fx.Node] | None:
    """``node[0] .. node[n-1]`` (the getitem nodes, in order) if ``node`` is a tensor whose static first
    dimension ``n`` they all select, each once; else ``None``."""
    infos = out_infos(node)
    if not infos or len(infos) != 1 or not infos[0].shape or not isinstance(infos[0].shape[0], int) or (
            not isinstance(tensor_meta(node), TensorMetadata)):  # one tensor, not a tuple of one
        return None
    n = infos[0].shape[0]
    picks = {}
    for u in node.users:
        if u.op == "call_function" and u.target is operator.getitem and u.args[0] is node and not u.kwargs \
                and type(u.args[1]) is int:
            if not 0 <= u.args[1] < n:  # x[-1] is the last row at any size, unbind(x)[n - 1] is not
                return None
            picks.setdefault(u.args[1], []).append(u)
    if n < 2 or sorted(picks) != list(range(n)) or any(len(v) > 1 for v in picks.values()):
        return None
    rows = [picks[i][0] for i in range(n)]
    # each selection one row: not the items of a tuple holding one tensor (`out, _ = attention(...)`, whose
    # other item is None, shows one tensor's sizes too)
    row = (infos[0].shape[1:], infos[0].dtype)
    if any([(i.shape, i.dtype) for i in out_infos(g) or ()] != [row] for g in rows):
        return None
    return rows


def _entry(n: fx.Node, gm: fx.GraphModule) -> ops.OpEntry | None:
    """``n``'s table entry where ampfx knows what it does to its input: not a leaf of a class defined
    outside torch (a subclass of ``nn.Linear`` may write its input in place), not an unlisted op."""
    if n.op not in ("call_function", "call_method", "call_module"):
        return None
    if n.op == "call_module" and not type(gm.get_submodule(str(n.target))).__module__.startswith("torch."):
        return None
    name = ops.lookup_name(op_key(n, gm))
    return ops.ENTRIES.get(name) if name is not None else None


def _unwritten(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Is no alias of ``node`` written in place: the tensor it views (up through view ops), and every
    view of that (``t.view(-1).mul_(2)`` after ``a, b = t`` makes unbind's outputs raise)? Every use of
    them must be an op ampfx knows."""
    group = view_group(node, lambda n: bool(n.args) and (e := _entry(n, gm)) is not None and e.view)
    return all(u.op == "output" or (not is_inplace(u, gm) and _entry(u, gm) is not None)
               for n in group for u in n.users)


def _safe(start: fx.Node, gm: fx.GraphModule) -> bool:
    """Does every use of ``start`` (through ops that may return their input) end in a new tensor?"""
    seen, stack = set(), [start]
    while stack:
        for u in stack.pop().users:
            if u in seen:
                continue
            seen.add(u)
            entry = _entry(u, gm)
            if u.op == "output" or is_inplace(u, gm) or entry is None:
                return False
            if entry.category not in MAKES_NEW:
                stack.append(u)
    return True


def _to_unbind(gm: fx.GraphModule, node: fx.Node, rows: list[fx.Node]) -> None:
    with gm.graph.inserting_after(node):
        unbind = gm.graph.call_function(torch.unbind, (node, 0))
    unbind.meta.update({k: v for k, v in rows[0].meta.items() if k == "nn_module_stack"})
    unbind.meta[TENSOR_META] = tuple(info for g in rows for info in (out_infos(g) or ()))
    if all("val" in g.meta for g in rows):
        unbind.meta["val"] = tuple(g.meta["val"] for g in rows)
    for i, g in enumerate(rows):
        g.args = (unbind, i)
