"""The tuned pass (passes/tuned.py): nodes named in Policy.tuned compute float32, rule 'tune'."""
import pytest
import torch
import torch.nn as nn

import ampfx
from ampfx.passes import tuned
from ampfx.report.records import Rule


def _net():
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))


def test_a_tuned_node_is_float32_with_the_reason_and_float32_flows_forward():
    amp = ampfx.convert(_net(), "bf16", tuned={"0:linear": "kept by tune: metric -1 -> -0.1"})
    rep = amp.ampfx_report
    d = rep.by_node("linear")
    assert (d.rule, d.dtype, d.reason) == (Rule.TUNE, torch.float32, "kept by tune: metric -1 -> -0.1")
    assert rep.by_node("_1").dtype == torch.float32  # the GELU after it follows the float32 (as after a deny op)
    assert rep.by_node("linear_1").dtype == torch.bfloat16
    assert "tuned" in rep.summary()
    x = torch.randn(3, 4)
    assert amp(x).dtype == torch.float32


def test_a_node_already_float32_keeps_its_own_rule():
    amp = ampfx.convert(_net(), "bf16", fp32_modules=("0",), tuned={"0:linear": "tuned"})
    assert amp.ampfx_report.by_node("linear").rule == Rule.FP32_MODULES


def test_keys_name_the_module_so_a_node_of_a_region_graph_is_reached():
    class Branchy(nn.Module):  # data-dependent control flow: runs eagerly, its children converted one by one
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x).relu() if x.sum() > 0 else self.a(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.head = Branchy(), nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.enc(x))

    x = torch.ones(3, 4)
    amp = ampfx.convert(Net(), "bf16", example_inputs=(x,), tuned={"enc.a:linear": "tuned"})
    by_key = {r.key: r for r in amp.ampfx_report.records}
    assert by_key["enc.a:linear"].rule == Rule.TUNE and by_key["head:linear"].rule == Rule.TABLE


def test_a_key_that_names_no_node_is_an_error_with_a_close_match():
    with pytest.raises(ampfx.PolicyError, match=r"'0:linear_9'.*Did you mean '0:linear'.*ampfx.tools.tune again"):
        ampfx.convert(_net(), "bf16", tuned={"0:linear_9": "tuned"})


def test_no_tuned_entries_leave_the_graph_alone():
    plain, again = ampfx.convert(_net(), "bf16"), ampfx.convert(_net(), "bf16", tuned=())
    assert [r.rule for r in plain.ampfx_report.records] == [r.rule for r in again.ampfx_report.records]
    assert tuned.keep_tuned.__doc__


@pytest.mark.parametrize("bad", ["add", [("a",)], [(1, "x")], [("", "x")], 3])
def test_bad_tuned_values_are_rejected(bad):
    with pytest.raises(ampfx.PolicyError, match="tuned"):
        ampfx.Policy(tuned=bad)
