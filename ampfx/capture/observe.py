"""One real run of the model on its example inputs, and what it shows.

Conversion runs the model's own Python for two facts that fake tensors cannot
give: what each submodule receives (a module that keeps its Python has its
children converted on those inputs) and the values other libraries' leaves see
(DGL's float16 overflow guard). :func:`observe` gets both from one run, on the
private copy of the model, in eval mode without gradients; buffers, training
flags and the random state (CPU and CUDA) are put back afterwards.

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU())
>>> seen = observe(net, ExampleInputs.of((torch.ones(1, 2),)), calls=True)
>>> sorted(seen.calls), seen.calls["1"].args[0].shape
(['0', '1'], torch.Size([1, 3]))
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from ..inputs import ExampleInputs
from ..state import kept_attributes, kept_buffers, kept_rng, modes


@dataclass(frozen=True)
class Observation:
    """``calls``: what each submodule received first (snapshots, by module path); ``seen``: for
    each module watched, what ``watch`` returned on each of its calls (``None`` where it raised)."""

    calls: dict[str, ExampleInputs] = field(default_factory=dict)
    seen: dict[str, list[Any]] = field(default_factory=dict)


def observe(model: nn.Module, inputs: ExampleInputs, *, calls: bool | Callable[[str], bool] = False,
            watch: dict[str, Callable[[nn.Module, tuple, dict], Any]] | None = None) -> Observation:
    """Run ``model`` once on ``inputs`` (see the module docstring). ``calls`` (``True``, or a test
    of the module path) chooses the submodules whose first call is recorded; ``watch`` maps module
    paths to a function of each call's ``(module, args, kwargs)`` whose results are kept in
    ``Observation.seen``."""
    record = calls if callable(calls) else (lambda path: calls)
    first: dict[str, ExampleInputs] = {}
    seen: dict[str, list[Any]] = {path: [] for path in watch or {}}
    hooks = []
    for path, sub in model.named_modules():
        if not path or not (record(path) or path in seen) or isinstance(sub, torch.jit.ScriptModule):
            continue  # a TorchScript module takes no hooks (it is an opaque leaf: nothing inside it is converted)

        def hook(mod: nn.Module, args: tuple, kwargs: dict, path: str = path) -> None:
            if path not in first and record(path):  # a snapshot: the forward may change what it passed (caches)
                first[path] = ExampleInputs(args, kwargs).snapshot()
            if path in seen:
                try:
                    seen[path].append(watch[path](mod, args, kwargs))
                except Exception:  # noqa: BLE001 - nothing seen of this call; the run goes on
                    seen[path].append(None)
        hooks.append(sub.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        # a cache the run fills is emptied again: a capture after it would take its contents for constants
        with kept_rng(*model.parameters(), *inputs.tensors()), kept_buffers(model), \
                kept_attributes(model, bookkeeping=False), modes(model, training=False), torch.no_grad():
            inputs.call(model)
    finally:
        for h in hooks:
            h.remove()
    return Observation({p: ExampleInputs.from_call(model.get_submodule(p), c.args, c.kwargs) for p, c in first.items()},
                       seen)


MOVES = frozenset({
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "squeeze", "unsqueeze", "select",
    "slice", "split", "split_with_sizes", "unbind", "narrow", "as_strided", "clone", "contiguous", "cat", "stack",
    "alias", "detach", "flatten", "unflatten", "movedim", "chunk", "_to_copy", "lift_fresh",
})
"""ATen ops that move, copy or reshape data without computing on it (``_to_copy`` only where it keeps the
dtype: a move between devices). A value they make from low values is those low values."""

METADATA = frozenset({"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride", "dim",
                      "is_contiguous", "numel"})
"""ATen ops that read a tensor's sizes alone."""

Source = tuple[str, int]  # (a child's path, the index of one of its float outputs)


