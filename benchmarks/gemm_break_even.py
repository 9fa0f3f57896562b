"""Where a low-precision GEMM starts to pay on this machine (not a test): the figures behind ``gemm_min_flops``
and ``gemm_min_rows``.

First, for linear layers and convolutions of many sizes, one training step of the layer alone (forward and
backward, with the casts of its input and weight that the low dtype needs) in float32 and in the low dtype, one CPU
thread (or the GPU, ``--device cuda``), median of repeats: each size's forward FLOPs and the ratio low / float32,
then the smallest FLOP count from which every measured size at or above it runs faster low. Then, the rows: two
MLP blocks (layer norm, linear d -> 4d, GELU, linear 4d -> d, residual) run forward and backward through
``ampfx.convert`` with every GEMM low and with every GEMM float32, over widths and rows (the rows each weight is
used for in a call): where the weight's casts outweigh the arithmetic saved. Compare both with
``ampfx.ops.gemm_cost.BREAK_EVEN`` for this device type, and set ``AMPFX_GEMM_MIN_FLOPS`` /
``AMPFX_GEMM_MIN_ROWS`` if they differ.

    python benchmarks/gemm_break_even.py [--dtype bf16] [--device cpu]     # with ampfx installed
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
import torch.nn.functional as F


def _median_us(fn, device: str, reps: int = 5) -> float:
    """Median over ``reps`` of the time of one call of ``fn`` (calls batched to at least 50 ms), in us."""
    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    for _ in range(3):
        fn()
    sync()
    t0, n = time.perf_counter(), 0
    while n < 3 or time.perf_counter() - t0 < 0.05:
        fn()
        n += 1
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def _step(op, x, w, grad, low):
    """One forward and backward of ``op`` in float32, or with ``x`` and ``w`` cast to ``low``."""
    def run():
        if low is None:
            op(x, w).backward(grad)
        else:
            op(x.to(low), w.to(low)).backward(grad.to(low))
    return run


def cases(device: str):
    for m, k, n in itertools.product([2, 32, 128, 512, 2048], [64, 256, 768], [64, 256, 768]):
        x = torch.randn(m, k, device=device, requires_grad=True)
        w = torch.randn(n, k, device=device, requires_grad=True)
        yield f"linear {m}x{k} -> {n}", 2 * m * k * n, F.linear, x, w, torch.randn(m, n, device=device)
    for c, hw, groups in [(16, 56, 1), (64, 28, 1), (128, 28, 1), (256, 14, 1), (64, 56, 64), (256, 14, 256)]:
        x = torch.randn(2, c, hw, hw, device=device, requires_grad=True)
        w = torch.randn(c, c // groups, 3, 3, device=device, requires_grad=True)

        def conv(a, b, g=groups):
            return F.conv2d(a, b, padding=1, groups=g)
        yield (f"conv3x3 2x{c}x{hw}x{hw}" + (" depthwise" if groups > 1 else ""), 2 * 2 * hw * hw * c * (c // groups) * 9,
               conv, x, w, torch.randn(2, c, hw, hw, device=device))


def rows_table(low, device: str) -> None:
    """Two MLP blocks' training step, every GEMM low against every GEMM float32, by width and rows."""
    import torch.nn as nn

    import ampfx

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(self.norm(x))))

    print("two MLP blocks, forward and backward, every GEMM low against every GEMM float32:")
    for d, rows in [(768, 8), (768, 16), (768, 32), (768, 64), (256, 64), (512, 64), (1024, 32), (1024, 128)]:
        model = nn.Sequential(Block(d), Block(d)).to(device)
        x = torch.randn(rows, d, device=device)
        times = []
        for flops in (0, 10 ** 18):  # every GEMM low; every GEMM float32
            amp = ampfx.convert(model, low, example_inputs=(x,), gemm_min_flops=flops)

            def step(amp=amp):
                model.zero_grad(set_to_none=True)
                amp(x).pow(2).mean().backward()
            times.append(_median_us(step, device))
        print(f"  d={d:5d} rows={rows:5d} fc1 {2 * rows * d * 4 * d:>15,d} FLOPs  low/float32 {times[0] / times[1]:5.2f}x",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if args.device == "cpu":
        torch.set_num_threads(1)
    print(f"low-precision GEMM break-even, {args.dtype} on {args.device}, torch {torch.__version__}; "
          "one layer's forward and backward with its casts, median")
    rows = []
    for name, flops, op, x, w, grad in cases(args.device):
        f32 = _median_us(_step(op, x, w, grad, None), args.device)
        lo = _median_us(_step(op, x, w, grad, low), args.device)
        rows.append((flops, lo / f32, name))
        print(f"{name:32s} {flops:>15,d} FLOPs  float32 {f32:10.1f} us  {args.dtype} {lo:10.1f} us  "
              f"{args.dtype}/float32 {lo / f32:5.2f}x", flush=True)
    rows.sort()
    slower = [f for f, r, _ in rows if r >= 1.0]
    above = [f for f, r, _ in rows if not slower or f > max(slower)]
    point = min(above) if above else None
    print(f"smallest FLOP count from which every measured size runs faster in {args.dtype}: "
          + (f"{point:,}" if point is not None else "none (slower at every size measured)"))
    rows_table(low, args.device)


if __name__ == "__main__":
    main()
