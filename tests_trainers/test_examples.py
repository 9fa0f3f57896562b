"""The trainer examples run (short) and print the report, the three loss curves and the step costs."""
import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lightning_example(capsys):
    """examples/train_lightning.py: one epoch; ampfx's curve within 1e-2 of bf16-mixed's, casts counted."""
    out = load("train_lightning").main(["--epochs", "1"])
    fp32, own, amp = out["losses"]
    assert len(fp32) == len(own) == len(amp) == 8
    assert max(abs(a - b) for a, b in zip(amp, own)) < 1e-2
    assert out["costs"]["ampfx"][0] > 0 and out["costs"]["own"][0] > 0
    printed = capsys.readouterr().out
    assert "ampfx: converted" in printed and "Lightning bf16-mixed" in printed


def test_hf_trainer_example(capsys, fresh_accelerate_state):
    """examples/train_hf_trainer.py: four steps; ampfx's curve within 1e-2 of bf16=True's; ampfx casts fewer bytes."""
    out = load("train_hf_trainer").main(["--steps", "4"])
    fp32, own, amp = out["losses"]
    assert len(amp) == len(own) == 4
    assert max(abs(a - b) for a, b in zip(amp, own)) < 1e-2
    assert out["costs"]["ampfx"][1] < out["costs"]["own"][1]
    assert "AmpfxTrainer bf16" in capsys.readouterr().out
