"""Pass: pad low-precision GEMM dimensions to multiples of 8.

Tensor cores want K (the reduced dimension) and N (the output features) to be
multiples of 8 for 16-bit types. For each low-precision GEMM (the ops whose
table entry has a ``gemm`` layout: linear, matmul, mm, bmm, addmm, baddbmm):

- *can we pad*: K and N are known (a parameter's sizes always are; an
  activation's come from ``example_inputs``), static or provably aligned
  (``8*batch`` is), not already multiples, not 1;
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

import sympy
import torch
import torch.fx as fx

from .. import ops, runtime
from ..meta import RECORD, TENSOR_META, decision, record
from ..report.records import CastInfo, Decision, Rule
from .context import PassContext
from .nodes import operand_shape

MAX_EXTRA = 0.25  # "auto" pads only when the padded weight is at most this much larger


def _up(n: int, m: int) -> int:
    return -(-n // m) * m


def _our_cast(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in (runtime.cast,
                                                                                         runtime.cast_pad)


def _pad_input(gm: fx.GraphModule, user: fx.Node, arg: fx.Node, dtype: torch.dtype, sizes: tuple[int, ...],
               made: dict) -> fx.Node:
    """A padded version of ``arg`` for ``user``: rewrite ``arg`` if it is our
    cast used only here, else add a ``cast_pad`` of it (shared by later users)."""
    if (arg, sizes) in made:
        new = made[(arg, sizes)]
        info = decision(new)
        new.meta[RECORD] = dataclasses.replace(info, consumers=info.consumers + (user.name,))
        return new
    if _our_cast(arg) and arg.target is runtime.cast and len(arg.users) == 1:
        arg.target, arg.args = runtime.cast_pad, (arg.args[0], dtype, sizes)
        info: CastInfo = decision(arg)
        arg.meta[RECORD] = dataclasses.replace(info, reason=f"{info.reason}; zero-padded to {list(sizes)} in the same copy")
        return arg
    with gm.graph.inserting_before(user):
        new = gm.graph.call_function(runtime.cast_pad, (arg, dtype, sizes))
    new.meta[RECORD] = CastInfo(node=new.name, value=arg.name, source=dtype, to=dtype, consumers=(user.name,),
                              reason=f"zero-padded to {list(sizes)}")
    made[(arg, sizes)] = new
    return new


def _should(ctx: PassContext, extra: float) -> str | None:
    """``None`` if padding pays here, else why not."""
    mode = ctx.policy.pad
    if mode == "never":
        return "pad='never'"
    if mode == "always":
        return None
    if ctx.device != "cuda":
        return f"pad='auto' pads on CUDA only (device {ctx.device})"
    if extra > MAX_EXTRA:
        return f"padding would add {extra:.0%} to the operands (> {MAX_EXTRA:.0%})"
    return None


def _aligned(size: Any, m: int) -> bool:
    return sympy.Mod(sympy.sympify(size), m) == 0


# operand positions and the trailing sizes each is padded to, per layout: (position, dims) where dims
# names the padded trailing dimensions ("K", "N")
LAYOUTS = {
    "linear": {"k_from": (1, -1), "n_from": (1, 0), "operands": ((0, ("K",)), (1, ("N", "K")), (2, ("N",)))},
    "matmul": {"k_from": (0, -1), "n_from": (1, -1), "operands": ((0, ("K",)), (1, ("K", "N")))},
    "addmm": {"k_from": (1, -1), "n_from": (2, -1), "operands": ((0, ("N",)), (1, ("K",)), (2, ("K", "N")))},
}


def _plan(node: fx.Node, layout: dict, gm: fx.GraphModule, m: int) -> tuple[dict | None, str]:
    """``({"K": (k, kp), "N": (n, np)}, note)`` if the GEMM can be padded, else ``(None, why not)``."""
    args = node.args
    sizes = {}
    for dim, (pos, axis) in (("K", layout["k_from"]), ("N", layout["n_from"])):
        shape = operand_shape(args[pos], gm) if pos < len(args) else None
        if shape is None or len(shape) < 2 or any(operand_shape(args[p], gm) is None for p, _ in layout["operands"][:2]):
            return None, "shapes unknown (no example_inputs): not padded"
        sizes[dim] = shape[axis]
    text = ", ".join(f"{d}={v}" for d, v in sizes.items())
    if all(_aligned(v, m) for v in sizes.values()):
        return None, f"{text} already multiples of {m}"
    symbolic = [d for d, v in sizes.items() if isinstance(v, sympy.Expr) and not v.is_number]
    if symbolic:
        aligned = [d for d in symbolic if _aligned(sizes[d], m)]
        said = "; ".join([*(f"{d}={sizes[d]} already aligned" for d in aligned),
                          *(f"{d}={sizes[d]} not provably a multiple of {m}" for d in symbolic if d not in aligned)])
        return None, f"{text}: {said}; symbolic operand sizes are not padded"
    if any(int(v) == 1 for v in sizes.values()):
        return None, f"{text}: size 1, not padded"
    return {d: (int(v), _up(int(v), m)) for d, v in sizes.items()}, text


def pad(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Pad K and N of low-precision GEMMs (see module docstring)."""
    low = ctx.policy.dtype
    m = ctx.policy.pad_multiple or 8
    made: dict = {}
    for node in list(gm.graph.nodes):
        d = record(node)
        entry = ops.ENTRIES.get(getattr(d, "op", ""))
        if not (isinstance(d, Decision) and entry is not None and entry.gemm
                and node.op in ("call_function", "call_method") and d.dtype == low and not node.kwargs):
            continue
        layout = LAYOUTS[entry.gemm]
        plan, text = _plan(node, layout, gm, m)
        if plan is None:
            node.meta[RECORD] = dataclasses.replace(d, reason=f"{d.reason}; {text}")
            continue
        (k, kp), (n, np_) = plan["K"], plan["N"]
        why = _should(ctx, (kp * np_) / (k * n) - 1)
        if why is not None:
            node.meta[RECORD] = dataclasses.replace(d, reason=f"{d.reason}; {text} not multiples of {m}; "
                                                            f"not padded: {why}")
            continue
        args = list(node.args)
        targets = {"K": kp, "N": np_}
        for pos, dims in layout["operands"]:
            if pos >= len(args) or not isinstance(args[pos], fx.Node):
                continue
            shape = operand_shape(args[pos], gm)
            trailing = tuple(shape[len(shape) - len(dims):]) if shape else ()
            want = tuple(targets[dim] for dim in dims)
            if len(trailing) == len(dims) and trailing != want and all(t != 1 for t in trailing):
                args[pos] = _pad_input(gm, node, args[pos], low, want, made)
        node.args = tuple(args)
        note = ", ".join(f"{name}={a} padded to {b}" for name, (a, b) in (("K", (k, kp)), ("N", (n, np_))) if a != b)
        if np_ != n:
            with gm.graph.inserting_after(node):
                narrow = gm.graph.call_function(torch.narrow, (node, -1, 0, n))
            node.replace_all_uses_with(narrow, delete_user_cb=lambda u: u is not narrow)
            if TENSOR_META in node.meta:
                narrow.meta[TENSOR_META] = node.meta[TENSOR_META]  # the original sizes again
            narrow.meta[RECORD] = Decision(node=narrow.name, op="narrow", target="torch.narrow", module=d.module,
                                         category=d.category, dtype=low, rule=Rule.PAD,
                                         reason=f"slices {node.name}'s padded output back to N={n}",
                                         kind="call_function", out=low)
        node.meta[RECORD] = dataclasses.replace(d, reason=f"{d.reason}; {note}")
