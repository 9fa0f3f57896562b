"""Helpers that the rewritten graph calls at run time.

The generated code of a converted module calls these by their qualified
names, so a converted module pickles and reloads as long as ``ampfx`` is
importable.

The package holds the converted module at run time: :mod:`~ampfx.runtime.graph_module`,
:mod:`~ampfx.runtime.entries` (its one runtime state: the call steps and entries), :mod:`~ampfx.runtime.view` (a
view of the model), :mod:`~ampfx.runtime.fixed` (what a graph fixed, checked per call),
:mod:`~ampfx.runtime.follow`, :mod:`~ampfx.runtime.guards`, :mod:`~ampfx.runtime.inference`,
:mod:`~ampfx.runtime.weight_cache` and :mod:`~ampfx.runtime.fp8` (FP8 GEMMs); this module imports none of them.
"""
from __future__ import annotations

import functools
import sys
import threading
from typing import Any

import torch
from torch.func import functional_call
from torch.nn.utils import parametrize

from ..threads import converting

CASTABLE = (torch.float32, torch.float16, torch.bfloat16)

if hasattr(torch.compiler, "is_compiling"):
    is_compiling = torch.compiler.is_compiling
else:  # torch < 2.3 (the DGL lane's 2.2.1)
    from torch._dynamo.external_utils import is_compiling  # noqa: E402
"""Only these dtypes are ever converted. float64, integers and bool pass through."""

WEIGHTS = threading.local()
"""``WEIGHTS.active``: the weight caches of the graph modules running in this thread, innermost last
(:mod:`ampfx.runtime.weight_cache`); :func:`cast` takes a cached weight's low copy from the innermost one."""

CACHES = [0]
"""How many weight caches were ever installed in this process (:func:`ampfx.runtime.weight_cache.cache_for`): while
none was (the cache is off by default), :func:`cast` looks for none (a cast costs what ``Tensor.to`` costs)."""


def cast(value: Any, dtype: torch.dtype) -> Any:
    """``value`` in ``dtype``: float32/16/bf16 tensors are converted, anything
    else (float64, integer and bool tensors, Python numbers) is returned as is.
    Tuples and lists are converted element by element.

    >>> cast(torch.ones(2), torch.bfloat16).dtype
    torch.bfloat16
    >>> cast(torch.arange(3), torch.bfloat16).dtype
    torch.int64
    """
    if isinstance(value, torch.Tensor):
        have = value.dtype
        if have != dtype and have in CASTABLE:
            if CACHES[0]:  # a weight's copy, made once (ampfx.runtime.weight_cache)
                active = getattr(WEIGHTS, "active", None)
                cached = active[-1].low(value, dtype) if active and not is_compiling() else None
                if cached is not None:
                    return cached
            return value.to(dtype=dtype)  # by keyword: Tensor.to's parser tries its device overload first (0.6 us)
        return value
    if isinstance(value, torch.fx.Proxy):  # re-tracing a converted module (unpickling does)
        return value.tracer.create_proxy("call_function", cast, (value, dtype), {})
    if isinstance(value, (tuple, list)):
        return type(value)(cast(v, dtype) for v in value)
    return value



def call_module_low(module: torch.nn.Module, dtype: torch.dtype, *args: Any, **kwargs: Any) -> Any:
    """Run ``module`` with low-precision copies of its float parameters.

    The module's own parameters stay float32 (the master weights); the copies
    are made with ``Tensor.to`` (one per parameter, tied ones once), so gradients flow back to the masters.
    Buffers are not copied. The copies stand in the module's parameter dicts while it runs (as
    ``torch.func.functional_call`` puts them there, without its general machinery: 0.15 ms a call of an
    ``nn.LSTM`` or ``nn.MultiheadAttention``), and the masters are back when it returns or raises.

    >>> lin = torch.nn.Linear(4, 2)
    >>> call_module_low(lin, torch.bfloat16, torch.ones(1, 4, dtype=torch.bfloat16)).dtype
    torch.bfloat16
    >>> lin.weight.dtype
    torch.float32
    """
    proxy = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.fx.Proxy)), None)
    if proxy is not None:  # re-tracing a converted module: stay one node
        return proxy.tracer.create_proxy("call_function", call_module_low, (module, dtype, *args), kwargs)
    if module._modules and _parametrized(module):
        return _call_low_parametrized(module, dtype, *args, **kwargs)
    dicts = [module._parameters] if not module._modules else [m._parameters for m in module.modules()]
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    low: dict[int, torch.Tensor] = {}
    try:
        for d in dicts:
            for name, p in d.items():
                if p is not None and p.dtype in CASTABLE and p.dtype != dtype:
                    copy = low.get(id(p))
                    if copy is None:
                        copy = low[id(p)] = p.to(dtype=dtype)
                    swapped.append((d, name, p))
                    d[name] = copy
        return module(*args, **kwargs)
    finally:
        for d, name, p in reversed(swapped):
            d[name] = p


