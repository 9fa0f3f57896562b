"""Pass: give every node a category from the op tables, the policy, module
names and device probes, as a :class:`~ampfx.report.records.Decision` in
``node.meta['ampfx']`` (dtype still unset for the four paintable lists).

Before::

    linear = torch._C._nn.linear(x, fc_weight, fc_bias)
    softmax = torch.nn.functional.softmax(linear, dim=-1)

After (meta only, the graph is unchanged)::

    linear.meta['ampfx']  == Decision(op='linear', category=ALLOW, rule='table', ...)
    softmax.meta['ampfx'] == Decision(op='softmax', category=DENY, dtype=float32, rule='table', ...)

Precedence is documented in :mod:`ampfx.policy`; its module and list part
(``fp32_modules`` / ``module_filter_fn``, unlisted, listed) is
:mod:`ampfx.policy.decide`, which the eager-leaf path of :mod:`ampfx.libraries`
shares. :func:`_verdict` is the whole chain for one node.
"""
from __future__ import annotations

import functools
import operator
from typing import Any

import torch
import torch.fx as fx

from .. import libraries, ops
from ..ops import probes
from ..policy import decide
from ..meta import RECORD, describe, node_module_path, out_infos, user_float32
from ..ops import Category, Result
from ..policy import Policy
from ..report.records import Decision, Rule, dtype_name
from ..runtime import CASTABLE
from .context import Ends, PassContext
from .nodes import attr_of, carries_float, is_inplace, op_key, other_float


def op_name(node: fx.Node, gm: fx.GraphModule, policy: Policy) -> str:
    """Canonical op name, or a qualified name for ops in no table."""
    key = op_key(node, gm)
    name = policy.op_name(key)
    if name is not None:
        return name
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    return ops.qualified_name(key)


def target_str(node: fx.Node) -> str:
    if node.op in ("call_function",):
        return ops.qualified_name(node.target) if callable(node.target) else str(node.target)
    return str(node.target)


RUN_TIME = "run-time"
"""A value of a float dtype ampfx does not convert whose exact dtype is known only at run time."""


def _widest(dtypes: list[torch.dtype]) -> torch.dtype | None:
    """The dtype PyTorch's type promotion gives ``dtypes`` together (``None`` for none)."""
    return functools.reduce(torch.promote_types, dtypes) if dtypes else None


def _other_float_value(p: fx.Node, gm: fx.GraphModule, decided: dict[fx.Node, Decision]) -> torch.dtype | str | None:
    """The unconverted float dtype (:func:`other_float`) of the value ``p``, else ``None``.
    Without shapes: a parameter or buffer in it with at least one dimension (a 0-dim one
    does not promote a dimensioned tensor), an op already found to run in it, or an explicit
    cast or factory naming it (``x.double()``, ``zeros(..., dtype=torch.float64)``)."""
    infos = out_infos(p)
    if infos is not None:
        return _widest([i.dtype for i in infos if other_float(i.dtype)])
    if p.op == "get_attr":
        value = attr_of(gm, str(p.target))
        return value.dtype if isinstance(value, torch.Tensor) and other_float(value.dtype) and value.dim() else None
    d = decided.get(p)
    if d is None:
        return None
    if d.rule is Rule.OTHER_FLOAT:
        return d.dtype or RUN_TIME
    entry = ops.ENTRIES.get(d.op)
    if d.category is Category.PASS and entry is not None and entry.result is Result.CAST:
        named = [*torch.utils._pytree.tree_leaves((p.args[1:], p.kwargs)), dict(entry.cast_to).get(str(p.target))]
        return _widest([a for a in named if other_float(a)])
    if d.category is Category.PASS:
        return _widest([a for a in p.kwargs.values() if other_float(a)])
    return None


