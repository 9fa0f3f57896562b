"""A user's mistake is reported where it was made, before any work, in the caller's words.

- every path the ``ampfx`` command writes is checked before the work (one line naming the flag, exit 2); the Python
  API's paths (``Report.save``, ``log_path`` / ``AMPFX_LOG_PATH``, a plot's ``path``) raise ``PathError`` naming the
  path, ``AMPFX_LOG_PATH`` at ``convert()``'s start;
- a bad argument, option or ``AMPFX_*`` value is raised from the public entry point, without ampfx's frames;
- a suggestion for a module name comes from the model; the command's advice names the command's values.

Unwritable places are under ``/proc``: root passes every permission check, and a folder there still cannot be made.
"""
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import ampfx
from ampfx.errors import ArgumentError, PathError, PolicyError
from ampfx.paths import check_writable
from ampfx.ui.cli import main

AMPFX = Path(ampfx.__file__).resolve().parent
NOWHERE = "/proc/ampfx-nowhere"
needs_proc = pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.isdir("/proc/self"),
                                reason="needs Linux's /proc (a folder nothing can be made in, root included)")
MLP = ["tests/support/models.py:MLP", "--input", "4,12"]


def _net():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _one_line(capsys):
    """The command's stderr, checked to be one line; its stdout, checked to be empty (nothing was done)."""
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, (out[-500:], err)
    return err.strip()


# ------------------------------------------------------------------ the command's paths
@needs_proc
@pytest.mark.parametrize("argv,flag", [
    (["plot", *MLP, "--out", f"{NOWHERE}/range.png"], "--out"),
    (["demo", "--steps", "1", "--out", NOWHERE], "--out"),
    (["demo", "--steps", "1", "--dtype", "fp16", "--loss-scale-plot", f"{NOWHERE}/scale.png"], "--loss-scale-plot"),
    (["explain", *MLP, "--out", NOWHERE], "--out"),
    (["explain", *MLP, "--html", f"{NOWHERE}/graph.html"], "--html"),
    (["compare", *MLP, "--json", f"{NOWHERE}/errors.json"], "--json"),
])
def test_every_path_the_command_writes_is_checked_before_the_work(argv, flag, capsys):
    """A folder that cannot be made (permission bits say nothing of /proc, and root passes them) is one line naming
    the flag and the path, exit 2, with nothing printed before it: the model is not loaded, converted or trained
    (plot and demo once gave a 19-line FileNotFoundError after the work, explain and compare after their tables)."""
    if argv[0] == "plot" or "--loss-scale-plot" in argv:
        pytest.importorskip("matplotlib")
    assert main(argv) == 2
    err = _one_line(capsys)
    assert f"{flag} '{NOWHERE}" in err and "cannot write there" in err and "No such file or directory" in err


@needs_proc
def test_the_environments_log_path_is_checked_before_the_model_is_loaded(capsys, monkeypatch):
    """``AMPFX_LOG_PATH`` where nothing can be written: one line naming the variable, before the table."""
    monkeypatch.setenv("AMPFX_LOG_PATH", NOWHERE)
    assert main(["explain", *MLP]) == 2
    assert "AMPFX_LOG_PATH" in _one_line(capsys)


def test_a_loss_scale_plot_matplotlib_cannot_write_is_refused_before_training(capsys):
    """``demo --loss-scale-plot scale.txt``: one line, before the demo converts and trains (it once trained, then
    failed in matplotlib with a traceback)."""
    pytest.importorskip("matplotlib")
    assert main(["demo", "--steps", "1", "--dtype", "fp16", "--loss-scale-plot", "scale.txt"]) == 2
    assert "--loss-scale-plot 'scale.txt': matplotlib writes no .txt figure" in _one_line(capsys)


# ------------------------------------------------------------------ the Python API's paths
@needs_proc
def test_report_save_names_a_directory_it_cannot_make(tmp_path):
    """``Report.save`` where nothing can be written: a PathError (an OSError and an ArgumentError) naming the call and
    the path (it was a FileNotFoundError from pathlib); under a regular file, the file is named."""
    report = ampfx.convert(_net(), "bf16").ampfx_report
    with pytest.raises(PathError, match=rf"Report.save\('{NOWHERE}'\): cannot write there: the folder {NOWHERE}"):
        report.save(NOWHERE)
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError, match="is a file, not a directory"):
        report.save(tmp_path / "file" / "log")
    assert issubclass(PathError, ArgumentError) and report.save(tmp_path / "a" / "b") == tmp_path / "a" / "b"


@needs_proc
@pytest.mark.parametrize("given,name", [({"environ": {"AMPFX_LOG_PATH": NOWHERE}}, "AMPFX_LOG_PATH"),
                                        ({"log_path": NOWHERE}, "log_path")])
def test_a_log_path_is_checked_when_convert_starts(given, name, monkeypatch):
    """``log_path`` / ``AMPFX_LOG_PATH`` where the report cannot be saved is a PathError naming the variable or the
    option and the path, raised before the conversion (it came after the whole conversion)."""
    import ampfx.api

    def converted(*args, **kwargs):
        raise AssertionError("the model was converted before the log path was checked")

    monkeypatch.setattr(ampfx.api, "convert_tree", converted)
    with pytest.raises(PathError, match=rf"^{name}='{NOWHERE}': cannot write there"):
        ampfx.convert(_net(), "bf16", **given)


