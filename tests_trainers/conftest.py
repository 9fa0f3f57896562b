import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class AutocastSpy:
    """Counts every ``torch.autocast`` entered (``torch.autocast(...)``, ``torch.amp.autocast``, Accelerate's and
    the HF Trainer's contexts all are this class) with ``enabled=True``."""

    def __init__(self):
        self.entered = 0

    def install(self, monkeypatch):
        real = torch.autocast.__enter__
        spy = self

        def enter(ctx):
            spy.entered += bool(getattr(ctx, "_enabled", True))
            return real(ctx)

        monkeypatch.setattr(torch.autocast, "__enter__", enter)
        return self


@pytest.fixture
def autocast_spy(monkeypatch):
    return AutocastSpy().install(monkeypatch)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """AMPFX_* variables are the tests' own; TrainingArguments(bf16=True) exports ACCELERATE_MIXED_PRECISION."""
    for k in list(os.environ):
        if k.startswith("AMPFX_") or k == "ACCELERATE_MIXED_PRECISION":
            monkeypatch.delenv(k)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread (two on a busy two-core machine make these steps many times slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def gap(a, b):
    """Largest absolute difference of two loss curves of the same length."""
    assert len(a) == len(b) and len(a) > 0
    return max(abs(x - y) for x, y in zip(a, b))