def _other_float(node: fx.Node, gm: fx.GraphModule,
                 decided: dict[fx.Node, Decision]) -> tuple[torch.dtype | None, str] | None:
    """``(dtype, why)`` when ``node`` computes in a float dtype ampfx does not convert, else ``None``.

    With shapes: it produces only such floats (type promotion made them, or a ``dtype=`` argument
    asked for them), or its float inputs are all such (``abs`` of a complex tensor). Without:
    one of its inputs holds such a value (see :func:`_other_float_value`); after a complex value
    the dtype is ``None``, known only at run time (``abs(z)`` is real)."""
    infos = out_infos(node)
    if infos is not None:
        floats = [i.dtype for i in infos if i.dtype.is_floating_point or i.dtype.is_complex]
        if makes_complex(node) is not None:  # from data ampfx converts: the lists decide what it reads
            return None
        if floats and all(other_float(f) for f in floats):
            return _widest(floats), f"produces {', '.join(dict.fromkeys(dtype_name(f) for f in floats))}"
        if not floats or any(i.dtype in CASTABLE for p in node.all_input_nodes for i in out_infos(p) or ()):
            return None
    wide_in = [(p, d) for p in node.all_input_nodes if (d := _other_float_value(p, gm, decided)) is not None]
    if not wide_in:
        return None
    if infos is not None:
        dtype = _widest([d for _, d in wide_in])
        return dtype, f"reads only {dtype_name(dtype)} data"
    names = ", ".join(p.name for p, _ in wide_in)
    if any(d is RUN_TIME or d.is_complex for _, d in wide_in):  # abs(z), z.real: complex in, real out
        return None, (f"reads complex (or run-time) data {names}, so the dtype it produces is known only at run "
                      "time (give example_inputs for exact dtypes)")
    dtype = _widest([d for _, d in wide_in])
    return dtype, (f"reads {dtype_name(dtype)} {names} (without example_inputs ampfx assumes this from the "
                   "parameters and explicit dtypes it sees)")


def makes_complex(node: fx.Node) -> torch.dtype | None:
    """The complex dtype ``node`` makes from real float32/16/bf16 data (``torch.fft.rfft(x)``,
    ``torch.complex(a, b)``, ``x * 1j``), else ``None``; known only with shapes. Such an op
    reads data ampfx converts, so the lists decide it, but never in a low dtype: bfloat16 has
    no complex dtype and float16's (``complex32``) has few kernels.

    >>> from ampfx.meta import TENSOR_META
    >>> from torch.fx.passes.shape_prop import _extract_tensor_metadata
    >>> g = fx.Graph(); x = g.placeholder("x"); z = g.call_function(torch.fft.rfft, (x,))
    >>> x.meta[TENSOR_META] = _extract_tensor_metadata(torch.empty(8, device="meta"))
    >>> z.meta[TENSOR_META] = _extract_tensor_metadata(torch.empty(5, dtype=torch.complex64, device="meta"))
    >>> makes_complex(z), makes_complex(x)
    (torch.complex64, None)
    """
    infos = out_infos(node)
    if infos is None:
        return None
    made = [i.dtype for i in infos if i.dtype.is_floating_point or i.dtype.is_complex]
    read = [i.dtype for p in node.all_input_nodes for i in out_infos(p) or ()
            if i.dtype.is_floating_point or i.dtype.is_complex]
    if made and all(d.is_complex for d in made) and read and all(d in CASTABLE for d in read):
        return _widest(made)
    return None


def _probe_variant(kind: str, node: fx.Node, gm: fx.GraphModule) -> probes.Variant:
    """Which kernel of probe ``kind`` the node runs (dimensions, mode): see :func:`ampfx.ops.probes.variant_of`."""
    module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
    target = type(module).__name__ if module is not None else target_str(node)
    first = next(iter(node.all_input_nodes), None)
    infos = out_infos(first) if first is not None else None
    rank = len(infos[0].shape) if infos else None
    return probes.variant_of(kind, target, node.kwargs, module, rank, node.args)