@needs_proc
def test_plots_check_their_path_before_drawing_and_make_its_folders(tmp_path):
    """``range_plot(path=...)`` / ``loss_scale_plot(path=...)``: a place nothing can be written or an extension
    matplotlib does not write is an ampfx error naming the call and the path, before drawing (they were matplotlib's
    FileNotFoundError and ValueError); a path in folders that do not exist yet is written there."""
    pytest.importorskip("matplotlib")
    from ampfx.ui.plots import collect_magnitudes, loss_scale_plot, range_plot

    mags = collect_magnitudes(_net(), (torch.randn(4, 4), None), lambda out, _: out.sum())
    with pytest.raises(PathError, match=rf"range_plot\(path='{NOWHERE}/r.png'\): cannot write there"):
        range_plot(mags, "fp16", path=f"{NOWHERE}/r.png")
    with pytest.raises(ArgumentError, match=r"loss_scale_plot\(path='s.txt'\): matplotlib writes no .txt figure"):
        loss_scale_plot([1.0, 2.0], path="s.txt")
    range_plot(mags, "fp16", path=tmp_path / "new" / "r.png")
    assert (tmp_path / "new" / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_the_check_makes_nothing_it_leaves_behind(tmp_path):
    """check_writable tries where the writer will write, and removes what it made: missing folders stay missing."""
    (tmp_path / "afile").write_text("x")
    assert check_writable(tmp_path / "a" / "b" / "c.png", "out") == tmp_path / "a" / "b" / "c.png"
    assert check_writable(tmp_path / "afile", "out") == tmp_path / "afile"
    assert check_writable(tmp_path, "out", directory=True) == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"] and (tmp_path / "afile").read_text() == "x"
    for path, directory, said in [(tmp_path, False, "is a directory"), (tmp_path / "afile", True, "is a file"),
                                  ("", False, "empty"), (tmp_path / "afile" / "x", True, "is a file")]:
        with pytest.raises(PathError, match=said):
            check_writable(path, "out", directory=directory)


# ------------------------------------------------------------------ raised from the entry point
def _ampfx_frames(error: BaseException) -> list[tuple[str, str]]:
    """The frames of ``error``'s traceback inside ampfx: (file under ampfx/, function)."""
    frames = traceback.extract_tb(error.__traceback__)
    return [(Path(f.filename).resolve().relative_to(AMPFX).as_posix(), f.name) for f in frames
            if Path(f.filename).resolve().is_relative_to(AMPFX)]


ENV_ERRORS = {
    "AMPFX_DENYLIST_ADD": ("notanop", "unknown op 'notanop'"),
    "AMPFX_PAD": ("sometimes", "use auto, always or never"),
    "AMPFX_FP8": ("tensorwsie", "Did you mean 'tensorwise'?"),
    "AMPFX_FP32_MODULES": ("hed", "neither a module of Sequential"),
    "AMPFX_REDUCTION_THRESHOLD": ("lots", "use a whole number"),
}


@pytest.mark.parametrize("var", list(ENV_ERRORS))
def test_an_environment_error_is_raised_from_convert_without_ampfx_frames(var):
    """The traceback of a bad AMPFX_* value ends at the user's call: the one ampfx frame is ``convert`` (it went
    through the request, the policy and the name tables, 13 lines of ampfx's internals), no chained exception."""
    value, said = ENV_ERRORS[var]
    with pytest.raises(PolicyError) as info:
        ampfx.convert(_net(), "bf16", environ={var: value})
    assert said in str(info.value)
    assert _ampfx_frames(info.value) == [("api.py", "convert")]
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert len(traceback.format_exception(info.value)) <= 5


def test_entry_points_raise_their_users_mistakes_from_their_own_frame():
    """``Policy(...)``, ``tune`` and ``compare`` do as ``convert`` does: one ampfx frame, the entry point's."""
    from ampfx.tools.compare import compare
    from ampfx.tools.tune import tune

    calls = {("policy/__init__.py", "__init__"): lambda: ampfx.Policy("bf16", pad="sometimes"),
             ("tools/tune.py", "tune"): lambda: tune(_net(), "bf16", example_inputs=(torch.randn(2, 4),),
                                                    metric=lambda m: 0.0, tolerance=0.1, progress=False,
                                                    environ={"AMPFX_PAD": "sometimes"}),
             ("tools/compare.py", "compare"): lambda: compare(_net(), "bf16", (torch.randn(2, 4),),
                                                             environ={"AMPFX_PAD": "sometimes"})}
    for frame, call in calls.items():
        with pytest.raises(PolicyError, match="sometimes") as info:
            call()
        assert _ampfx_frames(info.value) == [frame]


@pytest.mark.parametrize("var,value,said", [
    ("AMPFX_PAD", "sometimes", "AMPFX_PAD='sometimes': use auto, always or never."),
    ("AMPFX_FP8", "tensorwsie", "AMPFX_FP8='tensorwsie': use tensorwise, rowwise, rowwise_with_gw_hp or off. "
                                "Did you mean 'tensorwise'?"),
    ("AMPFX_FP8_ROOFLINE", "h300", "AMPFX_FP8_ROOFLINE='h300': use h100, h200, b200 or none."),
    ("AMPFX_GEMM_MIN_FLOPS", "-1", "AMPFX_GEMM_MIN_FLOPS='-1': use a whole number of FLOPs >= 0"),
    ("AMPFX_SENSITIVITY_THRESHOLD", "-1", "AMPFX_SENSITIVITY_THRESHOLD='-1': use a relative error >= 0"),
    ("AMPFX_PAD_MULTIPLE", "1", "AMPFX_PAD_MULTIPLE='1': use an integer >= 2"),
    ("AMPFX_RECONVERT_LIMIT", "x", "AMPFX_RECONVERT_LIMIT='x': use a whole number, e.g. 8"),
])
def test_a_bad_variable_is_one_line_in_the_variables_words(var, value, said, capsys, monkeypatch):
    """In the command (and from convert) a bad value of one variable is one line led by the variable, with the
    values the variable takes: no Python (``None``, ``ampfx.policy.fp8.Recipe``) and no field name."""
    monkeypatch.setenv(var, value)
    if var == "AMPFX_FP8_ROOFLINE":
        monkeypatch.setenv("AMPFX_FP8", "tensorwise")
    assert main(["lists"]) == 2
    err = _one_line(capsys)
    assert err.startswith(f"ampfx lists: error: {said}"), err
    assert "None" not in err and "Recipe" not in err and "e.g. 65536" not in err


def test_fp8_options_set_by_the_environment_alone_get_the_environments_advice(capsys, monkeypatch):
    monkeypatch.setenv("AMPFX_FP8_ROOFLINE", "h200")
    assert main(["lists"]) == 2
    assert _one_line(capsys) == ("ampfx lists: error: AMPFX_FP8_ROOFLINE=h200 without AMPFX_FP8: set "
                                 "AMPFX_FP8=tensorwise (or rowwise, rowwise_with_gw_hp), or unset AMPFX_FP8_ROOFLINE")


# ------------------------------------------------------------------ suggestions and advice
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.fc(x))


