"""Running a model during conversion without leaving a trace on it.

Shape propagation, calibration, recording the inputs of the parts converted on their own and tracing
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
import contextvars
import random
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .threads import set_elsewhere


@contextlib.contextmanager
def kept_buffers(module: nn.Module, grads: bool = False) -> Iterator[None]:
    """Restore every buffer (batch-norm statistics and counters) on exit, its value and its place (a
    forward that re-assigns one, ``self.n = self.n + 1``, leaves another tensor there), and with
    ``grads`` every parameter's ``.grad``."""
    # clones: backward accumulates into an existing .grad in place
    before = {p: (p.grad.clone() if p.grad is not None else None) for p in module.parameters()} if grads else {}
    slots = [(m._buffers, dict(m._buffers)) for m in module.modules() if not isinstance(m, torch.jit.ScriptModule)]
    try:
        with _kept_values(list(module.buffers())):
            yield
    finally:
        for p, g in before.items():
            p.grad = g
        for buffers, held in slots:
            if buffers.keys() != held.keys() or any(buffers[k] is not v for k, v in held.items()):
                buffers.clear()
                buffers.update(held)


@contextlib.contextmanager
def kept_requires_grad(module: nn.Module) -> Iterator[None]:
    """Every parameter's ``requires_grad`` put back on exit (a model's ``train()`` override that freezes
    a backbone, run on a copy that shares the parameters, must not freeze the model's).

    >>> lin = torch.nn.Linear(2, 2)
    >>> with kept_requires_grad(lin):
    ...     _ = lin.requires_grad_(False)
    >>> lin.weight.requires_grad
    True
    """
    flags = [(p, p.requires_grad) for p in module.parameters()]
    try:
        yield
    finally:
        for p, flag in flags:
            if p.requires_grad != flag:
                p.requires_grad_(flag)


def kept_parameters(module: nn.Module) -> contextlib.AbstractContextManager:
    """Restore every parameter's value on exit (a function handed the model that trains it, such as a
    metric taking an optimizer step, leaves the weights as they were)."""
    return _kept_values(list(module.parameters()))


@contextlib.contextmanager
def _kept_values(tensors: list[torch.Tensor]) -> Iterator[None]:
    """The values of ``tensors`` put back in place on exit (clones taken now)."""
    saved = [(t, t.detach().clone()) for t in tensors if t.device.type != "meta"]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, value in saved:
                if not _same(t, value):  # an unchanged tensor keeps its version counter (autograd's check)
                    t.copy_(value)


def _same(t: torch.Tensor, value: torch.Tensor) -> bool:
    """Does ``t`` still hold ``value`` (same shape and elements; NaN never counts as the same)?"""
    try:
        return t.shape == value.shape and bool(torch.equal(t, value))
    except (RuntimeError, TypeError, NotImplementedError):  # layouts torch.equal does not take: put back
        return False


@contextlib.contextmanager
def kept_rng(*tensors: torch.Tensor) -> Iterator[None]:
    """The random state of the CPU and of every CUDA device in use (initialised, or holding one of
    ``tensors``) put back on exit, so a run made during conversion draws nothing from the caller's."""
    cuda = {t.device.index or 0 for t in tensors if t.device.type == "cuda"}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda |= set(range(torch.cuda.device_count()))
    with torch.random.fork_rng(devices=sorted(cuda)):
        yield


def _top_level() -> int:
    """The level of the innermost torch.func transform (vmap, grad, jvp) open now; 0 outside any."""
    top = torch._C._functorch.peek_interpreter_stack()
    return 0 if top is None else top.level()


_CLOSE = {"Vmap": "_vmap_decrement_nesting", "Grad": "_grad_decrement_nesting", "Jvp": "_jvp_decrement_nesting",
          "Functionalize": "_func_decrement_nesting"}


