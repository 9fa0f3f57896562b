"""HuggingFace Trainer through ampfx: a small BERT sequence classifier (built from a config, random init)
fine-tuned with the Trainer's own ``bf16=True`` (autocast) and with ``AmpfxTrainer(..., ampfx="bf16")``.

Prints the ampfx report summary, both loss curves (and float32's), and what one training step costs in each
mode: dtype-changing copies (casts) and the bytes they write, and the bytes every op writes, counted at the
ATen level (:mod:`ampfx.tools.measure`) on the same batch, the loss computed by the model as the Trainer does
(``model(**batch).loss``, inside the Trainer's own autocast context for ``bf16=True``).

    pip install 'ampfx[hf]'
    HF_HUB_OFFLINE=1 python examples/train_hf_trainer.py [--steps 24]

Runs on a CPU in about a minute. Data are synthetic (made here); nothing is downloaded.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import (BertConfig, BertForSequenceClassification, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments)
from transformers.utils import logging as hf_logging  # noqa: E402

from ampfx.integrations.hf import AmpfxTrainer  # noqa: E402
from ampfx.tools.measure import measure_step  # noqa: E402

VOCAB, LENGTH = 128, 32


class Data(torch.utils.data.Dataset):
    """Token sequences labelled 1 where token 7 occurs before token 9 (synthetic)."""

    def __init__(self, n: int = 512) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(10, VOCAB, (n, LENGTH), generator=g)
        for i in range(n):
            a, b = torch.randperm(LENGTH, generator=g)[:2].tolist()
            self.ids[i, a], self.ids[i, b] = 7, 9
        self.labels = ((self.ids == 7).float().argmax(1) < (self.ids == 9).float().argmax(1)).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class Losses(TrainerCallback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def model() -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                    num_attention_heads=4, intermediate_size=128,
                                                    max_position_embeddings=LENGTH, num_labels=2))


def train(out: str, steps: int, cls: type = Trainer, **kwargs) -> tuple[Trainer, list[float], float]:
    flags = {k: kwargs.pop(k) for k in ("bf16",) if k in kwargs}
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=32, logging_steps=1,
                             learning_rate=1e-3, report_to=[], use_cpu=True, seed=0, save_strategy="no",
                             disable_tqdm=True, **flags)
    losses = Losses()
    trainer = cls(model=model(), args=args, train_dataset=Data(), callbacks=[losses], **kwargs)
    t0 = time.perf_counter()
    trainer.train()
    return trainer, losses.losses, time.perf_counter() - t0


def step_cost(trainer: Trainer, batch: dict) -> tuple[int, int, int]:
    """(casts, cast bytes, bytes written) of one forward + loss + backward, as the Trainer runs it."""
    net = trainer.model

    def step() -> None:
        with trainer.compute_loss_context_manager():
            loss = net(**batch).loss
        loss.backward()
    c = measure_step(step)
    net.zero_grad(set_to_none=True)
    return c.count, c.bytes, c.written


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads (default 1: the models are tiny, and more threads than idle cores slow "
                        "them down many times over)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    data = Data()
    batch = {"input_ids": data.ids[:32], "labels": data.labels[:32]}
    with tempfile.TemporaryDirectory() as out:
        _, fp32, t32 = train(os.path.join(out, "fp32"), args.steps)
        own_trainer, own, t_own = train(os.path.join(out, "own"), args.steps, bf16=True)
        own_cost = step_cost(own_trainer, batch)
        os.environ.pop("ACCELERATE_MIXED_PRECISION", None)  # TrainingArguments(bf16=True) exported it
        amp_trainer, amp, t_amp = train(os.path.join(out, "ampfx"), args.steps, cls=AmpfxTrainer, ampfx="bf16")
        amp_cost = step_cost(amp_trainer, batch)
        print(amp_trainer.ampfx_report.summary())
    n = len(fp32)
    print(f"\nloss ({n} steps, batch 32):")
    print(f"  {'step':>5} {'float32':>9} {'bf16=True':>10} {'ampfx bf16':>11}")
    for i in list(range(0, n, max(1, n // 8))) + [n - 1]:
        print(f"  {i + 1:5d} {fp32[i]:9.4f} {own[i]:10.4f} {amp[i]:11.4f}")
    print(f"  wall time {t32:8.1f}s {t_own:9.1f}s {t_amp:10.1f}s (ampfx's includes conversion)")
    print("\none training step (forward, loss, backward), batch 32:")
    print(f"  {'':22} {'casts':>6} {'cast bytes':>11} {'bytes written':>14}")
    for name, (count, cast_bytes, written) in (("Trainer bf16=True", own_cost), ("AmpfxTrainer bf16", amp_cost)):
        print(f"  {name:22} {count:6d} {cast_bytes:11,d} {written:14,d}")
    return {"losses": (fp32, own, amp), "costs": {"own": own_cost, "ampfx": amp_cost}}


if __name__ == "__main__":
    main()
