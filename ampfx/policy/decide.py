"""The module and list part of the precedence chain, written once.

``passes/classify.py`` decides every node of a traced graph, and
:func:`ampfx.libraries.convert_eager_leaf` decides another library's module
called from eager code (its parent could not be traced). Both ask this module
the same two questions, in this order (the full chain is in :mod:`ampfx.policy`):

1. :func:`decide_module`: is the code inside a module named in
   ``fp32_modules`` (by name, glob, class or predicate: :mod:`ampfx.policy.module_match`; or under
   one), or a module that ``module_filter_fn``
   rejects, checked on the module and on each of its parents up to the model's
   root (asked once per module by :func:`ampfx.convert`)? Then it stays float32 (rule ``fp32_modules`` /
   ``module_filter_fn``), whatever the lists say.
2. :func:`decide_op`: the lists, by canonical op name: in no list, float32
   (rule ``unlisted``); on a list, its category and the source of the entry
   (``table``, ``argument``, ``env:AMPFX_...``); ``DENY`` computes in float32,
   the other lists leave the dtype to painting.

:func:`decide_leaf` is 1 then 2 for one leaf module. What comes after (probes
and out-of-range constants for graph nodes, a library's device rules through
:func:`ampfx.libraries.refine`) refines a :class:`Verdict`, and never one
whose rule is in :data:`FINAL_RULES`.

>>> import torch, ampfx
>>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Softmax(-1))
>>> policy = ampfx.Policy("bf16", module_filter_fn=lambda m, fqn: fqn != "enc")
>>> decide_module(policy, net, "0", prefix="enc.")
('module_filter_fn', "module_filter_fn rejected module 'enc': kept float32")
>>> decide_leaf(ampfx.Policy("bf16"), net, "1").rule
'table'
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn as nn

from .. import ops
from ..ops import Category
from ..errors import PolicyError
from .names import did_you_mean, is_glob
from . import Policy, Resolved
from ..report.records import Decision, Rule

FINAL_RULES = frozenset({Rule.EAGER, Rule.KEPT, Rule.FP32_MODULES, Rule.MODULE_FILTER_FN, Rule.NON_FLOAT,
                         Rule.USER_FLOAT32, Rule.OTHER_FLOAT})
"""Rules no later step (probe, constant range, a library's refinement) overrides."""


@dataclass(frozen=True)
class Verdict:
    """A decision before it is tied to a node: category, compute dtype (``None``: painting
    decides), the rule that won and why."""

    category: Category
    dtype: torch.dtype | None
    rule: Rule
    reason: str

    def decision(self, **where: Any) -> Decision:
        """The :class:`~ampfx.report.records.Decision` for one node (``where``: its name, op, module, shapes, ...)."""
        return Decision(category=self.category, dtype=self.dtype, rule=self.rule, reason=self.reason, **where)


def decide_module(policy: Policy, root: nn.Module, path: str, prefix: str = "",
                  resolved: Resolved = Resolved()) -> tuple[str, str] | None:
    """``(rule, reason)`` when the module at ``path`` (relative to ``root``, which sits at
    ``prefix`` in the user's model) is kept float32 by ``fp32_modules`` or ``module_filter_fn``;
    else ``None``. The filter's answers for the module and each parent, innermost first, come
    from ``resolved.filter_rejected`` (:func:`ampfx.request.resolve`, up to the model's root); a
    policy not resolved asks the filter itself, up to ``root``."""
    full = prefix + path if path else prefix.rstrip(".")
    hit = _fp32_module(policy, resolved, full)
    if hit is not None:
        return Rule.FP32_MODULES, hit
    fn = policy.module_filter_fn
    if fn is not None and resolved.filter_rejected is not None:  # asked once per module by convert()
        parts = full.split(".") if full else []
        for fqn in (".".join(parts[:i]) for i in range(len(parts), -1, -1)):
            if fqn in resolved.filter_rejected:
                return Rule.MODULE_FILTER_FN, f"module_filter_fn rejected module {fqn or '<root>'!r}: kept float32"
    elif fn is not None:
        parts = path.split(".") if path else []
        for i in range(len(parts), -1, -1):
            sub = ".".join(parts[:i])
            mod = root.get_submodule(sub) if sub else root
            fqn = (prefix + sub) if sub else prefix.rstrip(".")
            if not fn(mod, fqn):
                return Rule.MODULE_FILTER_FN, f"module_filter_fn rejected module {fqn or '<root>'!r}: kept float32"
    return None


def _fp32_module(policy: Policy, resolved: Resolved, full: str) -> str | None:
    """The reason when the module at ``full`` (or one above it) is kept by ``fp32_modules``: the
    first entry that matched, from ``resolved.fp32_matched`` (resolved against the model by
    :func:`ampfx.request.resolve`); a policy not resolved matches its plain names, and its globs,
    classes and predicates, which only a model can resolve, are an error rather than ignored."""
    matched = resolved.fp32_matched
    if not matched:
        unresolved = [e for e in policy.fp32_modules if not isinstance(e, str) or is_glob(e)]
        if unresolved:
            raise PolicyError(f"fp32_modules entries {unresolved!r} are resolved against the model by ampfx.convert "
                              "(ampfx.policy.module_match.resolve); this policy was not: convert with it, or name modules")
        matched = tuple((e, "named in fp32_modules") for e in policy.fp32_modules)
    hit = matched_at(matched, full)
    return None if hit is None else f"inside module {hit[0]!r}, {hit[1]}: kept float32"


def matched_at(matched: tuple[tuple[str, str], ...], full: str) -> tuple[str, str] | None:
    """``(path, why)`` of the first entry of ``matched`` (resolved module entries, in entry order) that is the
    module at ``full`` or a module above it; ``None`` where none is.

    >>> matched_at((("enc", "named in fp32_modules"),), "enc.layers.0")
    ('enc', 'named in fp32_modules')
    """
    if not matched:
        return None
    order = _order(matched)
    parts = full.split(".") if full else []
    hits = [order[1][p] + (p,) for p in (".".join(parts[:i]) for i in range(len(parts), 0, -1)) if p in order[1]]
    if not hits:
        return None
    _, why, path = min(hits)
    return path, why


@functools.lru_cache(maxsize=64)
def _order(matched: tuple[tuple[str, str], ...]) -> tuple[tuple[str, ...], dict[str, tuple[int, str]]]:
    """``matched`` (``fp32_matched``) indexed by path: each path's place in it and its reason."""
    return matched, {path: (i, why) for i, (path, why) in enumerate(matched)}


def decide_op(policy: Policy, name: str, why: str | None = None) -> Verdict:
    """What the lists say about the op ``name`` (``why``: the reason it was traced as a leaf, if it was)."""
    listed = policy.category_of(name)
    if listed is None:
        reason = (f"{name} is not in any list: stays float32 (add it with AMPFX_ALLOWLIST_ADD / "
                  f"AMPFX_INFERLIST_ADD / ...={name})")
        if why:
            reason += f"; traced as a leaf because {why}"
        return Verdict(Category.FP32, torch.float32, Rule.UNLISTED, reason)
    category, source, reason = listed
    return Verdict(category, torch.float32 if category is Category.DENY else None, source, reason)


def leaf_name(policy: Policy, module: nn.Module) -> str:
    """The op name of a leaf module: its canonical name, else its type's qualified name."""
    return policy.op_name(type(module)) or ops.qualified_name(type(module))


def decide_leaf(policy: Policy, root: nn.Module, path: str, prefix: str = "", why: str | None = None,
                resolved: Resolved = Resolved()) -> Verdict:
    """The module rules (:func:`decide_module`), then the lists (:func:`decide_op`), for the leaf
    module at ``path`` under ``root``."""
    hit = decide_module(policy, root, path, prefix, resolved)
    if hit is not None:
        return Verdict(Category.FP32, torch.float32, *hit)
    module = root.get_submodule(path) if path else root
    return decide_op(policy, leaf_name(policy, module), why)


def check_tuned(policy: Policy, records: Iterable[Decision]) -> None:
    """Every node ``policy.tuned`` names is a node of the conversion whose ``records`` are given
    (:attr:`Decision.key`); else a :class:`PolicyError`: the model changed since it was tuned,
    and a tuned choice must not silently stop applying."""
    keys = {r.key for r in records}
    missing = [key for key, _ in policy.tuned if key not in keys]
    if missing:
        raise PolicyError(
            f"Policy.tuned / the policy file names {len(missing)} node(s) that this conversion does not have: "
            f"{', '.join(repr(k) for k in missing[:5])}{' ...' if len(missing) > 5 else ''}."
            f"{did_you_mean(missing[0], keys)} The model (or its capture) changed since ampfx.tools.tune chose them: "
            "run ampfx.tools.tune again, or drop `tuned` from the policy.")