@contextlib.contextmanager
def kept_transforms() -> Iterator[None]:
    """The torch.func transforms open on entry are the ones open on exit. A graph run node by node (an
    exported graph holds ``vmap`` as ``_vmap_increment_nesting`` ... ``_vmap_decrement_nesting`` nodes, as
    HF's attention masks write it) that fails between the two would leave a vmap level open for the rest
    of the process: every later random op then raises, and ``backward()`` says it runs inside a transform.

    >>> import torch
    >>> with kept_transforms():
    ...     _ = torch._C._functorch._vmap_increment_nesting(2, "error")   # opened, never closed
    >>> torch._C._functorch.peek_interpreter_stack() is None
    True
    """
    level = _top_level()
    try:
        yield
    finally:
        while _top_level() > level:
            kind = torch._C._functorch.peek_interpreter_stack().key().name
            getattr(torch._C._functorch, _CLOSE[kind])()


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


_UNWIND = {"Vmap": "_vmap_decrement_nesting", "Grad": "_grad_decrement_nesting", "Jvp": "_jvp_decrement_nesting",
           "Functionalize": "_func_decrement_nesting"}


@contextlib.contextmanager
def kept_functorch() -> Iterator[None]:
    """The torch.func levels open on entry are the ones open on exit: a level the block entered and did not leave
    (a trace that failed between a graph's ``_vmap_increment_nesting`` and its decrement, as in the graphs dynamo
    makes of Hugging Face's vmapped masks) is left here, or every op after it would run inside it.

    >>> with kept_functorch():
    ...     _ = torch._C._functorch._vmap_increment_nesting(2, "error")
    >>> torch._C._functorch.peek_interpreter_stack() is None
    True
    """
    top = _functorch_level()
    try:
        yield
    finally:
        while _functorch_level() > top:
            kind = torch._C._functorch.peek_interpreter_stack().key().name
            getattr(torch._C._functorch, _UNWIND[kind])()


def _functorch_level() -> int:
    """The level of the innermost torch.func transform open now (0: none)."""
    top = torch._C._functorch.peek_interpreter_stack()
    return 0 if top is None else top.level()


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


ORIGINS: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()
"""Each module :func:`copy_tree` made, to the module it copied (:func:`origin_of`)."""


def origin_of(m: nn.Module) -> nn.Module | None:
    """The module ``m`` is a copy of, through copies of copies (``None``: not a copy)."""
    found = None
    while True:
        try:
            up = ORIGINS.get(m)
        except TypeError:  # an unhashable module is never a copy
            return found
        if up is None:
            return found
        found = m = up


def copy_tree(m: nn.Module) -> nn.Module:
    """A copy of every module object in the tree that shares parameters and buffers.

    Training flags, hooks and submodule slots of the copy are its own, so the
    original model is never changed by what is done to the copy. Each copy remembers
    its original (:func:`origin_of`).
    """
    new = m.__class__.__new__(m.__class__)
    try:
        ORIGINS[new] = m
    except TypeError:
        pass
    new.__dict__.update(m.__dict__)
    for k, v in list(new.__dict__.items()):
        # torch's own containers (parameters, buffers, hooks); a subclass such as diffusers' FrozenDict config
        # stays shared (its copy() loses the attributes it mirrors its keys in)
        if type(v) in (dict, list, set, collections.OrderedDict):
            new.__dict__[k] = v.copy()
    new._modules = {k: (copy_tree(v) if v is not None else None) for k, v in m._modules.items()}
    return new


CONTAINERS = (dict, list, set, collections.OrderedDict)
"""Attribute containers a copy of a module gets its own shallow copy of (:func:`copy_tree`)."""
CLONE_BYTES = 128 * 2**20
"""Parameters up to this many bytes in all are cloned before conversion's runs and put back after;
larger ones are copied on first write (:class:`_SaveBeforeWrite`), which keeps memory flat but makes
every op of those runs pass through Python."""
TORCH_KEYS = frozenset(nn.Module().__dict__)  # nn.Module's own bookkeeping (hooks, parameters, ...)


