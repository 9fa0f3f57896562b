"""Capturing a model as a ``torch.fx`` graph, with a fallback ladder.

:class:`AmpTracer` differs from ``torch.fx.Tracer`` in which modules it keeps
opaque (leaves):

- traced *through*: the ``torch.nn`` types of :data:`ampfx.ops.TRACE_THROUGH`
  (``nn.Linear``, convolutions, ``nn.Softmax``, the ``nn.Transformer*``
  layers), so their parameters appear as ``get_attr`` nodes that the cast
  pass can cast once, and attention internals are visible to the policy;
- leaves: every other ``torch.nn`` module (as in ``torch.fx``: modules whose
  behaviour depends on ``training`` stay switchable), modules of an
  integrated library (DGL's, found by their class's package without
  importing it: :func:`ampfx.libraries.library_of`), module types named
  on a policy list or in ``leaf_modules``, and modules named by path. User functions
  named on a policy list stay one ``call_function`` node.

Functions a library hands to ``torch.fx.wrap`` (to keep fx from tracing something it cannot, such
as an attention helper with shape arithmetic) are traced into when ``into_wrapped`` is set: torch.fx
would otherwise keep each one an opaque node, whose GEMMs no table sees and which runs in float32.
The capture ladder sets it where it checks the graph against the module (``tracer="auto"`` with
example inputs). A function that still cannot be traced (data-dependent control flow), or whose body
does what the graph would drop (a ``no_grad`` region), is kept whole, as torch.fx keeps it, and the
capture names it (:attr:`~ampfx.capture.base.Capture.functions`). torch's own wrapped functions,
and functions named on a list, always stay whole.

:func:`trace` tries, in order: the whole model with every argument symbolic;
the whole model with optional arguments fixed at their defaults (the
converted module asserts they keep them); then, each time tracing fails
inside a submodule, that innermost submodule becomes a leaf and tracing
starts again. Every step is recorded with its error. If the root's own
``forward`` cannot be traced, :class:`RootUntraceable` tells the capture
ladder (:mod:`ampfx.capture.ladder`) to try the next rung.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import types
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .. import libraries, ops, runtime
from ..errors import RootUntraceable
from ..threads import converting
from .fixing import reads_training
from ..runtime.graph_module import OutputCodeGen
from ..policy import Policy
from .base import Capture, short
from .draws import Drawing
from .lift import Lifting, Tagged
from .semantics import Watch

MAX_LEAF_RETRIES = 64


class AmpTracer(fx.Tracer):
    """``torch.fx.Tracer`` with ampfx's leaf rules (see the module docstring)."""

    def __init__(self, policy: Policy | None = None, leaf_paths: set[str] = frozenset(),
                 kept: frozenset[str] = frozenset(), named: frozenset[str] = frozenset(),
                 into_wrapped: bool = False, whole: frozenset[str] = frozenset()) -> None:
        policy = policy if policy is not None else Policy()
        # user functions named on a list, and other libraries' functions in the tables (timm's drop_path),
        # stay one node (fx would trace into them)
        functions = tuple(obj for obj, _ in policy.user_ops if isinstance(obj, types.FunctionType))
        functions += tuple(fn for fn in ops.library_functions() if fn not in functions)
        super().__init__(autowrap_functions=functions)
        self.policy = policy
        self.user_functions = functions
        self.leaf_paths = set(leaf_paths) | {m for m in policy.capture.leaf_modules if isinstance(m, str)} | set(kept) | named
        self.failed_path: str | None = None
        self.into_wrapped = into_wrapped
        self.whole = whole  # torch.fx.wrap-ped functions (qualified names) kept whole even with into_wrapped
        self.failed_function: str | None = None  # the innermost wrapped function traced into that raised
        self.dropping: dict[str, tuple[str, ...]] = {}  # wrapped functions whose body does what a graph drops
        self.traced_into: dict[str, None] = {}  # wrapped functions whose body was traced, in order
        self.watch: Watch | None = None
        self.lifting: Lifting | None = None
        self.returned: Any = None
        self.drawing: Drawing | None = None

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        """``fx.Tracer.trace``; user functions on a list are also kept whole when
        called as ``module.function`` (``autowrap_functions`` covers only globals).
        What the forward does that the graph drops is in ``self.watch.dropped`` after
        (:mod:`ampfx.capture.semantics`), and the module attributes it changed are put back. One trace at a time
        in the process; what it patches acts in its own thread only (:mod:`ampfx.threads`)."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(converting())
            for fn in self.user_functions:
                home = sys.modules.get(fn.__module__)
                if home is not None and getattr(home, fn.__name__, None) is fn:
                    setattr(home, fn.__name__, _one_node(fn))
                    stack.callback(setattr, home, fn.__name__, fn)
            if self.into_wrapped:
                for space, name, fn in wrapped_functions(self.user_functions):
                    if ops.qualified_name(fn) not in self.whole:
                        space[name] = _traced_into(fn, self)
                        stack.callback(space.__setitem__, name, fn)
            self.watch = stack.enter_context(Watch(root))
            self.watch.where = self._current_path
            if isinstance(root, nn.Module):
                self.lifting = stack.enter_context(Lifting(root, torch.finfo(self.policy.dtype).max))
            self.drawing = stack.enter_context(Drawing(self))
            return super().trace(root, concrete_args)

    def create_args_for_root(self, root_fn: Any, is_module: bool, concrete_args: Any = None) -> tuple[Any, Any]:
        """``fx.Tracer.create_args_for_root``; what the traced function returns is kept in ``self.returned``
        (the graph's output node holds fx's plain containers in place of its own)."""
        fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)

        @functools.wraps(fn)
        def returning(*args: Any) -> Any:
            self.returned = fn(*args)
            return self.returned

        return returning, args

    def create_arg(self, a: Any) -> Any:
        """``fx.Tracer.create_arg``; a float attribute passed straight to an op is read at every call
        (:mod:`ampfx.capture.lift`); a random draw passed as a constant frees it (:mod:`ampfx.capture.draws`)."""
        if type(a) is Tagged and self.lifting is not None:
            return self.lifting.arg(self, a)
        if self.drawing is not None:
            self.drawing.passed(a)
        return super().create_arg(a)

    def _current_path(self) -> str:
        """The path of the module whose forward is being traced now ('' for the root)."""
        if not self.module_stack:
            return ""
        key, value = next(reversed(self.module_stack.items()))
        return str(value[0] if isinstance(value, tuple) else key)

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        """``fx.Tracer.create_node``; the node is shown to the :class:`Watch` (the regions it is created in)."""
        node = super().create_node(*args, **kwargs)
        if self.watch is not None:
            self.watch.stamp(node)
        return node

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        """``fx.Tracer.getattr`` with a name lookup table: fx scans every
        parameter of the model on each access, quadratic in model size."""
        if not isinstance(attr_val, torch.Tensor):
            return attr_val
        if getattr(self, "_names_root", None) is not self.root:
            self._names_root = self.root
            self._names = {}
            if self.proxy_buffer_attributes:
                self._names.update((id(b), n) for n, b in self.root.named_buffers())
            self._names.update((id(p), n) for n, p in self.root.named_parameters())
        name = self._names.get(id(attr_val))
        if name is None or not (isinstance(attr_val, nn.Parameter) or self.proxy_buffer_attributes):
            return attr_val
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if qualname in self.leaf_paths or libraries.library_of(m) is not None or self.policy.is_user_leaf(type(m)):
            return True
        if isinstance(m, torch.jit.ScriptModule):  # compiled by TorchScript: its forward is not Python to trace
            return True
        if type(m) in ops.TRACE_THROUGH:
            return False
        return super().is_leaf_module(m, qualname)

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_path is None:  # the innermost module sees the error first
                self.failed_path = self.path_of_module(m)
            raise


def _one_node(fn: Any) -> Any:
    """``fn`` that records itself as one ``call_function`` node when given proxies."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for a in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(a, fx.Proxy):
                return a.tracer.create_proxy("call_function", fn, args, kwargs)
        return fn(*args, **kwargs)
    wrapper._ampfx_one_node = fn  # a library's own torch.fx.wrap may record the wrapper: _finish unwraps it
    return wrapper