@dataclass(frozen=True)
class Links:
    """How the children of a module that keeps its Python pass values to each other, seen in one run of it
    (:func:`links`). ``feeds``: for each child, per float tensor of its first call, the children's
    outputs it is made of through :data:`MOVES` alone (``None``: anything else made it); ``takes``: the
    children's outputs any of its calls takes so. ``spent``: the children's outputs the module's own
    Python computes with or returns. ``outputs``: each child's number of float outputs; ``calls``: how
    often each child was called, in the order of their first calls."""

    feeds: dict[str, tuple[frozenset[Source] | None, ...]] = field(default_factory=dict)
    takes: dict[str, frozenset[Source]] = field(default_factory=dict)
    spent: frozenset[Source] = frozenset()
    outputs: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def hands_on(self, path: str) -> bool:
        """Do the float outputs of the child at ``path`` (called once) only reach other children's
        calls, through moves alone?"""
        return self.calls.get(path) == 1 and all((path, k) not in self.spent for k in range(self.outputs.get(path, 0)))

    def takes_handed(self, path: str) -> bool:
        """Does the child at ``path`` take outputs of a child that hands them on (:meth:`hands_on`)?"""
        return any(self.hands_on(p) for p, _ in self.takes.get(path, ()))

    def fed_by(self, path: str) -> frozenset[Source] | None:
        """The children's outputs all float inputs of the child at ``path`` are made of through moves
        alone, ``None`` where some are not (or it is called more than once, or takes none)."""
        feeds = self.feeds.get(path, ())
        if self.calls.get(path) != 1 or not feeds or any(f is None for f in feeds):
            return None
        return frozenset().union(*feeds)


def links(module: nn.Module, inputs: ExampleInputs, children: list[str]) -> Links:
    """Run ``module`` once on ``inputs`` (as :func:`observe` runs a model) and follow the float tensors
    its ``children`` (paths in ``module``) return through its own Python (see :class:`Links`)."""
    tracker = _Tracker()
    hooks = []
    for path in children:
        sub = module.get_submodule(path)
        hooks.append(sub.register_forward_pre_hook(functools.partial(tracker.enter, path)))
        hooks.append(sub.register_forward_hook(functools.partial(tracker.leave, path), prepend=True))
    try:
        with kept_rng(*module.parameters(), *inputs.tensors()), kept_buffers(module), \
                kept_attributes(module, bookkeeping=False), modes(module, training=False), torch.no_grad(), tracker:
            out = inputs.call(module)
    finally:
        for h in hooks:
            h.remove()
    tracker.spend(out)
    takes = {path: frozenset(found) for path, found in tracker.takes.items()}
    return Links(tracker.feeds, takes, frozenset(tracker.spent), tracker.outputs, tracker.calls)


def _floats(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


class _Tracker(TorchDispatchMode):
    """Follows children's float outputs through the ops run between the children's calls (:func:`links`)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, frozenset[Source]] = {}  # id of a tensor moves made from children's outputs
        self.alive: list[torch.Tensor] = []  # those tensors, kept so that their ids are not reused
        self.feeds: dict[str, tuple[frozenset[Source] | None, ...]] = {}
        self.takes: dict[str, set[Source]] = {}
        self.spent: set[Source] = set()
        self.outputs: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.depth = 0

    def enter(self, path: str, module: nn.Module, args: tuple) -> None:
        self.calls[path] = self.calls.get(path, 0) + 1
        if self.depth == 0:
            feeds = tuple(self.made.get(id(t)) for t in _floats(args))
            self.feeds.setdefault(path, feeds)
            self.takes.setdefault(path, set()).update(*(f for f in feeds if f))
        self.depth += 1

    def leave(self, path: str, module: nn.Module, args: tuple, out: Any) -> None:
        self.depth -= 1
        floats = _floats(out)
        self.outputs[path] = len(floats)
        if self.depth == 0:
            for k, t in enumerate(floats):
                self._mark(t, frozenset({(path, k)}))

    def spend(self, value: Any) -> None:
        """``value`` leaves the children's hands: what it is made of is spent."""
        for t in _floats(value):
            self.spent |= self.made.get(id(t), frozenset())

    def _mark(self, t: torch.Tensor, sources: frozenset[Source]) -> None:
        self.made[id(t)] = sources
        self.alive.append(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if self.depth:
            return out
        name = func.overloadpacket.__name__
        read = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        sources = [self.made.get(id(t)) for t in read if t.is_floating_point()]
        if name in METADATA or not any(sources):
            return out
        moves = name in MOVES and all(sources) and all(
            t.dtype == r.dtype for t in _floats(out) for r in read if r.is_floating_point())
        if not moves:
            self.spend(read)
            return out
        for t in _floats(out):
            self._mark(t, frozenset().union(*sources))
        return out
