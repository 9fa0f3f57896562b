"""FSDP2 all-gathers each weight in the dtype the converted graphs read it in.

FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps each parameter sharded across the ranks and all-gathers it
before its module runs. Without a ``MixedPrecisionPolicy`` it gathers the float32 masters, and the converted
graph then casts each whole weight to bfloat16 (twice the bytes on the wire); with
``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` it gathers every parameter of the module in bfloat16,
the weights of the float32 islands (norms, the ops ampfx keeps float32) included, which then compute with
rounded weights. :func:`gather_low` decides per parameter, from the converted graphs: a parameter every graph
reads only through a cast to the low dtype is gathered low (its shard is cast before the all-gather: half the
bytes); any other stays float32. Call it after :func:`ampfx.convert` and before ``fully_shard``::

    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    decisions = gather_low(amp)                  # one record per parameter, with its reason
    for block in amp.blocks:
        fully_shard(block)                       # no param_dtype: the plan chose per parameter
    fully_shard(amp)

The masters stay float32 (the optimizer steps them), and the gradients are float32, so FSDP2 reduce-scatters
them in float32. What reads a low-gathered parameter other than a cast to the low dtype (Python of the model's
own that a later conversion does not see) reads float32 made from the gathered low values, as it would under
``MixedPrecisionPolicy(param_dtype=...)``.

The mechanism is FSDP2's all-gather extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on the
local shard), as torchao's float8 all-gather uses it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from ..errors import ArgumentError
from ..runtime.graph_module import AmpGraphModule
from ..runtime.reads import reads

aten = torch.ops.aten

KEEP = frozenset({aten.empty_like.default, aten.new_zeros.default, aten.slice.Tensor, aten.copy_.default,
                  aten.view.default, aten.as_strided.default, aten._to_copy.default, aten._pin_memory.default,
                  aten.split.Tensor, aten.clone.default, aten.detach.default, aten.alias.default,
                  aten.narrow.default, aten.chunk.default})
"""Ops whose results stay :class:`LowShard` (FSDP2 pads, chunks and copies the shard with them)."""


@dataclasses.dataclass(frozen=True)
class GatherDecision:
    """How FSDP2 gathers one parameter: ``dtype``, and why (the graph nodes that read it)."""

    name: str
    dtype: torch.dtype
    reason: str

    def __str__(self) -> str:
        return f"{self.name}: {str(self.dtype).replace('torch.', '')} ({self.reason})"


def _wrapper(cls: type, inner: torch.Tensor, dtype: torch.dtype) -> Any:
    """A tensor of class ``cls`` with ``inner``'s size, strides and device, of ``dtype``, holding no data itself."""
    return torch.Tensor._make_wrapper_subclass(cls, inner.size(), strides=inner.stride(),
                                               storage_offset=inner.storage_offset(), dtype=dtype, layout=inner.layout,
                                               device=inner.device, requires_grad=inner.requires_grad)


class LowShard(torch.Tensor):
    """A float32 master (its local shard once ``fully_shard`` splits it) that FSDP2 all-gathers in ``low``.

    It is the master: every op but a few layout ones (which FSDP2 runs on it) reads the float32 tensor inside,
    and the optimizer steps that tensor in place.
    """

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, low: torch.dtype) -> "LowShard":
        return _wrapper(cls, tensor, tensor.dtype)

    def __init__(self, tensor: torch.Tensor, low: torch.dtype) -> None:
        self._tensor, self._low = tensor, low

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        lows = {t._low for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, LowShard)}
        args, kwargs = pytree.tree_map_only(LowShard, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in KEEP or len(lows) != 1 or (func is aten._to_copy.default and out.dtype != args[0].dtype):
            return out  # a cast to another dtype (the converted graph's, outside FSDP2) is a plain tensor
        low = lows.pop()
        return pytree.tree_map_only(torch.Tensor, lambda t: LowShard(t, low), out)

    def __tensor_flatten__(self) -> tuple[list[str], torch.dtype]:
        return ["_tensor"], self._low

    @staticmethod
    def __tensor_unflatten__(inner: dict, low: torch.dtype, outer_size: Any, outer_stride: Any) -> "LowShard":
        return LowShard(inner["_tensor"], low)

    def __repr__(self) -> str:  # noqa: D105
        return f"LowShard({self._tensor!r}, gathered in {self._low})"

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: Any, outer_stride: Any, module: nn.Module,
                            mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        return (self._tensor.to(self._low),), None

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *,
                             out: torch.Tensor | None = None) -> Any:
        (data,) = outputs
        if out is not None:  # gathered again into the storage the unsharded parameter already holds
            return None
        return LowGathered(data, param_dtype), (data,)


