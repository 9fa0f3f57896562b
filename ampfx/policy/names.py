"""The names a user writes at ampfx's string boundary (environment variables, the command line, policy
files) and how they are resolved: dtypes, ops, list names, importable objects, globs, and the
"did you mean" suggestion every unknown name gets. Used by :mod:`ampfx.policy` and by what reads and
writes policies (:mod:`ampfx.policy.policy_file`, :mod:`ampfx.policy.module_match`), none of which it imports.
"""
from __future__ import annotations

import difflib
import fnmatch
import pkgutil
import re
from typing import Any, Iterable

import torch

from .. import ops
from ..dtypes import LOW_DTYPES
from ..ops import custom_ops
from ..errors import PolicyError, did_you_mean
from ..ops import Category

ENV_PREFIX = "AMPFX_"
LIST_NAMES = {Category.ALLOW: "allowlist", Category.INFER: "inferlist", Category.CLEAR: "clearlist",
              Category.DENY: "denylist"}
_DTYPES = {name: getattr(torch, dtype) for name, dtype in LOW_DTYPES.items()}


def parse_dtype(value: Any, *, where: str = "dtype") -> torch.dtype:
    """``torch.bfloat16``, ``torch.float16`` or one of their names.

    >>> parse_dtype("fp16")
    torch.float16
    """
    if value in (torch.bfloat16, torch.float16):
        return value
    if isinstance(value, str) and value.strip().lower() in _DTYPES:
        return _DTYPES[value.strip().lower()]
    hint = (" (the model already runs in it; to keep it, do not convert, or set AMPFX_DISABLE=1)"
            if isinstance(value, torch.dtype) and value.is_floating_point else "")
    if "8" in str(value):
        hint = " (FP8 GEMMs ride on a 16-bit plan: convert(model, 'bf16', fp8='tensorwise'))"
    raise PolicyError(f"{where}={value!r} is not a low-precision dtype{hint}; use one of "
                      "torch.bfloat16, torch.float16, 'bf16', 'fp16', 'bfloat16', 'float16'")


def import_object(path: str) -> Any:
    """The object ``pkg.module.attr.attr`` names (:func:`pkgutil.resolve_name`), or ``None`` when nothing
    importable has that name.

    >>> import_object("torch.nn.LayerNorm"), import_object("torch.nn.NoSuchLayer")
    (<class 'torch.nn.modules.normalization.LayerNorm'>, None)
    """
    try:
        return pkgutil.resolve_name(path)
    except (ImportError, AttributeError, ValueError):
        return None


def resolve_op(spec: Any, *, where: str) -> tuple[str, Any | None]:
    """An op as a user names it -> ``(canonical name, user object or None)``.

    ``spec`` is a torch callable, a module type, a canonical name or method name
    (``"gelu"``, ``"softmax"``), or a qualified name (``"torch.nn.GELU"``,
    ``"mypkg.layers.MyBlock"``). A user function or module type that is in no
    table gets its qualified name, and the object is returned so that nodes
    calling it can be matched.
    """
    if not isinstance(spec, str):
        name = ops.lookup_name(spec) or _torch_op_name(custom_ops.ref_of(spec))
        if name is not None:
            return name, None
        if callable(spec):
            return ops.qualified_name(spec), spec
        raise PolicyError(f"{where}: {spec!r} is not an op, function or module type")
    text = spec.strip()
    name = ops.lookup_name(text)
    if name is not None:
        return name, None
    for prefix in ("torch.Tensor.", "Tensor."):
        if text.startswith(prefix):  # a Tensor method: matched on call_method nodes by its name
            method = text[len(prefix):]
            name = ops.lookup_name(method)
            if name is not None:
                return name, None
            if method.isidentifier() and hasattr(torch.Tensor, method):
                return f"Tensor.{method}", method
            raise PolicyError(f"{where}: torch.Tensor has no method {method!r}."
                              f"{did_you_mean(method, [m for m in dir(torch.Tensor) if not m.startswith('_')])}")
    try:
        name = _torch_op_name(custom_ops.parse(text))
    except LookupError as e:
        raise PolicyError(f"{where}: {e}") from None
    if name is not None:
        return name, None
    if "." in text:
        obj = import_object(text)
        if obj is not None and callable(obj):
            name = ops.lookup_name(obj)
            return (name, None) if name is not None else (ops.qualified_name(obj), obj)
    close = did_you_mean(text, [*ops.known_names(), *custom_ops.close_names(text)])
    raise PolicyError(f"{where}: unknown op {text!r}.{close} "
                      "Ops are named as in `ampfx lists` (e.g. softmax, linear, gelu), by a qualified "
                      "name of a function or module type (e.g. mypkg.layers.MyBlock), or, for a torch.library "
                      "op, as 'namespace::op' (e.g. mylib::scale2; import its library first).")


