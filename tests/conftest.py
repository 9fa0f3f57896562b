import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _no_ampfx_env(monkeypatch):
    """Tests control the AMPFX_* variables themselves (convert reads os.environ)."""
    for k in list(os.environ):
        if k.startswith("AMPFX_"):
            monkeypatch.delenv(k)
    torch.manual_seed(0)