class _SaveBeforeWrite(TorchDispatchMode):
    """Copy-on-write: before an op writes into the storage of one of ``tensors`` (an in-place
    update of a parameter in ``forward``, ``.data.mul_()``, ``out=``), keep a clone of it once.
    Nothing is cloned for a run that writes nothing."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.by_storage: dict[int, list[torch.Tensor]] = {}
        for t in tensors:
            ptr = _storage(t)
            if ptr:
                self.by_storage.setdefault(ptr, []).append(t)
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func._schema.is_mutable and self.by_storage:
            for t in tree_leaves((args, kwargs)):
                for owner in self.by_storage.get(_storage(t), ()) if isinstance(t, torch.Tensor) else ():
                    if id(owner) not in self.saved:
                        self.saved[id(owner)] = (owner, owner.detach().clone())
        return func(*args, **kwargs)


_PLAIN = tuple(c for c in (torch.Tensor, nn.Parameter, getattr(nn, "Buffer", None)) if c is not None)
"""Tensor types with a real storage (``nn.Buffer`` is new in torch 2.5; the DGL lane runs 2.2.1)."""


def _storage(t: torch.Tensor) -> int:
    """The address of ``t``'s storage; 0 where it has none to restore (meta, fake, subclasses)."""
    if t.device.type == "meta" or type(t) not in _PLAIN:
        return 0
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - a tensor without a real storage
        return 0


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor the model's modules hold: parameters, buffers, plain tensor attributes and the
    tensors in their top-level containers (caches)."""
    found: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for v in (*m._parameters.values(), *m._buffers.values(),
                  *tree_leaves([v for k, v in m.__dict__.items() if k not in TORCH_KEYS])):
            if isinstance(v, torch.Tensor):
                found[id(v)] = v
    return list(found.values())


@contextlib.contextmanager
def one_thread(model: nn.Module, *tensors: torch.Tensor) -> Iterator[None]:
    """torch's intra-op threads set to 1 while conversion runs a small CPU model, and put back on
    exit. Conversion's runs are a few steps on example inputs, mostly tiny ops; with other work on
    the machine, each parallel region of a tiny op waits for a descheduled thread, and a forward
    and backward of a 20k-node model went from 0.5 s to 20-50 s on a loaded 2-core machine
    (docs/benchmarks.md). Models over :data:`CLONE_BYTES` of parameters, or on another device,
    keep the caller's setting.

    >>> threads = torch.get_num_threads()
    >>> with one_thread(torch.nn.Linear(2, 2)):
    ...     torch.get_num_threads()
    1
    >>> torch.get_num_threads() == threads
    True
    """
    held = [*model.parameters(), *tensors]
    small = sum(t.numel() * t.element_size() for t in model.parameters()) <= CLONE_BYTES
    threads = torch.get_num_threads()
    if not small or threads == 1 or any(t.device.type != "cpu" for t in held):
        yield
        return
    torch.set_num_threads(1)
    token = CALLER_THREADS.set(threads)
    try:
        yield
    finally:
        CALLER_THREADS.reset(token)
        torch.set_num_threads(threads)


CALLER_THREADS: contextvars.ContextVar[int | None] = contextvars.ContextVar("ampfx_caller_threads", default=None)
"""Inside :func:`one_thread`, the intra-op threads the caller had (what a measurement of the device must use:
:mod:`ampfx.ops.device_cost`); ``None`` outside."""


def caller_threads() -> int:
    """The intra-op threads the code converting runs its model with: the caller's, also inside :func:`one_thread`."""
    inside = CALLER_THREADS.get()
    return torch.get_num_threads() if inside is None else inside