def _torch_op_name(ref: custom_ops.OpRef | None) -> str | None:
    """The list name of a torch op: its table name (``aten::softmax.int`` is ``softmax``: ampfx's
    tables name an op with all its overloads), else ``"ns::op"`` / ``"ns::op.overload"``."""
    if ref is None:
        return None
    return ops.lookup_name(ref.target()) or ref.name


GLOB_CHARS = frozenset("*?[")


def is_glob(text: str) -> bool:
    """Does ``text`` use glob characters (a module-name pattern of ``fp32_modules``)?

    >>> is_glob("head.*"), is_glob("head")
    (True, False)
    """
    return any(c in GLOB_CHARS for c in text)


def _bracket_end(pattern: str, i: int) -> int:
    """The index of the ``]`` closing the bracket expression opened at ``pattern[i]``, as :mod:`fnmatch`
    reads it (a ``]`` first in the set, after ``[`` or ``[!``, is a member), or -1."""
    j = i + 1
    if j < len(pattern) and pattern[j] == "!":
        j += 1
    if j < len(pattern) and pattern[j] == "]":
        j += 1
    end = pattern.find("]", j)
    return end


def _bracket_regex(bracket: str) -> str:
    """The regular expression :func:`fnmatch.translate` makes of one bracket expression (``[a-c]``,
    ``[!x]``, ``[]]``): ranges, negation and escapes exactly as fnmatch reads them."""
    translated = fnmatch.translate(bracket)  # '(?s:[a-c])\\Z'
    return translated[len("(?s:"):-len(")\\Z")]


def glob_regex(pattern: str, where: str = "fp32_modules") -> re.Pattern:
    """The regular expression of a module-name glob: ``*``/``?`` stay within a segment, ``**`` crosses dots,
    and a bracket expression means what it means to :mod:`fnmatch` (``[!x]`` within a segment). A ``[``
    left open is an error (fnmatch would read it as a literal, which in a module name is a typo).

    >>> bool(glob_regex("a.*.c").fullmatch("a.b.c")), bool(glob_regex("a.*").fullmatch("a.b.c"))
    (True, False)
    >>> bool(glob_regex("a.**").fullmatch("a.b.c"))
    True
    >>> [bool(glob_regex("l[0-2]").fullmatch(n)) for n in ("l1", "l3")], bool(glob_regex("a[!x]b").fullmatch("a.b"))
    ([True, False], False)
    """
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^.]*")
        elif c == "?":
            out.append("[^.]")
        elif c == "[":
            end = _bracket_end(pattern, i)
            if end < 0:
                raise PolicyError(f"{where}: the glob {pattern!r} opens '[' without closing it")
            body = _bracket_regex(pattern[i:end + 1])
            out.append("(?!\\.)" + body if pattern.startswith("[!", i) else body)  # '[!x]' stays within a segment
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    try:
        return re.compile("".join(out))
    except re.error as e:
        raise PolicyError(f"{where}: the glob {pattern!r} is not a valid pattern ({e})") from None
