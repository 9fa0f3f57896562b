"""Property tests (hypothesis): random small op chains keep the cast invariants and FP32 numerics."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ampfx
from ampfx.runtime import cast as runtime_cast

OPS = {
    "linear": lambda m, h, i: m.fcs[i % len(m.fcs)](h),
    "gelu": lambda m, h, i: F.gelu(h),
    "relu_": lambda m, h, i: F.relu(h.clone()).relu_(),
    "residual": lambda m, h, i: h + m.fcs[i % len(m.fcs)](h),
    "softmax": lambda m, h, i: F.softmax(h, -1),
    "norm": lambda m, h, i: m.norm(h),
    "exp_scaled": lambda m, h, i: torch.exp(h * 0.1),
    "sum_keep": lambda m, h, i: h - h.mean(-1, keepdim=True),
    "view": lambda m, h, i: h.reshape(h.shape[0], 2, -1).transpose(0, 1).transpose(0, 1).reshape(h.shape[0], -1),
    "tanh": lambda m, h, i: torch.tanh(h),
    "mutate": lambda m, h, i: _mutate(m, h, i),
}


def _mutate(m, h, i):
    """Uses h, mutates it in place, uses it again: casts made before must not be reused after."""
    y = m.fcs[i % len(m.fcs)](h)
    h.mul_(0.5)
    return y + m.fcs[(i + 1) % len(m.fcs)](h)


class Chain(nn.Module):
    def __init__(self, ops):
        super().__init__()
        self.ops = list(ops)
        self.fcs = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        h = x
        for i, op in enumerate(self.ops):
            h = OPS[op](self, h, i)
        return h


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=8),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       shapes=st.booleans())
def test_random_chains_keep_cast_invariants_and_numerics(ops, dtype, shapes):
    torch.manual_seed(0)
    m = Chain(ops)
    x = torch.randn(4, 8)
    gm = ampfx.convert(m, dtype, example_inputs=(x,) if shapes else None)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    mutations = [order[n] for n in gm.graph.nodes if getattr(n.meta.get("ampfx"), "inplace", False)]
    casts = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is runtime_cast]
    keys = [(c.args[0], c.args[1]) for c in casts]
    seen = {}
    for c, key in zip(casts, keys):  # one cast per (value, dtype), unless the value was mutated in between
        if key in seen:
            assert any(seen[key] < i < order[c] for i in mutations), f"second cast of {key} without a mutation"
        seen[key] = order[c]
    assert not any(src.target is runtime_cast for src, _ in keys if src.op == "call_function"), "no cast of a cast"
    out, ref = gm(x.clone()), m(x.clone())
    assert out.dtype == torch.float32 and out.shape == ref.shape
    tol = 0.05 if dtype is torch.bfloat16 else 0.01
    torch.testing.assert_close(out, ref, atol=tol * (1 + ref.abs().max().item()), rtol=tol)
    assert all(p.dtype == torch.float32 for p in gm.parameters())