@contextlib.contextmanager
def untouched(model: nn.Module, *tensors: torch.Tensor) -> Iterator[None]:
    """Whatever runs inside leaves ``model`` and the caller's random state as they were: the
    values of every tensor its modules hold (copied on first write, put back in place), tensors
    re-pointed with ``.data =``, each module's attributes (rebound, added, or top-level containers
    changed in place), the CPU and CUDA random state, Python's and numpy's, and the state of every
    ``torch.Generator`` a module holds. Python objects changed in place below the first level of an
    attribute (a cache object's own fields) are not put back.

    >>> net = torch.nn.Linear(2, 2)
    >>> w = net.weight.clone()
    >>> with untouched(net):
    ...     with torch.no_grad():
    ...         _ = net.weight.mul_(0)
    ...     net.calls = 1
    >>> torch.equal(net.weight, w), hasattr(net, "calls")
    (True, False)
    """
    held = _tensors(model)
    params = {id(p) for p in model.parameters()}
    cloned = sum(t.numel() * t.element_size() for t in held if id(t) in params) <= CLONE_BYTES
    # buffers and tensor attributes are cloned now (export's non-strict tracing writes tensor attributes it
    # keeps as constants outside any dispatch mode); parameters too when they are small, else copied on
    # first write by a dispatch mode, which costs every op of every run a trip through Python
    small = [t for t in held if id(t) not in params or cloned]
    data = [(t, t.data, t._version) for t in held]
    guard = _SaveBeforeWrite([] if cloned else [t for t in held if id(t) in params])
    with _kept_values(small):
        try:
            with kept_attributes(model), kept_rng(*held, *tensors), kept_random(torch_too=False), \
                    kept_generators(model), kept_functorch(), (contextlib.nullcontext() if cloned else guard):
                yield
        finally:
            _put_back(data, guard.saved, cloned)


@contextlib.contextmanager
def kept_generators(model: nn.Module) -> Iterator[None]:
    """The state of every ``torch.Generator`` the model's modules hold (attributes, and inside their
    top-level containers) put back on exit: a forward drawing ``torch.rand(..., generator=self.g)`` during
    conversion must not move the model's own stream.

    >>> net = torch.nn.Linear(2, 2)
    >>> net.g = torch.Generator().manual_seed(0)
    >>> with kept_generators(net):
    ...     _ = torch.rand(3, generator=net.g)
    >>> torch.rand(1, generator=net.g).item() == torch.rand(1, generator=torch.Generator().manual_seed(0)).item()
    True
    """
    found: dict[int, torch.Generator] = {}
    for m in model.modules():
        for v in tree_leaves([v for k, v in m.__dict__.items() if k not in TORCH_KEYS]):
            if isinstance(v, torch.Generator):
                found[id(v)] = v
    states = [(g, g.get_state()) for g in found.values()]
    try:
        yield
    finally:
        for g, state in states:
            g.set_state(state)


@contextlib.contextmanager
def kept_attributes(model: nn.Module, bookkeeping: bool = True) -> Iterator[None]:
    """Each module's attributes put back after the block: rebound, added, or top-level containers
    changed in place (a cache a forward fills: a run during conversion must not leave it filled,
    or a later capture would take its contents for constants). Without ``bookkeeping``, nn.Module's
    own dicts (parameters, buffers, submodules, hooks) are left to the caller (a quarter of the cost).
    An attribute another thread set meanwhile (``model.eval()`` while a conversion runs) stays as that thread
    set it (:func:`ampfx.threads.set_elsewhere`).

    >>> net = torch.nn.Linear(2, 2)
    >>> net.cache = {}
    >>> with kept_attributes(net):
    ...     net.cache["cpu"] = 1; net.calls = 1
    >>> net.cache, hasattr(net, "calls")
    ({}, False)
    """
    skip = frozenset() if bookkeeping else TORCH_KEYS
    attrs = [(m, {k: v for k, v in m.__dict__.items() if k not in skip},
              {k: v.copy() for k, v in m.__dict__.items() if type(v) in CONTAINERS and k not in skip})
             for m in model.modules()]
    try:
        yield
    finally:
        for m, before, contents in attrs:
            theirs = set_elsewhere(m)
            for k in [k for k in m.__dict__ if k not in before and k not in skip and k not in theirs]:
                del m.__dict__[k]
            m.__dict__.update({k: v for k, v in before.items() if k not in theirs} if theirs else before)
            for k, v in contents.items():
                if k not in theirs:
                    refill(before[k], v)


