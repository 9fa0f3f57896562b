"""Policy files: a :class:`~ampfx.policy.Policy` saved as JSON and read back.

:func:`ampfx.tools.tune` runs once; training runs many times. The tuned policy is
saved (``Policy.save(path)``) and loaded again, in code
(``Policy.from_file(path)``) or without code edits (``AMPFX_POLICY_FILE=path``).
A file holds the fields that differ from their defaults, plus the dtype;
everything in it must mean the same thing when read back, so a value that
cannot be named in JSON (a ``module_filter_fn``, a function defined inside
another) is an error when saving, not a field quietly left out.

``AMPFX_POLICY_FILE`` merges the file into the policy of the ``convert()``
call (:func:`merge`): list edits, ``fp32_modules``, ``leaf_modules`` and
``tuned`` are added to the call's; a scalar field the call left at its default
takes the file's value; a scalar field both set, to different values, is an
error naming both (no silent winner); the dtype is the file's unless the call
names another, which is an error too. The other ``AMPFX_*`` variables apply
after the file.

>>> import tempfile, os, ampfx
>>> path = os.path.join(tempfile.mkdtemp(), "p.json")
>>> _ = ampfx.Policy("fp16", denylist_add=("gelu",), inferlist_remove=("gelu",), tuned={"add": "tuned"}).save(path)
>>> p = ampfx.Policy.from_file(path)
>>> p.dtype, p.denylist_add, p.tuned
(torch.float16, ('gelu',), (('add', 'tuned'),))
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the class is given to the functions that make one: policy imports this module
    from . import Policy

from .. import ops
from ..errors import PolicyError
from .names import ENV_PREFIX, LIST_NAMES, did_you_mean, import_object, resolve_op
from ..ops import LISTS
from ..report.records import Rule, dtype_name

FORMAT = "ampfx-policy/1"
VAR = f"{ENV_PREFIX}POLICY_FILE"
LIST_FIELDS = tuple(f"{LIST_NAMES[c]}_{a}" for c in LISTS for a in ("add", "remove"))
ADDITIVE = (*LIST_FIELDS, "fp32_modules", "leaf_modules", "tuned")
"""Fields whose entries a file adds to the call's, rather than replacing them."""
def _not_saved(cls: type[Policy]) -> tuple[str, ...]:
    """Bookkeeping fields (``internal`` in their metadata: ampfx fills them), rebuilt when the file is read."""
    return tuple(f.name for f in cls.option_fields() if f.metadata.get("internal"))


def _defaults(cls: type[Policy]) -> dict[str, Any]:
    return {f.name: f.default for f in cls.option_fields() if f.default is not dataclasses.MISSING}


def _portable(value: Any, where: str) -> Any:
    """A value as JSON holds it: strings and numbers as they are, a class by its importable
    qualified name; anything else is an error naming ``where``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, type):
        name = ops.qualified_name(value)
        if "<locals>" in name or policy_object(name) is not value:
            raise PolicyError(f"cannot save {where}: the class {name} cannot be imported by that name (defined "
                              "inside a function?); define it at module level, or name it by a string")
        return name
    if isinstance(value, (tuple, list)):
        return [_portable(v, where) for v in value]
    raise PolicyError(f"cannot save {where}={value!r}: a policy file holds names and numbers only (a function "
                      "such as a predicate or module_filter_fn is not saved); give names, or keep this in code")


def policy_object(name: str) -> Any:
    """The object an importable qualified ``name`` denotes, else ``None``."""
    return import_object(name) if "." in name else None


def _list_names(policy: Policy, fname: str) -> list[str]:
    """A list edit's canonical names, each checked to resolve to itself when read back."""
    names = []
    for name in getattr(policy, fname):
        try:
            back, _ = resolve_op(name, where=fname)
        except PolicyError:
            back = None
        if back != name:
            raise PolicyError(f"cannot save {fname}: {name!r} cannot be found by that name when the file is read "
                              "(a function or module type defined inside a function?); define it at module level")
        names.append(name)
    return names


def as_json(policy: Policy) -> dict[str, Any]:
    """The file's content: the format, the dtype, and each field that differs from its default."""
    if policy.module_filter_fn is not None:
        _portable(policy.module_filter_fn, "module_filter_fn")
    defaults = _defaults(type(policy))
    out: dict[str, Any] = {"format": FORMAT, "dtype": dtype_name(policy.dtype)}
    for f in policy.option_fields():
        value = getattr(policy, f.name)
        if f.name in ("dtype", "module_filter_fn", *_not_saved(type(policy))) or value == defaults.get(f.name):
            continue
        if f.name in LIST_FIELDS:
            out[f.name] = _list_names(policy, f.name)
        elif f.name == "tuned":
            out[f.name] = {key: reason for key, reason in value}
        else:
            out[f.name] = _portable(str(value) if isinstance(value, os.PathLike) else value, f.name)
    return out


