"""Helpers that the rewritten graph calls at run time.

The generated code of a converted module calls these by their qualified
names, so a converted module pickles and reloads as long as ``ampfx`` is
importable.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.func import functional_call

CASTABLE = (torch.float32, torch.float16, torch.bfloat16)
"""Only these dtypes are ever converted. float64, integers and bool pass through."""


def cast(value: Any, dtype: torch.dtype) -> Any:
    """``value`` in ``dtype``: float32/16/bf16 tensors are converted, anything
    else (float64, integer and bool tensors, Python numbers) is returned as is.
    Tuples and lists are converted element by element.

    >>> cast(torch.ones(2), torch.bfloat16).dtype
    torch.bfloat16
    >>> cast(torch.arange(3), torch.bfloat16).dtype
    torch.int64
    """
    if isinstance(value, torch.fx.Proxy):  # re-tracing a converted module (unpickling does)
        return value.tracer.create_proxy("call_function", cast, (value, dtype), {})
    if isinstance(value, torch.Tensor):
        if value.dtype in CASTABLE and value.dtype != dtype:
            return value.to(dtype)
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(cast(v, dtype) for v in value)
    return value



def call_module_low(module: torch.nn.Module, dtype: torch.dtype, *args: Any, **kwargs: Any) -> Any:
    """Run ``module`` with low-precision copies of its float parameters.

    The module's own parameters stay float32 (the master weights); the copies
    are made with ``Tensor.to``, so gradients flow back to the masters.
    Buffers are not copied.

    >>> lin = torch.nn.Linear(4, 2)
    >>> call_module_low(lin, torch.bfloat16, torch.ones(1, 4, dtype=torch.bfloat16)).dtype
    torch.bfloat16
    >>> lin.weight.dtype
    torch.float32
    """
    proxy = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.fx.Proxy)), None)
    if proxy is not None:  # re-tracing a converted module: stay one node
        return proxy.tracer.create_proxy("call_function", call_module_low, (module, dtype, *args), kwargs)
    params = {name: p.to(dtype) if p.dtype in CASTABLE else p
              for name, p in module.named_parameters()}
    return functional_call(module, params, args, kwargs, tie_weights=True, strict=False)



def assert_is_none(value: Any, message: str) -> None:
    """Guard for an argument that tracing fixed at ``None``: passing one now is an error."""
    if isinstance(value, torch.fx.Proxy):
        return value.tracer.create_proxy("call_function", assert_is_none, (value, message), {})
    if value is not None:
        raise ValueError(f"{message}; ampfx traced this model with it fixed. Convert again with an "
                         "example input that includes it (example_inputs=dict(...)).")
    return None


def cast_pad(value: Any, dtype: torch.dtype, sizes: tuple[int, ...]) -> Any:
    """``value`` in ``dtype``, zero-padded at the end of its last ``len(sizes)``
    dimensions to ``sizes``, in one copy (the cast and the pad are the same
    write). Gradients reach ``value`` in its own dtype.

    >>> cast_pad(torch.ones(2, 3), torch.bfloat16, (4, 8)).shape
    torch.Size([4, 8])
    """
    if isinstance(value, torch.fx.Proxy):
        return value.tracer.create_proxy("call_function", cast_pad, (value, dtype, sizes), {})
    lead = tuple(value.shape[: value.dim() - len(sizes)])
    out = value.new_zeros((*lead, *sizes), dtype=dtype)
    out[(Ellipsis, *(slice(0, n) for n in value.shape[value.dim() - len(sizes):]))] = value
    return out
