"""Train two small models on scikit-learn's digits three ways: FP32, ampfx bf16, ampfx fp16.

The models are tiny: each conversion passes ``gemm_min_flops=0``, which lowers every GEMM (on a CPU ampfx
would keep GEMMs this small float32, where bfloat16 is slower: docs/concepts.md#small-gemms).

What it shows:

* ``ampfx.convert(model, dtype, example_inputs=(xb,))`` returns a
  mixed-precision module that shares ``model``'s float32 parameters, so the
  optimizer is built on ``model.parameters()`` exactly as for FP32 training;
* the loss (``F.cross_entropy``) is computed outside the model, on the
  float32 logits the converted module returns;
* fp16 training uses ``torch.amp.GradScaler("cpu")``; bf16 needs no scaler;
* both mixed-precision runs reach the FP32 run's test accuracy (within one
  percentage point) from the same initial weights and batch order;
* the casts a training step makes (``ampfx.count_casts`` on one forward and
  backward), next to what ``torch.autocast("cpu", dtype)`` makes for the
  same FP32 model, and ampfx's one-line summary of its decisions.

The data is ``sklearn.datasets.load_digits()`` (1797 8x8 images, bundled with
scikit-learn, no download): 1347 images to train on, 450 to test. The models
are a small CNN with BatchNorm and a two-layer transformer encoder that reads
each image row as a token.

Run it (about 40 seconds on two CPU cores; ``--quick`` for a smoke run of 10-20 seconds)::

    python examples/train_digits.py
    python examples/train_digits.py --quick

``run(quick=False)`` returns the numbers as a dict, for tests.
"""
from __future__ import annotations

import argparse
import copy
import time
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import ampfx

SEED = 0
BATCH = 64
LR = 3e-3
EPOCHS = {"cnn": 6, "transformer": 40}
QUICK_EPOCHS = {"cnn": 2, "transformer": 8}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MAX_GAP_PP = 1.0  # ampfx runs must be within this many percentage points of FP32 test accuracy
THREADS = 1  # the models are tiny: one thread is nearly as fast as two, and steady on a busy CPU


# ---------------------------------------------------------------------------- data
def load_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits as (N, 1, 8, 8) float32 images in [0, 1] and int64 labels: train and test."""
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.images, digits.target, test_size=0.25, random_state=0)
    as_images = lambda a: torch.tensor(a, dtype=torch.float32).unsqueeze(1) / 16.0  # noqa: E731
    as_labels = lambda a: torch.tensor(a, dtype=torch.int64)  # noqa: E731
    return as_images(x_train), as_labels(y_train), as_images(x_test), as_labels(y_test)


def batches(x: torch.Tensor, y: torch.Tensor, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Shuffled full batches of ``BATCH``; the order depends only on ``epoch``,
    so every training mode sees the same batches."""
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SEED + epoch))
    for start in range(0, len(x) - BATCH + 1, BATCH):
        idx = order[start:start + BATCH]
        yield x[idx], y[idx]