def save(policy: Policy, path: str | os.PathLike) -> Path:
    """Write ``policy`` to ``path`` as JSON (see :func:`as_json`); returns the path."""
    path = Path(path)
    text = json.dumps(as_json(policy), indent=2)
    try:
        path.write_text(text + "\n", encoding="utf-8")
    except OSError as e:
        raise PolicyError(f"cannot write the policy file {str(path)!r}: {e.strerror or e}") from e
    return path


def _read(path: str | os.PathLike, where: str, cls: type[Policy]) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise PolicyError(f"{where}: cannot read the policy file {str(path)!r}: {e.strerror or e}") from e
    except json.JSONDecodeError as e:
        raise PolicyError(f"{where}: {str(path)!r} is not a policy file (invalid JSON: {e})") from e
    return _fields(data, path, where, cls)


def _fields(data: Any, path: str | os.PathLike, where: str, cls: type[Policy]) -> dict[str, Any]:
    """The fields of a file's content ``data``, each checked to be a Policy field (``path`` names it)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise PolicyError(f"{where}: {str(path)!r} is not an ampfx policy file (format {found!r}, expected "
                          f"{FORMAT!r}); write one with Policy.save(path)")
    known = [f.name for f in cls.option_fields() if f.name not in (*_not_saved(cls), "module_filter_fn")]
    for key in data:
        if key != "format" and key not in known:
            raise PolicyError(f"{where}: {str(path)!r} sets {key!r}, which is not a Policy field."
                              f"{did_you_mean(key, known)}")
    return {k: v for k, v in data.items() if k != "format"}


def from_json(data: Any, cls: type[Policy], *, where: str = "Policy.from_json") -> Policy:
    """The :class:`~ampfx.policy.Policy` (``cls``) of :func:`as_json`'s content (what a checkpoint keeps of a
    policy); a bad value is a :class:`PolicyError` naming ``where``.

    >>> import ampfx
    >>> ampfx.Policy.from_json(as_json(ampfx.Policy("fp16", fp32_modules=("head",)))).fp32_modules
    ('head',)
    """
    return _policy(_fields(data, "(given as data)", where, cls), "(given as data)", where, cls)


def _leaf(value: Any) -> Any:
    """A saved leaf module entry: an importable class name is the class again, else a module name."""
    obj = policy_object(value) if isinstance(value, str) else None
    return obj if isinstance(obj, type) else value


def load(path: str | os.PathLike, cls: type[Policy], *, where: str = "Policy.from_file") -> Policy:
    """The :class:`~ampfx.policy.Policy` (``cls``) saved at ``path``; a bad file or value is a
    :class:`PolicyError` naming both."""
    return _policy(_read(path, where, cls), path, where, cls)


def _policy(saved: dict[str, Any], path: str | os.PathLike, where: str, cls: type[Policy]) -> Policy:
    """The :class:`Policy` of a file's fields (as :func:`_read` returns them)."""
    fields = dict(saved)
    for name in ("leaf_modules", *LIST_FIELDS, "fp32_modules"):
        if isinstance(fields.get(name), list):
            fields[name] = tuple(_leaf(v) for v in fields[name]) if name == "leaf_modules" else tuple(fields[name])
    try:
        return cls(**fields)
    except (PolicyError, TypeError) as e:
        raise PolicyError(f"{where}: the policy file {str(path)!r}: {e}") from None


def merge(base: Policy, path: str, *, dtype_given: bool) -> Policy:
    """``base`` (the ``convert()`` call's policy) with the file at ``path`` merged in, as the module
    docstring says; list edits from the file are recorded as coming from ``AMPFX_POLICY_FILE``."""
    where = f"{VAR}={path!r}"
    saved = _read(path, where, type(base))
    loaded = _policy(saved, path, where, type(base))
    if loaded.dtype != base.dtype and dtype_given:
        saved_for = dtype_name(loaded.dtype)
        raise PolicyError(f"{where} was saved for {saved_for}, but convert() was given {dtype_name(base.dtype)}: give "
                          f"{saved_for} (on the command line: --dtype {saved_for}), or leave convert()'s dtype out to "
                          "use the file's")
    defaults = _defaults(type(base))
    changes: dict[str, Any] = {"dtype": loaded.dtype}
    origins = dict(base.origins)
    for name in saved:
        if name == "dtype":
            continue
        mine, theirs = getattr(base, name), getattr(loaded, name)
        if name in ADDITIVE:
            changes[name] = tuple(dict.fromkeys((*mine, *theirs))) if name != "tuned" else (*mine, *theirs)
            if name in LIST_FIELDS:
                origins.update({(name, n): Rule.env(VAR) for n in theirs if n not in mine})
        elif mine == defaults.get(name) or mine == theirs:
            changes[name] = theirs
        else:
            raise PolicyError(f"{where} sets {name}={theirs!r}, but convert() was given {name}={mine!r}: set it in "
                              "one place")
    return dataclasses.replace(base, origins=tuple(origins.items()), user_ops=base.user_ops, **changes)

