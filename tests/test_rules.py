"""The vocabulary of decision rules (``ampfx.report.records.Rule``) and the per-op facts the passes read."""
import json
import pickle
import re
from pathlib import Path

import pytest
import torch

from ampfx import ops
from ampfx.ops import Category
from ampfx.report.records import Decision, Rule, dtype_name

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_a_rule_reads_as_its_string_everywhere():
    """A member equals, hashes, prints, formats, reprs and serialises as its value."""
    r = Rule.PAINT_DENY
    assert r == "paint:deny" and hash(r) == hash("paint:deny") and {"paint:deny": 1}[r] == 1
    assert (str(r), f"{r}", f"{r:12}|", repr(r)) == ("paint:deny", "paint:deny", "paint:deny  |", "'paint:deny'")
    assert json.dumps({"rule": r}) == '{"rule": "paint:deny"}'
    assert pickle.loads(pickle.dumps(r)) is r


def test_env_rules_are_members_made_on_demand():
    """``env:<VAR>`` names its variable, carries ENV's documentation and pickles."""
    r = Rule("env:AMPFX_DENYLIST_ADD")
    assert r is Rule.env("AMPFX_DENYLIST_ADD") and isinstance(r, Rule)
    assert (r == "env:AMPFX_DENYLIST_ADD", str(r), r.env_var, r.doc) == (
        True, "env:AMPFX_DENYLIST_ADD", "AMPFX_DENYLIST_ADD", Rule.ENV.doc)
    assert r.word == "env:AMPFX_DENYLIST_ADD" and r.counted and not r.inserted
    assert pickle.loads(pickle.dumps(r)) is r
    assert Rule.TABLE.env_var is None and Rule.ENV.env_var is None
    with pytest.raises(ValueError):
        Rule("env:")


def test_a_decision_holds_a_rule_member():
    """A rule given as its string becomes the member; an unknown rule is an error."""
    base = dict(node="n", op="add", target="t", module="", category=Category.INFER, dtype=None, reason="r")
    assert Decision(rule="paint:clear", **base).rule is Rule.PAINT_CLEAR
    assert Decision(rule="env:AMPFX_INFERLIST_ADD", **base).as_json()["rule"] == "env:AMPFX_INFERLIST_ADD"
    with pytest.raises(ValueError):
        Decision(rule="paint:typo", **base)


def test_inserted_and_counted():
    """Nodes ampfx adds are inserted and not counted; a module kept eager and a kept module's call
    are not counted either (their nodes are, in their own records)."""
    assert [r.value for r in Rule if r.inserted] == ["bias-fp32", "pad"]
    assert [r.value for r in Rule if not r.counted] == ["bias-fp32", "pad", "keep_modules", "eager"]


def test_report_md_lists_every_rule_and_every_short_word():
    """docs/report.md's rules table has one row per Rule member, and the summary's
    short words are the ones ``Rule.word`` gives."""
    text = (DOCS / "report.md").read_text()
    section = text.split("## Rules", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)
    assert sorted(rows) == sorted(r.value for r in Rule) and len(rows) == len(set(rows))
    words = " ".join(section.split())
    for r in Rule:
        if r.word != r.value:
            assert f"`{r.word}` (`{r.value}`)" in words, r


def test_dtype_names():
    """One spelling of dtypes: long by default, short on request, '-' for none."""
    assert [dtype_name(d) for d in (torch.float32, torch.float16, torch.bfloat16, None, "dynamic")] == [
        "float32", "float16", "bfloat16", "-", "dynamic"]
    assert [dtype_name(d, short=True) for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)] == [
        "fp32", "fp16", "bf16", "float64"]


def test_per_op_facts_the_passes_read():
    """The op table says which ops are views, selections, size-decided reductions,
    float32-accumulating, bias-splitting."""
    def having(field):
        return sorted(n for n, r in ops.ENTRIES.items() if getattr(r, field))

    assert having("view") == sorted([
        "view", "reshape", "permute", "transpose", "t", "flatten", "unflatten", "squeeze", "unsqueeze", "expand",
        "expand_as", "narrow", "select", "getitem", "chunk", "split", "tensor_split", "unbind", "view_as",
        "reshape_as", "movedim", "swapaxes", "diagonal", "contiguous", "detach", "getattr"])
    assert having("select") == ["getattr", "getitem"]
    assert having("float_attrs") == ["getattr"]
    assert having("reduction") == sorted(["sum", "mean", "var", "std", "norm", "prod", "cumsum", "logsumexp"])
    assert having("fp32_accumulation") == sorted(["mean", "sum", "batch_norm", "instance_norm", "layer_norm",
                                                  "group_norm", "rms_norm"])
    assert having("split_bias") == ["linear"]
    assert dict(ops.ENTRIES["to"].cast_to)["half"] is torch.float16 and ops.ENTRIES["to"].cast_like == ("type_as",)
    # that no pass compares an op's name: tests/test_architecture.py::test_passes_compare_no_op_names


def test_the_names_region_had_still_read():
    """``Rule.EAGER`` was ``Rule.REGION`` with the value ``"region"``, ``Part`` was ``Region`` and
    ``Report.parts`` was ``Report.regions``: code written for those names, records and reports saved
    with them, and converted modules pickled with them still work (the names warn as deprecated)."""
    import ampfx.report
    from ampfx.report import Report
    from ampfx.report.records import Part

    assert Rule.REGION is Rule.EAGER and Rule("region") is Rule.EAGER and Rule.EAGER == "eager"
    base = dict(node="n", op="block", target="block", module="block", category=Category.FP32,
                dtype=torch.float32, reason="r")
    assert Decision(rule="region", **base).rule is Rule.EAGER
    with pytest.warns(DeprecationWarning):
        assert ampfx.report.Region is Part
    with pytest.warns(DeprecationWarning):
        from ampfx.report.records import Region
    assert Region is Part
    rep = Report(dtype=torch.bfloat16, parts=(Part("", "fx"),))
    with pytest.warns(DeprecationWarning):
        assert rep.regions == rep.parts
    before = pickle.dumps(rep, protocol=0).replace(b"Vparts\n", b"Vregions\n")  # pickled before the rename
    assert b"Vregions\n" in before and b"Vparts\n" not in before
    assert pickle.loads(before).parts == rep.parts


def test_saved_reports_keep_the_regions_key(tmp_path):
    """``policy.json`` lists the parts under ``parts`` and, for code written for older files, under
    ``regions`` too."""
    import torch.nn as nn

    import ampfx

    amp = ampfx.convert(nn.Sequential(nn.Linear(4, 4)), torch.bfloat16, example_inputs=(torch.randn(2, 4),))
    saved = json.loads((amp.ampfx_report.save(tmp_path) / "policy.json").read_text())
    assert saved["parts"] == saved["regions"] and [p["method"] for p in saved["parts"]] == ["fx"]
