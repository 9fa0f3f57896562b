"""The DGL lane: torch 2.2.1 + dgl 2.1.0 (scripts/test-dgl.sh builds its venv). Skipped without dgl."""
import sys
from pathlib import Path

import importlib.util

import pytest
import torch

if importlib.util.find_spec("dgl") is None:  # not the DGL lane's venv: collect nothing here
    collect_ignore_glob = ["*.py"]

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same random state (the AMPFX_* variables are cleared by the root conftest)."""
    torch.manual_seed(0)


