"""Decision records and the report built from them.

Every node of a converted graph carries a frozen record in
``node.meta['ampfx']``: a :class:`Decision` for the model's own nodes, a
:class:`CastInfo` for each cast ampfx inserted. The :class:`Report` attached
to a converted module as ``ampfx_report`` is built from those records (never
kept in a side table) and holds no reference to the graph, so it pickles.

>>> import torch, ampfx
>>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1))
>>> rep = ampfx.convert(m, "bf16").ampfx_report
>>> [(r.op, str(r.dtype), r.rule) for r in rep.compute]
[('linear', 'torch.bfloat16', 'table'), ('softmax', 'torch.float32', 'table')]
"""
from __future__ import annotations

import dataclasses
import enum
import io
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from .ops import Category

COMPUTE = ("call_function", "call_method", "call_module")

SHORT_NAMES: dict[torch.dtype, str] = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
"""The short spellings of the float dtypes ampfx converts between (cast node names, plots)."""


def dtype_name(d: Any, *, short: bool = False, none: str = "-") -> str:
    """How ampfx writes a dtype: ``"bfloat16"`` for ``torch.bfloat16`` (``"bf16"``
    with ``short``, for the dtypes in :data:`SHORT_NAMES`), ``none`` for ``None``,
    and anything else (``"dynamic"``) as it is.

    >>> dtype_name(torch.bfloat16), dtype_name(torch.float16, short=True), dtype_name(None), dtype_name("dynamic")
    ('bfloat16', 'fp16', '-', 'dynamic')
    """
    if d is None:
        return none
    if short and d in SHORT_NAMES:
        return SHORT_NAMES[d]
    return str(d).replace("torch.", "")


@dataclass(frozen=True)
class _About:
    """What a :class:`Rule` member carries besides its value (see there)."""

    doc: str
    word: str | None = None
    inserted: bool = False
    counted: bool = True


def _about(doc: str, *, word: str | None = None, inserted: bool = False, counted: bool | None = None) -> _About:
    return _About(doc, word, inserted, (not inserted) if counted is None else counted)


