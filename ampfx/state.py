"""Running a model during conversion without leaving a trace on it.

Shape propagation, calibration, recording the inputs of regions and tracing
the other training mode all run or trace the model; these context managers
put back what that may change.

>>> import torch
>>> bn = torch.nn.BatchNorm1d(2)
>>> with kept_buffers(bn), modes(bn, training=True):
...     _ = bn(torch.randn(4, 2))
>>> int(bn.num_batches_tracked)
0
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn


@contextlib.contextmanager
def kept_buffers(module: nn.Module, grads: bool = False) -> Iterator[None]:
    """Restore every buffer (batch-norm statistics and counters) on exit, and
    with ``grads`` every parameter's ``.grad``."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    # clones: backward accumulates into an existing .grad in place
    before = {p: (p.grad.clone() if p.grad is not None else None) for p in module.parameters()} if grads else {}
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)
        for p, g in before.items():
            p.grad = g


@contextlib.contextmanager
def modes(module: nn.Module, training: bool) -> Iterator[None]:
    """Every module of the tree in ``training`` mode; each one's own flag back on exit."""
    flags = {m: m.training for m in module.modules()}
    for m in flags:
        m.training = training
    try:
        yield
    finally:
        for m, flag in flags.items():
            m.training = flag
