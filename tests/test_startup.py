"""What starting costs, bounded by what is imported (not by the clock): ``import ampfx``, ``ampfx --help`` and an
argument error import no torch; ampfx's public names import what they define, and only converting imports what
converting needs (sympy); ``scripts/demo.sh`` checks its arguments before its set-up. ``python
benchmarks/startup.py`` prints the times."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "numpy", "sympy", "torch._dynamo", "torch.fx.experimental.symbolic_shapes", "torch._inductor",
         "matplotlib", "rich")
"""What a start that runs nothing must not import (each seconds on a loaded machine, sympy alone 1.3 s)."""


def imported(*argv: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """``python -X importtime ARGV`` in a fresh process from the checkout: the run, and every module it imported."""
    run = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    names = set(re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", run.stderr, re.M))
    assert "ampfx" in names, run.stderr[-2000:]
    return run, names


@pytest.mark.parametrize("argv,code,says", [
    (["--help"], 0, "usage: ampfx"),
    (["explian"], 2, "invalid choice: 'explian'"),
    (["demo", "--steps", "abc"], 2, "'abc' is not a whole number"),
    (["lists", "--dtype", "fp64"], 2, "'fp64' is not a low-precision dtype"),
    (["explain", "m.py:build", "--imput", "4,12"], 2, "Did you mean '--input'"),
])
def test_help_and_argument_errors_import_no_torch(argv, code, says):
    """``ampfx --help`` and an argument error (an unknown command, a bad value, a misspelt flag) are answered by
    the parser alone: no torch, sympy, dynamo, matplotlib or rich is imported."""
    run, names = imported("-m", "ampfx", *argv)
    assert run.returncode == code and says in run.stdout + run.stderr
    assert not names & set(HEAVY), sorted(names & set(HEAVY))


def test_the_console_script_is_the_parser_without_torch():
    """The ``ampfx`` entry point (``ampfx.ui.cli:main``) imports no torch to parse."""
    run, names = imported("-c", "import sys; from ampfx.ui.cli import main; sys.exit(main(['demo', '--steps', '0']))")
    assert run.returncode == 2 and "0 is not positive" in run.stderr
    assert not names & set(HEAVY), sorted(names & set(HEAVY))


def test_import_ampfx_imports_nothing_heavy():
    """``import ampfx`` imports none of ampfx's modules but the package (each public name is imported at its first
    use), so no torch."""
    run, names = imported("-c", "import ampfx")
    assert run.returncode == 0, run.stderr[-2000:]
    assert not names & set(HEAVY) and {n for n in names if n.startswith("ampfx.")} == set()


def test_names_that_do_not_convert_import_nothing_converting_needs():
    """The policy, the report and the debugger import torch, but not sympy, dynamo, matplotlib or rich: those are
    imported when converting (sympy, by the passes) or printing (rich)."""
    run, names = imported("-c", "import ampfx; ampfx.Policy, ampfx.Report, ampfx.debug, ampfx.count_casts")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "torch" in names and not names & set(HEAVY[2:]), sorted(names & set(HEAVY[2:]))


def test_convert_imports_no_dynamo_plotting_or_tables():
    """``ampfx.convert`` imports what converting needs (sympy, the passes) and not torch._dynamo, inductor,
    matplotlib or rich."""
    run, names = imported("-c", "import ampfx; ampfx.convert")
    assert run.returncode == 0, run.stderr[-2000:]
    assert {"sympy", "ampfx.passes"} <= names
    assert not names & {"torch._dynamo", "torch._inductor", "matplotlib", "rich"}


def test_every_public_name_resolves_and_is_listed():
    """The names ``ampfx.__all__`` lists are in ``dir(ampfx)`` before their first use, resolve to what their
    modules define, and ``from ampfx import *`` binds them all; submodules are attributes too."""
    code = ("import ampfx; listed = set(dir(ampfx)); ns = {}; exec('from ampfx import *', ns); "
            "from ampfx.api import convert; from ampfx.runtime import weight_cache; from ampfx.policy import Policy; "
            "assert set(ampfx.__all__) <= listed; assert set(ampfx.__all__) <= set(ns); "
            "assert ampfx.convert is convert and ampfx.weight_cache is weight_cache and ampfx.Policy is Policy; "
            "assert ampfx.passes.PIPELINE and ampfx.ops.Category; "
            "assert not hasattr(ampfx, 'no_such_name')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.fixture
def demo_copy(tmp_path):
    """scripts/demo.sh in a checkout whose set-up and ``ampfx`` only say they ran (and with what)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "demo.sh", tmp_path / "scripts" / "demo.sh")
    (tmp_path / "scripts" / "setup.sh").write_text("echo set-up ran >&2\n")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    ampfx = tmp_path / ".venv" / "bin" / "ampfx"
    ampfx.write_text('#!/usr/bin/env bash\necho "ampfx ran: $*"\n')
    ampfx.chmod(0o755)
    (tmp_path / "ampfx").symlink_to(ROOT / "ampfx")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(tmp_path / "scripts" / "demo.sh"), *args], capture_output=True,
                              text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=300)
    return run


@pytest.mark.parametrize("args,says", [
    (["--steps", "abc"], "'abc' is not a whole number"),
    (["--steps", "0"], "0 is not positive"),
    (["--dtype", "fp64"], "'fp64' is not a low-precision dtype"),
    (["--out", "/dev/null"], "--out '/dev/null'"),
    (["--stpes", "3"], "Did you mean '--steps'"),
])
def test_demo_script_checks_its_arguments_before_the_set_up(demo_copy, args, says):
    """A bad argument of scripts/demo.sh is named at once, exit 2, before the set-up (pip) runs."""
    run = demo_copy(*args)
    assert run.returncode == 2 and says in run.stderr, run.stderr
    assert "set-up ran" not in run.stderr and "ampfx ran" not in run.stdout


def test_demo_script_answers_help_without_the_set_up_and_passes_good_arguments_on(demo_copy):
    """``--help`` prints ``ampfx demo``'s help and sets nothing up; good arguments reach ``ampfx demo`` as given,
    after the set-up."""
    run = demo_copy("--help")
    assert run.returncode == 0 and run.stdout.startswith("usage: ampfx demo") and "set-up ran" not in run.stderr
    run = demo_copy("--dtype", "fp16", "--steps", "3", "--out", "my log")
    assert run.returncode == 0 and "set-up ran" in run.stderr
    assert run.stdout.strip() == "ampfx ran: demo --dtype fp16 --steps 3 --out my log"


def test_each_public_name_is_what_its_module_defines_not_the_module():
    """``ampfx.compare``, ``ampfx.debug`` and ``ampfx.tune`` are the functions (their modules share their names);
    ``ampfx.weight_cache`` alone is a module."""
    import importlib
    import types

    import ampfx
    for name, where in ampfx._PUBLIC.items():
        got = getattr(ampfx, name)
        if name in ampfx._MODULES:
            assert isinstance(got, types.ModuleType), name
        else:
            assert got is getattr(importlib.import_module(where), name), name