class Rule(str, enum.Enum):
    """What decided a node's dtype: ``Decision.rule``.

    A member is its value, a string (``Rule.TABLE == "table"``), and prints,
    formats, reprs and serialises to JSON as that string, so records read the
    same as plain strings. Each member carries:

    - ``doc``: one line saying what the rule means (the report page shows it);
    - ``word``: the short word the summary's ``float32:`` line uses for it;
    - ``inserted``: the node is one ampfx added to the graph (drawn dotted);
    - ``counted``: the node counts as one of the model's compute nodes in the
      summary (not for nodes ampfx added, nor for an untraceable region, whose
      children are counted instead).

    A list edit from the environment is ``env:<VAR>`` with the variable's name:
    ``Rule("env:AMPFX_DENYLIST_ADD")`` (or ``Rule.env("AMPFX_DENYLIST_ADD")``) is
    a member made on demand, with :attr:`ENV`'s documentation.

    >>> Rule("table") is Rule.TABLE, Rule.TABLE == "table", f"{Rule.PAINT_DENY}", Rule.PAINT_DENY.word
    (True, True, 'paint:deny', 'follows deny')
    >>> r = Rule.env("AMPFX_DENYLIST_ADD")
    >>> r, r == "env:AMPFX_DENYLIST_ADD", r.env_var, r.doc == Rule.ENV.doc
    ('env:AMPFX_DENYLIST_ADD', True, 'AMPFX_DENYLIST_ADD', True)
    """

    def __new__(cls, value: str, about: _About) -> "Rule":
        member = str.__new__(cls, value)
        member._value_ = value
        member._info = about
        return member

    TABLE = "table", _about("the default op tables (ampfx.ops) for this dtype", word="deny list")
    ARGUMENT = "argument", _about("a list edit given as a Policy argument")
    ENV = "env:<VAR>", _about("a list edit from that environment variable")
    UNLISTED = "unlisted", _about("the op is in no list: it stays float32")
    NON_FLOAT = "non-float", _about("no float32/16/bf16 data flows through the node")
    OTHER_FLOAT = "other-float", _about("the op computes in float64, a complex dtype or another float dtype that ampfx "
                                        "never converts: it runs as written, in that dtype")
    FP32_MODULES = "fp32_modules", _about("inside a module named in fp32_modules / AMPFX_FP32_MODULES",
                                          word="fp32 module")
    MODULE_FILTER_FN = "module_filter_fn", _about("inside a module the policy's module_filter_fn rejected")
    USER_FLOAT32 = "user-float32", _about("the model's code asks for float32 here: inside "
                                          "torch.autocast(..., enabled=False)", word="user float32")
    PROBE = "probe", _about("the low-precision kernel failed a tiny test run on this device",
                            word="no low kernel here")
    COMPLEX = "complex", _about("makes complex numbers from real data (torch.complex, view_as_complex, x * 1j): "
                                "bfloat16 has no complex dtype and float16's has few kernels, so it reads float32",
                                word="makes complex")
    PAINT_DENY = "paint:deny", _about("follows a deny op through infer/clear ops (TF-AMP deny propagation)",
                                      word="follows deny")
    PAINT_BETWEEN_ALLOW = "paint:between-allow", _about("on a path between low-precision ops (TF-AMP)")
    PAINT_FOLLOW_ALLOW = "paint:follow-allow", _about(
        "an infer op fed by a low op and no deny op (bfloat16); all float inputs low (float16)")
    PAINT_CLEAR = "paint:clear", _about("a clear op next to a low-precision op (TF-AMP clear propagation)")
    PAINT_SAVE_CAST = "paint:save-cast", _about(
        "every user computes in float32 and the inputs are cast to float32 anyway, or its region of "
        "infer/clear ops needs fewer casts and moves no more bytes in float32: float32 saves casts",
        word="saves a cast")
    WRITE_LOW = "cost:write-low", _about(
        "a float32 op (softmax) whose low-precision kernel computes in float32 inside and rounds once, and whose "
        "consumers all read its result low: it writes the low dtype (the same values, no cast, its saved output "
        "half the bytes)", word="writes low")
    NO_FLOAT32_COPY = "cost:no-float32-copy", _about(
        "the model's own conversion of a low value to float32, whose users all read it low: left out (they "
        "would get the same values back)", word="float32 copy left out")
    FIDELITY_STREAM = "fidelity:stream", _about(
        "reads a float32 activation (a residual stream, a carried state, positions): computes in float32 as "
        "type promotion would, instead of casting that value down (Policy.float32_stream)", word="float32 stream")
    FIDELITY_OPERAND = "fidelity:operand", _about(
        "an add/sub of a float32 parameter, buffer or factory value (arange, meshgrid): computes in float32, "
        "so the operand's low bits survive (Policy.float32_operands)", word="float32 operand")
    FIDELITY_EXACT = "fidelity:exact", _about(
        "its value reaches an integer conversion, an index or a comparison: float32 inputs are not rounded "
        "(Policy.exact_values)", word="exact value")
    PAINT_DEFAULT = "paint:default", _about("an infer/clear op with no low-precision neighbours: stays float32",
                                            word="no low neighbour")
    SELECT = "select", _about("indexing keeps its input's dtype; consumers cast the (smaller) selection")
    DGL_DEVICE = "dgl:device", _about(
        "a DGL leaf whose kernels lack the low dtype on this device (no float16 on CPU): bfloat16 or float32")
    DGL_OVERFLOW = "dgl:overflow", _about(
        "a DGL sum/mean aggregation whose example inputs would overflow float16: bfloat16 or float32")
    BIAS_FP32 = "bias-fp32", _about("a GEMM bias added in float32 after the GEMM's float32 cast (no bias cast)",
                                    inserted=True)
    SHAPE_SMALL_REDUCTION = "shape:small-reduction", _about(
        "a reduction over at most reduction_threshold elements: follows its inputs")
    SHAPE_LARGE_REDUCTION = "shape:large-reduction", _about("a reduction over more than reduction_threshold elements")
    SHAPE_SIZE_UNKNOWN = "shape:size-unknown", _about(
        "a reduction whose size is unknown (no example_inputs, or a symbolic range): float32")
    CALIBRATION_OVERFLOW = "calibration:overflow", _about(
        "calibration saw this node's output or gradient exceed the low dtype's range")
    CALIBRATION_SENSITIVE = "calibration:sensitive", _about(
        "calibration saw that rounding this node's result alone to the low dtype moves the output or a parameter "
        "gradient by more than sensitivity_threshold", word="precision-sensitive")
    TUNE = "tune", _about(
        "ampfx.tune found that keeping this node float32 brings the user's metric within tolerance of the float32 "
        "model's (Policy.tuned, or a policy file)", word="tuned")
    PAD = "pad", _about("a node ampfx added to slice a padded GEMM's output back", inserted=True)
    INPLACE = "inplace", _about("an in-place op keeps the dtype of the tensor it mutates", word="in-place")
    RANGE_CONSTANT = "range:constant", _about(
        "a float constant argument the low dtype cannot hold (e.g. a float32 mask minimum)")
    KEPT = "keep_modules", _about("a module kept as a boundary (keep_modules): its forward runs, converted on its "
                                  "own; float32 crosses the boundary both ways", word="kept module", counted=False)
    REGION = "region", _about("a module that could not be traced runs eagerly; its children were converted one by one",
                              counted=False)
    STRUCTURE = "structure", _about("graph inputs, parameters and outputs")

    # str, not "Rule.TABLE", wherever a rule is printed: records read as they did when rules were strings
    __str__ = str.__str__
    __format__ = str.__format__

    def __repr__(self) -> str:
        return repr(self._value_)

    @classmethod
    def _missing_(cls, value: object) -> "Rule | None":
        """``env:<VAR>`` for any variable: a member made (once) on demand."""
        if not (isinstance(value, str) and value.startswith("env:") and len(value) > len("env:")):
            return None
        member = str.__new__(cls, value)
        member._name_ = "ENV"
        member._value_ = value
        member._info = _About(cls.ENV.doc)
        return cls._value2member_map_.setdefault(value, member)

    @classmethod
    def env(cls, var: str) -> "Rule":
        """The rule of a list edit read from the environment variable ``var``."""
        return cls(f"env:{var}")

    @property
    def doc(self) -> str:
        """What the rule means, in one line."""
        return self._info.doc

    @property
    def word(self) -> str:
        """The summary's short word for the rule (its value unless it has one)."""
        return self._info.word or self._value_

    @property
    def inserted(self) -> bool:
        """Is a node with this rule one ampfx added to the graph (a bias add, a pad slice)?"""
        return self._info.inserted

    @property
    def counted(self) -> bool:
        """Does a node with this rule count among the model's compute nodes in the summary?"""
        return self._info.counted

    @property
    def env_var(self) -> str | None:
        """The environment variable of an ``env:<VAR>`` rule; ``None`` for other rules."""
        return self._value_[len("env:"):] if self._name_ == "ENV" and self is not Rule.ENV else None


