"""The decision log's JSON says which dtype each field holds: before conversion or after."""
import json

import torch
import torch.nn as nn

import ampfx


def test_json_keys_say_which_dtypes_are_before_conversion(tmp_path):
    """A bfloat16 linear's line reads its shapes as the model's float32 ones (``shapes_before``) beside the
    bfloat16 it computes in and writes (``dtype``, ``out``): no bare ``shapes`` key next to ``out``."""
    amp = ampfx.convert(nn.Sequential(nn.Linear(10, 4)), torch.bfloat16, example_inputs=(torch.randn(8, 10),))
    out = amp.ampfx_report.save(tmp_path / "log")
    lines = [json.loads(line) for line in (out / "decisions.jsonl").read_text().splitlines()]
    linear = next(r for r in lines if r["op"] == "linear")
    assert "shapes" not in linear and "in_shapes" not in linear
    assert linear["shapes_before"] == ["float32[8, 4]"] and linear["in_shapes_before"][0] == "float32[8, 10]"
    assert (linear["dtype"], linear["out"]) == ("bfloat16", "bfloat16")
    record = amp.ampfx_report.by_node("linear")
    assert record.shapes == ("float32[8, 4]",)  # the record's field keeps its name
