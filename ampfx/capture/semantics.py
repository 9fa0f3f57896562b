"""What a forward does that a captured graph would not repeat, seen while it is captured.

``torch.fx`` records the tensor ops it sees on proxies; everything else the
forward's Python does happens once, while tracing, and never again:

- grad-mode regions (``torch.no_grad()``, ``enable_grad``, ``set_grad_enabled``,
  ``inference_mode``): their ops are recorded as plain ops, so parameters used
  only under ``no_grad`` are trained by the graph;
- ``torch.autocast(..., enabled=True)`` regions: the ops are recorded without the autocast;
- a ``torch.autograd.Function``: its forward's ops are recorded, its own backward is lost;
- buffers are real tensors while tracing: ``self.count += 1``, ``self.avg.mul_(0.9)``
  and ``self.count = self.count + 1`` change the buffer once, at trace time;
- Python attributes set by the forward (``self.calls += 1``, ``self.cache = h``).

:class:`Watch` sees these while a graph is captured (no example inputs
needed) and lists them in :attr:`Watch.dropped`; it also puts the module
state it saw change back as it was. ``torch.autocast(..., enabled=False)`` is
not dropped: it is the user's request that the ops inside stay float32, and
the nodes created inside carry it in ``node.meta`` (:data:`ampfx.meta.USER_FLOAT32`)
for the classify pass.

The context managers are seen by wrapping their ``__enter__`` / ``__exit__``
(and ``Function.apply``) for the duration of the capture only, as ``torch.fx``
itself wraps ``nn.Module.__call__`` while tracing: one capture at a time per
process (:mod:`ampfx.threads`), and a watch sees only the thread it was entered in
(another thread's ``no_grad`` block is not the traced forward's).

>>> import torch, torch.fx as fx
>>> class Net(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.register_buffer("count", torch.zeros(()))
...     def forward(self, x):
...         self.count += 1
...         with torch.no_grad():
...             return x * 2
>>> net = Net()
>>> with Watch(net) as w:
...     _ = fx.symbolic_trace(net)
>>> w.dropped
{'': ("buffer 'count' changed in place",)}
>>> int(net.count)  # put back
0
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
import torch.nn as nn
from torch.autograd import grad_mode
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from ..meta import USER_FLOAT32
from ..policy.module_match import TRACED_PRE_HOOKS
from ..state import refill


class Kind(enum.Enum):
    """What a region of the forward asks for, and whether a graph keeps it."""

    GRAD = "a grad-mode region: the graph records plain ops (parameters used under no_grad would be trained)"
    AUTOCAST = "an autocast region: the graph records the ops without it"
    FLOAT32 = "the user's float32 request: kept (the nodes inside stay float32)"
    FUNCTION = "an autograd.Function: the graph records its forward's ops, its own backward is lost"
    SAVED = ("a saved-tensor hooks region (torch.utils.checkpoint, save_on_cpu): the graph records its ops once, "
             "without the hooks (no recompute in backward: the memory saving and the recompute's effects are lost)")


@dataclass(frozen=True)
class Scope:
    """One region of the forward open while a node was created: its kind, how the user wrote it,
    and the path of the module whose forward opened it."""

    kind: Kind
    text: str
    path: str = ""


GRAD_CONTEXTS: tuple[type, ...] = (grad_mode.no_grad, grad_mode.enable_grad, grad_mode.set_grad_enabled,
                                   grad_mode.inference_mode)
"""The grad-mode context managers (also used as decorators) that a graph does not record."""

EXPORT_DROPS: tuple[type, ...] = (grad_mode.inference_mode, torch.autograd.graph.saved_tensors_hooks)
"""The context managers torch.export does not keep either (it keeps grad-mode and autocast regions as
higher-order ops, but records the ops under ``inference_mode`` and saved-tensor hooks as plain ones)."""

class Dropped(BaseException):
    """Raised (under torch.export) when a module's forward did what the graph would not repeat: the capture
    stops there. A ``BaseException``: export's own ``except Exception`` handlers must not swallow it."""


