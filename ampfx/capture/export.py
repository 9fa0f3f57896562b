"""Capturing a model with ``torch.export``: an ATen-level ``torch.fx`` graph.

``torch.fx`` symbolic tracing runs the model's Python on proxies and fails
on data-dependent Python (``torch.finfo(x.dtype)``, shape checks, caches).
``torch.export`` runs it on fake tensors instead and records the ATen ops
it reaches, so it captures many models ``torch.fx`` cannot. ampfx uses the
non-strict export (plain Python execution, no TorchDynamo) and the
pre-dispatch ("training") IR, where ``aten.linear``, ``aten.conv2d``,
``aten.layer_norm`` and ``aten.softmax.int`` survive undecomposed; the op
tables (:mod:`ampfx.ops`) map them to the same names as ``F.linear``,
``nn.Conv2d``, ... so one policy governs both front-ends.

What :func:`capture` does with the exported program:

- unlifts it (``ExportedProgram.module()``): parameters and buffers become
  ``get_attr`` nodes named by their place in the model
  (``encoder.layer.0.attention.self.query.weight``), so the converted module
  reads the model's own tensors (float32 masters, running statistics) and
  ``state_dict()`` is unchanged; tensor constants that export lifted out of
  the model's code become non-persistent buffers of the converted module;
- exports in the model's current training mode only: the exported graph has
  the mode baked in (``aten.dropout(x, 0.1, True)``); the other mode is
  converted on its own, as converting the model in that mode would
  (:mod:`ampfx.tree`), and ``.train()`` / ``.eval()`` switch between them;
- asks for every input dimension to be dynamic (``Dim.AUTO``), so the graph
  is not specialised to the example's batch size or sequence length where
  the model allows it; sizes the model fixes stay fixed;
- drops export's input guards and its ``_assert_tensor_metadata`` checks:
  the latter assert the dtypes the model had, which conversion changes on
  purpose;
- keeps each node's module path (from ``nn_module_stack``), so records
  carry ``module='encoder.layer.0.attention.self.query'`` and
  ``fp32_modules`` applies.

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1))
>>> cap = capture(net, ExampleInputs.of((torch.randn(2, 4),)))
>>> [str(n.target) for n in cap.graph.nodes if n.op == "call_function"]
['aten.linear.default', 'aten.softmax.int']
>>> cap.method
'export'
"""
from __future__ import annotations

import contextlib
import inspect
import io
import logging
import operator
import signal
import sys
import threading
import time
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import ExportFailed, Unfaithful
from ..inputs import ExampleInputs, snapshot
from ..meta import USER_FLOAT32, node_module_path
from ..policy.module_match import TRACED_PRE_HOOKS
from ..runtime.guards import read_by_key
from ..state import kept_attributes, kept_random, untouched, without_hooks
from ..threads import converting
from . import fold
from .base import Capture, short
from .fold import Folding
from .semantics import Dropped, Watch, python_changes
from .tracer import dropped_by

MIN_TORCH = (2, 5)
"""``torch.export`` with the non-strict mode and the pre-dispatch IR (older torch decomposes to core ATen)."""


def unavailable() -> str | None:
    """Why this torch cannot run the export front-end, or ``None`` if it can.

    >>> unavailable() is None  # doctest: +SKIP
    True
    """
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2] if p.isdigit())
    if version < MIN_TORCH or not hasattr(torch, "export"):
        return (f"the torch.export front-end needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} "
                f"(this is {torch.__version__}); use tracer='fx' or upgrade torch")
    return None


