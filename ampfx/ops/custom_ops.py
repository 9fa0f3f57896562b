"""The user's own torch ops (``torch.library``): one name however they are written.

A custom op is reached as an ``OpOverloadPacket`` (``torch.ops.mylib.scale2``), an
``OpOverload`` (``torch.ops.mylib.scale2.default``), the ``CustomOpDef`` that
``@torch.library.custom_op("mylib::scale2", ...)`` returns, or a name:
``"mylib::scale2"``, ``"mylib::scale2.default"``, ``"mylib.scale2"`` or
``"torch.ops.mylib.scale2"``. :func:`ref_of` and :func:`parse` turn each into the same
:class:`OpRef`, whose :attr:`OpRef.name` is the name policies, env variables and the
report use: ``"ns::op"`` for the op (all its overloads), ``"ns::op.overload"`` for one
overload. What torch records in a graph: ``torch.fx`` keeps the object the model called
(a packet for ``torch.ops.ns.op(x)``, an overload for ``.default(x)`` and for a
``CustomOpDef`` call); ``torch.export`` always records overloads.

Only ops torch has loaded are known (those of the dispatcher, ``torch._C._dispatch_get_all_op_names``):
a library's ops exist once the library is imported. This module imports nothing of ampfx.

>>> import torch
>>> ref_of(torch.ops.aten.relu.default)
OpRef(namespace='aten', op='relu', overload='default')
>>> parse("torch.ops.aten.relu").name, parse("aten::relu.out").name, parse("aten.relu").name
('aten::relu', 'aten::relu.out', 'aten::relu')
>>> parse("mypkg.layers.Block") is None
True
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

import torch

TORCH_NAMESPACES = ("aten", "prims")
"""Namespaces of torch's own ops, left out of the close matches offered for another namespace's name."""


@dataclass(frozen=True)
class OpRef:
    """One torch op, or one overload of it (``overload`` ``None``: the op with all its overloads)."""

    namespace: str
    op: str
    overload: str | None = None

    @property
    def packet(self) -> str:
        """``"ns::op"``, the op's name without overload."""
        return f"{self.namespace}::{self.op}"

    @property
    def name(self) -> str:
        """``"ns::op"`` or ``"ns::op.overload"``: how lists, env variables and the report name it."""
        return self.packet if self.overload is None else f"{self.packet}.{self.overload}"

    def whole(self) -> "OpRef":
        """The op this overload belongs to (itself for an op)."""
        return OpRef(self.namespace, self.op)

    def overloads(self) -> tuple[str, ...]:
        """The op's overload names, as torch lists them (``("default",)`` for a ``custom_op``)."""
        return tuple(getattr(getattr(torch.ops, self.namespace), self.op).overloads())

    def target(self) -> Any:
        """The torch object: the ``OpOverloadPacket``, or the ``OpOverload``."""
        packet = getattr(getattr(torch.ops, self.namespace), self.op)
        return packet if self.overload is None else getattr(packet, self.overload)


def ref_of(obj: Any) -> OpRef | None:
    """The :class:`OpRef` of an ``OpOverload``, ``OpOverloadPacket`` or ``CustomOpDef``; else ``None``.

    A ``CustomOpDef`` (``torch.library.custom_op``, torch >= 2.4) names the whole op: it is
    recognised by the ``OpOverload`` it wraps, so nothing newer than torch 2.2 is imported.
    """
    if isinstance(obj, torch._ops.OpOverload):
        ns, _, op = obj.overloadpacket._qualified_op_name.partition("::")
        return OpRef(ns, op, obj._overloadname)
    if isinstance(obj, torch._ops.OpOverloadPacket):
        ns, _, op = obj._qualified_op_name.partition("::")
        return OpRef(ns, op)
    wrapped = getattr(obj, "_opoverload", None)
    if isinstance(wrapped, torch._ops.OpOverload):
        return ref_of(wrapped.overloadpacket)
    return None


