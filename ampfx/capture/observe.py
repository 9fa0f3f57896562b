"""One real run of the model on its example inputs, and what it shows.

Conversion runs the model's own Python for three facts that fake tensors cannot
give: what each submodule receives (a module that keeps its Python has its
children converted on those inputs), the values other libraries' leaves see
(DGL's float16 overflow guard), and how the children of a module that keeps its
Python pass values to each other through its Python (:class:`Links`: which
children's outputs it only moves into other children). :func:`observe` gets all
from one run, on the private copy of the model, in eval mode without gradients;
buffers, training flags and the random state (CPU and CUDA) are put back afterwards.

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU())
>>> seen = observe(net, ExampleInputs.of((torch.ones(1, 2),)), calls=True)
>>> sorted(seen.calls), seen.calls["1"].args[0].shape
(['0', '1'], torch.Size([1, 3]))
>>> seen.links[""].hands_on({"0", "1"}), seen.links[""].fed_by("1")
(True, frozenset({('0', 0)}))
"""
from __future__ import annotations

import contextlib
import functools
import gc
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ..inputs import ExampleInputs
from ..runtime import handing
from ..state import kept_attributes, kept_buffers, kept_rng, modes

Source = tuple[str, int]
"""A child's output: (the child's path, the index of one of its float outputs)."""


@dataclass(frozen=True)
class Links:
    """How the children of one module pass values to each other through its own Python, in one run of it.
    Its children are the recorded modules it calls itself (paths in the observed model); a value is
    *moved* from children's outputs when only :data:`ampfx.ops.MOVES` made it of them.

    ``feeds``: for each child, per float tensor of its first call, the children's outputs it is moved from
    (``None``: anything else made it); ``takes``: the children's outputs each child's calls take so;
    ``outputs``: each child's number of float outputs; ``calls``: how often each child was called, in the
    order of their first calls; ``fanned``: the outputs one of whose values (the output, or a move of it)
    two or more readers read (moves, children's calls, the Python computing with it): in the low dtype,
    autograd would sum their gradients low; ``stored``: the outputs a value of which outlived the call
    without being returned (kept on a module, in a list or a cache)."""

    feeds: dict[str, tuple[frozenset[Source] | None, ...]] = field(default_factory=dict)
    takes: dict[str, frozenset[Source]] = field(default_factory=dict)
    outputs: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    fanned: frozenset[Source] = frozenset()
    stored: frozenset[Source] = frozenset()

    def hands_on(self, converted: set[str] | frozenset[str]) -> bool:
        """Does a child of ``converted`` take another's outputs, moved there alone, and none of their values
        outlive the call? (Then they hand each other the low dtype: :mod:`ampfx.runtime.handing`.)"""
        if any(src in converted for src, _ in self.stored):
            return False
        return any(src in converted for child in converted for src, _ in self.takes.get(child, ()))

    def fed_by(self, path: str) -> frozenset[Source] | None:
        """The children's outputs every float input of the child at ``path`` (called once) is moved from;
        ``None`` where some input is not, or it takes none."""
        feeds = self.feeds.get(path, ())
        if self.calls.get(path) != 1 or not feeds or any(f is None for f in feeds):
            return None
        return frozenset().union(*feeds)

    def renamed(self, full: Callable[[str], str]) -> "Links":
        """The same links with every path passed through ``full``."""
        def sources(found: frozenset[Source]) -> frozenset[Source]:
            return frozenset((full(p), k) for p, k in found)
        return Links({full(p): tuple(None if f is None else sources(f) for f in fs) for p, fs in self.feeds.items()},
                     {full(p): sources(t) for p, t in self.takes.items()}, {full(p): n for p, n in self.outputs.items()},
                     {full(p): n for p, n in self.calls.items()}, sources(self.fanned), sources(self.stored))


@dataclass(frozen=True)
class Observation:
    """``calls``: what each submodule received first (snapshots, by module path); ``seen``: for
    each module watched, what ``watch`` returned on each of its calls (``None`` where it raised);
    ``links``: for the model and each recorded module, how its children pass values (:class:`Links`)."""

    calls: dict[str, ExampleInputs] = field(default_factory=dict)
    seen: dict[str, list[Any]] = field(default_factory=dict)
    links: dict[str, Links] = field(default_factory=dict)


