"""ampfx.policy.module_match: which modules fp32_modules / keep_modules entries name (names, globs, classes,
predicates), and the errors for entries that cannot name one. Each test names the defect it caught."""
from __future__ import annotations

import pytest
import torch.nn as nn

import ampfx
from ampfx.errors import PolicyError
from ampfx.policy.module_match import resolve

@pytest.mark.usefixtures("one_thread")
def test_glob_character_ranges_match_as_fnmatch_does():
    """'[0-2]' kept modules 0 and 2 only (the '-' was escaped: a set of '0', '-', '2'); '[!0-2]' kept 1."""
    net = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
    assert [p for p, _ in resolve(net, ("[0-2]",))] == ["0", "1", "2"]
    assert [p for p, _ in resolve(net, ("[!0-2]",))] == ["3"]


@pytest.mark.usefixtures("one_thread")
def test_glob_negated_set_stays_within_one_name_segment():
    """'a[!x]b' matched 'a.b': '[!...]' must not cross a dot, as '*' and '?' do not."""
    net = nn.Module()
    net.a = nn.Module()
    net.a.b = nn.Linear(2, 2)
    net.acb = nn.Linear(2, 2)
    assert [p for p, _ in resolve(net, ("a[!x]b",))] == ["acb"]


@pytest.mark.usefixtures("one_thread")
def test_glob_with_a_reversed_range_is_a_policy_error():
    with pytest.raises(PolicyError, match=r"\[2-0\]"):
        resolve(nn.Sequential(nn.Linear(2, 2)), ("[2-0]",))


@pytest.mark.usefixtures("one_thread")
def test_a_module_object_in_fp32_modules_is_an_error_naming_its_name():
    """A module object was taken for a predicate and called as forward(module, fqn): the error blamed a
    'predicate' raising TypeError instead of saying to give the module's name."""
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    for value in (net[0], (net[0],)):
        with pytest.raises(PolicyError, match="module object.*name"):
            ampfx.Policy(fp32_modules=value)
