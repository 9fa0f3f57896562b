"""Casts per training step, ampfx against torch.autocast, on the test suite's small models.

Counted by ``ampfx.count_casts`` (dtype-changing ``aten._to_copy``, forward + backward), with the loss
inside the autocast region as PyTorch's recipe writes it, as ``tests/test_convert.py`` counts them. Prints
the Markdown table of docs/benchmarks.md; ``tests/test_docs.py`` runs this script and checks that the page
holds its output. Every GEMM is low (``gemm_min_flops=0``): these models are tiny, and on a CPU ampfx would
keep each of their GEMMs float32 by default (under the device's break-even) and cast nothing.

    python benchmarks/casts.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import ampfx  # noqa: E402
from support.models import build  # noqa: E402

ROWS = [  # (tests/support/models.py name, label, dtype)
    ("mlp", "MLP (3 linear, gelu, tanh, residual)", torch.bfloat16),
    ("cnn", "CNN (2 conv + BN, max-pool, head)", torch.bfloat16),
    ("transformer", "2-layer transformer classifier", torch.bfloat16),
    ("transformer", "2-layer transformer classifier", torch.float16),
    ("rnn", "GRU classifier", torch.bfloat16),
    ("encoder_layer", "`nn.TransformerEncoderLayer(64, 4, 128)`", torch.bfloat16),
]


def counts(name: str, dtype: torch.dtype) -> tuple[int, int]:
    """(ampfx, autocast) casts in one training step of ``build(name)``."""
    model, inputs, loss = build(name)
    amp = ampfx.convert(model, dtype, example_inputs=inputs, gemm_min_flops=0)

    def ours():
        loss(amp(*inputs)).backward()

    def autocast():
        with torch.autocast("cpu", dtype):
            value = loss(model(*inputs))
        value.backward()

    return ampfx.count_casts(ours), ampfx.count_casts(autocast)


def table() -> str:
    lines = ["| model (tests/support/models.py)                 | dtype | ampfx | autocast |",
             "|-----------------------------------------|-------|------:|---------:|"]
    for name, label, dtype in ROWS:
        ours, theirs = counts(name, dtype)
        short = "bf16" if dtype == torch.bfloat16 else "fp16"
        lines.append(f"| {label:<40}| {short:<5} | {ours:<5} | {theirs:<8} |")
    return "\n".join(lines)


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(table())