def observe(model: nn.Module, inputs: ExampleInputs, *, calls: bool | Callable[[str], bool] = False,
            watch: dict[str, Callable[[nn.Module, tuple, dict], Any]] | None = None) -> Observation:
    """Run ``model`` once on ``inputs`` (see the module docstring). ``calls`` (``True``, or a test
    of the module path) chooses the submodules whose first call is recorded; ``watch`` maps module
    paths to a function of each call's ``(module, args, kwargs)`` whose results are kept in
    ``Observation.seen``. The links of the model and of every recorded module are followed when
    ``calls`` records any."""
    record = calls if callable(calls) else (lambda path: calls)
    first: dict[str, ExampleInputs] = {}
    seen: dict[str, list[Any]] = {path: [] for path in watch or {}}
    hooks = []
    flows = _Flows()
    for path, sub in model.named_modules():
        if not path or not (record(path) or path in seen) or isinstance(sub, torch.jit.ScriptModule):
            continue  # a TorchScript module takes no hooks (it is an opaque leaf: nothing inside it is converted)

        def hook(mod: nn.Module, args: tuple, kwargs: dict, path: str = path) -> None:
            with flows.paused():
                note(mod, args, kwargs, path)

        def note(mod: nn.Module, args: tuple, kwargs: dict, path: str) -> None:
            if path not in first and record(path):  # a snapshot: the forward may change what it passed (caches)
                first[path] = ExampleInputs(args, kwargs).snapshot()
            if path in seen:
                try:
                    seen[path].append(watch[path](mod, args, kwargs))
                except Exception:  # noqa: BLE001 - nothing seen of this call; the run goes on
                    seen[path].append(None)
        hooks.append(sub.register_forward_pre_hook(hook, with_kwargs=True))
        if record(path):
            hooks.append(sub.register_forward_pre_hook(functools.partial(flows.enter, path), with_kwargs=True))
            hooks.append(sub.register_forward_hook(functools.partial(flows.leave, path), prepend=True,
                                                   always_call=True))
    try:
        # a cache the run fills is emptied again: a capture after it would take its contents for constants
        with kept_rng(*model.parameters(), *inputs.tensors()), kept_buffers(model), \
                kept_attributes(model, bookkeeping=False), modes(model, training=False), torch.no_grad():
            if len(hooks) > len(first) and any(record(p) for p, _ in model.named_modules() if p):
                with flows:
                    out = inputs.call(model)
                    flows.finish(out)
                del out
            else:
                inputs.call(model)
    finally:
        for h in hooks:
            h.remove()
    return Observation({p: ExampleInputs.from_call(model.get_submodule(p), c.args, c.kwargs) for p, c in first.items()},
                       seen, flows.links())


