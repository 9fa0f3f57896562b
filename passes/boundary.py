"""Casting a region's float inputs to the dtypes its graph was converted for (regions only: a graph
converted below the model's root, whose inputs come from eager code around it)."""
from __future__ import annotations

import torch.fx as fx

from .. import runtime
from ..meta import RECORD, record
from ..report.records import CastInfo, Decision
from .context import PassContext


def cast_region_inputs(gm: fx.GraphModule, ctx: PassContext) -> None:
    """A region's float inputs are cast to the dtype its graph was converted for, whatever the eager
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
    for node in inputs:
        d = record(node)
        want = d.out if isinstance(d, Decision) else None
        # the checks of arguments fixed while tracing (interleaved with the placeholders) read them as handed
        users = [u for u in node.users if u.target not in (runtime.cast, runtime.assert_is_none)]
        if want not in runtime.CASTABLE or not users:
            continue
        with gm.graph.inserting_after(inputs[-1]):
            cast = gm.graph.create_node("call_function", runtime.cast, (node, want), {}, name=f"{node.name}_in")
        for user in users:
            user.replace_input_with(node, cast)
        cast.meta[RECORD] = CastInfo(node=cast.name, value=node.name, source="as handed", to=want,
                                     consumers=tuple(u.name for u in users),
                                     reason="region input: cast to the dtype its graph was converted for")
