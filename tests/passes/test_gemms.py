"""``passes/gemms.py`` on tiny converted graphs: what ``count_gemms`` writes into each ``Decision``."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampfx

from ampfx.passes import gemms

from support.lean import GemmCounter

from .helpers import rec, run


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        y = self.fc(x)
        return self.attn(y, y, y)[0] @ y.transpose(1, 2)


def test_each_node_counts_the_aten_gemms_it_runs_and_those_in_the_low_dtype():
    """A linear is one GEMM, a matmul of batches one bmm, a leaf MultiheadAttention every GEMM it runs in
    the dtype it runs in; a transpose none. Counted on fake tensors, they add up to what a real run of the
    converted graph calls; the weights and buffers are left as they were."""
    x = torch.randn(2, 5, 8)
    gm, _ = run(Block(), (x,))
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    assert gemms.count_gemms(gm, (x,), torch.bfloat16) == "fake"
    assert (rec(gm, "fc_low").gemms, rec(gm, "fc_low").gemms_low) == (1, 1)
    assert (rec(gm, "matmul").gemms, rec(gm, "matmul").gemms_low) == (1, 1)
    assert rec(gm, "attn_low").gemms == rec(gm, "attn_low").gemms_low >= 3  # in-projection, two products, out
    assert rec(gm, "transpose").gemms == 0
    with torch.no_grad(), GemmCounter() as real:
        gm(x)
    assert real.by_dtype == {torch.bfloat16: sum(rec(gm, n.name).gemms or 0 for n in gm.graph.nodes
                                                  if hasattr(rec(gm, n.name), "gemms"))}
    assert all(torch.equal(v, before[k]) for k, v in gm.state_dict().items())


def test_a_float32_node_counts_its_gemms_as_not_low():
    """A GEMM left float32 (a deny-listed op here, by the policy) is counted, but not as low."""
    def f(x, w):
        return F.softmax(F.linear(x, w), -1)

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    gm, _ = run(f, (x, w), denylist_add=["linear"], allowlist_remove=["linear"])
    gemms.count_gemms(gm, (x, w), torch.bfloat16)
    assert (rec(gm, "linear").gemms, rec(gm, "linear").gemms_low) == (1, 0)
    assert rec(gm, "softmax").gemms == 0


@torch.fx.wrap
def _clipped(x, w):
    """Data-dependent Python: runs on no fake tensor."""
    y = x @ w
    return y / y.abs().amax() if y.abs().amax() > 1 else y


def test_a_node_that_cannot_run_on_fake_tensors_is_counted_by_a_real_run():
    """Data-dependent Python in an opaque function: the graph runs for real (no gradients), and says so."""
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    gm, _ = run(lambda x, w: _clipped(x, w) + 1, (x, w))
    assert gemms.count_gemms(gm, (x, w), torch.bfloat16) == "real"
    node = next(n for n in gm.graph.nodes if n.target is _clipped)
    assert (rec(gm, node.name).gemms, rec(gm, node.name).gemms_low) == (1, 0)


class _VmappedMask(nn.Module):
    """A causal mask made with nested ``torch.vmap``, as HF's attention masks are: torch.export writes it
    as ``_vmap_increment_nesting`` ... ``_vmap_decrement_nesting`` nodes in the graph."""

    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(8, 8), nn.Dropout(0.1)

    def forward(self, x):
        idx = torch.arange(x.shape[1])
        mask = torch.vmap(lambda i: torch.vmap(lambda j: j <= i)(idx))(idx)
        h = self.fc(x)
        scores = (h @ h.transpose(-1, -2)).masked_fill(~mask, -1e4)
        return self.drop(torch.softmax(scores, -1) @ h)


def test_counting_a_graph_that_opens_vmap_levels_leaves_none_open():
    """Each vmap level the graph opens is its own (never a remembered result of another call), and none
    stays open after the count: a level left open made every later dropout raise and backward() refuse."""
    x = torch.randn(2, 5, 8)
    amp = ampfx.convert(_VmappedMask().train(), "bf16", example_inputs=(x,))
    assert amp.ampfx_report.parts[-1].method == "export"
    assert torch._C._functorch.peek_interpreter_stack() is None
    assert amp.ampfx_report.gemms == 3
    amp(x).float().sum().backward()