def _call_low_parametrized(module: torch.nn.Module, dtype: torch.dtype, *args: Any, **kwargs: Any) -> Any:
    """:func:`call_module_low` for a module with ``torch.nn.utils.parametrize`` parametrizations, through
    ``functional_call`` (see :func:`_parametrized`)."""
    with parametrize.cached():  # a parametrized tensor is computed once per call, as in the module's forward
        for sub, leaf in _parametrized(module):
            value = getattr(sub, leaf)  # the parametrization runs in float32, as the model runs it
            # the cache key holds the id of the module the parametrization was registered on (a copy of
            # a model keeps its original's): find the entry by the tensor just computed
            key = next(k for k, v in parametrize._cache.items() if v is value)
            parametrize._cache[key] = value.to(dtype=dtype) if value.dtype in CASTABLE else value
        params = {name: p.to(dtype=dtype) if p.dtype in CASTABLE else p for name, p in module.named_parameters()
                  if ".parametrizations." not in f".{name}"}
        return functional_call(module, params, args, kwargs, tie_weights=True, strict=False)


def call_module_float32(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Run ``module`` (a leaf ampfx keeps float32, such as a norm) as it is; where some of its float
    parameters arrive in a low dtype (FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``
    all-gathers them so), with float32 copies of those, so the float32 kernel gets the dtypes it
    needs and gradients flow back to the low parameters.

    >>> ln = torch.nn.LayerNorm(4).to(torch.bfloat16)
    >>> call_module_float32(ln, torch.ones(1, 4)).dtype, ln.weight.dtype
    (torch.float32, torch.bfloat16)
    """
    for a in args:
        if isinstance(a, torch.fx.Proxy):  # re-tracing a converted module: stay one node
            return a.tracer.create_proxy("call_function", call_module_float32, (module, *args), kwargs)
    params = module._parameters.values() if not module._modules else module.parameters()
    for p in params:
        if p is not None and p.dtype in _LOW:
            break
    else:  # every parameter float32 (the usual case): the module as it is
        return module(*args, **kwargs)
    low = {name: p.float() for name, p in module.named_parameters() if p.dtype in _LOW}
    return functional_call(module, low, args, kwargs, tie_weights=True, strict=False)


_LOW = (torch.float16, torch.bfloat16)


def _parametrized(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """The ``(submodule, name)`` of every tensor a ``torch.nn.utils.parametrize`` parametrization
    computes (spectral_norm, weight_norm, orthogonal) in ``module``. Those are computed in float32
    by their parametrization (power-iteration buffers included) and the result cast: casting
    their ``original`` would run the parametrization in the low dtype against float32 buffers.
    Torch's parametrization cache (``parametrize.cached``) then hands the cast result to the
    forward.

    >>> from torch.nn.utils.parametrizations import spectral_norm
    >>> [name for _, name in _parametrized(spectral_norm(torch.nn.Linear(4, 2)))]
    ['weight']
    """
    return [(sub, leaf) for sub in module.modules() if parametrize.is_parametrized(sub)
            for leaf in sub.parametrizations]



def compile_disabled(fn: Any) -> Any:
    """``torch.compiler.disable(fn)``, applied at its first call: the decorator imports torch._dynamo (over a
    second), which ``import ampfx`` should not pay.

    >>> compile_disabled(abs)(-2)
    2
    """
    disabled: list[Any] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)
    return call


@compile_disabled
def eager_region(region: torch.nn.Module, *args: Any) -> Any:
    """``region(*args)``: a part of a converted graph that runs eagerly, also inside ``torch.compile`` (a graph
    break): a torch.func level the graph opens and closes (:mod:`ampfx.passes.transforms`).

    >>> eager_region(torch.nn.Identity(), torch.ones(1))
    tensor([1.])
    """
    proxy = next((a for a in args if isinstance(a, torch.fx.Proxy)), None)
    if proxy is not None:  # re-tracing a converted module (unpickling does): stay one node, reading the region
        root = proxy.tracer.root
        name = next((k for k, v in vars(root).items() if v is region), None) or \
            next(n for n, m in root.named_modules() if m is region)
        held = proxy.tracer.create_proxy("get_attr", name, (), {})
        return proxy.tracer.create_proxy("call_function", eager_region, (held, *args), {})
    return region(*args)


def _subclasses(cls: type) -> list[type]:
    found, stack = [], [cls]
    while stack:
        c = stack.pop()
        found.append(c)
        stack.extend(c.__subclasses__())
    return found


_ABSENT = object()
LIVE_READS = "_ampfx_live_reads"
"""The key, in a pickled graph module's state, of the attributes its graph reads at every call that are neither
tensors nor modules (``self.scale``): :class:`Retracer` keeps them reads."""


class Retracer(torch.fx.Tracer):
    """The tracer unpickling re-traces a converted graph's code with (its ``_tracer_cls``): torch.func's calls
    (:data:`ampfx.ops.TRANSFORM_CALLS`, which torch.export writes for ``torch.vmap``) are recorded as they
    stand, never run while tracing (they refuse proxies, and one without arguments would close a level for
    real); in other threads they run. It traces as a conversion does: one at a time (:mod:`ampfx.threads`)."""

    def trace(self, root: Any, *args: Any, **kwargs: Any) -> Any:
        with converting():
            return self._trace(root, *args, **kwargs)

    def _trace(self, root: Any, *args: Any, **kwargs: Any) -> Any:
        from .. import ops  # the tables import nothing of the runtime: no cycle

        self._thread = threading.get_ident()
        # the code names them by their modules (torch._functorch.predispatch._vmap_increment_nesting): those
        # attributes record while this trace runs
        places = [(m, name, fn) for fn in ops.TRANSFORM_CALLS for m in (sys.modules.get(getattr(fn, "__module__", "")),
                  torch._C._functorch) if m is not None and getattr(m, getattr(fn, "__name__", ""), None) is fn
                  for name in (fn.__name__,)]
        # higher-order ops (flat_apply: HF's mask index functions) refuse proxies too: each class's __call__
        # records a call given proxies
        hops = [c for c in _subclasses(torch._ops.HigherOrderOperator) if "__call__" in c.__dict__]
        calls = [c.__dict__["__call__"] for c in hops]
        self._live = []  # (holder's __dict__, name, value) of the attributes read as they are at each call
        try:  # every patch inside: the finally puts back each one, whatever raised where
            for m, name, fn in places:
                setattr(m, name, self._recorder(fn))
            for cls, call in zip(hops, calls):
                cls.__call__ = self._hop_recorder(call)
            return super().trace(root, *args, **kwargs)
        finally:
            for held, name, value in reversed(self._live):
                if value is _ABSENT:
                    held.pop(name, None)
                else:
                    held[name] = value
            for cls, call in zip(hops, calls):
                cls.__call__ = call
            for m, name, fn in places:
                setattr(m, name, fn)

    def create_args_for_root(self, root_fn: Any, is_module: bool, concrete_args: Any = None) -> Any:
        """fx's, then each attribute the graph reads at every call (``LIVE_READS``: a Python number, a flag) is
        a ``get_attr`` proxy while the code runs: read as a plain value, the trace would make it a constant,
        and the loaded copy would ignore a change of it."""
        out = super().create_args_for_root(root_fn, is_module, concrete_args)
        for target in getattr(self.root, "__dict__", {}).get(LIVE_READS, ()):
            *path, name = target.split(".")
            try:
                holder = self.root.get_submodule(".".join(path)) if path else self.root
            except AttributeError:
                continue
            held = vars(holder)  # a view's own dict may not hold it (read from its model module at a call)
            self._live.append((held, name, held.get(name, _ABSENT)))
            held[name] = self.create_proxy("get_attr", target, (), {})
        return out

    def _recorder(self, fn: Any) -> Any:
        """``fn``, recorded when this trace's thread calls it (run as it is in any other)."""
        @functools.wraps(fn)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self._thread:
                return fn(*args, **kwargs)
            return self._record(fn, *args, **kwargs)
        return recorded

    def _hop_recorder(self, call: Any) -> Any:
        def recorded(op: Any, *args: Any, **kwargs: Any) -> Any:
            if any(isinstance(v, torch.fx.Proxy) for v in torch.utils._pytree.tree_leaves((args, kwargs))):
                return self._record(op, *args, **kwargs)
            return call(op, *args, **kwargs)
        return recorded

    def _record(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = torch.utils._pytree.tree_map_only(torch.nn.Module, self._held, (args, kwargs))
        return self.create_proxy("call_function", fn, args, kwargs)

    def _held(self, module: torch.nn.Module) -> Any:
        """A graph a higher-order op takes (held as a plain attribute of the converted module: it is no child of
        the model's), read from where the module holds it."""
        name = next((k for k, v in vars(self.root).items() if v is module), None)
        if name is None:
            return module  # a child: torch.fx reads it by its path
        return self.create_proxy("get_attr", name, (), {})


def assert_is_none(value: Any, message: str) -> None:
    """Guard for an argument that tracing fixed at ``None``: passing one now is an error."""
    if isinstance(value, torch.fx.Proxy):
        return value.tracer.create_proxy("call_function", assert_is_none, (value, message), {})
    if value is not None:
        raise ValueError(f"{message}; ampfx traced this model with it fixed. Convert again with an "
                         "example input that includes it (example_inputs=dict(...)).")
    return None


def cast_pad(value: Any, dtype: torch.dtype, sizes: tuple[int, ...]) -> Any:
    """``value`` in ``dtype``, zero-padded at the end of its last ``len(sizes)``
    dimensions to ``sizes``, in one copy (the cast and the pad are the same
    write). Gradients reach ``value`` in its own dtype.

    >>> cast_pad(torch.ones(2, 3), torch.bfloat16, (4, 8)).shape
    torch.Size([4, 8])
    """
    if isinstance(value, torch.fx.Proxy):
        return value.tracer.create_proxy("call_function", cast_pad, (value, dtype, sizes), {})
    lead = tuple(value.shape[: value.dim() - len(sizes)])
    out = value.new_zeros((*lead, *sizes), dtype=dtype)
    out[(Ellipsis, *(slice(0, n) for n in value.shape[value.dim() - len(sizes):]))] = value
    return out


def _arguments_in(dtype: torch.dtype, low: torch.dtype, module: torch.nn.Module, args: tuple,
                  kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook (with kwargs): ``low`` tensors of the call, in lists and dicts too, in ``dtype``."""
    def to(v: Any) -> Any:
        return v.to(dtype=dtype) if isinstance(v, torch.Tensor) and v.dtype == low else v
    return torch.utils._pytree.tree_map(to, (args, kwargs))


def _outputs_in(dtype: torch.dtype, module: torch.nn.Module, args: tuple, out: Any) -> Any:
    """Forward hook: the float32 tensors of ``out`` in ``dtype``."""
    return torch.utils._pytree.tree_map(
        lambda v: v.to(dtype=dtype) if isinstance(v, torch.Tensor) and v.dtype == torch.float32 else v, out)


def cross_in_float32(module: torch.nn.Module, low: torch.dtype) -> None:
    """Make the kept ``module``, which keeps its own Python (it could not be captured), take the
    ``low`` values its caller's graph gives it in float32, as its Python was written for, and give
    its float32 results back in ``low``, the dtype that graph reads them in. Its own hooks run
    inside these two (they see float32, as in the model).

    >>> lin = torch.nn.Linear(2, 2)
    >>> cross_in_float32(lin, torch.bfloat16)
    >>> lin(torch.ones(1, 2, dtype=torch.bfloat16)).dtype
    torch.bfloat16
    """
    module.register_forward_pre_hook(functools.partial(_arguments_in, torch.float32, low), prepend=True,
                                     with_kwargs=True)
    module.register_forward_hook(functools.partial(_outputs_in, low))
