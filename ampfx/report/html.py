"""The decision log as a picture: one self-contained HTML page.

:func:`render` turns a :class:`~ampfx.report.Report` into a single HTML file
(inline CSS, JavaScript and SVG; nothing is fetched) that opens in a browser
from disk. It draws the rewritten graph:

- one box per record, coloured by the dtype the node computes in: the low
  dtype, float32, or untouched (``dtype`` is ``None``: inputs, parameters,
  outputs, ``pass`` ops); inputs, parameters and outputs have a dashed
  border, nodes ampfx added (bias add, pad slice) a dotted one;
- edges between nodes; an edge that goes through a cast ampfx inserted is
  dashed and carries a marker, a circle for an activation cast and a diamond
  for a weight cast, in the colour of the dtype cast to;
- boxes grouped by module path (``Decision.module``). Each group can be
  collapsed to one box (with its node count, casts and a dtype bar) and
  expanded by a click; with more than :data:`COLLAPSE_ABOVE` records every
  group starts collapsed;
- hovering shows a node's op, module, category, dtype, rule, reason and
  shapes; clicking shows them in a side panel, with its inputs and casts and
  the steps that decided it, in order (``Decision.history``).

Above the graph are the summary, a legend and a search box (``page.html#node=NAME``
opens with that node shown and selected); below it, the decisions and casts
as plain tables (readable without JavaScript). Once the script has drawn the
graph it sets ``data-ampfx-rendered`` on ``<body>``.

Edges come from what each record reads in the converted graph
(``Decision.inputs``), where casts are nodes like ``x_bf16``. An edge through a
cast is drawn from the cast's ``value`` to its consumer.

>>> import torch, ampfx
>>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1))
>>> rep = ampfx.convert(m, "bf16", example_inputs=(torch.randn(2, 4),)).ampfx_report
>>> g = graph(rep)
>>> for a, b, c in g["edges"]:
...     print(g["nodes"][a]["node"], "->", g["nodes"][b]["node"], *(["via", g["casts"][c]["node"]] if c >= 0 else []))
input_1 -> linear via input_1_bf16
_0_weight -> linear via _0_weight_bf16
linear -> linear_bias via linear_fp32
_0_bias -> linear_bias
linear_bias -> softmax
softmax -> output
>>> page = render(rep)
>>> page.startswith("<!DOCTYPE html>"), "<td>softmax</td>" in page  # the decisions table
(True, True)
"""
from __future__ import annotations

import html
import json
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from .records import SHORT_NAMES, Decision, Rule, dtype_name

if TYPE_CHECKING:  # the report renders itself through this module (Report.html)
    from . import Report

COLLAPSE_ABOVE = 200
"""Records above which every module group starts collapsed."""


# --------------------------------------------------------------------- edges
def _segments(records: tuple[Decision, ...]) -> list[list[int]]:
    """Record indices per captured graph: each graph ends with its ``output`` node."""
    segs: list[list[int]] = [[]]
    for i, r in enumerate(records):
        segs[-1].append(i)
        if r.kind == "output":
            segs.append([])
    return [s for s in segs if s]


def edges(report: Report) -> list[tuple[int, int, int]]:
    """``(source record, consumer record, cast index or -1)`` for every data edge.

    Record and cast indices point into ``report.records`` / ``report.casts``. Edges come from what each
    record reads (``Decision.inputs``); an input that is a cast ampfx inserted is drawn from the cast's
    ``value``. A graph whose records name no inputs (a report built by hand) still gets the edges
    through its casts (``CastInfo.consumers``)."""
    out: list[tuple[int, int, int]] = []
    cast_at = 0
    for seg in _segments(report.records):
        names = {report.records[i].node: i for i in seg}
        reads = {src for i in seg for src in report.records[i].inputs}
        mine: dict[str, int] = {}  # this graph's casts (a run of report.casts), by cast node name
        while cast_at < len(report.casts):
            c = report.casts[cast_at]
            ours = c.node in reads if reads else c.value in names and set(c.consumers) <= names.keys()
            if not ours or c.node in mine:  # cast names are unique within a graph
                break
            mine[c.node] = cast_at
            cast_at += 1
        if not reads:
            out += [(names[report.casts[j].value], names[u], j) for j in mine.values()
                    for u in report.casts[j].consumers]
            continue
        for i in seg:
            for src in dict.fromkeys(report.records[i].inputs):
                if src in mine:
                    if report.casts[mine[src]].value in names:
                        out.append((names[report.casts[mine[src]].value], i, mine[src]))
                elif src in names and names[src] != i:
                    out.append((names[src], i, -1))
    return out


