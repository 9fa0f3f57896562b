"""PyTorch Lightning through ampfx: the same LightningModule trained with Lightning's own
``precision="bf16-mixed"`` (autocast) and with ``plugins=[AmpfxPrecision("bf16")]``, side by side.

Prints the ampfx report summary, both loss curves (and float32's), and what one training step costs in each
mode: dtype-changing copies (casts) and the bytes they write, and the bytes every op writes, counted at the
ATen level (:mod:`ampfx.tools.measure`) on the same batch, loss computed the same way (``training_step``).

    pip install 'ampfx[lightning]'
    python examples/train_lightning.py [--epochs 3] [--dtype bf16|fp16] [--threads 1]

Runs on a CPU in well under a minute. Data are synthetic (made here); nothing is downloaded.
"""
from __future__ import annotations

import argparse
import logging
import tempfile
import time

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from ampfx.integrations.lightning import AmpfxPrecision
from ampfx.tools.measure import measure_step

VOCAB, LENGTH, CLASSES = 64, 16, 4


class SequenceClassifier(L.LightningModule):
    """A small transformer encoder over token ids, mean-pooled, then a linear head."""

    def __init__(self, width: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(torch.randn(LENGTH, width) * 0.02)
        block = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, CLASSES)
        self.losses: list[float] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(ids) + self.pos)
        return self.head(self.norm(h.mean(1)))

    def training_step(self, batch: tuple, i: int) -> torch.Tensor:
        ids, labels = batch
        loss = F.cross_entropy(self(ids), labels)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def data(n: int = 512) -> TensorDataset:
    """Token sequences; the class is which of four marker tokens occurs most often."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, VOCAB, (n, LENGTH), generator=g)
    marks = torch.randint(0, 4, (n, LENGTH), generator=g)
    ids = torch.where(torch.rand(n, LENGTH, generator=g) < 0.3, marks, ids)
    labels = F.one_hot(ids.clamp(max=4), 5)[..., :4].sum(1).argmax(1)
    return TensorDataset(ids, labels)


def fit(epochs: int, root: str, **trainer_kwargs) -> tuple[SequenceClassifier, L.Trainer, float]:
    torch.manual_seed(0)
    model = SequenceClassifier()
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", default_root_dir=root, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         **trainer_kwargs)
    t0 = time.perf_counter()
    trainer.fit(model, DataLoader(data(), batch_size=64, shuffle=False))
    return model, trainer, time.perf_counter() - t0


def step_cost(model: SequenceClassifier, trainer: L.Trainer, batch: tuple) -> tuple[int, int, int]:
    """(casts, cast bytes, bytes written) of one forward + loss + backward, in the trainer's forward context."""
    def step() -> None:
        with trainer.precision_plugin.forward_context():
            loss = model.training_step(batch, 0)
        loss.backward()
    c = measure_step(step)
    model.zero_grad(set_to_none=True)
    model.losses.pop()  # the measured step is not part of the curve
    return c.count, c.bytes, c.written


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads (default 1: the models are tiny, and more threads than idle cores slow "
                        "them down many times over)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    own_flag = "bf16-mixed" if args.dtype == "bf16" else "16-mixed"
    with tempfile.TemporaryDirectory() as root:
        fp32, _, t32 = fit(args.epochs, root)
        own, own_trainer, t_own = fit(args.epochs, root, precision=own_flag)
        amp, amp_trainer, t_amp = fit(args.epochs, root, plugins=[AmpfxPrecision(args.dtype)])
        report = amp_trainer.precision_plugin.report
        print(report.summary())
        print(f"decision log saved to {amp_trainer.precision_plugin.saved_to} (a temporary folder here)")
        batch = next(iter(DataLoader(data(), batch_size=64)))
        costs = {"own": step_cost(own, own_trainer, batch), "ampfx": step_cost(amp, amp_trainer, batch)}
    n = len(fp32.losses)
    print(f"\nloss every {n // 8} steps ({args.epochs} epochs, {n} steps, batch 64):")
    print(f"  {'step':>5} {'float32':>9} {own_flag:>11} {'ampfx ' + args.dtype:>11}")
    for i in list(range(0, n, n // 8)) + [n - 1]:
        print(f"  {i:5d} {fp32.losses[i]:9.4f} {own.losses[i]:11.4f} {amp.losses[i]:11.4f}")
    print(f"  wall time {t32:8.1f}s {t_own:10.1f}s {t_amp:10.1f}s (ampfx's includes conversion)")
    print(f"\none training step (forward, loss, backward), batch 64:")
    print(f"  {'':22} {'casts':>6} {'cast bytes':>11} {'bytes written':>14}")
    for name, (count, cast_bytes, written) in (("Lightning " + own_flag, costs["own"]),
                                               ("ampfx " + args.dtype, costs["ampfx"])):
        print(f"  {name:22} {count:6d} {cast_bytes:11,d} {written:14,d}")
    return {"losses": (fp32.losses, own.losses, amp.losses), "costs": costs, "report": report}


if __name__ == "__main__":
    main()