def _out_of_range(node: fx.Node, low: torch.dtype, gm: fx.GraphModule | None = None) -> float | None:
    """A Python float among ``node``'s arguments (a leaf module's float attributes, given ``gm``:
    ``nn.Threshold(0.1, -1e5)``) that ``low`` cannot hold, else ``None``.
    (Exported graphs bake in constants such as ``torch.finfo(torch.float32).min`` for masks:
    ``masked_fill(x_bf16, mask, -3.40e38)`` raises.)

    >>> import operator
    >>> g = fx.Graph(); x = g.placeholder("x"); n = g.call_function(operator.mul, (x, -3.4028234663852886e38))
    >>> _out_of_range(n, torch.bfloat16), _out_of_range(n, torch.float32)
    (-3.4028234663852886e+38, None)
    """
    top = torch.finfo(low).max
    attrs = [v for v in vars(gm.get_submodule(str(node.target))).values() if isinstance(v, float)] \
        if gm is not None and node.op == "call_module" else []
    for a in [*torch.utils._pytree.tree_leaves((node.args, node.kwargs)), *attrs]:
        if isinstance(a, float) and a == a and abs(a) != float("inf") and abs(a) > top:
            return a
    return None


def classify(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Annotate every node with its category (see module docstring)."""
    decided: dict[fx.Node, Decision] = {}
    for node in gm.graph.nodes:
        module = node_module_path(node)
        where = dict(node=node.name, target=target_str(node),
                     module=(ctx.prefix + module) if module else ctx.prefix.rstrip("."), kind=node.op,
                     shapes=tuple(describe(i) for i in (out_infos(node) or ())))
        if node.op in ("placeholder", "get_attr", "output"):
            d = _structure(node, gm, where, ctx)
        else:
            d = _compute(node, gm, ctx, decided, where)
        decided[node] = d
        node.meta[RECORD] = d


def _structure(node: fx.Node, gm: fx.GraphModule, where: dict[str, Any], ctx: PassContext) -> Decision:
    """Graph inputs, parameters and buffers, the output: never converted themselves. A kept module's
    float32 inputs arrive in ``ctx.arrive`` (the dtype its caller's graph gives them), when that is set;
    a part's in ``ctx.enter`` (the parts its module's Python moves them from compute them so)."""
    what = {"placeholder": "graph input: kept as given",
            "get_attr": "parameter or buffer: stays float32 (master copy); cast after get_attr where a "
                        "consumer wants low precision",
            "output": "graph output: float results return in the dtype they are computed in (the parts beside it "
                      "take them so; their parent's Python sees them in float32)" if ctx.hands_on else
                      "graph output: float results return in their original dtype"}[node.op]
    arrive = ctx.arrive if ctx.arrive is not None else ctx.enter
    how = ("input of a kept module: arrives in {}, as its caller's graph gives it" if ctx.arrive is not None else
           "input of a part: arrives in {}, as the parts its module's Python moves it from compute it")
    out = None
    if node.op == "get_attr":
        val = attr_of(gm, str(node.target))
        out = val.dtype if isinstance(val, torch.Tensor) and val.dtype in CASTABLE else None
    elif node.op == "placeholder":
        infos = out_infos(node)
        if infos is None:
            out = torch.float32
        else:
            floats = [i.dtype for i in infos if i.dtype in CASTABLE]
            out = floats[0] if floats else None
        if arrive is not None and arrive != torch.float32 and infos and out == torch.float32:
            # painted as a low source, as the low op feeding it in the caller's graph would be
            return Decision(op=node.op, category=Category.ALLOW, dtype=arrive, rule=Rule.STRUCTURE, out=arrive,
                            reason=how.format(dtype_name(arrive)), **where)
    return Decision(op=node.op, category=Category.PASS, dtype=None, rule=Rule.STRUCTURE, reason=what, out=out,
                    **where)


def _compute(node: fx.Node, gm: fx.GraphModule, ctx: PassContext, decided: dict[fx.Node, Decision],
             where: dict[str, Any]) -> Decision:
    """An op: the precedence chain (:func:`_verdict`), then, for another library's leaf module,
    that library's rules (:func:`ampfx.libraries.refine`, given the facts about the leaf)."""
    name = op_name(node, gm, ctx.policy)
    where.update(in_shapes=tuple(describe(i[0]) for i in (out_infos(n) for n in node.all_input_nodes) if i),
                 op=name, inplace=is_inplace(node, gm))
    d = _verdict(node, gm, ctx, decided, name).decision(**where)
    if node.op == "call_module" and d.rule not in decide.FINAL_RULES:
        # another library's leaf (DGL): its table's device rules, variants, guards (ampfx.libraries)
        target = str(node.target)
        facts = libraries.LeafFacts(path=ctx.prefix + target, device=ctx.device, dtype=ctx.policy.dtype,
                                       observed=ctx.leaf_facts.get(target))
        d = libraries.refine(d, gm.get_submodule(target), facts)
    return d


def _verdict(node: fx.Node, gm: fx.GraphModule, ctx: PassContext, decided: dict[fx.Node, Decision],
             name: str) -> decide.Verdict:
    """The precedence chain for one op, first match wins: a PASS table entry; no float data; a
    module kept eager (it runs its own Python); the model's own float32 request (traced inside
    ``torch.autocast(..., enabled=False)``); ``fp32_modules`` / ``module_filter_fn``; the lists
    (unlisted, or listed and then checked for a working kernel and representable constants)."""
    entry = ops.ENTRIES.get(name)
    float_inputs = [n for n in node.all_input_nodes if carries_float(n, decided)]
    infos = out_infos(node)
    out_float = infos is None or any(i.dtype in CASTABLE for i in infos)
    if ctx.policy.category_of(name) is None and entry is not None and entry.category is Category.PASS:
        return decide.Verdict(Category.PASS, None, Rule.TABLE, entry.reason)
    eager = node.op == "call_module" and str(node.target) in ctx.eager_leaves
    kept = ctx.kept.get(str(node.target)) if node.op == "call_module" else None
    other = None if eager or kept else _other_float(node, gm, decided)
    if other is not None:
        held = dtype_name(other[0], none="a float dtype ampfx does not convert")
        return decide.Verdict(Category.FP32, other[0], Rule.OTHER_FLOAT,
                              f"{other[1]}: computes in {held}, which ampfx never converts; runs as written")
    if not float_inputs and (not out_float or (infos is None and entry is not None)):
        return decide.Verdict(Category.PASS, None, Rule.NON_FLOAT, "no float32/16/bf16 tensor in or out: left as written")
    if kept:
        once = sum(n.op == "call_module" and n.target == node.target for n in node.graph.nodes) == 1
        where = (f"a module boundary ({kept}): its forward runs, converted on its own (see the records under "
                 f"{ctx.prefix}{node.target}); ")
        if not once:  # one conversion serves every call: the dtype that is safe for all of them
            return decide.Verdict(Category.FP32, torch.float32, Rule.KEPT,
                                  where + "called more than once here, so float32 crosses the boundary both ways")
        if gm.get_submodule(str(node.target))._forward_pre_hooks:  # its own Python may not take low inputs
            return decide.Verdict(Category.FP32, torch.float32, Rule.KEPT,
                                  where + "its forward pre-hooks keep its own Python, written for float32 inputs, so "
                                          "float32 crosses the boundary both ways")
        return _kept_verdict(ctx.kept_ends.get(str(node.target)), ctx.policy.dtype, where)
    if eager:
        return decide.Verdict(Category.FP32, torch.float32, Rule.EAGER,
                              f"could not be traced ({ctx.leaves.get(str(node.target), '')}); runs its own Python "
                              "on float32 inputs, with its children converted separately (see their records)")
    if node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), torch.jit.ScriptModule):
        return decide.Verdict(Category.FP32, torch.float32, Rule.EAGER,
                              "a TorchScript module (torch.jit.script / torch.jit.trace): compiled code that cannot "
                              "be traced, rewritten or run on low-precision copies of its parameters; runs as "
                              "written, on float32 inputs")
    if (asked := user_float32(node)) is not None:
        return decide.Verdict(Category.FP32, torch.float32, Rule.USER_FLOAT32, f"{asked}: the model asks for float32")
    hit = decide.decide_module(ctx.policy, gm, node_module_path(node), ctx.prefix, ctx.resolved)
    if hit is not None:
        return decide.Verdict(Category.FP32, torch.float32, *hit)
    why = ctx.leaves.get(str(node.target)) if node.op == "call_module" else None
    verdict = decide.decide_op(ctx.policy, name, why)
    if verdict.category in (Category.ALLOW, Category.INFER, Category.CLEAR):
        verdict = _kernel_checks(verdict, node, gm, ctx, name)
    return verdict


