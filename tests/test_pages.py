"""README and docs/ as a newcomer reads them: every printed output is checked, every page is reachable from
the index, every link and image exists, no page reads like a development journal, and the set-up
scripts install no system packages."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)


def test_readme_code_prints_what_the_readme_shows():
    """README's ```python blocks run as pasted, in order, from an empty namespace in an empty directory,
    and each prints exactly the ```text block after it (refresh: python tests/support/doccheck.py --fill README.md)."""
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "doccheck.py"), str(README)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_every_readme_output_block_follows_the_code_that_prints_it():
    """An output shown in README is a ```text block right after the ```python block that prints it (the
    one shape tests/support/doccheck.py checks); no python block shows its output in comments, and the first
    block of all is python, printing the summary."""
    blocks = [(m.group(1).strip(), m.group(2), m.start(), m.end()) for m in FENCE.finditer(README.read_text())]
    assert blocks[0][0] == "python" and "print(amp.ampfx_report.summary())" in blocks[0][1]
    for i, (lang, body, _, _) in enumerate(blocks):
        if lang == "text":
            assert i > 0 and blocks[i - 1][0] == "python", f"README block {i} shows output no code prints"
        if lang == "python":
            assert not re.search(r"^# (ampfx:|  )", body, re.M), f"README block {i} shows output as comments"
            assert i + 1 < len(blocks) and blocks[i + 1][0] == "text" or "print(" not in body


def test_docs_index_lists_every_page_and_readme_links_it():
    index = (DOCS / "README.md").read_text()
    linked = set(re.findall(r"\]\(([a-z0-9-]+\.md)[)#]", index))
    assert linked == {p.name for p in PAGES if p.name != "README.md"}
    assert "](docs/README.md)" in README.read_text()


def _links(path: Path):
    text = FENCE.sub("", path.read_text())
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"[a-z]+:", target) and not target.startswith("#"):
            yield target.split("#")[0]


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.name)
def test_every_link_and_image_exists(page):
    missing = [t for t in _links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.name} links to missing files: {missing}"


JOURNAL = [  # how the work was organised, which user docs never say
    r"\bsandbox", r"\blent\b", r"\bsessions?\b", r"\bissue #?\d+", r"(?<![\w/&])#\d{1,3}\b",
    r"\bhelpers?'? review", r"\breview(s|er|ers|ed)?\b", r"\bno GPU was\b", r"\bthis task\b", r"\bworktree",
    r"\bengineers?\b", r"\bthe lead\b", r"\bfirst run of the day\b", r"\bprevious run\b", r"\bearlier runs?\b",
]


def _prose(path: Path) -> str:
    text = path.read_text()
    if path.suffix == ".py":  # the module docstring and comments: what a reader of the script sees
        return "\n".join(re.findall(r'"""(.*?)"""', text, re.S) + re.findall(r"#.*", text))
    return text


@pytest.mark.parametrize("path", [README, *PAGES, *sorted((ROOT / "benchmarks").glob("*.py"))],
                         ids=lambda p: p.name)
def test_no_journal_wording(path):
    """Docs say what was measured, on what machine and versions, and what it means; not who measured it
    when or how the work was organised (history lives in git)."""
    prose = re.sub(r"\bPython session\b", "", _prose(path))
    hits = [m.group(0) for pattern in JOURNAL for m in re.finditer(pattern, prose, re.I)]
    assert not hits, f"{path.name}: {hits}"


def test_scripts_install_no_system_packages():
    """The README's commands never install system packages behind the user's back (CI opts in, in .ci/run)."""
    for script in sorted((ROOT / "scripts").glob("*.sh")):
        found = re.findall(r"\b(apt-get|apt|yum|dnf|brew|pacman|apk|sudo)\s+\w+", script.read_text())
        assert not found, f"{script.name} runs {found}"


def test_readme_states_the_test_commands_time_and_disk_first():
    text = README.read_text()
    before = text[:text.index("bash scripts/test.sh\n")]
    said = before[before.rindex("Run the tests"):]
    assert re.search(r"\d+ GB of disk", said) and re.search(r"\d+ minutes", said)


def test_readme_layout_lists_the_pipeline_in_order():
    from ampfx.passes import PIPELINE

    text = " ".join(README.read_text().split())
    order = ", ".join(f"`{f.__name__}`" for f in PIPELINE)
    assert f"`PIPELINE` in `passes/__init__.py`: {order})" in text


def test_benchmarks_page_holds_the_cast_counts_the_script_prints():
    """docs/benchmarks.md's casts-against-autocast table is benchmarks/casts.py's output, counted now."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "casts.py")], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() in (DOCS / "benchmarks.md").read_text()
