"""The report built from the decision records (:mod:`ampfx.report.records`).

Every node of a converted graph carries a frozen record in
``node.meta['ampfx']``: a :class:`~ampfx.report.records.Decision` for the model's own nodes, a
:class:`~ampfx.report.records.CastInfo` for each cast ampfx inserted. The :class:`Report` attached
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
import os
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from ..errors import PathError
from ..ops import ENTRIES, Category
from ..paths import check_writable
from .html import render
from .records import COMPUTE, dtype_name, Rule, Decision, CastInfo, Part, AutocastDiff, computes_in

@dataclass(frozen=True)
class Report:
    """The decision log of one :func:`ampfx.convert` call."""

    dtype: torch.dtype
    records: tuple[Decision, ...] = ()
    casts: tuple[CastInfo, ...] = ()
    parts: tuple[Part, ...] = ()
    leaf_param_casts: int = 0
    shapes: str = "no example_inputs: dtypes assumed float32 at graph inputs, casts check dtypes at run time"
    policy: dict[str, Any] = field(default_factory=dict)
    code_before: dict[str, str] = field(default_factory=dict)
    code_after: dict[str, str] = field(default_factory=dict)
    #: each step run on each graph: (graph path, step, seconds), in the order they ran (ampfx.observer)
    steps: tuple[tuple[str, str, float], ...] = ()
    #: with log_path: each graph's code after each step, {graph path: ((step, code), ...)}
    step_code: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    disabled: bool = False
    notes: tuple[str, ...] = ()

    # ------------------------------------------------------------------ views
    @property
    def compute(self) -> list[Decision]:
        """Records of nodes that compute on float data (what "nodes" counts in the summary)."""
        return [r for r in self.records
                if r.kind in COMPUTE and r.category is not Category.PASS and r.rule.counted]

    @property
    def regions(self) -> tuple[Part, ...]:
        """Deprecated: :attr:`parts`, the name it had."""
        warnings.warn("Report.regions is deprecated: read Report.parts", DeprecationWarning, stacklevel=2)
        return self.parts

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A report pickled before :attr:`parts` had its name (with a converted module) loads with it."""
        if "regions" in state:
            state = {**state, "parts": state["regions"]}
            del state["regions"]
        self.__dict__.update(state)

    @property
    def gemms(self) -> int | None:
        """The ATen GEMMs (:data:`ampfx.ops.ATEN_GEMMS`: ``mm``, ``addmm``, ``bmm``, ``baddbmm``,
        ``convolution``, fused attention) one forward of the converted model runs on the example inputs,
        counted per node on the converted graph (:mod:`ampfx.passes.gemms`): a leaf module or an opaque
        function counts every GEMM it runs (``nn.MultiheadAttention`` several, a ``torch.fx.wrap``-ped
        attention helper two), a module that keeps its Python counts in the graphs of its children.
        ``None`` where a graph's GEMMs were not counted (no example inputs).

        >>> import torch, ampfx
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> rep = ampfx.convert(m, "bf16", example_inputs=torch.randn(2, 4)).ampfx_report
        >>> rep.gemms, rep.gemms_low
        (2, 2)
        """
        return self._gemm_sum("gemms")

    @property
    def gemms_low(self) -> int | None:
        """Of :attr:`gemms`, those whose first input is in the low dtype; ``None`` where not counted."""
        return self._gemm_sum("gemms_low")

    def _gemm_sum(self, field_: str) -> int | None:
        """``gemms`` / ``gemms_low`` over the model. A module that keeps its Python (rule ``eager``) ran its
        own GEMMs and its children's, every call, as its node in its parent's graph counted them: that count
        stands for all the records inside it. Its own Python is not converted, so the low ones are the
        converted nodes' (its children's)."""
        rows = [r for r in self.records if r.kind in COMPUTE and (r.rule.counted or r.rule is Rule.EAGER)]
        if not rows or any(getattr(r, field_) is None for r in rows):
            return None
        eager = [r.module for r in rows if r.rule is Rule.EAGER]

        def within(r: Decision) -> bool:
            return any(r.module.startswith(p + ".") or (r.module == p and r.rule is not Rule.EAGER) for p in eager)

        if field_ == "gemms_low":
            return sum(r.gemms_low for r in rows if r.rule.counted)
        return sum(r.gemms for r in rows if not within(r))

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
        opaque leaf or function, a module kept eager, a recurrent module, and values computed from them)."""
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
        lines += self._small_gemm_lines()
        lines += self._inside_lines()
        lines += self._gemm_lines()
        lines += self.fp8_lines()
        lines += [f"  {note}" for note in self.notes if note.startswith(("inference mode", "loss scaling", "fp8=", "no GEMM runs"))]
        for reg in self.parts:
            if reg.method not in ("fx",) or reg.leaves or reg.functions:
                where = reg.path or "<root>"
                extra = f"; leaves: {', '.join(p for p, _ in reg.leaves)}" if reg.leaves else ""
                extra += (f"; functions kept whole (torch.fx.wrap): {', '.join(f for f, _ in reg.functions)}"
                          if reg.functions else "")
                if reg.method.startswith("eager") and reg.steps:  # why its Python runs as written
                    first = reg.steps[0].split(": ", 1)[-1].strip()
                    extra += f"; first error: {first[:160]}{'...' if len(first) > 160 else ''}"
                lines.append(f"  capture {where}: {reg.method}{extra}")
        return "\n".join(lines)

    def fp8_lines(self) -> list[str]:
        """With ``fp8=``, the summary's line for it: how many GEMM nodes run in FP8, their share of the forward's GEMM
        FLOPs (those known from the example inputs), and why the others do not, counted by rule. Nothing without
        ``fp8=``.

        >>> import torch, ampfx
        >>> m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
        ...                         torch.nn.Linear(32, 16))
        >>> amp = ampfx.convert(m, "bf16", example_inputs=torch.randn(16, 16), fp8="tensorwise", fp8_roofline="none")
        >>> print(amp.ampfx_report.fp8_lines()[0])
          FP8 (tensorwise): 1/3 GEMM nodes, 32,768 of 65,536 GEMM FLOPs (50%); not FP8: fp8:position 2
        """
        rows = [r for r in self.records if r.fp8 is not None]
        if not rows:
            return []
        on = [r for r in rows if r.fp8.output]
        known = [r for r in rows if r.fp8.flops is not None]
        share = "GEMM FLOPs unknown (no example_inputs, or symbolic sizes)"
        if known:
            total, fp8 = sum(r.fp8.flops for r in known), sum(r.fp8.flops for r in on if r.fp8.flops is not None)
            share = f"{fp8:,} of {total:,} GEMM FLOPs ({fp8 / total:.0%})" if total else "no GEMM FLOPs"
            if len(known) < len(rows):
                share += f" of the {len(known)} nodes whose FLOPs are known (matrix products)"
        off = Counter(r.fp8.rule.value for r in rows if not r.fp8.output)
        why = ", ".join(f"{rule} {n}" for rule, n in sorted(off.items(), key=lambda kv: (-kv[1], kv[0])))
        return [f"  FP8 ({rows[0].fp8.recipe}): {len(on)}/{len(rows)} GEMM nodes, {share}"
                + (f"; not FP8: {why}" if why else ""), *_fp8_calibration_line(rows)]

    def _small_gemm_lines(self) -> list[str]:
        """The summary's line for the GEMM nodes kept float32 as under the device's break-even (rule
        ``cost:small-gemm``), with the switch that lowers them; nothing where there are none.

        >>> import torch, ampfx
        >>> m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        >>> amp = ampfx.convert(m, "bf16", example_inputs=torch.randn(8, 16), gemm_min_flops=10_000)
        >>> print(amp.ampfx_report._small_gemm_lines()[0])
          small GEMMs: 2 GEMM nodes stay float32, under the break-even of bfloat16 GEMMs (float32 is faster there; each reason says why; gemm_min_flops=0 / AMPFX_GEMM_MIN_FLOPS=0 lowers them)
        """
        small = [r for r in self.records if r.rule is Rule.COST_SMALL_GEMM]
        if not small:
            return []
        n = len(small)
        return [f"  small GEMMs: {n} GEMM node{'s stay' if n > 1 else ' stays'} float32, under the break-even of "
                f"{dtype_name(self.dtype)} GEMMs (float32 is faster there; each reason says why; gemm_min_flops=0 / "
                "AMPFX_GEMM_MIN_FLOPS=0 lowers them)"]

    def _gemm_lines(self) -> list[str]:
        """The summary's line for GEMMs that do not run in the low dtype inside nodes whose op is not a GEMM
        of the allow list (those the ``float32:`` line shows), by op and rule: ``GEMMs: 2/4 in bfloat16;
        the others in mylib.attend 2 (unlisted)``. Nothing where there are none or none was counted."""
        total, low = self.gemms, self.gemms_low
        if total is None or low is None or low == total:
            return []
        others, shown = Counter(), 0
        for r in self.records:
            if r.kind in COMPUTE and r.rule.counted and r.gemms:
                if r.op in ENTRIES and ENTRIES[r.op].category is Category.ALLOW:  # a GEMM op: the node shows it
                    shown += r.gemms - (r.gemms_low or 0)
                else:
                    others[(r.op, r.rule.word)] += r.gemms - (r.gemms_low or 0)
        parts = [f"{op} {n} ({why})" for (op, why), n in sorted(others.items(), key=lambda kv: (-kv[1], kv[0])) if n]
        eager = total - low - shown - sum(others.values())  # the own Python of modules that keep it
        if eager > 0:
            paths = [r.module for r in self.records if r.rule is Rule.EAGER and r.gemms]
            parts.append(f"the Python of {', '.join(paths[:3])}{' ...' if len(paths) > 3 else ''} {eager} (eager)")
        if not parts:
            return []
        return [f"  GEMMs: {low}/{total} in {dtype_name(self.dtype)}; the others in {', '.join(parts)}"]

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
        it differs from ampfx's (:meth:`autocast_diff`). With ``fp8=``, an ``fp8`` column gives each GEMM node's
        FP8 rule (the reason is in its record)."""
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"ampfx decisions ({dtype_name(self.dtype)})", show_lines=False)
        fp8 = any(r.fp8 is not None for r in self.records)  # fp8=: each GEMM node's FP8 rule
        cols = ("node", "op", "module", "category", "dtype", *(("autocast",) if autocast else ()),
                *(("fp8",) if fp8 else ()), "rule", "reason")
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
            eight = ((r.fp8.rule if r.fp8 is not None else "",) if fp8 else ())
            t.add_row(r.node, r.op, r.module or "", r.shown_category, dtype_name(r.dtype), *mark, *eight, r.rule,
                      r.reason, style=style.get(r.dtype, ""))
        buf = io.StringIO()
        Console(file=buf, width=width, force_terminal=bool(color), no_color=not color,
                color_system="standard" if color else None).print(t)
        return buf.getvalue()

    def save(self, directory: str | Path) -> Path:
        """Write the decision log to ``directory``: ``decisions.jsonl`` (one
        record per node), ``casts.jsonl``, ``summary.txt``, ``policy.json`` and
        the graph's code before and after (``graph_before.py`` / ``graph_after.py``,
        one file per part captured as a graph), ``steps.json`` (every step run on every graph, with its
        seconds), the graph after each step when the conversion kept it (``log_path``:
        ``steps/<graph>/NN_<step>.py``, ``<graph>`` ``root`` for the model's), and ``report.html``,
        the graph as a picture (:meth:`html`). ``graph_before*.py`` / ``graph_after*.py`` and
        ``steps/*/*.py`` files left by an earlier save are removed first; nothing else in
        ``directory`` is touched. A directory that cannot be written (or made) is a
        :class:`~ampfx.errors.PathError` naming it, raised before anything is written."""
        what = f"Report.save({str(directory)!r})" if isinstance(directory, (str, os.PathLike)) else \
            f"Report.save({directory!r})"
        out = check_writable(directory, what, directory=True)
        try:
            self._write(out)
        except OSError as e:
            raise PathError(f"{what}: cannot write the report there ({e.strerror or e})") from None
        return out

    def _write(self, out: Path) -> None:
        """:meth:`save`'s files, written in ``out``."""
        out.mkdir(parents=True, exist_ok=True)
        for stale in [*out.glob("graph_before*.py"), *out.glob("graph_after*.py"), *out.glob("steps/*/*.py")]:
            stale.unlink()  # an older report's parts: only the files save() itself writes
        _write_lines(out / "decisions.jsonl", (r.as_json() for r in self.records))
        _write_lines(out / "casts.jsonl", (c.as_json() for c in self.casts))
        (out / "summary.txt").write_text(self.summary() + "\n")
        meta = {"dtype": dtype_name(self.dtype), "shapes": self.shapes, "disabled": self.disabled,
                "notes": list(self.notes), "policy": self.policy,
                "parts": [dataclasses.asdict(r) for r in self.parts]}
        meta["regions"] = meta["parts"]  # deprecated: the key's name before "parts", kept for code that reads it
        (out / "policy.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
        for label, codes in (("before", self.code_before), ("after", self.code_after)):
            for path, code in codes.items():
                suffix = f".{path}" if path else ""
                (out / f"graph_{label}{suffix}.py").write_text(code)
        (out / "steps.json").write_text(json.dumps(
            [{"graph": g, "step": s, "seconds": round(t, 6)} for g, s, t in self.steps], indent=1) + "\n")
        for path, steps in self.step_code.items():
            folder = out / "steps" / (path or "root")
            folder.mkdir(parents=True, exist_ok=True)
            for i, (step, code) in enumerate(steps):
                (folder / f"{i:02d}_{step}.py").write_text(code)
        (out / "report.html").write_text(self.html(), encoding="utf-8")

    def html(self) -> str:
        """One self-contained HTML page showing the rewritten graph: nodes coloured
        by dtype, the casts ampfx inserted, modules that collapse and expand
        (see :mod:`ampfx.report.html`)."""
        return render(self)

    @staticmethod
    def merge(dtype: torch.dtype, reports: Iterable["Report"], **kw: Any) -> "Report":
        """One report for a model converted part by part."""
        reports = list(reports)
        kw["notes"] = tuple(dict.fromkeys([*(n for p in reports for n in p.notes), *kw.pop("notes", ())]))
        return Report(
            dtype=dtype,
            records=tuple(r for p in reports for r in p.records),
            casts=tuple(c for p in reports for c in p.casts),
            parts=tuple(g for p in reports for g in p.parts) + tuple(kw.pop("parts", ())),
            leaf_param_casts=sum(p.leaf_param_casts for p in reports),
            code_before={k: v for p in reports for k, v in p.code_before.items()},
            code_after={k: v for p in reports for k, v in p.code_after.items()},
            steps=tuple(s for p in reports for s in p.steps),
            step_code={k: v for p in reports for k, v in p.step_code.items()},
            **kw,
        )


def _write_lines(path: Path, rows: Iterable[dict]) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, default=str) + "\n")


