"""A part's boundary: casting its float inputs to the dtypes its graph was converted for (parts
only: a graph converted below the model's root, whose inputs come from eager code around it), and
reading what a kept module's graph does at its boundary (:func:`ends`, for its caller's painting)."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from .. import ops, runtime
from ..meta import RECORD, record
from ..ops import Category, Result
from ..report.records import COMPUTE, CastInfo, Decision, Rule
from ..runtime import CASTABLE
from .cast_model import needed_casts, out_of
from .nodes import original_dtype
from .context import Ends, PassContext


def ends(gm: fx.GraphModule, ctx: PassContext) -> Ends:
    """What the painted graph of a kept module handed float32 (``ctx.arrive``) does at its boundary: the
    dtype its readers read each float32 input in, the dtype it computes each float output in.

    E.g. a block ``relu(bn(conv(x)))`` under bfloat16 reads ``x`` only through a cast to bfloat16 and
    computes its output in bfloat16 (cast back to float32 only to be returned): ``Ends((bf16,), (bf16,))``,
    so its caller hands it bfloat16 and takes bfloat16 back. A pre-norm transformer block reads ``x``
    in float32 only because it is handed float32 (its norm and residual add read a float32 stream:
    :data:`_HANDED`) and returns the float32 stream: ``Ends((None,), (fp32,))``, painted by its caller as an
    infer op.
    """
    reads = []
    for p in (n for n in gm.graph.nodes if n.op == "placeholder"):
        if out_of(p) != torch.float32:
            continue
        found = {_read_as(u, p, ctx, out_of) for u in p.users} - {_METADATA}
        reads.append(found.pop() if len(found) == 1 else None)
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    returns = tuple(out_of(v) for v in tree_leaves(output.args) if isinstance(v, fx.Node) and out_of(v) in CASTABLE)
    return Ends(reads=tuple(reads), returns=returns)


def output_dtypes(gm: fx.GraphModule) -> tuple[tuple[Any, Any], ...]:
    """For each float output of the converted ``gm``, in order: the dtype the model returned it in and the
    dtype the graph computes it in (before any cast for returning it)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    found = []
    for v in tree_leaves(output.args):
        if isinstance(v, fx.Node) and isinstance(record(v), CastInfo) and v.args:
            v = v.args[0]
        d = record(v) if isinstance(v, fx.Node) else None
        if isinstance(d, Decision) and d.out in CASTABLE:
            found.append((original_dtype(v), d.out))
    return tuple(found)


_METADATA = "metadata"


def _read_as(user: fx.Node, value: fx.Node, ctx: PassContext, out_of: Any) -> Any:
    """The dtype ``user`` reads the float32 ``value`` in; ``None`` where it reads it as it comes without
    computing (returns it, selects from it, writes it, converts it); :data:`_METADATA` for its size."""
    d = record(user)
    if not isinstance(d, Decision) or d.kind not in COMPUTE or d.inplace or d.rule is Rule.SELECT:
        return None
    if d.category is Category.PASS:
        entry = ops.ENTRIES.get(d.op)
        metadata = entry is not None and entry.result is Result.NONFLOAT and not entry.exact
        return _METADATA if metadata else None
    if d.dtype not in CASTABLE:
        return None
    if d.dtype == torch.float32 and d.rule in _HANDED:
        return None  # float32 because it was handed float32: the block's caller decides, not its ops
    casts = needed_casts(user, d.dtype, out_of, ctx.keeps_output_dtype)
    return next((to for v, to in casts if v is value), torch.float32)


_HANDED = frozenset({Rule.FIDELITY_STREAM, Rule.PAINT_DEFAULT})
"""Rules that make a reader float32 only because what it reads arrived float32 (a graph input read as a
float32 stream, an infer op with no low neighbour): in a kept module's graph, handed float32 to read its
boundary, they say nothing of what the module itself needs. A pre-norm block's norm and residual add read
its input so: its caller paints the call as an infer op, from its own neighbours."""


def cast_part_inputs(gm: fx.GraphModule, ctx: PassContext) -> None:
    """A part's float inputs are cast to the dtype its graph was converted for, whatever the eager
    code around it hands it: an input recorded as bfloat16 and handed float32 would otherwise reach
    a bfloat16 op, whose weight is cast, uncast (``mat1 and mat2 must have the same dtype``).
    Integer and bool inputs, and the casts ampfx already put on an input, are left alone; the cast
    does nothing when the dtype is already right.

    Before (``h`` recorded as bfloat16, ``linear`` in bfloat16)::

        linear = torch._C._nn.linear(h, weight_bf16)

    After::

        h_in = ampfx_runtime_cast(h, torch.bfloat16)
        linear = torch._C._nn.linear(h_in, weight_bf16)
    """
    if not ctx.prefix:  # the model's own inputs: the graph's input guards check them
        return
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    body = position[inputs[-1]] if inputs else -1
    for node in inputs:
        d = record(node)
        want = d.out if isinstance(d, Decision) else None
        # the checks of arguments fixed while tracing (interleaved with the placeholders, whatever op they
        # compare with) read them as handed: only the body after the last placeholder reads the cast
        users = [u for u in node.users
                 if position[u] > body and u.target not in (runtime.cast, runtime.assert_is_none)]
        if want not in runtime.CASTABLE or not users:
            continue
        with gm.graph.inserting_after(inputs[-1]):
            cast = gm.graph.create_node("call_function", runtime.cast, (node, want), {}, name=f"{node.name}_in")
        for user in users:
            user.replace_input_with(node, cast)
        cast.meta[RECORD] = CastInfo(node=cast.name, value=node.name, source="as handed", to=want,
                                     consumers=tuple(u.name for u in users),
                                     reason="part input: cast to the dtype its graph was converted for")
