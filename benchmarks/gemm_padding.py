"""Benchmark (not a test): GEMM padding and conversion time. Prints figures measured in one run.

1. Odd-dimension linear layers, forward + backward, timed three ways in each low dtype:
   ampfx with pad="never", ampfx with pad="always", and torch.autocast. Ratios are
   against pad="never". On CPU the sizes are small (bf16/fp16 matmuls are slow there);
   with CUDA the sizes that matter (8192x602 -> 256, an LM head with vocabulary 50257).
2. Conversion time of a deep stack of small blocks (about 20,000 graph nodes) with
   example inputs.

    python benchmarks/gemm_padding.py [--device cuda] [--reps 20]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampfx


def timed(fn, reps: int, device: str) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def gemm_table(device: str, reps: int) -> None:
    shapes = ([(8192, 602, 256), (8192, 768, 50257), (4096, 1000, 1000)] if device == "cuda"
              else [(256, 602, 256), (64, 768, 2001), (128, 1000, 1000)])
    print(f"GEMM padding on {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}), "
          f"torch {torch.__version__}, median of {reps}")
    print(f"{'M x K -> N':<22}{'dtype':<10}{'never ms':>10}{'always ms':>11}{'autocast ms':>13}"
          f"{'always/never':>14}{'autocast/never':>16}")
    for m, k, n in shapes:
        for dtype in (torch.bfloat16, torch.float16):
            if device == "cpu" and dtype is torch.float16 and m * k * n > 2e8:
                continue
            lin = nn.Linear(k, n).to(device)
            x = torch.randn(m, k, device=device)
            runs = {}
            for mode in ("never", "always"):
                gm = ampfx.convert(lin, dtype, example_inputs=(x,), pad=mode)
                runs[mode] = lambda gm=gm: gm(x).float().pow(2).mean().backward()

            def autocast_step() -> None:
                with torch.autocast(device, dtype):
                    y = lin(x)
                y.float().pow(2).mean().backward()

            runs["autocast"] = autocast_step
            t = {name: timed(fn, reps, device) for name, fn in runs.items()}
            print(f"{f'{m}x{k} -> {n}':<22}{str(dtype)[6:]:<10}{t['never'] * 1e3:>10.2f}{t['always'] * 1e3:>11.2f}"
                  f"{t['autocast'] * 1e3:>13.2f}{t['always'] / t['never']:>14.2f}{t['autocast'] / t['never']:>16.2f}")


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x):
        return x + F.gelu(self.fc(self.norm(x))) * 0.5


def conversion_time(nodes_wanted: int = 20000) -> None:
    blocks = nodes_wanted // 9  # placeholder-free: about 9 graph nodes per block (get_attr, norm, linear, ...)
    model = nn.Sequential(*[Block(8) for _ in range(blocks)])
    x = torch.randn(2, 8)
    t0 = time.perf_counter()
    gm = ampfx.convert(model, torch.bfloat16, example_inputs=(x,))
    seconds = time.perf_counter() - t0
    traced = len(gm.ampfx_report.records)
    print(f"\nconversion of {blocks} blocks: {traced} traced nodes ({len(gm.graph.nodes)} after rewriting), "
          f"{seconds:.1f} s with example inputs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--nodes", type=int, default=20000)
    args = ap.parse_args()
    gemm_table(args.device, args.reps)
    conversion_time(args.nodes)


if __name__ == "__main__":
    main()
