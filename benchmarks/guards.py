"""Per-call cost of the converted module's checks (not a test): figures, printed.

Every call of a converted graph module checks, before its graph runs:

- the **input guard** (:mod:`ampfx.runtime.guards`): the call's inputs against what the module was converted for;
- the **structure check** (:mod:`ampfx.runtime.follow`): changes torch announced for the model's modules;
- the **fixed values** (:mod:`ampfx.runtime.fixed`): what its graph fixed of the model's Python (training flags,
  attributes, globals, hooks of the modules it traced through; dtype and device of the tensors it reads).

Each is timed alone (its own call, best of ``--repeats`` runs of ``--calls`` calls), and the whole
call of the converted module is timed with and without all of them, next to the model's own eager
float32 call. Models: a small MLP (3 Linear layers, batch 32; torch.fx and torch.export), a model
taking a list of 3 tensors (export: a structure check), and a stack of 12 transformer blocks (d=128,
4 heads, sequence 64, batch 8) captured as one graph. CPU, one thread. The aim: all checks together
at most 2% of the eager call.

    .venv/bin/python benchmarks/guards.py [--calls 2000] [--repeats 7]
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch.nn as nn

import ampfx


class ListMLP(nn.Module):
    """The MLP over the sum of a list of tensors (tracer='export' keeps the list's length)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = mlp()

    def forward(self, xs: list) -> torch.Tensor:
        total = xs[0]
        for x in xs[1:]:
            total = total + x
        return self.mlp(total)


class Block(nn.Module):
    """A pre-norm transformer block written out (attention and MLP), traced through as a whole."""

    def __init__(self, d: int = 128, heads: int = 4) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads, self.scale = heads, (d // heads) ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = ((q @ k.transpose(-2, -1)) * self.scale).softmax(-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def per_call(fn, args: tuple, calls: int, repeats: int) -> float:
    """Best-of-``repeats`` mean seconds per call."""
    with torch.no_grad():
        for _ in range(min(50, calls)):
            fn(*args)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                fn(*args)
            best = min(best, (time.perf_counter() - start) / calls)
    return best


CHECKS = {"input guard": "guard", "structure": "check", "fixed values": "fixed"}
"""The per-call checks, by the field of the converted module's runtime state that holds each."""


def measure(name: str, model: nn.Module, args: tuple, tracer: str, calls: int, repeats: int, **options) -> None:
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=args, tracer=tracer, **options)
    eager = per_call(model, args, calls, repeats)
    converted = per_call(amp, args, calls, repeats)
    rt = amp._rt
    alone = {}
    for label, key in CHECKS.items():
        check = getattr(rt, key)
        if check is None:
            alone[label] = 0.0
        elif key == "guard":
            alone[label] = per_call(lambda *a: check(a, {}), args, calls, repeats)
        elif key == "check":
            alone[label] = per_call(lambda *a: check(amp), args, calls, repeats)
        else:
            alone[label] = per_call(lambda *a: check.holds(), args, calls, repeats)
    saved = {key: getattr(rt, key) for key in CHECKS.values()}
    for key in saved:
        setattr(rt, key, None)
    bare = per_call(amp, args, calls, repeats)
    for key, value in saved.items():
        setattr(rt, key, value)
    total = sum(alone.values())
    parts = " | ".join(f"{label} {t * 1e6:5.2f} us" for label, t in alone.items())
    print(f"{name:<26} eager {eager * 1e6:8.1f} us | converted {converted * 1e6:8.1f} us (without the checks "
          f"{bare * 1e6:8.1f}) | {parts} | all checks {total * 1e6:5.2f} us = {total / eager:6.2%} of eager")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    opts = parser.parse_args()
    if opts.calls <= 0 or opts.repeats <= 0:
        parser.error("--calls and --repeats must be positive")
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x = torch.randn(32, 64)
    print(f"torch {torch.__version__}, CPU, 1 thread; aim: all checks together at most 2% of the eager call")
    measure("MLP, torch.fx", mlp(), (x,), "auto", opts.calls, opts.repeats)
    measure("MLP, torch.export", mlp(), (x,), "export", opts.calls, opts.repeats)
    measure("list of 3, export", ListMLP(), ([x, x, x],), "export", opts.calls, opts.repeats)
    stack = nn.Sequential(*[Block() for _ in range(12)])
    measure("12 blocks, one graph", stack, (torch.randn(8, 64, 128),), "auto", max(opts.calls // 20, 5),
            opts.repeats, keep_modules=())


if __name__ == "__main__":
    main()