class Headed(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.blocks(x))


@pytest.mark.parametrize("model,entry,suggested", [
    (_net, "hed", None),                 # was "Did you mean 'Threshold'?", a torch class the model has none of
    (_net, "Threshol", None),
    (_net, "Linaer", "'Linear'"),
    (Headed, "hed", "'head'"),
    (Headed, "LayerNrom", "'LayerNorm'"),
    (Headed, "blocks.0.fcc", "'blocks.0.fc'"),
    (Headed, "Blok", f"'{__name__}.Block'"),  # the model's own class, by the name that imports it
])
def test_module_name_suggestions_come_from_the_model(model, entry, suggested):
    """A misspelt fp32_modules entry is compared with the model's module paths and its modules' classes, never with
    torch's catalogue of classes."""
    with pytest.raises(PolicyError) as info:
        ampfx.convert(model(), "bf16", fp32_modules=(entry,))
    message = str(info.value)
    if suggested is None:
        assert "Did you mean" not in message, message
    else:
        assert f"Did you mean {suggested}" in message, message


def test_the_commands_fp8_advice_names_the_commands_values(capsys):
    """``--fp8 tensorwsie``: the recipes by name and how to have no FP8 on the command line (leave --fp8 out), not
    Python's ``ampfx.policy.fp8.Recipe`` or ``None``; before the model is loaded (this one cannot run)."""
    assert main(["explain", "tests/support/cli_models.py:AlwaysRaises", "--input", "2,4", "--fp8", "tensorwsie"]) == 2
    assert _one_line(capsys) == ("ampfx explain: error: --fp8 'tensorwsie' is not an FP8 recipe: give one of "
                                 "tensorwise, rowwise, rowwise_with_gw_hp, or leave --fp8 out for no FP8. "
                                 "Did you mean 'tensorwise'?")


def test_lazy_modules_without_input_get_the_commands_advice(capsys, tmp_path):
    """Without --input the command does not run the model: lazy modules are one line asking for --input (the one way
    to run it first there), not Python's "run model(*example_inputs)"."""
    (tmp_path / "lazy_model.py").write_text("import torch.nn as nn\n\ndef build():\n"
                                            "    return nn.Sequential(nn.LazyLinear(4), nn.ReLU())\n")
    assert main(["explain", f"{tmp_path / 'lazy_model.py'}:build"]) == 2
    err = _one_line(capsys)
    assert "give --input" in err and "example_inputs" not in err


def test_a_target_file_that_is_a_directory_is_one_line(capsys, tmp_path):
    """TARGET is a path too: ``dir.py:build`` naming a directory is one line (it was an IsADirectoryError from
    importlib)."""
    (tmp_path / "models.py").mkdir()
    assert main(["explain", f"{tmp_path / 'models.py'}:build"]) == 2
    assert "is a directory, not a Python file" in _one_line(capsys)
