"""One request for every entry point (ampfx.request): the same misspelt option, the same policy misuse, gets
the same ampfx error with the same suggestion from convert, tune and compare; what convert resolves of a
policy lives in its own record and never in the user's Policy."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import ampfx
from ampfx.errors import ArgumentError, PolicyError
from ampfx.request import Asked, build, resolve

X = torch.randn(4, 8)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def _entry_points(**options):
    """Each public entry point that converts, called with the same policy arguments."""
    net = _net()
    return {
        "convert": lambda: ampfx.convert(net, "bf16", example_inputs=(X,), **options),
        "tune": lambda: ampfx.tune(net, "bf16", example_inputs=(X,), metric=lambda m: 0.0, tolerance=0.1,
                                   progress=False, **options),
        "compare": lambda: ampfx.compare(net, "bf16", (X,), autocast=False, sensitivity=False, **options),
    }


@pytest.mark.parametrize("caller", ["convert", "tune", "compare"])
def test_a_misspelt_option_gets_the_same_error_and_suggestion_everywhere(caller):
    """``fp32_modulez=`` is an ArgumentError naming the option and suggesting ``fp32_modules``, whichever
    entry point gets it (tune raised a bare TypeError from Policy(...) before the request builder)."""
    with pytest.raises(ArgumentError) as e:
        _entry_points(fp32_modulez=("0",))[caller]()
    assert str(e.value).startswith(f"{caller}() got an unknown option fp32_modulez=('0',). Did you mean 'fp32_modules'")


@pytest.mark.parametrize("caller", ["convert", "tune", "compare"])
def test_policy_and_options_together_are_the_same_error_everywhere(caller):
    with pytest.raises(ArgumentError, match=rf"{caller}\(\): pass either policy= or policy options, not both"):
        _entry_points(policy=ampfx.Policy("bf16"), pad="never")[caller]()


@pytest.mark.parametrize("caller", ["convert", "tune", "compare"])
def test_a_bad_option_value_is_the_policy_error_everywhere(caller):
    with pytest.raises(PolicyError, match=r"pad='sometimes': use 'auto', 'always' or 'never'"):
        _entry_points(pad="sometimes")[caller]()


def test_compare_converts_with_the_options_it_is_given():
    """``compare(model, dtype, batch, **options)`` converts the model as convert() would with them."""
    net = _net()
    result = ampfx.compare(net, "bf16", (X,), autocast=False, sensitivity=False, fp32_modules=("2",))
    assert result.dtype == torch.bfloat16
    with pytest.raises(ArgumentError, match="apply when compare converts the model"):
        ampfx.compare(net, ampfx.convert(net, "bf16"), (X,), fp32_modules=("2",))


def test_the_users_policy_is_never_changed_and_what_convert_resolved_is_its_own_record():
    """convert() resolves ``fp32_modules`` / ``keep_modules`` / ``module_filter_fn`` against the model into a
    :class:`~ampfx.policy.Resolved`; the Policy given is the same object, equal to a fresh one, with no field
    set by convert (such fields had to be skipped by hand when saving, and one was missed)."""
    net = _net()
    policy = ampfx.Policy("bf16", fp32_modules=("2",), module_filter_fn=lambda m, fqn: fqn != "0")
    before = dataclasses.asdict(policy)
    amp = ampfx.convert(net, policy=policy, example_inputs=(X,))
    assert dataclasses.asdict(policy) == before
    assert not {"fp32_matched", "keep_matched", "filter_rejected"} & {f.name for f in dataclasses.fields(policy)}
    request = build(net, Asked(policy=policy, example_inputs=(X,)), environ={})
    assert request.policy == policy
    assert dict(request.resolved.fp32_matched) == {"2": "named in fp32_modules"}
    assert request.resolved.filter_rejected == frozenset({"0"})
    assert amp.ampfx_report.policy["fp32_matched"] == {"2": "named in fp32_modules"}
    assert resolve(net, ampfx.Policy("bf16")).fp32_matched == ()


def test_a_policy_saved_after_conversion_loads_back_equal(tmp_path):
    """A policy used by a conversion (keep_modules matched in the model) saves and loads back equal: nothing
    resolved rides along in it."""
    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            for b in self.blocks:
                x = b(x).relu()
            return x

    policy = ampfx.Policy("bf16", keep_modules=("blocks.*",))
    ampfx.convert(Blocks(), policy=policy, example_inputs=(X,))
    path = policy.save(tmp_path / "p.json")
    assert ampfx.Policy.from_file(path) == policy
