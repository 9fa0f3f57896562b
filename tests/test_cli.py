"""The ampfx command: demo, lists, explain, and errors that name the bad argument."""
import json

import pytest

from ampfx.ui.cli import main


def test_demo_runs_end_to_end(capsys):
    assert main(["demo", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ampfx: converted") and "ampfx bfloat16" in out and "torch.autocast" in out


def test_demo_fp16_plots_the_loss_scale(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "scale.png"
    assert main(["demo", "--dtype", "fp16", "--steps", "3", "--loss-scale-plot", str(png)]) == 0
    assert "loss scale over 3 steps plotted" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_explain_html_to_stdout(capsys):
    assert main(["explain", "tests/models.py:MLP", "--input", "4,12", "--format", "html"]) == 0
    page = capsys.readouterr().out
    assert page.lstrip().lower().startswith("<!doctype html") and "gelu" in page


def test_lists_show_entries_with_sources_and_env_overrides(capsys, monkeypatch):
    monkeypatch.setenv("AMPFX_DENYLIST_ADD", "gelu")
    monkeypatch.setenv("AMPFX_INFERLIST_REMOVE", "gelu")
    assert main(["lists", "--dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    deny = out[out.index("denylist"):]
    assert "gelu" in deny and "[env:AMPFX_DENYLIST_ADD]" in deny and "softmax" in deny


def test_explain_prints_the_table_and_json(capsys, tmp_path):
    assert main(["explain", "tests/models.py:MLP", "--input", "4,12", "--dtype", "fp16",
                 "--out", str(tmp_path), "--html", str(tmp_path / "mlp.html")]) == 0
    assert "gelu" in capsys.readouterr().out and (tmp_path / "decisions.jsonl").exists()
    assert "gelu" in (tmp_path / "mlp.html").read_text() and (tmp_path / "report.html").exists()
    assert main(["explain", "tests/models.py:MLP", "--input", "4,12", "--format", "json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert any(r["op"] == "linear" and r["dtype"] == "bfloat16" for r in rows)


@pytest.mark.parametrize("argv,needle", [
    (["explain", "nope.nothing:build"], "cannot import nope.nothing"),
    (["explain", "tests/models.py:Missing"], "has no attribute 'Missing'"),
    (["explain", "tests/models.py:MLP", "--input", "4,x"], "--input '4,x'"),
    (["explain", "tests/models.py:MLP", "--input", "4,12:complex"], "unknown dtype 'complex'"),
])
def test_errors_name_the_bad_argument(capsys, argv, needle):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_bad_dtype_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["lists", "--dtype", "fp64"])
    assert "--dtype" in capsys.readouterr().err