_INTERNAL = frozenset({"_parameters", "_buffers", "_modules", "training"})
_FX_OWN = frozenset({"_graph", "_code", "_lineno_map", "_prologue_start", "_tracer_cls", "_tracer_extras", "_in_spec",
                     "_out_spec", "_erased", "meta", "shape_env"})
"""What a ``GraphModule`` sets of itself when it first runs (a lazy one, as dynamo hands a backend, compiles its code
then): bookkeeping of torch.fx, never the model's computation."""


def _internal(m: nn.Module) -> frozenset[str]:
    return _INTERNAL | _FX_OWN if isinstance(m, torch.fx.GraphModule) else _INTERNAL


_ACTIVE: list[Watch] = []  # the watches entered and not yet left, in every thread (:func:`_watching`)


def _watching() -> Watch | None:
    """The innermost active :class:`Watch` entered in the calling thread."""
    me = threading.get_ident()
    return next((w for w in reversed(_ACTIVE) if w.thread == me), None)


def _describe(cm: Any) -> Scope:
    """The scope a context manager opens, as the user wrote it."""
    if isinstance(cm, torch.autograd.graph.saved_tensors_hooks):
        return Scope(Kind.SAVED, f"{type(cm).__module__}.{type(cm).__qualname__}")
    if isinstance(cm, torch.autocast):
        args = f"{cm.device!r}, dtype={str(cm.fast_dtype).replace('torch.', '')}"
        if not cm._enabled:
            return Scope(Kind.FLOAT32, f"torch.autocast({cm.device!r}, enabled=False)")
        return Scope(Kind.AUTOCAST, f"torch.autocast({args})")
    mode = getattr(cm, "mode", getattr(cm, "prev", None))
    name = type(cm).__name__
    return Scope(Kind.GRAD, f"torch.{name}({mode})" if name in ("set_grad_enabled", "inference_mode")
                 else f"torch.{name}()")


