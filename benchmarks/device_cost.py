"""The device cost model's measurement on this machine (not a test): what ``ampfx.convert`` measures the first time
it needs the break-even of a low dtype here (``ampfx.ops.device_cost``), how long that takes, and the plan it
gives. Nothing is read from or written to the cache.

    python benchmarks/device_cost.py [--dtype bf16,fp16] [--device cpu] [--threads N] [--repeat 2]

Prints, per dtype and repeat, the measured table (one training step of a linear layer, then of a 3x3 convolution,
float32 against the low dtype, over the ladders of sizes, alone and, for the sizes that do not pay alone, between
low neighbours), the seconds the measurement took against its budget, and the break-evens; with ``--repeat 2`` or
more, whether the repeats agree on them (the margin is meant to keep noise from flipping them).
"""
from __future__ import annotations

import argparse
import platform
import time

import torch

from ampfx.ops import device_cost
from ampfx.policy import names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16,fp16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: as set)")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{platform.machine()} {device_cost.device_name(args.device)}; torch {torch.__version__}, "
          f"budget {device_cost.BUDGET_S.get(torch.device(args.device).type, 3.0)} s")
    for spec in args.dtype.split(","):
        dtype = names.parse_dtype(spec.strip())
        seen = []
        for i in range(args.repeat):
            t0 = time.perf_counter()
            table = device_cost.measure(args.device, dtype)
            wall = time.perf_counter() - t0
            print(f"\n-- {spec} repeat {i + 1}: {wall:.2f} s wall"
                  + ("" if table.conclusive else " (inconclusive: the datasheet would be used)"))
            print("\n".join(table.lines()))
            seen.append(tuple(table.break_even(conv, among) for conv in (False, True) for among in (False, True)))
        if len(seen) > 1:
            for i, what in enumerate(("linear", "linear between low neighbours", "convolutions",
                                      "convolutions between low neighbours")):
                got = sorted({s[i] for s in seen})
                print(f"{spec}: {what}: break-even {'the same' if len(got) == 1 else 'differs'} over {len(seen)} "
                      f"repeats: {[(b.flops, b.rows) if not b.never else 'never' for b in got]}")


if __name__ == "__main__":
    main()
