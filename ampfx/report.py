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
import io
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from .ops import Category

COMPUTE = ("call_function", "call_method", "call_module")
INSERTED = ("bias-fp32", "pad", "region")  # not counted as the model's converted / float32 ops  # rules of nodes ampfx adds (not the model's ops; not counted as converted)

RULES_DOC: dict[str, str] = {
    "table": "the default op tables (ampfx.ops) for this dtype",
    "argument": "a list edit given as a Policy argument",
    "env:<VAR>": "a list edit from that environment variable",
    "unlisted": "the op is in no list: it stays float32",
    "non-float": "no float32/16/bf16 data flows through the node",
    "fp32_modules": "inside a module named in fp32_modules / AMPFX_FP32_MODULES",
    "module_filter_fn": "inside a module the policy's module_filter_fn rejected",
    "probe": "the low-precision kernel failed a tiny test run on this device",
    "paint:deny": "follows a deny op through infer/clear ops (TF-AMP deny propagation)",
    "paint:between-allow": "on a path between low-precision ops (TF-AMP)",
    "paint:follow-allow": "an infer op fed by a low op and no deny op (bfloat16); all float inputs low (float16)",
    "paint:clear": "a clear op next to a low-precision op (TF-AMP clear propagation)",
    "paint:save-cast": "every user computes in float32 and the inputs are cast to float32 anyway, or its region of "
                       "infer/clear ops needs fewer casts and moves no more bytes in float32: float32 saves casts",
    "paint:default": "an infer/clear op with no low-precision neighbours: stays float32",
    "select": "indexing keeps its input's dtype; consumers cast the (smaller) selection",
    "dgl:device": "a DGL leaf whose kernels lack the low dtype on this device (no float16 on CPU): bfloat16 or float32",
    "dgl:overflow": "a DGL sum/mean aggregation whose example inputs would overflow float16: bfloat16 or float32",
    "bias-fp32": "a GEMM bias added in float32 after the GEMM's float32 cast (no bias cast)",
    "shape:small-reduction": "a reduction over at most reduction_threshold elements: follows its inputs",
    "shape:large-reduction": "a reduction over more than reduction_threshold elements",
    "shape:size-unknown": "a reduction whose size is unknown (no example_inputs, or a symbolic range): float32",
    "calibration:overflow": "calibration saw this node's output or gradient exceed the low dtype's range",
    "pad": "a node ampfx added to slice a padded GEMM's output back",
    "inplace": "an in-place op keeps the dtype of the tensor it mutates",
    "range:constant": "a float constant argument the low dtype cannot hold (e.g. a float32 mask minimum)",
    "region": "a module that could not be traced runs eagerly; its children were converted one by one",
    "structure": "graph inputs, parameters and outputs",
}


def dtype_name(d: Any) -> str:
    if d is None:
        return "-"
    return str(d).replace("torch.", "")


@dataclass(frozen=True)
class Decision:
    """Why one node got its dtype.

    ``dtype`` is the dtype the node computes in (``None``: left as written).
    ``shapes`` / ``in_shapes`` are its output and tensor-input shapes, as
    ``dtype[sizes]`` before conversion (symbolic sizes by name), when
    ``example_inputs`` were given.
    ``rule`` names the rule that decided (see ``RULES_DOC``); ``reason`` says it
    in words. ``out`` is the dtype of the value the node produces after
    conversion (``"dynamic"`` when only known at run time).
    """

    node: str
    op: str
    target: str
    module: str
    category: Category
    dtype: torch.dtype | None
    rule: str
    reason: str
    kind: str = "call_function"
    shapes: tuple[str, ...] = ()
    in_shapes: tuple[str, ...] = ()
    out: torch.dtype | str | None = None
    inplace: bool = False

    def as_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["category"] = self.category.value
        d["dtype"] = dtype_name(self.dtype) if self.dtype is not None else None
        d["out"] = dtype_name(self.out) if isinstance(self.out, torch.dtype) else self.out
        d["shapes"] = list(self.shapes)
        d["in_shapes"] = list(self.in_shapes)
        return d


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
    """How one part of the model was captured: ``path`` ('' = root), ``method``, ``steps``."""

    path: str
    method: str
    steps: tuple[str, ...] = ()
    leaves: tuple[tuple[str, str], ...] = ()


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
                if r.kind in COMPUTE and r.category is not Category.PASS and r.rule not in INSERTED]

    def fp32(self) -> list[Decision]:
        return [r for r in self.compute if r.dtype == torch.float32]

    def low(self) -> list[Decision]:
        return [r for r in self.compute if r.dtype == self.dtype]

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
        groups = Counter((r.op, _rule_word(r.rule)) for r in self.fp32() if r.rule != "unlisted")
        parts = [f"{op} {n} ({why})" for (op, why), n in sorted(groups.items(), key=lambda kv: (-kv[1], kv[0]))]
        lines = [head]
        if parts:
            lines.append(f"  float32: {', '.join(parts)}")
        unlisted = Counter(r.op for r in self.fp32() if r.rule == "unlisted")
        if unlisted:
            lines.append("  not in any list (float32): " + ", ".join(f"{op} {n}" for op, n in unlisted.most_common()))
        lines += [f"  {note}" for note in self.notes if note.startswith(("inference mode", "loss scaling"))]
        for reg in self.regions:
            if reg.method not in ("fx",) or reg.leaves:
                where = reg.path or "<root>"
                extra = f"; leaves: {', '.join(p for p, _ in reg.leaves)}" if reg.leaves else ""
                lines.append(f"  capture {where}: {reg.method}{extra}")
        return "\n".join(lines)

    def table(self, *, width: int = 160, color: bool | None = None, all_nodes: bool = False,
              group: bool = True) -> str:
        """A readable table (rich) of the compute nodes: node, op, module,
        category, dtype, rule, reason, coloured by dtype. ``group`` puts the
        rows of each top-level module together (in order of first appearance),
        float32 rows first so their reasons lead; ``group=False`` keeps graph
        order. ``all_nodes`` adds inputs, parameters and outputs."""
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"ampfx decisions ({dtype_name(self.dtype)})", show_lines=False)
        for col in ("node", "op", "module", "category", "dtype", "rule", "reason"):
            t.add_column(col, overflow="fold")
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
            t.add_row(r.node, r.op, r.module or "", r.category.value, dtype_name(r.dtype), r.rule, r.reason,
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
        picture (:meth:`html`)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
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


def _rule_word(rule: str) -> str:
    return {"table": "deny list", "paint:deny": "follows deny", "paint:default": "no low neighbour",
            "probe": "no low kernel here", "fp32_modules": "fp32 module", "inplace": "in-place",
            "paint:save-cast": "saves a cast"}.get(rule, rule)


def _write_lines(path: Path, rows: Iterable[dict]) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, default=str) + "\n")
