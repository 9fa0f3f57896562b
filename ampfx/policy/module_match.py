"""Which modules ``fp32_modules`` keeps float32: names, globs, classes and predicates.

An entry of ``Policy.fp32_modules`` is one of:

- a **module name** (``"head"``, ``"encoder.layers.0"``): that module and everything under it;
- a **glob** over module names, a string with ``*``, ``?`` or ``[...]`` (``"head.*"``,
  ``"encoder.layers.*.attn"``): ``*`` and ``?`` match within one name segment (no dot), ``**``
  matches any number of segments; a module whose name matches, and everything under it;
- a **module class** (``nn.LayerNorm``, or its name as a string: ``"LayerNorm"`` for a
  ``torch.nn`` class, ``"mypkg.blocks.Attn"`` for an importable one): every instance,
  subclasses included, and everything under each;
- a **predicate**, any other callable ``(module, fqn) -> bool``: the modules it returns
  ``True`` for, and everything under each.

A string is read in that order against the model: a module path of the model is a name
(even where a class has the same name: a submodule called ``LayerNorm`` is that submodule);
else a string with glob characters is a glob; else a class name; else it is an error.

:func:`resolve` turns the entries into the module paths they keep float32 in this model,
each with the words the report uses, once per :func:`ampfx.convert`; an entry that keeps
nothing, a predicate that raises or answers something other than a bool, is an error there:
a rule that silently matches nothing is a rule the user believes holds.

>>> import torch.nn as nn
>>> net = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2), nn.Sequential(nn.Linear(2, 2)))
>>> resolve(net, ("LayerNorm", "2.*"))
(('1', 'an instance of torch.nn.LayerNorm named in fp32_modules'), ('2.0', "matched by '2.*' in fp32_modules"))
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch.nn as nn
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from .. import ops
from ..errors import PolicyError
from .names import did_you_mean, glob_regex, import_object, is_glob



def as_class(text: str) -> type | None:
    """The module class a string names: a ``torch.nn`` class name, or an importable qualified name."""
    short = text[len("nn."):] if text.startswith("nn.") else text
    obj = getattr(nn, short, None) if "." not in short else import_object(text)
    return obj if isinstance(obj, type) and issubclass(obj, nn.Module) else None


def describe(entry: Any) -> str:
    """How the report names an entry: a class by its qualified name, a predicate by its name."""
    if isinstance(entry, type):
        return f"torch.nn.{entry.__name__}" if getattr(nn, entry.__name__, None) is entry else ops.qualified_name(entry)
    if isinstance(entry, str):
        return entry
    return getattr(entry, "__qualname__", None) or repr(entry)


def resolve(model: nn.Module, entries: Iterable[Any], field: str = "fp32_modules") -> tuple[tuple[str, str], ...]:
    """``(module path, why)`` for each module ``entries`` keep float32 in ``model``, in entry order
    (a path kept by two entries is listed once, for the first); errors as the module docstring says.
    ``field`` names the policy field the entries come from: ``keep_modules`` also takes ``"auto"``
    (:func:`auto_kept`), which may match nothing.

    A module registered under several names (``self.alias = self.fc``) is kept under every one:
    the converted tree copies each name's module apart, and a graph records the name ``forward``
    called it by, so a kept module must be found under any of them.
    """
    names_of: dict[int, list[str]] = {}
    for n, m in model.named_modules(remove_duplicate=False):
        if n:
            names_of.setdefault(id(m), []).append(n)
    all_names = [n for names in names_of.values() for n in names]
    found: dict[str, str] = {}
    for entry in entries:
        hits = (auto_kept(model) if field == "keep_modules" and entry == "auto" and "auto" not in all_names
                else _hits(model, entry, all_names, field))
        for path, why in hits:
            for name in names_of[id(model.get_submodule(path))]:
                found.setdefault(name, why if name == path else f"{why} (the same module as {path!r})")
    return tuple(found.items())


def _hits(model: nn.Module, entry: Any, all_names: list[str], field: str) -> list[tuple[str, str]]:
    """The module paths one entry keeps float32 (under the name that matched), with the reason's words."""
    owner, var = type(model).__name__, f"AMPFX_{field.upper()}"
    if isinstance(entry, str) and entry in all_names:
        return [(entry, f"named in {field}")]
    if isinstance(entry, str) and is_glob(entry):
        rx = glob_regex(entry, field)
        hits = [n for n in all_names if rx.fullmatch(n)]
        if not hits:
            raise PolicyError(f"{field} / {var}: the glob {entry!r} matches no module of {owner} "
                              f"('*' stays within one name segment; '**' crosses dots).{_close(entry, all_names)}")
        return [(p, f"matched by {entry!r} in {field}") for p in hits]
    if isinstance(entry, str):
        cls = as_class(entry)
        if cls is None:
            raise PolicyError(f"{field} / {var} names {entry!r}, which is neither a module of {owner} "
                              "nor a module class (a torch.nn class name such as 'LayerNorm', or an importable "
                              f"'pkg.module.Class').{_close(entry, _spellings(model, all_names))}")
        entry = cls
    if isinstance(entry, type):
        hits = [n for n, m in model.named_modules() if n and isinstance(m, entry)]
        if not hits:
            tip = "; to run the whole model in float32, do not convert it" if field == "fp32_modules" else ""
            whole = (f"only {owner} itself (the whole model) is an instance of it: {field} names submodules{tip}"
                     if isinstance(model, entry) else f"no module of {owner} is an instance of it")
            raise PolicyError(f"{field} / {var} names the class {describe(entry)}, and {whole}")
        return [(p, f"an instance of {describe(entry)} named in {field}") for p in hits]
    return _predicate_hits(model, entry, owner, field)


