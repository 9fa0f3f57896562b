"""Models for tests/test_cli.py's error cases (loaded by the CLI as tests/support/cli_models.py:NAME)."""
import torch.nn as nn


class AlwaysRaises(nn.Module):
    """A forward that cannot run on any input; its child converts on its own."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        raise ValueError("this model always raises")


class BareRaises(nn.Module):
    """No submodules and a forward that always raises: nothing to convert without running it."""

    def forward(self, x):
        raise ValueError("this model always raises")


class Embed(nn.Module):
    """Token ids -> embedding -> linear: ids must be below the vocabulary size (100)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 8)
        self.fc = nn.Linear(8, 4)

    def forward(self, ids):
        return self.fc(self.embed(ids))
