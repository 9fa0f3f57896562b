"""The cast model the passes share: which casts a node computing in a dtype needs, given the dtype each value
has (:func:`needed_casts`), what a float32 op reads as it is (type promotion, its own accumulation dtype), and the
dtype each argument slot takes. Painting weighs alternatives with it before anything is rewritten; the writes
pass decides with it; the casts pass carries it out. No pass decides here.
"""
from __future__ import annotations

from typing import Any, Callable, Collection

import torch
import torch.fx as fx

from .. import ops
from ..meta import out_infos, record
from ..ops import Category
from ..report.records import COMPUTE, Decision, Rule
from ..runtime import CASTABLE
from .nodes import original_dtype

Fixed = Collection[tuple[fx.Node, torch.dtype]]
"""Values with a bespoke conversion, as ``(value, dtype)``: a GEMM whose bias is added after its float32
cast has its own float32 form, which no other rule may bypass."""


def out_of(n: fx.Node) -> Any:
    """The dtype ``n``'s value has after conversion (its decision's ``out``), ``None`` if unknown."""
    d = record(n)
    return d.out if isinstance(d, Decision) else None


def _ndim(n: fx.Node) -> int | None:
    infos = out_infos(n)
    if not infos or len(infos) != 1:
        return None
    return len(infos[0].shape)


def slot_dtype(slot: int | str, entry: ops.OpEntry | None, want: torch.dtype) -> torch.dtype | None:
    """The dtype an argument slot is cast to: ``want``, float32 for pinned slots, ``None`` for index slots."""
    if entry is not None and slot in entry.index_args:
        return None
    return torch.float32 if entry is not None and slot in entry.fp32_args else want


def _takes(target: Any, name: str) -> bool:
    """Does ``target`` accept the keyword ``name``? ATen overloads say so in their schema
    (``aten.softmax.int`` takes ``dtype=``, ``aten._softmax`` does not); others are assumed to."""
    schema = getattr(target, "_schema", None)
    return schema is None or any(a.name == name for a in schema.arguments)


def promoted_inputs(node: fx.Node, entry: ops.OpEntry | None, want: torch.dtype,
                    out: Callable[[fx.Node], Any] = out_of, fixed: Fixed = ()) -> set[fx.Node]:
    """Low inputs of a float32 op that type promotion upcasts with no cast:
    the op ``promotes`` and another positional input is a float32 tensor with
    at least one dimension (a 0-dim tensor does not promote a dimensioned one).
    Inputs with a bespoke float32 form (``(value, float32) in fixed``) are not.
    ``out(value)`` is the dtype a value has (default: its decision's ``out``).

    E.g. Swin under float16: ``attn + mask``, attention scores in float16 and a
    float32 mask, adds in float32 without casting the scores first.
    """
    if entry is None or not entry.promotes or want != torch.float32:
        return set()
    tensors = [a for a in node.args if isinstance(a, fx.Node) and isinstance(record(a), Decision)]
    wide = [a for a in tensors if out(a) == torch.float32 and _ndim(a) not in (None, 0)]
    if not wide:
        return set()
    # a value with a bespoke float32 form (a GEMM whose bias is added after its float32 cast) is not promoted
    return {a for a in tensors if out(a) in (torch.float16, torch.bfloat16) and _ndim(a) is not None
            and (a, torch.float32) not in fixed}


def accumulates(node: fx.Node, entry: ops.OpEntry | None, want: torch.dtype, out: Callable[[fx.Node], Any],
                fixed: Fixed = ()) -> bool:
    """Does a float32 op take its low first input as is, accumulating through its own ``dtype=`` argument
    (``softmax(x, dim, dtype=torch.float32)``)?"""
    args = node.args
    return bool(entry is not None and entry.accum_dtype and want == torch.float32 and args
                and _takes(node.target, entry.accum_dtype) and isinstance(args[0], fx.Node)
                and node.kwargs.get(entry.accum_dtype) is None and len(args) < 4
                and out(args[0]) in (torch.float16, torch.bfloat16)
                and (args[0], torch.float32) not in fixed)  # a split bias must be added first


def needed_casts(node: fx.Node, want: torch.dtype | None, out_of: Callable[[fx.Node], Any],
                 keep_output_dtype: bool) -> set[tuple[fx.Node, torch.dtype]]:
    """The ``(value, dtype)`` casts :func:`~ampfx.passes.casts.insert_casts` would give ``node`` if it
    computed in ``want`` and every value had the dtype ``out_of(value)``; for
    weighing alternatives before anything is rewritten (``paint``, step 7).
    Ignores the linear-bias split, which only removes casts."""
    d = record(node)
    pairs: set[tuple[fx.Node, torch.dtype]] = set()

    def need(value: fx.Node, dtype: torch.dtype | None) -> None:
        src = out_of(value)
        if dtype is not None and src in CASTABLE and src != dtype:
            pairs.add((value, dtype))

    if not isinstance(d, Decision):
        return pairs
    if d.kind == "output":
        if keep_output_dtype:
            fx.map_arg(node.args, lambda n: need(n, original_dtype(n)))
        return pairs
    if (d.kind not in COMPUTE or d.inplace or d.category is Category.PASS or want not in CASTABLE
            or d.rule is Rule.SELECT):
        return pairs
    entry = ops.ENTRIES.get(d.op)
    start = 1 if accumulates(node, entry, want, out_of) else 0
    promoted = promoted_inputs(node, entry, want, out_of)
    for i, arg in enumerate(node.args[start:], start):
        if arg not in promoted:
            fx.map_arg(arg, lambda n, dt=slot_dtype(i, entry, want): need(n, dt))
    for k, arg in node.kwargs.items():
        if k != (entry.accum_dtype if entry else None):
            fx.map_arg(arg, lambda n, dt=slot_dtype(k, entry, want): need(n, dt))
    return pairs


def upcast_reads(node: fx.Node, want: torch.dtype | None, out_of: Callable[[fx.Node], Any]) -> set[fx.Node]:
    """The low inputs ``node``, computing in ``want``, reads as they are and upcasts itself (its own
    ``dtype=`` argument, type promotion): no cast forward, but one backward (autograd casts the
    gradient to the input's dtype)."""
    d = record(node)
    if not isinstance(d, Decision) or d.kind not in COMPUTE or d.category is Category.PASS or d.inplace:
        return set()
    entry = ops.ENTRIES.get(d.op)
    reads = promoted_inputs(node, entry, want, out_of) if want == torch.float32 else set()
    return reads | ({node.args[0]} if accumulates(node, entry, want, out_of) else set())


def fp32_slot_inputs(node: fx.Node, entry: ops.OpEntry | None) -> list[fx.Node]:
    """The input nodes in the slots ``entry`` pins to float32 (``OpEntry.fp32_args``: a norm's
    running statistics, weight and bias), in slot order."""
    found: dict[fx.Node, None] = {}
    for slot in entry.fp32_args if entry is not None else ():
        arg = node.args[slot] if isinstance(slot, int) and slot < len(node.args) else (
            node.kwargs.get(slot) if isinstance(slot, str) else None)
        fx.map_arg(arg, lambda n: found.setdefault(n))
    return list(found)
