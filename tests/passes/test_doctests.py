"""The doctests of every ``ampfx.passes`` module, run on the imported module.

pytest's ``--doctest-modules`` cannot collect the top-level ``passes/`` folder by
path: its relative imports need the package name ``ampfx.passes``. So each module
is imported by that name and handed to ``doctest.testmod``.
"""
import doctest
import importlib
import pkgutil

import pytest

import ampfx.passes

MODULES = ["ampfx.passes"] + sorted(f"ampfx.passes.{m.name}" for m in pkgutil.iter_modules(ampfx.passes.__path__))
FLAGS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS  # as pyproject's doctest_optionflags


def _run(name):
    return doctest.testmod(importlib.import_module(name), optionflags=FLAGS, verbose=False, report=True)


def test_every_pass_module_is_found():
    """Every pass in the pipeline, and the shared context, has its module in the list."""
    assert {f"ampfx.passes.{p.__module__.rsplit('.', 1)[-1]}" for p in ampfx.passes.PIPELINE} <= set(MODULES)
    assert {"ampfx.passes.context", "ampfx.passes.shapes"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_module_doctests_pass(name):
    """Each module's doctests (docstrings of the module, its classes and functions) pass."""
    result = _run(name)
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctest examples failed in {name}"


def test_at_least_one_doctest_ran():
    """The passes do carry doctests (so the test above checks something)."""
    assert sum(_run(name).attempted for name in MODULES) >= 1
