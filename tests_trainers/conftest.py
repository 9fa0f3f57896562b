import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

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
    """TrainingArguments(bf16=True) exports ACCELERATE_MIXED_PRECISION (the root conftest clears AMPFX_*)."""
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    torch.manual_seed(0)


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps one process-wide state: each test that uses it makes its own accelerator."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


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


def classifier(package):
    """The Lightning tests' small classifier, a ``LightningModule`` of ``package`` (``lightning`` or
    ``pytorch_lightning``). ``poison_first=True`` makes the first step's loss infinite (a float16 scaler must skip
    it)."""
    class Classifier(package.LightningModule):
        def __init__(self, poison_first=False):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))
            self.losses, self.poison_first = [], poison_first

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, i):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.losses.append(loss.item())
            if self.poison_first and i == 0 and self.current_epoch == 0:
                loss = loss * math.inf  # gradients not finite: a float16 scaler must skip this step
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.2)
    return Classifier
