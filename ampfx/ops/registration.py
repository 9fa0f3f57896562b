"""``ampfx.register_op``: a library that ships its own torch ops gives them a default rule.

The entry joins ampfx's op tables (rule ``table`` in the report, reason ``"registered by
<library>: <reason>"``), so a :class:`~ampfx.policy.Policy` edit or an ``AMPFX_*`` variable
still overrides it, as it overrides any table entry. Register when the library is imported,
before :func:`ampfx.convert`.

>>> import torch, ampfx
>>> lib = torch.library.Library("ampfx_doc", "DEF")
>>> _ = lib.define("twice(Tensor x) -> Tensor")
>>> lib.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")
>>> register_op(torch.ops.ampfx_doc.twice, "infer", reason="elementwise", library="ampfx_doc")
'ampfx_doc::twice'
>>> ampfx.Policy("bf16").category_of("ampfx_doc::twice")
(<Category.INFER: 'infer'>, 'table', 'registered by ampfx_doc: elementwise')
>>> _ = ops.ENTRIES.pop("ampfx_doc::twice"), ops.REGISTERED.pop("ampfx_doc::twice")
"""
from __future__ import annotations

import inspect
import types
from typing import Any

from .. import ops
from . import custom_ops
from ..errors import OpRegistrationError, did_you_mean
from . import LISTS, Category

_CATEGORIES = {c.value: c for c in LISTS}


def _category(value: Any, where: str) -> Category:
    """``Category.ALLOW`` or one of ``"allow"``, ``"infer"``, ``"clear"``, ``"deny"``."""
    if isinstance(value, Category) and value in LISTS:
        return value
    if isinstance(value, str) and value.strip().lower() in _CATEGORIES:
        return _CATEGORIES[value.strip().lower()]
    close = did_you_mean(value, _CATEGORIES) if isinstance(value, str) else ""
    raise OpRegistrationError(f"register_op({where}): category {value!r} is not a list; use one of "
                              f"{', '.join(map(repr, _CATEGORIES))} or ampfx.Category.ALLOW/INFER/CLEAR/DENY.{close}")


def _target(target: Any) -> tuple[str, str | None, Any]:
    """``(name, qualified name of a Python function or None, the object whose arguments the slots name)``."""
    try:
        ref = custom_ops.parse(target) if isinstance(target, str) else custom_ops.ref_of(target)
    except LookupError as e:
        raise OpRegistrationError(f"register_op({target!r}): {e}") from None
    if ref is not None:
        if ops.lookup_name(ref.target()) is not None or ref.namespace in custom_ops.TORCH_NAMESPACES:
            raise OpRegistrationError(
                f"register_op({target!r}): {ref.name} is one of torch's own ops, whose rules are ampfx's tables "
                f"(`ampfx lists`); change them with a Policy list edit or AMPFX_*LIST_ADD/REMOVE instead")
        return ref.name, None, ref
    held = ops.lookup_name(target) if callable(target) and not isinstance(target, type) else None
    if held is not None and held not in ops.REGISTERED:
        raise OpRegistrationError(f"register_op({ops.qualified_name(target)}): it is already ampfx's op {held!r}; "
                                  "change its list with a Policy list edit or AMPFX_*LIST_ADD/REMOVE instead")
    if isinstance(target, types.FunctionType):
        name = ops.qualified_name(target)
        return name, name, target
    raise OpRegistrationError(
        f"register_op({target!r}): not an op; give a torch.library op (torch.ops.ns.op, torch.ops.ns.op.overload, "
        "the CustomOpDef of @torch.library.custom_op, or its name 'ns::op') or a Python function")


def _arg_names(obj: Any) -> list[list[str]]:
    """The argument names of every schema (each overload of an op) or of a function's signature."""
    if isinstance(obj, custom_ops.OpRef):
        overloads = (obj.overload,) if obj.overload else obj.overloads()
        packet = obj.whole().target()
        return [[a.name for a in getattr(packet, o)._schema.arguments] for o in overloads]
    return [[p.name for p in inspect.signature(obj).parameters.values()]]


def _slots(value: Any, field: str, name: str, signatures: list[list[str]]) -> tuple[int | str, ...]:
    """``fp32_args`` / ``index_args``: positions and names that every overload of the op has, each given
    with its other spelling (a graph passes an argument by position or by name) where all overloads agree."""
    slots = (value,) if isinstance(value, (int, str)) else tuple(value)
    out: list[int | str] = []
    for slot in slots:
        ok = (isinstance(slot, str) and all(slot in args for args in signatures)) or (
            isinstance(slot, int) and not isinstance(slot, bool) and all(0 <= slot < len(args) for args in signatures))
        if not ok:
            raise OpRegistrationError(
                f"register_op({name}): {field} slot {slot!r} is not an argument of the op; its arguments: "
                f"{' | '.join(', '.join(f'{i}:{a}' for i, a in enumerate(args)) for args in signatures)}")
        other = {args.index(slot) if isinstance(slot, str) else args[slot] for args in signatures}
        out += [slot, *other] if len(other) == 1 else [slot]
    return tuple(dict.fromkeys(out))


def register_op(target: Any, category: Category | str, *, reason: str, library: str | None = None,
                fp32_args: Any = (), index_args: Any = (), fp16: Category | str | None = None,
                bf16: Category | str | None = None, replace: bool = False) -> str:
    """Give the op ``target`` a default list, as ampfx's own tables do; returns its list name.

    ``target``: a torch.library op in any form (``torch.ops.ns.op``, an overload, a ``CustomOpDef``,
    ``"ns::op"``, ``"ns::op.overload"``) or a Python function (kept whole when traced). ``category``:
    ``"allow"``, ``"infer"``, ``"clear"``, ``"deny"`` (or the :class:`~ampfx.Category`); ``fp16`` / ``bf16``
    another list under that dtype. ``fp32_args`` / ``index_args``: argument positions or names kept
    float32 / never cast whatever the op's dtype (a norm's statistics; an index). ``library``: who
    registers (the report's reason says so; default the op's namespace). Registering the op again with
    another rule is an error unless ``replace=True``; the same rule again is a no-op.
    """
    name, qualname, obj = _target(target)
    if not isinstance(reason, str) or not reason.strip():
        raise OpRegistrationError(f"register_op({name}): give reason='why this list' (the report shows it)")
    who = library or (obj.namespace if isinstance(obj, custom_ops.OpRef) else name.partition(".")[0])
    variants = {d: (_category(v, f"{name}, {d}="), f"registered by {who}: {reason} ({d})")
                for d, v in (("fp16", fp16), ("bf16", bf16)) if v is not None}
    entry = ops.OpEntry(name, _category(category, name), f"registered by {who}: {reason}",
                        fp32_args=_slots(fp32_args, "fp32_args", name, _arg_names(obj)),
                        index_args=_slots(index_args, "index_args", name, _arg_names(obj)), **variants)
    held = ops.ENTRIES.get(name) if name in ops.ENTRIES else None
    if held is not None and name not in ops.REGISTERED:
        raise OpRegistrationError(f"register_op({name}): {name!r} is one of ampfx's own ops; change its list "
                                  "with a Policy list edit or AMPFX_*LIST_ADD/REMOVE instead")
    if held is not None and held != entry and not replace:
        raise OpRegistrationError(
            f"register_op({name}): already registered by {ops.REGISTERED[name]} as {held.category.value} "
            f"({held.reason!r}); pass replace=True to change its rule")
    ops.register(entry, who, qualname)
    return name
