"""Training mode's weight cache: each weight a low-precision op reads cast once, and again only when it changes.

In training mode a converted graph reads the float32 master of every weight and
casts it where a GEMM or convolution reads it low, as autocast does: one cast per
weight per forward, so gradient accumulation over ``k`` micro-batches casts every
weight ``k`` times per optimizer step (and activation checkpointing once more per
recompute). With the cache each graph module keeps a low copy of parameters its
graph casts to the low dtype; while the graph runs, those casts
(:func:`ampfx.runtime.cast`) return the copy through :class:`_CachedCast`, whose
backward sends the gradient to the float32 master. The graph itself is unchanged.

Which weights, and when (``weight_cache``, ``AMPFX_WEIGHT_CACHE``):

- ``"auto"`` (the default) decides per weight and per call (:class:`_Auto`). A cached read saves a cast of the
  weight and of its gradient, and costs a Python autograd node: it pays for a weight of at least
  :func:`ampfx.ops.device_cost.cache_limit` elements (measured on the device with the GEMM break-even, or the
  datasheet's), and only where the copy is read again before its master changes: while the graph runs more than
  once between optimizer steps (gradient accumulation, activation checkpointing's recompute, an evaluation
  loop; an optimizer step, or a write of its largest trained weight, marks a new step), for a frozen weight (``requires_grad``
  False, nothing steps it), and for a weight its graph casts more than once a call. Elsewhere (one forward a step,
  the usual case) nothing is cached, no copy is held, and the cache costs a check a call.
- ``True``: every cast weight, at every call (``AMPFX_WEIGHT_CACHE=1``).
- ``False``: none; weights are cast at every forward, as autocast casts them (``AMPFX_WEIGHT_CACHE=0``).

The copy is made again at the first call after its master changed: in the first
micro-batch of a step (``.grad`` is None) by the graph's own cast, whose result is
kept (that micro-batch runs exactly as without the cache); otherwise (no grad, or
``.grad`` already there) all stale ones together in one ``torch._foreach_copy_``
before the graph runs, writing over copies nothing else holds. A master counts as
changed when it was:

- written by anything in the process (an optimizer step, fused ones too, ``copy_``,
  ``load_state_dict``, a write through ``.data`` such as a teacher's momentum update or a
  hand-written SGD step): :mod:`ampfx.runtime.written`;
- re-pointed (``p.data = t``, ``vector_to_parameters``, ``model.to(device)``) or moved to
  shared memory (then it is cast at every call: other processes write it);
- replaced (``model.fc.weight = nn.Parameter(...)``, ``load_state_dict(assign=True)``):
  another object sits in the module's parameter dict.

A copy an autograd graph still holds (a forward not yet backpropagated) is never
written over: that graph keeps the values it was built with, as with a per-call cast.

Gradients: the first micro-batch's weight gradient reaches the master as a cast
would send it (autograd casts it to float32, ``AccumulateGrad`` keeps it as
``.grad``). When ``.grad`` already exists, :class:`_CachedCast` adds the low
gradient into it in place (a mixed-dtype ``add_``: the same float32 sum, without a
float32 temporary), but only where nothing else watches the accumulation: no
tensor hook or post-accumulate-grad hook on the master, no process group (DDP's
reducer hooks ``AccumulateGrad``, invisibly from Python), no ``create_graph``,
not ``autograd.grad`` (which must return the gradient, not accumulate it), not
under torch.compile. Elsewhere the gradient takes the ordinary path. A hook put on
the master's ``AccumulateGrad`` node itself (``p.view_as(p).grad_fn.next_functions[0][0]
.register_hook``) cannot be seen from Python: in one process, with such a hook, set
``weight_cache=False``.

The cache stands aside (the graph casts the master per call, as without it) inside
FSDP2 (a sharded module, or DTensor parameters: FSDP2 owns the low weights with a
``MixedPrecisionPolicy``, and cached unsharded copies would undo its sharding) and
while torch.compile traces the module (inductor fuses the casts into the graph),
and under ``torch.inference_mode`` (a copy made there could not serve autograd later).
``mode="inference"`` keeps its copies with this same cache, read another way (:mod:`ampfx.runtime.inference`): its
graph reads each copy from an attribute in place of the parameter (``reads_copies``), so no cast is intercepted,
and the copies are made again before every call that needs them, under ``torch.inference_mode`` too.
``"auto"`` also stands aside in a run of several processes that loaded FSDP2 (:func:`_auto_off`).
A graph module converted again at a call (a value its graph fixed changed, a call's sizes crossed its plan's) gets
its cache as the first conversion's did (:class:`ampfx.api.Arm`).
Memory: 2 bytes per cached bfloat16/float16 element, held between steps while cached
(:func:`status` says how much each graph module holds).

>>> import torch, ampfx
>>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> amp = ampfx.convert(m, "bf16", example_inputs=(torch.ones(4, 8),), weight_cache=True)  # every weight
>>> x = torch.ones(4, 8)
>>> amp(x).sum().backward()                      # first call: the weights are cast
>>> ampfx.count_casts(lambda: amp(x).sum().backward())   # same weights: only the input and output casts
3
>>> with torch.no_grad():
...     _ = m[0].weight.add_(1)                   # the master changes: its copy is made again at the next call
>>> torch.equal(amp(x), ampfx.convert(m, "bf16")(x))
True
>>> _ = m[2].weight.data.mul_(0.5)                # through .data too (a teacher's momentum update)
>>> torch.equal(amp(x), ampfx.convert(m, "bf16")(x))
True
"""
from __future__ import annotations

