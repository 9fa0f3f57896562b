"""The HTML picture of the decision log (ampfx.report.html): structure, edges, size, and a real browser."""
from __future__ import annotations

import json
import pickle
import os
import shutil
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import ampfx
from ampfx.report.html import COLLAPSE_ABOVE, graph, render
from ampfx.ops import Category
from ampfx.report import Report
from ampfx.report.records import CastInfo, Decision, dtype_name
from support.models import Root, build


class Tags(HTMLParser):
    """Every start tag as (tag, attrs); the text by innermost element kind; table rows by table class."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: dict[str, list[str]] = {}
        self.rows: dict[str, list[list[str]]] = {}
        self._open: list[str] = []
        self._table = ""
        self.feed(page)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._open.append(tag)
        if tag == "table":
            self._table = dict(attrs).get("class", "")
        elif tag == "tr":
            self.rows.setdefault(self._table, []).append([])
        elif tag == "td":
            self.rows[self._table][-1].append("")

    def handle_endtag(self, tag):
        if tag in self._open:
            while self._open.pop() != tag:
                pass

    def handle_data(self, data):
        if self._open:
            self.text.setdefault(self._open[-1], []).append(data)
            if self._open[-1] == "td":
                self.rows[self._table][-1][-1] += data

    def attrs(self, name: str) -> list[str]:
        return [a[name] for _, a in self.tags if a.get(name) is not None]


def convert(name: str, dtype: str = "bf16") -> Report:
    m, ex, _ = build(name)
    return ampfx.convert(m, dtype, example_inputs=ex).ampfx_report


def embedded(page: str) -> dict:
    start = page.index('<script type="application/json" id="ampfx-data">')
    body = page[page.index(">", start) + 1:page.index("</script>", start)]
    return json.loads(body)


def low_or(d) -> str:
    return dtype_name(d) if d is not None else "none"


# ------------------------------------------------------------------ structure
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_page_lists_every_node_with_its_dtype_and_is_self_contained(name):
    rep = convert(name)
    page = render(rep)
    tags = Tags(page)  # html.parser reads it without error
    rows = tags.rows["decisions"][1:]  # after the header row
    assert [(r[0], r[2], r[5]) for r in rows] == [(d.node, d.module, dtype_name(d.dtype)) for d in rep.records]
    assert [r[0] for r in tags.rows["casts"][1:]] == [c.node for c in rep.casts]
    data = embedded(page)
    assert [(n["node"], n["dtype"]) for n in data["nodes"]] == [(d.node, d.as_json()["dtype"]) for d in rep.records]
    assert rep.summary().splitlines()[0] in tags.text["h1"]
    # self-contained: no fetched files, styles or scripts
    for link in tags.attrs("src") + tags.attrs("href"):
        assert not link.startswith(("http:", "https:", "//")), link
    assert not [t for t, a in tags.tags if t == "link" or (t == "script" and "src" in a)]
    assert "@import" not in page and "url(http" not in page
    assert page.count("<script") == 2


def test_casts_are_marked_on_the_edges_from_value_to_consumers():
    rep = convert("mlp")
    data = graph(rep)
    names = [n["node"] for n in data["nodes"]]
    through = {(names[a], names[b], data["casts"][c]["node"]) for a, b, c in data["edges"] if c >= 0}
    assert through == {(c.value, u, c.node) for c in rep.casts for u in c.consumers}
    assert [c["weight"] for c in data["casts"]] == [c.weight for c in rep.casts]
    assert any(c.weight for c in rep.casts) and not all(c.weight for c in rep.casts)


def test_edges_are_the_rewritten_graph():
    rep = convert("mlp")
    data = graph(rep)
    names = [n["node"] for n in data["nodes"]]
    plain = {(names[a], names[b]) for a, b, c in data["edges"] if c < 0}
    assert plain == {("linear", "gelu"), ("gelu", "linear_1"), ("linear_1", "tanh"), ("gelu", "add"),
                     ("tanh", "add"), ("add", "linear_2"), ("fc3_bias", "linear_2_bias"),
                     ("linear_2_bias", "output")}  # fc3's bias is added in float32 after the cast


def test_groups_follow_module_paths():
    rep = convert("transformer")
    data = graph(rep)
    groups = {g["path"]: g for g in data["groups"]}
    assert {"", "layers", "layers.0", "layers.0.linear1"} <= set(groups)
    assert "layers.0.dropout1" not in groups  # one record: drawn as a plain node in layers.0
    for n, d in zip(data["nodes"], rep.records):
        path = data["groups"][n["g"]]["path"]
        assert d.module == path or d.module.startswith(path + ".") or path == ""
    lin = groups["layers.0.linear1"]
    assert lin["label"] == "linear1" and data["groups"][lin["parent"]]["path"] == "layers.0"
    assert lin["n"] == [1, 0, 2]  # linear in bfloat16; weight and bias untouched
    assert sum(data["groups"][0]["n"]) == len(rep.records)


def test_regions_converted_separately_keep_their_own_edges():
    rep = ampfx.convert(Root(), "bf16", example_inputs=(torch.randn(3, 8),)).ampfx_report
    assert len(rep.code_after) == 3  # enc, enc.b.lin, head: node names repeat across them
    data = graph(rep)
    region = {}
    for i, d in enumerate(rep.records):
        region[i] = next(p for p in ("enc.b.lin", "enc", "head") if d.module == p or d.module.startswith(p + "."))
    assert all(region[a] == region[b] for a, b, _ in data["edges"])
    head = {(rep.records[a].node, rep.records[b].node, rep.casts[c].node if c >= 0 else None)
            for a, b, c in data["edges"] if region[a] == "head"}
    # head's float32 input (enc returns float32 to the root's Python) is cast where its linear reads it
    assert ("input_1", "linear", "input_1_bf16") in head and ("weight", "linear", "weight_bf16") in head
    assert sum(c >= 0 for *_, c in data["edges"]) == sum(len(c.consumers) for c in rep.casts)


def test_text_is_escaped():
    evil = "<script>alert(1)</script>"
    rec = Decision(node="x", op=evil, target="t", module="m<1>", category=Category.ALLOW, dtype=torch.bfloat16,
                   rule="table", reason=evil + ' "quoted" & more', kind="call_function")
    cast = CastInfo(node="x_fp32", value="x", source=torch.bfloat16, to=torch.float32, consumers=("x",),
                    reason=evil)
    page = Report(dtype=torch.bfloat16, records=(rec,), casts=(cast,)).html()
    assert evil not in page and "m<1>" not in page
    assert page.count("<script") == 2
    assert embedded(page)["nodes"][0]["reason"].startswith(evil)  # the data survives, escaped
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_empty_and_disabled_reports_render():
    for rep in (Report(dtype=torch.float16),
                ampfx.convert(nn.Linear(2, 2), "fp16", disable=True).ampfx_report):
        page = rep.html()
        assert "ampfx" in Tags(page).text["h1"][0]
        assert embedded(page)["nodes"] == []


def test_save_writes_report_html(tmp_path):
    rep = convert("mlp")
    rep.save(tmp_path)
    assert (tmp_path / "report.html").read_text(encoding="utf-8") == rep.html()
    assert pickle.loads(pickle.dumps(rep)).html() == rep.html()


# ---------------------------------------------------------------- large graph
class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + torch.relu(self.fc(self.norm(x)))


class Deep(nn.Module):
    """4 stages of 50 residual blocks: 1,207 records."""

    def __init__(self, blocks: int = 200, d: int = 8):
        super().__init__()
        self.stages = nn.ModuleList(nn.Sequential(*[Block(d) for _ in range(blocks // 4)]) for _ in range(4))
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        for stage in self.stages:
            x = stage(x)
        return self.head(x).softmax(-1)


@pytest.fixture(scope="module")
def deep() -> Report:
    # one large graph (its repeated blocks traced through, not kept)
    return ampfx.convert(Deep(), "bf16", example_inputs=(torch.randn(2, 8),), keep_modules=()).ampfx_report


def test_large_graph_renders_quickly_and_starts_collapsed(deep):
    assert len(deep.records) > 1000
    start = time.perf_counter()
    page = deep.html()
    took = time.perf_counter() - start
    assert took < 3.0, f"render took {took:.2f}s"
    data = embedded(page)
    assert data["collapsed"] and len(deep.records) > COLLAPSE_ABOVE
    top = [k for row in data["groups"][0]["rows"] for k in row]
    assert len(top) < 10 and any(k < 0 for k in top)  # the root shows x, stages, head, softmax, output
    assert not convert("mlp").html().count('"collapsed":true')


# -------------------------------------------------------------------- browser
def find_chromium() -> str | None:
    """A Chromium already on this machine: ``$CHROME_BIN``, then ``chromium``, ``chromium-browser``,
    ``google-chrome`` on the PATH, then one that Playwright downloaded (``playwright install chromium``).
    Nothing is installed here."""
    given = os.environ.get("CHROME_BIN")
    if given:
        return shutil.which(given)
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if found := shutil.which(name):
            return found
    cache = Path(os.environ.get("PLAYWRIGHT_BROWSERS_PATH") or Path.home() / ".cache" / "ms-playwright")
    found = sorted(cache.glob("chromium-*/chrome-linux*/chrome"))
    return str(found[-1]) if found else None


CHROMIUM = find_chromium()
NO_BROWSER = ("headless browser test skipped: no Chromium found ($CHROME_BIN, chromium, chromium-browser, "
              "google-chrome, or Playwright's). Install one (Debian: apt-get install chromium; or pip install "
              "playwright && playwright install chromium), or set CHROME_BIN=/path/to/chromium")


def dump_dom(page: Path, tmp_path: Path, fragment: str = "") -> Tags:
    """The DOM after the page's scripts ran, from headless Chromium. Without one the test is skipped,
    unless ``TEST_REQUIRE_BROWSER=1`` (CI sets it): then it fails."""
    if CHROMIUM is None:
        if os.environ.get("TEST_REQUIRE_BROWSER") == "1":
            pytest.fail(NO_BROWSER.replace("skipped", "required (TEST_REQUIRE_BROWSER=1)"))
        pytest.skip(NO_BROWSER)
    run = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri() + fragment],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "<body" in run.stdout, run.stderr[-3000:]
    dom = Tags(run.stdout)
    body = next(a for t, a in dom.tags if t == "body")
    assert "data-ampfx-error" not in body, body["data-ampfx-error"]
    assert body.get("data-ampfx-rendered") == "1", "the page's script did not finish"
    dom.body = body
    return dom


def drawn_nodes(dom: Tags) -> dict[str, str]:
    return {a["data-node"]: a["data-dtype"] for t, a in dom.tags if t == "g" and "data-node" in a}


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_browser_draws_every_node_with_its_dtype_and_the_casts(name, tmp_path):
    rep = convert(name)
    path = tmp_path / "report.html"
    path.write_text(rep.html(), encoding="utf-8")
    dom = dump_dom(path, tmp_path)
    assert drawn_nodes(dom) == {r.node: low_or(r.dtype) for r in rep.records}
    assert int(dom.body["data-ampfx-visible-nodes"]) == len(rep.records)
    marked = {c for marks in dom.attrs("data-cast") for c in marks.split()}
    assert marked == {c.node for c in rep.casts}
    weight = {c for t, a in dom.tags if "castmark" in a.get("class", "") and "weight" in a.get("class", "")
              for c in a["data-cast"].split()}
    assert weight == {c.node for c in rep.casts if c.weight}


def test_browser_large_graph_starts_collapsed_and_expands_to_a_node(deep, tmp_path):
    path = tmp_path / "report.html"
    path.write_text(deep.html(), encoding="utf-8")
    dom = dump_dom(path, tmp_path)
    assert set(drawn_nodes(dom)) == {"x", "softmax", "output"}
    assert {a["data-group"] for t, a in dom.tags if "closed" in a.get("class", "")} == {"stages", "head"}
    dom = dump_dom(path, tmp_path, "#node=linear_120")  # opens stages, stages.2, stages.2.20, its fc
    shown = drawn_nodes(dom)
    # the residual add reads the float32 stream: float32 (fidelity:stream)
    assert shown["linear_120"] == "bfloat16" and shown["add_120"] == "float32" and len(shown) < 30
    assert any(a.get("data-node") == "linear_120" and "sel" in a["class"].split() for _, a in dom.tags)


def test_edges_are_the_converted_graphs_own_edges_not_a_reading_of_its_code():
    amp = ampfx.convert(Root(), "bf16", example_inputs=(torch.randn(3, 8),))
    rep = amp.ampfx_report
    reads = {(d.module, d.node): d.inputs for d in rep.records}
    # what each record says it reads is what its node reads in the converted graph
    head = amp.get_submodule("head")
    checked = 0
    for node in head.graph.nodes:
        mine = [d for d in rep.records if d.module.startswith("head") and d.node == node.name]
        if mine:
            assert mine[0].inputs == tuple(n.name for n in node.all_input_nodes), node.name
            checked += 1
    assert checked >= 4
    assert any(src.endswith("_bf16") for inputs in reads.values() for src in inputs)  # a cast is read
    blank = Report(dtype=rep.dtype, records=rep.records, casts=rep.casts)  # no generated code at all
    assert graph(blank)["edges"] == graph(rep)["edges"] and graph(rep)["edges"]