@dataclass(frozen=True)
class Decision:
    """Why one node got its dtype.

    ``dtype`` is the dtype the node computes in (``None``: left as written).
    ``shapes`` / ``in_shapes`` are its output and tensor-input shapes, as
    ``dtype[sizes]`` before conversion (symbolic sizes by name), when
    ``example_inputs`` were given.
    ``rule`` is the :class:`Rule` that decided (a rule's value is accepted and
    made a member); ``reason`` says it in words. ``out`` is the dtype of the value the node produces after
    conversion (``"dynamic"`` when only known at run time). ``fp32_inside`` says what stays float32
    inside a low-precision op, one ``"what: names"`` item each (``"running statistics: bn.running_mean,
    bn.running_var"``, ``"affine parameters: bn.weight, bn.bias"``, ``"accumulation"``).
    ``autocast`` is the dtype ``torch.autocast`` would compute the node in on the conversion device
    (``"unknown"`` where that cannot be known, ``None`` for non-float values, on devices without
    autocast, and for nodes ampfx inserted): see :meth:`Report.autocast_diff`.
    """

    node: str
    op: str
    target: str
    module: str
    category: Category
    dtype: torch.dtype | None
    rule: Rule
    reason: str
    kind: str = "call_function"
    shapes: tuple[str, ...] = ()
    in_shapes: tuple[str, ...] = ()
    out: torch.dtype | str | None = None
    inplace: bool = False
    fp32_inside: tuple[str, ...] = ()
    autocast: torch.dtype | str | None = None

    def __post_init__(self) -> None:
        if type(self.rule) is not Rule:  # dataclasses.replace passes the member back: skip Enum's lookup
            object.__setattr__(self, "rule", Rule(self.rule))

    @property
    def key(self) -> str:
        """The node's name across the whole conversion, as ``Policy.tuned`` names it: ``module:node``
        (``node`` alone at the root); a name repeats in different graphs, a module's graph is one.

        >>> Decision("linear", "linear", "linear", "head", Category.ALLOW, None, "table", "").key
        'head:linear'
        """
        return f"{self.module}:{self.node}" if self.module else self.node

    def as_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["category"] = self.category.value
        d["dtype"] = dtype_name(self.dtype) if self.dtype is not None else None
        d["out"] = dtype_name(self.out) if isinstance(self.out, torch.dtype) else self.out
        d["shapes"] = list(self.shapes)
        d["in_shapes"] = list(self.in_shapes)
        d["fp32_inside"] = list(self.fp32_inside)
        d["autocast"] = dtype_name(self.autocast) if isinstance(self.autocast, torch.dtype) else self.autocast
        # the shapes' dtypes are the original model's, ``dtype`` and ``out`` the conversion's: the keys say so
        return {JSON_KEYS.get(k, k): v for k, v in d.items()}


