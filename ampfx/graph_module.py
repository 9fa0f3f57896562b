"""The converted module: an ``fx.GraphModule`` that keeps the model's whole module tree.

:class:`AmpGraphModule` keeps every parameter, buffer and submodule of the
model it was built from (so ``state_dict()`` keys equal the model's), survives
``copy.deepcopy`` and pickling with its report, and holds one graph per
training mode when its graph depends on the mode: ``.train()`` / ``.eval()``
switch to the other mode's own conversion (:meth:`AmpGraphModule.set_mode_graph`).
It keeps the public attributes of the module it was built from (``stride``,
``in_features``, ``config``...) and reaches that module's methods, so code
around it that reads them still works.

>>> import torch, torch.fx as fx
>>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
>>> g = graph_module(net, fx.symbolic_trace(net).graph)
>>> sorted(g.state_dict()) == sorted(net.state_dict())
True
>>> conv = torch.nn.Conv1d(2, 2, 3, stride=2)
>>> graph_module(conv, fx.symbolic_trace(conv).graph).stride
(2,)
"""
from __future__ import annotations

import copy
import inspect
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn as nn

from .errors import TrainingModeError
from .state import HOOK_DICTS

_MODULE_STATE = frozenset(nn.Module().__dict__) | {"training"}
"""What every ``nn.Module`` holds in its ``__dict__`` (parameters, hooks...): not a public attribute."""


def _keep_tree(gm: fx.GraphModule, root: nn.Module, training: bool) -> None:
    """Put ``root``'s whole module tree (unused parameters and buffers too) on ``gm``."""
    for name, child in root._modules.items():
        gm._modules[name] = child
    for name, p in root._parameters.items():
        gm._parameters[name] = p
    for name, b in root._buffers.items():
        gm._buffers[name] = b
    gm._non_persistent_buffers_set = set(root._non_persistent_buffers_set)
    gm.training = training


