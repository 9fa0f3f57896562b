"""Arguments are validated with clear errors (issue #17, "Validate the arguments").

Every user error from ``ampfx.convert`` is an ampfx exception (``PolicyError`` or its
subclass ``ArgumentError``) whose one-line message names the bad input; the ``ampfx``
command exits 2 with one line and no traceback for every user error.
"""
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import ampfx
from ampfx.errors import ArgumentError
from ampfx.errors import PolicyError
from ampfx.ui.cli import main


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.relu(self.fc(x)))


class Shared(nn.Module):
    """One submodule under two names: ``fc`` (what tracing records) and ``alias``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.alias = self.fc
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.alias(x))


def build_fn(x):
    return x


X = torch.randn(2, 4)

BAD_CALLS = {
    # the model itself
    "class": (lambda: ampfx.convert(Net), "got the class Net - did you mean Net()?"),
    "function": (lambda: ampfx.convert(build_fn), "got the function build_fn"),
    "None": (lambda: ampfx.convert(None), "takes an nn.Module instance; got None"),
    # module names
    "fp32_modules empty name": (lambda: ampfx.convert(Net(), fp32_modules=("",)), "empty name"),
    "fp32_modules empty string": (lambda: ampfx.convert(Net(), fp32_modules=""), "empty name"),
    "fp32_modules a non-module class": (lambda: ampfx.convert(Net(), fp32_modules=(int,)), "is a class but not an nn.Module"),
    "fp32_modules typo": (lambda: ampfx.convert(Net(), fp32_modules=("fcc",)), "Did you mean 'fc'"),
    "leaf_modules an int": (lambda: ampfx.convert(Net(), leaf_modules=(3,)), "leaf_modules: 3"),
    # example inputs
    "inputs generator": (lambda: ampfx.convert(Net(), example_inputs=(t for t in [X])), "is a generator"),
    "inputs of strings": (lambda: ampfx.convert(Net(), example_inputs=["a", "b"]), "holds no tensor"),
    "inputs too many": (lambda: ampfx.convert(Net(), example_inputs=(X, X)), "does not fit Net.forward(x)"),
    "inputs unknown keyword": (lambda: ampfx.convert(Net(), example_inputs={"y": X}), "does not fit Net.forward"),
    "inputs non-str keys": (lambda: ampfx.convert(Net(), example_inputs={0: X}), "keys must be forward's"),
    # calibration
    "calibrate an int": (lambda: ampfx.convert(Net(), example_inputs=(X,), calibrate=3), "calibrate=3"),
    "calibrate a tensor": (lambda: ampfx.convert(Net(), example_inputs=(X,), calibrate=X), "list of batches"),
    "calibrate empty": (lambda: ampfx.convert(Net(), example_inputs=(X,), calibrate=[]), "has no batches"),
    "calibrate other rank": (lambda: ampfx.convert(Net(), example_inputs=(X,), calibrate=[(torch.randn(2, 2, 4),)]),
                             "calibrate batch 0 differs"),
    "calibrate int batch": (lambda: ampfx.convert(Net(), example_inputs=(X,), calibrate=[(X,), (X.long(),)]),
                            "calibrate batch 1 differs"),
    "loss not callable": (lambda: ampfx.convert(Net(), example_inputs=(X,), calibrate=[(X,)], calibrate_loss=3),
                          "calibrate_loss=3"),
    "loss not scalar": (lambda: ampfx.convert(Net(), example_inputs=(X,), calibrate=[(X,)],
                                              calibrate_loss=lambda out: out), "returned a torch.float32 tensor"),
    "loss a float": (lambda: ampfx.convert(Net(), example_inputs=(X,), calibrate=[(X,)],
                                           calibrate_loss=lambda out: 1.0), "calibrate_loss returned 1.0"),
    "loss without calibrate": (lambda: ampfx.convert(Net(), calibrate_loss=lambda out: out.sum()),
                               "without calibrate="),
    # the other arguments
    "environ a list": (lambda: ampfx.convert(Net(), environ=["AMPFX_PAD=never"]), "environ=list"),
    "mode typo": (lambda: ampfx.convert(Net(), mode="inferenc"), "Did you mean 'inference'"),
    "tracer typo": (lambda: ampfx.convert(Net(), tracer="exprt"), "Did you mean 'export'"),
    "unknown option": (lambda: ampfx.convert(Net(), fp32_module=("fc",)), "Did you mean 'fp32_modules'"),
    "policy a string": (lambda: ampfx.convert(Net(), policy="bf16"), "give an ampfx.Policy"),
    "policy and options": (lambda: ampfx.convert(Net(), policy=ampfx.Policy(), pad="never"), "not both"),
    "export without inputs": (lambda: ampfx.convert(Net(), tracer="export"), "give example_inputs"),
    # dtypes
    "dtype float32": (lambda: ampfx.convert(Net(), torch.float32), "the model already runs in it"),
    "dtype float64": (lambda: ampfx.convert(Net(), torch.float64), "not a low-precision dtype"),
    "dtype int": (lambda: ampfx.convert(Net(), 16), "dtype=16"),
    "dtype int64": (lambda: ampfx.convert(Net(), torch.int64), "dtype=torch.int64"),
    # Policy fields
    "probe a string": (lambda: ampfx.convert(Net(), probe="no"), "probe='no': use True or False"),
    "keep_output_dtype": (lambda: ampfx.convert(Net(), keep_output_dtype="yes"), "use True or False"),
    "disable an int": (lambda: ampfx.Policy(disable=1), "disable=1"),
    "calibration_margin": (lambda: ampfx.convert(Net(), calibration_margin=0), "calibration_margin=0"),
    "module_filter_fn": (lambda: ampfx.convert(Net(), module_filter_fn=3), "module_filter_fn=3"),
    "log_path an int": (lambda: ampfx.convert(Net(), log_path=3), "log_path=3"),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_arguments_raise_one_clear_ampfx_error(name):
    """Each bad argument: an ampfx error (PolicyError or ArgumentError), one line, naming it."""
    call, needle = BAD_CALLS[name]
    with pytest.raises(PolicyError) as info:
        call()
    message = str(info.value)
    assert needle in message and "\n" not in message, message


def test_argument_errors_are_both_type_and_value_errors():
    """ArgumentError keeps existing ``except TypeError`` and ``except ValueError`` clauses working."""
    for builtin in (TypeError, ValueError):
        with pytest.raises(builtin):
            ampfx.convert(Net, "bf16")
    assert issubclass(ArgumentError, PolicyError)


def test_unwritable_log_path_is_named(tmp_path):
    """``AMPFX_LOG_PATH`` under a regular file: an ampfx error naming the variable, not an OSError."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ArgumentError, match="AMPFX_LOG_PATH.*cannot write"):
        ampfx.convert(Net(), "bf16", environ={"AMPFX_LOG_PATH": str(blocker / "logs")})


