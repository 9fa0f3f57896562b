"""``passes/transforms.py``: each torch.func level an exported graph opens and closes (``torch.vmap`` in an attention
mask, as Hugging Face builds them; tests_models runs HF's own under torch.compile) runs as one eager call, which torch.compile runs outside its graph; the report
keeps the level's nodes; the converted module computes, compiles, copies and pickles as before."""
import copy
import pickle

import torch
import torch.nn as nn

import ampfx
from ampfx import ops, runtime
from ampfx.passes import transforms


class Masked(nn.Module):
    """An attention whose causal mask is built with nested torch.vmap over (query, key) positions."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        positions = torch.arange(x.shape[1])
        mask = torch.vmap(lambda q: torch.vmap(lambda k: k <= q)(positions))(positions)
        h = self.fc(x)
        return (h @ h.transpose(-1, -2)).masked_fill(~mask, -1e4).softmax(-1) @ h


X = torch.randn(2, 5, 8)


def converted():
    torch.manual_seed(0)
    model = Masked()
    return model, ampfx.convert(model, "bf16", example_inputs=(X,), tracer="export")


def test_each_level_becomes_one_eager_call_and_the_report_keeps_its_nodes():
    """Structure: no torch.func call is left in the converted graph; one eager_region call reads the region, whose
    own graph holds them; the report still lists the nodes that opened and closed the level."""
    _, amp = converted()
    targets = [n.target for n in amp.graph.nodes]
    assert not any(t in ops.TRANSFORM_CALLS for t in targets)
    assert targets.count(runtime.eager_region) == 1
    region = getattr(amp, f"{transforms.PREFIX}0")
    assert any(n.target in ops.TRANSFORM_OPENS for n in region.graph.nodes)
    assert any("_vmap_increment_nesting" in r.node for r in amp.ampfx_report.records)


def test_it_computes_compiles_copies_and_pickles():
    """Numerics and contracts: the model's output within bfloat16's tolerance; torch.compile runs it (the level as a
    graph break); a deep copy and an unpickled copy compute the same bits (unpickling re-traced torch.func's calls on
    proxies, which they refuse)."""
    model, amp = converted()
    out = amp(X)
    torch.testing.assert_close(out, model(X), rtol=0.05, atol=0.05)
    torch.testing.assert_close(torch.compile(amp, backend="eager")(X), out, rtol=0, atol=0)
    torch.testing.assert_close(copy.deepcopy(amp)(X), out, rtol=0, atol=0)
    torch.testing.assert_close(pickle.loads(pickle.dumps(amp))(X), out, rtol=0, atol=0)
    out.sum().backward()
    assert model.fc.weight.grad is not None


def test_a_graph_without_levels_is_left_as_it_was():
    """Rule: nothing to outline, nothing changed."""
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    code = gm.code
    assert transforms.outline_transforms(gm) == 0 and gm.code == code