def wrapped_functions(skip: tuple = ()) -> list[tuple[dict[str, Any], str, types.FunctionType]]:
    """``(globals, name, function)`` of every Python function ``torch.fx.wrap`` registered that a graph keeps
    opaque: not torch's own (fx's ``_assert_is_none``), not in ``skip`` and not in the op tables (which decide
    a function they name, as torchvision's ``stochastic_depth``, whole); names of builtins
    (``torch.fx.wrap("len")``) are left out."""
    table = getattr(fx._symbolic_trace, "_wrapped_fns_to_patch", {})  # torch.fx's registry, read only
    return [(space, name, space[name]) for (_, name), space in list(table.items())
            if _opaque(space.get(name), skip)]


def _opaque(fn: Any, skip: tuple) -> bool:
    """Is ``fn`` a Python function that no table or list decides, and not torch's own?"""
    return isinstance(fn, types.FunctionType) and fn not in skip and ops.lookup_name(fn) is None \
        and (fn.__module__ or "").split(".")[0] != "torch"


def _traced_into(fn: types.FunctionType, tracer: AmpTracer) -> Any:
    """``fn`` as a global while ``tracer`` traces into torch.fx.wrap-ped functions: called with proxies, its body
    is traced; an error inside it names it (``tracer.failed_function``), and so does a region or update its body
    does that the graph would drop (``tracer.dropping``: the module calling it is not blamed)."""
    name = ops.qualified_name(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not any(isinstance(a, fx.Proxy) for a in torch.utils._pytree.tree_leaves((args, kwargs))):
            return fn(*args, **kwargs)
        before = dict(tracer.watch.dropped) if tracer.watch is not None else {}
        tracer.traced_into[name] = None
        try:
            out = fn(*args, **kwargs)
        except Exception:
            tracer.failed_function = tracer.failed_function or name  # the innermost function sees the error first
            raise
        if tracer.watch is not None and tracer.watch.dropped != before:
            tracer.dropping[name] = tuple(w for p, ws in tracer.watch.dropped.items() for w in ws
                                          if w not in before.get(p, ()))
            tracer.watch.dropped = before
        return out
    setattr(wrapper, "__fx_already_patched", True)  # torch.fx's own patching leaves it in place
    return wrapper


def _default_args(model: nn.Module, given: set[str]) -> dict[str, Any]:
    """Parameters of ``model.forward`` that have defaults and are not given a tensor."""
    out = {}
    for name, p in inspect.signature(model.forward).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or name in given:
            continue
        if p.default is not p.empty:
            out[name] = p.default
    return out


@contextlib.contextmanager
def _fast_paths_off():
    """``nn.MultiheadAttention`` / ``nn.Transformer*`` fast-path checks branch on
    tensor properties; with the fast path off they are skipped. The encoder's
    and decoder's sequence-length probe (used only to recognise a causal mask)
    answers "unknown" for traced values, so a mask is then judged by its own size."""
    from torch.nn.modules import transformer

    with contextlib.ExitStack() as stack:
        mha = getattr(torch.backends, "mha", None)
        if mha is not None and hasattr(mha, "set_fastpath_enabled"):
            stack.callback(mha.set_fastpath_enabled, mha.get_fastpath_enabled())
            mha.set_fastpath_enabled(False)
        probe = getattr(transformer, "_get_seq_len", None)
        if probe is not None:
            transformer._get_seq_len = lambda src, batch_first: (
                None if isinstance(src, fx.Proxy) else probe(src, batch_first))
            stack.callback(setattr, transformer, "_get_seq_len", probe)
        yield


def trace(model: nn.Module, policy: Policy, given_args: set[str] | None = None,
          kept: frozenset[str] = frozenset(), named: frozenset[str] = frozenset(),
          into_wrapped: bool = False) -> Capture:
    """Trace ``model`` with the fallback ladder; raises :class:`RootUntraceable`.

    ``given_args`` names the forward arguments the caller supplies (from
    ``example_inputs``); the others may be fixed at their defaults. The modules at
    ``kept`` (paths in ``model``) are leaves: module boundaries ``keep_modules`` asked for; so are those at
    ``named``, the names of the modules ``leaf_modules`` names (:attr:`ampfx.policy.Resolved.leaf_names`).
    With ``into_wrapped``, functions ``torch.fx.wrap`` keeps whole are traced into, and each one that
    fails to trace (or would lose a region) is kept whole and tracing starts again (see the module docstring).
    """
    steps: list[str] = []
    leaves: dict[str, str] = {}
    whole: dict[str, str] = {}
    # an optional argument defaulting to None is traced as None: a proxy would make
    # `if mask is not None:` take the masked branch for every call
    fixed: dict[str, Any] = {k: v for k, v in _default_args(model, given_args or set()).items() if v is None}
    mode = "fx, None defaults fixed" if fixed else "fx"
    python_state = False
    with _fast_paths_off():
        for _ in range(MAX_LEAF_RETRIES):
            tracer = AmpTracer(policy, set(leaves), kept, named, into_wrapped, frozenset(whole))
            try:
                tracer.trace(model, concrete_args=fixed or None)  # _captured reads tracer.graph
            except Exception as e:  # noqa: BLE001 - any trace error moves down the ladder
                path = tracer.failed_path
                if mode in ("fx", "fx, None defaults fixed"):
                    more = _default_args(model, given_args or set())
                    steps.append(f"whole model, {'None defaults fixed' if fixed else 'all arguments symbolic'}: "
                                 f"{short(e)}")
                    if more != fixed:
                        fixed, mode = more, "fx, optional arguments fixed"
                        continue
                    mode = "fx, optional arguments fixed" if fixed else "fx, whole model failed"
                if _keep_whole(steps, whole, {tracer.failed_function: short(e)} if tracer.failed_function else {}):
                    continue
                if path and path not in leaves:
                    leaves[path] = short(e)
                    steps.append(f"module {path!r} made a leaf: {short(e)}")
                    continue
                steps.append(f"root forward: {short(e)}")
                raise RootUntraceable(e, steps) from e
            if _keep_whole(steps, whole, {name: f"torch.fx would drop what its body does: {'; '.join(what)}"
                                          for name, what in tracer.dropping.items()}):
                continue
            python_state = python_state or tracer.watch.python_state
            inner = {p: w for p, w in tracer.watch.dropped.items() if p and p not in leaves}
            if inner:  # a submodule does what the graph would drop: it keeps its Python, as a leaf
                for path, what in inner.items():
                    leaves[path] = f"torch.fx would drop what its forward does: {'; '.join(what)}"
                    steps.append(f"module {path!r} made a leaf: {leaves[path]}")
                continue
            mode = "fx" if mode == "fx, whole model failed" else mode
            mode = "fx, optional arguments fixed" if fixed and mode == "fx, None defaults fixed" else mode
            return _captured(tracer, mode, leaves, fixed, steps, kept, whole, python_state)
    raise RootUntraceable(RuntimeError(f"more than {MAX_LEAF_RETRIES} modules failed to trace"), steps)


def _captured(tracer: AmpTracer, mode: str, leaves: dict[str, str], fixed: dict[str, Any], steps: list[str],
              kept: frozenset[str], whole: dict[str, str], python_state: bool) -> Capture:
    """The :class:`Capture` of a trace :func:`trace` accepts (``tracer.graph``, the graph its last trace made):
    the graph finished (fixed arguments, the forward's own output containers), and the step that says how."""
    graph = tracer.graph
    _finish(graph, fixed)
    try:
        _keep_output_types(graph, tracer.returned)
    except TypeError as e:
        steps.append(f"root forward: {e}")
        raise RootUntraceable(e, steps) from e
    steps.append(f"traced ({mode})" + (f" with leaves {sorted(leaves)}" if leaves else "")
                 + (f", into torch.fx.wrap-ped {', '.join(tracer.traced_into)}" if tracer.traced_into else ""))
    boundaries = tuple(dict.fromkeys(str(n.target) for n in graph.nodes
                                     if n.op == "call_module" and str(n.target) in kept and n.target not in leaves))
    if tracer.drawing.kept:
        steps.append(_kept_draws(tracer.drawing.kept))
    return Capture(graph, mode, leaves, fixed, tuple(steps), dropped=dropped_by(tracer.watch),
                   python_state=python_state, kept=boundaries, lifted=tracer.lifting.lifted(),
                   read=frozenset(tracer.lifting.seen) | tracer.lifting.fixed(),
                   traced_into=tuple(tracer.traced_into),
                   functions=_opaque_functions(graph, whole, tracer.user_functions), free_draws=tracer.drawing.free)


def _kept_draws(draws: tuple) -> str:
    """The step line for random draws whose every comparison had one answer."""
    names = ", ".join(dict.fromkeys(d.describe() for d in draws))
    return (f"{len(draws)} random draw(s) ({names}) only compared with values they cannot reach (a layerdrop "
            "of 0): the branch does not depend on the draw; the graph keeps torch's draws and fixes the values "
            "they were compared with (checked at every call)")


def _keep_output_types(graph: fx.Graph, returned: Any) -> None:
    """Make ``graph`` return the containers its forward returned (``returned``, traced values inside).

    An output node holds fx's own containers, and the code generated for it returns a ``dict``,
    ``list``, ``tuple`` or namedtuple: a forward returning an ``OrderedDict`` (a detection backbone's
    feature maps), another ``dict`` or ``list`` subclass, an HF ``ModelOutput`` would return something
    else once converted (and the next converted module, whose guard was built for the model's own
    value, rejects it). There the output node holds the leaves, and the code rebuilds the forward's
    containers with their pytree spec (:class:`~ampfx.runtime.graph_module.OutputCodeGen`). A container
    torch.utils._pytree cannot rebuild raises ``TypeError`` (the graph is not used)::

        before: return {'0': relu, '1': relu_1}
        after:  return pytree.tree_unflatten((relu, relu_1), self._out_spec)   # an OrderedDict
    """
    if type(graph._codegen) is not fx.graph.CodeGen:  # fx's pytree code (fixed containers): it has them
        return
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    if _generated_as(returned, output.args[0]):
        return
    spec, leaves = _respec(returned, output.args[0])
    output.args = (tuple(leaves),)
    graph._codegen = OutputCodeGen(spec)


def _made(held: Any) -> type | None:
    """The container type the code fx generates builds for ``held`` (a value in an output node);
    ``None`` for a leaf (a node builds its own value: a dataclass, a namedtuple fx recorded)."""
    if isinstance(held, fx.Node) or not isinstance(held, (tuple, list, dict)):
        return None
    if isinstance(held, dict):
        return dict
    return list if isinstance(held, list) else type(held) if hasattr(held, "_fields") else tuple


def _generated_as(returned: Any, held: Any) -> bool:
    """Does the code generated for ``held`` build the containers of ``returned``?"""
    made = _made(held)
    if made is None:
        return True
    if type(returned) is not made or len(returned) != len(held):
        return False
    if made is dict:
        return list(returned) == list(held) and all(_generated_as(returned[k], held[k]) for k in held)
    return all(_generated_as(r, h) for r, h in zip(returned, held))


def _respec(returned: Any, held: Any) -> tuple[Any, list[Any]]:
    """The pytree spec of ``returned``'s containers down to the leaves the output node holds (``held``),
    and those leaves; ``TypeError`` where torch.utils._pytree cannot rebuild a container."""
    from collections.abc import Mapping
    from torch.utils import _pytree as pytree
    from torch.utils._pytree import SUPPORTED_NODES, TreeSpec, _get_node_type

    made = _made(held)
    if made is None:
        return getattr(pytree, "treespec_leaf", getattr(pytree, "LeafSpec", None))(), [held]  # older torch: LeafSpec
    entry = SUPPORTED_NODES.get(_get_node_type(returned))
    name = type(returned).__qualname__
    if entry is None:
        raise TypeError(f"the forward returns a {name}, which torch.fx's graph would return as a {made.__name__} "
                        "(register the type with torch.utils._pytree for ampfx to rebuild it)")
    children, context = entry.flatten_fn(returned)
    if made is dict:
        same = isinstance(returned, Mapping) and list(returned) == list(held)
        values, inner = ([returned[k] for k in returned], [held[k] for k in returned]) if same else ([], [])
    else:
        same = isinstance(returned, (list, tuple)) and len(returned) == len(held)
        values, inner = (list(returned), list(held)) if same else ([], [])
    if not same or len(children) != len(values) or any(c is not v for c, v in zip(children, values)):
        raise TypeError(f"the forward returns a {name} whose pytree flattening does not follow its items: ampfx "
                        "cannot rebuild it from torch.fx's graph")
    specs, leaves = [], []
    for r, h in zip(values, inner):
        spec, more = _respec(r, h)
        specs.append(spec)
        leaves += more
    return TreeSpec(_get_node_type(returned), context, specs), leaves
def _keep_whole(steps: list[str], whole: dict[str, str], found: dict[str, str]) -> bool:
    """Keep the wrapped functions ``found`` (name: why) whole from now on; were any new?"""
    new = {name: why for name, why in found.items() if name not in whole}
    for name, why in new.items():
        whole[name] = why
        steps.append(f"function {name} kept whole (torch.fx.wrap): {why}")
    return bool(new)


def _opaque_functions(graph: fx.Graph, whole: dict[str, str], listed: tuple) -> dict[str, str]:
    """The functions ``torch.fx.wrap`` kept whole in ``graph`` (torch's own, those a table decides and the
    ``listed`` ones aside), each with why: the error that kept it (``whole``), or that it was not traced into
    (no check of the graph would follow)."""
    found = {}
    for node in graph.nodes:
        fn = node.target
        if node.op == "call_function" and node.meta.get("is_wrapped") and _opaque(fn, listed):
            name = ops.qualified_name(fn)
            found[name] = whole.get(name, "torch.fx.wrap keeps it one node: not traced into, as no check of the "
                                          "graph against the module follows (tracer='fx', or no example inputs)")
    return found


def dropped_by(watch: Watch | None) -> tuple[str, ...]:
    """What the watched forward does that its graph does not repeat, one line per module."""
    return tuple(f"{path or 'the root module'!r}: {'; '.join(what)}"
                 for path, what in (watch.dropped.items() if watch is not None else ()))


def _finish(graph: fx.Graph, fixed: dict[str, Any]) -> None:
    """Arguments fixed while tracing keep their names in the converted module's
    signature (fx renames them ``name_1``, which breaks keyword calls), and
    fx's ``_assert_is_none`` guards, which do not survive pickling, become
    ampfx's importable equivalent. A function kept whole that its library also
    ``torch.fx.wrap``-s (torchvision's ``stochastic_depth``) is recorded as
    itself, not as ampfx's wrapper. Containers fixed while tracing become one
    argument again (:func:`_unflatten_fixed`). An annotation that is a string (a forward in a module
    with ``from __future__ import annotations``) is dropped from the graph: fx cannot pickle a graph module
    whose generated code names one, and the code runs the same without it."""
    _unflatten_fixed(graph, fixed)
    for node in graph.nodes:
        if isinstance(node.type, str):
            node.type = None
        if node.op == "placeholder" and isinstance(node.target, str) and node.target.endswith("_1") \
                and node.target[:-2] in fixed:
            node.target = node.target[:-2]
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "_assert_is_none":
            node.target = runtime.assert_is_none
        if node.op == "call_function" and hasattr(node.target, "_ampfx_one_node"):
            node.target = node.target._ampfx_one_node


def _unflatten_fixed(graph: fx.Graph, fixed: dict[str, Any]) -> None:
    """One placeholder per argument fixed at a container (``mix=(0.5, 0.5)``), with the
    container as its default, and fx's own signature again.

    torch.fx gives each leaf of a fixed container its own placeholder (``mix_1``, ``mix_2``),
    each defaulting to the whole container, and then generates a forward that flattens its
    arguments with a pytree spec. That code does not compile when a fixed argument has a
    default (``x, flag_1 = False, ... = tree_flatten_spec(...)``) and takes an extra argument
    when ``forward``'s first parameter is not called ``self``. The traced code reads the fixed
    values themselves, so the leaf placeholders feed only fx's per-leaf asserts; ampfx's guard
    checks the whole value at call time (:mod:`ampfx.runtime.guards`), so they go::

        before: mix_1 = placeholder(); eq_1 = mix_1 == 0.5; _assert(eq_1, ...); mix_2 = ...
        after:  mix = placeholder(default=(0.5, 0.5))
    """
    from torch.fx.graph import CodeGen, _PyTreeCodeGen

    info = getattr(graph._codegen, "pytree_info", None)
    containers = {name for name, value in fixed.items() if not torch.utils._pytree.tree_flatten(value)[1].is_leaf()}
    if not isinstance(graph._codegen, _PyTreeCodeGen) or info is None or not containers:
        return
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    leaf_nodes = {n for n in placeholders if isinstance(n.target, str) and n.target.rpartition("_")[0] in containers
                  and n.target.rpartition("_")[2].isdigit()}
    for ph in leaf_nodes:  # each feeds its assert (and an eq / _assert_is_none before it) only
        for user in reversed(_users_closure(ph)):
            graph.erase_node(user)
        graph.erase_node(ph)
    by_name = {_argument(n.target, fixed): n for n in graph.nodes if n.op == "placeholder"}
    cursor = None
    for name in info.orig_args:  # forward's parameters (then its locals) in order; placeholders follow them
        if name in containers:
            where = graph.inserting_after(cursor) if cursor is not None else graph.inserting_before(
                next(iter(graph.nodes), None))
            with where:
                cursor = graph.placeholder(name, default_value=fixed[name])
        elif name in by_name:
            cursor = by_name[name]
    # the output node holds the flat leaves of the forward's own output, which fx's out_spec rebuilds
    graph._codegen = OutputCodeGen(info.out_spec) if info.out_spec is not None else CodeGen()


def _argument(target: str, fixed: dict[str, Any]) -> str:
    """The forward parameter a placeholder stands for: ``*args`` for ``args``, a fixed ``flag_1`` for ``flag``."""
    target = target.lstrip("*")
    return target[:-2] if target.endswith("_1") and target[:-2] in fixed else target


def _users_closure(node: fx.Node) -> list[fx.Node]:
    """``node``'s users, their users, and so on, in graph order."""
    seen: dict[fx.Node, None] = {}
    todo = list(node.users)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen[n] = None
            todo.extend(n.users)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def reads_mode(model: nn.Module, capture: Capture, policy: Policy) -> bool:
    """Can ``capture``'s graph of ``model`` compute something else in the other training mode?

    torch.export bakes every module's mode into its ops (``aten.dropout(x, 0.1, True)``): any
    module of the tree that reads ``training``. A torch.fx graph calls its leaves (``nn.Dropout``,
    ``nn.BatchNorm2d``, modules that keep their Python), which follow their own flag: only the
    modules it traced through count (:func:`inlined`).

    >>> net = nn.Sequential(nn.Linear(2, 2), nn.Dropout())
    >>> reads_mode(net, trace(net, Policy()), Policy())
    False
    """
    return any(reads_training(type(model.get_submodule(p) if p else model)) for p in inlined(model, capture, policy))


def inlined(model: nn.Module, capture: Capture, policy: Policy, named: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """The paths in ``model`` ('' for itself) of the modules whose ``forward`` ``capture``'s graph traced
    through: every module for torch.export; for torch.fx, those that are neither leaves nor inside one.

    >>> net = nn.Sequential(nn.Linear(2, 2), nn.Dropout())
    >>> inlined(net, trace(net, Policy()), Policy())
    ('', '0')
    """
    if capture.method == "export":
        return tuple(p for p, _ in model.named_modules())
    tracer = AmpTracer(policy, set(capture.leaves) | set(capture.kept), named=named)
    found, stack = [], [("", model)]
    while stack:  # the modules traced through: not leaves, nor inside one (containers are looked into)
        name, m = stack.pop()
        found.append(name)
        stack.extend((f"{name}.{n}" if name else n, c) for n, c in reversed(list(m.named_children()))
                     if _container(c) or not _is_leaf(tracer, c, f"{name}.{n}" if name else n))
    return tuple(found)


def _container(m: nn.Module) -> bool:
    """A module without a ``forward`` of its own (``nn.ModuleList``, ``nn.ModuleDict``): never called, its
    modules are called by the code around it."""
    forward = inspect.getattr_static(type(m), "forward", None)  # a ScriptModule's class attribute raises on read
    return getattr(forward, "__name__", "") == "_forward_unimplemented"


def _is_leaf(tracer: AmpTracer, m: nn.Module, name: str) -> bool:
    try:
        return tracer.is_leaf_module(m, name)
    except Exception:  # noqa: BLE001
        return True