def _floats(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


class _Flows(TorchFunctionMode):
    """Follows the float outputs of recorded modules through the Python of the module that called them
    (:class:`Links`), with the classification the run time uses (:func:`ampfx.runtime.handing.kind`).
    ``stack``: the recorded modules running, innermost last (``""``: the model's own Python). Tensors are
    held weakly: one still alive when its level's Python has returned, and not returned by it, was stored
    (on a module, in a list or a cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = [""]
        self.pause = 0
        # marked tensors by id: (weak reference, by level what it is moved from, serial number). What is counted of one
        # is keyed by its serial: a freed tensor's id may be reused by another
        self.made: dict[int, tuple[weakref.ref, dict[str, frozenset[Source]], int]] = {}
        self.serials: dict[int, tuple[weakref.ref, dict[str, frozenset[Source]], int]] = {}
        self.at: dict[str, list[int]] = {}  # by level: the serials it marked since the level's Python began
        self.uses: dict[tuple[int, str], int] = {}  # children's calls reading a marked tensor
        self.moved: dict[tuple[int, str], list[int]] = {}  # the marked tensors moves made of a marked tensor
        self.read: set[tuple[int, str]] = set()  # marked tensors the level's Python computes with, writes or returns
        self.feeds: dict[str, dict[str, tuple[frozenset[Source] | None, ...]]] = {}
        self.takes: dict[str, dict[str, set[Source]]] = {}
        self.fanned: dict[str, set[Source]] = {}
        self.stored: dict[str, set[Source]] = {}
        self.outputs: dict[str, dict[str, int]] = {}
        self.calls: dict[str, dict[str, int]] = {}

    def _hit(self, t: torch.Tensor) -> tuple | None:
        hit = self.made.get(id(t))
        return hit if hit is not None and hit[0]() is t else None

    def _of(self, t: torch.Tensor, level: str) -> frozenset[Source] | None:
        hit = self._hit(t)
        return hit[1].get(level) if hit is not None else None

    def _mark(self, t: torch.Tensor, level: str, sources: frozenset[Source]) -> int:
        hit = self._hit(t)
        if hit is None:
            serial = len(self.serials)
            hit = self.made[id(t)] = self.serials[serial] = (weakref.ref(t), {}, serial)
        hit[1][level] = sources
        self.at.setdefault(level, []).append(hit[2])
        return hit[2]

    def _use(self, t: torch.Tensor, level: str, computed: bool = False) -> None:
        if self._of(t, level):
            key = (self._hit(t)[2], level)
            if computed:
                self.read.add(key)
            else:
                self.uses[key] = self.uses.get(key, 0) + 1

    def enter(self, path: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        with self.paused():
            self._enter(path, args, kwargs)

    def leave(self, path: str, module: nn.Module, args: tuple, out: Any) -> None:
        with self.paused():
            self._leave(path, out)

    def _enter(self, path: str, args: tuple, kwargs: dict) -> None:
        level = self.stack[-1]
        calls = self.calls.setdefault(level, {})
        calls[path] = calls.get(path, 0) + 1
        floats = _floats((args, kwargs))
        feeds = tuple(self._of(t, level) for t in floats)
        for t in floats:
            self._use(t, level)
        self.feeds.setdefault(level, {}).setdefault(path, feeds)
        self.takes.setdefault(level, {}).setdefault(path, set()).update(*(f for f in feeds if f))
        self.stack.append(path)

    def _leave(self, path: str, out: Any) -> None:
        if self.stack[-1] == path:
            self.stack.pop()
        self.finish(out, level=path)  # its own Python returns it
        floats = _floats(out)
        self.outputs.setdefault(self.stack[-1], {})[path] = len(floats)
        for k, t in enumerate(floats):
            self._mark(t, self.stack[-1], frozenset({(path, k)}))

    def finish(self, out: Any, level: str = "") -> None:
        """The Python at ``level`` returned ``out``: the children's outputs it fanned out while low (read by two
        or more of moves, children's calls and its own computing), and those it stored, are known."""
        returned = {self._hit(t)[2] for t in _floats(out) if self._hit(t) is not None}
        for t in _floats(out):
            self._use(t, level, computed=True)
        ids = list(dict.fromkeys(self.at.pop(level, ())))  # serials
        used: dict[int, bool] = {}

        def reaches(i: int) -> bool:  # read by a child, its own computing or a move whose result is (not .item())
            if i not in used:
                used[i] = False
                used[i] = self.uses.get((i, level), 0) > 0 or (i, level) in self.read or \
                    any(reaches(o) for o in self.moved.get((i, level), ()))
            return used[i]
        kept = []
        for i in ids:
            hit = self.serials.get(i)
            sources = hit[1].get(level) if hit is not None else None
            if not sources:
                continue
            readers = self.uses.get((i, level), 0) + ((i, level) in self.read) + \
                sum(reaches(o) for o in self.moved.get((i, level), ()))
            if readers > 1:
                self.fanned.setdefault(level, set()).update(sources)
            if hit[0]() is not None and i not in returned:
                kept.append((hit[0], sources))
        if kept:  # alive: stored, or held by a reference cycle not yet collected (a frame in a traceback)
            gc.collect()
        for ref, sources in kept:
            if ref() is not None:
                self.stored.setdefault(level, set()).update(sources)
        for i in ids:
            self.uses.pop((i, level), None)
            self.moved.pop((i, level), None)
            self.read.discard((i, level))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops run here (the observation's own, on what a hook sees) are not the model's."""
        self.pause += 1
        try:
            yield
        finally:
            self.pause -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.pause:
            return out
        level = self.stack[-1]
        floats = _floats((args, kwargs))
        sources = [self._of(t, level) for t in floats]
        if not any(sources):
            return out
        what = handing.kind(func, args, kwargs)
        if what in (handing.SIZE, handing.DTYPE):
            return out
        if what == handing.MOVE and all(sources):
            for t in _floats(out):
                made = self._mark(t, level, frozenset().union(*sources))
                for r in floats:
                    self.moved.setdefault((self._hit(r)[2], level), []).append(made)
            return out
        if _floats(out):  # a comparison's or an index's result carries no gradient back
            for t in floats:
                self._use(t, level, computed=True)
        return out

    def links(self) -> dict[str, Links]:
        levels = set(self.calls)
        return {level: Links(self.feeds.get(level, {}), {p: frozenset(t) for p, t in self.takes.get(level, {}).items()},
                             self.outputs.get(level, {}), self.calls.get(level, {}),
                             frozenset(self.fanned.get(level, ())), frozenset(self.stored.get(level, ())))
                for level in levels}
