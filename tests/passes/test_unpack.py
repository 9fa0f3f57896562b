"""``passes/unpack.py``: a tensor unpacked into all its rows becomes one ``unbind``, as eager Python
runs ``q, k, v = qkv``; never where an ``unbind`` could raise (a row written in place, returned, or
passed to an op without a table entry)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampfx
from ampfx.tools.measure import measure_step
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


class Rows(nn.Module):
    """``a, b, c = t[0], t[1], t[2]`` of a (3, B, 4) tensor, then ``then(self, t)``."""

    def __init__(self, then=lambda self, t: None):
        super().__init__()
        self.lin = nn.Linear(4, 12)
        self.then = then

    def forward(self, x):
        t = self.lin(x).view(x.shape[0], 3, 4).transpose(0, 1).contiguous()
        a, b, c = t[0], t[1], t[2]
        self.then(self, t)
        return a * b + c


class ScaledLinear(nn.Linear):
    """A leaf of a user's class: it scales its input in place."""

    def forward(self, x):
        x.mul_(0.5)
        return super().forward(x)


@pytest.mark.parametrize("then", [lambda self, t: t.view(-1).mul_(2), lambda self, t: t[0:1].mul_(2)],
                         ids=["view-mul_", "slice-mul_"])
def test_rows_whose_base_is_written_through_a_view_stay_selections(then):
    """Writing the base through a view makes unbind's outputs raise at their next use (found by review)."""
    torch.manual_seed(0)
    m, x = Rows(then), torch.randn(2, 4)
    amp = ampfx.convert(m, torch.bfloat16, example_inputs=(x,))
    assert not _unbinds(amp)
    assert (amp(x).float() - m(x)).abs().max() < 0.1


def test_negative_indices_stay_selections():
    """``h[-1]`` is the last row at every size; unbind(h)[2] is not (a call with 5 rows computed row 2)."""
    class Neg(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            return h[0] * h[1] + h[-1]

    torch.manual_seed(0)
    m = Neg()
    amp = ampfx.convert(m, torch.bfloat16, example_inputs=(torch.randn(3, 4),))
    assert not _unbinds(amp)
    x5 = torch.randn(5, 4)
    assert (amp(x5).float() - m(x5)).abs().max() < 0.05


def test_a_row_given_to_a_leaf_of_a_users_class_stays_a_selection():
    """Its table entry comes from its base class (nn.Linear); what its forward does to its input does not."""
    class M(Rows):
        def __init__(self):
            super().__init__()
            self.proj = ScaledLinear(4, 4)

        def forward(self, x):
            t = self.lin(x).view(x.shape[0], 3, 4).transpose(0, 1)
            q, k, v = t[0], t[1], t[2]
            return self.proj(q) * k + v

    torch.manual_seed(0)
    m, x = M(), torch.randn(2, 4)
    amp = ampfx.convert(m, torch.bfloat16, example_inputs=(x,), keep_modules=["proj"])
    assert not _unbinds(amp)
    assert (amp(x).float() - m(x)).abs().max() < 0.1


def test_nothing_changes_without_shapes():
    gm, _ = run(Attention(), None, upto=unpack.unpack)
    assert not _unbinds(gm)