# -------------------------------------------------------------------- groups
def _parent_path(path: str) -> str:
    return path.rpartition(".")[0]


def graph(report: Report) -> dict[str, Any]:
    """What the page's script draws, as plain data (it is embedded as JSON).

    ``nodes``: ``Decision.as_json()`` plus ``g``, the index of its group.
    ``groups``: one per module path with at least two records that are not all
    in one child module (group 0 is the root): ``path``, ``label`` (the path
    relative to the parent group), ``parent``, ``n`` (records computing in the
    low dtype, in float32, untouched), ``casts`` (casts read inside) and
    ``rows``, the layered layout of its members (a record index ``i`` or a
    group as ``~g``, i.e. ``-g - 1``): each member's row is the longest path
    to it from earlier members; a member fed by none sits just above its
    earliest consumer. ``edges``: see :func:`edges`.
    """
    records = report.records
    low = dtype_name(report.dtype)
    groups, node_group, starts = _groups(records, _group_paths(records))
    chains = [_chain(groups, g) for g in range(len(groups))]
    for i, r in enumerate(records):
        slot = {low: 0, "float32": 1}.get(dtype_name(r.dtype), 2)  # dtype None is "-"
        for g in chains[node_group[i]]:
            groups[g]["n"][slot] += 1
    es = edges(report)
    cast_groups, member_edges = _links(es, chains, node_group)
    members: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(node_group):
        members[g].append(i)
    for g in range(1, len(groups)):
        members[groups[g]["parent"]].append(~g)
    for g, grp in enumerate(groups):
        grp["casts"] = len(cast_groups[g])
        grp["rows"] = _rows(members[g], member_edges[g], lambda k: k if k >= 0 else starts[~k])
    nodes = [{**r.as_json(), "g": node_group[i]} for i, r in enumerate(records)]
    return {"low": low, "nodes": nodes, "groups": groups, "edges": es,
            "casts": [c.as_json() for c in report.casts],
            "collapsed": len(records) > COLLAPSE_ABOVE, "rules": {r.value: r.doc for r in Rule},
            "added": [r.value for r in Rule if r.inserted]}  # nodes ampfx added: drawn with a dotted border


def _group_paths(records: tuple[Decision, ...]) -> set[str]:
    """The module paths that are groups: at least two records, not all in one child module."""
    count: dict[str, int] = defaultdict(int)
    for r in records:
        p = r.module
        while p:
            count[p] += 1
            p = _parent_path(p)
    biggest_child: dict[str, int] = defaultdict(int)
    for p, n in count.items():
        biggest_child[_parent_path(p)] = max(biggest_child[_parent_path(p)], n)
    return {p for p, n in count.items() if n >= 2 and biggest_child[p] < n}


def _group_of(path: str, is_group: set[str]) -> str:
    """The innermost group holding module ``path`` (``""``: the root)."""
    while path and path not in is_group:
        path = _parent_path(path)
    return path


def _groups(records: tuple[Decision, ...], is_group: set[str]) -> tuple[list[dict[str, Any]], list[int], list[int]]:
    """``(groups, group of each record, first record of each group)``; groups in
    order of first appearance, parents before children, counts still zero."""
    first: dict[str, int] = {"": 0}
    for i, r in enumerate(records):
        p = _group_of(r.module, is_group)
        while p not in first:
            first[p] = i
            p = _group_of(_parent_path(p), is_group)
    paths = sorted(first, key=lambda p: (first[p], p.count(".")))  # parents before children
    index = {p: k for k, p in enumerate(paths)}
    groups: list[dict[str, Any]] = []
    for p in paths:
        parent = _group_of(_parent_path(p), is_group) if p else None
        label = p[len(parent) + 1:] if parent else p
        groups.append({"path": p, "label": label or "<root>", "parent": index[parent] if p else -1,
                       "n": [0, 0, 0], "casts": 0, "rows": []})
    node_group = [index[_group_of(r.module, is_group)] for r in records]
    return groups, node_group, [first[p] for p in paths]


def _chain(groups: list[dict[str, Any]], g: int) -> list[int]:
    """Group ``g`` and its ancestors, innermost first, up to the root (group 0)."""
    chain = []
    while g >= 0:
        chain.append(g)
        g = groups[g]["parent"]
    return chain


