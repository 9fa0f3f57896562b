"""One real run of the model on its example inputs, and what it shows.

Conversion runs the model's own Python for two facts that fake tensors cannot
give: what each submodule receives (a module that keeps its Python has its
children converted on those inputs) and the values other libraries' leaves see
(DGL's float16 overflow guard). :func:`observe` gets both from one run, on the
private copy of the model, in eval mode without gradients; buffers, training
flags and the random state (CPU and CUDA) are put back afterwards.

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU())
>>> seen = observe(net, ExampleInputs.of((torch.ones(1, 2),)), calls=True)
>>> sorted(seen.calls), seen.calls["1"].args[0].shape
(['0', '1'], torch.Size([1, 3]))
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from ..inputs import ExampleInputs
from ..state import kept_attributes, kept_buffers, kept_rng, modes


@dataclass(frozen=True)
class Observation:
    """``calls``: what each submodule received first (snapshots, by module path); ``seen``: for
    each module watched, what ``watch`` returned on each of its calls (``None`` where it raised)."""

    calls: dict[str, ExampleInputs] = field(default_factory=dict)
    seen: dict[str, list[Any]] = field(default_factory=dict)


def observe(model: nn.Module, inputs: ExampleInputs, *, calls: bool | Callable[[str], bool] = False,
            watch: dict[str, Callable[[nn.Module, tuple, dict], Any]] | None = None) -> Observation:
    """Run ``model`` once on ``inputs`` (see the module docstring). ``calls`` (``True``, or a test
    of the module path) chooses the submodules whose first call is recorded; ``watch`` maps module
    paths to a function of each call's ``(module, args, kwargs)`` whose results are kept in
    ``Observation.seen``."""
    record = calls if callable(calls) else (lambda path: calls)
    first: dict[str, ExampleInputs] = {}
    seen: dict[str, list[Any]] = {path: [] for path in watch or {}}
    hooks = []
    for path, sub in model.named_modules():
        if not path or not (record(path) or path in seen) or isinstance(sub, torch.jit.ScriptModule):
            continue  # a TorchScript module takes no hooks (it is an opaque leaf: nothing inside it is converted)

        def hook(mod: nn.Module, args: tuple, kwargs: dict, path: str = path) -> None:
            if path not in first and record(path):  # a snapshot: the forward may change what it passed (caches)
                first[path] = ExampleInputs(args, kwargs).snapshot()
            if path in seen:
                try:
                    seen[path].append(watch[path](mod, args, kwargs))
                except Exception:  # noqa: BLE001 - nothing seen of this call; the run goes on
                    seen[path].append(None)
        hooks.append(sub.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        # a cache the run fills is emptied again: a capture after it would take its contents for constants
        with kept_rng(*model.parameters(), *inputs.tensors()), kept_buffers(model), \
                kept_attributes(model, bookkeeping=False), modes(model, training=False), torch.no_grad():
            inputs.call(model)
    finally:
        for h in hooks:
            h.remove()
    return Observation({p: ExampleInputs.from_call(model.get_submodule(p), c.args, c.kwargs) for p, c in first.items()},
                       seen)
