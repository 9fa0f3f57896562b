"""Fidelity (issue #16): on small models of the families the issue names, ampfx's default
conversion is at least about as faithful to float32 as torch.autocast: output error <= 1.5 x
autocast's and worst parameter-gradient error <= 2 x autocast's (each + ``FLOOR``), for bf16 and
fp16, means over 3 batches of one model. The models and the measurement are in
``fidelity_models.py``; ``benchmarks/fidelity.py`` prints the full table (and each fidelity switch
off). autocast is CPU autocast, with the loss inside the region.
"""
import dataclasses
import functools
import math

import pytest
import torch

import ampfx
from support import fidelity_models as fm
from conftest import DTYPES

BATCHES = 3


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def _rows(name: str, dtype: torch.dtype) -> dict[str, fm.Fidelity]:
    return {r.variant: r for r in fm.measure_fidelity(name, dtype, batches=BATCHES, switches=False)}


def _table(rows: dict[str, fm.Fidelity]) -> str:
    return "\n".join(f"  {r.variant}: out {r.out_err:.3g}, worst grad {r.grad_err:.3g} ({r.grad_param}), "
                     f"wrong idx {r.wrong}, casts {r.casts}{', failed ' + r.failed if r.failed else ''}"
                     for r in rows.values())


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(fm.FAMILIES))
def test_ampfx_is_within_bounds_of_autocast(name, dtype):
    """ampfx by default: output error <= 1.5 x autocast's, worst gradient error <= 2 x autocast's,
    and no more wrong integer outputs than autocast, against float32 on the same weights and batches."""
    rows = _rows(name, dtype)
    amp, ac = rows["ampfx"], rows["autocast"]
    assert not ac.failed, f"{name}: autocast itself failed: {ac.failed}"
    ok, text = fm.verdict(amp, ac)
    assert ok, f"{name} {dtype}: {text}\n{_table(rows)}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_positions_after_long_are_exact(dtype):
    """``(arange(600, dtype=float32) + offset).long()`` with an offset in (0.25, 0.75) from a GEMM
    gives the positions themselves in float32; ampfx's indices equal float32's, all 1200 of them
    (autocast's do too: type promotion keeps the add float32)."""
    model, inputs, _ = fm.positions(seed=0)
    with torch.no_grad():
        want = model(*inputs)[1]
        amp = ampfx.convert(model, dtype, example_inputs=inputs)
        got = amp(*inputs)[1]
        with torch.autocast("cpu", dtype=dtype):
            auto = model(*inputs)[1]
    assert torch.equal(want, torch.arange(600).expand(2, 600)), "the model's own premise: float32 gives positions"
    assert int((auto != want).sum()) == 0, "the model's own premise: autocast is exact"
    wrong = int((got != want).sum())
    first = (got != want).nonzero()[:3].tolist()
    assert wrong == 0, f"{wrong} of {want.numel()} indices differ from float32's (first at {first})"


# ----------------------------------------------------------------------------- the measurement itself
def _row(out: float, grad: float, wrong: int = 0) -> fm.Fidelity:
    return fm.Fidelity("m", torch.bfloat16, "v", out_err=out, grad_err=grad, grad_param="p", wrong=wrong)


def test_verdict_applies_the_bounds():
    """1.5x (out) and 2x (grad) pass, a little more fails; more wrong indices fail; a failed run fails."""
    ac = _row(1e-2, 1e-2)
    assert fm.verdict(_row(1.5e-2, 2e-2), ac)[0]
    assert not fm.verdict(_row(1.52e-2, 1e-2), ac)[0]
    assert not fm.verdict(_row(1e-2, 2.02e-2), ac)[0]
    assert not fm.verdict(_row(1e-2, 1e-2, wrong=1), ac)[0]
    assert not fm.verdict(dataclasses.replace(_row(0, 0), failed="RuntimeError: x"), ac)[0]


def test_errors_average_batches_and_skip_zero_gradients():
    """Per parameter the mean over batches, then the worst parameter; a parameter whose float32
    gradient is zero is left out, a missing gradient counts 1, NaN counts inf; integer outputs
    count their differing entries."""
    one, two = torch.ones(4), torch.full((4,), 2.0)
    ref = fm._Step([one], [torch.arange(3)], {"a": one, "b": torch.zeros(4), "c": one})
    got1 = fm._Step([one * 1.1], [torch.tensor([0, 1, 5])], {"a": one * 1.2, "b": two, "c": one})
    got2 = fm._Step([one * 1.3], [torch.arange(3)], {"a": one * 1.4, "b": two, "c": None})
    out, grad, param, wrong = fm._errors([got1, got2], [ref, ref])
    assert math.isclose(out, 0.2, rel_tol=1e-6) and wrong == 1
    assert (param, round(grad, 6)) == ("c", 0.5)  # c: (0 + 1) / 2 beats a: (0.2 + 0.4) / 2; b ignored
    nan = fm._Step([one * math.nan], [], {"a": one})
    assert fm._errors([nan], [fm._Step([one], [], {"a": one})])[0] == math.inf


def test_switch_variants_exist_only_for_policy_fields():
    """Every "off" variant names a Policy field, so the harness runs before and after the rules land."""
    fields = {f.name for f in dataclasses.fields(ampfx.Policy)}
    assert set(fm.fidelity_switches()) <= fields
    for label in fm.variants():
        if "=" in label:
            assert label.split()[1].split("=")[0] in fields


class _TanhGELU(torch.nn.Module):
    """HF's ``gelu_new`` (GPT-2, ALBERT, ...), written out: ``x**3`` overflows float16 above |x| = 40."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def test_float16_power_stays_float32_where_its_gradient_would_overflow():
    """Why ``pow`` is on the float16 deny list (2-3 more casts per tanh-GELU than CPU autocast): with
    pre-activations of a few hundred, ``pow``'s backward (3 x**2 times a gradient of exactly 0 where
    tanh saturates) is inf * 0 in float16, so every weight before it gets NaN gradients (the loss
    scaler skips the step, and keeps skipping). The deny entry keeps them finite and close to float32's;
    autocast's plan (``pow`` run in float16, as the environment override below asks) does not."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), _TanhGELU(), torch.nn.Linear(64, 16))
    with torch.no_grad():
        net[0].weight.mul_(400.0)  # pre-activations up to a few hundred, as outlier features reach
    x = torch.randn(8, 16)
    assert 150 < net[0](x).abs().max() < 3000

    def grads(model):
        net.zero_grad()
        model(x).float().pow(2).mean().backward()
        return torch.cat([p.grad.flatten() for p in net.parameters()])

    want = grads(net)
    got = grads(ampfx.convert(net, torch.float16, example_inputs=(x,)))
    assert torch.isfinite(got).all() and ((got - want).abs().max() / want.abs().max()) < 0.01
    as_autocast = ampfx.convert(net, torch.float16, example_inputs=(x,),
                                environ={"AMPFX_DENYLIST_REMOVE": "pow", "AMPFX_INFERLIST_ADD": "pow"})
    assert not torch.isfinite(grads(as_autocast)).all()
