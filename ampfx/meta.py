"""The keys ampfx writes into ``node.meta`` and ``gm.meta``, with typed accessors.

One module owns every key, so writer and reader cannot drift apart.
"""
from __future__ import annotations

import torch.fx as fx


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
