"""Casts at the boundaries of separately converted pieces: a model split into kept blocks or regions
costs no more casts and saved bytes than ``torch.autocast`` does on it, at about autocast's error.
Each test names the pattern; the models are tiny versions of it (``support/lean.py`` measures)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import ampfx
from support.lean import against_autocast
from support.models import Stage

pytestmark = pytest.mark.usefixtures("one_thread")


class ConvBlock(nn.Module):
    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class BlockChain(nn.Module):
    """Repeated blocks in an ``nn.ModuleDict`` (kept by ``keep_modules="auto"``), fed straight from
    the float32 input, with no GEMM of the parent's own."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({f"b{i}": ConvBlock() for i in range(n)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x


class PooledStages(nn.Module):
    """A backbone's stages in an ``nn.ModuleDict``, each one's pooled features collected."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.ModuleDict({f"s{i}": nn.Sequential(ConvBlock(), ConvBlock()) for i in range(3)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = []
        for stage in self.stages.values():
            x = stage(x)
            feats.append(x.mean((2, 3)))
        return torch.cat(feats, 1)


def _errors(model: nn.Module, amp: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    """Output error against float32 of ``amp`` and of autocast on ``model`` (eval mode)."""
    model.eval(), amp.eval()
    with torch.no_grad():
        ref = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = model(x)
        ours = amp(x)
    model.train(), amp.train()
    return (ours.float() - ref).abs().max().item(), (auto.float() - ref).abs().max().item()


def _within(ours: float, autocast: float) -> bool:
    return ours <= 1.5 * autocast + 1e-6


@pytest.mark.parametrize("model", [BlockChain, PooledStages])
def test_chain_of_auto_kept_blocks_fed_from_the_input_costs_no_more_than_autocast(model):
    """Kept blocks whose graphs read their inputs only low and compute their outputs low are painted
    from those graphs (low-precision ops in the caller's graph), not as infer ops with nothing low
    around them: they hand each other the low dtype, instead of float32 both ways."""
    torch.manual_seed(0)
    net, x = model(), torch.randn(2, 4, 8, 8)
    cost = against_autocast(net, (x,))
    assert cost.casts <= cost.casts_autocast, cost
    assert cost.saved <= cost.saved_autocast, cost
    assert cost.gemms_reported == cost.gemms_run == cost.gemms_low, cost
    kept = [r for r in cost.report.records if r.rule == "keep_modules"]
    assert kept and all(r.dtype == torch.bfloat16 for r in kept), [(r.node, r.dtype) for r in kept]
    amp = ampfx.convert(net, "bf16", example_inputs=(x,))
    assert _within(*_errors(net, amp, x)), _errors(net, amp, x)


def test_kept_blocks_see_their_inputs_in_the_dtype_autocast_hands_them():
    """The report's autocast column reads a kept block's inputs in the dtype autocast's run of the
    caller hands them (the previous block's bfloat16 output), and the caller's graph follows the
    block's own graph under autocast: no node's autocast dtype is left unknown."""
    torch.manual_seed(0)
    net, x = PooledStages(), torch.randn(2, 4, 8, 8)
    report = ampfx.convert(net, "bf16", example_inputs=(x,)).ampfx_report
    inputs = {r.module: r.autocast for r in report.records if r.kind == "placeholder" and r.module}
    assert inputs == {"stages.s0": torch.float32, "stages.s1": torch.bfloat16, "stages.s2": torch.bfloat16}
    assert report.autocast_unknown() == []
    assert {r.autocast for r in report.records if r.rule == "keep_modules"} == {torch.bfloat16}


class PreNorm(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.ln(x))


class SteeredStage(Stage):
    """A child that keeps its Python too (a value steers it); its ``nn.Linear`` leaves run as they are."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if float(x.detach().abs().amax()) > 1e6:
            x = x / 2
        return super().forward(x)


class EagerParent(nn.Module):
    """Python steered by a tensor's value (neither torch.fx nor torch.export captures it): its children
    are converted one by one, and between them its Python only moves and reshapes their outputs
    (``glue`` adds a computation of its own on the first child's output)."""

    def __init__(self, middle: type[nn.Module] = Stage, glue: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c = Stage(), middle(), Stage()
        self.glue = glue

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if float(x.detach().abs().amax()) > 1e6:
            x = x / 2
        h = self.a(x)
        h = h * 2 if self.glue else h
        h = self.b(h.transpose(0, 1).contiguous().flatten(0, 1))
        return self.c(h.view(x.shape[1], x.shape[0], -1).transpose(0, 1))


@pytest.mark.parametrize("middle", [Stage, PreNorm])
def test_parts_under_an_eager_parent_hand_each_other_the_low_dtype_through_reshapes(middle, monkeypatch):
    """With hand_low (off by default: AMPFX_HAND_LOW=1), children of a module that keeps its Python, whose
    outputs its Python only moves and reshapes into the next child: each returns what it computes low in the
    low dtype and the next takes it so, as under autocast, instead of float32 both ways. The next child's input
    is not a float32 stream (a pre-norm block's residual add is not kept float32 for an upcast made at the
    boundary)."""
    monkeypatch.setenv("AMPFX_HAND_LOW", "1")
    torch.manual_seed(0)
    net, x = EagerParent(middle), torch.randn(4, 8, 16)
    cost = against_autocast(net, (x,))
    assert cost.casts <= cost.casts_autocast, cost
    assert cost.saved <= cost.saved_autocast, cost
    assert cost.gemms_reported == cost.gemms_run == cost.gemms_low, cost
    b_input = next(r for r in cost.report.records if r.module == "b" and r.kind == "placeholder")
    assert b_input.out == torch.bfloat16, b_input
    assert not [r for r in cost.report.records if r.module.startswith("b") and r.rule == "fidelity:stream"]
    amp = ampfx.convert(net, "bf16", example_inputs=(x,))
    assert _within(*_errors(net, amp, x)), _errors(net, amp, x)


def test_the_eager_parent_computes_in_float32_on_what_a_child_hands_it():
    """Where the parent's own Python computes on a child's output (``h * 2``), it computes in float32 on
    the value the child returned before, exactly (the reference: its ``forward`` run without the handing,
    each child returning float32)."""
    torch.manual_seed(0)
    net, x = EagerParent(glue=True), torch.randn(4, 8, 16)
    amp = ampfx.convert(net, "bf16", example_inputs=(x,))
    seen = []
    amp.a.register_forward_hook(lambda m, a, out: seen.append(out.dtype))  # the parent's Python sees float32
    out = amp(x)
    assert seen == [torch.float32] and out.dtype == torch.float32
    torch.testing.assert_close(out, type(amp).forward(amp, x), rtol=0, atol=0)
    assert _within(*_errors(net, amp, x)), _errors(net, amp, x)


def test_an_eager_child_handed_low_values_runs_its_python_on_float32():
    """A child that keeps its Python itself (its linear leaves run as they are, in float32) runs it on the
    float32 values it ran on before: its Python sees float32, and its output is exactly that of the
    converted module whose children all return float32."""
    torch.manual_seed(0)
    net, x = EagerParent(SteeredStage), torch.randn(4, 8, 16)
    amp = ampfx.convert(net, "bf16", example_inputs=(x,))
    seen = []
    amp.b.register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    out = amp(x)
    assert seen == [torch.float32]
    torch.testing.assert_close(out, type(amp).forward(amp, x), rtol=0, atol=0)
    assert _within(*_errors(net, amp, x)), _errors(net, amp, x)
