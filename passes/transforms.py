"""Lowering: each torch.func level a graph opens (``torch.vmap``, as torch.export writes it) runs as one eager call.

torch.export writes ``torch.vmap`` as calls that open a level, move tensors into it, compute on batched tensors
and close it again (``_vmap_increment_nesting``, ``_add_batch_dim``, ..., ``_remove_batch_dim``,
``_vmap_decrement_nesting``): Hugging Face's attention masks are built so. Run eagerly they work; traced by
``torch.compile`` they do not (dynamo runs them on fake batched tensors: ``NYI: querying is_contiguous inside of
vmap``), where ``torch.compile`` of the model's own Python, which calls ``torch.vmap``, traces it as one
higher-order op. So after the passes (the report keeps every node), each outermost level, from the call that
opens it to the one that closes it, becomes a graph module of its own, called through
:func:`ampfx.runtime.eager_region`, which ``torch.compile`` runs outside its graph (a graph break). Its nodes,
their dtypes and casts are as the passes left them.

Before: ``_vmap_increment_nesting(n, 'error'); b = _add_batch_dim(arange, 0, 1); ...; m = _remove_batch_dim(x, 1,
n, 0); _vmap_decrement_nesting(); y = m.unsqueeze(0)``
After:  ``region = ampfx_runtime_eager_region(self._ampfx_region0, arange, n, ...); m = region[0];
y = m.unsqueeze(0)``
"""
from __future__ import annotations

import operator

import torch.fx as fx

from .. import ops, runtime
from ..meta import RECORD
from ..ops import Category
from ..report.records import Decision, Rule

PREFIX = "_ampfx_region"
"""Attribute name prefix of the graph modules the levels become (the converted module's own, never the model's)."""


def outline_transforms(gm: fx.GraphModule) -> int:
    """Make each outermost torch.func level of ``gm``'s graph one eager call (see the module docstring); the
    number of levels. The caller recompiles."""
    nodes = list(gm.graph.nodes)
    made, i = 0, 0
    while i < len(nodes):
        if nodes[i].op == "call_function" and nodes[i].target in ops.TRANSFORM_OPENS:
            end = _closing(nodes, i)
            if end is None:
                return made  # a level never closed: left as traced
            start = i - 1 if i and nodes[i - 1].target in ops.TRANSFORM_SETUP else i
            _outline(gm, nodes[start:end + 1], f"{PREFIX}{made}")
            made += 1
            i = end + 1
        else:
            i += 1
    return made


def _closing(nodes: list[fx.Node], start: int) -> int | None:
    """Index of the call that closes the level ``nodes[start]`` opens (levels opened inside it closed first)."""
    depth = 0
    for j in range(start, len(nodes)):
        target = nodes[j].target if nodes[j].op == "call_function" else None
        if target in ops.TRANSFORM_OPENS:
            depth += 1
        elif target in ops.TRANSFORM_CLOSES:
            depth -= 1
            if depth == 0:
                return j
    return None


def _outline(gm: fx.GraphModule, region: list[fx.Node], name: str) -> None:
    """Replace ``region`` (consecutive nodes) by a call of a graph module made of them, taking the values it reads
    from outside and returning those read after it."""
    inside = set(region)
    inputs = list(dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in region:
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(tuple(env[o] for o in outputs))
    level = fx.GraphModule(gm, sub, class_name="TransformLevel")
    level._tracer_cls = runtime.Retracer  # a pickle re-traces its code with torch.func's calls as they are
    setattr(gm, name, level)
    graph = gm.graph
    with graph.inserting_before(region[0]):
        module = graph.get_attr(name)
        call = graph.call_function(runtime.eager_region, (module, *inputs))
        why = ("a torch.func level the graph opens and closes (torch.vmap), run as one eager call: torch.compile "
               "runs it outside its graph, as it traces torch.vmap in the model's own Python")
        for n in (module, call):
            n.meta[RECORD] = Decision(node=n.name, op="eager_region", target="ampfx.runtime.eager_region", module="",
                                      category=Category.PASS, dtype=None, rule=Rule.STRUCTURE, reason=why)
        for k, o in enumerate(outputs):
            item = graph.call_function(operator.getitem, (call, k))
            item.meta = dict(o.meta)
            o.replace_all_uses_with(item)
    for n in reversed(region):
        graph.erase_node(n)
