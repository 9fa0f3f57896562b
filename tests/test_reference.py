"""The op-table reference in docs/ is generated from the tables and must not go stale."""
from pathlib import Path

from ampfx.tools import reference
from ampfx.ops import ENTRIES

PAGE = Path(__file__).resolve().parent.parent / "docs" / "op-tables.md"


def test_generated_reference_is_current():
    """Regenerate with: python -m ampfx.tools.reference > docs/op-tables.md"""
    assert PAGE.read_text() == reference.markdown(), "docs/op-tables.md is stale: python -m ampfx.tools.reference > docs/op-tables.md"


def test_every_op_and_its_reason_appear():
    page = reference.markdown()
    for name, rule in ENTRIES.items():
        assert f"| `{name}` |" in page and rule.reason.replace("|", "/") in page
