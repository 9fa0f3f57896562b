"""Paint's fidelity step: float32 values stay float32 where autocast's type promotion keeps them.

Not a pass of its own: :func:`ampfx.passes.paint.paint` calls :func:`float32_values` after deny
propagation, and the nodes it paints float32 block the later steps as denied nodes do.

TF-AMP's painting puts an infer op between two GEMMs in the low dtype, and casts any float32
value it reads down. Under ``torch.autocast`` the same op reads a float32 tensor and computes in
float32 (type promotion). Where that value's low bits matter, rounding it loses what the model
computes (docs/numerics.md has the measurements). Three rules, each a :class:`~ampfx.policy.Policy`
switch:

- ``float32_stream`` (rule ``fidelity:stream``): an infer op reading a float32 *activation* — a
  graph input, an embedding's rows, a float32 op's output, a value ``.float()`` made, a factory's
  ``arange``/``zeros``, or an op this rule already made float32 — computes in float32. The residual
  stream of a transformer stays float32 (its adds read the float32 stream and a low branch, as
  under autocast), so do carried states (``h = a * h + b``) and positions. Clear ops join only on
  the way to an infer/deny op (as in TF-AMP's deny propagation): a view that only feeds a GEMM is
  cast after, not computed in float32. Nor does a product or quotient by a float32 value smaller
  than its result whose value only GEMMs read (``linear(h / deg[:, None])``, a graph network's
  degree normalisation): the GEMM rounds it to the low dtype either way, and casting the small
  factor moves fewer bytes than casting the product.
- ``float32_operands`` (rule ``fidelity:operand``): an add/sub (``OpEntry.additive``) of a float32
  parameter, buffer or view of one computes in float32: ``x + pos_embed``, ``attn + bias_table[idx]``.
  So does a product or quotient with one (``OpEntry.promotes``: autocast leaves it to type promotion,
  which computes in float32) whose value goes on to anything but GEMMs: layer scale's
  ``x + gamma * branch(norm(x))`` keeps autocast's float32 product, and the residual stream it joins
  stays float32 (``fidelity:stream``). A product that only feeds GEMMs (``linear(h * scale)``) stays
  low: the GEMM rounds it to the low dtype either way.
- ``exact_values`` (rule ``fidelity:exact``): an infer/clear op whose value reaches an integer
  conversion, a comparison or an argmax (``OpEntry.exact``; ``x.to(torch.int64)``) computes in
  float32 whenever it reads a float32 value: ``(gemm + arange).long()`` gives the float32 indices
  (bfloat16 holds integers exactly only up to 256).

A tensor with no dimensions does not promote one that has dimensions (PyTorch's rule), so a 0-dim
float32 value is no reason here. A norm's pinned slots (its weight and bias) are no reason either.

Before (bfloat16, pre-LN block)::  x[input] -> layer_norm -> linear -> add(x, linear) -> layer_norm_1
After::                             float32    float32       bf16      float32           float32
"""
from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.fx as fx

from .. import ops
from ..meta import decision, numel, out_infos
from ..ops import Category, Result
from ..policy import Policy
from ..report.records import Decision, Rule
from .cast_model import fp32_slot_inputs
from .nodes import carries_float, original_dtype, pass_result

PAINTED = (Category.INFER, Category.CLEAR)
RULES = (Rule.FIDELITY_STREAM, Rule.FIDELITY_OPERAND, Rule.FIDELITY_EXACT)
_STREAM, _PARAM = "activation", "parameter"
_ASSUMED = "assumed activation"  # a factory's value without example inputs: float32 or not, the run shows


def float32_values(nodes: list[fx.Node], cat: dict, decided: dict[fx.Node, Decision], u_set: set[fx.Node],
                   color: dict, denied: set[fx.Node], policy: Policy) -> set[fx.Node]:
    """Paint float32 (in ``color``) the infer/clear nodes the three rules keep float32; return them."""
    if not (policy.float32_stream or policy.float32_operands or policy.exact_values):
        return set()
    exact = _exact_cone(nodes, cat, decided) if policy.exact_values else set()
    kinds: dict[fx.Node, str] = {}
    for n in nodes:  # graph order: a view of a parameter is a parameter too
        if decided[n].inplace:  # x.index_add_(...) holds what its target holds: zeros_like(h) follows h
            target = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
            kind = kinds.get(target) if n not in denied else _STREAM
        else:
            kind = _float32_kind(n, cat, decided, denied) or _parameter_view(n, cat, kinds)
        if kind is not None:
            kinds[n] = kind
    queue = deque(kinds)
    painted: set[fx.Node] = set()
    while queue:
        v = queue.popleft()
        for u in v.users:
            if u in color or u in denied or cat.get(u) not in PAINTED or u in painted or u in kinds:
                continue
            rule = _promotes(v, kinds[v], u, cat, u_set, exact, policy)
            if rule is None:
                continue
            color[u] = (torch.float32, rule, _reason(rule, v, kinds[v]))
            painted.add(u)
            painted |= _keep_parameter_views(v, u, cat, kinds, color)
            kinds[u] = _STREAM
            queue.append(u)
    return painted


