"""The benchmark harnesses' own checks: a check that cannot fire is a defect in the figures it prints."""
import importlib.util
from pathlib import Path

import torch
import torch.nn as nn

import ampfx

ROOT = Path(__file__).resolve().parent.parent


def _coverage():
    spec = importlib.util.spec_from_file_location("coverage_bench", ROOT / "benchmarks" / "coverage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BranchOnValue(nn.Module):
    """Python control flow on a tensor's value: torch.fx cannot trace the root, its children convert."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:
            h = h * 2
        return self.b(h)


def test_coverage_flags_a_root_left_eager():
    """benchmarks/coverage.py marks a row "root left eager" when the root region (path "", listed after
    its children) ran eagerly; reading the first region instead saw a child and never fired."""
    coverage = _coverage()
    rep = ampfx.convert(BranchOnValue(), torch.bfloat16, example_inputs=(torch.randn(2, 8),)).ampfx_report
    methods = [(reg.path, reg.method) for reg in rep.parts]
    assert methods[0][0] != "" and methods[-1][0] == ""  # the root is listed last
    assert coverage.root_left_eager(methods)
    assert coverage.capture({"methods": methods}).startswith("eager")
    traced = ampfx.convert(nn.Sequential(nn.Linear(8, 8)), torch.bfloat16).ampfx_report
    assert not coverage.root_left_eager([(reg.path, reg.method) for reg in traced.parts])
