"""Casts at the boundaries of separately converted pieces: a model split into kept blocks or regions
costs no more casts and saved bytes than ``torch.autocast`` does on it, at about autocast's error.
Each test names the pattern; the models are tiny versions of it (``support/lean.py`` measures)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import ampfx
from support.lean import against_autocast

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