class ExportTimeout(BaseException):
    """``torch.export`` ran past its time limit (``Policy.export_timeout``). A ``BaseException``, as
    ``KeyboardInterrupt`` is: export's own ``except Exception`` handlers must not swallow it."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[str | None]:
    """Raise :class:`ExportTimeout` in the block once ``seconds`` have passed (a ``SIGALRM`` timer);
    yields why there is no limit (``None``: there is one). No limit without ``seconds``, off the main
    thread, where the platform has no interval timer, or while another timer of the process runs.

    >>> with time_limit(None) as why:
    ...     why
    'no export_timeout'
    """
    if not seconds:
        yield "no export_timeout"
        return
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield "export_timeout not applied: it needs the main thread of a platform with signal.setitimer"
        return
    if signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        yield "export_timeout not applied: another interval timer of this process is running"
        return

    def expire(signum: int, frame: Any) -> None:
        if _importing(frame, outer):  # an import cut short leaves a half-made module in sys.modules for good
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            return
        raise ExportTimeout(f"torch.export took longer than {seconds:g} s")

    outer = sys._getframe(1)  # the frame with the block: imports already under way around it are not its
    while outer is not None and outer.f_code.co_filename == contextlib.__file__:
        outer = outer.f_back
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


STALL_SECONDS = 1.0
STALL_RATIO = 25.0
"""A try with dynamic sizes is abandoned (the next try takes over) when one module's forward takes longer
than both :data:`STALL_SECONDS` and :data:`STALL_RATIO` times the average of the modules before it:
export's symbolic size analysis has met arithmetic on sizes it cannot simplify (``ceil(H / p) * p``
reshapes of a conv/attention hybrid took 2-7 s each, against milliseconds for a module elsewhere).
Relative to the average, so a slower or loaded machine does not change the verdict."""


class ExportStalled(ExportTimeout):
    """A dynamic-size try stalled on one module (:data:`STALL_RATIO`)."""


@contextlib.contextmanager
def stall_limit(model: nn.Module, active: bool) -> Iterator[None]:
    """While ``active``, raise :class:`ExportStalled` at the end of a module's forward that stalled
    (:data:`STALL_SECONDS`); a forward hook on every module, removed when the block ends.

    >>> with stall_limit(nn.Linear(2, 2), active=True):
    ...     pass
    """
    if not active:
        yield
        return
    from torch.nn.modules.module import register_module_forward_hook

    names = {id(m): path or "the root module" for path, m in model.named_modules()}
    first = last = 0.0  # times from the first module's end: export's setup before it is not a module's time
    ends = 0  # module ends after the first

    thread = threading.get_ident()

    def check(module: nn.Module, args: Any, output: Any) -> None:
        nonlocal first, last, ends
        if threading.get_ident() != thread:  # a global hook: other threads' modules are not export's
            return
        now = time.perf_counter()
        if not first:
            first = last = now
            return
        took, average = now - last, (last - first) / ends if ends else None
        if average is not None and took > max(STALL_SECONDS, STALL_RATIO * average):
            raise ExportStalled(f"symbolic size analysis stalled: {took:.1f} s passed before the forward of "
                                f"{names.get(id(module), type(module).__name__)!r} ended, "
                                f"{took / max(average, 1e-9):.0f}x the average module before it")
        last, ends = now, ends + 1

    handle = register_module_forward_hook(check)
    try:
        yield
    finally:
        handle.remove()


def _importing(frame: Any, outer: Any = None) -> bool:
    """Is a module being imported on ``frame``'s stack, below ``outer`` (torch imports parts of itself
    lazily)? Frames from ``outer`` up (the code around the timed block, which may itself run inside
    an import) do not count."""
    while frame is not None and frame is not outer:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _short(e: BaseException) -> str:
    """:func:`~ampfx.capture.base.short`, with the fix for the export error HF caches give."""
    text = short(e)
    if "Cache" in text and ("not a known type" in text or "Unsupported input type" in text):
        text += (" (HF models: give use_cache=False in example_inputs, a training forward needs no cache; or "
                 "call transformers.integrations.executorch.register_dynamic_cache_export_support() first)")
    return text


def _auto_dims(fn: Any, args: tuple, kwargs: dict, every: bool = True) -> Any:
    """``Dim.AUTO`` for every dimension of every tensor input (export keeps
    static what the model needs static), or for the first dimension alone (not ``every``);
    ``None`` where this torch has no ``Dim.AUTO`` or the inputs do not bind to ``fn``.

    torch.export matches ``dynamic_shapes`` to the inputs bound to ``forward``'s signature
    (``inspect.Signature.bind``): one entry per parameter given, by name, a ``*args`` parameter's
    entry a tuple of its values' specs and a ``**kwargs`` one's a dict of them.

    >>> def forward(x, *xs, scale=1.0, **extra): ...
    >>> dims = _auto_dims(forward, (torch.ones(2, 3), torch.ones(2), torch.ones(2)), {"mask": torch.ones(2)})
    >>> {name: type(spec).__name__ for name, spec in dims.items()}
    {'x': 'dict', 'xs': 'tuple', 'extra': 'dict'}
    >>> len(dims["xs"]), list(dims["extra"])
    (2, ['mask'])
    """
    auto = getattr(getattr(torch.export, "Dim", None), "AUTO", None)
    if auto is None:
        return None

    def spec(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return {i: auto for i in range(v.dim() if every else min(v.dim(), 1))} or None
        if isinstance(v, (tuple, list)):
            items = [spec(x) for x in v]
            return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)  # a namedtuple takes fields
        if isinstance(v, dict):
            return {k: spec(x) for k, x in v.items()}
        return None

    try:
        bound = inspect.signature(fn).bind(*args, **kwargs).arguments
    except TypeError:  # export itself reports the call that does not bind
        return None
    return {name: spec(v) for name, v in bound.items()}


def _marked(fn: Any, args: tuple, kwargs: dict, dynamic: Any) -> Any:
    """``dynamic`` (from :func:`_auto_dims`), or ``None`` where it is given as marks on the tensors instead:
    where a ``**kwargs`` parameter receives values. torch.export's constraint step (torch 2.13) matches
    ``dynamic_shapes`` against the inputs re-ordered as the call gave them, with the ``**kwargs``
    entries beside the parameter that holds them, and fails on the documented structure; it reads
    ``torch._dynamo.maybe_mark_dynamic``'s marks the same way as ``Dim.AUTO`` (dynamic, specialised
    where the model needs it). ``args`` and ``kwargs`` are the export's own copies: the marks go
    nowhere else."""
    params = inspect.signature(fn).parameters.values()
    var_keyword = next((p.name for p in params if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    if dynamic is None or var_keyword not in dynamic:
        return dynamic
    bound = inspect.signature(fn).bind(*args, **kwargs).arguments

    def mark(value: Any, spec: Any) -> None:
        if isinstance(value, torch.Tensor):
            if spec:
                torch._dynamo.maybe_mark_dynamic(value, sorted(spec))
        elif isinstance(value, (tuple, list)) and isinstance(spec, (tuple, list)):
            for v, s in zip(value, spec):
                mark(v, s)
        elif isinstance(value, dict) and isinstance(spec, dict):
            for k, v in value.items():
                mark(v, spec.get(k))

    for name, value in bound.items():
        mark(value, dynamic.get(name))
    return None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch.export prints the partial graph to stderr when it fails and logs
    warnings; ampfx records the error in the report instead."""
    names = ("torch.export", "torch._export", "torch.fx.experimental.symbolic_shapes", "torch._dynamo")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _export(model: nn.Module, args: tuple, kwargs: dict, dynamic: Any, folds: Folding | None = None) -> Any:
    """One export of ``model``; with ``folds``, its small integer buffers are read as their values
    (:mod:`ampfx.capture.fold`), and ``folds`` says which the forward read."""
    fn = getattr(torch.export, "export_for_training", None) or torch.export.export
    # a copy each time: non-strict export runs the model's Python, which may change Python objects it is
    # given (caches), also when it fails
    args, kwargs = snapshot((args, kwargs))
    dynamic = _marked(model.forward, args, kwargs, dynamic)
    # torch's own draws run on fake tensors (a branch on one stops export); Python's and numpy's are real
    try:
        # kept_attributes: a cache filled with fake tensors is emptied again
        with converting(), _folded(model, folds), kept_attributes(model, bookkeeping=False), torch.enable_grad(), \
                _quiet(), Watch(model, export=True) as watch, kept_random(torch_too=False) as draws, _no_stack_traces():
            ep = fn(model, args, kwargs, strict=False, dynamic_shapes=dynamic)
    except Dropped:  # the watch stopped export where a forward did what the graph would not repeat
        pass
    if watch.dropped:
        raise Unfaithful(f"torch.export would drop what the forward does ({'; '.join(dropped_by(watch))})",
                         tuple(watch.dropped))
    if draws.drew:
        raise RuntimeError("the model's Python drew a random number (random / numpy) while being exported: the "
                           "graph would take that draw's branch on every call")
    return ep


