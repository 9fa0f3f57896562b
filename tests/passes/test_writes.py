"""``passes/writes.py``: what a node writes where that is not its dtype, decided after painting and
before any cast; the graph itself is not touched (the casts pass carries the decisions out)."""
import torch
import torch.fx as fx
import torch.nn.functional as F

from ampfx.passes import paint, writes

from .helpers import Weights, rec, run


def decided(fn, x):
    gm, _ = run(Weights(fn), (x,), upto=writes.decide_writes, probe=True)
    return gm


def _code(gm: fx.GraphModule) -> str:
    gm.recompile()
    return gm.code


def test_a_softmax_read_only_low_writes_the_low_dtype_and_the_graph_is_untouched():
    fn = lambda m, x: torch.softmax(F.linear(x, m.w) @ F.linear(x, m.v).T, -1) @ x  # noqa: E731
    painted, _ = run(Weights(fn), (torch.randn(6, 4),), upto=paint.paint, probe=True)
    gm = decided(fn, torch.randn(6, 4))
    d = rec(gm, "softmax")
    assert (d.rule, d.dtype, d.out) == ("cost:write-low", torch.float32, torch.bfloat16)
    assert _code(gm) == _code(painted)  # decided, not rewritten


def test_the_bias_of_a_gemm_read_only_in_float32_is_added_after_the_cast():
    gm = decided(lambda m, x: torch.exp(F.linear(x, m.w, m.b)), torch.randn(3, 4))
    assert rec(gm, "linear").bias_after and "bias added in float32" in rec(gm, "linear").reason
    gm = decided(lambda m, x: F.linear(F.linear(x, m.w, m.b), m.v), torch.randn(3, 4))
    assert not rec(gm, "linear").bias_after  # its consumer reads it low: the bias stays in the GEMM


def test_a_float32_copy_read_only_low_is_left_out():
    gm = decided(lambda m, x: F.linear(F.linear(x, m.w).float(), m.v), torch.randn(3, 4))
    d = rec(gm, "float_1")
    assert (d.rule, d.out) == ("cost:no-float32-copy", torch.bfloat16)
    gm = decided(lambda m, x: torch.exp(F.linear(x, m.w).float()), torch.randn(3, 4))
    assert rec(gm, "float_1").rule != "cost:no-float32-copy"  # exp reads it in float32: the copy is the model's