def _links(es: list[tuple[int, int, int]], chains: list[list[int]],
           node_group: list[int]) -> tuple[dict[int, set[int]], dict[int, set[tuple[int, int]]]]:
    """``(casts read inside each group, edges between the members of each group)``.
    An edge joins, inside the innermost group holding both ends, the members
    (records, or child groups as ``~g``) that hold them."""
    cast_groups: dict[int, set[int]] = defaultdict(set)
    member_edges: dict[int, set[tuple[int, int]]] = defaultdict(set)
    for a, b, c in es:
        if c >= 0:
            for g in chains[node_group[b]]:
                cast_groups[g].add(c)
        ca, cb = chains[node_group[a]], chains[node_group[b]]
        common = set(ca) & set(cb)
        lca = next(g for g in ca if g in common)
        ka = a if node_group[a] == lca else ~ca[ca.index(lca) - 1]
        kb = b if node_group[b] == lca else ~cb[cb.index(lca) - 1]
        if ka != kb:
            member_edges[lca].add((ka, kb))
    return cast_groups, member_edges


def _rows(members: list[int], links: set[tuple[int, int]], first) -> list[list[int]]:
    """Layered layout of one group: members in graph order, each one row below
    its latest-row predecessor (edges going back in graph order are ignored)."""
    members = sorted(members, key=first)
    order = {k: n for n, k in enumerate(members)}
    preds, succs = defaultdict(list), defaultdict(list)
    for a, b in links:
        if order[a] < order[b]:
            preds[b].append(a)
            succs[a].append(b)
    rank: dict[int, int] = {}
    for k in members:
        rank[k] = max((rank[p] + 1 for p in preds[k]), default=0)
    for k in members:
        if not preds[k] and succs[k]:
            rank[k] = max(0, min(rank[s] for s in succs[k]) - 1)
    rows: list[list[int]] = [[] for _ in range(max(rank.values(), default=-1) + 1)]
    for k in members:
        rows[rank[k]].append(k)
    return [r for r in rows if r]


# ---------------------------------------------------------------------- page
def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _json_for_script(data: Any) -> str:
    """JSON that cannot close its ``<script>`` element."""
    return (json.dumps(data, default=str, separators=(",", ":"))
            .replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))


def _table(head: tuple[str, ...], rows: list[tuple[Any, ...]], cls: str) -> str:
    out = [f'<table class="{cls}"><thead><tr>', *(f"<th>{_e(h)}</th>" for h in head), "</tr></thead><tbody>"]
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{_e(v)}</td>" for v in row) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _swatch(cls: str, text: str) -> str:
    return f'<span class="key"><span class="sw {cls}"></span>{_e(text)}</span>'


def fp8_text(fp8: dict | None) -> str:
    """A GEMM node's FP8 decision (its ``fp8`` record as JSON) as the page shows it: which of its three GEMMs run
    in FP8, the rule and the reason.

    >>> fp8_text({"rule": "fp8", "reason": "M=4096, N=4096 ...", "output": True, "input_grad": True,
    ...           "weight_grad": False, "recipe": "rowwise_with_gw_hp", "flops": 8})
    'fp8 (output, input gradient; rowwise_with_gw_hp): M=4096, N=4096 ...'
    >>> fp8_text({"rule": "fp8", "reason": "...", "output": True, "input_grad": True, "weight_grad": True,
    ...           "recipe": "tensorwise", "error": 0.036, "amax_input": 4.2, "amax_weight": 0.12, "amax_grad": 2e-05})
    'fp8 (output, input gradient, weight gradient; tensorwise): ...; in calibration: error 0.036, amax input 4.2, weight 0.12, gradient 2e-05'
    >>> fp8_text(None)
    ''
    """
    if not fp8:
        return ""
    gemms = [word for key, word in (("output", "output"), ("input_grad", "input gradient"),
                                    ("weight_grad", "weight gradient")) if fp8[key]]
    seen = [f"{word} {fp8[key]:.3g}" for key, word in (("error", "error"), ("amax_input", "amax input"),
                                                        ("amax_weight", "weight"), ("amax_grad", "gradient"),
                                                        ("saturated", "saturated"))
            if fp8.get(key) is not None and (key != "saturated" or fp8[key])]
    return (f"{fp8['rule']} ({', '.join(gemms) or 'none in FP8'}; {fp8['recipe']}): {fp8['reason']}"
            + (f"; in calibration: {', '.join(seen)}" if seen else ""))


_GEMM_COST = ("cost:small-gemm", "cost:low-slower")  # ampfx.report.records.GEMM_COST_RULES' values


