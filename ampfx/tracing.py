"""Capturing a model as a ``torch.fx`` graph, with a fallback ladder.

:class:`AmpTracer` differs from ``torch.fx.Tracer`` in which modules it keeps
opaque (leaves):

- traced *through*: ``nn.Linear``, convolutions, ``nn.Softmax`` and the
  ``nn.Transformer*`` layers, so their parameters appear as ``get_attr``
  nodes that the cast pass can cast once, and attention internals are
  visible to the policy;
- leaves: every other ``torch.nn`` module (as in ``torch.fx``: modules whose
  behaviour depends on ``training`` stay switchable), DGL modules (by their
  ``__module__``, without importing dgl), module types named on a policy
  list or in ``leaf_modules``, and modules named by path. User functions
  named on a policy list stay one ``call_function`` node.

:func:`trace` tries, in order: the whole model with every argument symbolic;
the whole model with optional arguments fixed at their defaults (the
converted module asserts they keep them); then, each time tracing fails
inside a submodule, that innermost submodule becomes a leaf and tracing
starts again. Every step is recorded with its error. If the root's own
``forward`` cannot be traced, :class:`RootUntraceable` tells the caller to
convert the children one by one.
"""
from __future__ import annotations

import collections

import contextlib
import copy
import inspect
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from . import ops
from .policy import Policy
from .state import modes

TRACE_THROUGH: tuple[type, ...] = tuple(
    getattr(nn, n) for n in (
        "Linear", "Bilinear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
        "ConvTranspose3d", "Softmax", "LogSoftmax", "Softmin", "Identity", "Flatten", "Unflatten",
        "TransformerEncoderLayer", "TransformerDecoderLayer", "TransformerEncoder", "TransformerDecoder",
        "Transformer") if hasattr(nn, n))
"""``torch.nn`` types traced through: their ``forward`` has no ``training``-dependent Python."""

MAX_LEAF_RETRIES = 64


class RootUntraceable(RuntimeError):
    """The root module's own ``forward`` cannot be traced; ``steps`` says what was tried."""

    def __init__(self, error: BaseException, steps: list[str]):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error
        self.steps = steps


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:300]}"


def is_dgl_module(m: nn.Module) -> bool:
    return type(m).__module__.split(".")[0] == "dgl"


class AmpTracer(fx.Tracer):
    """``torch.fx.Tracer`` with ampfx's leaf rules (see the module docstring)."""

    def __init__(self, policy: Policy | None = None, leaf_paths: set[str] = frozenset()) -> None:
        policy = policy if policy is not None else Policy()
        # user functions named on a list, and other libraries' functions in the tables (timm's drop_path),
        # stay one node (fx would trace into them)
        functions = tuple(obj for obj, _ in policy.user_ops if isinstance(obj, types.FunctionType))
        functions += tuple(fn for fn in ops.library_functions() if fn not in functions)
        super().__init__(autowrap_functions=functions)
        self.policy = policy
        self.user_functions = functions
        self.leaf_paths = set(leaf_paths) | {m for m in policy.leaf_modules if isinstance(m, str)}
        self.failed_path: str | None = None

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        """``fx.Tracer.trace``; user functions on a list are also kept whole when
        called as ``module.function`` (``autowrap_functions`` covers only globals)."""
        with contextlib.ExitStack() as stack:
            for fn in self.user_functions:
                home = sys.modules.get(fn.__module__)
                if home is not None and getattr(home, fn.__name__, None) is fn:
                    setattr(home, fn.__name__, _one_node(fn))
                    stack.callback(setattr, home, fn.__name__, fn)
            return super().trace(root, concrete_args)

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
        if qualname in self.leaf_paths or is_dgl_module(m) or self.policy.is_user_leaf(type(m)):
            return True
        if type(m) in TRACE_THROUGH:
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


@dataclass
class Capture:
    """What :func:`trace` produced and how."""

    graph: fx.Graph
    method: str  # "fx" | "fx, optional arguments fixed" | "export"
    leaves: dict[str, str] = field(default_factory=dict)  # module path -> trace error that made it a leaf
    fixed_args: dict[str, Any] = field(default_factory=dict)
    steps: list[str] = field(default_factory=list)
    mode_graphs: dict[bool, fx.Graph] | None = None  # export: the graph of each training mode, when they differ
    constants: dict[str, Any] = field(default_factory=dict)  # export: get_attr targets that are not the model's
    notes: list[str] = field(default_factory=list)
    mode_error: str | None = None  # export: why the other training mode could not be exported


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


