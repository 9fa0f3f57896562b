"""The one conftest every lane shares (tests/, tests_models/, tests_dgl/, tests_trainers/ and the doctests of
``ampfx/``): no ``AMPFX_*`` variable of the shell reaches a test (convert() reads os.environ; tests set the ones
they need). The lanes' own conftests hold only what their lane needs.

Collection of ``ampfx/`` (doctests): the trainer integrations import their library at module level, so they
are left out where it is not installed (the core lane); the trainers lane (scripts/test-trainers.sh) tests them.
``ampfx/integrations/dgl.py`` is ``ampfx.libraries.dgl`` under its old name: collected there."""
import importlib.util
import os

import pytest

_NEEDS = {"ampfx/integrations/lightning.py": ("lightning", "pytorch_lightning"),
          "ampfx/integrations/accelerate.py": ("accelerate",), "ampfx/integrations/hf.py": ("transformers",)}
collect_ignore = [path for path, libraries in _NEEDS.items()
                  if all(importlib.util.find_spec(library) is None for library in libraries)]
collect_ignore.append("ampfx/integrations/dgl.py")  # the old name of ampfx/libraries/dgl.py (its doctests run there)


@pytest.fixture(autouse=True)
def _no_ampfx_env(monkeypatch):
    """Tests control the AMPFX_* variables themselves (convert reads os.environ)."""
    for key in list(os.environ):
        if key.startswith("AMPFX_"):
            monkeypatch.delenv(key)


@pytest.fixture(autouse=True, scope="session")
def _every_gemm_low():
    """The tests' models are tiny: on a CPU every GEMM of theirs is under the device's break-even
    (``ampfx.ops.gemm_cost``) and would stay float32, so the table is empty while they run (every GEMM low, on
    every device; before any fixture of a wider scope converts); the tests of that rule set it or
    ``gemm_min_flops``. Nothing is measured either (``ampfx.ops.device_cost``: the tests of measuring feed it
    tables). Processes the tests start clear both too (tests/distributed/harness.py)."""
    from ampfx.ops import device_cost, gemm_cost

    saved = dict(gemm_cost.BREAK_EVEN)
    measured_on = device_cost.measure_on(())
    gemm_cost.BREAK_EVEN.clear()
    yield
    gemm_cost.BREAK_EVEN.update(saved)
    device_cost.measure_on(measured_on)