class Watch:
    """Watches one capture of ``root`` (see the module docstring). ``dropped`` maps a module path
    ('' for the root) to what that module's forward does that the graph would not repeat."""

    def __init__(self, root: Any, *, export: bool = False) -> None:
        self.root = root if isinstance(root, nn.Module) else None
        # torch.export keeps grad-mode and autocast regions and buffer updates (it functionalises them), but
        # traces through an autograd.Function and runs the Python once: any Function call and any Python
        # attribute the forward sets count (export creates no proxies to stamp)
        self.export = export
        self.scopes: list[tuple[int, Scope]] = []
        self.dropped: dict[str, tuple[str, ...]] = {}
        self.python_state = False  # a Python attribute was set: torch.export would not repeat it either
        self.grad = self.inference = False
        self._stack = contextlib.ExitStack()  # undoes the wrappings (set by __enter__)
        self.where: Callable[[], str] = lambda: ""  # the tracer says which module's forward runs now
        self.own: set[str] = set()  # get_attr targets of the graph: fx stores its constants on the root
        self._state: dict[str, _ModuleState] = {}
        self._paths: dict[int, str] = {}  # id of each watched module -> its path (under export)
        self._slots: dict[int, list[dict[str, Any]]] = {}  # its buffers as each of its running forwards began
        self.written: set[int] = set()  # ids of watched modules an attribute was set on (under export)
        self.thread: int | None = None  # the thread it watches (set by __enter__)

    def __enter__(self) -> Watch:
        self.grad, self.inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        self.thread = threading.get_ident()
        if self.root is not None:
            self._state = {path: _ModuleState.of(m) for path, m in self.root.named_modules()}
        with contextlib.ExitStack() as stack:  # a wrapping that fails undoes those made before it
            for cls in (*GRAD_CONTEXTS, torch.autocast, torch.autograd.graph.saved_tensors_hooks):
                stack.enter_context(_wrapped_context(cls))
            stack.enter_context(_wrapped_apply())
            if self.export and self._state:
                self._paths = {id(s.module): p for p, s in self._state.items()}
                stack.enter_context(_noted_writes(self))
                stack.callback(register_module_forward_pre_hook(self._note_buffers).remove)
                stack.callback(register_module_forward_hook(self._stop_at_attribute).remove)
            self._stack = stack.pop_all()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)
        self._stack.close()
        for path, state in self._state.items():
            for change, of_tensor in state.put_back(self.own if not path else set()):
                if not (self.export and of_tensor):
                    self.drop(path, change)
                    self.python_state = self.python_state or not of_tensor

    def _note_buffers(self, module: nn.Module, args: Any) -> None:
        if threading.get_ident() != self.thread:  # a global hook: another thread's module calls are not watched
            return
        self._stop_at_written(module)
        if self._paths.get(id(module)):  # a submodule (the root's re-assigned buffers export keeps)
            self._slots.setdefault(id(module), []).append(dict(module._buffers))

    def _stop_at_written(self, running: nn.Module) -> None:
        """A module whose forward is not running had a Python attribute set that feeds the computation (a
        method of it called from its parent's forward: RAFT's ``corr_block.build_pyramid``): say so at the next
        module call, instead of after tracing the rest of the model (a module's own forward is checked as
        it ends)."""
        for key in [k for k in self.written if k != id(running) and k not in self._slots_running()]:
            self.written.discard(key)
            path = self._paths[key]
            changed = self._state[path].unfaithful()
            if changed and path:  # the root's own attributes: its forward's end says
                for words in changed:
                    self.drop(path, words)
                raise Dropped(f"{path!r}: {'; '.join(changed)}")

    def _slots_running(self) -> set[int]:
        return {k for k, held in self._slots.items() if held}

    def _stop_at_attribute(self, module: nn.Module, args: Any, output: Any) -> None:
        """torch.export runs the Python once: a module whose forward set a Python attribute that feeds the
        computation (a cache of attention biases) makes the capture unfaithful, and so does a submodule
        whose forward re-assigns a buffer (``self.n = self.n + 1``): non-strict export records that as a
        ``copy_`` for the root module only, and drops it for a submodule. Say so when that forward ends,
        instead of after tracing the rest of the model."""
        path = self._paths.get(id(module))
        if path is None or threading.get_ident() != self.thread:
            return
        self._stop_at_written(module)
        self.written.discard(id(module))
        changed = self._state[path].unfaithful()
        held = self._slots.get(id(module))
        if held:
            before = held.pop()
            changed += [f"buffer {k!r} re-assigned" for k, b in module._buffers.items() if before.get(k) is not b]
        if changed:
            for words in changed:
                self.drop(path, words)
            raise Dropped(f"{path or 'the root module'!r}: {'; '.join(changed)}")

    def drop(self, path: str, what: str) -> None:
        """Record that the forward of the module at ``path`` does ``what``, which the graph would not repeat."""
        if what not in self.dropped.get(path, ()):
            self.dropped[path] = (*self.dropped.get(path, ()), what)

    def stamp(self, node: fx.Node) -> None:
        """Called for every node the tracer creates: note the regions it was created in."""
        if node.op == "get_attr":
            self.own.add(str(node.target))
        if node.op not in ("call_function", "call_method", "call_module"):
            return
        out = node.kwargs.get("out")
        if isinstance(out, fx.Node) and out.op == "get_attr":  # torch.add(y, 1, out=self.buf)
            what = ("a tensor the forward made while tracing" if str(out.target).startswith("_tensor_constant")
                    else f"{str(out.target)!r}")
            self.drop(self.where(), f"writes into {what} with out=: torch.fx computes the reads of it that use "
                                    "no traced value once, while tracing")
        for _, scope in self.scopes:
            if scope.kind is Kind.FLOAT32:
                node.meta[USER_FLOAT32] = f"inside {scope.text} in {scope.path or 'the root module'!r}"
            else:
                self.drop(scope.path, f"{scope.text}: {scope.kind.value}")
        if torch.is_grad_enabled() != self.grad or torch.is_inference_mode_enabled() != self.inference:
            self.drop(self.where(), "the grad mode is changed (torch.set_grad_enabled / inference_mode): "
                                    f"{Kind.GRAD.value}")

    def enter(self, key: int, scope: Scope) -> None:
        self.scopes.append((key, dataclasses.replace(scope, path=self.where())))

    def exit(self, key: int) -> None:
        for i in range(len(self.scopes) - 1, -1, -1):
            if self.scopes[i][0] == key:
                del self.scopes[i]
                return


