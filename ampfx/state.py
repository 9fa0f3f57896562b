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

import collections
import contextlib
import random
import sys
from dataclasses import dataclass
from typing import Any, Iterator

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
def kept_rng(*tensors: torch.Tensor) -> Iterator[None]:
    """The random state of the CPU and of every CUDA device in use (initialised, or holding one of
    ``tensors``) put back on exit, so a run made during conversion draws nothing from the caller's."""
    cuda = {t.device.index or 0 for t in tensors if t.device.type == "cuda"}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda |= set(range(torch.cuda.device_count()))
    with torch.random.fork_rng(devices=sorted(cuda)):
        yield


@dataclass
class Draws:
    """Whether a block run under :func:`kept_random` drew random numbers (set on exit)."""

    drew: bool = False


def _random_states(torch_too: bool) -> list[Any]:
    states: list[Any] = [random.getstate()]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, *rest = numpy.random.get_state()
        states.append((kind, keys.tobytes(), *rest))
    if torch_too:
        states.append(bytes(torch.get_rng_state().tolist()))
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            states.extend(bytes(s.tolist()) for s in torch.cuda.get_rng_state_all())
    return states


@contextlib.contextmanager
def kept_random(torch_too: bool = True) -> Iterator[Draws]:
    """Python's, numpy's and (with ``torch_too``) torch's random state put back on exit; the
    yielded :class:`Draws` says whether the block drew from any of them. Tracing a model on
    proxies draws nothing: a draw means its Python decided something on a random value (a
    layerdrop ``if torch.rand(()) < p``), which a graph would freeze.

    >>> with kept_random() as seen:
    ...     _ = random.random()
    >>> seen.drew
    True
    """
    before = _random_states(torch_too)
    python, numpy = random.getstate(), sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    seen = Draws()
    with kept_rng() if torch_too else contextlib.nullcontext():
        try:
            yield seen
        finally:
            seen.drew = _random_states(torch_too) != before
            random.setstate(python)
            if numpy_state is not None:
                numpy.random.set_state(numpy_state)


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


def copy_tree(m: nn.Module) -> nn.Module:
    """A copy of every module object in the tree that shares parameters and buffers.

    Training flags, hooks and submodule slots of the copy are its own, so the
    original model is never changed by what is done to the copy.
    """
    new = m.__class__.__new__(m.__class__)
    new.__dict__.update(m.__dict__)
    for k, v in list(new.__dict__.items()):
        # torch's own containers (parameters, buffers, hooks); a subclass such as diffusers' FrozenDict config
        # stays shared (its copy() loses the attributes it mirrors its keys in)
        if type(v) in (dict, list, set, collections.OrderedDict):
            new.__dict__[k] = v.copy()
    new._modules = {k: (copy_tree(v) if v is not None else None) for k, v in m._modules.items()}
    return new