@pytest.mark.parametrize("field,name", [("fp32_modules", "alias"), ("leaf_modules", "alias")])
def test_alias_of_a_shared_submodule_is_a_module_name(field, name):
    """A submodule registered under two names answers to both (it was "not a module of Shared"):
    ``fp32_modules=('alias',)`` keeps it float32, ``leaf_modules=('alias',)`` keeps it a leaf."""
    model = Shared()
    amp = ampfx.convert(model, "bf16", example_inputs=(X,), **{field: (name,)})
    rec = next(r for r in amp.ampfx_report.compute if r.module in ("fc", "alias"))
    if field == "fp32_modules":
        assert rec.dtype == torch.float32 and rec.rule == "fp32_modules"
        assert "fc" in amp.ampfx_report.policy["fp32_matched"]  # the object's first name too (tracing's)
    else:
        assert rec.kind == "call_module"  # kept as an opaque leaf
    torch.testing.assert_close(amp(X), model(X), atol=0.05, rtol=0.05)


def test_valid_calibration_still_runs():
    """Batches like example_inputs (another batch size) and a scalar loss are accepted."""
    amp = ampfx.convert(Net(), "bf16", example_inputs=(X,), calibrate=[(torch.randn(8, 4),), torch.randn(3, 4)],
                        calibrate_loss=lambda out: out.pow(2).mean())
    assert any("calibration: 2 batches" in n for n in amp.ampfx_report.notes)


