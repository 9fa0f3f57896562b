"""What a cast costs beyond its bytes (not a test): the figure behind ``passes.paint.LAUNCH_BYTES``.

Times ``x.to(low)`` on one thread for tensors of 1 element to 1 Mi elements (median of repeats). The launch is a
one-element cast's time; the bandwidth is the slope between 16 Ki and 64 Ki elements (values that stay in cache, as
the small ones this weighs do). It prints the launch as the bytes a cast moves in that time: the size below which
the launch costs more than the copy. Painting weighs a cluster of
clear ops (copies, concatenations) that needs fewer casts in float32 by this many bytes per cast saved.

    python benchmarks/cast_launch.py [--dtype bf16|fp16] [--device cpu|cuda]
"""
import argparse
import statistics
import time

import torch


def seconds(x: torch.Tensor, dtype: torch.dtype, reps: int) -> float:
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    for _ in range(20):
        x.to(dtype)
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        for _ in range(50):
            x.to(dtype)
        sync()
        times.append((time.perf_counter() - t0) / 50)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    rows = []
    for n in (1, 1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20):
        x = torch.randn(n, device=a.device)
        moved = n * (4 + dtype.itemsize)
        rows.append((moved, seconds(x, dtype, 21)))
        print(f"{n:>9,} elements  {moved:>10,} bytes moved  {rows[-1][1] * 1e6:8.2f} us")
    sizes = dict(rows)
    small, large = 16384 * (4 + dtype.itemsize), 65536 * (4 + dtype.itemsize)
    slope = (sizes[large] - sizes[small]) / (large - small)
    launch = sizes[1 * (4 + dtype.itemsize)]
    print(f"torch {torch.__version__}, {a.device}, one thread: launch {launch * 1e6:.2f} us, "
          f"{1 / slope / 1e9:.1f} GB/s moved: a launch costs what moving {launch / slope / 1024:,.0f} KiB costs")


if __name__ == "__main__":
    main()