def trace(model: nn.Module, policy: Policy, given_args: set[str] | None = None) -> Capture:
    """Trace ``model`` with the fallback ladder; raises :class:`RootUntraceable`.

    ``given_args`` names the forward arguments the caller supplies (from
    ``example_inputs``); the others may be fixed at their defaults.
    """
    steps: list[str] = []
    leaves: dict[str, str] = {}
    # an optional argument defaulting to None is traced as None: a proxy would make
    # `if mask is not None:` take the masked branch for every call
    fixed: dict[str, Any] = {k: v for k, v in _default_args(model, given_args or set()).items() if v is None}
    mode = "fx, None defaults fixed" if fixed else "fx"
    with _fast_paths_off():
        for _ in range(MAX_LEAF_RETRIES):
            tracer = AmpTracer(policy, set(leaves))
            try:
                graph = tracer.trace(model, concrete_args=fixed or None)
            except Exception as e:  # noqa: BLE001 - any trace error moves down the ladder
                path = tracer.failed_path
                if mode in ("fx", "fx, None defaults fixed"):
                    more = _default_args(model, given_args or set())
                    steps.append(f"whole model, {'None defaults fixed' if fixed else 'all arguments symbolic'}: "
                                 f"{_short(e)}")
                    if more != fixed:
                        fixed, mode = more, "fx, optional arguments fixed"
                        continue
                    mode = "fx, optional arguments fixed" if fixed else "fx, whole model failed"
                if path and path not in leaves:
                    leaves[path] = _short(e)
                    steps.append(f"module {path!r} made a leaf: {_short(e)}")
                    continue
                steps.append(f"root forward: {_short(e)}")
                raise RootUntraceable(e, steps) from e
            mode = "fx" if mode == "fx, whole model failed" else mode
            mode = "fx, optional arguments fixed" if fixed and mode == "fx, None defaults fixed" else mode
            _finish(graph, fixed)
            steps.append(f"traced ({mode})" + (f" with leaves {sorted(leaves)}" if leaves else ""))
            return Capture(graph, mode, leaves, fixed, steps)
    raise RootUntraceable(RuntimeError(f"more than {MAX_LEAF_RETRIES} modules failed to trace"), steps)


def _finish(graph: fx.Graph, fixed: dict[str, Any]) -> None:
    """Arguments fixed while tracing keep their names in the converted module's
    signature (fx renames them ``name_1``, which breaks keyword calls), and
    fx's ``_assert_is_none`` guards, which do not survive pickling, become
    ampfx's importable equivalent. A function kept whole that its library also
    ``torch.fx.wrap``-s (torchvision's ``stochastic_depth``) is recorded as
    itself, not as ampfx's wrapper."""
    from . import runtime

    for node in graph.nodes:
        if node.op == "placeholder" and isinstance(node.target, str) and node.target.endswith("_1") \
                and node.target[:-2] in fixed:
            node.target = node.target[:-2]
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "_assert_is_none":
            node.target = runtime.assert_is_none
        if node.op == "call_function" and hasattr(node.target, "_ampfx_one_node"):
            node.target = node.target._ampfx_one_node