def _predicate_hits(model: nn.Module, fn: Callable[[nn.Module, str], Any], owner: str,
                    field: str) -> list[tuple[str, str]]:
    hits = []
    for name, module in model.named_modules(remove_duplicate=False):  # a module under each of its names
        if not name:
            continue
        try:
            answer = fn(module, name)
        except Exception as e:  # noqa: BLE001 - the user's predicate: named, with its error
            raise PolicyError(f"{field}: the predicate {describe(fn)} raised {type(e).__name__}: {e} on module "
                              f"{name!r} ({type(module).__name__}); it is called as fn(module, fqn) on every module")
        if not isinstance(answer, bool):
            raise PolicyError(f"{field}: the predicate {describe(fn)} returned {answer!r} for module {name!r}: "
                              "return True to keep the module, False otherwise")
        if answer:
            hits.append((name, f"kept by the predicate {describe(fn)} in {field}"))
    if not hits:
        raise PolicyError(f"{field}: the predicate {describe(fn)} returned False for every module of {owner}")
    return hits


WRAPPERS = {
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.ActivationWrapper": "activation-checkpoint wrapper",
}
"""Wrapper classes (by qualified name, so nothing is imported) whose Python must run: kept, and the
module each wraps converted inside (``checkpoint_wrapper`` recomputes its module's forward)."""

WRAP_FIRST = {
    "torch.nn.parallel.distributed.DistributedDataParallel": "DistributedDataParallel",
    "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel": "FSDP (FullyShardedDataParallel)",
    "torch.distributed.fsdp.FSDPModule": "FSDP2 (fully_shard)",
    "torch._dynamo.eval_frame.OptimizedModule": "torch.compile",
}
"""Wrappers ampfx cannot convert inside (:func:`wrapped_first`): they hold the module's parameters
as shards, or run a forward bound when they were made; the model must be converted first."""

