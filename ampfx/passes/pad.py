"""Pass: pad low-precision GEMM dimensions to multiples of 8.

Tensor cores want K (the reduced dimension) and N (the output features) to be
multiples of 8 for 16-bit types. For each low-precision ``linear`` whose
weight is a parameter cast in this graph:

- *can we pad*: K and N are known (a weight's sizes always are), not already
  multiples, not 1; the inputs are float;
- *should we pad*: ``pad="always"`` yes, ``"never"`` no; ``"auto"`` pads on
  CUDA only (CPU kernels gain nothing) and only when the padded weight is at
  most 25% larger.

Padding rides on the casts the cast pass inserted: the weight's cast and pad
are one copy (:func:`ampfx.runtime.cast_pad`), and so are the activation's
when its cast has no other consumer. The output is narrowed back to N, so
consumers, parameters, gradients and ``state_dict`` keep their shapes; the
extra rows and columns are zeros and change nothing beyond rounding.

Before::

    w_bf16 = ampfx.runtime.cast(w, torch.bfloat16)          # w: [41, 602]
    x_bf16 = ampfx.runtime.cast(x, torch.bfloat16)
    linear = torch._C._nn.linear(x_bf16, w_bf16, b_bf16)

After (``pad="always"``)::

    w_bf16 = ampfx.runtime.cast_pad(w, torch.bfloat16, (48, 608))
    x_bf16 = ampfx.runtime.cast_pad(x, torch.bfloat16, (608,))
    linear = torch._C._nn.linear(x_bf16, w_bf16, b_bf16)    # b padded to 48 the same way
    linear_n = torch.narrow(linear, -1, 0, 41)
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from .. import runtime
from ..report import CastInfo, Decision
from . import PassContext
from .classify import META

MAX_EXTRA = 0.25  # "auto" pads only when the padded weight is at most this much larger


def _up(n: int, m: int) -> int:
    return -(-n // m) * m


def _our_cast(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is runtime.cast


def _param(node: Any, gm: fx.GraphModule) -> torch.Tensor | None:
    """The parameter a ``cast(get_attr)`` node casts, else ``None``."""
    if not _our_cast(node) or node.args[0].op != "get_attr":
        return None
    obj: Any = gm
    for part in str(node.args[0].target).split("."):
        obj = getattr(obj, part)
    return obj if isinstance(obj, torch.Tensor) else None


def _pad_input(gm: fx.GraphModule, user: fx.Node, arg: fx.Node, dtype: torch.dtype, sizes: tuple[int, ...]) -> fx.Node:
    """A padded version of ``arg`` for ``user``: rewrite ``arg`` if it is our
    cast used only here, else add a ``cast_pad`` of it."""
    if _our_cast(arg) and len(arg.users) == 1:
        arg.target, arg.args = runtime.cast_pad, (arg.args[0], dtype, sizes)
        info: CastInfo = arg.meta[META]
        arg.meta[META] = dataclasses.replace(info, reason=f"{info.reason}; zero-padded to {list(sizes)} in the same copy")
        return arg
    with gm.graph.inserting_before(user):
        new = gm.graph.call_function(runtime.cast_pad, (arg, dtype, sizes))
    new.meta[META] = CastInfo(node=new.name, value=arg.name, source=dtype, to=dtype, consumers=(user.name,),
                              reason=f"zero-padded to {list(sizes)} for {user.name}")
    return new


def _should(ctx: PassContext, k: int, n: int, kp: int, np_: int) -> str | None:
    """``None`` if padding pays here, else why not."""
    mode = ctx.policy.pad
    if mode == "never":
        return "pad='never'"
    if mode == "always":
        return None
    if ctx.device != "cuda":
        return f"pad='auto' pads on CUDA only (device {ctx.device})"
    extra = (kp * np_) / (k * n) - 1
    if extra > MAX_EXTRA:
        return f"padding would add {extra:.0%} to the weight (> {MAX_EXTRA:.0%})"
    return None


def pad(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Pad K and N of low-precision linears (see module docstring)."""
    low = ctx.policy.dtype
    m = ctx.policy.pad_multiple or 8
    for node in list(gm.graph.nodes):
        d = node.meta.get(META)
        if not (isinstance(d, Decision) and d.op == "linear" and node.op == "call_function" and d.dtype == low):
            continue
        x, w = node.args[0], node.args[1]
        weight = _param(w, gm)
        if weight is None or weight.dim() != 2:
            continue
        n, k = weight.shape
        kp, np_ = _up(k, m), _up(n, m)
        sizes = f"K={k}, N={n}"
        if kp == k and np_ == n:
            note = f"{sizes} already multiples of {m}"
        elif k == 1 or n == 1:
            note = f"{sizes}: size 1, not padded"
        elif (why := _should(ctx, k, n, kp, np_)) is not None:
            note = f"{sizes} not multiples of {m}; not padded: {why}"
        else:
            note = ", ".join(f"{name}={a} padded to {b}" for name, a, b in (("K", k, kp), ("N", n, np_)) if a != b)
            args = list(node.args)
            args[1] = _pad_input(gm, node, w, low, (np_, kp))
            if kp != k:
                args[0] = _pad_input(gm, node, x, low, (kp,))
            bias = args[2] if len(args) > 2 else None
            if isinstance(bias, fx.Node) and np_ != n:
                args[2] = _pad_input(gm, node, bias, low, (np_,))
            node.args = tuple(args)
            if np_ != n:
                with gm.graph.inserting_after(node):
                    narrow = gm.graph.call_function(torch.narrow, (node, -1, 0, n))
                node.replace_all_uses_with(narrow, delete_user_cb=lambda u: u is not narrow)
                narrow.meta[META] = Decision(node=narrow.name, op="narrow", target="torch.narrow", module=d.module,
                                             category=d.category, dtype=low, rule="pad",
                                             reason=f"slices {node.name}'s padded output back to N={n}",
                                             kind="call_function", out=low)
        node.meta[META] = dataclasses.replace(d, reason=f"{d.reason}; {note}")