@contextlib.contextmanager
def _folded(model: nn.Module, folds: Folding | None) -> Iterator[None]:
    """:func:`ampfx.capture.fold.folding` into ``folds`` (its ``read`` set after the block), or nothing."""
    if folds is None:
        yield
        return
    with fold.folding(model) as found:
        yield
    folds.read = found.read


def _data_dependent(e: BaseException) -> bool:
    """Did export stop at Python asking for a tensor's value (``int(t)``, ``max(t, 0)``, ``if t:``)?"""
    text = f"{type(e).__name__} {e}"
    return "DataDependent" in text or "data-dependent" in text


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    """Export without recording each node's Python stack (``torch.fx.config.do_not_emit_stack_traces``,
    where this torch has it): extracting and symbolising a traceback for every node took a tenth of an export
    (EfficientViT-M0: 0.7 of 7 s), and nothing here reads ``node.meta["stack_trace"]`` (torch.fx
    captures have none either); the records name each node's module instead."""
    config = getattr(fx, "config", None)
    if config is None or not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    before, config.do_not_emit_stack_traces = config.do_not_emit_stack_traces, True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def _about_sizes(e: BaseException) -> bool:
    """Did export fail over dynamic sizes (then static sizes may work)? A symbolic number where Python wanted a
    tensor or a plain number counts: ``torch.ceil(length / self.stride)`` gets a ``SymFloat`` where the length is
    symbolic, and a tensor of the stride's value where it is the example's."""
    text = f"{type(e).__name__} {e}"
    return any(w in text for w in ("Constraint", "dynamic_shapes", "Dim.", "specializ", "SymFloat", "SymInt",
                                   "SymBool"))