_HOOKS = ("_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
"""Hooks that make ``"auto"`` keep a module: they fire only when its forward is called. So do forward
pre-hooks other than :data:`TRACED_PRE_HOOKS`."""

TRACED_PRE_HOOKS = (BasePruningMethod, WeightNorm, SpectralNorm)
"""Forward pre-hooks that recompute a weight from the module's own tensors (pruning, the old
``weight_norm`` and ``spectral_norm``): tracing runs them into the graph, which recomputes the weight
on every call, so they do not make ``"auto"`` keep their module. Any other pre-hook (a user's own,
with effects a graph would run once at conversion) does."""


def _hooked(m: nn.Module) -> bool:
    """Does ``m`` carry hooks that fire only when its forward is called (see :data:`_HOOKS`)?"""
    return (any(getattr(m, h, None) for h in _HOOKS)
            or any(not isinstance(h, TRACED_PRE_HOOKS) for h in m._forward_pre_hooks.values()))


def class_names(module: nn.Module) -> set[str]:
    """The qualified names of ``module``'s class and its bases (``pkg.mod.Cls``)."""
    return {f"{c.__module__}.{c.__qualname__}" for c in type(module).__mro__}


HOOKED = "it carries hooks, which fire only when its forward is called"
"""Why ``keep_modules="auto"`` keeps a hooked module (the capture ladder reads it: such a module stays a boundary)."""


def auto_kept(model: nn.Module) -> list[tuple[str, str]]:
    """What ``keep_modules="auto"`` keeps in ``model``: every module carrying forward (not pre-) or
    backward hooks, every wrapper of :data:`WRAPPERS`, and **repeated blocks**: the children of an
    ``nn.ModuleList`` / ``nn.ModuleDict`` of which two or more share a class and have parameters
    and submodules of their own (transformer layers; not a list of ``nn.Linear`` heads).
    (``nn.Sequential`` stages are not: a CNN stage's blocks are cheaper traced through; name
    them to keep them.)

    >>> import torch.nn as nn
    >>> blocks = nn.ModuleList(nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(2))
    >>> net = nn.ModuleDict({"blocks": blocks, "heads": nn.ModuleList(nn.Linear(2, 2) for _ in range(2))})
    >>> [path for path, _ in auto_kept(net)]
    ['blocks.0', 'blocks.1']
    """
    found: dict[str, str] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if not name:
            continue
        wrapper = wrapper_of(m)
        if wrapper is not None:
            found.setdefault(name, f"keep_modules='auto': an {wrapper} ({type(m).__name__}) runs its own Python")
        elif _hooked(m):
            found.setdefault(name, f"keep_modules='auto': {HOOKED}")
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            kids = [(n, c) for n, c in m.named_children()
                    if any(True for _ in c.children()) and any(True for _ in c.parameters())]
            for n, c in kids:
                same = sum(type(o) is type(c) for _, o in kids)
                if same >= 2:
                    found.setdefault(f"{name}.{n}", f"keep_modules='auto': a repeated block, one of {same} "
                                                    f"{type(c).__name__} in {type(m).__name__} {name!r}")
    return list(found.items())


def wrapper_of(module: nn.Module) -> str | None:
    """What kind of :data:`WRAPPERS` wrapper ``module`` is (``"activation-checkpoint wrapper"``), else ``None``."""
    names = class_names(module)
    return next((w for c, w in WRAPPERS.items() if c in names), None)


def keeps_python(module: nn.Module) -> str | None:
    """Why the kept ``module`` runs its own Python rather than a converted graph of itself, else ``None``:
    a wrapper (its wrapped module is converted), or forward pre-hooks (they may set attributes a graph
    would hold fixed; its children are converted)."""
    wrapper = wrapper_of(module)
    if wrapper is not None:
        return f"an {wrapper} ({type(module).__name__}): it runs its own Python, and the module it wraps is converted"
    if module._forward_pre_hooks:
        return ("its forward pre-hooks may set attributes its own graph would hold fixed: it keeps its Python, "
                "and its children are converted")
    return None


def wrapped_first(model: nn.Module) -> tuple[str, str] | None:
    """``(path, wrapper)`` of the first module of ``model`` (the root included) already wrapped by one of
    :data:`WRAP_FIRST`, or holding a sharded (DTensor) parameter; ``None`` if none is."""
    for name, m in model.named_modules():
        wrapper = next((w for c, w in WRAP_FIRST.items() if c in class_names(m)), None)
        if wrapper is None and any(type(p).__name__ == "DTensor" for p in m.parameters(recurse=False)):
            wrapper = "FSDP2 (fully_shard: its parameters are DTensor shards)"
        if wrapper is not None:
            return name, wrapper
    return None


def filter_rejected(model: nn.Module, fn: Callable[[nn.Module, str], Any]) -> frozenset[str]:
    """The module paths ``module_filter_fn`` rejects (returns a false value for) in ``model``, the
    root (``""``) included; a module rejected under one of its names is rejected under all. A
    filter that raises is a :class:`PolicyError` naming the module.

    >>> net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU()))
    >>> sorted(filter_rejected(net, lambda m, fqn: fqn != "1"))
    ['1']
    """
    named = list(model.named_modules(remove_duplicate=False))
    rejected_ids = set()
    for name, module in named:
        try:
            keep = fn(module, name)
        except Exception as e:  # noqa: BLE001 - the user's filter: named, with its error
            raise PolicyError(f"module_filter_fn {describe(fn)} raised {type(e).__name__}: {e} on module "
                              f"{name or '<root>'!r} ({type(module).__name__}); it is called as fn(module, fqn) "
                              "on every module, the root ('') included") from e
        if not keep:
            rejected_ids.add(id(module))
    return frozenset(name for name, module in named if id(module) in rejected_ids)


def _spellings(model: nn.Module, names: list[str]) -> dict[str, str]:
    """What a misspelt entry is compared with, and what is suggested for it: the model's module paths, and the
    classes its submodules are instances of (their bases too: ``LayerNorm`` keeps a subclass of it), written as an
    entry names them (a ``torch.nn`` class by its name, another by its importable name, which its short name also
    finds). Never a class no module of the model is an instance of: a suggestion must match something here."""
    out = {n: n for n in names}
    classes = (c for n, m in model.named_modules() if n for c in type(m).__mro__
               if issubclass(c, nn.Module) and c is not nn.Module)
    for cls in dict.fromkeys(classes):
        written = cls.__name__ if getattr(nn, cls.__name__, None) is cls else ops.qualified_name(cls)
        if "<" in written:  # defined inside a function: no name imports it
            continue
        out.setdefault(written, written)
        out.setdefault(cls.__name__, written)
    return out


def _close(word: str, options: list[str] | dict[str, str]) -> str:
    """The suggestion for ``word`` among ``options`` (a dict: what is compared -> what is suggested)."""
    return did_you_mean(word, options, cutoff=0.5, written=options if isinstance(options, dict) else None)


def entries(value: Any, name: str = "fp32_modules") -> tuple[Any, ...]:
    """``fp32_modules`` (or ``keep_modules``: ``name``) as a tuple of entries (see this module);
    a bad entry is a :class:`PolicyError`.

    >>> entries("head"), entries((nn.LayerNorm, " enc.* "))
    (('head',), (<class 'torch.nn.modules.normalization.LayerNorm'>, 'enc.*'))
    >>> entries("none", "keep_modules")
    ()
    """
    entries = (value,) if isinstance(value, (str, type)) or callable(value) else value
    if name == "keep_modules" and isinstance(entries, Iterable) and not isinstance(entries, (str, bytes)) and \
            [e.strip().lower() for e in entries if isinstance(e, str)] == ["none"] and len(tuple(entries)) == 1:
        return ()  # keep_modules="none", as AMPFX_KEEP_MODULES=none: no module kept
    if not isinstance(entries, Iterable):
        raise PolicyError(f"{name}={value!r}: give module names, globs, module classes or predicates, e.g. "
                          "('head', 'encoder.layers.*.attn', nn.LayerNorm)")
    out = []
    for entry in entries:
        if isinstance(entry, str):
            if not entry.strip():
                raise PolicyError(f"{name}={value!r}: an empty name names the whole model; name submodules "
                                  "(e.g. 'head')" + ("" if name == "keep_modules" else ", or do not convert the model"))
            out.append(entry.strip())
            if is_glob(entry):
                glob_regex(entry, name)  # a glob that is no pattern is an error now, not when it is resolved
        elif isinstance(entry, type):
            if not issubclass(entry, nn.Module):
                raise PolicyError(f"{name}: {entry.__name__} is a class but not an nn.Module; give module "
                                  "classes (nn.LayerNorm), names, globs or predicates")
            out.append(entry)
        elif isinstance(entry, nn.Module):  # callable, but not a predicate
            raise PolicyError(f"{name}: a module object ({type(entry).__name__}) is not an entry; give its name "
                              f"in the model (as model.named_modules() lists it, e.g. 'head'), a glob, or its class")
        elif callable(entry):
            out.append(entry)
        else:
            raise PolicyError(f"{name}: {entry!r} is neither a module name, a glob, a module class nor a "
                              "predicate (module, fqn) -> bool")
    return tuple(out)