@contextlib.contextmanager
def python_changes(model: nn.Module) -> Iterator[dict[str, tuple[str, ...]]]:
    """The modules of ``model`` (paths, '' for ``model``) whose Python state a call of ``model`` in the block
    changed in a way a graph would not repeat (:meth:`_ModuleState.unfaithful`), in words, from the start
    of its forward to its end (``model``'s own hooks are outside: they stay Python around a graph); filled
    when that forward ends, and nothing is put back (the caller's :func:`~ampfx.state.kept_attributes`
    does that). A real run of the model that shows one tells, before torch.export is tried, that its
    graph would be unfaithful.

    >>> class Cached(nn.Linear):
    ...     def forward(self, x):
    ...         self.cache.setdefault("w", self.weight * 2)
    ...         return x @ self.cache["w"].t()
    >>> net = nn.Sequential(Cached(2, 2)); net[0].cache = {}
    >>> with python_changes(net) as seen:
    ...     _ = net(torch.ones(1, 2))
    >>> seen
    {'0': ("attribute 'cache' changed in place",)}
    """
    seen: dict[str, tuple[str, ...]] = {}
    before: list[tuple[str, _ModuleState]] = []

    def start(module: nn.Module, args: Any) -> None:
        before[:] = [(path, _ModuleState.of(m, tensors=False)) for path, m in model.named_modules()]

    def end(module: nn.Module, args: Any, output: Any) -> None:
        for path, state in before:
            changed = state.unfaithful()
            if changed:
                seen[path] = tuple(changed)

    # the forward itself, inside the model's own hooks: those stay Python around an exported graph
    # (`self.last = out.detach()` in a forward hook on it does not make its graph unfaithful)
    handles = [model.register_forward_pre_hook(start), model.register_forward_hook(end, prepend=True)]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _wrapped_context(cls: type) -> Iterator[None]:
    """``cls.__enter__`` / ``__exit__`` tell the active :class:`Watch`, until the block ends."""
    enter, exit_ = cls.__dict__["__enter__"], cls.__dict__["__exit__"]

    def watched_enter(cm: Any) -> Any:
        out = enter(cm)
        watch = _watching() if _ACTIVE else None
        if watch is not None:
            scope = _describe(cm)
            watch.enter(id(cm), scope)
            if watch.export and isinstance(cm, EXPORT_DROPS) and getattr(cm, "mode", True):
                watch.drop("", f"{scope.text}: {scope.kind.value}")
        return out

    def watched_exit(cm: Any, *exc: Any) -> Any:
        watch = _watching() if _ACTIVE else None
        if watch is not None:
            watch.exit(id(cm))
        return exit_(cm, *exc)

    cls.__enter__, cls.__exit__ = watched_enter, watched_exit
    try:
        yield
    finally:
        cls.__enter__, cls.__exit__ = enter, exit_


DERIVATIVE_FUNCTIONS = frozenset({"torch._dynamo._trace_wrapped_higher_order_op.ModIndex"})
"""``autograd.Function`` classes whose backward is exactly the derivative of their forward's ops
(``ModIndex``: ``aten.index`` forward, a scatter backward; HF's attention masks use it under
``torch.vmap``). A graph of their forward's ops gets their gradients right, so they do not make a
capture unfaithful. Any other Function may define any backward (a straight-through estimator;
reentrant checkpointing, whose forward runs without gradients) and keeps its module's Python."""


def _derivative_only(cls: type) -> bool:
    """Is ``cls`` one of :data:`DERIVATIVE_FUNCTIONS`, or torch's vmapped variant of one?

    >>> from torch._dynamo._trace_wrapped_higher_order_op import ModIndex
    >>> _derivative_only(ModIndex), _derivative_only(torch.utils.checkpoint.CheckpointFunction)
    (True, False)
    """
    name = cls.__name__
    if cls.__module__ == "torch._functorch.autograd_function":  # torch.vmap's generated classes
        while name.startswith("Vmapped"):
            name = name[len("Vmapped"):]
        return any(f.rsplit(".", 1)[1] == name for f in DERIVATIVE_FUNCTIONS)
    return f"{cls.__module__}.{name}" in DERIVATIVE_FUNCTIONS