def _unlift(ep: Any) -> fx.GraphModule:
    try:
        return ep.module(check_guards=False)
    except TypeError:  # torch without the check_guards argument
        return ep.module()


def _inputs_by_key(graph: fx.Graph) -> None:
    """The exported graph flattens an ``OrderedDict`` input as a ``dict``, by the example's keys: the
    guard takes a ``dict`` there too (:func:`ampfx.runtime.guards.read_by_key`)."""
    info = getattr(graph._codegen, "pytree_info", None)
    if info is not None and info.in_spec is not None:
        graph._codegen.pytree_info = info._replace(in_spec=read_by_key(info.in_spec))


def _module_paths(model: nn.Module) -> set[str]:
    return {name for name, _ in model.named_modules()}


def _clean(gm: fx.GraphModule, model: nn.Module, paths: set[str]) -> tuple[dict[str, Any], list[str]]:
    """Prepare the unlifted graph for the passes (see the module docstring);
    returns the constants to install and notes."""
    graph = gm.graph
    # pickling re-traces the code with the graph's tracer class: export's needs arguments it cannot get
    graph._tracer_cls, graph._tracer_extras = None, {}
    constants: dict[str, Any] = {}
    dropped: dict[str, int] = {}
    for node in list(graph.nodes):
        if node.op == "call_module" and str(node.target) == "_guards_fn":
            graph.erase_node(node)
            dropped["input guards"] = dropped.get("input guards", 0) + 1
            continue
        if _dropped(node, dropped):
            continue
        if node.op == "get_attr":
            target = str(node.target)
            try:
                mine = operator.attrgetter(target)(model)
            except AttributeError:
                mine = None
            if mine is None:
                constants[target] = operator.attrgetter(target)(gm)
        stack = node.meta.get("nn_module_stack")
        if stack:
            # keep entries that name modules of the model (export adds hook frames; strict mode's
            # paths look like L['self'].encoder.layer[0]); the path is the first tuple item
            clean = {}
            for key, value in stack.items():
                path = _normal_path(value[0] if isinstance(value, tuple) else key)
                if path in paths:
                    clean[key] = (path, value[1]) if isinstance(value, tuple) else value
            node.meta["nn_module_stack"] = clean
        _mark_user_float32(node)
    for path, body in gm.named_modules():  # the bodies of regions (with torch.no_grad(), with torch.autocast)
        if path and isinstance(body, fx.GraphModule):  # their dtype assertions only: a whole-dimension slice made
            # under no_grad is a view that takes no gradient, where the tensor it slices does
            if sum(_dropped(node, dropped, slices=False) for node in list(body.graph.nodes)):
                body.recompile()
    notes = [f"dropped export's {k} ({n})" for k, n in dropped.items()]
    return constants, notes


