"""The converted module: an ``fx.GraphModule`` that is a view of one of the model's modules.

:class:`AmpGraphModule` stands for the model's module it was converted from (its
*model module*, ``_ampfx_model``) and shares with it what ``nn.Module`` keeps:

- the ``_parameters`` and ``_buffers`` dicts themselves (not copies), so
  ``parameters()``, ``state_dict()`` and ``buffers()`` are the model's, in the model's
  order and names, and a tensor replaced on either side (``load_state_dict(assign=True)``,
  ``fc.bias = None``, ``.to()``) is replaced on both;
- its hooks (the dicts themselves), so a hook registered on the model's module or on
  this one fires when this one is called;
- its training flag and its Python attributes: reads fall through to the model module
  (``conv.stride``, ``config``, a method of its class bound to this module), writes go to
  it; ``.train()`` / ``.eval()`` run the model module's own ``train``.

Its children are the model's own modules, except where a child is converted too (a
kept block: another :class:`AmpGraphModule`) or keeps its Python around converted
children (a :class:`~ampfx.runtime.view.Mirror`). What the graph fixed about the model's Python
(training flags, attributes, globals, hooks of the modules it traced through, the dtype
and device of the tensors it reads: :mod:`ampfx.runtime.fixed`) is checked before each call; when
it no longer holds, the module runs a conversion that does (the other training mode's,
or one made again at the call: :mod:`ampfx.runtime.entries`, armed by :func:`ampfx.runtime.arming.arm`), or raises
:class:`~ampfx.errors.StaleModelError` naming the change.

A copy (``copy.deepcopy``) copies the model module along and stays a view of the copy;
a pickled and loaded module is a view of the copy of the model module the pickle holds too, and converts that
copy again as the original converts the model; where the model cannot be pickled (a lambda on it, a class local
to a function) it is standalone (the model module's attributes kept as its own) and raises where it would have to
convert again.

>>> import torch, torch.fx as fx
>>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
>>> g = graph_module(net, fx.symbolic_trace(net).graph)
>>> list(g.state_dict()) == list(net.state_dict()), g._parameters is net._parameters
(True, True)
>>> conv = torch.nn.Conv1d(2, 2, 3, stride=2)
>>> graph_module(conv, fx.symbolic_trace(conv).graph).stride
(2,)
"""
from __future__ import annotations

import copy
import functools
import inspect
import io
import pickle
import types
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.graph import CodeGen, _PyTreeCodeGen, _PyTreeInfo
from torch.fx.graph_module import _CodeOnlyModule

from .. import runtime
from ..errors import BakedValueError, GuardError, PlanSizeError
from ..state import TORCH_KEYS
from . import lowered
from .entries import ModeUnavailable, PendingMode, Runtime, run, stands_for

__all__ = ["AmpGraphModule", "ModeUnavailable", "OutputCodeGen", "PendingMode", "graph_module", "run"]

TREE = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")
"""What ``nn.Module`` keeps of its tree (shared with the model module, ``_modules`` excepted)."""
HOOKS = tuple(k for k in TORCH_KEYS if "hook" in k)
"""Every hook dict of ``nn.Module`` (forward, backward, state-dict and load hooks)."""
_LOCAL = frozenset({"_graph", "_code", "_lineno_map", "_prologue_start", "_tracer_cls", "_tracer_extras", "meta",
                    "shape_env", "_in_spec", "_out_spec", "_create_node_hooks", "_erase_node_hooks",
                    "_replace_hooks", "_deepcopy_hooks", "forward", "graph", "code", *TREE, *HOOKS})
"""``GraphModule``'s own attributes: kept on this module, never written to the model module."""
_MISSING = object()
MADE = ("_ampfx", "_tensor_constant", "_torchbind_obj")
"""Attributes a capture made (constants torch.fx and ampfx set on the traced copy): the graph module's own."""


def _get_training(self: AmpGraphModule) -> bool:
    model = self.__dict__.get("_ampfx_model")
    return model.training if model is not None else self.__dict__.get("_ampfx_training", True)