# ---------------------------------------------------------------------------- models
class DigitsCNN(nn.Module):
    """Two 3x3 convolutions with BatchNorm, a 2x2 max-pool and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


class DigitsTransformer(nn.Module):
    """Each of the 8 image rows is a token of 8 features: embed, add a learned
    position, two encoder layers, mean-pool, linear head."""

    def __init__(self, d_model: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d_model)
        self.pos = nn.Parameter(torch.zeros(1, 8, d_model))
        layer = nn.TransformerEncoderLayer(d_model, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x.flatten(1, 2)) + self.pos  # (N, 1, 8, 8) -> (N, 8 rows, d_model)
        return self.head(self.encoder(tokens).mean(1))


MODELS: dict[str, Callable[[], nn.Module]] = {"cnn": DigitsCNN, "transformer": DigitsTransformer}


# ---------------------------------------------------------------------------- training
def train(net: nn.Module, params, data, epochs: int, scaler: torch.amp.GradScaler | None = None) -> float:
    """Adam on ``params`` through ``net``'s forward, learning rate decayed to
    zero on a cosine; returns the last epoch's mean loss."""
    x_train, y_train = data
    opt = torch.optim.Adam(params, lr=LR)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * (len(x_train) // BATCH))
    net.train()
    for epoch in range(epochs):
        total, steps = 0.0, 0
        for xb, yb in batches(x_train, y_train, epoch):
            loss = F.cross_entropy(net(xb), yb)
            opt.zero_grad(set_to_none=True)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            sched.step()
            total, steps = total + loss.item(), steps + 1
    return total / steps


@torch.no_grad()
def accuracy(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy in percent, in eval mode."""
    net.eval()
    return (net(x).argmax(1) == y).float().mean().item() * 100


# ---------------------------------------------------------------------------- casts
def step_casts(net: nn.Module, xb: torch.Tensor, yb: torch.Tensor, autocast: torch.dtype | None = None) -> int:
    """Dtype-changing copies in one forward + backward (under autocast if given, with the
    loss inside the autocast region as PyTorch's recipe writes it)."""
    def step() -> None:
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = F.cross_entropy(net(xb), yb)
        loss.backward()

    net.train()
    return ampfx.count_casts(step)


def cast_counts(init: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> dict[str, dict[str, int]]:
    """Casts per step for each mode, measured on throwaway copies of ``init``
    (a step updates BatchNorm statistics and gradients)."""
    counts = {"fp32": {"ampfx": step_casts(copy.deepcopy(init), xb, yb), "autocast": None}}
    for name, dtype in DTYPES.items():
        amp = ampfx.convert(copy.deepcopy(init), dtype, example_inputs=(xb,), gemm_min_flops=0)
        counts[name] = {"ampfx": step_casts(amp, xb, yb),
                        "autocast": step_casts(copy.deepcopy(init), xb, yb, autocast=dtype)}
    return counts


# ---------------------------------------------------------------------------- one model, three ways
def run_mode(init: nn.Module, mode: str, data, epochs: int) -> dict:
    """Train a copy of ``init`` in ``mode`` ("fp32", "bf16" or "fp16") and test it."""
    x_train, y_train, x_test, y_test = data
    model = copy.deepcopy(init)
    start = time.perf_counter()
    if mode == "fp32":
        net, scaler, summary = model, None, None
    else:
        net = ampfx.convert(model, DTYPES[mode], example_inputs=(x_train[:BATCH],), gemm_min_flops=0)
        scaler = torch.amp.GradScaler("cpu") if mode == "fp16" else None
        summary = net.ampfx_report.summary()
    loss = train(net, model.parameters(), (x_train, y_train), epochs, scaler)
    acc = accuracy(net, x_test, y_test)
    return {"loss": loss, "acc": acc, "epochs": epochs, "seconds": time.perf_counter() - start,
            "summary": summary}


def run_model(name: str, data, epochs: int) -> dict:
    """FP32, ampfx bf16 and ampfx fp16 training of one model from the same initial weights."""
    torch.manual_seed(SEED)
    init = MODELS[name]()
    x_train, y_train = data[0], data[1]
    counts = cast_counts(init, x_train[:BATCH], y_train[:BATCH])
    results = {}
    for mode in ("fp32", *DTYPES):
        results[mode] = run_mode(init, mode, data, epochs)
        results[mode]["casts"] = counts[mode]["ampfx"]
        results[mode]["autocast_casts"] = counts[mode]["autocast"]
    return results


def run(quick: bool = False) -> dict:
    """Train both models three ways; returns ``{model: {mode: {"loss", "acc", ...}}}``.

    Each mode's entry has ``loss`` (mean training loss of the last epoch),
    ``acc`` (test accuracy, percent), ``epochs``, ``casts`` (casts per training step;
    ampfx's for bf16/fp16, 0 for fp32), ``autocast_casts`` (the same step of
    the FP32 model under ``torch.autocast``; None for fp32), ``seconds`` and
    ``summary`` (``ampfx_report.summary()``; None for fp32). ``quick`` trains
    for fewer epochs (a smoke test: accuracies are lower and not compared).
    """
    data = load_data()
    epochs = QUICK_EPOCHS if quick else EPOCHS
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)  # results depend (slightly) on the thread count; restored below
    try:
        return {name: run_model(name, data, epochs[name]) for name in MODELS}
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------- printing
LABELS = {"fp32": "fp32 eager", "bf16": "ampfx bf16", "fp16": "ampfx fp16 + GradScaler"}


def format_table(name: str, res: dict) -> str:
    """The side-by-side table for one model."""
    head = (f"{'mode':<24} {'train loss':>10} {'test acc':>9} {'vs fp32':>8}  "
            f"{'casts/step':>10} {'autocast casts/step':>20} {'time':>7}")
    title = (f"{name}: {res['fp32']['epochs']} epochs, Adam lr {LR:g} (cosine), batch {BATCH}; "
             "train loss = mean over the last epoch; casts = per forward + backward")
    lines = [title, head, "-" * len(head)]
    base = res["fp32"]["acc"]
    for mode, label in LABELS.items():
        r = res[mode]
        gap = "" if mode == "fp32" else f"{r['acc'] - base:+.2f}"
        auto = "-" if r["autocast_casts"] is None else str(r["autocast_casts"])
        lines.append(f"{label:<24} {r['loss']:>10.4f} {r['acc']:>8.2f}% {gap:>8}  "
                     f"{r['casts']:>10} {auto:>20} {r['seconds']:>6.1f}s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer epochs: a smoke run")
    args = parser.parse_args()
    start = time.perf_counter()
    results = run(quick=args.quick)
    for name, res in results.items():
        print(f"\n=== {name} ===")
        for mode in DTYPES:
            print(res[mode]["summary"])
        print()
        print(format_table(name, res))
    gaps = [abs(res[m]["acc"] - res["fp32"]["acc"]) for res in results.values() for m in DTYPES]
    verdict = "ok" if max(gaps) <= MAX_GAP_PP else "OVER THE LIMIT"
    if args.quick:
        verdict += " (quick run: not expected to hold)"
    print(f"\nlargest |ampfx - fp32| test accuracy gap: {max(gaps):.2f} pp "
          f"(limit {MAX_GAP_PP:.0f} pp): {verdict}")
    print(f"total time: {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
