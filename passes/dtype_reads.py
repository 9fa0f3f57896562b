"""Pass: a tensor's ``.dtype`` read by the model's code is the dtype the model computed it in.

torch.fx records ``x.dtype`` as a node, so after conversion it would say ``bfloat16`` wherever ampfx
computes ``x`` low, and the model's own dtype logic would take that for the model's: a factory made
``dtype=x.dtype`` comes out low where the plan (and the model) has it float32, and an in-place op that
mixes it with a float32 tensor raises (``zeros(n).index_add_(0, i, ones_like(i, dtype=h.dtype))`` in a
scatter-based graph network). The plan of every pass is built on the model's dtypes, as a graph
``torch.export`` captures holds them as constants; with shapes, this pass makes an fx graph's dtype reads
those constants too (the converted module's input guards keep them true).

Before: ``getattr_1 = getattr(linear, 'dtype'); ones_like = torch.ones_like(dst, dtype=getattr_1)``
After:  ``ones_like = torch.ones_like(dst, dtype=torch.float32)``
"""
from __future__ import annotations

import builtins

import torch.fx as fx
from torch.fx.passes.shape_prop import TensorMetadata

from .. import ops
from ..meta import tensor_meta
from ..runtime import CASTABLE
from .context import PassContext


def fold_dtype_reads(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Replace each ``x.dtype`` of a float tensor whose dtype shape propagation recorded by that dtype (see the
    module docstring)."""
    if not ctx.has_shapes:
        return
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and node.target is builtins.getattr and len(node.args) == 2
                and node.args[1] in ops.DTYPE_ATTRS and isinstance(node.args[0], fx.Node)):
            continue
        meta = tensor_meta(node.args[0])
        if isinstance(meta, TensorMetadata) and meta.dtype in CASTABLE:
            node.replace_all_uses_with(meta.dtype)
            gm.graph.erase_node(node)
