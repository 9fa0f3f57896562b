"""Fuzz: seeded random graphs through every check of :func:`fuzzgraphs.run_case`.

Each case is a random DAG of 5-30 ops (GEMMs, convolutions, norms, reductions, softmax,
elementwise, views, concatenation, embedding, pooling, dropout) with random ``convert``
options (``pad``, ``dynamic_dims``, list edits, ``fp32_modules``, tracer, training mode) in
bfloat16 or float16. A failure prints the model's source and the options. The long run is
``python benchmarks/fuzz.py --n 2000`` (figures in docs/fuzz.md).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampfx
from support import fuzzgraphs as fg

N_CI = 200


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("seed", range(N_CI))
def test_random_graph(seed):
    """Convert succeeds, lint passes, the report's dtypes are the dtypes the nodes produce, outputs and
    gradients are finite where float32's are, the error against float32 is within FACTOR x autocast's
    + FLOOR, and another batch size and sequence length give the right values (or, for a dimension
    not in dynamic_dims, a clear ampfx error)."""
    outcome = fg.run_case(fg.generate(seed))
    assert not outcome.failures, outcome.message()


# ----------------------------------------------------------------------------- minimised findings
class TopkValues(nn.Module):
    """Fuzz seeds 21, 30 and 38 (first generator), minimised: an attribute of a namedtuple result
    (``topk(...).values``) feeding an op that stays float32."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(torch.topk(self.fc(x), 4, dim=-1).values).reshape(x.shape[0], -1)