def node_module_path(node: fx.Node) -> str:
    """The qualified name of the module a node was traced in ('' for the root)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    key, value = list(stack.items())[-1]
    if isinstance(value, tuple):  # torch >= 2.3: key -> (path, type)
        return str(value[0])
    return str(key)


# ---------------------------------------------------------------------- module tree copies
def copy_tree(m: nn.Module) -> nn.Module:
    """A copy of every module object in the tree that shares parameters and buffers.

    Training flags, hooks and submodule slots of the copy are its own, so the
    original model is never changed by what is done to the copy.
    """
    new = m.__class__.__new__(m.__class__)
    new.__dict__.update(m.__dict__)
    for k, v in list(new.__dict__.items()):
        # torch's own containers (parameters, buffers, hooks); a subclass such as diffusers' FrozenDict config
        # stays shared (its copy() loses the attributes it mirrors its keys in)
        if type(v) in (dict, list, set, collections.OrderedDict):
            new.__dict__[k] = v.copy()
    new._modules = {k: (copy_tree(v) if v is not None else None) for k, v in m._modules.items()}
    return new


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
        if "ampfx_report" in self.__dict__:
            res.ampfx_report = self.ampfx_report  # frozen: safe to share
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
                           self.__dict__.get("_ampfx_alt"), getattr(self.graph._codegen, "pytree_info", None)))

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
             pytree_info=None) -> AmpGraphModule:
    plain = fn(*args)
    if pytree_info is not None:
        _restore_pytree(plain, pytree_info)
    gm = AmpGraphModule(plain, plain.graph, class_name=type(plain).__name__)
    _keep_tree(gm, holder, training)
    if report is not None:
        gm.ampfx_report = report
    if alt is not None:
        gm.set_mode_graph(*alt)
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


def trace_other_mode(model: nn.Module, policy: Policy, capture: Capture) -> fx.Graph | None:
    """If the traced code may depend on ``self.training``, trace again with
    every module in the other mode (same leaves, same fixed arguments); the
    graph if it differs from ``capture.graph``, else ``None``. Raises what
    tracing raises."""
    tracer = AmpTracer(policy, set(capture.leaves))
    traced = [m for name, m in model.named_modules() if not name or not _is_leaf(tracer, m, name)]
    if not any(_mentions_training(type(m)) for m in traced):
        return None
    with modes(model, training=not model.training), _fast_paths_off():
        graph = AmpTracer(policy, set(capture.leaves)).trace(model, concrete_args=capture.fixed_args or None)
    _finish(graph, capture.fixed_args)
    same = graph.python_code("self").src == capture.graph.python_code("self").src
    return None if same else graph


def snapshot(value: Any) -> Any:
    """A deep copy of ``value`` that later in-place changes cannot reach (the value itself if uncopyable)."""
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - uncopyable objects: keep the live reference
        return value


def call_with(module: nn.Module, example_inputs: Any) -> Any:
    """``module`` called on ``example_inputs`` (a tuple of positional inputs, a dict of keyword inputs, or one value)."""
    if isinstance(example_inputs, dict):
        return module(**example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return module(*example_inputs)
    return module(example_inputs)


def reproduces(model: nn.Module, capture: Capture, example_inputs: Any, rtol: float = 1e-4) -> str | None:
    """``None`` if ``capture.graph`` gives ``model``'s outputs on ``example_inputs``, else why not.

    Both run in float32 in the model's current mode, without gradients, from
    the same random seed (dropout draws the same masks), and leave buffers
    as found. Python that branches on sizes or values can trace into a graph
    that runs but computes something else; this catches it before conversion.
    """
    from .state import kept_buffers

    gm = graph_module(model, capture.graph)

    def run(m: nn.Module) -> list[Any]:
        with torch.random.fork_rng(devices=[]), kept_buffers(model), torch.no_grad():
            torch.manual_seed(0)
            # a copy of the inputs each time: the forward may change what it is given (caches)
            return torch.utils._pytree.tree_leaves(call_with(m, snapshot(example_inputs)))

    try:
        want = run(model)
    except Exception:  # noqa: BLE001 - the model itself does not run: nothing to compare (shapes says so)
        return None
    try:
        got = run(gm)
    except Exception as e:  # noqa: BLE001
        return f"the torch.fx graph does not run on the example inputs ({_short(e)})"
    want = [t for t in want if isinstance(t, torch.Tensor)]
    got = [t for t in got if isinstance(t, torch.Tensor)]
    if len(want) != len(got):
        return f"the torch.fx graph returns {len(got)} tensors, the model {len(want)}"
    for i, (a, b) in enumerate(zip(want, got)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return (f"the torch.fx graph's output {i} is {b.dtype}{list(b.shape)}, the model's "
                    f"{a.dtype}{list(a.shape)}")
        if a.is_floating_point() or a.is_complex():
            scale = a.abs().max().item() if a.numel() else 0.0
            if not torch.allclose(b, a, rtol=rtol, atol=rtol * max(scale, 1e-6), equal_nan=True):
                diff = (b - a).abs().max().item()
                return f"the torch.fx graph's output {i} differs from the model's (max abs difference {diff:.3g})"
        elif not torch.equal(a, b):
            return f"the torch.fx graph's output {i} differs from the model's"
    return None


def _is_leaf(tracer: AmpTracer, m: nn.Module, name: str) -> bool:
    try:
        return tracer.is_leaf_module(m, name)
    except Exception:  # noqa: BLE001
        return True


_READS_TRAINING: dict[type, bool] = {}


def _reads(code: types.CodeType, name: str) -> bool:
    return name in code.co_names or any(_reads(c, name) for c in code.co_consts if isinstance(c, types.CodeType))


def _mentions_training(cls: type) -> bool:
    """Does any method of ``cls`` (or of its bases below ``nn.Module``) read
    ``training``? Read from the bytecode, so it also works for classes
    defined in notebooks and ``exec``. Cached per class."""
    if cls not in _READS_TRAINING:
        _READS_TRAINING[cls] = any(
            _reads(inspect.unwrap(fn).__code__, "training")  # unwrap: decorated forwards (HF's) hide their code
            for klass in cls.__mro__ if klass not in (nn.Module, object)
            for fn in vars(klass).values() if hasattr(inspect.unwrap(fn), "__code__"))
    return _READS_TRAINING[cls]


def graph_module(root: nn.Module, graph: fx.Graph) -> AmpGraphModule:
    """An :class:`AmpGraphModule` running ``graph`` over ``root``'s module tree."""
    gm = AmpGraphModule(root, graph, class_name=type(root).__name__)
    _keep_tree(gm, root, root.training)
    return gm
