"""Other libraries' modules: per-library rules and runners, found by the
module's qualified type name so that ampfx imports none of those libraries.

The core passes ask this package two questions about a leaf module:

- :func:`refine`: given the decision the op lists produced for a leaf
  (``classify``), return the library's decision (device rules, variants,
  overflow guards), or the decision unchanged;
- :func:`runner`: the function the rewritten graph calls to run a leaf in
  low precision (``casts``), or ``None`` for ampfx's generic
  :func:`ampfx.runtime.call_module_low`.

A library is recognised by the top-level package of the module's class
(``type(m).__module__``). Each integration's ``TABLE`` is registered in the
op lists (:func:`ampfx.ops.register_library`) when ampfx is imported, so
policies and env variables can name its entries (``dgl.GATConv``).

>>> import torch
>>> library_of(torch.nn.Linear(2, 2)) is None
True
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from .. import ops

LIBRARIES: dict[str, str] = {
    "dgl": "ampfx.integrations.dgl",  # DGL's graph convolutions and readouts (dgl.nn)
}
"""Top-level package of a module's class -> the ampfx module that integrates it."""

for _path in LIBRARIES.values():  # their tables are data: importing them imports no library
    ops.register_library((r.name, r.category, r.reason, r.qualnames) for r in importlib.import_module(_path).TABLE)


def library_of(module: Any) -> Any | None:
    """The integration module for ``module``'s library, or ``None`` (imported lazily)."""
    for klass in type(module).__mro__:
        top = getattr(klass, "__module__", "").split(".")[0]
        if top in LIBRARIES:
            return importlib.import_module(LIBRARIES[top])
    return None


def refine(decision: Any, module: Any, node: Any, gm: Any, ctx: Any) -> Any:
    """The library's decision for the leaf ``module`` at ``node`` (see the module docstring)."""
    lib = library_of(module)
    return decision if lib is None else lib.refine(decision, module, node, gm, ctx)


def convert_eager_leaf(module: Any, policy: Any, example_inputs: Any, path: str, device: str) -> Any:
    """For a library module called from eager code (its parent could not be traced): ``(replacement,
    Report)`` running it as the library's table says, or ``None`` for modules of no library."""
    lib = library_of(module)
    return None if lib is None else lib.convert_eager_leaf(module, policy, example_inputs, path, device)


def runs_on_fake_tensors(module: Any) -> bool:
    """Can ``module`` run on meta / fake tensors for shape propagation? (DGL's kernels cannot.)"""
    lib = library_of(module)
    return lib is None or lib.RUNS_ON_FAKE_TENSORS


def runners() -> tuple[Callable[..., Any], ...]:
    """Every library's low-precision leaf runner (their modules import no library).

    >>> [f.__name__ for f in runners()]
    ['call_dgl_low']
    """
    return tuple(f for path in LIBRARIES.values() for f in importlib.import_module(path).RUNNERS)


def runner(module: Any) -> Callable[..., Any] | None:
    """``runner(module, dtype, *args, **kwargs)`` for a low-precision leaf of a library, or ``None``."""
    lib = library_of(module)
    return None if lib is None else lib.runner(module)