def _op_autograd(cls: type) -> bool:
    """Is ``cls`` the autograd kernel torch.library makes for a custom op (``GeneratedBackwardFor_<ns>_<op>_<overload>``,
    applied inside the op's call)? The graph records the op itself, whose kernel runs again when the graph runs: its
    backward is kept."""
    return cls.__module__ == "torch._library.autograd"


@contextlib.contextmanager
def _noted_writes(watch: Watch) -> Iterator[None]:
    """``nn.Module.__setattr__`` notes in ``watch.written`` the watched modules an attribute is set on, until
    the block ends."""
    original = nn.Module.__setattr__
    paths = watch._paths

    def __setattr__(self: nn.Module, name: str, value: Any) -> None:
        if id(self) in paths and threading.get_ident() == watch.thread:
            watch.written.add(id(self))
        original(self, name, value)

    nn.Module.__setattr__ = __setattr__
    try:
        yield
    finally:
        nn.Module.__setattr__ = original


@contextlib.contextmanager
def _wrapped_apply() -> Iterator[None]:
    """``torch.autograd.Function.apply`` tells the active :class:`Watch`, until the block ends."""
    function = torch.autograd.Function
    original = function.__dict__["apply"]  # a classmethod (torch 2.13) or a C classmethod_descriptor (2.14)

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        watch = _watching() if _ACTIVE else None
        scope = Scope(Kind.FUNCTION, f"torch.autograd.Function {cls.__qualname__}")
        if watch is None or _derivative_only(cls) or _op_autograd(cls):
            return original.__get__(None, cls)(*args, **kwargs)
        if watch.export:
            watch.drop("", f"{scope.text}: {scope.kind.value}")
        key = object()
        watch.enter(id(key), scope)
        try:
            return original.__get__(None, cls)(*args, **kwargs)
        finally:
            watch.exit(id(key))

    function.apply = classmethod(apply)
    try:
        yield
    finally:
        function.apply = original


_MISSING = object()


