"""Pass: TF-AMP's painting, then the dtype of every value after conversion.

Nodes on the four lists are painted (shared/REFERENCE.md, steps 1-5), after step 0: the GEMMs kept float32 by
their size alone that sit between low neighbours get the low dtype back where that casts no more
(:mod:`ampfx.passes.between_low`, not TF-AMP's; it paints the graph both ways to count):

1. every ALLOW node is low precision;
2. deny propagation: from each DENY node walk forward into INFER/CLEAR nodes
   that lead (through CLEAR nodes) to an INFER or DENY node; paint them float32;
   2b. fidelity (:mod:`ampfx.passes.fidelity`, not TF-AMP's): float32 values
   stay float32 where autocast's type promotion keeps them: residual streams,
   carried states, positions, adds of float32 parameters, values that reach an
   integer conversion or comparison. These nodes block steps 3-5 as denied ones do;
3. between-allow: INFER/CLEAR nodes on a path from one low node to another
   (not through float32 nodes) go low;
4. follow-allow, in graph order: a CLEAR node fed by a low node and no deny
   node goes low; so does an INFER node under bfloat16 (TF-AMP's bf16 entry),
   and under float16 when *all* its float inputs are low (it then runs in its
   inputs' dtype, as autocast would; range-risky ops are on the fp16 deny list);
5. clear propagation: CLEAR nodes next to low nodes go low, both directions.

Steps 4 and 5 repeat until nothing changes. Step 6 moves an infer/clear op
painted low to float32 where that removes a cast and adds none; step 7 moves a
whole connected cluster of them where that needs fewer casts and moves no more
bytes (a cluster of clear ops only, whose values are the same either way, may move
up to :data:`LAUNCH_BYTES` more per cast saved). A slot the op's entry pins to
float32 (a norm's weight and bias, ``OpEntry.fp32_args``) is not counted as a
float input in step 4.

Unpainted INFER/CLEAR nodes stay float32. Then, in graph order, every node
gets ``out``: the dtype of the value it produces once converted. An in-place
op computes in the dtype of the tensor it mutates, whatever its paint.

Before (categories)::  linear[allow] -> add[infer] -> relu[clear] -> linear_1[allow] -> softmax[deny]
After (dtypes)::       bf16          -> bf16       -> bf16        -> bf16              -> float32
"""
from __future__ import annotations

import dataclasses
from collections import deque
from typing import Callable, Iterable

import torch
import torch.fx as fx

from .. import ops
from ..meta import RECORD, decision, out_infos
from ..ops import Category, Result
from ..report.records import GEMM_COST_RULES, Decision, Rule, dtype_name
from ..runtime import CASTABLE
from .context import PassContext
from . import between_low, fidelity
from .cast_model import fp32_slot_inputs, needed_casts, upcast_reads
from .nodes import DYNAMIC, carries_float, elements, joined, original_dtype, pass_result, selects_float, written

PAINTABLE = (Category.ALLOW, Category.INFER, Category.CLEAR, Category.DENY)
SIZE_RULES = (Rule.SHAPE_SMALL_REDUCTION, Rule.SHAPE_LARGE_REDUCTION, Rule.SHAPE_SIZE_UNKNOWN)
Neighbours = Callable[[fx.Node], list[fx.Node]]
Color = dict[fx.Node, tuple[torch.dtype, Rule, str]]  # node -> (dtype, entry, reason) painted so far


def _walk(starts: Iterable[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]],
          ok: Callable[[fx.Node], bool]) -> dict[fx.Node, fx.Node]:
    """Breadth-first from ``starts`` through nodes passing ``ok``; maps each
    reached node to the start it was reached from."""
    seen: dict[fx.Node, fx.Node] = {}
    queue = deque((s, s) for s in starts)
    while queue:
        node, origin = queue.popleft()
        for nxt in step(node):
            if nxt not in seen and ok(nxt):
                seen[nxt] = origin
                queue.append((nxt, origin))
    return seen