def shown_category(n: dict) -> str:
    """A logged decision's category as the page shows it (:attr:`~ampfx.report.records.Decision.shown_category`).

    >>> shown_category({"category": "deny", "rule": "cost:small-gemm"}), shown_category({"category": "deny", "rule": "table"})
    ('cost', 'deny')
    """
    return "cost" if n.get("rule") in _GEMM_COST else n["category"]


def history_text(history: list[list[str]]) -> str:
    """A decision's history (``Decision.history``) as the page shows it.

    >>> history_text([["classify", "table"], ["paint", "paint:clear"]])
    'classify (table) → paint (paint:clear)'
    """
    return " → ".join(f"{step} ({rule})" for step, rule in history)


def render(report: Report) -> str:
    """The report as one self-contained HTML page (see the module docstring)."""
    data = graph(report)
    low = data["low"]
    lines = [*report.summary().splitlines(), f"  {report.autocast_summary()}"]
    fp8 = any(n["fp8"] for n in data["nodes"])  # fp8=: each GEMM node's FP8 rule and reason
    decisions = _table(("node", "op", "module", "kind", "category", "dtype", "autocast", *(("fp8",) if fp8 else ()),
                        "rule", "reason", "decided by", "shapes before"),
                       [(n["node"], n["op"], n["module"], n["kind"], shown_category(n), n["dtype"] or "-",
                         n["autocast"] or "-", *((fp8_text(n["fp8"]),) if fp8 else ()), n["rule"], n["reason"],
                         history_text(n["history"]), " ".join(n["shapes_before"])) for n in data["nodes"]],
                       "decisions")
    diff = report.autocast_diff()
    differs = _table(("node", "op", "module", "ampfx", "autocast", "rule", "reason"),
                     [(d.node, d.op, d.module, dtype_name(d.dtype), dtype_name(d.autocast), d.rule, d.reason)
                      for d in diff], "autocast-diff")
    casts = _table(("cast", "value", "source", "to", "consumers", "weight", "reason"),
                   [(c["node"], c["value"], c["source"], c["to"], ", ".join(c["consumers"]),
                     "yes" if c["weight"] else "", c["reason"]) for c in data["casts"]], "casts")
    legend = "".join([
        _swatch("low", f"computes in {low}"), _swatch("f32", "computes in float32"),
        _swatch("none", "untouched (input, parameter, output, pass op)"),
        _swatch("none struct", "graph input / parameter / output"), _swatch("low added", "added by ampfx"),
        '<span class="key"><svg width="14" height="14"><circle cx="7" cy="7" r="5" class="castmark low"/></svg>'
        "activation cast</span>",
        '<span class="key"><svg width="14" height="14"><rect x="3" y="3" width="8" height="8" '
        'transform="rotate(45 7 7)" class="castmark low"/></svg>weight cast</span>',
        '<span class="key"><svg width="30" height="14"><path d="M1 7 H29" class="edge cast f32"/></svg>'
        "edge through a cast (colour: the dtype cast to)</span>",
        _swatch("grp", "module (click to expand / collapse)"),
    ])
    return "".join([
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<title>ampfx report ({_e(low)})</title><style>{_CSS}</style></head><body>",
        f'<header><h1>{_e(lines[0])}</h1><pre class="more">{_e(chr(10).join(lines[1:]))}</pre>',
        f'<div class="legend">{legend}</div>',
        '<div class="tools"><button id="expand">expand all</button><button id="collapse">collapse all</button>'
        '<input id="find" placeholder="find node by name" size="24"><button id="go">find</button>'
        f'<span id="status">{len(report.records)} nodes, {len(report.casts)} casts</span></div></header>',
        '<main><div id="graph"><noscript>JavaScript is off: the graph needs it; the tables below '
        'hold every decision.</noscript></div><aside id="panel"><p class="hint">Click a node or a cast '
        "marker for details; hover for a summary.</p></aside></main>",
        f"<details><summary>All decisions ({len(report.records)})</summary>{decisions}</details>",
        f"<details><summary>All casts ({len(report.casts)})</summary>{casts}</details>",
        f"<details><summary>Differs from torch.autocast ({len(diff)})</summary>{differs}</details>",
        f'<script type="application/json" id="ampfx-data">{_json_for_script(data)}</script>',
        f"<script>{_JS}</script></body></html>\n",
    ])