class AmpGraphModule(fx.GraphModule):
    """A ``GraphModule`` that keeps the *whole* module tree of the model it was
    traced from, so ``state_dict()`` keys equal the model's, also after
    ``copy.deepcopy`` and pickling (plain ``GraphModule`` keeps only what the
    graph references), and keeps its ``ampfx_report``."""

    def __deepcopy__(self, memo: dict) -> "AmpGraphModule":
        res = super().__deepcopy__(memo)
        tree = copy.deepcopy({"_modules": self._modules, "_parameters": self._parameters,
                              "_buffers": self._buffers}, memo)
        holder = nn.Module()
        holder._modules, holder._parameters, holder._buffers = tree["_modules"], tree["_parameters"], tree["_buffers"]
        holder._non_persistent_buffers_set = set(self._non_persistent_buffers_set)
        _keep_tree(res, holder, self.training)
        for name in HOOK_DICTS:  # GraphModule's deepcopy keeps only state_dict hooks
            getattr(res, name).update(copy.deepcopy(getattr(self, name), memo))
        _keep_attributes(res, copy.deepcopy(_kept_attributes(self), memo))
        if "ampfx_report" in self.__dict__:
            res.ampfx_report = self.ampfx_report  # frozen: safe to share
        if "_ampfx_guard" in self.__dict__:
            res.set_guard(self.__dict__["_ampfx_guard"])  # immutable: safe to share
        alt = self.__dict__.get("_ampfx_alt")
        if alt is not None:
            res.set_mode_graph(alt[0], copy.deepcopy(alt[1], memo))
        return res

    def __reduce__(self):  # noqa: ANN204
        fn, (body, *rest) = super().__reduce__()
        body.pop("_ampfx_pairs", None)  # rebuilt on first use
        if "<locals>" in getattr(body.get("_ampfx_source"), "__qualname__", ""):
            body.pop("_ampfx_source")  # a class pickle cannot find: its methods are not reached after loading
        args = (body, *rest)
        holder = nn.Module()
        holder._modules, holder._parameters, holder._buffers = self._modules, self._parameters, self._buffers
        holder._non_persistent_buffers_set = set(self._non_persistent_buffers_set)
        kept = {k: v for k, v in _kept_attributes(self).items() if k in body or k == "_ampfx_attrs"}
        return (_rebuild, (fn, args, holder, self.training, self.__dict__.get("ampfx_report"),
                           self.__dict__.get("_ampfx_alt"), getattr(self.graph._codegen, "pytree_info", None), kept,
                           self.__dict__.get("_ampfx_guard")))

    def set_mode_graph(self, training: bool, other: nn.Module) -> None:
        """Run ``other`` whenever this module is in mode ``training``: the module's own conversion
        in that mode (a graph module, or the model's Python with its children converted), over
        the same parameters and buffers. Before each such call the training flags, parameters
        and buffers of ``other``'s tree are set from this module's tree, path by path, so what
        ``.train()`` / ``.eval()`` / ``.to()`` did here holds there."""
        self.__dict__["_ampfx_alt"] = (training, other)
        self.__dict__.pop("_ampfx_pairs", None)
        self._install_dispatch()

    def set_guard(self, guard: Any) -> None:
        """Call ``guard(args, kwargs)`` (:mod:`ampfx.guards`) before this module's own graph runs:
        after the follow check and the mode choice, so a call in the other training mode is
        checked by that mode's conversion alone (it may accept what this graph would not)."""
        self.__dict__["_ampfx_guard"] = guard
        self._install_dispatch()

    def set_check(self, check: Any) -> None:
        """Call ``check(self)`` before every call (:mod:`ampfx.follow`: the model's mode and
        replaced tensors); a copy or an unpickled module has none."""
        self.__dict__["_ampfx_check"] = check
        self._install_dispatch()

    def train(self, mode: bool = True) -> "AmpGraphModule":
        """``nn.Module.train``; an explicit switch of this module is the latest word on its mode
        (:meth:`ampfx.follow.Follower.own_mode`)."""
        super().train(mode)
        own_mode = getattr(self.__dict__.get("_ampfx_check"), "own_mode", None)
        if own_mode is not None:
            own_mode()
        return self

    def mode_module(self, training: bool) -> nn.Module:
        """The module that runs when this one is in mode ``training`` (itself, or the other mode's
        conversion, whose ``ampfx_report`` says what it runs)."""
        alt = self.__dict__.get("_ampfx_alt")
        return alt[1] if alt is not None and alt[0] == training else self

    def _mode_target(self) -> nn.Module | None:
        """The other mode's conversion, brought in line with this tree, when this module is in
        that mode; else ``None`` (this graph runs)."""
        alt = self.__dict__.get("_ampfx_alt")
        if alt is None or self.training != alt[0]:
            return None
        for mine, theirs in self._mode_pairs():
            if theirs.training != mine.training:  # nn.Module.__setattr__ costs most of this loop: only on a change
                theirs.training = mine.training
            for own, their in ((mine._parameters, theirs._parameters), (mine._buffers, theirs._buffers)):
                for name, value in own.items():
                    if name in their and their[name] is not value:
                        their[name] = value
        return alt[1]

    def _mode_pairs(self) -> tuple[tuple[nn.Module, nn.Module], ...]:
        pairs = self.__dict__.get("_ampfx_pairs")
        if pairs is None:
            mine = dict(self.named_modules(remove_duplicate=False))
            pairs = tuple((mine[path], theirs) for path, theirs in
                          self.__dict__["_ampfx_alt"][1].named_modules(remove_duplicate=False) if path in mine)
            self.__dict__["_ampfx_pairs"] = pairs
        return pairs

    def recompile(self) -> Any:
        """``GraphModule.recompile`` (pickling calls it too), keeping the mode dispatch."""
        code = super().recompile()
        if {"_ampfx_alt", "_ampfx_check", "_ampfx_guard"} & self.__dict__.keys():
            self._install_dispatch()
        return code

    def _install_dispatch(self) -> None:
        cls = type(self)
        graph_forward = cls.forward
        if getattr(graph_forward, "_ampfx_dispatch", False):
            return

        def forward(self: AmpGraphModule, *args: Any, **kwargs: Any) -> Any:
            check = self.__dict__.get("_ampfx_check")
            if check is not None:
                check(self)
            target = self._mode_target()
            if target is not None:
                return target(*args, **kwargs)
            guard = self.__dict__.get("_ampfx_guard")
            if guard is not None:
                guard(args, kwargs)
            return graph_forward(self, *args, **kwargs)

        forward.__signature__ = inspect.signature(graph_forward)
        forward._ampfx_dispatch = True
        cls.forward = forward

    def __getattr__(self, name: str) -> Any:
        """``nn.Module``'s lookup, then the class of the module this was built from: its methods
        and properties bound to this module (code around it may call ``self.conv._conv_forward``)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            source = self.__dict__.get("_ampfx_source")
            attr = inspect.getattr_static(source, name, _MISSING) if source is not None else _MISSING
            if attr is _MISSING or name.startswith("__"):
                raise
            return attr.__get__(self, type(self)) if hasattr(type(attr), "__get__") else attr


_MISSING = object()


class ModeUnavailable(nn.Module):
    """Stands in for the other training mode's conversion when it failed: calling the converted
    module in that mode raises :class:`~ampfx.errors.TrainingModeError`, saying why and what to do."""

    def __init__(self, training: bool, why: str) -> None:
        super().__init__()
        self.mode, self.why = ("train" if training else "eval"), why

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        other = "train" if self.mode == "eval" else "eval"
        raise TrainingModeError(
            f"this converted module has no {self.mode}-mode conversion: converting the model in {self.mode} "
            f"mode failed ({self.why}). Convert the model in {self.mode} mode for that "
            f"(ampfx.convert(model.{self.mode}(), ...)), or use it in {other} mode only.")


def _rebuild(fn, args, holder: nn.Module, training: bool, report, alt=None,  # noqa: ANN001
             pytree_info=None, kept=None, guard=None) -> AmpGraphModule:
    plain = fn(*args)
    if pytree_info is not None:
        _restore_pytree(plain, pytree_info)
    gm = AmpGraphModule(plain, plain.graph, class_name=type(plain).__name__)
    _keep_tree(gm, holder, training)
    _keep_attributes(gm, kept or {})
    if report is not None:
        gm.ampfx_report = report
    if alt is not None:
        gm.set_mode_graph(*alt)
    if guard is not None:
        gm.set_guard(guard)
    return gm


def _restore_pytree(gm: fx.GraphModule, info: Any) -> None:
    """Unpickling re-traces the code of an exported graph, which builds its output
    structure (an HF ``ModelOutput``, say) from plain dicts; give it back its
    pytree input/output handling so it returns what it returned before."""
    from torch.fx.graph import _PyTreeCodeGen

    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    leaves, _ = torch.utils._pytree.tree_flatten(out.args[0])
    if len(leaves) != info.out_spec.num_leaves:
        return  # a structure this cannot map back: keep the re-traced one
    out.args = (tuple(leaves),)
    gm.graph._codegen = _PyTreeCodeGen(info)
    gm.recompile()


def graph_module(root: nn.Module, graph: fx.Graph) -> AmpGraphModule:
    """An :class:`AmpGraphModule` running ``graph`` over ``root``'s module tree, with ``root``'s
    attributes (see the module docstring)."""
    gm = AmpGraphModule(root, graph, class_name=type(root).__name__)
    _keep_tree(gm, root, root.training)
    # a tensor attribute the graph reads became a buffer (a pruned weight, which the pruning pre-hook sets on
    # every call): a copy in __dict__ would shadow it with the value at conversion
    kept = {name: value for name, value in _attributes(root) if name not in gm.__dict__
            and name not in gm._buffers and name not in gm._parameters}
    _keep_attributes(gm, {**kept, "_ampfx_source": getattr(root, "_ampfx_source", type(root)),
                          "_ampfx_attrs": tuple(kept)})
    return gm


def _kept_attributes(gm: AmpGraphModule) -> dict[str, Any]:
    """What :func:`graph_module` kept of its source module (``GraphModule``'s deepcopy and pickling drop it)."""
    names = (*gm.__dict__.get("_ampfx_attrs", ()), "_ampfx_source", "_ampfx_attrs")
    return {name: gm.__dict__[name] for name in names if name in gm.__dict__}


def _keep_attributes(gm: AmpGraphModule, attributes: dict[str, Any]) -> None:
    for name, value in attributes.items():
        gm.__dict__.setdefault(name, value)


def _attributes(root: nn.Module) -> Iterator[tuple[str, Any]]:
    """``root``'s own attributes that are neither module state nor callables (``stride``, ``config``)."""
    for name, value in vars(root).items():
        if name not in _MODULE_STATE and not callable(value) and not isinstance(value, nn.Module) \
                and not name.startswith("_ampfx"):
            yield name, value
