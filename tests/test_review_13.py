"""Review of issue #13: bad inputs next to each case it names (tune, module patterns, autocast field).
Each test names the defect it caught."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import ampfx
from ampfx.module_match import resolve
from ampfx.errors import PolicyError

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ fp32_modules
def test_glob_character_ranges_match_as_fnmatch_does():
    """'[0-2]' kept modules 0 and 2 only (the '-' was escaped: a set of '0', '-', '2'); '[!0-2]' kept 1."""
    net = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
    assert [p for p, _ in resolve(net, ("[0-2]",))] == ["0", "1", "2"]
    assert [p for p, _ in resolve(net, ("[!0-2]",))] == ["3"]


def test_glob_negated_set_stays_within_one_name_segment():
    """'a[!x]b' matched 'a.b': '[!...]' must not cross a dot, as '*' and '?' do not."""
    net = nn.Module()
    net.a = nn.Module()
    net.a.b = nn.Linear(2, 2)
    net.acb = nn.Linear(2, 2)
    assert [p for p, _ in resolve(net, ("a[!x]b",))] == ["acb"]


def test_glob_with_a_reversed_range_is_a_policy_error():
    with pytest.raises(PolicyError, match=r"\[2-0\]"):
        resolve(nn.Sequential(nn.Linear(2, 2)), ("[2-0]",))


def test_a_module_object_in_fp32_modules_is_an_error_naming_its_name():
    """A module object was taken for a predicate and called as forward(module, fqn): the error blamed a
    'predicate' raising TypeError instead of saying to give the module's name."""
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    for value in (net[0], (net[0],)):
        with pytest.raises(PolicyError, match="module object.*name"):
            ampfx.Policy(fp32_modules=value)


# ------------------------------------------------------------------ tune
class Offset(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return (self.fc(x) + 300.0) - 300.0


def _offset():
    torch.manual_seed(0)
    net, x = Offset(), torch.randn(16, 8)
    with torch.no_grad():
        want = net(x)
    return net, x, want


def test_a_metric_that_trains_the_model_sees_the_same_weights_each_time_and_leaves_them():
    """A metric that takes an optimizer step (fine-tune, then measure) changed the user's float32 weights
    for good, and each evaluation started from other weights (the search then blamed determinism)."""
    net, x, want = _offset()
    before = {k: v.clone() for k, v in net.state_dict().items()}

    def metric(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        (m(x).float() - want).pow(2).mean().backward()
        opt.step()
        with torch.no_grad():
            return -float((m(x).float() - want).pow(2).mean())

    amp = ampfx.tune(net, "bf16", example_inputs=(x,), metric=metric, tolerance=1e-4, progress=False)
    assert amp.ampfx_tune.kept == ("add",)
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in net.parameters())


def test_a_numpy_float_metric_is_a_number():
    """np.float32 (np.mean of a float32 array) was rejected as 'not a number'."""
    net, x, want = _offset()
    amp = ampfx.tune(net, "bf16", example_inputs=(x,), tolerance=1e-4, progress=False,
                     metric=lambda m: np.float32(-(m(x).detach().float() - want).pow(2).mean().item()))
    assert amp.ampfx_tune.kept == ("add",)


# ------------------------------------------------------------------ the autocast field
class DtypeArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return torch.softmax(h, -1, dtype=torch.float32) + 1, h.cumsum(0, dtype=torch.float32) * 2


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_dtype_argument_decides_the_autocast_dtype_in_exported_graphs_too(tracer):
    """torch.export passes dtype= by position (aten.softmax.int(h, -1, torch.float32)): the analysis read
    only keywords and said bfloat16 where autocast computes float32."""
    x = torch.randn(4, 8)
    report = ampfx.convert(DtypeArgs(), "bf16", example_inputs=(x,), tracer=tracer).ampfx_report
    got = {r.op: r.autocast for r in report.records if r.op in ("softmax", "cumsum")}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s, c = DtypeArgs()(x)
    assert got == {"softmax": torch.float32, "cumsum": torch.float32} and s.dtype == c.dtype == torch.float32
