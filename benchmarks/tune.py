"""How many metric evaluations ``ampfx.tools.tune`` spends as the graph grows (docs/tuning.md).

Deep MLPs of growing depth whose outputs carry one or two precision-critical accumulations,
``(head(h) + c) - c`` with a large ``c``: everything else is fine in bfloat16. For each size the
script prints the low-precision candidates, the nodes kept float32, the metric evaluations and
sensitivity runs tune spent, and the metric of the float32 model, the default plan and the tuned
plan. A search that tried nodes one by one would spend one evaluation per candidate.

    python benchmarks/tune.py [--depths 4,16,64] [--offsets 1|2]
"""
from __future__ import annotations

import argparse
import math
import time

import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import ampfx  # noqa: E402
from support.models import Offsets  # noqa: E402 - tests/support/models.py, the model tests/test_tune.py tunes


def row(depth: int, offsets: tuple[float, ...]) -> str:
    torch.manual_seed(0)
    model, x = Offsets(depth, offsets=offsets), torch.randn(32, 16)
    with torch.no_grad():
        want = model(x)

    def metric(m: nn.Module) -> float:
        with torch.no_grad():
            return -float((m(x) - want).pow(2).mean())

    t0 = time.perf_counter()
    t = ampfx.tune(model, "bf16", example_inputs=(x,), metric=metric, tolerance=1e-4, progress=False).ampfx_tune
    seconds = time.perf_counter() - t0
    return (f"{depth:>6} {t.candidates:>11} {len(t.kept):>5} {t.evaluations:>12} {math.ceil(math.log2(t.candidates)):>8}"
            f" {t.sensitivity_evaluations:>12} {t.metric_float32:>10.2e} {t.metric_default:>10.2e} {t.metric_tuned:>10.2e}"
            f" {seconds:>7.1f}  {', '.join(t.kept)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="4,16,64")
    ap.add_argument("--offsets", type=int, default=1, choices=(1, 2))
    args = ap.parse_args()
    offsets = (512.0, 1024.0)[:args.offsets]
    print(f"torch {torch.__version__}; bfloat16; tolerance 1e-4 on minus the output MSE; {args.offsets} critical node(s)")
    print(f"{'depth':>6} {'candidates':>11} {'kept':>5} {'evaluations':>12} {'log2(n)':>8} {'sens. runs':>12}"
          f" {'fp32':>10} {'default':>10} {'tuned':>10} {'seconds':>7}  kept nodes")
    for depth in (int(d) for d in args.depths.split(",")):
        print(row(depth, offsets), flush=True)


if __name__ == "__main__":
    main()
