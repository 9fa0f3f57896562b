"""The docs' examples run, and print what the docs say they print."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["getting-started.md", "concepts.md", "policy.md", "report.md", "numerics.md", "plots.md", "tuning.md", "scale.md",
         "fp8.md", "integrations.md"]


def run_page(path, *flags):
    """tests/support/doccheck.py on ``path``: the completed process."""
    return subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "doccheck.py"), str(path), *flags],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("page", PAGES)
def test_doc_examples_print_what_the_page_shows(page):
    """Each ```python block runs; its output must equal the ```text block after it. A block whose info string
    names libraries not installed here (```` ```python needs=lightning ````: the trainers' pages) is skipped, and
    the test with it, saying which (the trainers lane runs those pages with every block: tests_trainers/test_docs.py).
    Refresh after an intended change: python tests/support/doccheck.py --fill docs/<page>"""
    run = run_page(ROOT / "docs" / page)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    skipped = [line.removeprefix("--- SKIPPED ") for line in run.stdout.splitlines() if line.startswith("--- SKIPPED ")]
    if skipped:  # the blocks that ran passed; these need the trainers lane
        pytest.skip(f"docs/{page}: {'; '.join(skipped)} (tests_trainers/test_docs.py runs them)")


def test_a_block_needing_a_library_not_installed_is_skipped_with_a_message_or_fails_when_strict(tmp_path):
    """Rule: a page's ```python block marked ``needs=LIB`` is skipped, with its output check, where LIB is not
    installed, and the run says which block and library; with ``--strict`` (the lane that installs LIB) the page
    fails instead; the page's other blocks run either way."""
    page = tmp_path / "page.md"
    page.write_text("```python\nprint('core')\n```\n\n```text\ncore\n```\n\n"
                    "```python needs=ampfx_no_such_library\nprint('never')\n```\n\n```text\nsomething else\n```\n\n"
                    "```python needs=json\nprint('installed')\n```\n\n```text\ninstalled\n```\n")
    run = run_page(page)
    assert run.returncode == 0, run.stdout
    assert "--- SKIPPED block 2: needs ampfx_no_such_library (not installed)" in run.stdout
    assert "MISMATCH" not in run.stdout and "SKIPPED block 4" not in run.stdout
    strict = run_page(page, "--strict")
    assert strict.returncode == 1 and "FAILED block 2: needs ampfx_no_such_library" in strict.stdout


def test_getting_starteds_bullets_explain_the_summary_lines_it_shows():
    """Each bullet of getting-started.md that explains a summary entry (`` `op N (word)` ``) quotes an entry the
    page's printed output holds: the prose never contradicts the output above it."""
    import re
    text = (ROOT / "docs" / "getting-started.md").read_text()
    shown = "\n".join(re.findall(r"```text\n(.*?)```", text, flags=re.S))
    quoted = re.findall(r"^- `(\w+ \d+ \([^`]*\))`", text, flags=re.M)
    assert quoted
    for entry in quoted:
        assert entry in shown, f"{entry!r} is explained but not in the output the page shows"


def test_a_pages_decimal_figures_may_differ_by_a_tenth_and_nothing_else_may():
    """The page check reads decimal figures (a loss, an error) within 10% of the page's, since another CPU's
    low-precision kernels round their own way; counts and all other text must match exactly."""
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from doccheck import same
    assert same("ampfx bfloat16  0.111  0.99", "ampfx bfloat16  0.113  0.99")
    assert same("step 100  loss 0.0015", "step 100  loss 0.0014")
    assert not same("converted 9/11 nodes, 9 casts", "converted 9/11 nodes, 8 casts")
    assert not same("error 0.50", "error 0.70")
    assert not same("loss 0.113 (bf16)", "loss 0.113 (fp16)")
