"""ampfx as the torch.compile backend against autocast + compile and convert + compile (not a test).

For each model, a training step (forward, the loss in float32 inside autocast's region as users write it, backward,
SGD) three ways, each compiled by torch.compile: ``torch.autocast`` around the compiled model, ``ampfx.convert`` then
compile, and ``torch.compile(model, backend=ampfx.backend(...))``. It prints the casts per step (ATen ``_to_copy``
calls, forward and backward, counted with the ``aot_eager`` inner backend, which runs each ATen op as it is) and the
median step time with inductor (interleaved step by step, one CPU thread, after warm-up; compiling takes most of the
run). The built-in models each break dynamo's graph on a value (as Hugging Face's T5 clamps large activations);
``--models`` adds models of benchmarks/step_time.py (needs the models lane's environment).

    .venv/bin/python benchmarks/backend.py [--reps 21] [--models tv_resnet18,hf_bert_seqcls] [--no-time]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import ampfx  # noqa: E402
import step_time  # noqa: E402


class Block(nn.Module):
    """A two-layer transformer classifier branching on its activations' size after each layer (graph breaks; called
    one by one: dynamo skips a whole frame that breaks inside a loop)."""

    def __init__(self, d=128, heads=4, layers=2, vocab=1000):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(layers))
        self.head = nn.Linear(d, 10)

    def forward(self, ids):
        x = clamped(self.layers[0](self.emb(ids)))
        x = clamped(self.layers[1](x))
        return self.head(x.mean(1))


class Cnn(nn.Module):
    """A CNN with batch norm whose stages branch on their activations' sum (graph breaks)."""

    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList(nn.Sequential(nn.Conv2d(c, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU())
                                    for c, o in ((3, 32), (32, 64), (64, 64)))
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        x = halved(self.stages[0](x))
        x = halved(self.stages[1](x))
        x = halved(self.stages[2](x))
        return self.fc(x.mean((2, 3)))


def clamped(x):
    if x.abs().max() > 1e4:
        x = x.clamp(-1e4, 1e4)
    return x


def halved(x):
    if x.sum() > 1e9:
        x = x / 2
    return x


def built_in(name):
    if name == "transformer":
        return Block(), (torch.randint(0, 1000, (8, 64)),), "classes"
    return Cnn(), (torch.randn(8, 3, 32, 32),), "classes"


def build(name):
    if name in ("transformer", "cnn"):
        return built_in(name)
    return step_time.build(name)


def loss_of(out, spec):
    if spec == "classes":
        return F.cross_entropy(out.float(), torch.zeros(out.shape[0], dtype=torch.long))
    return step_time.loss_of(out, spec)


def steps(base, inp, spec, inner):
    """The three compiled training steps of one model, each on its own copy."""
    runs = {}
    for tool in ("autocast", "convert", "backend"):
        torch._dynamo.reset() if inner == "aot_eager" else None
        model = copy.deepcopy(base)
        if tool == "autocast":
            run = torch.compile(model, backend=inner)
        elif tool == "convert":
            run = torch.compile(ampfx.convert(model, "bf16", example_inputs=inp), backend=inner)
        else:
            run = torch.compile(model, backend=ampfx.backend("bf16", inner=inner))
        runs[tool] = step_time.training_step(run, model, inp, spec, torch.bfloat16 if tool == "autocast" else None,
                                             loss_of)
    return runs


def casts(name):
    base, inp, spec = build(name)
    out = {}
    for tool, step in steps(base, inp, spec, "aot_eager").items():
        step(), step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        out[tool] = sum(1 for e in prof.events() if e.name == "aten::_to_copy")
    return out


def times(name, reps):
    torch._dynamo.reset()
    base, inp, spec = build(name)
    runs = steps(base, inp, spec, "inductor")
    for step in runs.values():
        step(), step(), step()
    got = {tool: [] for tool in runs}
    for k in range(reps):
        for tool in step_time.interleaved(list(runs), k):  # each tool after each other about as often
            t0 = time.perf_counter()
            runs[tool]()
            got[tool].append(time.perf_counter() - t0)
    return {tool: statistics.median(ts) * 1e3 for tool, ts in got.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="")
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--no-time", action="store_true", help="casts only (no inductor)")
    a = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    names = ["transformer", "cnn"] + [m for m in a.models.split(",") if m]
    print(f"torch {torch.__version__}, one CPU thread, bfloat16")
    print(f"{'model':<22} {'casts: autocast':>15} {'convert':>8} {'backend':>8}"
          + ("" if a.no_time else f" {'ms: autocast':>13} {'convert':>8} {'backend':>8} {'backend/autocast':>17}"))
    for name in names:
        c = casts(name)
        line = f"{name:<22} {c['autocast']:>15} {c['convert']:>8} {c['backend']:>8}"
        if not a.no_time:
            t = times(name, a.reps)
            line += (f" {t['autocast']:>13.2f} {t['convert']:>8.2f} {t['backend']:>8.2f}"
                     f" {t['backend'] / t['autocast']:>16.2f}x")
        print(line, flush=True)


if __name__ == "__main__":
    main()
