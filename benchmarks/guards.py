"""Per-call cost of the call-time guards (not a test): figures, printed.

A small MLP (3 Linear layers, batch 32, CPU) is timed eager, converted with its guard, and
converted with the guard removed; the guard's cost is the difference of the last two, as a
share of the eager call. The same for an exported model (torch.export: a guard with
specialised sizes and ranges) and for a model taking a list of tensors (a structure check).
Each line also times the check that the converted module still follows its model
(:mod:`ampfx.follow`), run at every call too.
The target (issue #17) is a guard cost under 5% of the eager call.

    .venv/bin/python benchmarks/guards.py [--calls 3000] [--repeats 7]
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch.nn as nn

import ampfx
from ampfx.guards import ATTR


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


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def per_call(fn, args: tuple, calls: int, repeats: int) -> float:
    """Best-of-``repeats`` mean seconds per call."""
    with torch.no_grad():
        for _ in range(50):
            fn(*args)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                fn(*args)
            best = min(best, (time.perf_counter() - start) / calls)
    return best


def measure(name: str, model: nn.Module, args: tuple, tracer: str, calls: int, repeats: int) -> None:
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=args, tracer=tracer)
    guard = amp.__dict__.get(ATTR)
    eager = per_call(model, args, calls, repeats)
    guarded = per_call(amp, args, calls, repeats)
    amp.__dict__.pop(ATTR, None)
    bare = per_call(amp, args, calls, repeats)
    if guard is not None:
        amp.__dict__[ATTR] = guard
    check = per_call(lambda *a: guard(a, {}), args, calls, repeats) if guard is not None else 0.0
    follower = amp.__dict__.get("_ampfx_check")  # ampfx.follow: is the model still the one converted?
    follow = per_call(lambda *a: follower(amp), args, calls, repeats) if follower is not None else 0.0
    print(f"{name:<22} eager {eager * 1e6:7.1f} us | converted+guard {guarded * 1e6:7.1f} us | converted "
          f"{bare * 1e6:7.1f} us | guard alone {check * 1e6:5.2f} us = {check / eager:6.2%} of eager "
          f"(difference of the two converted timings: {(guarded - bare) / eager:+6.2%}) | follow check "
          f"{follow * 1e6:5.2f} us = {follow / eager:6.2%} of eager")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=7)
    opts = parser.parse_args()
    if opts.calls <= 0 or opts.repeats <= 0:
        parser.error("--calls and --repeats must be positive")
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x = torch.randn(32, 64)
    print(f"torch {torch.__version__}, CPU, 1 thread; target: guard < 5% of the eager call")
    measure("MLP, torch.fx", mlp(), (x,), "auto", opts.calls, opts.repeats)
    measure("MLP, torch.export", mlp(), (x,), "export", opts.calls, opts.repeats)
    measure("list of 3, export", ListMLP(), ([x, x, x],), "export", opts.calls, opts.repeats)


if __name__ == "__main__":
    main()
