"""The region-input cast: a graph converted below the model's root (a region) casts each float input its
graph reads in a low dtype to that dtype; the model's own root graph, integer inputs and a graph reading
its input float32 get no cast."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ampfx import runtime
from ampfx.meta import RECORD
from ampfx.passes import boundary, pad

from .helpers import calls, run, run_passes


def _boundary_casts(gm):
    """The casts the boundary pass made (each records its value as handed by the code around the region)."""
    return [n for n in calls(gm, runtime.cast) if getattr(n.meta.get(RECORD), "source", None) == "as handed"]


def _fn(x, w, idx):
    return F.linear(x, w)[idx]


INPUTS = (torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(4, 4), torch.tensor([0, 2]))


def _converted(prefix: str):
    gm, ctx = run(_fn, INPUTS, upto=pad.pad)
    ctx = ctx.at(prefix=prefix)
    run_passes(gm, ctx, start=boundary.cast_part_inputs, upto=boundary.cast_part_inputs)
    return gm


def test_a_regions_low_inputs_are_cast_to_the_dtype_its_graph_was_converted_for():
    """In a region whose input ``x`` was recorded bfloat16 (its caller's graph hands it low), ``x`` gets
    ``x_in = cast(x, bfloat16)``, so a float32 ``x`` handed by eager code around it still reaches the
    bfloat16 linear in bfloat16; ``w`` is read through the cast the casts pass already put on it; the
    integer index is left alone."""
    gm = _converted("enc.")
    assert [(n.name, n.args[1]) for n in _boundary_casts(gm)] == [("x_in", torch.bfloat16)]
    x, w, idx = INPUTS
    assert gm(x.float(), w, idx).dtype == torch.bfloat16


def test_the_models_root_graph_gets_no_boundary_cast():
    gm = _converted("")
    assert _boundary_casts(gm) == [] and calls(gm, runtime.cast)  # the casts pass's own casts are there
