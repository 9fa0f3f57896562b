"""Conversion time against graph size (not a test): is the time per node flat?

Synthetic models of about 1k, 5k, 20k and 50k graph nodes (stacks of a pre-norm residual block:
LayerNorm, Linear, GELU, scale, add), converted with example inputs. For each size the script prints
the graph nodes, the seconds of ``ampfx.convert`` and the milliseconds per node, with the time spent in
each stage (capture, shapes, passes) from a profile of the same call when ``--stages`` is given.
The goal: at most 10 s at 20k nodes, and linear growth.

    python benchmarks/conversion_time.py [--nodes 1000,5000,20000,50000] [--stages]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ampfx  # noqa: E402
from gemm_padding import Block  # noqa: E402 - the same block as its ~20k-node conversion time

NODES_PER_BLOCK = 9
"""Graph nodes one :class:`Block` adds (get_attr x4, layer_norm, linear, gelu, mul, add)."""

STAGES = {
    "capture": ("ampfx/capture/ladder.py", "capture"),
    "verify": ("ampfx/capture/verify.py", "reproduces"),
    "shapes": ("passes/shapes.py", "propagate"),
    "passes": ("ampfx/rewrite.py", "run_passes"),
    "guards": ("ampfx/runtime/guards.py", "attach"),
}


def _model(nodes: int) -> tuple[nn.Module, torch.Tensor]:
    return nn.Sequential(*[Block(8) for _ in range(max(1, nodes // NODES_PER_BLOCK))]), torch.randn(2, 8)


def convert(nodes: int) -> tuple[int, float]:
    """Graph nodes and seconds of one conversion of a model of about ``nodes`` nodes."""
    model, x = _model(nodes)
    t0 = time.perf_counter()
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=(x,))
    return len(amp.ampfx_report.records), time.perf_counter() - t0


def stages(nodes: int) -> dict[str, float]:
    """Cumulative seconds of each stage of :data:`STAGES` in a profiled conversion."""
    model, x = _model(nodes)
    prof = cProfile.Profile()
    prof.enable()
    ampfx.convert(model, torch.bfloat16, example_inputs=(x,))
    prof.disable()
    found = dict.fromkeys(STAGES, 0.0)
    for (path, _, fn), (_, _, _, cum, _) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        for stage, (suffix, name) in STAGES.items():
            if fn == name and path.endswith(suffix):
                found[stage] = max(found[stage], cum)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="1000,5000,20000,50000")
    ap.add_argument("--stages", action="store_true", help="also profile each size and print seconds per stage")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ampfx.convert(..., example_inputs=...)")
    head = f"{'wanted':>8}{'nodes':>8}{'seconds':>9}{'ms/node':>9}"
    print(head + ("".join(f"{s:>9}" for s in STAGES) if args.stages else ""))
    for wanted in (int(n) for n in args.nodes.split(",")):
        nodes, seconds = convert(wanted)
        line = f"{wanted:>8}{nodes:>8}{seconds:>9.2f}{seconds / nodes * 1e3:>9.3f}"
        if args.stages:
            line += "".join(f"{v:>9.2f}" for v in stages(wanted).values())
        print(line, flush=True)


if __name__ == "__main__":
    main()