def __getattr__(name: str) -> Any:
    """``Region``, the name :class:`~ampfx.report.records.Part` had: deprecated, kept so that older code imports."""
    if name == "Region":
        warnings.warn("ampfx.report.Region is deprecated: it is ampfx.report.records.Part now", DeprecationWarning,
                      stacklevel=2)
        return Part
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _fp8_calibration_line(rows: list[Any]) -> list[str]:
    """The summary's line for what calibration saw of the GEMM nodes in FP8 (``Fp8Decision.error`` and amax);
    none without calibration.

    >>> from ampfx.report.records import Fp8Decision
    >>> class R:
    ...     def __init__(self, node, **kw): self.node, self.fp8 = node, Fp8Decision("tensorwise", "fp8", "", **kw)
    >>> print(_fp8_calibration_line([R("fc1", error=0.03, amax_input=4.0, amax_weight=0.1, amax_grad=2e-4),
    ...                              R("fc2", error=0.2, amax_input=900.0, amax_weight=0.1, amax_grad=1e-4)])[0])
      FP8 in calibration (2 of 2 GEMM nodes): output error against the low dtype 0.03-0.2 (largest fc2), amax input <= 900, weight <= 0.1, output gradient <= 0.0002
    """
    seen = [r for r in rows if r.fp8.error is not None]
    if not seen:
        return []
    worst = max(seen, key=lambda r: r.fp8.error)

    def most(key: str) -> str:
        values = [getattr(r.fp8, key) for r in seen if getattr(r.fp8, key) is not None]
        return f"{max(values):.3g}" if values else "unknown"

    return [f"  FP8 in calibration ({len(seen)} of {len(rows)} GEMM nodes): output error against the low dtype "
            f"{min(r.fp8.error for r in seen):.3g}-{worst.fp8.error:.3g} (largest {worst.node}), amax input <= "
            f"{most('amax_input')}, weight <= {most('amax_weight')}, output gradient <= {most('amax_grad')}"
            + (f"; delayed scaling: up to {most('saturated')} of an input past its history (scaled by its own amax)"
               if any(r.fp8.saturated for r in seen) else "")]
