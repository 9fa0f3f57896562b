"""examples/train_digits.py: the CNN and the transformer train three ways (smoke run)."""
import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("sklearn")
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_digits.py"


def test_digits_example_trains_fp32_bf16_fp16_side_by_side():
    spec = importlib.util.spec_from_file_location("train_digits", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.run(quick=True)
    for name in ("cnn", "transformer"):
        runs = results[name]
        assert runs["fp32"]["acc"] > 60, runs  # learned something in a couple of epochs (chance: 10%)
        for mode in ("bf16", "fp16"):
            assert abs(runs[mode]["acc"] - runs["fp32"]["acc"]) <= 5, (name, mode, runs)
            assert runs[mode]["casts"] < runs[mode]["autocast_casts"], (name, mode, runs)
            assert runs[mode]["summary"].startswith("ampfx: converted")


FSDP_EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_fsdp.py"


@pytest.mark.distributed
def test_train_fsdp_example_matches_one_process():
    """examples/train_fsdp.py: 2 spawned gloo ranks, FSDP2 per block + checkpointing, loss curve equal
    to one process's (the example asserts it; a failing or hung rank raises within its deadline)."""
    sys.path.insert(0, str(FSDP_EXAMPLE.parent))  # the spawned ranks import it by name (spawn passes sys.path)
    try:
        import train_fsdp
        curve, single = train_fsdp.main(["--steps", "3"])
    finally:
        sys.path.remove(str(FSDP_EXAMPLE.parent))
    assert len(curve) == len(single) == 3 and curve[-1] < curve[0] + 0.5
