"""``passes/dtype_reads.py``: ``x.dtype`` read by the model's code is the dtype the model computed ``x`` in (a
constant, with shapes), so its own dtype logic (a factory made ``dtype=x.dtype``) runs as the plan has it."""
import builtins

import torch
import torch.nn as nn

import ampfx
from ampfx.passes import dtype_reads

from .helpers import run


class Scatter(nn.Module):
    """Degree-normalised neighbour sums, as a scatter-based graph network writes them: the degree vector is
    float32 (``torch.zeros``) and the ones added into it are made ``dtype=h.dtype``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, dst):
        h = self.fc(x)
        deg = torch.zeros(h.shape[0]).index_add_(0, dst, torch.ones_like(dst, dtype=h.dtype))
        return torch.zeros_like(h).index_add_(0, dst, h) / deg.clamp(min=1)[:, None]


X, DST = torch.randn(6, 4), torch.tensor([0, 1, 1, 2, 5, 5])


def _dtype_reads(gm):
    return [n for n in gm.graph.nodes if n.target is builtins.getattr and n.args[1] == "dtype"]


def test_a_dtype_read_becomes_the_models_dtype():
    """Structure: the getattr node is gone and its user reads the constant float32."""
    gm, _ = run(Scatter(), (X, DST), upto=dtype_reads.fold_dtype_reads)
    assert not _dtype_reads(gm)
    ones = next(n for n in gm.graph.nodes if n.target is torch.ones_like)
    assert ones.kwargs["dtype"] is torch.float32


def test_without_shapes_the_read_is_left_as_traced():
    """Rule: without example inputs the model's dtypes are not known: nothing is folded."""
    gm, _ = run(Scatter(), None, upto=dtype_reads.fold_dtype_reads)
    assert len(_dtype_reads(gm)) == 1


def test_a_scatter_graph_network_runs_as_the_model():
    """Numerics: converted, the model's float32 degree vector takes float32 ones (it raised a dtype mismatch in
    index_add_ before), and the result is the model's within bfloat16's tolerance."""
    torch.manual_seed(0)
    model = Scatter()
    amp = ampfx.convert(model, "bf16", example_inputs=(X, DST))
    torch.testing.assert_close(amp(X, DST), model(X, DST), rtol=0.02, atol=0.02)
    amp(X, DST).sum().backward()
    assert model.fc.weight.grad is not None