def _dropped(node: fx.Node, dropped: dict[str, int], slices: bool = True) -> bool:
    """Drop ``node`` from its graph if it is one of export's dtype assertions or (``slices``) a whole-dimension
    slice (:func:`_full_slice`), counted in ``dropped``; whether it was."""
    graph = node.graph
    if node.op == "call_function" and str(node.target).startswith("aten._assert_tensor_metadata"):
        graph.erase_node(node)
        dropped["dtype assertions"] = dropped.get("dtype assertions", 0) + 1
        return True
    if slices and _full_slice(node):
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)
        dropped["whole-dimension slices"] = dropped.get("whole-dimension slices", 0) + 1
        return True
    return False


def _full_slice(node: fx.Node) -> bool:
    """Is ``node`` ``aten.slice(x, dim, 0, <end of any size>)``, which export records for each ``:`` of
    ``x[:, t]`` where eager indexing records nothing? Its backward writes a zero tensor of ``x``'s size
    and copies the gradient in (a selective scan indexing ``dt[:, t]`` per step wrote 9% more bytes
    in its step with them than without, 4% more than autocast); reading ``x`` itself is the same values,
    the same storage."""
    if node.op != "call_function" or node.target is not torch.ops.aten.slice.Tensor or node.kwargs:
        return False
    _, start, end, step = (*node.args[1:], *(0, None, None, 1)[len(node.args) - 1:])
    return (isinstance(node.args[0], fx.Node) and start in (None, 0) and step in (None, 1)
            and (end is None or (isinstance(end, int) and end >= sys.maxsize)))


def _mark_user_float32(node: fx.Node) -> None:
    """A ``torch.autocast(device, enabled=False)`` region (export's ``wrap_with_autocast`` with
    ``enabled`` False) is the model asking for float32: say so for the classify pass."""
    hop = getattr(torch.ops.higher_order, "wrap_with_autocast", None)
    if hop is None or node.op != "call_function" or node.target is not hop or len(node.args) < 3:
        return
    device, _, enabled = node.args[:3]
    if enabled is False:
        path = node_module_path(node)
        node.meta[USER_FLOAT32] = f"inside torch.autocast({device!r}, enabled=False) in {path or 'the root module'!r}"


