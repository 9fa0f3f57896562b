"""The autocast annotation (reporting only): annotate_autocast writes the dtype torch.autocast would compute
each node in; stamp_autocast copies it into the node's Decision after the passes; neither decides a dtype."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ampfx.meta import AUTOCAST, RECORD
from ampfx.passes import autocast, casts

from .helpers import context, graph, rec, run, run_passes


def _fn(x, w):
    return F.softmax(F.linear(x, w), dim=-1) + x.sum()


INPUTS = (torch.randn(8, 4), torch.randn(4, 4))


def test_annotate_writes_autocasts_dtype_on_each_node_and_decides_nothing():
    """On CPU under bfloat16 autocast runs linear low and softmax on its input's dtype; the add of a
    bfloat16 tensor and a float32 0-dim sum gives bfloat16. No Decision is written."""
    gm = graph(_fn)
    ctx = context(gm, INPUTS)
    autocast.annotate_autocast(gm, ctx)
    seen = {n.name: n.meta.get(AUTOCAST) for n in gm.graph.nodes if n.op == "call_function"}
    assert seen["linear"] == torch.bfloat16 and seen["softmax"] == torch.bfloat16
    assert not any(RECORD in n.meta for n in gm.graph.nodes)


def test_a_device_without_autocast_tables_gets_no_annotation():
    gm = graph(_fn)
    autocast.annotate_autocast(gm, context(gm, INPUTS, device="mps"))
    assert not any(AUTOCAST in n.meta for n in gm.graph.nodes)


def test_stamp_copies_the_annotation_into_the_decisions_and_leaves_casts_alone():
    gm, ctx = run(_fn, INPUTS, upto=casts.insert_casts)
    autocast.stamp_autocast(gm, ctx)
    assert rec(gm, "linear").autocast == torch.bfloat16
    inserted = [n for n in gm.graph.nodes if n.name not in {"x", "w", "linear", "softmax", "sum_1", "add", "output"}]
    assert inserted and all(getattr(n.meta.get(RECORD), "autocast", None) is None for n in inserted)
    dtype_before = rec(gm, "softmax").dtype
    run_passes(gm, ctx, start=autocast.stamp_autocast, upto=autocast.stamp_autocast)
    assert rec(gm, "softmax").dtype == dtype_before
