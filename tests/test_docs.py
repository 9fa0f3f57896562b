"""The docs' examples run, and print what the docs say they print."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["getting-started.md", "concepts.md", "policy.md", "report.md", "numerics.md", "plots.md", "tuning.md", "scale.md",
         "fp8.md"]


@pytest.mark.parametrize("page", PAGES)
def test_doc_examples_print_what_the_page_shows(page):
    """Each ```python block runs; its output must equal the ```text block after it.
    Refresh after an intended change: python tests/support/doccheck.py --fill docs/<page>"""
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "doccheck.py"), str(ROOT / "docs" / page)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
