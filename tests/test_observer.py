"""Every step of a graph's conversion is listed in one place and observed (ampfx.observer): timed, each
Decision carrying the (step, rule) history that set it, the page showing it, and with a log path a graph
dump per step."""
from __future__ import annotations

import json
import logging

import torch
import torch.nn as nn

import ampfx
from ampfx import passes
from ampfx.passes import boundary, casts, classify, paint

X = torch.randn(4, 8)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4), nn.Softmax(-1))


def test_one_list_holds_every_step_in_order():
    """The analyses and the passes are listed in passes/__init__.py; the boundary cast of a region, the
    autocast annotation and its stamping are steps of the list (they ran outside it before)."""
    names = [name for name, _ in passes.ANALYSES] + [p.__name__ for p in passes.PIPELINE]
    assert names[:3] == ["propagate_shapes", "record_calibration", "find_sensitive"]
    assert names.index("classify") < names.index("paint") < names.index("insert_casts") < names.index("pad")
    assert names[-1] == boundary.cast_part_inputs.__name__
    assert passes.DECIDING[0] is passes.PIPELINE[1] and passes.DECIDING[-1] is paint.paint


def test_each_step_is_timed_and_logged(caplog):
    with caplog.at_level(logging.DEBUG, logger="ampfx.observer"):
        report = ampfx.convert(_net(), "bf16", example_inputs=(X,)).ampfx_report
    ran = [step for graph, step, _ in report.steps if graph == ""]
    assert ran == ["propagate_shapes"] + [p.__name__ for p in passes.PIPELINE] + [name for name, _ in passes.COUNTS] \
        + [name for name, _ in passes.LOWERING]
    assert all(seconds >= 0 for *_, seconds in report.steps)
    assert sum("ampfx: classify on <root>" in r.getMessage() for r in caplog.records) == 1


def test_a_decision_carries_the_steps_that_set_it():
    """The first linear: the tables list it (classify), painting gives it bfloat16; softmax is denied by
    the tables and no later step changes it. Every record has a history: classify first, or the step that
    made the node (the bias add insert_casts splits off the second linear)."""
    report = ampfx.convert(_net(), "bf16", example_inputs=(X,)).ampfx_report
    by = {r.node: r for r in report.records}
    assert [s for s, _ in by["linear"].history] == ["classify", "paint"]
    assert by["softmax"].history == (("classify", "table"),)
    first = {r.node: r.history[0][0] for r in report.records}
    assert first.pop("linear_1_bias") == casts.insert_casts.__name__
    assert set(first.values()) == {classify.classify.__name__}
    row = json.loads(json.dumps(by["linear"].as_json()))
    assert row["history"] == [["classify", "table"], ["paint", "table"]]


def test_the_page_shows_each_decisions_history():
    page = ampfx.convert(_net(), "bf16", example_inputs=(X,)).ampfx_report.html()
    assert "decided by" in page and "classify (table) → paint (table)" in page


def test_a_log_path_keeps_the_graph_after_each_step(tmp_path, monkeypatch):
    """With AMPFX_LOG_PATH the saved report has steps.json (every step's seconds) and one graph dump per
    step and graph; without it nothing is kept (no graph code per step held in memory)."""
    monkeypatch.setenv("AMPFX_LOG_PATH", str(tmp_path))
    ampfx.convert(_net(), "bf16", example_inputs=(X,))
    dumps = sorted(p.name for p in (tmp_path / "steps" / "root").iterdir())
    assert dumps[0] == "00_propagate_shapes.py" and \
        len(dumps) == 1 + len(passes.PIPELINE) + len(passes.COUNTS) + len(passes.LOWERING)
    at = {name.split("_", 1)[1][:-3]: tmp_path / "steps" / "root" / name for name in dumps}
    assert "torch.bfloat16" in at["insert_casts"].read_text() and "torch.bfloat16" not in at["paint"].read_text()
    assert at["decide_writes"].read_text() == at["paint"].read_text()  # a deciding step rewrites nothing
    assert {row["step"] for row in json.loads((tmp_path / "steps.json").read_text())} >= {casts.insert_casts.__name__}
    monkeypatch.delenv("AMPFX_LOG_PATH")
    assert ampfx.convert(_net(), "bf16", example_inputs=(X,)).ampfx_report.step_code == {}


def test_the_observer_sees_the_dry_runs():
    """The passes up to painting run on copies of a graph twice: on each kept block's graph, for its caller to read
    its boundary, and, with calibration's precision check, on the root graph to find the nodes that would be low.
    Both are steps of the report (``dry run: <pass>``), under the graph they copied, before its own steps."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

        def forward(self, x):
            return self.norm(x + self.fc(x))

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), nn.Linear(8, 4))
    steps = ampfx.convert(model, "bf16", example_inputs=(X,), keep_modules=("0", "1")).ampfx_report.steps
    dry = [p.__name__ for p in passes.DECIDING]
    for graph in ("0", "1"):
        ran = [step for where, step, _ in steps if where == graph]
        assert [s for s in ran if s.startswith("dry run: ")] == ["dry run: propagate_shapes"] + [
            f"dry run: {name}" for name in dry]
        assert ran.index(f"dry run: {dry[-1]}") < ran.index("paint")
        assert ran.count("propagate_shapes") == 1  # the block's own analysis, once
    batches = [(X,)]
    steps = ampfx.convert(_net(), "bf16", example_inputs=(X,), calibrate=batches,
                          sensitivity_threshold=0.01).ampfx_report.steps
    assert [s for g, s, _ in steps if g == "" and s.startswith("dry run: ")] == [f"dry run: {n}" for n in dry]