_CSS = """
body{font:13px system-ui,sans-serif;margin:0;color:#222}
header{padding:8px 12px;border-bottom:1px solid #ccc;background:#fafafa}
h1{font-size:15px;margin:0 0 4px}
pre.more{margin:0 0 6px;font-size:12px;color:#444;white-space:pre-wrap}
.legend,.tools{display:flex;flex-wrap:wrap;gap:4px 14px;align-items:center;margin:4px 0}
.key{display:inline-flex;align-items:center;gap:4px}
.sw{display:inline-block;width:18px;height:12px;border:1.5px solid;border-radius:3px}
.sw.struct{border-style:dashed}.sw.added{border-style:dotted}
.sw.grp{background:#e8eaf6;border-color:#5c6bc0}
main{display:flex;align-items:flex-start}
#graph{flex:1;overflow:auto;height:calc(100vh - 130px);min-height:300px;padding:8px}
#panel{width:340px;flex:none;height:calc(100vh - 130px);overflow:auto;border-left:1px solid #ccc;
 padding:8px 10px;font-size:12px;box-sizing:border-box}
#panel dt{font-weight:600;margin-top:5px}#panel dd{margin:0 0 0 8px;word-break:break-word}
.hint{color:#777}
.low{fill:#c8e6c9;stroke:#2e7d32;background:#c8e6c9;border-color:#2e7d32}
.f32{fill:#ffe0b2;stroke:#e65100;background:#ffe0b2;border-color:#e65100}
.none,.other{fill:#eeeeee;stroke:#9e9e9e;background:#eee;border-color:#9e9e9e}
.node rect{stroke-width:1.5}.node.struct rect{stroke-dasharray:4 2}.node.added rect{stroke-dasharray:1.5 2}
.node.sel rect{stroke:#1a237e;stroke-width:3}
.node,.grp.closed,.castmark,.ghead{cursor:pointer}
svg text{font-size:11px;fill:#222;stroke:none;pointer-events:none}
svg text.nm{font-weight:600}svg text.sub{fill:#555}
.grp rect.box{fill:rgba(92,107,192,.05);stroke:#9fa8da;stroke-width:1}
.grp.closed rect.box{fill:#e8eaf6;stroke:#5c6bc0;stroke-width:1.5}
.ghead{font-size:11px;fill:#3949ab;font-weight:600;pointer-events:all}
.bar{stroke:none}.bar.low{fill:#66bb6a}.bar.f32{fill:#fb8c00}.bar.none{fill:#bdbdbd}
.edge{fill:none;stroke:#90a4ae;stroke-width:1.2}
.edge.cast{stroke-dasharray:5 3;stroke-width:1.6}.edge.cast.low{stroke:#2e7d32}.edge.cast.f32{stroke:#e65100}
.castmark{stroke:#263238;stroke-width:1}
table{border-collapse:collapse;font-size:12px;margin:4px 12px}
td,th{border:1px solid #ddd;padding:2px 5px;text-align:left;vertical-align:top}
details{margin:6px 12px}
"""