def loaded() -> dict[str, set[str]]:
    """Namespace -> the names of its ops (``"op"`` and ``"op.overload"``) that torch has loaded now."""
    out: dict[str, set[str]] = {}
    for qualified in torch._C._dispatch_get_all_op_names():
        ns, _, rest = qualified.partition("::")
        out.setdefault(ns, set()).update((rest, rest.partition(".")[0]))
    return out


def close_names(word: str) -> list[str]:
    """Op names torch has loaded that look like ``word``: ``"ns::op"`` names of ``word``'s namespace
    if it has one that is loaded, else of every namespace but torch's own."""
    known = loaded()
    ns = word.replace("torch.ops.", "", 1).replace("::", ".").partition(".")[0]
    spaces = [ns] if ns in known else [n for n in known if n not in TORCH_NAMESPACES]
    return [f"{n}::{op}" for n in spaces for op in known[n] if "." not in op]


def _split(text: str) -> tuple[str, str, str | None] | None:
    """``"ns::op.ov"`` / ``"ns.op.ov"`` / ``"torch.ops.ns.op"`` -> ``(ns, op, overload)``."""
    body = text[len("torch.ops."):] if text.startswith("torch.ops.") else text
    ns, sep, rest = body.partition("::")
    if not sep:
        ns, sep, rest = body.partition(".")
    op, _, overload = rest.partition(".")
    if not (ns.isidentifier() and op.isidentifier() and (not overload or overload.isidentifier())):
        return None
    return ns, op, overload or None


def parse(text: str) -> OpRef | None:
    """The op a name names, or ``None`` when ``text`` is not written as an op name.

    A name with ``::`` or ``torch.ops.`` is an op name: if torch has not loaded it, this raises
    ``LookupError`` with a message (the namespace is not loaded: import the library first; or the op
    or overload is unknown, with close matches). ``"ns.op"`` is an op name only when torch has that op
    (``"mypkg.fn"`` may be a Python function).
    """
    text = text.strip()
    parts = _split(text)
    explicit = "::" in text or text.startswith("torch.ops.")
    if parts is None:
        if explicit:
            raise LookupError(f"{text!r} is not an op name: write 'namespace::op' or 'namespace::op.overload'")
        return None
    ns, op, overload = parts
    known = loaded()
    if ns not in known:
        if not explicit:
            return None
        hint = f"; close: {', '.join(map(repr, sorted(difflib.get_close_matches(ns, known))))}" if \
            difflib.get_close_matches(ns, known) else ""
        raise LookupError(f"torch has no op namespace {ns!r} loaded{hint}. Import the library that defines "
                          f"{ns}::{op} (or call torch.ops.load_library) before ampfx.convert()")
    if op not in known[ns]:
        if not explicit:
            return None
        hits = difflib.get_close_matches(op, sorted(o for o in known[ns] if "." not in o), n=3)
        hint = f" Did you mean {' or '.join(repr(f'{ns}::{h}') for h in hits)}?" if hits else ""
        raise LookupError(f"torch has no op {ns}::{op} (namespace {ns!r} is loaded).{hint}")
    ref = OpRef(ns, op, overload)
    if overload is not None and overload not in ref.overloads():
        if not explicit:
            return None
        raise LookupError(f"{ns}::{op} has no overload {overload!r}; its overloads: {', '.join(ref.overloads())} "
                          f"(or name the op without overload, {ns}::{op}, for all of them)")
    return ref


def writes_inputs(target: Any) -> bool:
    """Does ``target``, a library's op (not torch's own), write into an argument (``mutates_args``, a
    ``Tensor(a!)`` in its schema)? For a packet: does any overload? A cast copy would take the write.

    >>> writes_inputs(torch.ops.aten.add_.Tensor), writes_inputs(len)
    (False, False)
    """
    ref = ref_of(target)
    if ref is None or ref.namespace in TORCH_NAMESPACES:
        return False
    packet = getattr(getattr(torch.ops, ref.namespace), ref.op)
    overloads = [target] if ref.overload is not None else [getattr(packet, o) for o in packet.overloads()]
    return any(o._schema.is_mutable for o in overloads)