def _put_back(data: list[tuple[torch.Tensor, torch.Tensor, int]], saved: dict, cloned: bool) -> None:
    """Tensors re-pointed with ``.data =`` and parameters written in place, put back; a parameter
    written where no copy could be kept is reported, not passed over (``cloned``: every parameter
    was cloned beforehand, and is put back by :func:`_kept_values`)."""
    with torch.no_grad():
        for t, d, _ in data:
            if t.data.data_ptr() != d.data_ptr():
                t.data = d
        for t, value in saved.values():
            t.copy_(value)
    lost = [t for t, _, version in data if isinstance(t, nn.Parameter) and t._version != version
            and id(t) not in saved and t.device.type != "meta" and not cloned]
    if lost:
        raise RuntimeError(f"ampfx.convert changed {len(lost)} parameter(s) of the model in place and could not "
                           "put them back (a forward that writes its parameters outside torch's dispatch); "
                           "please report this with the model")


def same_contents(container: Any, contents: Any) -> bool:
    """Does ``container`` (a dict or list) hold ``contents``' items, compared by identity only (``==`` on
    tensors is elementwise)?

    >>> w = torch.ones(1)
    >>> same_contents({"w": w}, {"w": w}), same_contents([w], [torch.ones(1)])
    (True, False)
    """
    if isinstance(container, dict):
        return len(container) == len(contents) and all(k in container and container[k] is v
                                                       for k, v in contents.items())
    return isinstance(container, list) and len(container) == len(contents) and all(
        a is b for a, b in zip(container, contents))


def refill(container: Any, contents: Any) -> None:
    """Put ``contents`` back into ``container`` in place (its identity is what others hold), unless it
    holds them already (:func:`same_contents`)."""
    if same_contents(container, contents):
        return
    container.clear()
    if isinstance(container, list):
        container.extend(contents)
    else:
        container.update(contents)


HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
              "_forward_hooks_always_called")


@contextlib.contextmanager
def without_hooks(module: nn.Module, keep: tuple[type, ...] = ()) -> Iterator[None]:
    """``module`` without its own forward hooks and pre-hooks inside the block (torch.export traces
    ``__call__``, which would inline them; :func:`keep_hooks` gives them to the graph module instead),
    put back after. Hooks that are instances of ``keep`` stay (they belong in the graph)."""
    saved = {name: getattr(module, name).copy() for name in HOOK_DICTS}
    for name in HOOK_DICTS:
        hooks = getattr(module, name)
        for key in [k for k, h in hooks.items() if not isinstance(h, keep)]:
            del hooks[key]
    try:
        yield
    finally:
        for name, hooks in saved.items():
            getattr(module, name).update(hooks)


def keep_hooks(new: nn.Module, old: nn.Module, skip: tuple[type, ...] = ()) -> None:
    """Give ``new`` (a graph traced from ``old.forward``) ``old``'s forward hooks and pre-hooks:
    torch.fx traces ``forward`` alone, so a hook on the traced module itself would be dropped
    (its submodules' hooks are traced into the graph). Hooks that are instances of ``skip`` are
    in the graph already (:func:`without_hooks` kept them for torch.export).

    >>> lin = torch.nn.Linear(2, 2)
    >>> _ = lin.register_forward_hook(lambda m, a, out: out * 0)
    >>> g = torch.fx.symbolic_trace(lin)
    >>> keep_hooks(g, lin)
    >>> g(torch.ones(1, 2)).abs().sum().item()
    0.0
    """
    for name in HOOK_DICTS:
        getattr(new, name).update((k, h) for k, h in getattr(old, name).items() if not isinstance(h, skip))
