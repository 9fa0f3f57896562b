"""Small models shared by the tests: each a builder returning (model, example inputs, loss fn)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(12, 32), nn.Linear(32, 32), nn.Linear(32, 5)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        h = h + torch.tanh(self.fc2(h))
        return self.fc3(h)


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(2)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = self.pool(self.relu(self.bn1(self.conv1(x))))
        x = self.relu(self.bn2(self.conv2(x)))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 30, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, 16, d) * 0.02)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True)
                                    for _ in range(2))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 3)

    def forward(self, ids):
        h = self.emb(ids) + self.pos[:, : ids.shape[1]]
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h).mean(dim=1))


class RNNClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.rnn = nn.GRU(16, 16, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, ids):
        out, _ = self.rnn(self.emb(ids))
        return self.head(out[:, -1])


class Stage(nn.Module):
    """Linear, ReLU, Linear, ReLU: a part of a module that keeps its Python (tests of what parts hand each other)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc2(torch.relu(self.fc1(x))))


# ------------------------------------------------------------------ models torch.fx cannot trace whole
class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: torch.fx cannot trace this
            return self.lin(x)
        return -self.lin(x)


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), Branchy(), nn.Linear(8, 4)

    def forward(self, x):
        return self.c(F.relu(self.b(self.a(x))))


class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.head = Outer(), nn.Linear(4, 2)

    def forward(self, x):
        y = self.enc(x)
        if y.max() > 100:
            y = y / 2
        return self.head(y)



def build(name: str, seed: int = 0):
    torch.manual_seed(seed)
    if name == "mlp":
        return MLP(), (torch.randn(8, 12),), lambda y: F.cross_entropy(y, torch.arange(8) % 5)
    if name == "cnn":
        return CNN(), (torch.randn(4, 3, 8, 8),), lambda y: F.cross_entropy(y, torch.arange(4) % 4)
    if name == "transformer":
        return (TinyTransformer(), (torch.randint(0, 30, (4, 10)),),
                lambda y: F.cross_entropy(y, torch.arange(4) % 3))
    if name == "encoder_layer":
        return (nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), (torch.randn(2, 5, 64),),
                lambda y: y.float().pow(2).mean())
    if name == "rnn":
        return RNNClassifier(), (torch.randint(0, 20, (4, 7)),), lambda y: F.cross_entropy(y, torch.arange(4) % 3)
    raise KeyError(name)


MODELS = ["mlp", "cnn", "transformer", "encoder_layer", "rnn"]


class Offsets(nn.Module):
    """A deep MLP whose outputs are small corrections carried on large offsets: ``(y + c) - c``.
    Each offset add is one precision-critical accumulation (bfloat16 keeps 8 bits: at 512 its
    spacing is 4); everything else is fine in bfloat16."""

    def __init__(self, depth=10, width=16, offsets=(512.0,)):
        super().__init__()
        self.body = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())])
        self.heads = nn.ModuleList(nn.Linear(width, 4) for _ in offsets)
        self.offsets = offsets

    def forward(self, x):
        h = self.body(x)
        return torch.cat([(head(h) + c) - c for head, c in zip(self.heads, self.offsets)], -1)
