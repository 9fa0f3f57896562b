"""Other libraries' modules: per-library plugins, found by the module's
qualified type name so that ampfx imports none of those libraries.

An integration is a table plus a runner, and it receives facts: it never sees
a graph or a pass context, and imports nothing from :mod:`ampfx.passes`. Each
one (a module named in :data:`LIBRARIES`, data and functions only; importing
it imports no library) provides:

- ``TABLE``: entries with ``name``, ``category``, ``reason`` and
  ``qualnames``, registered in the op lists (:func:`ampfx.ops.register_library`)
  when ampfx's first public name is used (``ampfx.convert``, ``ampfx.Policy``, ...), so policies
  and env variables can name them (``AMPFX_DENYLIST_ADD=dgl.GATConv``);
- ``refine(decision, module, facts)``: the library's decision for a leaf the
  lists decided (device rules, variants, overflow guards), given
  :class:`LeafFacts`;
- ``needs_run(dtype)``, ``observe_call(module, args, kwargs)`` and
  ``observation(calls, example_inputs)``: what the one observation run of the
  model (:mod:`ampfx.capture.observe`, with :func:`watched`'s hooks) makes of a leaf on
  the example inputs (``facts.observed``, through :func:`leaf_facts`);
- ``runner(module)`` / ``RUNNERS``: the function the rewritten graph calls to
  run a leaf in low precision, ``eager_leaf(module, dtype)``: the module that
  replaces a leaf called from eager code, ``RUNS_ON_FAKE_TENSORS``.

>>> import torch
>>> library_of(torch.nn.Linear(2, 2)) is None
True
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from .. import ops
from ..policy import decide
from ..inputs import ExampleInputs
from ..policy import Policy, Resolved
from ..report import Report
from ..report.records import Part, dtype_name
from . import dgl

LIBRARIES: dict[str, Any] = {
    "dgl": dgl,  # DGL's graph convolutions and readouts (dgl.nn)
}
"""Top-level package of a module's class -> the ampfx module that integrates it."""

for _lib in LIBRARIES.values():
    ops.register_library((r.name, r.category, r.reason, r.qualnames) for r in _lib.TABLE)


@dataclass(frozen=True)
class LeafFacts:
    """What an integration is told about one leaf: its module path in the user's model, the
    device it runs on, the policy's low dtype, and ``observed``: what the library recorded of
    it on the example inputs (:func:`leaf_facts`; ``None`` without example inputs)."""

    path: str
    device: str
    dtype: torch.dtype
    observed: Any = None


def library_of(module: Any) -> Any | None:
    """The integration module for ``module``'s library (the top-level package of its class or a
    base class), or ``None``."""
    for klass in type(module).__mro__:
        top = getattr(klass, "__module__", "").split(".")[0]
        if top in LIBRARIES:
            return LIBRARIES[top]
    return None


def refine(decision: Any, module: Any, facts: LeafFacts) -> Any:
    """The library's decision for the leaf ``module`` (see the module docstring); ``decision`` unchanged
    for modules of no library."""
    lib = library_of(module)
    return decision if lib is None else lib.refine(decision, module, facts)


def watched(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, Callable[..., Any]]:
    """Module path -> the function that observes one call of that library leaf, for the leaves whose
    library reads values seen on the example inputs under ``dtype`` (``None``: any); see
    :func:`ampfx.capture.observe.observe`."""
    return {path: lib.observe_call for path, m in model.named_modules()
            if path and (lib := library_of(m)) is not None and lib.needs_run(dtype)}


def leaf_facts(model: nn.Module, inputs: Any, seen: Mapping[str, list[Any]], prefix: str = "") -> dict[str, Any]:
    """Module path (relative to ``model``) -> what its library makes of each library leaf: the
    observations of its calls in ``seen`` (keyed by path in the user's model, ``prefix`` + path)
    and the example ``inputs``; ``{}`` without inputs."""
    if inputs is None:
        return {}
    return {path: facts_of(m, seen.get(prefix + path, []), inputs) for path, m in model.named_modules()
            if path and library_of(m) is not None}


def facts_of(module: nn.Module, seen: list[Any], inputs: Any) -> Any:
    """What ``module``'s library makes of it: the observations of its calls (``seen``, from
    :func:`watched`'s functions) and example ``inputs`` (those of the model, or the module's own);
    ``None`` for a module of no library."""
    lib, inputs = library_of(module), ExampleInputs.of(inputs)
    if lib is None:
        return None
    return lib.observation(seen, (inputs.args, dict(inputs.kwargs)) if inputs is not None else None)


def convert_eager_leaf(root: nn.Module, path: str, policy: Policy, observed: Any, prefix: str = "",
                       device: str = "cpu", resolved: Resolved = Resolved()) -> tuple[nn.Module, Report] | None:
    """For a library module called from eager code (its parent could not be traced): ``(replacement,
    Report)`` running it as the library's table says, or ``None`` for modules of no library.

    ``path`` is the module's path under ``root``, which sits at ``prefix`` in the user's model;
    ``observed`` is what its library made of its calls on the example inputs (:func:`facts_of`;
    ``None`` without example inputs). The decision is the traced leaf's: the module rules and
    the lists (:func:`ampfx.policy.decide.decide_leaf`, parents included), then the library's
    :func:`refine`. A low result is the library's ``eager_leaf``, a float32 one the module unchanged.
    """
    module = root.get_submodule(path)
    lib = library_of(module)
    if lib is None:
        return None
    full = prefix + path
    verdict = decide.decide_leaf(policy, root, path, prefix, resolved=resolved)
    record = verdict.decision(node=full.replace(".", "_") or "leaf", op=decide.leaf_name(policy, module),
                              target=full, module=full, kind="call_module", out=torch.float32)
    if record.rule not in decide.FINAL_RULES:
        record = lib.refine(record, module, LeafFacts(full, device, policy.dtype, observed))
    dtype = record.dtype if record.dtype is not None else torch.float32
    where = "called from eager code (its parent could not be traced)"
    if dtype != torch.float32:
        how = f"runs by {lib.runner(module).__name__}, float outputs back in its inputs' dtype"
        replacement = lib.eager_leaf(module, dtype)
    else:
        how, replacement = "runs as written", module
    record = dataclasses.replace(record, dtype=dtype, reason=f"{record.reason}; {where}: {how}")
    return replacement, Report(dtype=policy.dtype, records=(record,), parts=(
        Part(full, f"a {lib.LIBRARY} module called from eager code: {dtype_name(dtype)} leaf"),))


def runs_on_fake_tensors(module: Any) -> bool:
    """Can ``module`` run on meta / fake tensors for shape propagation? (DGL's kernels cannot.)"""
    lib = library_of(module)
    return lib is None or lib.RUNS_ON_FAKE_TENSORS


def runners() -> tuple[Callable[..., Any], ...]:
    """Every library's low-precision leaf runner (their modules import no library).

    >>> [f.__name__ for f in runners()]
    ['call_dgl_low']
    """
    return tuple(f for lib in LIBRARIES.values() for f in lib.RUNNERS)


def runner(module: Any) -> Callable[..., Any] | None:
    """``runner(module, dtype, *args, **kwargs)`` for a low-precision leaf of a library, or ``None``."""
    lib = library_of(module)
    return None if lib is None else lib.runner(module)