def paint(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Set ``dtype``, ``rule``, ``reason`` and ``out`` of every Decision, after giving the low dtype back to the
    small GEMMs between low neighbours where that casts no more (step 0, :mod:`ampfx.passes.between_low`)."""
    between_low.lower(gm, ctx, _paint)
    _paint(gm, ctx)


def _paint(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Steps 1-7 (see the module docstring)."""
    low = ctx.policy.dtype
    nodes = list(gm.graph.nodes)
    cat = {n: decision(n).category for n in nodes}
    paintable = {n for n in nodes if cat[n] in PAINTABLE}

    def ins(n: fx.Node) -> list[fx.Node]:
        return [p for p in n.all_input_nodes if p in paintable]

    def outs(n: fx.Node) -> list[fx.Node]:
        return [u for u in n.users if u in paintable]

    # 1. allow; an integration may have chosen the dtype already (DGL: bfloat16 under float16 on CPU)
    allow = [n for n in nodes if cat[n] is Category.ALLOW]
    color: Color = {n: (decision(n).dtype or low, decision(n).rule, decision(n).reason) for n in allow}
    decided = {n: decision(n) for n in nodes}
    u_set = _leads_to_infer_or_deny(nodes, cat, ins)
    denied = _deny_propagation(nodes, cat, u_set, outs, color)
    # 2b. fidelity: float32 values stay float32 where type promotion keeps them (residual streams, positions)
    denied |= fidelity.float32_values(nodes, cat, decided, u_set, color, denied, ctx.policy)
    _between_allow(allow, cat, ins, outs, color, denied, low)
    # 4. follow-allow, in graph order: a clear op fed by a low op and no deny op goes low; an infer op
    #    does too under bfloat16 (float32's range), and under float16 only when all its float inputs are
    #    low (then it runs in its inputs' dtype, as under autocast; range-risky ops are on the float16
    #    deny list)
    #    Steps 4 and 5 repeat until nothing changes: a clear op painted in 5 can make an infer op's
    #    inputs all low.
    while True:
        painted = len(color)
        _follow_allow(nodes, cat, color, denied, decided, low)
        _clear_propagation(cat, ins, outs, color, low)
        if len(color) == painted:
            break
    _save_casts(nodes, cat, color, denied, decided, low, ctx.keeps_output_dtype)
    _record_paint(nodes, cat, ins, outs, color, low)
    _values(gm, low)
    if _float32_clusters(gm, ctx):
        _values(gm, low)


def _leads_to_infer_or_deny(nodes: list[fx.Node], cat: dict, ins: Neighbours) -> set[fx.Node]:
    """TF-AMP's U: the infer/deny nodes and the clear nodes leading to them through clear nodes."""
    seeds = [n for n in nodes if cat[n] in (Category.DENY, Category.INFER)]
    return set(seeds) | set(_walk(seeds, ins, lambda p: cat[p] is Category.CLEAR))


def _deny_propagation(nodes: list[fx.Node], cat: dict, u_set: set[fx.Node], outs: Neighbours,
                      color: Color) -> set[fx.Node]:
    """Step 2: paint float32 the infer/clear nodes a deny node reaches through
    U (:func:`_leads_to_infer_or_deny`). Returns the denied nodes: the deny
    nodes and every node painted float32 so far."""
    deny = [n for n in nodes if cat[n] is Category.DENY]
    for n, origin in _walk(deny, outs, lambda c: c in u_set and cat[c] is not Category.DENY).items():
        color[n] = (torch.float32, Rule.PAINT_DENY, f"follows {_deny_word(origin)} {origin.name!r} "
                    f"({decision(origin).op}) through infer/clear ops: float32")
    return {n for n, c in color.items() if c[0] == torch.float32} | set(deny)


def _deny_word(node: fx.Node) -> str:
    """What a float32 origin is, in a follower's reason: a ``deny`` op, or a GEMM kept float32 by its cost."""
    rule = decision(node).rule
    return f"a GEMM kept float32 by its cost ({rule.value})" if rule in GEMM_COST_RULES else "deny op"


def _between_allow(allow: list[fx.Node], cat: dict, ins: Neighbours, outs: Neighbours, color: Color,
                   denied: set, low: torch.dtype) -> None:
    """Step 3: infer/clear nodes on a path from one low node to another, not
    through denied nodes, go low."""
    def passable(n: fx.Node) -> bool:
        return cat[n] in (Category.INFER, Category.CLEAR) and n not in denied

    forward = _walk(allow, outs, passable)
    for n, origin in _walk(allow, ins, lambda p: p in forward).items():
        if n not in color:
            # both ends in another low dtype an integration chose (DGL under float16 on CPU): that dtype
            ends = {color[forward[n]][0], color[origin][0]}
            dtype = ends.pop() if len(ends) == 1 else low
            color[n] = (dtype, Rule.PAINT_BETWEEN_ALLOW,
                        f"between low-precision ops ({forward[n].name} ... {origin.name}): {dtype_name(dtype)}")


def _clear_propagation(cat: dict, ins: Neighbours, outs: Neighbours, color: Color, low: torch.dtype) -> None:
    """Step 5: unpainted clear nodes next to low nodes go low, both directions."""
    lows = [n for n, c in color.items() if c[0] == low]
    both = lambda n: [*ins(n), *outs(n)]  # noqa: E731
    for n, origin in _walk(lows, both, lambda c: cat[c] is Category.CLEAR and c not in color).items():
        color[n] = (low, Rule.PAINT_CLEAR, f"clear op next to low-precision {origin.name}: {dtype_name(low)}")


def _record_paint(nodes: list[fx.Node], cat: dict, ins: Neighbours, outs: Neighbours, color: Color,
                  low: torch.dtype) -> None:
    """Write the paint into the records; unpainted infer/clear nodes stay float32
    (``paint:default``). A size rule's reason is kept at the end of the new one."""
    for n in nodes:
        d: Decision = decision(n)
        earlier = f" ({d.reason})" if d.rule in SIZE_RULES else ""  # keep the size facts
        if d.rule is Rule.KEPT:  # a kept module's call: the boundary's dtype, under its own rule and words
            painted = color.get(n, (torch.float32, None, "no low-precision neighbour path"))
            n.meta[RECORD] = dataclasses.replace(d, dtype=painted[0], reason=f"{d.reason}: {dtype_name(painted[0])} "
                                                                             f"({painted[2]})")
            continue
        if n in color and color[n][1] in fidelity.RULES and not any(
                color.get(p, (None,))[0] == low for p in (*ins(n), *outs(n))):
            del color[n]  # float32 with no low neighbour: no fidelity rule was needed (paint:default)
        if n in color:
            dtype, rule, reason = color[n]
            d = dataclasses.replace(d, dtype=dtype, rule=rule, reason=reason + earlier)
        elif cat[n] in (Category.INFER, Category.CLEAR):
            near = [p.name for p in (*ins(n), *outs(n)) if color.get(p, (None,))[0] == low]
            why = (f"not between low-precision ops, and not all its float inputs are {dtype_name(low)} "
                   f"(low neighbours: {', '.join(near)})" if near else "with no low-precision neighbour path")
            d = dataclasses.replace(d, dtype=torch.float32, rule=Rule.PAINT_DEFAULT,
                                    reason=f"{cat[n].value} op {why}: float32" + earlier)
        n.meta[RECORD] = d


def _follow_allow(nodes: list[fx.Node], cat: dict, color: dict, denied: set, decided: dict,
                  low: torch.dtype) -> None:
    """Step 4, one pass in graph order (see the module docstring)."""
    low_name = dtype_name(low)
    for n in nodes:
        if n in color or n in denied or cat[n] not in (Category.INFER, Category.CLEAR):
            continue
        pinned = _fp32_slot_inputs(n)  # statistics/affine slots stay float32 whatever the op's dtype
        feeds = [p for p in n.all_input_nodes if carries_float(p, decided) and p not in pinned]
        lows = [p for p in feeds if _painted(p, color, decided) == low]
        if not lows or any(p in denied and not (cat[n] is Category.INFER and fidelity.small_factor(p, n, cat))
                           for p in feeds):
            continue
        if cat[n] is Category.CLEAR:
            color[n] = (low, Rule.PAINT_FOLLOW_ALLOW, f"clear op fed by low-precision {lows[0].name}: {low_name}")
        elif low == torch.bfloat16:
            color[n] = (low, Rule.PAINT_FOLLOW_ALLOW,
                        f"fed by low-precision {lows[0].name} and no deny op; bfloat16 has float32's range")
        elif len(lows) == len(feeds):
            color[n] = (low, Rule.PAINT_FOLLOW_ALLOW,
                        f"all float inputs are {low_name} ({', '.join(p.name for p in lows)}): runs in their dtype")


def _painted(n: fx.Node, color: Color, decided: dict) -> object:
    """The dtype painted so far for ``n``'s value: its own paint; for an in-place op (``zeros_like(h).index_add_(...)``)
    its target's, for a selection its source's, for a factory that takes its argument's dtype (``zeros_like(h)``)
    that argument's; ``None`` where nothing is painted yet."""
    seen = 0
    while n not in color and seen < 16:
        d, seen = decided[n], seen + 1
        first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if d.inplace and isinstance(written(n), fx.Node):
            n = written(n)
        elif first is not None and (d.rule is Rule.SELECT or (
                d.category is Category.PASS and pass_result(n, d, {first: _MARK}) is _MARK)):
            n = first
        else:
            return None
    return color[n][0] if n in color else None


_MARK = object()


def _save_casts(nodes: list[fx.Node], cat: dict, color: dict, denied: set, decided: dict,
                low: torch.dtype, keep_output_dtype: bool) -> None:
    """Step 6: an infer/clear op painted low whose every user computes in
    float32, and whose every float input is float32 or cast to float32 for
    another user anyway, computes in float32 instead: its output cast goes and
    no cast is added (fewer bytes too: the op writes what the cast wrote).
    In reverse graph order, so chains of such ops all move.

    E.g. GPT-2's tanh GELU under float16, where ``pow`` is on the deny list:
    ``0.5 * x`` only feeds the float32 product, and ``x`` is cast for ``pow``.
    Or logits returned as a float32 output whose view feeds the loss: the view
    is taken of the float32 copy instead of being cast a second time.
    """
    def wants_fp32(u: fx.Node, value: fx.Node) -> bool:  # takes value as a float32 copy (not through dtype=)
        if u.op == "output":  # outputs return in their original dtype
            return keep_output_dtype and original_dtype(value) == torch.float32
        entry = ops.ENTRIES.get(decided[u].op)
        if entry is not None and entry.accum_dtype:
            return False
        return u in denied or color.get(u, (None,))[0] == torch.float32

    for n in reversed(nodes):
        if color.get(n, (None,))[0] != low or cat[n] not in (Category.INFER, Category.CLEAR):
            continue
        if decided[n].inplace or not n.users or not all(wants_fp32(u, n) for u in n.users):
            continue
        pinned = _fp32_slot_inputs(n)
        feeds = [p for p in n.all_input_nodes if carries_float(p, decided) and p not in pinned]
        low_feeds = [p for p in feeds if color.get(p, (None,))[0] == low]
        if any(not any(u is not n and wants_fp32(u, p) for u in p.users) for p in low_feeds):
            continue
        users = ", ".join(u.name for u in n.users)
        color[n] = (torch.float32, Rule.PAINT_SAVE_CAST,
                    f"every user ({users}) computes in float32 and its inputs are cast to float32 anyway: "
                    "float32 saves a cast")


LAUNCH_BYTES = 64 * 1024
"""What a cast costs beyond its bytes, in bytes: its launch. ``benchmarks/cast_launch.py`` measures it: on one
core of an x86 CPU with torch 2.13 a bfloat16 cast's launch (2 us) costs what moving 70 KiB costs, a float16
cast's 144 KiB; on a GPU a launch (a few us) is worth megabytes. This is a round figure below those. Counted
where only cost differs: a cluster of clear ops (copies, concatenations, views) holds the same values cast before
it or after it. A diffusion model's timestep embedding ``cat([cos(t), sin(t)])`` feeding a GEMM is cast once after
the ``cat`` rather than twice before it; a recommender's float32 embedding lookups are stacked beside its low
dense features in float32 and cast once, rather than each cast before the stack."""


def _float32_clusters(gm: fx.GraphModule, ctx: PassContext) -> bool:
    """Step 7: a connected cluster of infer/clear ops painted low computes in
    float32 instead when that needs fewer casts and moves no more bytes; a
    cluster of clear ops only may move :data:`LAUNCH_BYTES` more per cast saved
    (its values do not depend on where the cast is). Returns whether any cluster moved.

    Casts are counted as :func:`~ampfx.passes.cast_model.needed_casts` would insert
    them (one per value and dtype, shared with consumers outside the cluster;
    type promotion reads low inputs of a float32 add/mul beside a float32
    tensor directly). A graph converted in training mode also weighs the
    gradients: each cast has one in backward, and so has each low value a
    float32 op reads as it is (:func:`~ampfx.passes.cast_model.upcast_reads`).
    Bytes are those the cluster's ops and its casts read and write, from the
    example shapes (each value counts as one element without).

    E.g. ``exp(gemm(x) * scale)`` under bfloat16: step 4 paints the product
    low (fed by a GEMM), so the float32 ``scale`` is cast down and the product
    up for ``exp``. In float32 the product reads the GEMM's output as it is and
    nothing is cast. Clusters with a low consumer (another GEMM) stay low: in
    float32 they would need a cast for it. Nor do a CNN's pooled features
    ``cat([f.mean((2, 3)) for f in stages])`` in training: in float32 each mean
    reads its low stage as it is, and each gradient is cast back.
    """
    low, keep = ctx.policy.dtype, ctx.keeps_output_dtype
    nodes = list(gm.graph.nodes)
    dec = {n: decision(n) for n in nodes}
    current = lambda n: dec[n].out  # noqa: E731
    needs = {n: needed_casts(n, dec[n].dtype, current, keep) for n in nodes}  # node -> its (value, dtype) casts
    users_of: dict[tuple, set[fx.Node]] = {}  # (value, dtype) -> the nodes that need that cast
    for n, pairs in needs.items():
        for pair in pairs:
            users_of.setdefault(pair, set()).add(n)

    moved = False
    clusters = _low_clusters(nodes, dec, low)
    for cluster in [*clusters, *([n] for c in clusters if len(c) > 1 for n in c if _joins(n, dec))]:
        if any(dec[n].out != low for n in cluster):
            continue  # moved with its whole cluster
        members = set(cluster)
        consumers = {u for n in cluster for u in n.users if u not in members}
        if any(dec[u].inplace or (dec[u].category is Category.PASS and dec[u].rule is not Rule.SELECT
                                  and dec[u].out in CASTABLE) for u in consumers):
            continue  # a consumer whose own dtype would follow the cluster's: leave it
        touched = members | consumers
        cost = {option: _cluster_cost(cluster, touched, option, dec, users_of, keep, ctx)
                for option in (low, torch.float32)}
        (n_low, up_low, bytes_low, _), (n_fp32, up_fp32, bytes_fp32, per_node) = cost[low], cost[torch.float32]
        exact = all(dec[n].category is Category.CLEAR for n in cluster)  # same values cast before or after
        launches = (n_low - n_fp32) * LAUNCH_BYTES if exact else 0
        if not (n_fp32 < n_low and bytes_fp32 <= bytes_low + launches):
            continue
        if gm.training and 2 * n_fp32 + up_fp32 >= 2 * n_low + up_low:
            continue  # a step's casts, gradients included
        grads = f" (and {up_fp32} gradient casts of low values it reads as they are)" if gm.training and up_fp32 else ""
        _move_to_float32(cluster, dec, f"{n_low} casts -> {n_fp32}{grads}, bytes moved {bytes_low:,} -> {bytes_fp32:,}")
        for n in touched:
            for pair in needs[n]:
                users_of[pair].discard(n)
            needs[n] = per_node[n]
            for pair in needs[n]:
                users_of.setdefault(pair, set()).add(n)
        moved = True
    return moved


def _joins(n: fx.Node, dec: dict[fx.Node, Decision]) -> bool:
    """Does ``n`` join float values into one without changing them (``cat``, ``stack``: a clear op, not a view,
    with two or more float inputs)? Such an op is weighed on its own too when its cluster stays low: eight
    float32 embedding lookups stacked beside one low feature are stacked in float32 and cast once."""
    if dec[n].category is not Category.CLEAR or ops.is_view(dec[n].op) or dec[n].rule is Rule.SELECT:
        return False
    return sum(1 for p in n.all_input_nodes if dec[p].out in CASTABLE) >= 2


def _low_clusters(nodes: list[fx.Node], dec: dict[fx.Node, Decision], low: torch.dtype) -> list[list[fx.Node]]:
    """The connected clusters (in graph order) of infer/clear ops whose value is
    ``low``, not in place; a selection joins only when what it selects from does."""
    def candidate(n: fx.Node) -> bool:
        d = dec[n]
        if d.out != low or d.category not in (Category.INFER, Category.CLEAR) or d.inplace:
            return False
        return d.rule is not Rule.SELECT or bool(n.args and isinstance(n.args[0], fx.Node) and candidate(n.args[0]))

    clusters: dict[fx.Node, list[fx.Node]] = {}
    for n, root in joined([n for n in nodes if candidate(n)]).items():
        clusters.setdefault(root, []).append(n)
    return list(clusters.values())


def _cluster_cost(cluster: list[fx.Node], touched: set[fx.Node], option: torch.dtype, dec: dict[fx.Node, Decision],
                  users_of: dict[tuple, set[fx.Node]], keep: bool,
                  ctx: PassContext) -> tuple[int, int, int, dict[fx.Node, set]]:
    """``(casts, upcast reads, bytes moved, each touched node's casts)`` if ``cluster``'s
    values were ``option``: the casts no node outside ``touched`` shares, the low values
    touched nodes read as they are in float32, the bytes the casts and the cluster's ops
    (views aside) read and write."""
    members = set(cluster)
    out_of = (lambda n: option if n in members else dec[n].out)
    want = {n: option if n in members and dec[n].rule is not Rule.SELECT else dec[n].dtype for n in touched}
    per_node = {n: needed_casts(n, want[n], out_of, keep) for n in touched}
    new = {pair for pairs in per_node.values() for pair in pairs if not (users_of.get(pair, set()) - touched)}
    upcasts = sum(len(upcast_reads(n, want[n], out_of)) for n in touched)
    moved_bytes = sum(_numel(v, ctx) * (_itemsize(out_of(v)) + _itemsize(to)) for v, to in new)
    for n in cluster:  # the cluster's ops read their inputs and write their outputs
        if ops.is_view(dec[n].op):
            continue
        casted = dict(per_node[n])
        moved_bytes += _numel(n, ctx) * _itemsize(option) + sum(
            _numel(p, ctx) * _itemsize(casted.get(p, out_of(p))) for p in n.all_input_nodes
            if out_of(p) in CASTABLE)
    return len(new), upcasts, moved_bytes, per_node


def _move_to_float32(cluster: list[fx.Node], dec: dict[fx.Node, Decision], counts: str) -> None:
    """Record that ``cluster`` computes (selections aside) and produces float32."""
    names = ", ".join(n.name for n in cluster[:4]) + (f" and {len(cluster) - 4} more" if len(cluster) > 4 else "")
    for n in cluster:
        if dec[n].rule is not Rule.SELECT:
            dec[n] = dataclasses.replace(
                dec[n], dtype=torch.float32, rule=Rule.PAINT_SAVE_CAST,
                reason=f"its cluster of infer/clear ops ({names}) computes in float32: {counts} "
                       f"(was {dec[n].rule})")
        dec[n] = n.meta[RECORD] = dataclasses.replace(dec[n], out=torch.float32)


def _numel(n: fx.Node, ctx: PassContext) -> int:
    """Elements of ``n``'s first output (symbolic sizes at their least; 1 if unknown)."""
    least = (lambda count: ctx.symbols.bounds(count)[0]) if ctx.symbols is not None else (lambda count: None)
    return max(elements(n, least), 1)


def _itemsize(dtype: object) -> int:
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 0


def _fp32_slot_inputs(n: fx.Node) -> set[fx.Node]:
    """Input nodes in the slots the op's rule pins to float32 (``OpEntry.fp32_args``):
    a layer norm's weight and bias are float32 whatever dtype its data runs in."""
    return set(fp32_slot_inputs(n, ops.ENTRIES.get(decision(n).op)))


def _selects(n: fx.Node, d: Decision) -> bool:
    """Does the op take a part of its first argument and keep its dtype (``OpEntry.select``: ``x[i]``)?
    An op whose result is non-float by default (``getattr``: ``x.shape``) selects only where shapes
    show it returns a float tensor (``torch.topk(x, k).values``)."""
    entry = ops.ENTRIES.get(d.op)
    if entry is None or not entry.select:
        return False
    return selects_float(n, entry) if entry.result is Result.NONFLOAT else True


def _values(gm: fx.GraphModule, low: torch.dtype) -> None:
    """Fill ``out`` for every node, in graph order; in-place ops follow their target."""
    out: dict[fx.Node, object] = {}
    for n in gm.graph.nodes:
        d: Decision = decision(n)
        if d.kind in ("placeholder", "get_attr"):
            out[n] = d.out
        elif d.kind == "output":
            out[n] = None
        elif d.inplace and isinstance(written(n), fx.Node):  # x.add_(y), torch.mm(a, b, out=t)
            target = out.get(written(n))
            dtype = target if isinstance(target, torch.dtype) else None
            if d.category is not Category.PASS:
                held = "run-time" if target == DYNAMIC else dtype_name(target, none="")
                d = dataclasses.replace(d, dtype=dtype, rule=Rule.INPLACE,
                                        reason=f"in-place op keeps the dtype of {written(n).name} ({held})")
            out[n] = target
        elif _selects(n, d) and n.args and isinstance(n.args[0], fx.Node):
            out[n] = out.get(n.args[0])
            if out[n] is None:  # an item of a non-tensor container (DGL's nodes.data['h']): its own dtype
                infos = out_infos(n)
                floats = [i.dtype for i in infos or () if i.dtype in CASTABLE]
                out[n] = floats[0] if floats else (DYNAMIC if infos is None else None)
            src = out[n]
            d = dataclasses.replace(d, dtype=src if isinstance(src, torch.dtype) else None, rule=Rule.SELECT,
                                    reason="selects from its input; keeps the input's dtype (consumers cast the "
                                           "selection, which is smaller)")
        elif d.category is Category.PASS:
            out[n] = pass_result(n, d, out)
        elif d.rule is Rule.OTHER_FLOAT:  # runs as written: what it produced before conversion
            floats = [i.dtype for i in out_infos(n) or () if i.dtype.is_floating_point or i.dtype.is_complex]
            out[n] = floats[0] if floats else (d.dtype or DYNAMIC)
        else:
            infos = out_infos(n)
            out[n] = d.dtype if infos is None or any(i.dtype in CASTABLE for i in infos) else None
        n.meta[RECORD] = dataclasses.replace(d, out=out[n])