class LowGathered(torch.Tensor):
    """The all-gathered parameter: ``dtype`` (float32) outside, the gathered low values inside. A cast to the low
    dtype (what the converted graph does) is those values, no copy; any other op reads them as ``dtype``. Its
    gradient is ``dtype`` (the cast's backward casts it), so FSDP2 reduce-scatters float32 gradients."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, dtype: torch.dtype) -> "LowGathered":
        return _wrapper(cls, data, dtype)

    def __init__(self, data: torch.Tensor, dtype: torch.dtype) -> None:
        self._data = data

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if (func is aten._to_copy.default and isinstance(args[0], LowGathered) and len(args) == 1
                and kwargs.keys() <= {"dtype"} and kwargs.get("dtype") == args[0]._data.dtype):
            return aten.alias.default(args[0]._data)
        if func in _LAYOUT:
            (this, *rest) = args
            return LowGathered(func(this._data, *rest, **kwargs), this.dtype)
        up = pytree.tree_map_only(LowGathered, lambda t: t._data.to(t.dtype), (args, kwargs))
        return func(*up[0], **up[1])

    def __tensor_flatten__(self) -> tuple[list[str], torch.dtype]:
        return ["_data"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner: dict, dtype: torch.dtype, outer_size: Any, outer_stride: Any) -> "LowGathered":
        return LowGathered(inner["_data"], dtype)

    def __repr__(self) -> str:  # noqa: D105
        return f"LowGathered({self._data!r} read as {self.dtype})"


_LAYOUT = frozenset({aten.as_strided.default, aten.view.default, aten.detach.default, aten.alias.default,
                     aten.slice.Tensor, aten._unsafe_view.default})
"""Ops FSDP2 runs on the gathered parameter that keep it gathered low (a view of the same values)."""


def _graphs(amp: nn.Module) -> Iterator[AmpGraphModule]:
    """Every converted graph in ``amp``'s tree, and in each one's other training mode's conversion (made now, where
    it was waiting for its first use) and conversions made again (a graph, or Python around converted children)."""
    seen: set[int] = set()
    todo = [amp]
    while todo:
        for m in todo.pop().modules():
            if not isinstance(m, AmpGraphModule) or id(m) in seen:
                continue
            seen.add(id(m))
            yield m
            todo += [other for other in (m.mode_module(not m.training), *m.variants()) if other is not m]


def _reads(gm: fx.GraphModule, low: torch.dtype) -> Iterator[tuple[nn.Parameter, bool, str]]:
    """``(parameter, read low, by what)`` for each read of a parameter in ``gm``'s graph
    (:func:`ampfx.runtime.reads.reads`): low where a cast to ``low`` or a module run in ``low`` reads it."""
    name = str(low).replace("torch.", "")
    for r in reads(gm, low):
        if r.takes(low):
            yield r.param, True, f"cast to {name} for {r.by}" if r.how == "cast" else f"read by {r.by}"
        elif r.how in ("cast", "cast_pad"):  # to another dtype, or padded
            yield r.param, False, f"read as it is by {r.how}"
        elif r.how == "as_is":
            yield r.param, False, f"read as it is by {r.by}"
        elif r.how == "module_float32":
            yield r.param, False, f"read in float32 by {r.by}"
        elif r.how == "module":
            yield r.param, False, f"read by {r.by}"


def _eager(amp: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The modules of ``amp``'s tree that no converted graph covers (a module that keeps its Python around
    converted children, a module it calls as it is): their own Python reads their parameters."""
    covered = {id(m) for gm in amp.modules() if isinstance(gm, AmpGraphModule) for m in gm.modules()}
    for path, m in amp.named_modules():
        if id(m) not in covered:
            yield path, m