JSON_KEYS = {"shapes": "shapes_before", "in_shapes": "in_shapes_before"}
"""Decision fields renamed in :meth:`Decision.as_json`: their dtypes are before conversion."""


@dataclass(frozen=True)
class CastInfo:
    """One cast ampfx inserted: ``value`` to ``to``, shared by ``consumers``."""

    node: str
    value: str
    source: torch.dtype | str | None
    to: torch.dtype
    consumers: tuple[str, ...]
    weight: bool = False
    reason: str = ""

    def as_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["source"] = dtype_name(self.source) if isinstance(self.source, torch.dtype) else self.source
        d["to"] = dtype_name(self.to)
        d["consumers"] = list(self.consumers)
        return d


@dataclass(frozen=True)
class Region:
    """How one part of the model was captured: ``path`` ('' = root), ``method``, the ``steps``
    tried, the ``leaves`` kept opaque (path, why) and ``why`` the capture was accepted."""

    path: str
    method: str
    steps: tuple[str, ...] = ()
    leaves: tuple[tuple[str, str], ...] = ()
    why: str = ""


@dataclass(frozen=True)
class AutocastDiff:
    """One compute node whose dtype under ampfx (``dtype``) is not the one ``torch.autocast`` would
    compute it in (``autocast``), with the ``rule`` and ``reason`` that decided ampfx's dtype."""

    node: str
    op: str
    module: str
    dtype: torch.dtype
    autocast: torch.dtype
    rule: Rule
    reason: str

    def as_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["dtype"], d["autocast"], d["rule"] = dtype_name(self.dtype), dtype_name(self.autocast), str(self.rule)
        return d


def computes_in(r: Decision) -> torch.dtype | None:
    """The dtype a record's node computes in under ampfx: its ``dtype``, else (left as written) the
    dtype of its value, else ``None``."""
    if r.dtype is not None:
        return r.dtype
    return r.out if isinstance(r.out, torch.dtype) else None