def _kept_verdict(ends: Ends | None, low: torch.dtype, where: str) -> decide.Verdict:
    """A kept module called once: painted from what its own graph does at its boundary (``ends``, read
    before this graph was painted): a low-precision op where it reads its float inputs and computes its
    float outputs only in ``low`` (handing it ``low`` and taking ``low`` back moves the casts it makes
    anyway out to its caller, where siblings share them), a float32 op where it reads and computes them
    only in float32, and an infer op otherwise (or where its graph was not read first)."""
    if ends is not None and ends.only(low):
        return decide.Verdict(Category.ALLOW, low, Rule.KEPT, where + (
            f"its graph reads its float inputs only in {dtype_name(low)} and computes its float outputs in "
            f"{dtype_name(low)}: painted as a low-precision op, its inputs cast here and its outputs returned "
            f"{dtype_name(low)}"))
    if ends is not None and ends.only(torch.float32):
        return decide.Verdict(Category.FP32, torch.float32, Rule.KEPT, where + (
            "its graph reads its float inputs and computes its float outputs in float32: float32 crosses the "
            "boundary both ways"))
    return decide.Verdict(Category.INFER, None, Rule.KEPT,
                          where + "painted as an infer op: its inputs are cast to the dtype chosen here, and it "
                                  "returns that dtype")