def _normal_path(path: str) -> str:
    """``L['self'].encoder.layer[0]`` -> ``encoder.layer.0``; plain paths are returned as they are."""
    p = str(path)
    for prefix in ("L['self'].", "L['self']", "L__self__."):
        if p.startswith(prefix):
            p = p[len(prefix):]
    p = p.replace("._modules['", ".").replace("']", "").replace("[", ".").replace("]", "")
    return p.strip(".")


def install_constants(root: nn.Module, constants: dict[str, Any], graph: fx.Graph) -> None:
    """Make each ``get_attr`` target in ``constants`` resolvable under ``root`` (a private copy of the
    model's module): each becomes a plain attribute ``_ampfx_const<i>`` of ``root``, and the graph's
    ``get_attr`` nodes read it by that name. Neither the model's tree nor its ``state_dict()``,
    ``buffers()`` or ``modules()`` gain anything (a change of device converts again: :mod:`ampfx.runtime.fixed`)."""
    names = {target: f"_ampfx_const{i}" for i, target in enumerate(constants)}
    for node in graph.nodes:
        if node.op == "get_attr" and str(node.target) in names:
            node.target = names[str(node.target)]
    for target, value in constants.items():
        root.__dict__[names[target]] = value


def capture(model: nn.Module, inputs: ExampleInputs | None, timeout: float | None = None,
            sizes: list[int] | None = None, drops: set[str] | None = None) -> Capture:
    """Export ``model`` on ``example_inputs``; raises :class:`ExportFailed`
    (with the steps tried) if this torch cannot or the model does not export,
    or if exporting takes longer than ``timeout`` seconds (all tries together).
    The model is left as found (modes, buffers).

    Sizes are tried from the most dynamic down (:func:`_size_tries`): a try that
    fails over dynamic sizes, or runs past :data:`DYNAMIC_SHARE` of ``timeout``
    (export's symbolic size analysis can take minutes where a model does
    arithmetic on its spatial sizes), gives way to the next. ``sizes`` (a one-item list) is the
    try to start from, and is set to the one that ended the tries: the module's other training mode
    starts there rather than wait for the same timeout again. ``drops`` gets the paths (in ``model``) of
    the modules that make the capture unfaithful (:class:`Unfaithful`), if that is why it fails."""
    why = unavailable()
    if why is not None:
        raise ExportFailed(why, [f"torch.export: {why}"])
    if inputs is None:
        raise ExportFailed("torch.export needs example_inputs", ["torch.export: no example_inputs"])
    order = [isinstance(h, TRACED_PRE_HOOKS) for h in model._forward_pre_hooks.values()]
    if True in order and not all(order[order.index(True):]):
        raise ExportFailed("a forward pre-hook follows a pruning / weight_norm one", [
            "torch.export: not tried: a forward pre-hook of this module runs after its pruning / weight_norm "
            "pre-hook; the graph computes the weight, so that hook would run before it (register it first)"])
    args, kwargs = inputs.ordered(model.forward)
    paths, steps, mode = _module_paths(model), [], _mode(model.training)
    start = time.perf_counter()
    tries, folds = _size_tries(model.forward, args, kwargs), Folding()
    memo = sizes if sizes is not None else [0]
    first = min(memo[0], len(tries) - 1)
    if first:
        steps.append(f"torch.export: starting with {tries[first][0]}, as the other training mode's export did")
    for i, (words, dynamic) in enumerate(tries[first:], first):
        memo[0] = i
        last = i == len(tries) - 1
        left = None if not timeout else timeout - (time.perf_counter() - start)
        share = left if last or left is None else min(left, DYNAMIC_SHARE * timeout)
        share = None if share is None else max(share, 0.01)  # 0 would mean no limit
        t = time.perf_counter()
        # the root's own hooks stay Python the graph module calls (rewrite.keep_hooks), as torch.fx's do; a
        # pruning or weight-norm pre-hook is traced in (left out, the weight it sets became a constant)
        try:
            with time_limit(share) as unbounded, without_hooks(model, keep=TRACED_PRE_HOOKS), \
                    stall_limit(model, not last):
                ep = _export_folding(model, args, kwargs, dynamic, folds, steps)
            break
        except ExportStalled as e:
            steps.append(f"torch.export with {words} ({mode} mode) stopped after {time.perf_counter() - t:.1f} s: {e}")
        except ExportTimeout:
            steps.append(f"torch.export with {words} ({mode} mode) stopped after {time.perf_counter() - t:.0f} s")
            if last:
                steps.append(f"torch.export: longer than export_timeout={timeout:g} s in all "
                             "(Policy(export_timeout=...) or AMPFX_EXPORT_TIMEOUT; off: no limit)")
                raise ExportFailed(f"torch.export took longer than export_timeout={timeout:g} s", steps) from None
        except Exception as e:  # noqa: BLE001 - any export error: fewer dynamic sizes if it was about sizes
            if isinstance(e, Unfaithful) and drops is not None:
                drops.update(e.paths)
            if last or not _about_sizes(e):
                steps.append(f"torch.export ({mode} mode{'' if i == 0 else ', ' + words}): {_short(e)}")
                raise ExportFailed(_short(e), steps) from e
            steps.append(f"torch.export with {words} ({mode} mode): {_short(e)}")
    gm = _unlift(ep)
    _inputs_by_key(gm.graph)
    constants, notes = _clean(gm, model, paths)
    steps.append(f"exported (torch.export, non-strict, training IR, {words}){_folded_words(folds)}")
    if dynamic is None:
        notes.append("torch.export specialised every input size to the example's: calls with other sizes raise "
                     "GuardError (convert again for other sizes)")
    elif i > 0:  # fewer dynamic sizes than asked for
        notes.append(f"torch.export was given {words}: other dimensions are the example's, and calls with other "
                     "sizes there raise GuardError (convert again for other sizes)")
    if unbounded is not None and timeout:
        notes.append(unbounded)
    return Capture(gm.graph, "export", steps=tuple(steps), constants=constants, notes=tuple(notes), folded=folds.read)