def _set_training(self: AmpGraphModule, mode: bool) -> None:
    model = self.__dict__.get("_ampfx_model")
    if model is not None:
        model.training = mode
    else:
        self.__dict__["_ampfx_training"] = mode


class AmpGraphModule(fx.GraphModule):
    """A ``GraphModule`` over the tree of the model module it stands for (see the module docstring),
    with its report (``ampfx_report``), the other training mode's conversion and call-time checks."""

    training = property(_get_training, _set_training)  # the model module's flag

    # --- the view ------------------------------------------------------------------------------------

    def view_of(self, model: nn.Module) -> None:
        """Make this module stand for ``model``: share its parameter and buffer dicts (``_modules`` is
        this module's own, ordered as ``model``'s), and read and write its flag and attributes. Entries
        of this module's dicts that ``model`` lacks (constants a capture made) are kept as plain
        attributes; copies of ``model``'s own attributes are dropped (they are read from it)."""
        d = self.__dict__
        for name in ("_parameters", "_buffers"):
            theirs = getattr(model, name)
            for key, value in d[name].items():
                if key not in theirs and (key.startswith(MADE) or key not in model.__dict__):
                    d[key] = value
        for key in [k for k in d if k in model.__dict__ and k not in _LOCAL and not k.startswith((*MADE, "ampfx_"))]:
            del d[key]
        d["_parameters"], d["_buffers"] = model._parameters, model._buffers
        d["_non_persistent_buffers_set"] = model._non_persistent_buffers_set
        own = d["_modules"]
        order = [k for k in model._modules if k in own] + [k for k in own if k not in model._modules]
        d["_modules"] = {k: own[k] for k in order if k in model._modules}
        for k in order:
            if k not in model._modules and own[k] is not None:  # a holder a capture made: not a child
                d[k] = own[k]
        d.pop("_ampfx_training", None)
        d["_ampfx_model"] = model

    def _apply(self, fn: Callable, recurse: bool = True) -> "AmpGraphModule":
        """``nn.Module._apply`` (``.to()``, ``.cuda()``, ``.double()``), and the tensor constants a capture made,
        which this module keeps as plain attributes (the model module's buffers are not theirs)."""
        super()._apply(fn, recurse)
        for key, value in list(self.__dict__.items()):
            if key.startswith(MADE) and isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                self.__dict__[key] = fn(value)
        return self

    def share_hooks(self, model: nn.Module) -> None:
        """Use ``model``'s hook dicts as this module's own: a hook registered on either fires here (whether
        backward hooks are full ones is read from ``model`` too)."""
        for name in HOOKS:
            if name in model.__dict__ and isinstance(model.__dict__[name], dict):
                self.__dict__[name] = model.__dict__[name]
        self.__dict__.pop("_is_full_backward_hook", None)
        self.__dict__["_ampfx_shared_hooks"] = True

    def __getattr__(self, name: str) -> Any:
        """``nn.Module``'s lookup, then the model module's attributes, then its class's methods and
        properties bound to this module (code around it may call ``self.conv._conv_forward``)."""
        child = self.__dict__["_modules"].get(name, _MISSING) if "_modules" in self.__dict__ else _MISSING
        if child is not _MISSING:  # the graph's code reads its children at every call
            return child
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__"):
                raise
            model = self.__dict__.get("_ampfx_model")
            if model is not None:
                value = model.__dict__.get(name, _MISSING)
                if value is not _MISSING:
                    return value
            source = type(model) if model is not None else self.__dict__.get("_ampfx_source")
            attr = inspect.getattr_static(source, name, _MISSING) if source is not None else _MISSING
            if attr is _MISSING:
                raise
            if not hasattr(type(attr), "__get__"):
                return attr
            code = getattr(getattr(attr, "__func__", attr), "__code__", None)
            if model is not None and code is not None and "__class__" in code.co_freevars:
                return attr.__get__(model, type(model))  # zero-argument super() needs an instance of its class
            return attr.__get__(self, type(self))

    __getattr__._ampfx_modules_first = True  # children from _modules first (ampfx.runtime.lowered reads so)
    __getattr__._ampfx_falls_back_to = "_ampfx_model"  # then the model module's attributes (lowered reads them so)

    def __setattr__(self, name: str, value: Any) -> None:
        model = self.__dict__.get("_ampfx_model")
        if name == "_is_full_backward_hook" and self.__dict__.get("_ampfx_shared_hooks"):
            return setattr(model, name, value)
        if model is None or name in _LOCAL or name.startswith(("_ampfx", "ampfx_")) or name == "training":
            return super().__setattr__(name, value)
        if isinstance(value, nn.Module) or (value is None and name in self.__dict__["_modules"]):
            # the converted tree's structure is its own (a checkpoint wrapper around a kept block); where the
            # graph traced the old module's forward, the new one would not run
            recorded = self._rt.recorded
            if self.__dict__["_modules"].get(name) is value:
                return  # set back as it was (a wrapping pass visits every child)
            if recorded is not None and any(p == name or p.startswith(name + ".") for p in recorded.inlined):
                self._rt.go_stale(
                    f"{name} was replaced on the converted module, but its graph traced the old module's forward, "
                    f"so the new one would not run. Replace it on the model and convert again, or keep it as a "
                    f"module boundary (keep_modules=[{name!r}])")
            self.__dict__["_modules"][name] = value
            return
        setattr(model, name, value)  # parameters, buffers, attributes: the model module's

    def __delattr__(self, name: str) -> None:
        model = self.__dict__.get("_ampfx_model")
        if model is None or name in _LOCAL or name.startswith(("_ampfx", "ampfx_")):
            return super().__delattr__(name)
        own = self.__dict__["_modules"]
        if name in own:
            del own[name]
        if name in model.__dict__ or name in model._parameters or name in model._buffers or name in model._modules:
            delattr(model, name)
        elif name in self.__dict__:
            del self.__dict__[name]

    def train(self, mode: bool = True) -> "AmpGraphModule":
        """The model module's own ``train(mode)`` (an override that keeps batch norm frozen runs): it sets
        the flags this module and its children read."""
        model = self.__dict__.get("_ampfx_model")
        if model is None:
            return super().train(mode)
        model.train(mode)
        for name, child in self._modules.items():  # a module set on this one (not the model's): its own flag
            if child is not None and child is not model._modules.get(name) and not stands_for(child):
                child.train(mode)
        return self

    # --- the runtime: call steps and entries (ampfx.runtime.entries) ---------------------------------------

    @property
    def _rt(self) -> Runtime:
        """This module's one runtime state (:class:`~ampfx.runtime.entries.Runtime`)."""
        rt = self.__dict__.get("_ampfx_runtime")
        if rt is None:
            rt = self.__dict__["_ampfx_runtime"] = Runtime()
        return rt

    def mode_module(self, training: bool) -> nn.Module:
        """The module that runs when this one is in mode ``training`` (itself, or the other mode's
        conversion, whose ``ampfx_report`` says what it runs; made now if it was not yet: :class:`PendingMode`)."""
        rt = self._rt
        if rt.alt is None or rt.alt[0] != training:
            return self
        return rt.other_mode(self, None) if isinstance(rt.alt[1], PendingMode) else rt.alt[1]

    def variants(self) -> list[nn.Module]:
        """The conversions made again at call time because what this graph fixed changed (each has an
        ``ampfx_report`` whose notes say why), oldest first."""
        return list(self._rt.variants)

    def restructured(self, change: str) -> None:
        """The model module's structure changed where this graph traced it (``change``, in words: a submodule
        replaced or added, a tied tensor untied): at the next call its graph, the other mode's and the
        conversions made again so far are retired, and the model module is converted again (within
        ``reconvert_limit``, as for a changed value)."""
        self._rt.heard(change)

    def _run_graph(self, args: tuple, kwargs: dict) -> Any:
        """The steps after the choice of entry (``guard``, ``weights``), then this module's graph."""
        rt = self.__dict__.get("_ampfx_runtime")
        if rt is None:
            return type(self)._ampfx_graph_forward(self, *args, **kwargs)
        if rt.guard is not None:
            try:
                rt.guard(args, kwargs)
            except PlanSizeError as e:  # the call's sizes cross a size-dependent dtype decision: plan again
                entry = rt.for_sizes(self, args, kwargs, e)
                if entry is not None:
                    return run(entry, args, kwargs)
            except BakedValueError as e:  # an argument the graph holds as traced (None, a flag) differs
                return run(rt.for_values(self, args, kwargs, e), args, kwargs)
            except GuardError as e:  # outside its signature: below the root, converted again for the call
                return run(rt.for_signature(self, args, kwargs, e), args, kwargs)
        cache = rt.weights
        if cache is None:
            return type(self)._ampfx_graph_forward(self, *args, **kwargs)
        with cache.used(self):  # the weight copies (ampfx.runtime.weight_cache): made again where stale
            return type(self)._ampfx_graph_forward(self, *args, **kwargs)

    def recompile(self) -> Any:
        """``GraphModule.recompile`` (pickling calls it too), keeping the dispatch; called as a plain module.
        fx wraps each call of a graph module to add the generated code's line to an error's message: every
        exception through it, caught or not, extracts a traceback from the source cache (activation
        checkpointing stops each recompute early by raising one: 0.13 ms a call). The generated source is in
        the line cache anyway, so tracebacks show its lines."""
        code = super().recompile()
        cls = type(self)
        fast = lowered.forward(self)
        if fast is not None:  # its ops through their C++ handles (ampfx.runtime.lowered)
            cls.forward = lowered.either(cls.forward, fast)
        if "__call__" in type(self).__dict__:  # fx's wrapper: nn.Module.__call__ (looked up, so tracers patch it)
            delattr(type(self), "__call__")
        if self.__dict__.get("_ampfx_runtime") is not None and self._rt.dispatched():
            self._install_dispatch()
        return code

    def _install_dispatch(self) -> None:
        cls = type(self)
        graph_forward = cls.forward
        if getattr(graph_forward, "_ampfx_dispatch", False):
            return

        def forward(self: AmpGraphModule, *args: Any, **kwargs: Any) -> Any:  # the steps of entries.CALL_STEPS
            rt = self.__dict__["_ampfx_runtime"]
            if rt.check is not None:
                rt.check(self)
            if rt.linked is not None:
                return rt.linked.run(functools.partial(type(self)._ampfx_dispatched, self), args, kwargs)
            target = rt.runner(self, args, kwargs)
            return self._run_graph(args, kwargs) if target is None else run(target, args, kwargs)

        def dispatched(self: AmpGraphModule, args: tuple, kwargs: dict) -> Any:
            target = self.__dict__["_ampfx_runtime"].runner(self, args, kwargs)
            return self._run_graph(args, kwargs) if target is None else run(target, args, kwargs)

        # a code object of its own for each graph module's class: torch.compile caches compiled frames by code
        # object, and one shared by every kept block would count each block as a recompile of the same frame
        # (a 12-block model hit dynamo's recompile limit and ran the blocks past the 8th uncompiled)
        forward = types.FunctionType(forward.__code__.replace(), forward.__globals__, "forward", None,
                                     forward.__closure__)
        forward.__signature__ = inspect.signature(graph_forward)
        forward._ampfx_dispatch = True
        cls._ampfx_graph_forward = graph_forward
        cls._ampfx_dispatched = types.FunctionType(dispatched.__code__.replace(), dispatched.__globals__, "dispatched")
        cls.forward = forward

    # --- copies ---------------------------------------------------------------------------------------

    def __deepcopy__(self, memo: dict) -> "AmpGraphModule":
        """A copy over the copy of the model module (``GraphModule.__deepcopy__``'s steps, with the attributes
        the graph reads through the model module found there), a view of that copy."""
        res = type(self).__new__(type(self))
        memo[id(self)] = res
        copied = copy.deepcopy(self.__dict__, memo)
        fake = _Copied(dict(copied))
        fx.GraphModule.__init__(res, fake, copied["_graph"])
        for name in ("_state_dict_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
                     "_replace_hooks", "_create_node_hooks", "_erase_node_hooks", "_deepcopy_hooks"):
            if name in copied:
                res.__dict__[name] = copied[name]
        res.meta = copy.deepcopy(getattr(self, "meta", {}), memo)
        for name in (*TREE, *HOOKS, *(k for k in copied if k.startswith(("_ampfx", "ampfx_", *MADE)))):
            if name in copied:
                res.__dict__[name] = copied[name]
        model = copied.get("_ampfx_model")
        if model is not None:
            res.view_of(model)
        if "ampfx_report" in self.__dict__:
            res.__dict__["ampfx_report"] = self.ampfx_report  # frozen: safe to share
        if res.__dict__.get("_ampfx_runtime") is not None and res._rt.dispatched():
            res._install_dispatch()
        return res

    def __reduce__(self):  # noqa: ANN204
        """A copy over a copy of the model module, which the pickle holds with the means to convert it again
        (:class:`ampfx.api.Again`), as a deep copy is; where those cannot be pickled, a standalone copy: the
        model module's attributes become this module's own, what its graph fixed is checked against its own tree,
        and it cannot convert again. The attributes its graph reads at every call (``runtime.LIVE_READS``) stay
        reads when loading re-traces its code."""
        self.__dict__["_tracer_cls"] = runtime.Retracer  # loading re-traces the code: torch.func's calls as they are
        rt = self._rt
        if rt.alt is not None and isinstance(rt.alt[1], PendingMode):  # a loaded copy cannot convert: made now
            rt.other_mode(self, None)
        fn, (body, *rest) = super().__reduce__()
        body[runtime.LIVE_READS] = _live_reads(self)
        model = body.pop("_ampfx_model", None)
        goes_along = model is not None and rt.reconvert is not None and _picklable((model, rt.reconvert))
        body["_ampfx_runtime"] = rt.for_pickle(goes_along)  # the loaded copy binds what its graph fixed to its tree
        if goes_along:
            # a view of the model module's copy, which it converts again (the copy of the model in the pickle)
            body["_ampfx_model"] = model
            for target in body[runtime.LIVE_READS]:  # loading builds the graph module from them (then reads its model's)
                if "." not in target and target in model.__dict__ and target not in body:
                    body[target] = model.__dict__[target]
        elif model is not None:
            body["_ampfx_training"] = model.training
            source = type(model)
            if "<locals>" not in source.__qualname__:
                body["_ampfx_source"] = source
            for k, v in model.__dict__.items():
                if k not in TORCH_KEYS and k not in body and not isinstance(v, nn.Module) and not callable(v):
                    body[k] = v
        elif "<locals>" in getattr(body.get("_ampfx_source"), "__qualname__", ""):
            body.pop("_ampfx_source")
        tree = {k: body[k] for k in (*TREE, *HOOKS) if k in body}
        return (_rebuild, (fn, (body, *rest), tree, getattr(self.graph._codegen, "pytree_info", None)))


