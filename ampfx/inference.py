"""Inference mode: store the weights of low-precision ops in the low dtype, once.

In training mode (the default) parameters stay float32 masters and are cast
after ``get_attr`` on every call. With ``convert(..., mode="inference")`` a
parameter whose every use wants the low dtype (a cast to it in the graph, or
an ALLOW leaf run with low-precision copies) is replaced, in the converted
module only, by a low-precision copy that does not require grad: the casts
in the graph then find the dtype already right and copy nothing. Parameters
any consumer reads in float32 (batch-norm and layer-norm affine parameters,
embedding tables, biases added in float32) stay float32. The model given to
``convert`` is not changed.

>>> import torch, ampfx
>>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> inf = ampfx.convert(m, "bf16", mode="inference")
>>> inf.get_submodule("0").weight.dtype, m[0].weight.dtype
(torch.bfloat16, torch.float32)
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from . import integrations, runtime
from .passes.classify import attr_of


def _low_only_params(gm: fx.GraphModule, low: torch.dtype) -> set[str]:
    """Names of parameters every graph use of which is a cast to ``low`` or an ALLOW leaf."""
    wanted: dict[str, bool] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        obj = attr_of(gm, str(node.target))
        if isinstance(obj, nn.Module):  # a leaf run by call_module_low: all its float parameters go low
            runs_low = all(u.target in (runtime.call_module_low, *integrations.runners()) and u.args[1] == low
                           for u in node.users)
            for name, p in obj.named_parameters():
                key = f"{node.target}.{name}"
                wanted[key] = wanted.get(key, True) and runs_low and p.dtype in runtime.CASTABLE
        elif isinstance(obj, nn.Parameter):
            low_use = all(u.op == "call_function" and u.target in (runtime.cast, runtime.cast_pad)
                          and u.args[1] == low for u in node.users)
            key = str(node.target)
            wanted[key] = wanted.get(key, True) and low_use and bool(node.users)
    # a parameter also reached some other way (a leaf module using it directly) is not low-only
    for node in gm.graph.nodes:
        if node.op == "call_module":
            for name, _ in gm.get_submodule(str(node.target)).named_parameters():
                wanted[f"{node.target}.{name}"] = False
    return {k for k, ok in wanted.items() if ok}


def store_low(gm: fx.GraphModule, low: torch.dtype) -> tuple[int, int, int]:
    """Replace low-only parameters of ``gm`` by low-precision copies; returns
    ``(count, bytes before, bytes after)`` over all parameters."""
    before = sum(p.numel() * p.element_size() for p in gm.parameters())
    names = _low_only_params(gm, low)
    copies: dict[int, nn.Parameter] = {}  # tied parameters stay tied
    for name in sorted(names):
        owner_path, _, leaf = name.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        p = owner._parameters[leaf]
        if id(p) not in copies:
            copies[id(p)] = nn.Parameter(p.detach().to(low), requires_grad=False)
        owner._parameters[leaf] = copies[id(p)]
        if hasattr(owner, "_flat_weights_names") and leaf in owner._flat_weights_names:  # RNNs cache weights
            owner._init_flat_weights()
    after = sum(p.numel() * p.element_size() for p in gm.parameters())
    return len(copies), before, after