@dataclass(frozen=True)
class Report:
    """The decision log of one :func:`ampfx.convert` call."""

    dtype: torch.dtype
    records: tuple[Decision, ...] = ()
    casts: tuple[CastInfo, ...] = ()
    regions: tuple[Region, ...] = ()
    leaf_param_casts: int = 0
    shapes: str = "no example_inputs: dtypes assumed float32 at graph inputs, casts check dtypes at run time"
    policy: dict[str, Any] = field(default_factory=dict)
    code_before: dict[str, str] = field(default_factory=dict)
    code_after: dict[str, str] = field(default_factory=dict)
    disabled: bool = False
    notes: tuple[str, ...] = ()

    # ------------------------------------------------------------------ views
    @property
    def compute(self) -> list[Decision]:
        """Records of nodes that compute on float data (what "nodes" counts in the summary)."""
        return [r for r in self.records
                if r.kind in COMPUTE and r.category is not Category.PASS and r.rule.counted]

    def fp32(self) -> list[Decision]:
        return [r for r in self.compute if r.dtype == torch.float32]

    def low(self) -> list[Decision]:
        return [r for r in self.compute if r.dtype == self.dtype]

    def autocast_diff(self) -> list[AutocastDiff]:
        """The compute nodes where ampfx's dtype differs from the one ``torch.autocast`` would use on
        the conversion device (``Decision.autocast``), in graph order, each with ampfx's rule and reason:
        the answer to "why not what autocast does?". Nodes whose autocast dtype is not known
        (``"unknown"``, ``None``) are left out: :meth:`autocast_unknown` counts them.

        >>> import torch, ampfx
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1))
        >>> rep = ampfx.convert(m, "bf16", example_inputs=torch.randn(2, 4)).ampfx_report
        >>> [(d.op, str(d.dtype), str(d.autocast), d.rule) for d in rep.autocast_diff()]
        [('softmax', 'torch.float32', 'torch.bfloat16', 'table')]
        """
        out = []
        for r in self.compute:
            mine = computes_in(r)
            if isinstance(r.autocast, torch.dtype) and mine is not None and mine != r.autocast:
                out.append(AutocastDiff(r.node, r.op, r.module, mine, r.autocast, r.rule, r.reason))
        return out

    def autocast_unknown(self) -> list[Decision]:
        """The compute nodes whose dtype under ``torch.autocast`` ampfx cannot know (``"unknown"``: an
        opaque leaf or function, a region run eagerly, a recurrent module, and values computed from them)."""
        return [r for r in self.compute if isinstance(r.autocast, str)]

    def autocast_summary(self) -> str:
        """One line: on how many nodes ampfx differs from ``torch.autocast``, grouped by op and rule
        (``ampfx / autocast`` dtypes), and how many it could not compare.

        >>> import torch, ampfx
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1))
        >>> print(ampfx.convert(m, "bf16", example_inputs=torch.randn(2, 4)).ampfx_report.autocast_summary())
        differs from autocast on 1/2 nodes: softmax 1 (fp32/bf16, deny list)
        """
        diff, unknown = self.autocast_diff(), self.autocast_unknown()
        if not any(r.autocast is not None for r in self.records):
            return "autocast: not compared (no autocast op lists for this device, or no graph was converted)"
        groups = Counter((d.op, dtype_name(d.dtype, short=True), dtype_name(d.autocast, short=True),
                          d.rule.word if d.dtype == torch.float32 else str(d.rule)) for d in diff)  # words say float32
        parts = [f"{op} {n} ({mine}/{theirs}, {why})"
                 for (op, mine, theirs, why), n in sorted(groups.items(), key=lambda kv: (-kv[1], kv[0]))]
        line = f"differs from autocast on {len(diff)}/{len(self.compute)} nodes"
        line += f": {', '.join(parts)}" if parts else ""
        return line + (f"; autocast's dtype unknown for {len(unknown)}" if unknown else "")

    def by_node(self, name: str) -> Decision:
        for r in self.records:
            if r.node == name:
                return r
        raise KeyError(f"no record for node {name!r}; nodes: {', '.join(r.node for r in self.records[:20])}...")

    def summary(self) -> str:
        """One line, like TF-AMP's, then what stayed float32 and why, counted by op."""
        low_name = dtype_name(self.dtype)
        if self.disabled:
            return "ampfx: disabled (AMPFX_DISABLE=1 or Policy(disable=True)): the model is an unconverted copy"
        weights = sum(c.weight for c in self.casts)
        head = (f"ampfx: converted {len(self.low())}/{len(self.compute)} nodes to {low_name} using "
                f"{len(self.casts)} casts ({weights} of weights")
        head += f", {self.leaf_param_casts} parameter copies inside leaves)" if self.leaf_param_casts else ")"
        groups = Counter((r.op, r.rule.word) for r in self.fp32() if r.rule is not Rule.UNLISTED)
        parts = [f"{op} {n} ({why})" for (op, why), n in sorted(groups.items(), key=lambda kv: (-kv[1], kv[0]))]
        lines = [head]
        if parts:
            lines.append(f"  float32: {', '.join(parts)}")
        unlisted = Counter(r.op for r in self.fp32() if r.rule is Rule.UNLISTED)
        if unlisted:
            lines.append("  not in any list (float32): " + ", ".join(f"{op} {n}" for op, n in unlisted.most_common()))
        lines += self._inside_lines()
        lines += [f"  {note}" for note in self.notes if note.startswith(("inference mode", "loss scaling"))]
        for reg in self.regions:
            if reg.method not in ("fx",) or reg.leaves:
                where = reg.path or "<root>"
                extra = f"; leaves: {', '.join(p for p, _ in reg.leaves)}" if reg.leaves else ""
                lines.append(f"  capture {where}: {reg.method}{extra}")
        return "\n".join(lines)

    def _inside_lines(self) -> list[str]:
        """The summary's lines for what is not plain low precision inside the converted nodes:
        ``float32 inside bfloat16 ops: batch_norm 1 (running statistics, affine parameters,
        accumulation)``, and ops that run as written in another dtype (``float64 (as given, ampfx
        converts float32 only): linear 2``)."""
        lines = []
        inside = Counter((r.op, ", ".join(part.split(":")[0] for part in r.fp32_inside))
                         for r in self.low() if r.fp32_inside)
        if inside:
            parts = [f"{op} {n} ({what})" for (op, what), n in sorted(inside.items(), key=lambda kv: (-kv[1], kv[0]))]
            lines.append(f"  float32 inside {dtype_name(self.dtype)} ops: {', '.join(parts)}")
        others: dict[str, Counter] = {}
        for r in self.compute:
            if r.rule is Rule.OTHER_FLOAT:
                others.setdefault(dtype_name(r.dtype, none="run-time dtype"), Counter())[r.op] += 1
        for name, ops_ in others.items():
            lines.append(f"  {name} (as given, ampfx converts float32 only): "
                         + ", ".join(f"{op} {n}" for op, n in ops_.most_common()))
        return lines

    def table(self, *, width: int = 160, color: bool | None = None, all_nodes: bool = False,
              group: bool = True, autocast: bool = False) -> str:
        """A readable table (rich) of the compute nodes: node, op, module,
        category, dtype, rule, reason, coloured by dtype. ``group`` puts the
        rows of each top-level module together (in order of first appearance),
        float32 rows first so their reasons lead; ``group=False`` keeps graph
        order. ``all_nodes`` adds inputs, parameters and outputs. ``autocast``
        adds a column with the dtype ``torch.autocast`` would use, marked ``≠`` where
        it differs from ampfx's (:meth:`autocast_diff`)."""
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"ampfx decisions ({dtype_name(self.dtype)})", show_lines=False)
        cols = ("node", "op", "module", "category", "dtype", *(("autocast",) if autocast else ()), "rule", "reason")
        for col in cols:
            t.add_column(col, overflow="fold")
        differs = {d.node for d in self.autocast_diff()} if autocast else set()
        style = {self.dtype: "green", torch.float32: "yellow", None: "dim"}
        rows = list(self.records if all_nodes else [r for r in self.records if r.kind in COMPUTE])
        if group:
            first: dict[str, int] = {}
            for i, r in enumerate(rows):
                first.setdefault(r.module.split(".")[0], i)
            rows = [r for _, r in sorted(enumerate(rows), key=lambda ir: (
                first[ir[1].module.split(".")[0]], ir[1].dtype != torch.float32, ir[0]))]
        previous = None
        for r in rows:
            top = r.module.split(".")[0]
            if group and previous is not None and top != previous:
                t.add_section()
            previous = top
            mark = (("≠ " if r.node in differs else "") + dtype_name(r.autocast),) if autocast else ()
            t.add_row(r.node, r.op, r.module or "", r.category.value, dtype_name(r.dtype), *mark, r.rule, r.reason,
                      style=style.get(r.dtype, ""))
        buf = io.StringIO()
        Console(file=buf, width=width, force_terminal=bool(color), no_color=not color,
                color_system="standard" if color else None).print(t)
        return buf.getvalue()

    def save(self, directory: str | Path) -> Path:
        """Write the decision log to ``directory``: ``decisions.jsonl`` (one
        record per node), ``casts.jsonl``, ``summary.txt``, ``policy.json`` and
        the graph's code before and after (``graph_before.py`` / ``graph_after.py``,
        one file per captured region), and ``report.html``, the graph as a
        picture (:meth:`html`). ``graph_before*.py`` / ``graph_after*.py`` files left
        by an earlier save are removed first; nothing else in ``directory`` is touched."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        for stale in [*out.glob("graph_before*.py"), *out.glob("graph_after*.py")]:
            stale.unlink()  # an older report's regions: only the files save() itself writes
        _write_lines(out / "decisions.jsonl", (r.as_json() for r in self.records))
        _write_lines(out / "casts.jsonl", (c.as_json() for c in self.casts))
        (out / "summary.txt").write_text(self.summary() + "\n")
        meta = {"dtype": dtype_name(self.dtype), "shapes": self.shapes, "disabled": self.disabled,
                "notes": list(self.notes), "policy": self.policy,
                "regions": [dataclasses.asdict(r) for r in self.regions]}
        (out / "policy.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
        for label, codes in (("before", self.code_before), ("after", self.code_after)):
            for path, code in codes.items():
                suffix = f".{path}" if path else ""
                (out / f"graph_{label}{suffix}.py").write_text(code)
        (out / "report.html").write_text(self.html(), encoding="utf-8")
        return out

    def html(self) -> str:
        """One self-contained HTML page showing the rewritten graph: nodes coloured
        by dtype, the casts ampfx inserted, modules that collapse and expand
        (see :mod:`ampfx.ui.html`)."""
        from .ui.html import render

        return render(self)

    @staticmethod
    def merge(dtype: torch.dtype, parts: Iterable["Report"], **kw: Any) -> "Report":
        """One report for a model converted region by region."""
        parts = list(parts)
        kw["notes"] = tuple(dict.fromkeys([*(n for p in parts for n in p.notes), *kw.pop("notes", ())]))
        return Report(
            dtype=dtype,
            records=tuple(r for p in parts for r in p.records),
            casts=tuple(c for p in parts for c in p.casts),
            regions=tuple(g for p in parts for g in p.regions) + tuple(kw.pop("regions", ())),
            leaf_param_casts=sum(p.leaf_param_casts for p in parts),
            code_before={k: v for p in parts for k, v in p.code_before.items()},
            code_after={k: v for p in parts for k, v in p.code_after.items()},
            **kw,
        )


def _write_lines(path: Path, rows: Iterable[dict]) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, default=str) + "\n")
