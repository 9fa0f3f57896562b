"""The converted module: an ``fx.GraphModule`` that keeps the model's whole module tree.

:class:`AmpGraphModule` keeps every parameter, buffer and submodule of the
model it was built from (so ``state_dict()`` keys equal the model's), survives
``copy.deepcopy`` and pickling with its report, and holds one graph per
training mode when the model's Python reads ``self.training``: ``.train()`` /
``.eval()`` switch graphs as they switch Python.

>>> import torch, torch.fx as fx
>>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
>>> g = graph_module(net, fx.symbolic_trace(net).graph)
>>> sorted(g.state_dict()) == sorted(net.state_dict())
True
"""
from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn


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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``nn.Module.__call__``, after the call-time guard (:mod:`ampfx.guards`) checked the inputs."""
        guard = self.__dict__.get("_ampfx_guard")
        if guard is not None:
            guard(args, kwargs)
        return super().__call__(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> "AmpGraphModule":
        res = super().__deepcopy__(memo)
        tree = copy.deepcopy({"_modules": self._modules, "_parameters": self._parameters,
                              "_buffers": self._buffers}, memo)
        holder = nn.Module()
        holder._modules, holder._parameters, holder._buffers = tree["_modules"], tree["_parameters"], tree["_buffers"]
        holder._non_persistent_buffers_set = set(self._non_persistent_buffers_set)
        _keep_tree(res, holder, self.training)
        if "ampfx_report" in self.__dict__:
            res.ampfx_report = self.ampfx_report  # frozen: safe to share
        if "_ampfx_guard" in self.__dict__:
            res.__dict__["_ampfx_guard"] = self.__dict__["_ampfx_guard"]  # immutable: safe to share
        alt = self.__dict__.get("_ampfx_alt")
        if alt is not None:
            res.set_mode_graph(alt[0], copy.deepcopy(alt[1], memo))
        return res

    def __reduce__(self):  # noqa: ANN204
        fn, args = super().__reduce__()
        holder = nn.Module()
        holder._modules, holder._parameters, holder._buffers = self._modules, self._parameters, self._buffers
        holder._non_persistent_buffers_set = set(self._non_persistent_buffers_set)
        return (_rebuild, (fn, args, holder, self.training, self.__dict__.get("ampfx_report"),
                           self.__dict__.get("_ampfx_alt"), getattr(self.graph._codegen, "pytree_info", None),
                           self.__dict__.get("_ampfx_guard")))

    def set_mode_graph(self, training: bool, other: "AmpGraphModule") -> None:
        """Run ``other`` (the graph traced with every module's ``training`` set to
        ``training``, over the same module tree) whenever this module is in that
        mode: ``.train()`` / ``.eval()`` then switch graphs, as they switch Python."""
        self.__dict__["_ampfx_alt"] = (training, other)
        self._install_dispatch()

    def recompile(self) -> Any:
        """``GraphModule.recompile`` (pickling calls it too), keeping the mode dispatch."""
        code = super().recompile()
        if "_ampfx_alt" in self.__dict__:
            self._install_dispatch()
        return code

    def _install_dispatch(self) -> None:
        cls = type(self)
        graph_forward = cls.forward
        if getattr(graph_forward, "_ampfx_dispatch", False):
            return

        def forward(self: AmpGraphModule, *args: Any, **kwargs: Any) -> Any:
            alt = self.__dict__.get("_ampfx_alt")
            if alt is not None and self.training == alt[0]:
                return alt[1](*args, **kwargs)
            return graph_forward(self, *args, **kwargs)

        forward.__signature__ = inspect.signature(graph_forward)
        forward._ampfx_dispatch = True
        cls.forward = forward


def _rebuild(fn, args, holder: nn.Module, training: bool, report, alt=None,  # noqa: ANN001
             pytree_info=None, guard=None) -> AmpGraphModule:
    plain = fn(*args)
    if pytree_info is not None:
        _restore_pytree(plain, pytree_info)
    gm = AmpGraphModule(plain, plain.graph, class_name=type(plain).__name__)
    _keep_tree(gm, holder, training)
    if report is not None:
        gm.ampfx_report = report
    if alt is not None:
        gm.set_mode_graph(*alt)
    if guard is not None:
        gm.__dict__["_ampfx_guard"] = guard
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
    """An :class:`AmpGraphModule` running ``graph`` over ``root``'s module tree."""
    gm = AmpGraphModule(root, graph, class_name=type(root).__name__)
    _keep_tree(gm, root, root.training)
    return gm
