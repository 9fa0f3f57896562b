"""Patterns of real models where ampfx must cost no more than CPU autocast (casts made, bytes saved
for backward, measured alike by ``support.lean``), and must compute what the model computes.

- A layerdrop whose draw cannot change the branch (``torch.rand(()) < self.layerdrop`` with
  ``layerdrop = 0.0``, HF's speech encoders in training mode) must not cost the whole graph: the
  comparison has one answer, the graph keeps the draw and fixes the attribute.
- Layer scale (``x + gamma * branch(norm(x))``, CaiT, DeiT-III, ConvNeXt): autocast's type promotion
  computes the product with the float32 ``gamma`` in float32, so its residual stream and the norms
  reading it stay float32; ampfx does the same (``fidelity:operand``), at no more casts or bytes.
  Its fidelity against autocast is measured in ``tests/test_fidelity.py`` (family ``layer_scale``).
"""
import random
import types

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampfx
from support import fidelity_models as fm
from support.lean import against_autocast

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- layerdrop
class _Block(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class SpeechEncoder(nn.Module):
    """wav2vec2's / whisper's encoder in small: a projection and a norm, layers skipped in training with
    probability ``layerdrop``, a head."""

    def __init__(self, layerdrop: float = 0.0, d: int = 16, layers: int = 2):
        super().__init__()
        self.layerdrop = layerdrop
        self.proj, self.norm = nn.Linear(d, d), nn.LayerNorm(d)
        self.layers = nn.ModuleList(_Block(d) for _ in range(layers))
        self.head = nn.Linear(d, d)

    def forward(self, x):
        x = self.norm(self.proj(x))
        for layer in self.layers:
            if self.training and torch.rand([]) < self.layerdrop:
                continue
            x = layer(x)
        return self.head(F.gelu(x))


def test_a_layerdrop_of_zero_keeps_the_graph_and_costs_no_more_than_autocast():
    """``if self.training and torch.rand([]) < self.layerdrop`` with ``layerdrop = 0.0``: the draw cannot
    skip a layer, so the root is one graph (not eager with each child converted alone, which cast every
    child's output back to float32: 33 casts and 10816 bytes against autocast's 27 and 9792)."""
    torch.manual_seed(0)
    model, x = SpeechEncoder(0.0), torch.randn(2, 4, 16)
    cost = against_autocast(model, (x,))
    root = next(r for r in cost.report.parts if r.path == "")
    assert root.method == "fx", root.steps
    assert cost.casts <= cost.casts_autocast and cost.saved <= cost.saved_autocast, str(cost)
    assert cost.gemms_reported == cost.gemms_run, str(cost)


def _helper_reads_p(module):
    return torch.rand(()) < module.p


DRAWS = {  # name -> (how the forward draws and decides to skip, the value for which no layer is ever skipped)
    "torch.rand(()) < p": (lambda m: torch.rand(()) < m.p, 0.0),
    "torch.rand(1).item() < p": (lambda m: torch.rand(1).item() < m.p, 0.0),
    "torch.rand(()) > keep, keep = 1.0": (lambda m: torch.rand(()) > m.p, 1.0),
    "random.uniform(0, 1) < p": (lambda m: random.uniform(0, 1) < m.p, 0.0),
    "p > random.random()": (lambda m: m.p > random.random(), 0.0),
    "np.random.rand() < p": (lambda m: np.random.rand() < m.p, 0.0),
    "np.random.uniform(0, 1) < p": (lambda m: np.random.uniform(0, 1) < m.p, 0.0),
    "torch.rand(()) < config.layerdrop": (lambda m: torch.rand(()) < m.config.layerdrop, 0.0),
    "a helper reads p": (_helper_reads_p, 0.0),
}


class Skipping(nn.Module):
    """Three residual layers with dropout, each skipped in training when ``skip(self)`` says so."""

    def __init__(self, skip, p: float):
        super().__init__()
        self.skip, self.p = skip, p
        self.config = types.SimpleNamespace(layerdrop=p)
        self.layers = nn.ModuleList(_Block(8) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            if self.training and self.skip(self):
                continue
            x = layer(x)
        return x


def _same_draws(amp, model, x, seeds=range(3)):
    """The largest difference between ``amp`` and ``model`` over calls from the same random states
    (torch's, Python's, numpy's): the same layers skipped and the same dropout masks."""
    worst = 0.0
    for seed in seeds:
        outs = []
        for m in (amp, model):
            torch.manual_seed(seed), random.seed(seed), np.random.seed(seed)
            outs.append(m(x).float())
        worst = max(worst, ((outs[0] - outs[1]).abs().max() / outs[1].abs().max()).item())
    return worst


@pytest.mark.parametrize("name", list(DRAWS))
def test_a_draw_compared_with_a_value_it_cannot_reach_is_no_branch(name):
    """A draw whose every comparison has one answer over the draw's range (torch's, Python's, numpy's;
    [0, 1) or uniform's [a, b]) does not reject the graph: the root is one graph, the same as the model
    (torch's draw stays in the graph, so the dropout masks after it are the model's)."""
    skip, never = DRAWS[name]
    torch.manual_seed(0)
    model, x = Skipping(skip, never).train(), torch.randn(2, 4, 8)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    root = next(r for r in amp.ampfx_report.parts if r.path == "")
    assert root.method == "fx", root.steps
    assert any("only compared with values they cannot reach" in s for s in root.steps), root.steps
    assert _same_draws(amp, model, x) < 0.03


@pytest.mark.parametrize("name", list(DRAWS))
def test_a_draw_that_can_go_either_way_still_rejects_the_graph(name):
    """``p = 0.5``: the draw decides which layers run; no graph takes one of its branches for ever (the root
    keeps its Python, as before), and the report says a draw decided something."""
    skip, _ = DRAWS[name]
    model, x = Skipping(skip, 0.5).train(), torch.randn(2, 4, 8)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    root = next(r for r in amp.ampfx_report.parts if r.path == "")
    assert "eager" in root.method and any("drew a random number" in s for s in root.steps), root.steps
    assert _same_draws(amp, model, x) < 0.03


@pytest.mark.parametrize("name", ["torch.rand(()) < p", "random.uniform(0, 1) < p", "a helper reads p",
                                  "torch.rand(()) > keep, keep = 1.0"])
def test_changing_the_layerdrop_after_convert_is_seen(name):
    """The graph fixed ``p`` (read in the forward or by a helper it calls): a new value converts again at the
    call, so the layers skipped are the model's for every value (1.0 or 0.0: all or none; 0.5: the same
    draws, so the same layers), never those of the value converted with."""
    skip, never = DRAWS[name]
    torch.manual_seed(0)
    model, x = Skipping(skip, never).train(), torch.randn(2, 4, 8)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    for p in (1.0 - never, 0.5, never):
        model.p = p
        assert _same_draws(amp, model, x) < 0.03, p


def test_a_draw_that_reaches_the_graph_rejects_it():
    """``x * random.uniform(0.9, 1.1)``: the draw is a value of the computation, not a branch; the graph
    would multiply by one number for ever, so it is not used."""

    class Jitter(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x) * random.uniform(0.9, 1.1)

    amp = ampfx.convert(Jitter(), "bf16", example_inputs=(torch.randn(2, 8),))
    root = next(r for r in amp.ampfx_report.parts if r.path == "")
    assert "eager" in root.method and any("reaches the graph" in s for s in root.steps), root.steps


# ----------------------------------------------------------------------------- layer scale
def _records(report, op):
    return [(r.key.partition(":")[2], r.dtype, r.rule) for r in report.compute if r.op == op]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_layer_scale_keeps_autocasts_float32_stream_at_no_more_cost(dtype):
    """``x + ls1(attn(...))`` (timm's ``LayerScale``: ``x * gamma``) and ``x + gamma2 * mlp(...)``, with the
    stream starting as a GEMM's output: every product with ``gamma`` computes float32 (rule
    ``fidelity:operand``), as autocast's promotion does, so every residual add and every norm after the first
    reads a float32 stream; casts and saved bytes stay within autocast's (76 casts against 78, 600000 bytes
    saved against 600000; before: the products, adds and norms ran low)."""
    model, inputs, _ = fm.layer_scale(0)
    cost = against_autocast(model, inputs, dtype=dtype)
    assert cost.casts <= cost.casts_autocast and cost.saved <= cost.saved_autocast, str(cost)
    products = _records(cost.report, "mul")
    assert len(products) == 6 and all(d == torch.float32 and rule == "fidelity:operand" for _, d, rule in products)
    assert all(d == torch.float32 for _, d, _ in _records(cost.report, "add"))
    norms = _records(cost.report, "layer_norm")
    assert [d for _, d, _ in norms[1:]] == [torch.float32] * (len(norms) - 1), norms


class ScaledHead(nn.Module):
    """``linear(h * scale)``: a product with a float32 parameter that only a GEMM reads."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.fc, self.out = nn.Linear(d, d), nn.Linear(d, d)
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.out(F.gelu(self.fc(x)) * self.scale)


def test_a_product_that_only_a_gemm_reads_stays_low():
    """The GEMM rounds the product to the low dtype either way: it stays low, with no more casts or
    bytes than autocast's (which computes it float32 and casts it for the GEMM)."""
    cost = against_autocast(ScaledHead(), (torch.randn(4, 16),))
    assert [d for _, d, _ in _records(cost.report, "mul")] == [torch.bfloat16]
    assert cost.casts <= cost.casts_autocast and cost.saved <= cost.saved_autocast, str(cost)
    assert cost.gemms_reported == cost.gemms_run, str(cost)