def _export_folding(model: nn.Module, args: tuple, kwargs: dict, dynamic: Any, folds: Folding,
                    steps: list[str]) -> Any:
    """:func:`_export`; where it stops at Python asking for a tensor's value and the model has small integer
    buffers (:func:`ampfx.capture.fold.candidates`), once more with them read as their values, and so every
    try after (``folds.active``)."""
    if not folds.active:
        try:
            return _export(model, args, kwargs, dynamic)
        except Exception as e:
            if not _data_dependent(e) or not fold.candidates(model):
                raise
            steps.append(f"torch.export ({_mode(model.training)} mode): {_short(e)}; once more with the small "
                         "integer buffers of the model's modules read as their values")
            folds.active = True
    return _export(model, args, kwargs, dynamic, folds)


def _folded_words(folds: Folding) -> str:
    names = [f"{path}.{name}" if path else name for path, name, _ in folds.read]
    return f"; buffers read as their values: {', '.join(names)}" if names else ""


def changes_past_sizes(model: nn.Module, inputs: ExampleInputs,
                       capture: Capture) -> tuple[dict[str, tuple[str, ...]], str] | None:
    """What the model's own Python changes in a run just past the largest size the exported graph holds
    for: ``({module path: what it changed}, the sizes in words)``, or ``None`` (no size is bounded
    above, or that run changes nothing, or the model does not run there).

    A forward that grows a cache for longer inputs (``if T > self.cache_len: self.cache = ...;
    self.cache_len = T``) takes the branch that keeps the cache on the example when the cache is
    long enough already (filled by an earlier call, or precomputed to a length), so the export
    holds only up to that length: longer calls would raise ``GuardError``, and converting again
    cannot help, since the model sets that length itself. The run, on the example inputs repeated
    along each bounded dimension to one past its bound, shows the forward setting Python state
    there (or re-assigning a buffer), which no graph repeats: the module then keeps its Python.
    The model is left as found."""
    placeholders = [n for n in capture.graph.nodes if n.op == "placeholder"]
    args, kwargs = inputs.ordered(model.forward)
    leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    if len(leaves) != len(placeholders):
        return None
    bounded = [(sym, high, f"{n.target} dim {d}") for n in placeholders for d, sym, high in _bounded(n.meta.get("val"))]
    past = {sym: high + 1 for sym, high, _ in bounded}
    if not past:
        return None
    words = ", ".join(dict.fromkeys(f"{where} <= {high}" for _, high, where in bounded))
    grown = [_grown(leaf, n.meta.get("val"), past) for leaf, n in zip(leaves, placeholders)]
    args, kwargs = torch.utils._pytree.tree_unflatten(grown, spec)
    buffers = {path: dict(m._buffers) for path, m in model.named_modules()}
    try:
        with untouched(model), torch.no_grad(), python_changes(model) as seen:
            model(*args, **kwargs)
            for path, m in model.named_modules():  # a buffer re-assigned (self.cache = longer) is state too
                swapped = tuple(f"buffer {k!r} re-assigned" for k, b in m._buffers.items()
                                if b is not buffers.get(path, {}).get(k))
                seen[path] = (*seen.get(path, ()), *swapped) if swapped else seen.get(path, ())
    except Exception:  # noqa: BLE001 - the model does not run past its sizes (a position table): nothing seen
        return None
    seen = {path: what for path, what in seen.items() if what}
    return (seen, words) if seen else None


