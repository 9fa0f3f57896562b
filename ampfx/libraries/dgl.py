"""DGL: which ``dgl.nn`` modules run in low precision, and how they are run.

ampfx never imports ``dgl`` to build these rules: modules are matched by the
qualified name of their class (or of a base class), e.g.
``dgl.nn.pytorch.conv.gatconv.GATConv``. Every ``dgl.*`` module is traced as
an opaque leaf (see :mod:`ampfx.capture.tracer`); this module says what happens to
the leaf.

**The table** (:data:`TABLE`, one :class:`ModuleEntry` per module type, each
with its reason) is registered in the op lists under a canonical name such as
``dgl.GATConv``, so the usual overrides address it::

    AMPFX_DENYLIST_ADD=dgl.GATConv AMPFX_ALLOWLIST_REMOVE=dgl.GATConv   # keep every GATConv float32
    AMPFX_FP32_MODULES=layers.0                                          # keep one layer float32
    AMPFX_ALLOWLIST_ADD=dgl.nn.pytorch.conv.tagconv.TAGConv              # opt an unlisted module in

**Rules applied on top** (:func:`decide`, through :func:`refine`, which the
passes call with the facts of one leaf: low dtype, device, and what
:func:`ampfx.libraries.leaf_facts` made of the example inputs as an
:class:`Observed`), each recorded in the decision log:

- DGL has no float16 kernels on CPU: a float16 policy runs DGL leaves in
  bfloat16 there (or float32 where bfloat16 has no kernel either), rule
  ``dgl:device``;
- variants: ``SAGEConv('lstm')`` runs an ``nn.LSTM``; it is low only where
  ampfx's LSTM probe passes for that dtype and device (oneDNN's bfloat16
  LSTM needs AVX-512 on x86), rule ``probe``;
- float16 overflow guard for sum/mean aggregation: with example inputs, when
  max in-degree x max |feature| (x max |edge weight|) exceeds float16's
  65504, the layer runs in bfloat16 where the device has it, else float32,
  rule ``dgl:overflow``, with the numbers in the reason;
- modules that call ``edge_softmax`` run it in float32 (the logits are cast
  up and the attention weights back down, by :func:`fp32_edge_softmax`, only
  during the leaf's call): DGL's CPU bfloat16 edge_softmax accumulates the
  exponent sum in bfloat16, so per-node attention weights sum to ~5 instead
  of 1 above in-degree 4096;
- ``dgl.nn`` modules in no table stay float32 (rule ``unlisted``).

**The runner** (:func:`call_dgl_low`) runs a low-precision leaf with
``torch.func.functional_call`` on low-precision copies of its float32
parameters (gradients reach the masters) and gives every float tensor that
reaches a DGL kernel the same dtype: positional and keyword tensors, tensors
inside tuples (``(src_feat, dst_feat)``), and float node/edge data stored on
a graph argument (cast lazily, on first read, inside ``graph.local_scope()``
so the caller's graph is untouched). DGL's ``gspmm``/``gsddmm`` raise when
node and edge data differ in dtype, which is why ``torch.autocast`` crashes on
``GATConv``.

>>> [r.name for r in TABLE][:4]
['dgl.GraphConv', 'dgl.SAGEConv', 'dgl.GINConv', 'dgl.GATConv']
>>> entry_for_type_name("dgl.nn.pytorch.conv.gatconv.GATConv").edge_softmax
True
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.func import functional_call

from ..ops import probes
from ..ops import Category
from ..report.records import Rule, dtype_name

LIBRARY = "DGL"
FP16_MAX = 65504.0
RUNS_ON_FAKE_TENSORS = False
"""DGL passes tensors to its C++ kernels through DLPack: meta and fake tensors crash it (segfault)."""

# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class ModuleEntry:
    """One ``dgl.nn`` module type: its list, why, and what the rules on top need.

    ``aggregation`` is how the module combines neighbour messages (``"sum"``,
    ``"mean"``, ``"max"``, ``"attention"``: a softmax-weighted sum, or
    ``"lstm"``), for the float16 overflow guard; when ``aggregator_attr`` is
    set, the module's attribute of that name picks the aggregation instead
    (``SAGEConv._aggre_type``). ``edge_softmax``: the module calls DGL's
    ``edge_softmax``, which ampfx runs in float32. ``cpu_bf16``: DGL has
    bfloat16 CPU kernels for everything the module runs.
    """

    name: str
    types: tuple[str, ...]
    category: Category
    reason: str
    aggregation: str | None = None
    aggregator_attr: str | None = None
    edge_softmax: bool = False
    cpu_bf16: bool = True
    functions: tuple[str, ...] = ()

    @property
    def qualnames(self) -> tuple[str, ...]:
        """The qualified names the entry covers (module types, then functions), as registered in the op lists."""
        return (*self.types, *self.functions)

    def aggregation_of(self, module: Any) -> str | None:
        """The aggregation ``module`` uses (its aggregator attribute, else the rule's)."""
        if self.aggregator_attr is not None:
            value = getattr(module, self.aggregator_attr, None)
            if isinstance(value, str):
                return value if value != "gcn" else "mean"  # gcn: (sum + self) / (in-degree + 1)
        return self.aggregation


_CONV = "dgl.nn.pytorch.conv."
_SPMM = "message passing is a sparse-dense product (SpMM) plus GEMMs; DGL has bfloat16 CSR kernels on CPU"
_ATTENTION = "attention convolution: GEMMs and SpMM/SDDMM in low precision, edge_softmax in float32"
_READOUT = ("graph readout that sums every node of a graph (SegmentSum): DGL has no bfloat16 CPU kernel for it, "
            "and a sum over a whole graph overflows float16's range")

TABLE: tuple[ModuleEntry, ...] = (
    ModuleEntry("dgl.GraphConv", (_CONV + "graphconv.GraphConv",), Category.ALLOW,
               _SPMM + " (GraphConv casts its degree norms to the feature dtype)", aggregation="sum"),
    ModuleEntry("dgl.SAGEConv", (_CONV + "sageconv.SAGEConv",), Category.ALLOW,
               _SPMM + " (mean / gcn / pool aggregators; lstm runs an nn.LSTM, low only where ampfx's LSTM "
                       "probe passes)", aggregator_attr="_aggre_type"),
    ModuleEntry("dgl.GINConv", (_CONV + "ginconv.GINConv",), Category.ALLOW,
               _SPMM + " (sum / mean / max aggregators; apply_func runs with low-precision weights)",
               aggregator_attr="_aggregator_type"),
    ModuleEntry("dgl.GATConv", (_CONV + "gatconv.GATConv",), Category.ALLOW, _ATTENTION,
               aggregation="attention", edge_softmax=True),
    ModuleEntry("dgl.GATv2Conv", (_CONV + "gatv2conv.GATv2Conv",), Category.ALLOW, _ATTENTION,
               aggregation="attention", edge_softmax=True),
    ModuleEntry("dgl.DotGatConv", (_CONV + "dotgatconv.DotGatConv",), Category.ALLOW, _ATTENTION,
               aggregation="attention", edge_softmax=True),
    ModuleEntry("dgl.AGNNConv", (_CONV + "agnnconv.AGNNConv",), Category.ALLOW, _ATTENTION,
               aggregation="attention", edge_softmax=True),
    ModuleEntry("dgl.EGATConv", (_CONV + "egatconv.EGATConv",), Category.ALLOW, _ATTENTION,
               aggregation="attention", edge_softmax=True),
    ModuleEntry("dgl.EdgeGATConv", (_CONV + "edgegatconv.EdgeGATConv",), Category.ALLOW, _ATTENTION,
               aggregation="attention", edge_softmax=True),
    ModuleEntry("dgl.SumPooling", ("dgl.nn.pytorch.glob.SumPooling",), Category.DENY, _READOUT,
               aggregation="sum", cpu_bf16=False),
    ModuleEntry("dgl.AvgPooling", ("dgl.nn.pytorch.glob.AvgPooling",), Category.DENY,
               _READOUT + " (the mean is a sum, then a division)", aggregation="mean", cpu_bf16=False),
    ModuleEntry("dgl.sum_nodes", (), Category.DENY, _READOUT, aggregation="sum", cpu_bf16=False,
               functions=("dgl.readout.sum_nodes",)),
    ModuleEntry("dgl.mean_nodes", (), Category.DENY, _READOUT + " (the mean is a sum, then a division)",
               aggregation="mean", cpu_bf16=False, functions=("dgl.readout.mean_nodes",)),
)
"""The per-module policy table: canonical name, qualified type names, list, reason."""

_BY_TYPE_NAME: dict[str, ModuleEntry] = {t: r for r in TABLE for t in r.qualnames}
_BY_NAME: dict[str, ModuleEntry] = {r.name: r for r in TABLE}


def entry_for_type_name(qualname: str) -> ModuleEntry | None:
    """The table entry for a qualified class or function name, or ``None``."""
    return _BY_TYPE_NAME.get(qualname)


def entry_for(module: Any) -> ModuleEntry | None:
    """The table entry for ``module``'s class or its nearest base class in the table."""
    for klass in type(module).__mro__:
        hit = _BY_TYPE_NAME.get(f"{klass.__module__}.{klass.__qualname__}")
        if hit is not None:
            return hit
    return None


def is_dgl(module: Any) -> bool:
    """Is ``module`` (or one of its base classes) a DGL module?"""
    return any(getattr(k, "__module__", "").split(".")[0] == "dgl" for k in type(module).__mro__)


# --------------------------------------------------------------------------- the decision

@dataclass(frozen=True)
class LeafStats:
    """What the overflow guard knows about one leaf's inputs on the example inputs."""

    max_in_degree: int
    max_abs_node: float
    max_abs_edge: float | None = None

    @property
    def bound(self) -> float:
        """An upper bound on |a sum of in-neighbour messages|: degree x |feature| x |edge weight|."""
        return self.max_in_degree * self.max_abs_node * (self.max_abs_edge if self.max_abs_edge else 1.0)

    def describe(self) -> str:
        edge = f" x max |edge weight| {self.max_abs_edge:,.4g}" if self.max_abs_edge else ""
        return (f"max in-degree {self.max_in_degree:,} x max |feature| {self.max_abs_node:,.4g}{edge} "
                f"= {self.bound:,.4g}")


@dataclass(frozen=True)
class Choice:
    """What :func:`decide` chose: ``dtype`` (float32 = keep the leaf float32), the rule, why."""

    dtype: torch.dtype
    rule: str
    reason: str


def _probe_variant(aggregation: str | None, dtype: torch.dtype, device: str) -> str | None:
    if aggregation != "lstm":
        return None
    return probes.check("lstm", dtype, device)


def decide(rule: ModuleEntry | None, module: Any, dtype: torch.dtype, device: str, *,
           observed: Observed | None = None, source: str = Rule.TABLE, reason: str | None = None,
           cuda_bf16: bool | None = None) -> Choice:
    """The dtype a DGL leaf the lists put on the allowlist runs in, on ``device``.

    ``rule`` is the table entry (``None`` for a module a user allowed), ``dtype``
    the policy's low dtype, ``observed`` what the example inputs showed (:class:`Observed`: the facts of the
    overflow guard, ``stats``, and ``coo_only``, an example graph restricted to the COO format: no bfloat16 COO
    SpMM on CPU), ``source``/``reason`` what the lists said. ``cuda_bf16``
    overrides ``torch.cuda.is_bf16_supported()`` (tests).

    >>> import torch
    >>> gcn = entry_for_type_name("dgl.nn.pytorch.conv.graphconv.GraphConv")
    >>> decide(gcn, None, torch.float16, "cpu").dtype
    torch.bfloat16
    >>> c = decide(gcn, None, torch.float16, "cuda", observed=Observed(LeafStats(5000, 30.0)), cuda_bf16=False)
    >>> c.dtype, c.rule
    (torch.float32, 'dgl:overflow')
    >>> print(c.reason.split("; ")[-1])
    float16 overflow guard: max in-degree 5,000 x max |feature| 30 = 1.5e+05 > 65504: float32 (no bfloat16 on this device)
    """
    stats, coo_only = (observed.stats, observed.coo_only) if observed is not None else (None, False)
    want = dtype
    rule_name = source
    why = [reason if reason is not None else (rule.reason if rule is not None else "allowed by the policy")]
    aggregation = rule.aggregation_of(module) if rule is not None else None
    cpu_bf16 = rule.cpu_bf16 if rule is not None else True
    if want == torch.float16 and device == "cpu":
        rule_name = Rule.DGL_DEVICE
        if cpu_bf16 and _probe_variant(aggregation, torch.bfloat16, device) is None:
            want = torch.bfloat16
            why.append("no float16 DGL kernels on CPU ('Feature data can only be bfloat16/float32/float64 on "
                       "CPU'): bfloat16 instead")
            if stats is not None and aggregation in ("sum", "mean") and stats.bound > FP16_MAX:
                why.append(f"{stats.describe()} would overflow float16 too")
        else:
            return Choice(torch.float32, rule_name, "; ".join(
                [*why, "no float16 DGL kernels on CPU and no bfloat16 kernel for this module there: float32"]))
    if want == torch.bfloat16 and device == "cpu" and not cpu_bf16:
        return Choice(torch.float32, Rule.DGL_DEVICE, "; ".join([*why, "no bfloat16 DGL kernel on CPU: float32"]))
    if want == torch.bfloat16 and device == "cpu" and coo_only:
        return Choice(torch.float32, Rule.DGL_DEVICE, "; ".join(
            [*why, "the graph is restricted to the COO format and DGL has no bfloat16 COO SpMM on CPU "
                   "(allow CSR/CSC with g.formats(['coo', 'csr', 'csc'])): float32"]))
    err = _probe_variant(aggregation, want, device)
    if err is not None:
        return Choice(torch.float32, Rule.PROBE, "; ".join(
            [*why, f"aggregator lstm: nn.LSTM has no working {dtype_name(want)} kernel on {device} ({err}): float32"]))
    if want == torch.float16 and stats is not None and aggregation in ("sum", "mean") and stats.bound > FP16_MAX:
        if cuda_bf16 is None:
            cuda_bf16 = device == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        fallback = torch.bfloat16 if cuda_bf16 else torch.float32
        where = "bfloat16 has float32's range" if cuda_bf16 else "no bfloat16 on this device"
        return Choice(fallback, Rule.DGL_OVERFLOW, "; ".join(
            [*why, f"float16 overflow guard: {stats.describe()} > 65504: {dtype_name(fallback)} ({where})"]))
    if stats is not None and aggregation in ("sum", "mean") and want == torch.float16:
        why.append(f"float16 overflow guard: {stats.describe()} <= 65504")
    if rule is not None and rule.edge_softmax or rule is None and _calls_edge_softmax(type(module)):
        why.append("edge_softmax forced to float32: DGL's CPU bfloat16 edge_softmax accumulates in bfloat16 "
                   "(attention weights wrong above in-degree 4096)")
    return Choice(want, rule_name, "; ".join(why))


def refine(decision: Any, module: Any, facts: Any) -> Any:
    """The DGL decision for a leaf the op lists decided (``decision``: a record with ``category``,
    ``dtype``, ``rule`` and ``reason``), given ``facts`` (:class:`ampfx.libraries.LeafFacts`:
    the policy's low dtype, the device, and the :class:`Observed` facts of the example inputs).

    ALLOW leaves get :func:`decide`'s dtype (a float32 result makes the leaf
    ``FP32``); leaves in no list get a DGL-specific reason; others are kept.

    >>> import torch
    >>> from ampfx.libraries import LeafFacts
    >>> from ampfx.policy.decide import Verdict
    >>> allowed = Verdict(Category.ALLOW, None, "table", "GEMMs")
    >>> facts = LeafFacts("conv", "cpu", torch.float16, Observed(coo_only=True))
    >>> refine(allowed, None, facts).rule, refine(allowed, None, facts).dtype
    ('dgl:device', torch.float32)
    """
    if decision.category is Category.ALLOW:
        observed = facts.observed if facts.observed is not None else Observed()
        choice = decide(entry_for(module), module, facts.dtype, facts.device, observed=observed,
                        source=decision.rule, reason=decision.reason)
        if choice.dtype == torch.float32:
            return dataclasses.replace(decision, category=Category.FP32, dtype=torch.float32, rule=choice.rule,
                                       reason=choice.reason)
        return dataclasses.replace(decision, dtype=choice.dtype, rule=choice.rule, reason=choice.reason)
    if decision.rule == Rule.UNLISTED:
        qual = f"{type(module).__module__}.{type(module).__qualname__}"
        return dataclasses.replace(decision, reason=(
            f"dgl.nn module {type(module).__name__} is not in ampfx's DGL table (ampfx.libraries.dgl): float32; "
            f"if every kernel it runs takes one dtype, allow it with AMPFX_ALLOWLIST_ADD={qual}"))
    return decision


# --------------------------------------------------------------------------- leaves called from eager code

class EagerLeaf(torch.nn.Module):
    """A DGL module called from Python that ampfx cannot trace (a root whose
    ``forward`` uses ``g.local_scope()`` or ``dgl.mean_nodes``), run in ``dtype``
    by :func:`call_dgl_low`; float outputs return in the dtype of its float inputs.

    It holds the module's own parameters, buffers and children (the same
    objects, so the same ``state_dict`` keys) and keeps the module itself
    unregistered, so nothing appears twice.
    """

    def __init__(self, leaf: torch.nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.__dict__["leaf"] = leaf  # not a registered child: state_dict keys stay the leaf's own
        self._parameters = leaf._parameters
        self._buffers = leaf._buffers
        self._modules = leaf._modules
        self._non_persistent_buffers_set = leaf._non_persistent_buffers_set
        self.low_dtype = dtype
        self.training = leaf.training

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        floats = [t.dtype for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.dtype in CASTABLE]
        return _cast_tree(call_dgl_low(self.leaf, self.low_dtype, *args, **kwargs),
                          floats[0] if floats else torch.float32)

    def train(self, mode: bool = True) -> "EagerLeaf":
        self.leaf.training = mode
        return super().train(mode)

    def _ampfx_rebase(self, model: torch.nn.Module, view: Any) -> None:
        """Stand for the model's own DGL module (:func:`ampfx.runtime.view.rebase`): run it, with its tensors and
        children (``view(child, model_child, path)`` gives each child's place in the converted tree)."""
        self.__dict__["leaf"] = model
        self._parameters, self._buffers = model._parameters, model._buffers
        self._non_persistent_buffers_set = model._non_persistent_buffers_set
        self._modules = model._modules

    def extra_repr(self) -> str:
        return f"{type(self.leaf).__name__} run in {dtype_name(self.low_dtype)} by ampfx.libraries.dgl.call_dgl_low"


def eager_leaf(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """What replaces a DGL module called from eager code that runs in ``dtype``: an :class:`EagerLeaf`."""
    return EagerLeaf(module, dtype)


# --------------------------------------------------------------------------- example-input facts

@dataclass(frozen=True)
class Observed:
    """What the example inputs say about one DGL leaf: :class:`LeafStats` of its inputs (``None``
    when the model was not run for them, or the run failed) and whether the example graphs are
    restricted to the COO format."""

    stats: LeafStats | None = None
    coo_only: bool = False


def needs_run(dtype: torch.dtype | None) -> bool:
    """Do the rules read values seen by running the model under ``dtype`` (``None``: any)? Only the
    float16 overflow guard does."""
    return dtype is None or dtype == torch.float16


def observe_call(module: torch.nn.Module, args: Any, kwargs: Any) -> LeafStats | None:
    """What one call of a DGL leaf shows (forward pre-hook of :func:`ampfx.libraries.observe`)."""
    return stats_of(args, kwargs)


def observation(calls: Sequence[LeafStats | None], example_inputs: Any) -> Observed:
    """The :class:`Observed` facts of one leaf from its calls (the largest of each number over
    every call) and the example inputs given to ``convert`` (or recorded for the leaf)."""
    seen = [c for c in calls if c is not None]
    stats = None
    if seen:
        edges = [c.max_abs_edge for c in seen if c.max_abs_edge is not None]
        stats = LeafStats(max(c.max_in_degree for c in seen), max(c.max_abs_node for c in seen),
                          max(edges) if edges else None)
    return Observed(stats, coo_only=any(_coo_only(g) for g in _graphs(example_inputs)))


def _graphs(values: Any) -> list[Any]:
    return [v for v in torch.utils._pytree.tree_leaves(values)
            if hasattr(v, "local_scope") and hasattr(v, "in_degrees")]


def _coo_only(g: Any) -> bool:
    """Is ``g`` restricted to the COO sparse format (``g.formats('coo')``)?"""
    try:
        formats = g.formats()
    except Exception:  # noqa: BLE001 - not a DGL graph after all
        return False
    allowed = {*formats.get("created", ()), *formats.get("not created", ())}
    return bool(allowed) and not allowed & {"csr", "csc"}


def stats_of(args: Any, kwargs: Any) -> LeafStats | None:
    """:class:`LeafStats` for one call of a DGL module: its graph's max in-degree,
    max |x| over its float node tensors and over its float edge tensors (a
    tensor whose first dimension is the number of edges)."""
    graphs = _graphs((args, kwargs))
    if not graphs:
        return None
    g = graphs[0]
    degree = 0
    for etype in g.canonical_etypes:
        if g.num_edges(etype):
            degree = max(degree, int(g.in_degrees(etype=etype).max()))
    edges = g.num_edges()
    node_max, edge_max = 0.0, None
    for t in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            m = float(t.detach().abs().max())
            if t.dim() and t.shape[0] == edges and edges != g.num_nodes():
                edge_max = max(edge_max or 0.0, m)
            else:
                node_max = max(node_max, m)
    return LeafStats(degree, node_max, edge_max)


# --------------------------------------------------------------------------- the runner

def runner(module: Any) -> Callable[..., Any]:
    """The function the rewritten graph calls for a low-precision DGL leaf."""
    return call_dgl_low


_FP32_EDGE_SOFTMAX: contextvars.ContextVar[bool] = contextvars.ContextVar("ampfx_dgl_fp32_edge_softmax",
                                                                         default=False)
CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


def call_dgl_low(module: torch.nn.Module, dtype: torch.dtype, *args: Any, **kwargs: Any) -> Any:
    """Run the DGL module ``module`` with every float input in ``dtype``.

    Parameters are low-precision copies of the float32 masters (gradients flow
    back to them), and so are float buffers of DGL's own modules (constants
    such as ``GINConv``'s ``eps``); float tensors in ``args``/``kwargs`` (tuples included) are
    cast; float node and edge data on graph arguments are cast lazily, on first
    read, inside ``graph.local_scope()``; ``edge_softmax`` runs in float32.
    The module's own parameters and the caller's graph are not changed.
    """
    proxy = next((a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.fx.Proxy)),
                 None)
    if proxy is not None:  # re-tracing a converted module: stay one node
        return proxy.tracer.create_proxy("call_function", call_dgl_low, (module, dtype, *args), kwargs)
    params = {name: p.to(dtype) if p.dtype in CASTABLE else p for name, p in module.named_parameters()}
    params.update(_constant_buffers(module, dtype))
    args, kwargs = _cast_tree((args, kwargs), dtype)
    with contextlib.ExitStack() as stack:
        for g in _graphs((args, kwargs)):
            stack.enter_context(g.local_scope())
            _cast_graph_data(g, dtype)
        stack.enter_context(fp32_edge_softmax(type(module)))
        return functional_call(module, params, args, kwargs, tie_weights=True, strict=False)


RUNNERS = (call_dgl_low,)
"""The functions generated code calls for DGL leaves (``mode="inference"`` stores their weights low)."""


def _constant_buffers(module: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Low-precision copies of the float buffers that DGL's own modules keep as constants
    (``GINConv``'s fixed ``eps``: float32 there would promote the whole update back to float32).
    Buffers of ``torch.nn`` submodules (batch-norm statistics, updated in place) are left alone."""
    out = {}
    for path, sub in module.named_modules():
        if not is_dgl(sub):
            continue
        for name, b in sub.named_buffers(recurse=False):
            if b is not None and b.dtype in CASTABLE and b.dtype != dtype:
                out[f"{path}.{name}" if path else name] = b.to(dtype)
    return out


def _cast_tree(values: Any, dtype: torch.dtype) -> Any:
    def one(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.dtype in CASTABLE and v.dtype != dtype:
            return v.to(dtype)
        return v
    return torch.utils._pytree.tree_map(one, values)


def _cast_graph_data(g: Any, dtype: torch.dtype) -> None:
    """Inside a local scope of ``g``: its float node/edge data read as ``dtype``.

    Uses DGL's deferred column cast (``Column.deferred_dtype``, what
    ``Column.astype`` uses for pending transfers), so data the module never
    reads is never copied; with an older or newer DGL lacking it, the columns
    are cast now.
    """
    for frames in (g._node_frames, g._edge_frames):
        for i, frame in enumerate(frames):
            columns = getattr(frame, "_columns", None)
            if not columns:
                continue
            new = frame.clone()
            for name, col in list(new._columns.items()):
                if col.dtype in CASTABLE and col.dtype != dtype:
                    lazy = col.clone()
                    if hasattr(lazy, "deferred_dtype"):
                        if lazy.deferred_dtype is not None:
                            _ = lazy.data  # a pending cast first (same order as Column.astype)
                        lazy.deferred_dtype = dtype
                    else:  # pragma: no cover - other DGL versions
                        lazy = col.astype(dtype)
                    new._columns[name] = lazy
            frames[i] = new


_PATCH_LOCK = threading.Lock()
_PATCHED: dict[types.ModuleType, tuple[Callable[..., Any], int]] = {}
"""Python module whose ``edge_softmax`` is wrapped now -> (DGL's function, how many calls need the wrapper)."""


def _edge_softmax_homes(cls: type) -> list[types.ModuleType]:
    """The Python modules of ``cls`` and its bases that call ``edge_softmax`` by a module-level name."""
    homes = []
    for klass in cls.__mro__:
        home = sys.modules.get(getattr(klass, "__module__", ""))
        if home is not None and getattr(home, "edge_softmax", None) is not None and home not in homes:
            homes.append(home)
    return homes


def _fp32_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    def edge_softmax(graph: Any, logits: torch.Tensor, *a: Any, **k: Any) -> Any:
        if _FP32_EDGE_SOFTMAX.get() and isinstance(logits, torch.Tensor) and logits.dtype in (
                torch.float16, torch.bfloat16):
            return original(graph, logits.float(), *a, **k).to(logits.dtype)
        return original(graph, logits, *a, **k)

    edge_softmax.__wrapped__ = original
    edge_softmax.__doc__ = original.__doc__
    edge_softmax._ampfx_fp32 = True
    return edge_softmax


@contextlib.contextmanager
def fp32_edge_softmax(cls: type) -> Iterator[None]:
    """Inside the block, ``edge_softmax`` as called by ``cls`` (the name in its Python module,
    e.g. ``dgl.nn.pytorch.conv.gatconv``, and its bases') runs in float32 for this thread's
    low-precision logits: the logits are cast up, the attention weights back down. DGL's own
    function is put back when the last block using it exits (blocks in other threads count);
    calls outside any block, from any thread, reach DGL's function unchanged.

    >>> class NoSoftmax: ...
    >>> with fp32_edge_softmax(NoSoftmax): pass   # nothing to wrap
    """
    homes = _edge_softmax_homes(cls)
    with _PATCH_LOCK:
        for home in homes:
            original, users = _PATCHED.get(home, (home.edge_softmax, 0))
            if users == 0:
                home.edge_softmax = _fp32_wrapper(original)
            _PATCHED[home] = (original, users + 1)
    token = _FP32_EDGE_SOFTMAX.set(True)
    try:
        yield
    finally:
        _FP32_EDGE_SOFTMAX.reset(token)
        with _PATCH_LOCK:
            for home in homes:
                original, users = _PATCHED.pop(home)
                if users == 1:
                    home.edge_softmax = original
                else:
                    _PATCHED[home] = (original, users - 1)


def _calls_edge_softmax(cls: type) -> bool:
    return any(getattr(sys.modules.get(getattr(k, "__module__", "")), "edge_softmax", None) is not None
               for k in cls.__mro__)