def _kernel_checks(verdict: decide.Verdict, node: fx.Node, gm: fx.GraphModule, ctx: PassContext,
                   name: str) -> decide.Verdict:
    """A listed low-precision candidate stays float32 where the device has no working kernel for
    it (rule ``probe``) or it takes a constant the low dtype cannot hold (``range:constant``)."""
    low = ctx.policy.dtype
    entry = ops.ENTRIES.get(name)
    if ctx.policy.probe and entry is not None and entry.probe:
        variant = _probe_variant(entry.probe, node, gm)
        err = probes.check(entry.probe, low, ctx.device, variant)
        if err is not None:
            verdict = decide.Verdict(Category.FP32, torch.float32, Rule.PROBE,
                                     f"{name}{probes.describe(variant)} has no working {dtype_name(low)} kernel on "
                                     f"{ctx.device} ({err}): float32")
    elif ctx.policy.probe and (err := probes.missing_kernel(node, low, ctx.device)) is not None:
        verdict = decide.Verdict(Category.FP32, torch.float32, Rule.PROBE,
                                 f"{name} has no working {dtype_name(low)} kernel on {ctx.device} (tried on its own "
                                 f"arguments, shrunk: {err}): float32")
    if (made := makes_complex(node)) is not None:
        verdict = decide.Verdict(Category.FP32, torch.float32, Rule.COMPLEX,
                                 f"{name} makes {dtype_name(made)} from real data: {dtype_name(low)} has "
                                 f"{'no complex dtype' if low is torch.bfloat16 else 'few complex kernels'}, so "
                                 "it reads float32")
    if (big := _out_of_range(node, low, gm)) is not None:
        verdict = decide.Verdict(Category.FP32, torch.float32, Rule.RANGE_CONSTANT,
                                 f"{name} uses the constant {big:.4g}, outside {dtype_name(low)}'s range: float32")
    return verdict
