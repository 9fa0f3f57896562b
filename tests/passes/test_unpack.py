"""``passes/unpack.py``: a tensor unpacked into all its rows becomes one ``unbind``, as eager Python
runs ``q, k, v = qkv``; never where an ``unbind`` could raise (a row written in place, returned, or
passed to an op without a table entry)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampfx
from ampfx.measure import measure_step
from ampfx.passes import unpack

from .helpers import run


class Attention(nn.Module):
    """``q, k, v = qkv``: unpacking a tensor, as many attention blocks write it; ``after`` runs on ``q``."""

    def __init__(self, after=lambda q: q):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.after = after

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 8).permute(2, 0, 1, 3)
        q = self.after(q)
        return torch.softmax(q @ k.transpose(-2, -1), -1) @ v


def _unbinds(gm):
    return [n for n in gm.graph.nodes if n.target is torch.unbind]


def test_a_tensor_unpacked_into_its_rows_is_one_unbind():
    x = torch.randn(2, 5, 8)
    gm, _ = run(Attention(), (x,), upto=unpack.unpack)
    (unbind,) = _unbinds(gm)
    assert sorted(u.args[1] for u in unbind.users) == [0, 1, 2]
    torch.manual_seed(0)
    model = Attention()
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=(x,))
    assert len(_unbinds(amp)) == 1
    want = torch.autograd.grad(model(x).sum(), model.qkv.weight)[0]
    got = torch.autograd.grad(amp(x).float().sum(), model.qkv.weight)[0]
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_its_backward_writes_fewer_bytes_than_one_selection_per_row():
    """Each selection's backward writes a zero tensor of the whole size; unbind's one stack."""
    x = torch.randn(4, 16, 8)
    model = Attention()
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=(x,))
    selects = ampfx.convert(model, torch.bfloat16, example_inputs=(x,), tracer="fx")
    for node in _unbinds(selects):  # undo the pass: one selection per row, as torch.fx traced it
        for u in list(node.users):
            u.args = (node.args[0], u.args[1])
        selects.graph.erase_node(node)
    selects.recompile()
    ours = measure_step(lambda: amp(x).float().sum().backward()).written
    theirs = measure_step(lambda: selects(x).float().sum().backward()).written
    assert ours < theirs


@pytest.mark.parametrize("after", [lambda q: q.mul_(2), lambda q: F.relu(q, inplace=True),
                                   lambda q: F.dropout(q, 0.5, training=False).add_(1)],  # dropout returns q itself
                         ids=["mul_", "relu-inplace", "dropout-add_"])
def test_rows_written_in_place_stay_selections(after):
    """unbind's outputs may not be changed in place (eager Python raises there): a graph whose rows
    are written, also through an op that returns its input, keeps one selection per row."""
    x = torch.randn(2, 5, 8)
    gm, _ = run(Attention(after), (x,), upto=unpack.unpack)
    assert not _unbinds(gm)


def test_rows_returned_or_not_all_selected_stay_selections():
    x = torch.randn(3, 4)
    gm, _ = run(lambda t: (t[0] * t[1], t[2]), (x,), upto=unpack.unpack)  # t[2] is an output: a caller may write it
    assert not _unbinds(gm)
    gm, _ = run(lambda t: t[0] * t[1], (x,), upto=unpack.unpack)  # row 2 never selected
    assert not _unbinds(gm)
    gm, _ = run(lambda t: t[0] * t[1] + t[2], (x,), upto=unpack.unpack)
    assert len(_unbinds(gm)) == 1


def test_the_items_of_a_tuple_holding_one_tensor_are_not_rows():
    """``out, _ = attention(x, x, x, need_weights=False)`` returns ``(tensor, None)``: its shapes record one
    tensor, whose first dimension here is 2, and both items are taken. They are a tuple's items, not rows
    (torchvision's ViT failed at its first call)."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x):
            out, _ = self.attn(x, x, x, need_weights=False)
            return out + x

    x = torch.randn(2, 5, 8)
    gm, _ = run(Block(), (x,), upto=unpack.unpack)  # meta-tensor shapes: each tensor's sizes, not the tuple
    assert not _unbinds(gm)
    amp = ampfx.convert(Block(), torch.bfloat16, example_inputs=(x,))
    assert amp(x).shape == (2, 5, 8)


def test_nothing_changes_without_shapes():
    gm, _ = run(Attention(), None, upto=unpack.unpack)
    assert not _unbinds(gm)