def test_calibration_batches_as_dicts_in_any_key_order():
    """Keyword batches match example_inputs whatever the order of their keys."""
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, y):
            return self.fc(x) + y

    amp = ampfx.convert(TwoInputs(), "bf16", example_inputs={"x": X, "y": X},
                        calibrate=[{"y": X, "x": X}, {"x": X, "y": X}])
    assert any("calibration: 2 batches" in n for n in amp.ampfx_report.notes)


def test_save_removes_stale_graph_files_and_nothing_else(tmp_path):
    """Saving into a directory holding an older report with more regions removes its
    ``graph_*.py`` files; files ``save()`` does not own stay."""
    (tmp_path / "graph_before.encoder.py").write_text("old")
    (tmp_path / "graph_after.encoder.py").write_text("old")
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "graph_notes.py").write_text("mine too")
    ampfx.convert(Net(), "bf16", example_inputs=(X,)).ampfx_report.save(tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "graph_before.encoder.py" not in names and "graph_after.encoder.py" not in names
    assert {"graph_before.py", "graph_after.py", "notes.txt", "graph_notes.py"} <= set(names)


# --------------------------------------------------------------------------- the command

MODEL_FILE = textwrap.dedent('''
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)

    class NeedsArgs(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.fc = nn.Linear(width, width)

        def forward(self, x):
            return self.fc(x)
''')


@pytest.fixture
def in_model_dir(tmp_path, monkeypatch):
    """A folder holding ``guard_model.py``, made the current directory; the module forgotten after."""
    (tmp_path / "guard_model.py").write_text(MODEL_FILE)
    (tmp_path / "afile").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield tmp_path
    sys.modules.pop("guard_model", None)


CLI_ERRORS = {
    "constructor needs arguments": (["explain", "guard_model.py:NeedsArgs"], "cannot be called without arguments"),
    "negative size": (["explain", "guard_model:Net", "--input", "2,-4"], "sizes must be positive"),
    "zero size": (["explain", "guard_model:Net", "--input", "0,4"], "sizes must be positive"),
    "empty input": (["explain", "guard_model:Net", "--input", ""], "--input ''"),
    "empty size": (["explain", "guard_model:Net", "--input", "2,,4"], "--input '2,,4'"),
    "export without input": (["explain", "guard_model:Net", "--tracer", "export"], "give --input"),
    "unwritable --out": (["explain", "guard_model:Net", "--input", "2,4", "--out", "afile/report"], "--out"),
    "--out is a file": (["explain", "guard_model:Net", "--input", "2,4", "--out", "afile"], "not a directory"),
    "unwritable --html": (["explain", "guard_model:Net", "--input", "2,4", "--html", "afile/x.html"], "--html"),
    "unwritable plot --out": (["plot", "guard_model:Net", "--input", "2,4", "--out", "afile/x.png"], "--out"),
}


@pytest.mark.parametrize("name", list(CLI_ERRORS))
def test_cli_user_errors_exit_2_with_one_line(name, in_model_dir, capsys):
    """Each user error: exit status 2, one line on stderr naming the flag, no traceback."""
    argv, needle = CLI_ERRORS[name]
    if argv[0] == "plot":
        pytest.importorskip("matplotlib")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_cli_unwritable_log_path_exits_2(in_model_dir, capsys, monkeypatch):
    monkeypatch.setenv("AMPFX_LOG_PATH", "afile/logs")
    assert main(["explain", "guard_model:Net", "--input", "2,4"]) == 2
    err = capsys.readouterr().err
    assert "AMPFX_LOG_PATH" in err and "Traceback" not in err


@pytest.mark.parametrize("steps", ["-5", "0", "two"])
def test_demo_rejects_non_positive_steps(steps, capsys):
    """``demo --steps`` takes a positive whole number: argparse exits 2 naming it."""
    with pytest.raises(SystemExit) as info:
        main(["demo", "--steps", steps])
    assert info.value.code == 2 and "--steps" in capsys.readouterr().err


def test_module_target_imports_from_the_current_directory(in_model_dir, capsys):
    """``ampfx explain guard_model:Net`` run in the folder holding guard_model.py works, as
    ``python -m`` would import it."""
    assert main(["explain", "guard_model:Net", "--input", "2,4", "--format", "json"]) == 0
    assert '"op": "linear"' in capsys.readouterr().out