def _parameter_view(n: fx.Node, cat: dict, kinds: dict[fx.Node, str]) -> str | None:
    """A clear op (a view, a selection) of float32 parameters only is a parameter value too."""
    floats = [p for p in n.all_input_nodes if p in kinds or cat.get(p) is not Category.PASS]
    if cat.get(n) is Category.CLEAR and floats and all(kinds.get(p) == _PARAM for p in floats):
        return _PARAM
    return None


def _keep_parameter_views(v: fx.Node, reader: fx.Node, cat: dict, kinds: dict[fx.Node, str],
                          color: dict) -> set[fx.Node]:
    """Paint float32 the clear ops between a parameter and ``reader``, which reads it in float32
    (else a later step could paint such a view low next to another, low, user)."""
    chain: set[fx.Node] = set()
    stack = [v]
    while stack:
        n = stack.pop()
        if kinds.get(n) != _PARAM or cat.get(n) is not Category.CLEAR or n in color:
            continue
        color[n] = (torch.float32, Rule.FIDELITY_OPERAND,
                    f"a view of a float32 parameter that {reader.name!r} reads in float32: float32")
        chain.add(n)
        stack.extend(n.all_input_nodes)
    return chain


def _promotes(v: fx.Node, kind: str, u: fx.Node, cat: dict, u_set: set[fx.Node], exact: set[fx.Node],
              policy: Policy) -> Rule | None:
    """The rule by which ``u`` reading the float32 value ``v`` computes in float32, else ``None``."""
    if v in fp32_slot_inputs(u, ops.ENTRIES.get(decision(u).op)) or not _has_dims(v):
        return None
    if u in exact:
        return Rule.FIDELITY_EXACT
    if cat[u] is Category.CLEAR and u not in u_set:
        return None  # a view or clear op that only leads to a GEMM: cast after it, not computed in float32
    entry = ops.ENTRIES.get(decision(u).op)
    if kind in (_STREAM, _ASSUMED) and policy.float32_stream:
        if small_factor(v, u, cat):
            return None  # h / deg[:, None] before a GEMM: the small float32 factor is cast, not the product
        return Rule.FIDELITY_STREAM
    if kind != _PARAM or not policy.float32_operands or entry is None:
        return None
    if entry.additive or (entry.promotes and not _only_gemms_read(u, cat)):
        return Rule.FIDELITY_OPERAND
    return None


def small_factor(v: fx.Node, u: fx.Node, cat: dict) -> bool:
    """Is the float32 value ``v`` a factor that the product or quotient ``u`` broadcasts over a larger operand
    (a per-row normaliser, a mask: by shapes), with ``u``'s value read by GEMMs only? Then ``u`` may compute
    low: the GEMM rounds its value to the low dtype either way, and the small factor is cast, not the product."""
    entry = ops.ENTRIES.get(decision(u).op)
    return bool(entry is not None and entry.promotes and not entry.additive and _scales(v, u)
                and _only_gemms_read(u, cat))


def _scales(v: fx.Node, u: fx.Node) -> bool:
    """Is ``v`` smaller than ``u``'s value (which it is broadcast over), by shapes?"""
    mine, theirs = out_infos(v), out_infos(u)
    if not mine or not theirs:
        return False
    small, large = numel(mine[0]), numel(theirs[0])
    return isinstance(small, int) and isinstance(large, int) and small < large


def _only_gemms_read(n: fx.Node, cat: dict) -> bool:
    """Does ``n``'s value reach only allow ops (GEMMs, convolutions), through clear ops (views)?"""
    seen, stack, reached = set(), list(n.users), False
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if cat.get(u) is Category.CLEAR:
            stack.extend(u.users)
        elif cat.get(u) is Category.ALLOW:
            reached = True
        else:
            return False
    return reached


