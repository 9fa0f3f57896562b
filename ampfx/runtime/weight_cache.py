"""Training mode's weight cache: each weight a low-precision op reads cast once, and again only when it changes.

In training mode a converted graph reads the float32 master of every weight and
casts it where a GEMM or convolution reads it low, as autocast does: one cast per
weight per forward, so gradient accumulation over ``k`` micro-batches casts every
weight ``k`` times per optimizer step (and activation checkpointing once more per
recompute). With the cache (``weight_cache=True`` or ``AMPFX_WEIGHT_CACHE=1``; off
by default: with one micro-batch a step it saves no cast and costs a Python step per
weight, see docs/benchmarks.md) each graph module keeps a low copy of every
parameter its graph casts to the low dtype; while the graph runs, those casts
(:func:`ampfx.runtime.cast`) return the copy through :class:`_CachedCast`, whose
backward sends the gradient to the float32 master. The graph itself is unchanged.
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
``mode="inference"`` keeps its own low copies (:mod:`ampfx.runtime.inference`) and no cache.
Memory: 2 bytes per cached bfloat16/float16 element, held between steps
(:func:`status` says how much each graph module holds).

>>> import torch, ampfx
>>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> amp = ampfx.convert(m, "bf16", example_inputs=(torch.ones(4, 8),), weight_cache=True)
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


@dataclass(eq=False)
class WeightCache:
    """The low copies of one graph module's weights (see the module docstring). While its graph runs
    (:meth:`used`), :func:`ampfx.runtime.cast` takes a cached weight's copy from :meth:`low`."""

    dtype: torch.dtype
    entries: list[_Entry] = field(default_factory=list)
    #: why the last call ran without the cache (``None``: it used it)
    off: str | None = None
    #: copies made since conversion (one per weight per refresh)
    casts: int = 0
    #: during a call: each cached master's id, to its entry
    _by_id: dict[int, _Entry] = field(default_factory=dict, repr=False)

    def __repr__(self) -> str:
        return f"WeightCache({str(self.dtype).replace('torch.', '')}: {', '.join(e.path for e in self.entries)})"

    def __post_init__(self) -> None:
        runtime.CACHES[0] += 1  # ampfx.runtime.cast looks for cached weights from now on

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        runtime.CACHES[0] += 1

    def _anew(self, owner: Callable[[dict], dict]) -> "WeightCache":
        """A cache over ``owner(parameter dict)`` with no copies yet (a copy's masters are other tensors)."""
        return WeightCache(self.dtype, [_Entry(owner(e.owner), e.name, e.path) for e in self.entries])

    def __deepcopy__(self, memo: dict) -> "WeightCache":
        return self._anew(lambda d: copy.deepcopy(d, memo))

    def __getstate__(self) -> dict:
        return self._anew(lambda d: d).__dict__

    def nbytes(self) -> int:
        """Bytes the low copies hold now."""
        return sum(e.low.numel() * e.low.element_size() for e in self.entries if e.low is not None)

    def refresh(self, at_use: bool = False) -> int:
        """Make again every copy whose master was replaced, re-pointed or written since it was made, all in one
        ``torch._foreach_copy_``; the number made. With ``at_use`` (a forward with gradients), a master whose
        ``.grad`` is None (the first micro-batch of a step) is left to its first cast in the graph, which makes
        its copy (:meth:`low`): that cast and its gradient then run as without the cache."""
        stale, masters = [], []
        for e in self.entries:
            master = e.owner.get(e.name)
            if master is None:
                raise StaleModelError(f"parameter {e.path!r}, which the converted graph reads, was removed from the "
                                      "model: put it back or convert the model again")
            if master is e.master and written.unwritten(master, e.key):
                continue
            if not _cacheable(master, self.dtype):
                e.master, e.key, e.low, e.pending = master, written.stamp(master), None, False
                continue
            if at_use and master.requires_grad and master.grad is None:
                e.master, e.key, e.low, e.pending = master, None, None, True  # the old copy is let go first
                continue
            stale.append(e)
            masters.append(master.detach())
        if stale:
            # a copy nothing else holds (no autograd graph still saves it) is written over; others are left to the
            # graphs that hold them, and a new copy is made
            lows = [e.low if _reusable(e.low, m, self.dtype) else torch.empty_like(m, dtype=self.dtype)
                    for e, m in zip(stale, masters)]
            with torch.no_grad():
                torch._foreach_copy_(lows, masters)
            for e, low in zip(stale, lows):
                master = e.owner[e.name]  # the parameter itself: its optimizer steps are noted by identity
                e.master, e.key, e.low, e.pending = master, written.stamp(master), low, False
            self.casts += len(stale)
        return len(stale)

    @contextlib.contextmanager
    def used(self, gm: nn.Module) -> Iterator[None]:
        """Around a call of ``gm``'s graph: the copies made again where stale, and handed to the graph's casts;
        or, where the cache stands aside (:func:`_why_off`), nothing (the graph casts its masters)."""
        self.off = _why_off(gm, self.entries)
        if self.off is not None:
            for e in self.entries:  # copies made before (the module was sharded since) are let go
                e.master = e.key = e.low = None
                e.pending = False
            yield
            return
        self.refresh(at_use=torch.is_grad_enabled())
        self._by_id = {id(e.master): e for e in self.entries if e.low is not None or e.pending}
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


def install(gm: fx.GraphModule, low: torch.dtype) -> WeightCache:
    """Give ``gm`` a weight cache over each float parameter its graph casts to ``low`` (its ``get_attr`` feeds a
    :func:`ampfx.runtime.cast` to ``low``; tied parameters share one entry). The graph is not changed."""
    cache = WeightCache(low)
    seen: set[int] = set()
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not any(u.op == "call_function" and u.target is runtime.cast and u.args[0] is node
                                            and u.args[1] == low for u in node.users):
            continue
        owner_path, _, leaf = str(node.target).rpartition(".")
        try:
            owner = gm.get_submodule(owner_path) if owner_path else gm
        except AttributeError:
            continue
        param = owner._parameters.get(leaf)
        if isinstance(param, nn.Parameter) and param.dtype in runtime.CASTABLE and id(param) not in seen:
            seen.add(id(param))
            cache.entries.append(_Entry(owner._parameters, leaf, str(node.target)))
    gm.set_step("weights", cache)
    return cache


def caches(module: nn.Module) -> list[tuple[str, WeightCache]]:
    """Every weight cache in ``module``'s tree (a converted module), by the path of its graph module."""
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
        return "no weight cache (off by default: weight_cache=True / AMPFX_WEIGHT_CACHE=1; mode='inference'; or no cast weights)"
    return "\n".join(f"{path or '<root>'}: {'on' if c.off is None else 'off: ' + c.off}, {len(c.entries)} weights, "
                     f"{c.nbytes():,} bytes" for path, c in found)


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
    found = [c for _, c in caches(module)] if isinstance(module, nn.Module) else []
    if not found:
        raise ValueError("attach(optimizer, module): the module has no weight cache (not a converted module, "
                         "mode='inference', or the cache off: it is unless weight_cache=True / AMPFX_WEIGHT_CACHE=1)")

    def refresh(opt: Any, args: Any, kwargs: Any) -> None:
        for cache in found:
            if cache.off is None:
                cache.refresh()

    return optimizer.register_step_post_hook(refresh)