def decide(amp: nn.Module) -> list[GatherDecision]:
    """The dtype FSDP2 should gather each of ``amp``'s parameters in, from its converted graphs (see the module
    docstring), in ``named_parameters`` order."""
    report = getattr(amp, "ampfx_report", None)
    if report is None:
        raise ArgumentError(f"gather_low takes a module ampfx.convert returned; got {type(amp).__name__}")
    low = report.dtype
    seen: dict[int, list[tuple[bool, str]]] = {}
    for gm in _graphs(amp):
        for p, is_low, why in _reads(gm, low):
            seen.setdefault(id(p), []).append((is_low, why))
    for path, m in _eager(amp):
        for p in m.parameters(recurse=False):
            seen.setdefault(id(p), []).append((False, f"read by {path or 'the root'}'s own Python (it runs as it is)"))
    out = []
    for name, p in amp.named_parameters():
        reads = seen.get(id(p), [])
        if p.dtype != torch.float32:
            out.append(GatherDecision(name, p.dtype, f"held in {p.dtype}: gathered as it is"))
        elif not reads:
            out.append(GatherDecision(name, torch.float32, "no converted graph reads it (Python ampfx runs as it is "
                                                           "may)"))
        elif all(is_low for is_low, _ in reads):
            out.append(GatherDecision(name, low, "; ".join(sorted({why for _, why in reads}))))
        else:
            out.append(GatherDecision(name, torch.float32, "; ".join(sorted({why for is_low, why in reads
                                                                             if not is_low}))))
    return out


def gather_low(amp: nn.Module) -> list[GatherDecision]:
    """Make FSDP2 gather each parameter of ``amp`` (a module :func:`ampfx.convert` returned, not sharded yet) in
    the dtype :func:`decide` chooses, and return the decisions. Call it before ``fully_shard`` and before making
    the optimizer (the low-gathered parameters are new ``nn.Parameter`` objects over the same float32 data).

    >>> import ampfx
    >>> amp = ampfx.convert(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)), "bf16",
    ...                     example_inputs=(torch.randn(2, 4),))
    >>> for d in gather_low(amp): print(d)
    0.weight: bfloat16 (cast to bfloat16 for linear)
    0.bias: bfloat16 (cast to bfloat16 for linear)
    1.weight: float32 (read by 1's own forward)
    1.bias: float32 (read by 1's own forward)
    """
    from torch.distributed.tensor import DTensor
    decisions = decide(amp)
    for name, p in amp.named_parameters():
        if isinstance(p, DTensor):
            raise ArgumentError(f"gather_low: {name} is sharded already; call gather_low(amp) before fully_shard")
    made: dict[int, nn.Parameter] = {}  # a tied parameter stays one parameter
    hooked: set[int] = set()
    # the float32 masters decided low (a parameter held in a low dtype is gathered as it is, as FSDP2 does)
    dtypes = {id(p): d.dtype for (_, p), d in zip(amp.named_parameters(), decisions)
              if p.dtype == torch.float32 and d.dtype != torch.float32}
    for module in amp.modules():
        for key, p in list(module._parameters.items()):
            if p is None or isinstance(p, LowShard) or id(p) not in dtypes:
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(LowShard(p.detach(), dtypes[id(p)]), requires_grad=p.requires_grad)
            module._parameters[key] = made[id(p)]
            if id(module._parameters) not in hooked:  # a graph module shares its model module's dicts
                hooked.add(id(module._parameters))
                module._register_state_dict_hook(_plain_state)
    return decisions


def _plain_state(module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
    """A state dict holds the float32 masters as plain tensors (or ``DTensor`` shards of them): a checkpoint loads
    with ``torch.load(weights_only=True)`` and into a model that never gathered low."""
    from torch.distributed.tensor import DTensor
    for key, value in state.items():
        if not key.startswith(prefix):
            continue
        if isinstance(value, LowShard):
            state[key] = value._tensor
        elif isinstance(value, DTensor) and isinstance(value._local_tensor, LowShard):
            state[key] = DTensor.from_local(value._local_tensor._tensor, value.device_mesh, value.placements,
                                            run_check=False, shape=value.shape, stride=value.stride())