@pytest.mark.parametrize("with_inputs", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attribute_holding_a_float_tensor_is_a_selection(dtype, with_inputs):
    """``topk(...).values`` keeps the low dtype of ``topk``'s values (rule ``select``), so the float32
    layer norm after it gets a cast: it computes in float32, as its record says, and the output is
    float32. It used to be taken for non-float data (as ``x.shape`` is): no cast, the norm ran in
    the low dtype while the report said float32, and without example inputs the output came back
    low. ``x.shape`` stays non-float."""
    x = torch.randn(3, 8)
    amp = ampfx.convert(TopkValues(), dtype, example_inputs=(x,) if with_inputs else None)
    rep = amp.ampfx_report
    values = next(r for r in rep.records if r.op == "getattr" and r.out is not None)
    assert (values.rule, values.dtype, values.out) == ("select", dtype, dtype)
    assert rep.by_node("norm").dtype == torch.float32
    shape = [r for r in rep.records if r.op == "getattr" and r is not values]
    assert [r.out for r in shape] == [None]
    sink = []
    out = fg.recorded_call(amp, (x,), sink)
    assert sink == [] and out.dtype == torch.float32


# ----------------------------------------------------------------------------- the fuzzer's own checks
def _quick_case(**want):
    """A small fx case with the options ``want`` asks for (first matching seed)."""
    for seed in range(500):
        case = fg.generate(seed)
        opts = case.options
        if case.steps <= 10 and opts["tracer"] == "fx" and not case.has_img and all(
                (opts.get(k) or None) == v for k, v in want.items()):
            return case
    raise AssertionError(f"no small case with {want}")


def test_generator_is_deterministic_and_covers_what_the_issue_asks():
    """One seed, one source; over the CI seeds every op family, both dtypes, every pad value,
    dynamic batch and seq, every tracer and both training modes appear, with 5-30 ops."""
    assert fg.generate(7).source == fg.generate(7).source and fg.generate(7).source != fg.generate(8).source
    cases = [fg.generate(s) for s in range(N_CI)]
    used = {op for c in cases for op in c.ops}
    assert used == set(fg.SEQ_OPS) | set(fg.IMG_OPS) | set(fg.VEC_OPS)
    assert {c.dtype for c in cases} == {torch.bfloat16, torch.float16}
    assert {c.options["pad"] for c in cases} == {"auto", "never", "always"}
    assert {tuple(sorted(c.options.get("dynamic_dims") or {})) for c in cases} == {(), (0,), (1,), (0, 1)}
    assert {c.options["tracer"] for c in cases} == {"auto", "fx", "export"}
    assert {c.train for c in cases} == {True, False}
    assert min(c.steps for c in cases) == 5 and max(c.steps for c in cases) == 30
    for name in ("F.scaled_dot_product_attention", "nn.Conv2d", "nn.Embedding", "torch.cat", "F.dropout",
                 "max_pool", "nn.LayerNorm", "nn.BatchNorm", "logsumexp", "softmax", ".reshape("):
        assert any(name in c.source for c in cases), name


class _Wrong(nn.Module):
    """A stand-in for a converted module: the model, then ``damage`` applied to its outputs."""

    def __init__(self, model, damage):
        super().__init__()
        self.model, self.damage = model, damage

    def forward(self, *args):
        out = self.model(*args)
        return tuple(map(self.damage, out)) if isinstance(out, tuple) else self.damage(out)


def _with_convert(monkeypatch, make):
    monkeypatch.setattr(ampfx, "convert", lambda model, dtype, **kw: make(model, kw))


def test_checks_catch_wrong_values(monkeypatch):
    """A module 3% off float32 fails the error bound (autocast is far closer)."""
    _with_convert(monkeypatch, lambda m, kw: _Wrong(m, lambda t: t * 1.03))
    failures = fg.run_case(_quick_case()).failures
    assert {f.check for f in failures} == {"error-vs-autocast"}, failures


def test_checks_catch_non_finite_outputs(monkeypatch):
    """An inf where float32 is finite fails the finiteness check."""
    _with_convert(monkeypatch, lambda m, kw: _Wrong(m, lambda t: t.index_fill(-1, torch.tensor([0]), float("inf"))))
    assert "finite-output" in {f.check for f in fg.run_case(_quick_case()).failures}


class _Refuses(nn.Module):
    """Right at the example's sizes; at others raises ``error``."""

    def __init__(self, model, shape, error):
        super().__init__()
        self.model, self.shape, self.error = model, shape, error

    def forward(self, x, *rest):
        if tuple(x.shape) != self.shape:
            raise self.error
        return self.model(x, *rest)


@pytest.mark.parametrize("dynamic, error, refused", [
    (None, ampfx.PolicyError("converted for batch 3: convert again"), True),
    (None, RuntimeError("shape '[3, 5, 2, -1]' is invalid"), False),
    ({0: "batch", 1: "seq"}, ampfx.PolicyError("converted for batch 3: convert again"), False),
])
def test_other_sizes_accept_only_a_clear_ampfx_refusal(monkeypatch, dynamic, error, refused):
    """At another size, an ampfx error is a clear refusal for a dimension not in ``dynamic_dims``; a
    torch-internal error, or any refusal of a dimension named in ``dynamic_dims``, is a failure."""
    case = _quick_case(dynamic_dims=dynamic)
    _with_convert(monkeypatch, lambda m, kw: _Refuses(m, (case.batch, case.seq, fg.FEATS_IN), error))
    outcome = fg.run_case(case)
    assert len(outcome.refused) == (2 if refused else 0)
    assert [f.check for f in outcome.failures] == ([] if refused else ["other-size", "other-size"])


def test_report_check_catches_a_record_that_lies():
    """The recorder compares every node's output dtype with its record: a record edited to say
    float32 where the node runs low is caught, naming the node."""
    import dataclasses

    from ampfx import meta

    amp = ampfx.convert(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.bfloat16, example_inputs=(torch.randn(2, 4),))
    node = next(n for n in amp.graph.nodes if getattr(meta.record(n), "op", None) == "linear")
    node.meta[meta.RECORD] = dataclasses.replace(meta.record(node), dtype=torch.float32, out=torch.float32)
    sink = []
    fg.recorded_call(amp, (torch.randn(2, 4),), sink)
    assert sink and all(s.startswith(f"{node.name} (linear)") for s in sink), sink


class MaskedNormalize(nn.Module):
    """Fuzz seed 175, minimised: a padding mask zeroes whole rows, then ``F.normalize``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, tok):
        return F.normalize(self.fc(x).masked_fill((tok == 0).unsqueeze(-1), 0.0), dim=-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_normalize_of_a_zero_row_stays_finite(dtype):
    """``F.normalize`` divides by ``max(norm, eps)``; its eps (1e-12) is 0 in float16, so a zero row
    gave 0/0 = NaN (autocast does too). Under float16 it stays float32 (rule ``table``, op
    ``normalize``); under bfloat16, which holds eps, it follows its inputs."""
    x, tok = torch.randn(2, 3, 8), torch.tensor([[0, 1, 2], [3, 0, 1]])
    model = MaskedNormalize()
    amp = ampfx.convert(model, dtype, example_inputs=(x, tok))
    rec = next(r for r in amp.ampfx_report.records if r.op == "normalize")
    assert rec.dtype == (torch.float32 if dtype is torch.float16 else dtype)
    out, ref = amp(x, tok), model(x, tok)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=0.02, rtol=0.02)


# ----------------------------------------------------------------------------- the harness itself
def test_without_autocast_ampfx_is_held_to_the_floor():
    """Where autocast cannot run a graph (no figures to compare with), ampfx's error must stay within
    FLOOR alone: an infinite autocast error must not make the bound infinite."""
    ck = fg._Checker(fg.generate(0))
    floor = fg.FLOOR[ck.case.dtype]
    ref = [torch.ones(4)]
    ck._error("within", [torch.ones(4) * (1 + floor / 2)], ref, None)
    assert not ck.failures
    ck._error("above", [torch.ones(4) * 2], ref, None)
    assert [f.check for f in ck.failures] == ["error-vs-autocast"]
    assert "autocast cannot run it" in ck.failures[0].detail


@pytest.mark.xfail(strict=True, reason="known, open (docs/fuzz.md): float16 gives non-finite outputs where "
                                       "float32 and autocast stay finite")
def test_fuzz_seed_1669_float16_stays_finite():
    """Long-run seed 1669 (float16): outputs must be finite where float32's are. Open: strict, so a fix
    shows up as an unexpected pass and this marker must go."""
    outcome = fg.run_case(fg.generate(1669))
    assert outcome.case.dtype == torch.float16
    assert not [f for f in outcome.failures if f.check.startswith("finite")], outcome.message()