def _picklable(value: Any) -> bool:
    """Can ``value`` be pickled (tensors aside: their data is not written)? A model whose class is local to a
    function cannot."""
    class Structure(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return id(obj) if isinstance(obj, torch.Tensor) else None

    try:
        Structure(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except Exception:  # noqa: BLE001 - any failure: the copy is standalone
        return False
    return True


def _live_reads(gm: AmpGraphModule) -> tuple[str, ...]:
    """The ``get_attr`` targets of ``gm``'s graph whose values are neither tensors nor modules (``self.scale``)."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            value = gm.get_submodule(".".join(node.target.split(".")[:-1])) if "." in node.target else gm
            value = getattr(value, node.target.split(".")[-1])
        except AttributeError:
            continue
        if not isinstance(value, (torch.Tensor, nn.Module)):
            out.append(node.target)
    return tuple(out)


class _Copied(_CodeOnlyModule):
    """The copied ``__dict__`` a copy is built from; what the graph reads through the model module (a float
    attribute read at every call) is found in the copied model module."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_ampfx_model")
            if model is None or name not in model.__dict__:
                raise
            return model.__dict__[name]


def _rebuild(fn, args, tree: dict, pytree_info=None) -> AmpGraphModule:  # noqa: ANN001
    plain = fn(*args)
    if pytree_info is not None:
        _restore_pytree(plain, pytree_info)
    gm = AmpGraphModule(plain, plain.graph, class_name=type(plain).__name__)
    body = args[0]
    gm.__dict__.update(tree)
    for key, value in body.items():
        # GraphModule.__init__ set its own defaults (the training flag as True): what was saved wins over them
        if (key not in gm.__dict__ or key.startswith("_ampfx")) and key not in ("_graph", "_code", runtime.LIVE_READS):
            gm.__dict__[key] = value
    if "_ampfx_runtime" not in gm.__dict__:  # pickled before the runtime state was one attribute
        old = Runtime.from_keys(gm.__dict__)
        if old is not None:
            gm.__dict__["_ampfx_runtime"] = old
    model = gm.__dict__.get("_ampfx_model")
    if model is not None:  # a view of the loaded copy of its model module, as a deep copy is
        gm.view_of(model)
    rt = gm._rt
    rt.bind_loaded(model if model is not None else gm)
    if rt.dispatched():
        gm._install_dispatch()
    return gm


def _restore_pytree(gm: fx.GraphModule, info: Any) -> None:
    """Unpickling re-traces the code of an exported graph (or one whose outputs keep their containers:
    :class:`OutputCodeGen`), which builds its output structure (an HF ``ModelOutput``, say) from plain
    dicts; give it back its pytree input/output handling so it returns what it returned before."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    leaves, _ = torch.utils._pytree.tree_flatten(out.args[0])
    if len(leaves) != info.out_spec.num_leaves:
        return  # a structure this cannot map back: keep the re-traced one
    out.args = (tuple(leaves),)
    gm.graph._codegen = OutputCodeGen(info.out_spec) if info.in_spec is None else _PyTreeCodeGen(info)
    gm.recompile()


class OutputCodeGen(_PyTreeCodeGen):
    """torch.fx's code generation, returning the containers the forward returned.

    A graph's output node holds fx's plain ``dict`` / ``list`` where the forward returned an
    ``OrderedDict``, another ``dict`` or ``list`` subclass or an HF ``ModelOutput``: its code would
    return other types than the model (and the next converted module's guard, built for the model's,
    rejects them). With this code generation the output node holds the flat leaves and the code
    rebuilds the forward's own tree (``out_spec``), as an exported graph's code does; the inputs are
    fx's own, taken as given (``in_spec`` is ``None``)."""

    def __init__(self, out_spec: Any) -> None:
        super().__init__(_PyTreeInfo([], None, out_spec))

    def process_inputs(self, *inputs: Any) -> Any:
        return CodeGen.process_inputs(self, *inputs)

    def gen_fn_def(self, *args: Any, **kwargs: Any) -> str:
        return CodeGen.gen_fn_def(self, *args, **kwargs)


def graph_module(root: nn.Module, graph: fx.Graph) -> AmpGraphModule:
    """An :class:`AmpGraphModule` running ``graph`` as a view of ``root`` (see the module docstring): its
    parameters and buffers, its children, its flag and attributes."""
    gm = AmpGraphModule(root, graph, class_name=type(root).__name__)
    own = gm.__dict__["_modules"]
    gm.__dict__["_modules"] = {**{k: v for k, v in root._modules.items()}, **{k: v for k, v in own.items()
                                                                                if k not in root._modules}}
    gm.view_of(root)
    return gm