def _bounded(val: Any) -> list[tuple[int, Any, int]]:
    """The dimensions of an exported placeholder's value whose size is a symbol with a finite upper bound:
    ``(dim, symbol, bound)``."""
    if not isinstance(val, torch.Tensor):
        return []
    out = []
    for d, size in enumerate(val.shape):
        if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
            vr = size.node.shape_env.var_to_range.get(size.node.expr)
            try:
                if vr is not None and vr.upper.is_integer and vr.upper < 2 ** 62:
                    out.append((d, size.node.expr, int(vr.upper)))
            except (TypeError, AttributeError):  # an unbounded range
                continue
    return out


def _grown(leaf: Any, val: Any, past: dict[Any, int]) -> Any:
    """``leaf`` repeated along each dimension whose exported size is a symbol of ``past`` to that size
    (token ids stay valid ids, masks stay masks)."""
    if not isinstance(leaf, torch.Tensor) or not isinstance(val, torch.Tensor) or leaf.dim() != val.dim():
        return leaf
    for d, size in enumerate(val.shape):
        if isinstance(size, torch.SymInt) and size.node.expr in past and leaf.shape[d] > 0:
            index = torch.arange(past[size.node.expr], device=leaf.device) % leaf.shape[d]
            leaf = leaf.index_select(d, index)
    return leaf


DYNAMIC_SHARE = 0.25
"""The share of ``export_timeout`` a try with dynamic sizes may take before fewer dynamic sizes are tried."""


def _size_tries(fn: Any, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """What :func:`capture` tries, in order: (words, ``dynamic_shapes``). Every dimension dynamic
    (``Dim.AUTO``: export keeps static what the model needs static), then the first dimension
    of each input only (the batch), then static sizes; the last alone where this torch has no
    ``Dim.AUTO`` or the inputs do not bind to ``fn``."""
    every, first = _auto_dims(fn, args, kwargs, every=True), _auto_dims(fn, args, kwargs, every=False)
    tries = [("dynamic sizes where the model allows (Dim.AUTO)", every)] if every is not None else []
    if first is not None and first != every:
        tries.append(("a dynamic first (batch) dimension where the model allows (Dim.AUTO)", first))
    return [*tries, ("static sizes", None)]


def _mode(training: bool) -> str:
    return "train" if training else "eval"
