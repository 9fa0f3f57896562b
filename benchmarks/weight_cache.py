"""Casts and bytes written per optimizer step with gradient accumulation: ampfx (weight cache off, ``"auto"``, the
default, and on) against ``torch.autocast`` (not a test: prints figures for docs/benchmarks.md).

One optimizer step is ``k`` micro-batches (forward, float32 cross-entropy, backward), an SGD step and
``zero_grad(set_to_none=True)``, counted at the ATen level with :class:`ampfx.tools.measure.CastCounter`: the
dtype-changing copies (``_to_copy``, and each pair of the cache's ``_foreach_copy_``) and the bytes every op
writes. The second step is counted (the first fills the cache; the second pays the refresh after the first
step's update, as every later step does). The loss is computed the same way for every run: the output in
float32, cross-entropy inside autocast's region; every GEMM is low (``gemm_min_flops=0``, the plan autocast makes),
so that the casts compare. Models: a small GPT (4 pre-norm blocks, width 64 and 512, kept as blocks) and a CNN
with batch norm (4 conv / batch-norm / ReLU stages); each with ``k`` = 1 and 4 micro-batches,
with and without activation checkpointing of each block (``checkpoint_wrapper``, non-reentrant).
"Cache MB" is what the cache holds between steps (2 bytes per cached bf16 element).

``--time`` prints median CPU step times instead (one thread, the four runs interleaved, ``--reps`` steps
each; ampfx's default plan) of the transformer at widths 64 and 512: what the saved casts buy against the Python
autograd node the cache adds per weight and micro-batch.

    python benchmarks/weight_cache.py [--dtype bf16] [--ks 1,4] [--time [--widths 64,512] [--reps 15]]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (apply_activation_checkpointing,
                                                                         checkpoint_wrapper)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ampfx  # noqa: E402
from ampfx.runtime import weight_cache  # noqa: E402
from ampfx.tools.measure import CastCounter  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(att)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 128, d: int = 64, layers: int = 4, heads: int = 4, seq: int = 32) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Stage(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class CNN(nn.Module):
    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Stage(3, width), Stage(width, width), Stage(width, 2 * width),
                                     Stage(2 * width, 2 * width)])
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i % 2 == 1:
                x = F.max_pool2d(x, 2)
        return self.head(x.mean((2, 3)))


def models() -> dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    idx = torch.randint(0, 128, (4, 32))
    return {"transformer": (GPT(), idx, torch.roll(idx, -1, 1)),
            "transformer512": (GPT(d=512, heads=8), idx, torch.roll(idx, -1, 1)),
            "cnn+bn": (CNN(), torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,)))}


def step_of(model: nn.Module, run: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int,
            region: Callable[[], contextlib.AbstractContextManager]) -> Callable[[], None]:
    """One optimizer step: ``k`` micro-batches, an SGD step, gradients set to None."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        for _ in range(k):
            with region():
                out = run(x)
                loss = F.cross_entropy(out.float().flatten(0, -2), y.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def prepared(how: str, base: nn.Module, x: torch.Tensor, dtype: torch.dtype,
             **options: Any) -> tuple[nn.Module, nn.Module, Any]:
    """A fresh copy of ``base``, what runs it (itself under autocast; ampfx's conversion with ``options`` and each
    weight cache of :data:`CACHE`) and the region its loss is computed in."""
    model = copy.deepcopy(base)
    if how == "autocast":
        return model, model, lambda: torch.autocast("cpu", dtype)
    amp = ampfx.convert(model, dtype, example_inputs=(x,), weight_cache=CACHE[how], **options)
    return model, amp, contextlib.nullcontext


CACHE = {"ampfx, no cache": False, "ampfx, auto": "auto", "ampfx, cache": True}
"""The runs besides autocast: ampfx's conversion with each ``weight_cache`` (``"auto"`` is the default)."""


def rows(dtype: torch.dtype, ks: list[int]) -> None:
    for name, (base, x, y) in models().items():
        for ckpt in (False, True):
            for k in ks:
                counted = {}
                for how in ("autocast", *CACHE):
                    model, run, region = prepared(how, base, x, dtype, gemm_min_flops=0)
                    if ckpt:
                        blocks = set(run.blocks)
                        apply_activation_checkpointing(run, checkpoint_wrapper_fn=checkpoint_wrapper,
                                                       check_fn=lambda m, blocks=blocks: m in blocks)
                    step = step_of(model, run, x, y, k, region)
                    step()  # fills the cache; the counted step pays the refresh after this one's update
                    with CastCounter() as c:
                        step()
                    held = sum(cache.nbytes() for _, cache in weight_cache.caches(run)) if how != "autocast" else 0
                    counted[how] = (c.count, c.written, held)
                ac = counted["autocast"]
                for how, (casts, written, held) in counted.items():
                    print(f"{name:<13}{'yes' if ckpt else 'no':<7}{k:>3}  {how:<17}{casts:>7}{casts / ac[0]:>8.2f}"
                          f"{written / 2**20:>12.2f}{written / ac[1]:>8.2f}{held / 2**20:>10.3f}", flush=True)


def timings(dtype: torch.dtype, ks: list[int], widths: list[int], reps: int) -> None:
    """``--time``: median CPU step time (one thread, the runs interleaved) of the transformer at each width."""
    torch.set_num_threads(1)
    for d in widths:
        torch.manual_seed(0)
        base, idx = GPT(d=d, heads=8 if d >= 256 else 4), torch.randint(0, 128, (2, 32))
        y = torch.roll(idx, -1, 1)
        for k in ks:
            steps = {}
            for how in ("autocast", *CACHE):
                model, run, region = prepared(how, base, idx, dtype)
                steps[how] = step_of(model, run, idx, y, k, region)
                steps[how]()
            times: dict[str, list[float]] = {how: [] for how in steps}
            for _ in range(reps):
                for how, step in steps.items():
                    start = time.perf_counter()
                    step()
                    times[how].append(time.perf_counter() - start)
            ac = statistics.median(times["autocast"])
            for how, t in times.items():
                print(f"{'transformer d=' + str(d):<18}{k:>3}  {how:<17}{statistics.median(t) * 1e3:>10.1f}"
                      f"{statistics.median(t) / ac:>8.2f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--ks", default="1,4", help="micro-batches per optimizer step, comma-separated")
    ap.add_argument("--time", action="store_true", help="CPU step times of the transformer instead of counts")
    ap.add_argument("--widths", default="64,512", help="--time: transformer widths")
    ap.add_argument("--reps", type=int, default=15, help="--time: steps timed per run")
    args = ap.parse_args(argv)
    dtype = ampfx.policy.parse_dtype(args.dtype, where="--dtype")
    ks = [int(k) for k in args.ks.split(",")]
    print(f"weight cache: torch {torch.__version__}, python {platform.python_version()}, ampfx {ampfx.__version__}, "
          f"{platform.machine()} CPU, {str(dtype)[6:]}; per optimizer step (second step)")
    if args.time:
        print(f"\n{'model':<18}{'k':>3}  {'run':<17}{'step ms':>10}{'x ac':>8}")
        timings(dtype, ks, [int(w) for w in args.widths.split(",")], args.reps)
        return
    print(f"\n{'model':<13}{'ckpt':<7}{'k':>3}  {'run':<17}{'casts':>7}{'x ac':>8}{'written MB':>12}{'x ac':>8}"
          f"{'cache MB':>10}")
    rows(dtype, ks)


if __name__ == "__main__":
    main()
