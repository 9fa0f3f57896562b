"""The trainers' page runs whole here: every block, the libraries its blocks need installed (the core lane skips
them, tests/test_docs.py)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("page", ["integrations.md"])
def test_the_trainer_pages_run_every_block_and_print_what_they_show(page):
    """Rule: in the lane that installs Lightning, Accelerate and transformers, every ```python block of the
    trainers' page runs (``--strict``: a block whose library is missing fails the page, none is skipped) and
    prints what the ```text block after it shows."""
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "doccheck.py"), str(ROOT / "docs" / page),
                          "--strict"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert "SKIPPED" not in run.stdout