import contextlib
import copy
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
import torch.nn as nn

from .. import runtime
from .entries import runtime_of
from .reads import reads
from . import written
from ..errors import StaleModelError


class _CachedCast(torch.autograd.Function):
    """``low`` (a cached copy of ``master`` in a low dtype) as a tensor whose gradient reaches ``master``."""

    @staticmethod
    def forward(ctx: Any, master: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        # held, not saved: an in-place step between this forward and its backward must not raise (a cast saves
        # nothing either)
        ctx.master = master
        return low.view_as(low)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        master = ctx.master
        if _accumulates_in_place(ctx, master, grad):
            master.grad.add_(grad)  # float32 += low, computed in float32: the sum AccumulateGrad makes
            return None, None
        return grad.to(master.dtype), None


def _accumulates_in_place(ctx: Any, master: torch.Tensor, grad: torch.Tensor) -> bool:
    """May the backward of a cached weight add its gradient into ``master.grad`` itself? Only where the
    master's ``AccumulateGrad`` would add it in place and nobody watches that node."""
    held = master.grad
    if (held is None or torch.is_grad_enabled() or type(held) is not torch.Tensor or held.layout != torch.strided
            or held.requires_grad or held.dtype != master.dtype or held.shape != grad.shape
            or held.device != grad.device or grad.layout != torch.strided or type(grad) is not torch.Tensor):
        return False
    if master._backward_hooks or getattr(master, "_post_accumulate_grad_hooks", None):
        return False
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return False  # DDP / FSDP / DeepSpeed hook AccumulateGrad in C++, out of sight
    if runtime.is_compiling():
        return False
    try:
        return bool(torch._C._will_engine_execute_node(ctx.next_functions[0][0]))
    except RuntimeError:  # autograd.grad(..., master): the gradient is returned, not accumulated
        return False


@dataclass(eq=False)
class _Entry:
    owner: dict  # the parameter dict of the module that holds the master (the model's own)
    name: str
    path: str  # the master's path in the graph module, for messages
    master: Any = None  # the master the copy was made from, and its (version, storage) then
    key: Any = None
    low: Any = None
    pending: bool = False  # the copy is made by the master's first cast in the graph (refresh(at_use=True))
    attr: str | None = None  # reads_copies: the graph module's attribute the graph reads the copy from


STEPS = [0]
"""Optimizer steps taken in this process (torch.optim's global step post-hook, installed with the first ``"auto"``
cache): with ``watch``'s version counter, what tells :class:`_Auto` a step was taken."""
_HOOK: list[Any] = []


def _count_steps() -> None:
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook
        _HOOK.append(register_optimizer_step_post_hook(lambda *_: STEPS.__setitem__(0, STEPS[0] + 1)))


@dataclass(eq=False)
class _Auto:
    """``weight_cache="auto"``: which entries a call caches (see the module docstring). An optimizer step, or a
    write that moves the version counter of ``watch`` (the largest trained weight), or its replacement, starts a
    new step; from the second call of a step, and from the first where the last step had several, every weight in
    ``large`` is cached; otherwise only ``steady`` ones (read twice a call, or frozen: checked at each new step),
    and copies held before are let go. The signal only decides what to cache (each copy is checked against its
    master by :meth:`WeightCache.refresh`): a write it misses (through ``.data``, outside torch.optim) caches more
    than needed, never a stale copy. It costs two integer reads a call: no copy-on-write stamp, which would make
    the optimizer's write of that weight a copy."""

    large: list[_Entry]  # weights large enough that a cached read pays on the device
    several: list[_Entry]  # of those, the ones the graph casts more than once a call
    watch: _Entry | None  # whose writes mark a step (None: no trained weight is large enough to watch)
    key: Any = None  # (optimizer steps, ``watch``'s master, its version) when the step began
    calls: int = 0  # calls since the step began
    last: int = 0  # calls in the step before
    steady: list[_Entry] = field(default_factory=list)

    def __post_init__(self) -> None:
        _count_steps()

    def entries(self) -> list[_Entry]:
        """The entries this call caches."""
        w = self.watch
        if w is not None and not getattr(w.owner.get(w.name), "requires_grad", True):  # frozen since: watch another
            self.watch = w = watched(self.large)
            self.key = None
        if w is not None:
            master = w.owner.get(w.name)
            key = None if master is None else (STEPS[0], id(master), _version(master))
            if key is None or key != self.key:  # a new step (or the first call)
                self.last, self.calls, self.key = self.calls, 0, key
                self.steady = [e for e in self.large if e in self.several
                               or not getattr(e.owner.get(e.name), "requires_grad", True)]
        self.calls += 1
        return self.large if (self.calls >= 2 or self.last >= 2 or w is None) else self.steady


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (``None``: an inference tensor has none)."""
    try:
        return t._version
    except RuntimeError:
        return None


def watched(entries: list[_Entry]) -> _Entry | None:
    """The entry whose writes mark an optimizer step for :class:`_Auto`: the largest trained weight (``None``: none
    is trained)."""
    trained = [(e.owner[e.name].numel(), i, e) for i, e in enumerate(entries)
               if e.name in e.owner and e.owner[e.name].requires_grad]
    return max(trained)[2] if trained else None


@dataclass(eq=False)
class WeightCache:
    """The low copies of one graph module's weights (see the module docstring), the one store of them: training
    mode's cache, and ``mode="inference"``'s copies (``reads_copies``). While its graph runs (:meth:`used`),
    :func:`ampfx.runtime.cast` takes a cached weight's copy from :meth:`low`; or, with ``reads_copies``, the graph
    reads each copy from its attribute (:attr:`_Entry.attr`) and casts nothing."""

    dtype: torch.dtype
    entries: list[_Entry] = field(default_factory=list)
    #: ``weight_cache="auto"``: which entries each call caches (``None``: all of them, always)
    auto: _Auto | None = None
    #: ``mode="inference"``: the graph reads the copies from attributes of the graph module in place of the
    #: parameters (:func:`ampfx.runtime.inference.store_low` pointed its reads there), every call
    reads_copies: bool = False
    #: why the last call ran without the cache (``None``: it used it)
    off: str | None = None
    #: copies made since conversion (one per weight per refresh)
    casts: int = 0
    #: the entries the last call cached
    live: list[_Entry] = field(default_factory=list, repr=False)
    #: during a call: each cached master's id, to its entry
    _by_id: dict[int, _Entry] = field(default_factory=dict, repr=False)

    def __repr__(self) -> str:
        return f"WeightCache({str(self.dtype).replace('torch.', '')}: {', '.join(e.path for e in self.entries)})"

    def __post_init__(self) -> None:
        if not self.reads_copies:
            runtime.CACHES[0] += 1  # ampfx.runtime.cast looks for cached weights from now on

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("reads_copies", False)
        self.__post_init__()

    def _anew(self, owner: Callable[[dict], dict]) -> "WeightCache":
        """A cache over ``owner(parameter dict)`` with no copies yet (a copy's masters are other tensors: each copy
        is made again at its first call, the masters' version counters starting anew)."""
        entries = [_Entry(owner(e.owner), e.name, e.path, attr=e.attr) for e in self.entries]
        auto = None
        if self.auto is not None:
            same = dict(zip(map(id, self.entries), entries))
            auto = _Auto([same[id(e)] for e in self.auto.large], [same[id(e)] for e in self.auto.several],
                         None if self.auto.watch is None else same[id(self.auto.watch)])
        return WeightCache(self.dtype, entries, auto, reads_copies=self.reads_copies)

    def __deepcopy__(self, memo: dict) -> "WeightCache":
        return self._anew(lambda d: copy.deepcopy(d, memo))

    def __getstate__(self) -> dict:
        return self._anew(lambda d: d).__dict__

    def nbytes(self) -> int:
        """Bytes the low copies hold now."""
        return sum(e.low.numel() * e.low.element_size() for e in self.entries if e.low is not None)

    def refresh(self, at_use: bool = False, entries: list[_Entry] | None = None, gm: nn.Module | None = None,
                lent: list[tuple[str, Any]] | None = None) -> int:
        """Make again every copy of ``entries`` (default: those the last call cached) whose master was replaced,
        re-pointed or written since it was made, all in one ``torch._foreach_copy_``; the number made. With
        ``at_use`` (a forward with gradients), a master whose ``.grad`` is None (the first micro-batch of a step)
        is left to its first cast in the graph, which makes its copy (:meth:`low`): that cast and its gradient
        then run as without the cache. With ``reads_copies`` each copy made is put in ``gm``'s attribute its graph
        reads (a master that is not cast, as it is); a value given for this call in a master's place
        (:func:`_given_for_the_call`) is put there for this call only, with what the attribute held appended to
        ``lent`` (:meth:`put_back`)."""
        if self.reads_copies and gm is None:
            raise TypeError("refresh(): copies the graph reads from attributes need the graph module (gm=)")
        stale, masters = [], []
        for e in self.live if entries is None else entries:
            master = e.owner.get(e.name)
            if master is None:
                raise StaleModelError(f"parameter {e.path!r}, which the converted graph reads, was removed from the "
                                      "model: put it back or convert the model again")
            if master is e.master and written.unwritten(master, e.key):
                continue
            if lent is not None and _given_for_the_call(master):  # the graph's cast makes its low value (and gradient)
                lent.append((e.attr, gm.__dict__.get(e.attr)))
                gm.__dict__[e.attr] = master
                continue
            if not _cacheable(master, self.dtype):
                e.master, e.key, e.low, e.pending = master, written.stamp(master), None, False
                if self.reads_copies:
                    gm.__dict__[e.attr] = master  # the graph's cast takes it as it is
                continue
            if at_use and master.requires_grad and master.grad is None:
                e.master, e.key, e.low, e.pending = master, None, None, True  # the old copy is let go first
                continue
            stale.append(e)
            masters.append(master.detach())
        if stale:
            # a copy nothing else holds (no autograd graph still saves it) is written over; others are left to the
            # graphs that hold them, and a new copy is made. A copy the graph reads from an attribute is always made
            # anew: an autograd graph may save it as it is, which its storage's users do not show
            lows = [e.low if not self.reads_copies and _reusable(e.low, m, self.dtype)
                    else torch.empty_like(m, dtype=self.dtype) for e, m in zip(stale, masters)]
            with torch.no_grad():
                torch._foreach_copy_(lows, masters)
            for e, low in zip(stale, lows):
                master = e.owner[e.name]  # the parameter itself: its optimizer steps are noted by identity
                e.master, e.key, e.low, e.pending = master, written.stamp(master), low, False
                if self.reads_copies:
                    gm.__dict__[e.attr] = low
            self.casts += len(stale)
        return len(stale)

    @staticmethod
    def put_back(gm: nn.Module, lent: list[tuple[str, Any]]) -> None:
        """After a call that read values given for it (:meth:`refresh`'s ``lent``): the copies the graph reads
        otherwise."""
        for attr, held in lent:
            if held is None:
                gm.__dict__.pop(attr, None)  # none made yet: the next call makes it
            else:
                gm.__dict__[attr] = held

    def _let_go(self, keep: list[_Entry]) -> None:
        """Drop the copies of the entries not in ``keep`` (no longer cached: their memory is freed)."""
        kept = set(map(id, keep))
        for e in self.live:
            if id(e) not in kept:
                e.master = e.key = e.low = None
                e.pending = False
        self.live = keep

    @contextlib.contextmanager
    def used(self, gm: nn.Module) -> Iterator[None]:
        """Around a call of ``gm``'s graph: the copies made again where stale, and handed to the graph's casts;
        or, where the cache stands aside (:func:`_why_off`) or caches nothing this call (``"auto"``), nothing
        (the graph casts its masters). With ``reads_copies``: every copy made again where stale, in the
        attributes the graph reads, and values given for this call (``functional_call``'s, ``torch.func``'s) read in
        their masters' places until it returns."""
        if self.reads_copies:
            lent: list[tuple[str, Any]] = []
            self.refresh(entries=self.entries, gm=gm, lent=lent)
            try:
                yield
            finally:
                if lent:
                    self.put_back(gm, lent)
            return
        self.off = _why_off(gm, self.entries) or (_auto_off() if self.auto is not None else None)
        if self.off is not None:
            self._let_go([])  # copies made before (the module was sharded since) are let go
            yield
            return
        now = self.entries if self.auto is None else self.auto.entries()
        if now is not self.live:
            self._let_go(now)
        if not now:
            yield
            return
        self.refresh(at_use=torch.is_grad_enabled(), entries=now)
        self._by_id = {id(e.master): e for e in now if e.low is not None or e.pending}
        active = runtime.WEIGHTS.__dict__.setdefault("active", [])
        active.append(self)
        try:
            yield
        finally:
            active.pop()
            self._by_id = {}

    def low(self, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """``value``'s copy in ``dtype``, as a tensor whose gradient reaches ``value`` (``None``: not a cached
        master): the cached one, or, for a copy left to its first use, a cast whose result is kept."""
        e = self._by_id.get(id(value))
        if e is None or e.master is not value or dtype != self.dtype:
            return None
        if e.pending:  # the first micro-batch: cast as without the cache (autograd's own cast node), keep the copy
            out = value.to(dtype=dtype)
            e.low, e.key, e.pending = out.detach(), written.stamp(value), False
            self.casts += 1
            return out
        if value.requires_grad and torch.is_grad_enabled():
            return _CachedCast.apply(value, e.low)
        return e.low


def _given_for_the_call(t: torch.Tensor) -> bool:
    """Is ``t``, found in a parameter's place, a value given for one call rather than a parameter of the model:
    a plain tensor (``torch.func.functional_call`` puts its tensors there; a module's own parameters are
    ``nn.Parameter``), or one a ``torch.func`` transform wraps (``torch.vmap``'s, ``torch.func.grad``'s)?"""
    return not isinstance(t, nn.Parameter) or bool(_WRAPPED is not None and _WRAPPED(t))


_WRAPPED = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)


def _storage_users(t: torch.Tensor) -> int:
    """How many tensors hold ``t``'s storage (``t`` and its views, saved or not); 0 where torch cannot say."""
    try:
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata)
    except (AttributeError, RuntimeError):
        return 0


_ALONE = _storage_users(torch.empty(1))
"""What :func:`_storage_users` says of a tensor held by nothing else (the storage handle it takes counts too)."""


def _reusable(low: torch.Tensor | None, master: torch.Tensor, dtype: torch.dtype) -> bool:
    """May ``master``'s refreshed copy be written into ``low`` in place: same layout, and nothing else holds it
    (a forward's graph not yet backpropagated saves it, and must keep the values it was built with)?"""
    return (low is not None and low.shape == master.shape and low.stride() == master.stride()
            and low.device == master.device and low.dtype == dtype and _ALONE > 0 and _storage_users(low) == _ALONE)


def _cacheable(master: torch.Tensor, low: torch.dtype) -> bool:
    """Is ``master`` a plain float leaf the graph casts to ``low`` (not already low, not a DTensor or another
    subclass, not a value computed per call such as ``functional_call``'s, not on the meta device)?"""
    return (type(master) in (nn.Parameter, torch.Tensor) and master.is_leaf and master.dtype in runtime.CASTABLE
            and master.dtype != low and master.device.type != "meta")


def _why_off(gm: nn.Module, entries: list[_Entry]) -> str | None:
    """Why the cache stands aside for this call of ``gm`` (``None``: it does not)."""
    if runtime.is_compiling():
        return "torch.compile traces the module (inductor fuses the casts)"
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return "inside a torch.func transform (its tensors are wrapped per call)"
    if torch.is_inference_mode_enabled():
        return "torch.inference_mode (a copy made there could not be used by autograd later)"
    # fully_shard swaps the class of the module it is given; on a converted module, of the model module it stands for
    fsdp_module = _fsdp_module()
    if fsdp_module is not None and any(isinstance(m, fsdp_module) for m in (gm, gm.__dict__.get("_ampfx_model"))):
        return "FSDP2 shards the module (its MixedPrecisionPolicy owns the low weights)"
    if any(type(e.owner.get(e.name)).__name__ == "DTensor" for e in entries):
        return "its parameters are DTensors (FSDP2 or tensor parallelism owns them)"
    return None


def _auto_off() -> str | None:
    """Why ``"auto"`` stands aside in this process (``None``: it does not): FSDP2 loaded in a run of several
    processes, where a block sharded through a ``fully_shard`` on one of its parents is not recognised by
    :func:`_why_off`, and cached copies of its gathered weights would hold the memory FSDP2 frees."""
    if _fsdp_module() is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return "FSDP2 is loaded in a run of several processes (weight_cache=True caches anyway)"
    return None


def _fsdp_module() -> type | None:
    """FSDP2's module class, or ``None`` (torch built without distributed, or before FSDP2); imported when first
    needed (it takes about half a second), and only where FSDP could have sharded anything already."""
    if "torch.distributed.fsdp" not in sys.modules:
        return None  # nothing was sharded in this process
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def cast_weights(gm: fx.GraphModule, low: torch.dtype) -> list[tuple[dict, str, str, int]]:
    """Each float parameter ``gm``'s graph casts to ``low`` (:func:`ampfx.runtime.reads.reads`: a ``get_attr``
    feeding a :func:`ampfx.runtime.cast` to ``low``; tied parameters once), as ``(the parameter dict holding it, its
    name there, its path, how many casts a call makes of it)``."""
    found: dict[int, list] = {}
    for r in reads(gm, low):
        if r.how == "cast" and r.dtype == low and r.owner is not None and r.param.dtype in runtime.CASTABLE:
            found.setdefault(id(r.param), [r.owner, r.name, r.path, 0])[3] += 1
    return [tuple(f) for f in found.values()]


def cache_for(gm: fx.GraphModule, low: torch.dtype, auto_from: int | None = None,
              weights: list[tuple[dict, str, str, int]] | None = None) -> WeightCache | None:
    """The weight cache ``gm`` is armed with (:func:`ampfx.runtime.arming.arm`, ``weights``): over each parameter
    of :func:`cast_weights` (``weights``, where the caller has them already). With ``auto_from`` (elements), the ``"auto"`` cache over those of at least that size
    (:class:`_Auto`), and none where no parameter is that large (``None``: nothing to check at each call); without
    it, every one at every call. The graph is not changed."""
    weights = cast_weights(gm, low) if weights is None else weights
    sized = [w for w in weights if auto_from is None or w[0][w[1]].numel() >= auto_from]
    if not sized:
        return None
    cache = WeightCache(low, [_Entry(owner, name, path) for owner, name, path, _ in weights])
    if auto_from is not None:
        entry = {w[2]: e for w, e in zip(weights, cache.entries)}
        large = [entry[w[2]] for w in sized]
        cache.auto = _Auto(large, [entry[w[2]] for w in sized if w[3] > 1], watched(large))
    return cache


def caches(module: nn.Module) -> list[tuple[str, WeightCache]]:
    """Every weight cache in ``module``'s tree (a converted module), by the path of its graph module (those of
    ``mode="inference"`` too: ``reads_copies``)."""
    return [(path, rt.weights) for path, rt in ((p, runtime_of(m)) for p, m in module.named_modules())
            if rt is not None and rt.weights is not None]


def status(module: nn.Module) -> str:
    """One line per graph module of the converted ``module``: whether its last call used the cache (or why
    not), how many weights it caches and the bytes their copies hold now.

    >>> import torch, ampfx
    >>> amp = ampfx.convert(torch.nn.Linear(4, 2), "bf16", weight_cache=True)
    >>> _ = amp(torch.ones(1, 4))
    >>> print(ampfx.runtime.weight_cache.status(amp))
    <root>: on, 1 weights, 16 bytes
    """
    found = caches(module)
    if not found:
        return "no weight cache (weight_cache=False / AMPFX_WEIGHT_CACHE=0, or no cast weights)"
    return "\n".join(f"{path or '<root>'}: {_state(c)}, {c.nbytes():,} bytes" for path, c in found)


def _state(c: WeightCache) -> str:
    if c.reads_copies:
        return f"mode='inference', {len(c.entries)} weights read from copies"
    if c.off is not None:
        return "off: " + c.off
    if c.auto is None:
        return f"on, {len(c.entries)} weights"
    a = c.auto
    return (f"auto, {len(c.live)} of {len(c.entries)} weights cached ({len(a.large)} large enough; "
            f"{a.calls} call{'s' if a.calls != 1 else ''} since the last weight update, {a.last} before it)")


def attach(optimizer: torch.optim.Optimizer, module: nn.Module) -> Any:
    """Refresh the weight caches of the converted ``module`` right after each ``optimizer.step()`` (all stale
    copies in one ``torch._foreach_copy_`` per graph module), instead of at the next forward. Optional: the
    refresh at the next call stays, and finds nothing left to do. Returns the hook's handle (``.remove()``).

    >>> import torch, ampfx
    >>> amp = ampfx.convert(torch.nn.Linear(4, 2), "bf16", weight_cache=True)
    >>> opt = torch.optim.SGD(amp.parameters(), lr=0.1)
    >>> handle = ampfx.attach(opt, amp)
    >>> amp(torch.ones(1, 4)).sum().backward(); opt.step()
    >>> [c.refresh() for _, c in ampfx.runtime.weight_cache.caches(amp)]   # refreshed by the step already
    [0]
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"attach(optimizer, module): {type(optimizer).__name__} is not a torch.optim.Optimizer")
    found = [c for _, c in caches(module) if not c.reads_copies] if isinstance(module, nn.Module) else []
    if not found:
        raise ValueError("attach(optimizer, module): the module has no weight cache (not a converted module, "
                         "mode='inference', or weight_cache=False / AMPFX_WEIGHT_CACHE=0)")

    def refresh(opt: Any, args: Any, kwargs: Any) -> None:
        for cache in found:
            if cache.off is None:
                cache.refresh()

    return optimizer.register_step_post_hook(refresh)
