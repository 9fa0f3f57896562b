"""Example inputs: the one place that knows the tuple / dict / single-value convention.

Users give example inputs (and calibration batches) as a tuple of positional
values, a dict of keyword values, or one value. :class:`ExampleInputs` holds
them as ``(args, kwargs)`` and is the only code that unpacks that convention:
calling a module, binding a signature, ordering keywords as ``forward``
declares them, naming the arguments that carry tensors.

>>> import torch
>>> ex = ExampleInputs.of({"mask": None, "x": torch.ones(2)})
>>> ex.args, sorted(ex.kwargs)
((), ['mask', 'x'])
>>> def forward(x, mask=None): ...
>>> ex.ordered(forward)[1].keys(), ex.tensor_names(forward)
(dict_keys(['x', 'mask']), {'x'})
>>> ExampleInputs.of(torch.ones(2)).args[0].shape
torch.Size([2])
"""
from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves


@dataclass(frozen=True)
class ExampleInputs:
    """Positional ``args`` and keyword ``kwargs`` for one call of a module."""

    args: tuple = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, value: Any) -> ExampleInputs | None:
        """``value`` as given by a user: a tuple or list (positional), a dict
        (keywords), one value (the only positional), ``None`` (no inputs)."""
        if value is None or isinstance(value, ExampleInputs):
            return value
        if isinstance(value, dict):
            return cls((), dict(value))
        if isinstance(value, (tuple, list)):
            return cls(tuple(value))
        return cls((value,))

    @classmethod
    def from_call(cls, module: nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> ExampleInputs:
        """A call seen at run time; with keywords, every argument by its name in ``module.forward``."""
        if not kwargs:
            return cls(tuple(args))
        return cls((), {**dict(zip(_parameters(module), args)), **kwargs})

    def rows(self, k: int = 8, least: int = 1 << 20) -> "ExampleInputs | None":
        """These inputs cut to their first ``k`` rows, where they hold at least ``least`` elements: each tensor whose
        first size is the largest tensor's (the batch, or the tokens of a 2-D input) sliced to ``k``; ``None``
        where they are smaller, or the rows fewer than ``2 * k`` (nothing to save).

        >>> ExampleInputs((torch.ones(4096, 256), torch.zeros(4096, dtype=torch.long), 3)).rows().args[0].shape
        torch.Size([8, 256])
        >>> ExampleInputs((torch.ones(16, 4),)).rows() is None
        True
        """
        tensors = [t for t in self.tensors() if t.dim()]
        if not tensors or sum(t.numel() for t in tensors) < least:
            return None
        n = max(tensors, key=lambda t: t.numel()).shape[0]
        if n < 2 * k:
            return None

        def cut(v: Any) -> Any:
            if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n:
                return v[:k]
            if isinstance(v, (tuple, list)):
                return type(v)(cut(x) for x in v) if type(v) in (tuple, list) else v
            if isinstance(v, dict) and type(v) is dict:
                return {key: cut(x) for key, x in v.items()}
            return v
        return ExampleInputs(tuple(cut(a) for a in self.args), {key: cut(v) for key, v in self.kwargs.items()})

    def bind(self, fn: Callable[..., Any]) -> inspect.BoundArguments:
        """These inputs bound to ``fn``'s signature, defaults applied."""
        bound = inspect.signature(fn).bind(*self.args, **self.kwargs)
        bound.apply_defaults()
        return bound

    def positional(self, gm: nn.Module) -> list[Any]:
        """The values of ``gm.forward``'s parameters in order (what a graph's placeholders take)."""
        bound = self.bind(gm.forward)
        return list(bound.args) + list(bound.kwargs.values())

    def ordered(self, fn: Callable[..., Any]) -> tuple[tuple, dict[str, Any]]:
        """``(args, kwargs)`` with keywords in the order ``fn`` declares them
        (torch.export's input spec follows that order)."""
        rank = {name: i for i, name in enumerate(inspect.signature(fn).parameters)}
        kwargs = dict(sorted(self.kwargs.items(), key=lambda kv: rank.get(kv[0], len(rank))))
        return self.args, kwargs

    def given(self, fn: Callable[..., Any]) -> dict[str, Any]:
        """The value of each of ``fn``'s parameters these inputs give, by name (no defaults)."""
        return {**dict(zip(inspect.signature(fn).parameters, self.args)), **self.kwargs}

    def tensor_names(self, fn: Callable[..., Any]) -> set[str]:
        """Names of ``fn``'s parameters given a value that holds a tensor (the rest may be
        fixed at their defaults while tracing)."""
        return {k for k, v in self.given(fn).items() if any(isinstance(t, torch.Tensor) for t in tree_leaves(v))}

    def call(self, module: Callable[..., Any]) -> Any:
        """``module(*args, **kwargs)``."""
        return module(*self.args, **self.kwargs)

    def snapshot(self) -> ExampleInputs:
        """A copy that later in-place changes cannot reach (see :func:`snapshot`)."""
        return ExampleInputs(*snapshot((self.args, dict(self.kwargs))))

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in tree_leaves((self.args, dict(self.kwargs))) if isinstance(t, torch.Tensor)]

    def describe(self) -> str:
        """``"x: float32[2, 4], n: 3"``: each argument, tensors by dtype and shape."""
        def one(v: Any) -> str:
            if isinstance(v, torch.Tensor):
                return f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
            if isinstance(v, (tuple, list, dict)):
                return str(torch.utils._pytree.tree_map(one, v)).replace("'", "")
            return repr(v)[:40]

        named = [f"args[{i}]: {one(v)}" for i, v in enumerate(self.args)]
        return ", ".join(named + [f"{k}: {one(v)}" for k, v in self.kwargs.items()]) or "(none)"

    def device(self) -> str | None:
        """The device type of the first tensor, ``None`` without tensors."""
        found = self.tensors()
        return found[0].device.type if found else None


def snapshot(value: Any) -> Any:
    """A deep copy of ``value`` that later in-place changes cannot reach (the value itself if uncopyable)."""
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - uncopyable objects: keep the live reference
        return value


def _parameters(module: nn.Module) -> list[str]:
    return list(inspect.signature(module.forward).parameters)
