"""The ampfx command: demo, lists, explain, and errors that name the bad argument."""
import json

import pytest

from ampfx.ui.cli import main


def test_demo_runs_end_to_end(capsys, tmp_path):
    """The demo says its task, the summary, what stays float32 and why, where the log went, the two runs,
    and the casts against autocast with what they mean, then what its step times mean and what ampfx's default plan
    does here (the tests' device: no break-even, every GEMM low); no full table (its output, without the
    machine's part, is docs/getting-started.md's)."""
    assert main(["demo", "--steps", "3", "--out", str(tmp_path / "log")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Task: ") and "ampfx: converted" in out and "What stays float32, and why" in out
    assert f"Full log in {tmp_path / 'log'}/" in out and (tmp_path / "log" / "report.html").exists()
    assert "ampfx bfloat16" in out and "torch.autocast" in out and "A cast is" in out
    closing = " ".join(out[out.index("A cast is"):].split())
    assert "On this machine the ampfx bfloat16 step took" in closing and "Against torch.autocast" in closing
    assert "its default plan runs every GEMM in bfloat16, as the demo does" in closing
    assert "┃" not in out and len(out.splitlines()) < 45


@pytest.mark.parametrize("times, says", [
    ({"ampfx": 213.0, "autocast": 239.0, "float32": 57.0},
     "took 3.7x float32's time: slower than float32 at this model's sizes. Against torch.autocast in bfloat16 it "
     "took 0.89x the time: faster."),
    ({"ampfx": 40.0, "autocast": 41.0, "float32": 80.0},
     "took 0.50x float32's time: faster than float32. Against torch.autocast in bfloat16 it took 0.98x the time: "
     "about the same."),
    ({"ampfx": 50.0, "autocast": 40.0, "float32": 52.0},
     "took 0.96x float32's time: about the same. Against torch.autocast in bfloat16 it took 1.25x the time: slower."),
], ids=["slower", "faster", "same"])
def test_the_demo_says_what_its_step_times_mean(times, says):
    """Rule: the demo's closing text compares the measured step times in words, ampfx against float32 and against
    autocast (slower, faster, about the same within 10%), not only the losses and accuracies."""
    import torch
    from ampfx.ui.demo import _times_in_words

    assert _times_in_words(times, torch.bfloat16) == f"On this machine the ampfx bfloat16 step {says}"


@pytest.mark.parametrize("break_even, says", [
    (None, "On this CPU ampfx takes bfloat16 GEMMs to pay at every size (on cpu (datasheet)): its default plan runs "
           "every GEMM in bfloat16, as the demo does."),
    ((2 ** 24, 64, False), "On this CPU bfloat16 GEMMs pay from 16,777,216 FLOPs a call whose weight is used for at "
                           "least 64 rows (on cpu (datasheet)): this demo's GEMMs are all under it, so ampfx's default "
                           "plan keeps its 7 GEMM nodes float32 (rule cost:small-gemm); the demo lowers every GEMM"),
    ((4_000_000, 0, False), "5 of this demo's 7 GEMM nodes are under it: ampfx's default plan keeps those float32 "
                            "(rule cost:small-gemm) and runs the others in bfloat16"),
    ((0, 0, True), "On this CPU bfloat16 GEMMs are slower than float32 at every size measured (on cpu (datasheet)): "
                   "ampfx's default plan keeps every GEMM float32 here (rule cost:low-slower)"),
], ids=["none", "all-under", "some-under", "never"])
def test_the_demo_says_what_ampfxs_default_plan_does_with_its_gemms_here(monkeypatch, break_even, says):
    """Rule: the demo, which lowers every GEMM (gemm_min_flops=0), says what ampfx's default plan would do with its
    GEMMs on this CPU, from the device's break-even (ampfx.ops.device_cost.limits): every GEMM low where there is
    none, float32 for those under it (all, or how many), float32 for all where bfloat16 is slower at every size;
    the default is the default whatever AMPFX_* variables the demo runs under."""
    import torch
    from ampfx.ops import gemm_cost
    from ampfx.ui.demo import DemoClassifier, _default_plan, make_data

    if break_even is not None:
        monkeypatch.setitem(gemm_cost.BREAK_EVEN, "cpu", gemm_cost.BreakEven(*break_even))
    monkeypatch.setenv("AMPFX_GEMM_MIN_FLOPS", "0")
    text = _default_plan(DemoClassifier(), make_data(64)[0], torch.bfloat16)
    assert says in text, text


def test_demo_fp16_plots_the_loss_scale(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "scale.png"
    assert main(["demo", "--dtype", "fp16", "--steps", "3", "--loss-scale-plot", str(png),
                 "--out", str(tmp_path / "log")]) == 0
    assert "loss scale over 3 steps plotted" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_explain_html_to_stdout(capsys):
    assert main(["explain", "tests/support/models.py:MLP", "--input", "4,12", "--format", "html"]) == 0
    page = capsys.readouterr().out
    assert page.lstrip().lower().startswith("<!doctype html") and "gelu" in page


def test_lists_show_entries_with_sources_and_env_overrides(capsys, monkeypatch):
    monkeypatch.setenv("AMPFX_DENYLIST_ADD", "gelu")
    monkeypatch.setenv("AMPFX_INFERLIST_REMOVE", "gelu")
    assert main(["lists", "--dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    deny = out[out.index("denylist"):]
    assert "gelu" in deny and "[env:AMPFX_DENYLIST_ADD]" in deny and "softmax" in deny


def test_lists_show_every_option_with_its_variable_from_the_fields_metadata(capsys, monkeypatch):
    """Every option a user sets (the numerics core's and each record's, walked from the fields: none listed by
    hand) has its line in `ampfx lists`, with its value and the variable that sets it."""
    from ampfx.policy import INTERNAL, Policy

    monkeypatch.setenv("AMPFX_WEIGHT_CACHE", "1")
    assert main(["lists"]) == 0
    out = capsys.readouterr().out
    shown = {line.split()[0]: line.split()[1:] for line in out[out.index("options"):].splitlines()[1:]
             if line.startswith("  ")}
    for f in Policy.option_fields():
        if f.name in INTERNAL or f.name.endswith(("_add", "_remove")):
            continue
        assert f.name in shown, f.name
        assert shown[f.name][-1] == f.metadata.get("env", "-"), f.name
    assert shown["weight_cache"][0] == "True" and shown["keep_modules"][0] == "('auto',)"


def test_explain_prints_the_table_and_json(capsys, tmp_path):
    assert main(["explain", "tests/support/models.py:MLP", "--input", "4,12", "--dtype", "fp16",
                 "--out", str(tmp_path), "--html", str(tmp_path / "mlp.html")]) == 0
    assert "gelu" in capsys.readouterr().out and (tmp_path / "decisions.jsonl").exists()
    assert "gelu" in (tmp_path / "mlp.html").read_text() and (tmp_path / "report.html").exists()
    assert main(["explain", "tests/support/models.py:MLP", "--input", "4,12", "--format", "json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert any(r["op"] == "linear" and r["dtype"] == "bfloat16" for r in rows)


def test_explain_with_fp8_gives_each_gemm_its_fp8_rule(capsys, monkeypatch):
    """``--fp8`` (or ``AMPFX_FP8``): the summary's FP8 line, an ``fp8`` column in the table, ``fp8`` in the JSON."""
    monkeypatch.setenv("AMPFX_FP8_ROOFLINE", "none")
    assert main(["explain", "tests/support/models.py:MLP", "--input", "16,12", "--fp8", "tensorwise"]) == 0
    out = capsys.readouterr().out
    assert "FP8 (tensorwise): 1/3 GEMM nodes" in out and "not FP8: fp8:shape 2" in out and "│ fp8 " in out
    monkeypatch.setenv("AMPFX_FP8", "rowwise")
    assert main(["explain", "tests/support/models.py:MLP", "--input", "16,12", "--format", "json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["module"]: r["fp8"]["rule"] for r in rows if r["fp8"]} == {
        "fc1": "fp8:shape", "fc2": "fp8", "fc3": "fp8:shape"}  # K=12 and N=5: no multiples of 16


@pytest.mark.parametrize("argv,needle", [
    (["explain", "nope.nothing:build"], "cannot import nope.nothing"),
    (["explain", "tests/support/models.py:Missing"], "has no attribute 'Missing'"),
    (["explain", "tests/support/models.py:MLP", "--input", "4,x"], "--input '4,x'"),
    (["explain", "tests/support/models.py:MLP", "--input", "4,12:complex"], "unknown dtype 'complex'"),
    (["explain", "tests/support/models.py:MLP", "--fp8", "rowwse"], "Did you mean 'rowwise'"),
])
def test_errors_name_the_bad_argument(capsys, argv, needle):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_bad_dtype_is_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["lists", "--dtype", "fp64"])
    assert "--dtype" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["explain", "compare", "plot"])
def test_a_model_that_cannot_run_on_its_inputs_is_one_line_exit_2(capsys, tmp_path, command):
    """The float32 model is run once on the --input values first: its error is one line naming the
    target, the exception and the inputs, exit 2 (not a traceback, and not a report of a model that
    cannot run)."""
    if command == "plot":
        pytest.importorskip("matplotlib")
    argv = [command, "tests/support/cli_models.py:AlwaysRaises", "--input", "2,4"]
    assert main(argv + (["--out", str(tmp_path / "p.png")] if command == "plot" else [])) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "AlwaysRaises" in err and "ValueError: this model always raises" in err and "--input 2,4" in err


def test_a_model_that_converts_nothing_without_inputs_is_an_error(capsys):
    """Without --input nothing is run; a model torch.fx cannot trace, with nothing else to convert, is
    an error asking for --input rather than an empty report and exit 0."""
    assert main(["explain", "tests/support/cli_models.py:BareRaises"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nothing was converted" in err and "give --input" in err


def test_int_range_sets_the_integer_inputs(capsys):
    """Integer inputs are drawn from --int-range [LOW, HIGH) (default [0, 2)): an embedding model is
    measured on ids across its vocabulary, and ids past it are the model's own error, in one line."""
    from ampfx.ui.cli import parse_input

    ids = parse_input("64,32:int64", (0, 100))
    assert ids.min() >= 0 and ids.max() < 100 and len(ids.unique()) > 50
    assert set(parse_input("64,32:int64").unique().tolist()) == {0, 1}
    assert main(["explain", "tests/support/cli_models.py:Embed", "--input", "8,5:int64", "--int-range", "0,100"]) == 0
    capsys.readouterr()
    assert main(["explain", "tests/support/cli_models.py:Embed", "--input", "8,50:int64", "--int-range", "0,1000"]) == 2
    assert "IndexError" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["5,5", "0", "a,b"])
def test_a_bad_int_range_is_rejected_by_the_parser(capsys, value):
    with pytest.raises(SystemExit) as exit_:
        main(["explain", "tests/support/models.py:MLP", "--int-range", value])
    assert exit_.value.code == 2 and "--int-range" in capsys.readouterr().err


def test_every_subcommand_defaults_to_bf16_and_says_so():
    """--dtype has one default (bfloat16) in every subcommand, and help text that says it. The parser holds
    its name (it imports no torch); the command gets the torch dtype."""
    import argparse

    import torch

    from ampfx.policy.names import parse_dtype
    from ampfx.ui.cli import build_parser

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        dtype = next(a for a in sub._actions if a.dest == "dtype")
        assert parse_dtype(dtype.default) is torch.bfloat16, name
        assert dtype.help and "bf16 (default)" in dtype.help, name
        for action in sub._actions:
            assert action.help, f"ampfx {name} {action.option_strings or action.dest} has no help"


def test_lists_reasons_read_as_sentences(capsys):
    """The float16 deny reasons of reductions and reciprocals are sentences (they once read "a sum of
    many values large outputs for small inputs overflow ...")."""
    assert main(["lists", "--dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    assert "values large outputs" not in out and ") large outputs" not in out
    assert "a sum of many values can overflow float16's range (max 65504) and lose low bits" in out
    assert "1/x: small inputs give large outputs that overflow float16's range" in out


def test_the_run_check_leaves_the_models_buffers_as_they_were():
    """The float32 run on --input values before conversion does not move batch-norm statistics (compare
    would otherwise measure a model one step on from the one it loaded)."""
    import argparse

    import torch

    from ampfx.ui.cli import _check_runs

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _check_runs(model, (torch.randn(8, 4) * 3 + 1,), argparse.Namespace(target="t", input=["8,4"]))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_misspelt_flag_gets_a_suggestion(capsys):
    """A misspelt option of a subcommand is rejected naming it, with the close options of that subcommand."""
    with pytest.raises(SystemExit) as e:
        main(["explain", "tests/support/models.py:MLP", "--imput", "4,12"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--imput" in err and "Did you mean '--input'" in err


def test_a_bad_dtype_names_what_a_shell_can_type(capsys):
    """The --dtype error lists the names a shell can give (half included), not torch.bfloat16."""
    with pytest.raises(SystemExit):
        main(["explain", "tests/support/models.py:MLP", "--dtype", "bfloat"])
    err = capsys.readouterr().err
    assert "'bfloat'" in err and "half" in err and "torch." not in err


def test_plot_checks_its_figure_before_the_work_and_makes_its_folder(capsys, tmp_path):
    """An --out matplotlib cannot write (its extension) is one line, exit 2, before the model is loaded; an --out in
    folders that do not exist yet is written there."""
    pytest.importorskip("matplotlib")
    argv = ["plot", "tests/support/models.py:MLP", "--input", "4,12"]
    assert main(argv + ["--out", str(tmp_path / "range.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "matplotlib writes no .txt figure" in err and ".png" in err
    out = tmp_path / "new" / "deeper" / "range.png"
    assert main(argv + ["--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_explain_says_why_a_root_runs_its_python(capsys):
    """Without --input nothing is run: a root whose forward raises while tracing keeps its Python, and the summary
    names the error, not only report.parts."""
    assert main(["explain", "tests/support/cli_models.py:AlwaysRaises"]) == 0
    out = capsys.readouterr().out
    assert "capture <root>: eager" in out and "first error: ValueError: this model always raises" in out