_JS = r"""
(function () {
  "use strict";
  const body = document.body;
  try {
    const D = JSON.parse(document.getElementById("ampfx-data").textContent);
    const N = D.nodes, G = D.groups, E = D.edges, C = D.casts;
    const NS = "http://www.w3.org/2000/svg";
    const NW = 170, NH = 38, CW = 210, CH = 54, GAP = 14, ROWGAP = 28, PAD = 10, HEAD = 22;
    const SHORT = %SHORT%;
    const open = G.map((g, i) => i === 0 || !D.collapsed);
    const size = new Map(), pos = new Map();
    let selected = -1;

    const cls = d => d === null ? "none" : d === D.low ? "low" : d === "float32" ? "f32" : "other";
    const clip = (s, n) => s.length > n ? s.slice(0, n - 1) + "\u2026" : s;
    const shownCategory = n => ["cost:small-gemm", "cost:low-slower"].includes(n.rule) ? "cost" : n.category;  // shown_category
    function el(tag, attrs, parent, text) {
      const e = document.createElementNS(NS, tag);
      for (const k in attrs) e.setAttribute(k, attrs[k]);
      if (text !== undefined) e.textContent = text;
      if (parent) parent.appendChild(e);
      return e;
    }
    function owner(i) {  // what shows node i: itself, or its outermost collapsed group (~g)
      let v = i;
      for (let g = N[i].g; g > 0; g = G[g].parent) if (!open[g]) v = ~g;
      return v;
    }
    function measure(k) {
      let w = NW, h = NH;
      if (k < 0 && !open[~k]) { w = CW; h = CH; }
      else if (k < 0) {
        w = 0; h = HEAD;
        for (const row of G[~k].rows) {
          let rw = -GAP, rh = 0;
          for (const c of row) { const s = measure(c); rw += s[0] + GAP; rh = Math.max(rh, s[1]); }
          w = Math.max(w, rw); h += rh + ROWGAP;
        }
        w += 2 * PAD; h += PAD - ROWGAP;
      }
      size.set(k, [w, h]);
      return [w, h];
    }
    function place(k, x, y) {
      const [w, h] = size.get(k);
      pos.set(k, [x, y, w, h]);
      if (k >= 0 || !open[~k]) return;
      let cy = y + HEAD;
      for (const row of G[~k].rows) {
        let rw = -GAP, rh = 0;
        for (const c of row) { rw += size.get(c)[0] + GAP; rh = Math.max(rh, size.get(c)[1]); }
        let cx = x + (w - rw) / 2;
        for (const c of row) { place(c, cx, cy); cx += size.get(c)[0] + GAP; }
        cy += rh + ROWGAP;
      }
    }
    function nodeTip(n) {
      return [n.node, `${n.op} (${n.kind}) in ${n.module || "<root>"}`,
              `${shownCategory(n)} \u00b7 dtype ${n.dtype || "-"} \u00b7 rule ${n.rule}`, n.reason,
              n.shapes_before.length ? `shapes before: ${n.shapes_before.join(", ")}` : "",
              n.in_shapes_before.length ? `inputs before: ${n.in_shapes_before.join(", ")}` : ""].filter(Boolean).join("\n");
    }
    const castTip = c => `${c.node}: ${c.value} ${c.source} \u2192 ${c.to}${c.weight ? " (weight)" : ""}` +
                         ` for ${c.consumers.join(", ")}: ${c.reason}`;

    const svg = el("svg", {id: "picture"}, document.getElementById("graph"));
    let layers, stats;
    function drawNode(i, x, y) {
      const n = N[i];
      const kind = ["placeholder", "get_attr", "output"].includes(n.kind) ? " struct" :
                   D.added.includes(n.rule) ? " added" : "";
      const g = el("g", {id: "n" + i, class: `node ${cls(n.dtype)}${kind}${i === selected ? " sel" : ""}`,
                         "data-node": n.node, "data-dtype": n.dtype || "none",
                         transform: `translate(${x},${y})`}, layers.nodes);
      el("rect", {width: NW, height: NH, rx: 5}, g);
      el("text", {x: 7, y: 15, class: "nm"}, g, clip(n.node, 24));
      el("text", {x: 7, y: 30, class: "sub"}, g, clip(n.op, 17) + " \u00b7 " + (SHORT[n.dtype] || n.dtype || "-"));
      el("title", {}, g, nodeTip(n));
      g.addEventListener("click", () => select(i));
      stats.nodes++;
    }
    function drawClosed(gi, x, y, w, h) {
      const grp = G[gi], total = grp.n[0] + grp.n[1] + grp.n[2];
      const g = el("g", {class: "grp closed", "data-group": grp.path, transform: `translate(${x},${y})`},
                   layers.nodes);
      el("rect", {width: w, height: h, rx: 6, class: "box"}, g);
      el("text", {x: 8, y: 16, class: "nm"}, g, "\u25b8 " + clip(grp.label, 28));
      el("text", {x: 8, y: 31, class: "sub"}, g, `${total} nodes \u00b7 ${grp.casts} casts`);
      let bx = 8;
      ["low", "f32", "none"].forEach((c, j) => {
        const bw = (w - 16) * grp.n[j] / Math.max(total, 1);
        if (bw > 0) el("rect", {x: bx, y: 39, width: bw, height: 7, class: "bar " + c}, g);
        bx += bw;
      });
      el("title", {}, g, `${grp.path}: ${grp.n[0]} ${D.low}, ${grp.n[1]} float32, ${grp.n[2]} untouched, ` +
                         `${grp.casts} casts (click to expand)`);
      g.addEventListener("click", () => { open[gi] = true; render(); });
      stats.closed++;
    }
    function draw(k) {
      const [x, y, w, h] = pos.get(k);
      if (k >= 0) return drawNode(k, x, y);
      const gi = ~k;
      if (!open[gi]) return drawClosed(gi, x, y, w, h);
      if (gi > 0) {
        const g = el("g", {class: "grp open", "data-group": G[gi].path}, layers.groups);
        el("rect", {x, y, width: w, height: h, rx: 6, class: "box"}, g);
        const t = el("text", {x: x + 8, y: y + 15, class: "ghead"}, g, "\u25be " + G[gi].label);
        el("title", {}, t, `${G[gi].path} (click to collapse)`);
        t.addEventListener("click", () => { open[gi] = false; render(); });
      }
      for (const row of G[gi].rows) for (const c of row) draw(c);
    }
    function bez(p, t) {
      const u = 1 - t;
      return [0, 1].map(d => u*u*u*p[0][d] + 3*u*u*t*p[1][d] + 3*u*t*t*p[2][d] + t*t*t*p[3][d]);
    }
    function drawEdges() {
      const agg = new Map();
      for (const [a, b, c] of E) {
        const va = owner(a), vb = owner(b);
        if (va === vb) continue;
        const key = va + " " + vb;
        let e = agg.get(key);
        if (!e) agg.set(key, e = {va, vb, casts: []});
        if (c >= 0 && !e.casts.includes(c)) e.casts.push(c);
      }
      const mid = k => { const [x, , w] = pos.get(k); return x + w / 2; };
      const ends = new Map();  // spread the edges leaving / entering one box along its bottom / top side
      for (const [side, me, other] of [["out", "va", "vb"], ["in", "vb", "va"]]) {
        const by = new Map();
        for (const e of agg.values()) by.has(e[me]) ? by.get(e[me]).push(e) : by.set(e[me], [e]);
        for (const [k, es] of by) {
          const [x, , w] = pos.get(k);
          es.sort((p, q) => mid(p[other]) - mid(q[other]));
          es.forEach((e, j) => ends.set(e, {...ends.get(e), [side]: x + w * (j + 1) / (es.length + 1)}));
        }
      }
      for (const e of agg.values()) {
        const [, y1, , h1] = pos.get(e.va), [, y2] = pos.get(e.vb);
        const p0 = [ends.get(e).out, y1 + h1], p3 = [ends.get(e).in, y2];
        const gap = p3[1] - p0[1], dy = Math.max(24, Math.abs(gap) / 2);
        const bend = gap > ROWGAP + NH || gap < 0 ? Math.min(260, 50 + Math.abs(gap) / 8) : 0;  // skip rows: arc
        const pts = [p0, [p0[0] + bend, p0[1] + dy], [p3[0] + bend, p3[1] - dy], p3];
        const cs = e.casts.map(c => C[c]);
        const to = cs.length ? " cast " + cls(cs[0].to) : "";
        el("path", {class: "edge" + to, "marker-end": "url(#arrow)",
                    d: `M${p0} C${pts[1]} ${pts[2]} ${p3}`}, layers.edges);
        if (!cs.length) continue;
        let t = 1, mx = p3[0], my = p3[1];  // the marker sits 15px up the edge from its consumer
        while (t > 0 && Math.hypot(mx - p3[0], my - p3[1]) < 15) [mx, my] = bez(pts, t -= 0.02);
        const weight = cs.every(c => c.weight);
        const m = weight ? el("rect", {x: mx - 5, y: my - 5, width: 10, height: 10,
                                       transform: `rotate(45 ${mx} ${my})`}, layers.marks)
                         : el("circle", {cx: mx, cy: my, r: 5.5}, layers.marks);
        m.setAttribute("class", `castmark ${cls(cs[0].to)}${weight ? " weight" : ""}`);
        m.setAttribute("data-cast", cs.map(c => c.node).join(" "));
        el("title", {}, m, cs.map(castTip).join("\n"));
        m.addEventListener("click", () => showCasts(cs));
        stats.marks++;
      }
    }
    function render() {
      size.clear(); pos.clear();
      svg.textContent = "";
      const defs = el("defs", {}, svg);
      const mk = el("marker", {id: "arrow", viewBox: "0 0 8 8", refX: 8, refY: 4, markerWidth: 7,
                               markerHeight: 7, orient: "auto"}, defs);
      el("path", {d: "M0,0 L8,4 L0,8 z", fill: "#78909c"}, mk);
      layers = {};
      for (const name of ["groups", "edges", "nodes", "marks"]) layers[name] = el("g", {class: name}, svg);
      stats = {nodes: 0, closed: 0, marks: 0};
      measure(~0);
      place(~0, 0, 0);
      const [, , w, h] = pos.get(~0);
      svg.setAttribute("width", w + 2);
      svg.setAttribute("height", h + 2);
      draw(~0);
      drawEdges();
      body.setAttribute("data-ampfx-visible-nodes", stats.nodes);
      body.setAttribute("data-ampfx-closed-groups", stats.closed);
      body.setAttribute("data-ampfx-cast-markers", stats.marks);
      document.getElementById("status").textContent =
        `${N.length} nodes, ${C.length} casts; showing ${stats.nodes} nodes and ${stats.closed} collapsed modules`;
    }

    const panel = document.getElementById("panel");
    function show(title, rows) {
      panel.textContent = "";
      const h = document.createElement("h3");
      h.textContent = title;
      panel.appendChild(h);
      const dl = document.createElement("dl");
      for (const [k, v] of rows) {
        if (v === "" || v === null || v === undefined) continue;
        const dt = document.createElement("dt"), dd = document.createElement("dd");
        dt.textContent = k; dd.textContent = v;
        dl.append(dt, dd);
      }
      panel.appendChild(dl);
    }
    function select(i) {
      const old = document.getElementById("n" + selected);
      if (old) old.classList.remove("sel");
      selected = i;
      const now = document.getElementById("n" + i);
      if (now) now.classList.add("sel");
      const n = N[i];
      const ins = E.filter(e => e[1] === i).map(e => N[e[0]].node + (e[2] >= 0 ? ` via ${C[e[2]].node}` : ""));
      const outs = E.filter(e => e[0] === i).map(e => N[e[1]].node + (e[2] >= 0 ? ` via ${C[e[2]].node}` : ""));
      show(n.node, [["op", n.op], ["kind", n.kind], ["target", n.target], ["module", n.module || "<root>"],
                    ["category", shownCategory(n)], ["dtype", n.dtype || "- (left as written)"],
                    ["output dtype", n.out], ["rule", n.rule + (D.rules[n.rule] ? ` \u2014 ${D.rules[n.rule]}` : "")],
                    ["reason", n.reason], ["decided by", n.history.map(h => `${h[0]} (${h[1]})`).join(" \u2192 ")],
                    ["shapes before conversion", n.shapes_before.join(", ")],
                    ["input shapes before conversion", n.in_shapes_before.join(", ")],
                    ["in-place", n.inplace ? "yes" : ""], ["inputs", ins.join(", ")], ["consumers", outs.join(", ")],
                    ["fp8", n.fp8 ? `${n.fp8.rule} (${["output", "input_grad", "weight_grad"].filter(k => n.fp8[k])
                      .join(", ") || "none in FP8"}; ${n.fp8.recipe}): ${n.fp8.reason}` : ""]]);
    }
    function showCasts(cs) {
      const c = cs[0];
      if (cs.length > 1) return show(`${cs.length} casts`, cs.map(c => [c.node, castTip(c)]));
      show(`cast ${c.node}`, [["value", c.value], ["from", c.source], ["to", c.to],
                              ["weight", c.weight ? "yes (parameter or buffer)" : "no"],
                              ["consumers", c.consumers.join(", ")], ["reason", c.reason]]);
    }
    function find(q) {  // select the node named q (or the first whose name contains q), expanding its modules
      q = (typeof q === "string" ? q : document.getElementById("find").value).trim();
      if (!q) return;
      let i = N.findIndex(n => n.node === q);
      if (i < 0) i = N.findIndex(n => n.node.includes(q));
      if (i < 0) { document.getElementById("status").textContent = `no node matches ${q}`; return; }
      for (let g = N[i].g; g > 0; g = G[g].parent) open[g] = true;
      render();
      select(i);
      const [x, y] = pos.get(i), view = document.getElementById("graph");
      view.scrollTo(x + NW / 2 - view.clientWidth / 2, y - view.clientHeight / 2);
    }
    document.getElementById("expand").addEventListener("click", () => { open.fill(true); render(); });
    document.getElementById("collapse").addEventListener("click", () => {
      open.fill(false); open[0] = true; render();
    });
    document.getElementById("go").addEventListener("click", find);
    document.getElementById("find").addEventListener("keydown", e => { if (e.key === "Enter") find(); });
    render();
    if (location.hash.startsWith("#node=")) find(decodeURIComponent(location.hash.slice(6)));
    body.setAttribute("data-ampfx-rendered", "1");
  } catch (err) {
    body.setAttribute("data-ampfx-error", String(err && err.stack || err));
    const p = document.createElement("pre");
    p.textContent = "ampfx report: the graph could not be drawn: " + err;
    document.getElementById("graph").appendChild(p);
  }
})();
"""
_JS = _JS.replace("%SHORT%", json.dumps({dtype_name(d): dtype_name(d, short=True) for d in SHORT_NAMES}))
