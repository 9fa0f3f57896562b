"""Pass: give every node a category from the op tables, the policy, module
names and device probes, as a :class:`~ampfx.report.Decision` in
``node.meta['ampfx']`` (dtype still unset for the four paintable lists).

Before::

    linear = torch._C._nn.linear(x, fc_weight, fc_bias)
    softmax = torch.nn.functional.softmax(linear, dim=-1)

After (meta only, the graph is unchanged)::

    linear.meta['ampfx']  == Decision(op='linear', category=ALLOW, rule='table', ...)
    softmax.meta['ampfx'] == Decision(op='softmax', category=DENY, dtype=float32, rule='table', ...)

Precedence is documented in :mod:`ampfx.policy`.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .. import integrations, ops, probes
from ..meta import RECORD, node_module_path, out_infos
from ..ops import Category
from ..policy import Policy
from ..report import Decision
from ..runtime import CASTABLE
from .context import PassContext

def is_inplace(node: fx.Node, gm: fx.GraphModule) -> bool:
    """``x.add_(y)``, ``F.relu(x, inplace=True)``, ``nn.ReLU(inplace=True)``, ``x[i] = v``."""
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_function":
        if node.kwargs.get("inplace") is True:
            return True
        packet = getattr(node.target, "overloadpacket", None)  # ATen ops: aten.add_.Tensor -> "add_"
        name = getattr(packet if packet is not None else node.target, "__name__", "")
        return ops.is_inplace_operator(node.target) or (
            name.endswith("_") and not name.endswith("__") and node.target not in (torch._assert,))
    if node.op == "call_module":
        return getattr(gm.get_submodule(str(node.target)), "inplace", False) is True
    return False


def op_key(node: fx.Node, gm: fx.GraphModule) -> Any:
    """What the tables are keyed by: the callable, the method name or the module type."""
    if node.op == "call_module":
        return type(gm.get_submodule(str(node.target)))
    return node.target


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


def carries_float(node: fx.Node, decided: dict[fx.Node, Decision]) -> bool:
    """Might this node's value hold a float32/16/bf16 tensor? Exact with shapes;
    otherwise everything not known to be non-float might."""
    infos = out_infos(node)
    if infos is not None:
        return any(i.dtype in CASTABLE for i in infos)
    d = decided.get(node)
    if d is None:
        return True
    if d.kind in ("placeholder", "get_attr"):
        return d.out is not None
    if d.rule == "non-float":
        return False
    rule = ops.RULES.get(d.op)
    return not (d.category is Category.PASS and rule is not None and rule.result == "nonfloat")


def original_dtype(n: fx.Node) -> torch.dtype:
    """The float dtype ``n`` produced before conversion (float32 when unknown)."""
    infos = out_infos(n)
    floats = [i.dtype for i in infos or () if i.dtype in CASTABLE]
    return floats[0] if floats else torch.float32


def attr_of(gm: fx.GraphModule, target: str) -> Any:
    """The object a ``get_attr`` target names (``"layer1.0.conv1.weight"``)."""
    return operator.attrgetter(target)(gm)


def _fp32_module(path: str, ctx: PassContext, gm: fx.GraphModule) -> tuple[str, str] | None:
    full = ctx.prefix + path if path else ctx.prefix.rstrip(".")
    for p in ctx.policy.fp32_modules:
        if full == p or full.startswith(p + "."):
            return "fp32_modules", f"inside module {p!r}, named in fp32_modules: kept float32"
    fn = ctx.policy.module_filter_fn
    if fn is not None:
        parts = path.split(".") if path else []
        for i in range(len(parts), -1, -1):
            sub = ".".join(parts[:i])
            mod = gm.get_submodule(sub) if sub else gm
            fqn = (ctx.prefix + sub) if sub else ctx.prefix.rstrip(".")
            if not fn(mod, fqn):
                return "module_filter_fn", f"module_filter_fn rejected module {fqn or '<root>'!r}: kept float32"
    return None


def _probe_variant(kind: str, node: fx.Node, gm: fx.GraphModule) -> probes.Variant:
    """Which kernel of probe ``kind`` the node runs (dimensions, mode): see :func:`ampfx.probes.variant_of`."""
    module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
    target = type(module).__name__ if module is not None else target_str(node)
    first = next(iter(node.all_input_nodes), None)
    infos = out_infos(first) if first is not None else None
    rank = len(infos[0].shape) if infos else None
    return probes.variant_of(kind, target, node.kwargs, module, rank, node.args)


def _out_of_range(node: fx.Node, low: torch.dtype) -> float | None:
    """A Python float among ``node``'s arguments that ``low`` cannot hold, else ``None``.
    (Exported graphs bake in constants such as ``torch.finfo(torch.float32).min`` for masks:
    ``masked_fill(x_bf16, mask, -3.40e38)`` raises.)

    >>> import operator
    >>> g = fx.Graph(); x = g.placeholder("x"); n = g.call_function(operator.mul, (x, -3.4028234663852886e38))
    >>> _out_of_range(n, torch.bfloat16), _out_of_range(n, torch.float32)
    (-3.4028234663852886e+38, None)
    """
    top = torch.finfo(low).max
    for a in torch.utils._pytree.tree_leaves((node.args, node.kwargs)):
        if isinstance(a, float) and a == a and abs(a) != float("inf") and abs(a) > top:
            return a
    return None


def classify(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Annotate every node with its category (see module docstring)."""
    policy = ctx.policy
    low = policy.dtype
    decided: dict[fx.Node, Decision] = {}
    for node in gm.graph.nodes:
        module = node_module_path(node)
        full_module = (ctx.prefix + module) if module else ctx.prefix.rstrip(".")
        shapes = tuple(str(i) for i in (out_infos(node) or ()))
        base = dict(node=node.name, target=target_str(node), module=full_module, kind=node.op, shapes=shapes)
        if node.op in ("placeholder", "get_attr", "output"):
            what = {"placeholder": "graph input: kept as given",
                    "get_attr": "parameter or buffer: stays float32 (master copy); cast after get_attr where a "
                                "consumer wants low precision",
                    "output": "graph output: float results return in their original dtype"}[node.op]
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
            decided[node] = Decision(op=node.op, category=Category.PASS, dtype=None, rule="structure", reason=what,
                                     out=out, **base)
            node.meta[RECORD] = decided[node]
            continue

        base["in_shapes"] = tuple(str(i[0]) for i in (out_infos(n) for n in node.all_input_nodes) if i)
        name = op_name(node, gm, policy)
        rule = ops.RULES.get(name)
        inplace = is_inplace(node, gm)
        base.update(op=name, inplace=inplace)
        float_inputs = [n for n in node.all_input_nodes if carries_float(n, decided)]
        infos = out_infos(node)
        out_float = infos is None or any(i.dtype in CASTABLE for i in infos)

        def decide(category: Category, dtype: torch.dtype | None, rule_name: str, reason: str) -> Decision:
            return Decision(category=category, dtype=dtype, rule=rule_name, reason=reason, **base)

        listed = policy.category_of(name)
        if listed is None and rule is not None and rule.category is Category.PASS:
            d = decide(Category.PASS, None, "table", rule.reason)
        elif not float_inputs and (not out_float or (infos is None and rule is not None)):
            d = decide(Category.PASS, None, "non-float", "no float32/16/bf16 tensor in or out: left as written")
        elif node.op == "call_module" and str(node.target) in ctx.regions:
            d = decide(Category.FP32, torch.float32, "region",
                       f"could not be traced ({ctx.leaves.get(str(node.target), '')}); runs its own Python on "
                       "float32 inputs, with its children converted separately (see their records)")
        elif (hit := _fp32_module(module, ctx, gm)) is not None:
            d = decide(Category.FP32, torch.float32, *hit)
        elif listed is None:
            why = ctx.leaves.get(str(node.target)) if node.op == "call_module" else None
            reason = (f"{name} is not in any list: stays float32 (add it with AMPFX_ALLOWLIST_ADD / "
                      f"AMPFX_INFERLIST_ADD / ...={name})")
            if why:
                reason += f"; traced as a leaf because {why}"
            d = decide(Category.FP32, torch.float32, "unlisted", reason)
        else:
            category, source, reason = listed
            d = decide(category, torch.float32 if category is Category.DENY else None, source, reason)
            if (category in (Category.ALLOW, Category.INFER, Category.CLEAR) and policy.probe
                    and rule is not None and rule.probe):
                variant = _probe_variant(rule.probe, node, gm)
                err = probes.check(rule.probe, low, ctx.device, variant)
                if err is not None:
                    d = decide(Category.FP32, torch.float32, "probe",
                               f"{name}{probes.describe(variant)} has no working {str(low)[6:]} kernel on "
                               f"{ctx.device} ({err}): float32")
            if category in (Category.ALLOW, Category.INFER, Category.CLEAR) and (
                    big := _out_of_range(node, low)) is not None:
                d = decide(Category.FP32, torch.float32, "range:constant",
                           f"{name} uses the constant {big:.4g}, outside {str(low)[6:]}'s range: float32")
        if node.op == "call_module" and d.rule not in ("region", "fp32_modules", "module_filter_fn", "non-float"):
            # another library's leaf (DGL): its table's device rules, variants, guards (ampfx.integrations)
            d = integrations.refine(d, gm.get_submodule(str(node.target)), node, gm, ctx)
        decided[node] = d
        node.meta[RECORD] = d