@dataclass(frozen=True)
class _ModuleState:
    """One module's Python attributes, parameters and buffers (objects and versions, buffer values)."""

    module: nn.Module
    attrs: dict[str, Any]
    tensors: dict[str, tuple[str, Any, int]]
    values: dict[str, torch.Tensor]
    contents: dict[str, Any] = dataclasses.field(default_factory=dict)  # a copy of each list or dict attribute

    @classmethod
    def of(cls, m: nn.Module, tensors: bool = True) -> _ModuleState:
        """The module's state now (``tensors=False``: its Python attributes only)."""
        internal = _internal(m)
        attrs = {k: v for k, v in vars(m).items() if k not in internal}
        contents = {k: v.copy() for k, v in attrs.items() if type(v) in (list, dict)}
        if not tensors:
            return cls(m, attrs, {}, {}, contents)
        tensors = {**{n: ("parameter", p, p._version) for n, p in m._parameters.items() if p is not None},
                   **{n: ("buffer", b, b._version) for n, b in m._buffers.items() if b is not None}}
        values = {n: b.detach().clone() for n, b in m._buffers.items()
                  if b is not None and b.device.type != "meta"}  # `.data` writes leave no version
        return cls(m, attrs, tensors, values, contents)

    def put_back(self, own: set[str]) -> list[tuple[str, bool]]:
        """Undo what the capture changed in this module's attributes and buffers (parameters'
        values are the caller's: only buffers are copied); what changed, in words, and whether
        it is a parameter or buffer. ``own`` names attributes the tracer itself set (its constants)."""
        changes, now = [], vars(self.module)
        for name, (what, obj, version) in self.tensors.items():
            store = self.module._parameters if what == "parameter" else self.module._buffers
            if (store[name] if name in store else None) is not obj:  # a ScriptModule's store has no .get
                changes.append((f"{what} {name!r} reassigned", True))
                store[name] = obj
            elif obj._version != version or (name in self.values and not _same(self.values[name], obj)):
                changes.append((f"{what} {name!r} changed in place", True))
            if name in self.values and not _same(self.values[name], obj):
                with torch.no_grad():
                    obj.copy_(self.values[name])
        for key, words in self.attr_changes(own):
            if words is not None:
                changes.append((words, False))
            if key in self.attrs:
                now[key] = self.attrs[key]
            else:
                del now[key]
        changes += [(words, False) for words in self.filled(now)]
        for key, copy in self.contents.items():  # a cache filled while tracing holds proxies or fakes
            if now.get(key) is self.attrs[key]:
                refill(now[key], copy)
        return changes

    def filled(self, now: dict[str, Any]) -> list[str]:
        """The list and dict attributes changed in place since :meth:`of` whose contents can feed the
        computation (a cache of tensors a forward fills: a graph would not fill it), in words."""
        return [f"attribute {key!r} changed in place" for key, copy in self.contents.items()
                if now.get(key) is self.attrs[key] and _items(now[key]) != _items(copy) and _computes(now[key])]

    def unfaithful(self) -> list[str]:
        """What the module's forward changed since :meth:`of` that a graph, which runs the Python once, would
        not repeat, in words: a Python attribute set or changed that feeds the computation (a tensor too,
        except the weight a traced pruning / weight_norm pre-hook sets on every call), a list or dict filled."""
        now = vars(self.module)
        hooked = {getattr(h, "_tensor_name", None) or getattr(h, "name", None)
                  for h in self.module._forward_pre_hooks.values() if isinstance(h, TRACED_PRE_HOOKS)}
        changed = [words for key, words in self.attr_changes(set())
                   if words is not None and not (key in hooked and isinstance(now.get(key), torch.Tensor))]
        return changed + self.filled(now)

    def attr_changes(self, own: set[str]) -> list[tuple[str, str | None]]:
        """Each Python attribute set or changed since :meth:`of`, with what changed in words (``None``:
        bookkeeping that cannot feed the computation, :func:`_computes`); changes nothing."""
        now, out, internal = vars(self.module), [], _internal(self.module)
        for key in [k for k in now if k not in internal and k not in self.attrs and k not in own]:
            out.append((key, f"attribute {key!r} set{_traced(now[key])}" if _computes(now[key]) else None))
        for key, value in self.attrs.items():
            if not _unchanged(value, now.get(key, _MISSING)):
                feeds = _computes(value) or _computes(now.get(key))
                out.append((key, f"attribute {key!r} changed{_traced(now.get(key))}" if feeds else None))
        return out


def _computes(value: Any) -> bool:
    """Can this attribute value feed the computation: a tensor, a traced value, a number or flag
    (a counter, ``self.first = False``), or a container of tensors? Bookkeeping containers (a
    library's dict of warnings issued or of sharding plans) are put back but do not make the
    graph unfaithful.

    >>> _computes(3), _computes(torch.ones(1)), _computes({"warned": True}), _computes([torch.ones(1)])
    (True, True, False, True)
    """
    if isinstance(value, (list, tuple, dict)):
        return any(isinstance(v, (torch.Tensor, fx.Proxy)) for v in torch.utils._pytree.tree_leaves(value))
    return isinstance(value, (torch.Tensor, fx.Proxy, int, float))


def _items(value: Any) -> tuple:
    """The ids of a list's items or of a dict's keys and values: a cache filled in place changes them."""
    pairs = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    return tuple((k, id(v)) for k, v in pairs)


def _unchanged(old: Any, new: Any) -> bool:
    """The same object, or an equal plain value (torch.export rebuilds ``LayerNorm.normalized_shape``)."""
    if old is new:
        return True
    if type(old) is not type(new) or not isinstance(old, (int, float, str, bytes, tuple, frozenset, type(None))):
        return False
    try:
        return _traced(new) == "" and bool(old == new)
    except Exception:  # noqa: BLE001 - a value without a plain equality is taken as changed
        return False


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b.detach()))


def _traced(value: Any) -> str:
    leaves = torch.utils._pytree.tree_leaves(value) if isinstance(value, (list, tuple, dict)) else [value]
    return " to a traced value" if any(isinstance(v, fx.Proxy) for v in leaves) else ""