def _reason(rule: Rule, v: fx.Node, kind: str) -> str:
    what = f"float32 {_STREAM if kind == _ASSUMED else kind} {v.name!r}" + (
        " (assumed: without example_inputs its dtype is known only at run time)" if kind == _ASSUMED else "")
    return {Rule.FIDELITY_STREAM: f"reads the {what}: computes in float32 as type promotion would, instead of "
                                  "rounding it (a residual stream, carried state or position keeps its low bits)",
            Rule.FIDELITY_OPERAND: f"adds or multiplies by the {what}: computes in float32 as type promotion "
                                   "would, so the operand's low bits survive (a layer-scaled branch joins a float32 "
                                   "residual stream)",
            Rule.FIDELITY_EXACT: f"reads the {what} and its value reaches an integer conversion, index or "
                                 "comparison: computes in float32 so that value stays exact",
            }[rule]


def _has_dims(v: fx.Node) -> bool:
    """A 0-dim tensor does not promote a dimensioned one (unknown shapes: assume it has dimensions)."""
    infos = out_infos(v)
    return not infos or len(infos[0].shape) > 0


def _float32_kind(n: fx.Node, cat: dict, decided: dict[fx.Node, Decision], denied: set[fx.Node]) -> str | None:
    """``"parameter"`` for a float32 parameter or buffer, ``"activation"`` for any other value that is
    float32 whatever the painting does (graph inputs, float32 ops, embeddings, factories, ``.float()``),
    ``"assumed activation"`` for a factory whose dtype only the run shows, ``None`` for the rest."""
    d = decided[n]
    if d.kind == "get_attr":
        return _PARAM if d.out == torch.float32 else None
    if d.kind == "placeholder":
        return _STREAM if d.out == torch.float32 else None
    if d.kind == "output" or not _produces_float32(n, decided):
        return None
    if n in denied or d.category is Category.DENY or (d.category is Category.FP32 and d.dtype == torch.float32):
        return _STREAM
    if d.category is Category.PASS:
        made = _pass_float32(n, d, decided)
        return _STREAM if made else (_ASSUMED if made is None else None)
    return None


def _produces_float32(n: fx.Node, decided: dict[fx.Node, Decision]) -> bool:
    infos = out_infos(n)
    if infos is None:
        return carries_float(n, decided)
    return original_dtype(n) == torch.float32 and any(i.dtype == torch.float32 for i in infos)


def _pass_float32(n: fx.Node, d: Decision, decided: dict[fx.Node, Decision]) -> bool | None:
    """Does a left-as-written op make float32 whatever its inputs' dtype? An embedding's gather from a
    float32 table, an explicit ``.float()`` / ``.to(torch.float32)`` (:func:`~.nodes.pass_result`
    says), a factory whose dtype its constant arguments fix (``arange(T, dtype=torch.float32)``,
    ``zeros``; not ``zeros_like(x)``). ``None``: a factory whose dtype only the run shows (no
    example inputs, no ``dtype=``: ``arange(T)`` is int64, ``zeros(T)`` float32)."""
    entry = ops.ENTRIES.get(d.op)
    if entry is None or d.rule is Rule.NON_FLOAT:
        return False
    if entry.result is not None:
        return pass_result(n, d, {}) == torch.float32
    if any(carries_float(p, decided) for p in n.all_input_nodes):
        return False  # zeros_like(x): x's dtype
    named = n.kwargs.get("dtype")
    if isinstance(named, torch.dtype):
        return named == torch.float32
    return True if out_infos(n) is not None else None


def _exact_cone(nodes: list[fx.Node], cat: dict, decided: dict[fx.Node, Decision]) -> set[fx.Node]:
    """The infer/clear nodes whose value reaches an exact consumer through infer/clear nodes."""
    starts = [n for n in nodes if _exact_consumer(n, decided[n])]
    cone: set[fx.Node] = set()
    queue = deque(starts)
    while queue:  # through infer/clear ops, and through the float32 ops they feed (floor, round)
        n = queue.popleft()
        for p in n.all_input_nodes:
            if p not in cone and cat.get(p) in (*PAINTED, Category.FP32):
                cone.add(p)
                queue.append(p)
    return {n for n in cone if cat.get(n) in PAINTED}


def _exact_consumer(n: fx.Node, d: Decision) -> bool:
    """Does ``n`` need the exact values of the float data it reads (``x.long()``, ``x > t``, argmax)?"""
    entry = ops.ENTRIES.get(d.op)
    if entry is None or d.category is not Category.PASS:
        return False
    if entry.exact:
        return True
    return entry.result is Result.CAST and any(_integer_dtype(a) for a in (*n.args[1:], *n.kwargs.values()))


def _integer_dtype(a: Any) -> bool:
    return isinstance(a, torch.dtype) and not (a.is_floating_point or a.is_complex)
