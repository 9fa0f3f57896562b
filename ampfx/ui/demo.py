"""The built-in example behind ``ampfx demo``: convert a small transformer
classifier, show the report, then train it in float32 and with ampfx side by
side on a synthetic task (no downloads), counting casts against autocast.
"""
from __future__ import annotations

import statistics
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..tools.measure import count_casts
from ..api import convert
from ..report.records import dtype_name


class DemoClassifier(nn.Module):
    """Tokens -> embedding + position -> 2 transformer layers -> mean-pool -> linear head."""

    def __init__(self, vocab: int = 16, d: int = 32, classes: int = 4, length: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, length, d) * 0.02)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True), num_layers=2,
            enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(ids) + self.pos)
        return self.head(self.norm(h).mean(dim=1))


def make_data(n: int, vocab: int = 16, length: int = 12, classes: int = 4, seed: int = 0):
    """Sequences whose class is the most frequent of the first ``classes`` tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, length), generator=g)
    counts = torch.stack([(ids == c).sum(1) for c in range(classes)], 1).float()
    labels = (counts + 0.01 * torch.arange(classes)).argmax(1)
    return ids, labels


def _cpu_grad_scaler():
    """``torch.amp.GradScaler("cpu")``, or ``None`` where torch has none for CPU (torch 2.2: no
    ``torch.amp.GradScaler`` and no CPU unscale kernel); the float16 run then trains unscaled."""
    cls = getattr(torch.amp, "GradScaler", None)
    return cls("cpu") if cls is not None else None


def _train(model: nn.Module, run: nn.Module, ids, labels, steps: int, scaler=None,
           progress: Callable[[int], None] | None = None, scale_log: dict | None = None) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss = torch.tensor(0.0)
    for step in range(steps):
        idx = torch.randint(0, len(ids), (64,), generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        loss = F.cross_entropy(run(ids[idx]), labels[idx])
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            if scale_log is not None:
                from .plots import record_loss_scale

                record_loss_scale(scaler, scale_log)
            else:
                scaler.update()
        else:
            loss.backward()
            opt.step()
        if progress is not None:
            progress(step)
    return loss.item()


def _accuracy(run: nn.Module, ids, labels) -> float:
    run.eval()
    with torch.no_grad():
        acc = (run(ids).argmax(1) == labels).float().mean().item()
    run.train()
    return acc


def _stays_fp32(rep, echo: Callable[[str], None]) -> None:
    """What stays float32, one group per rule: the nodes (by module) and the first one's reason."""
    groups: dict[str, list] = {}
    for r in rep.fp32():
        groups.setdefault(str(r.rule), []).append(r)
    echo(f"\nWhat stays float32, and why ({sum(map(len, groups.values()))} of {len(rep.compute)} nodes):")
    for rule, records in groups.items():
        names = ", ".join(r.module if r.module.rpartition(".")[2] == r.node else
                          f"{r.module}:{r.node}" if r.module else r.node for r in records)
        echo(textwrap.fill(f"{rule} ({len(records)}): {names}", 100, initial_indent="  ",
                           subsequent_indent="      "))
        echo(textwrap.fill(f"e.g. {records[0].node}: {records[0].reason}", 100, initial_indent="    ",
                           subsequent_indent="      "))


def _casts(fp32: nn.Module, amp: nn.Module, ids, labels, low: torch.dtype) -> tuple[int, int]:
    """Casts in one training step: ampfx's, and autocast's on the float32 model (loss inside the autocast region)."""
    ours = count_casts(lambda: F.cross_entropy(amp(ids), labels).backward())

    def autocast_step() -> None:
        with torch.autocast("cpu", low):
            value = F.cross_entropy(fp32(ids), labels)
        value.backward()

    return ours, count_casts(autocast_step)


def _step_ms(fp32: nn.Module, amp: nn.Module, ids, labels, low: torch.dtype, reps: int = 21) -> dict[str, float]:
    """Median milliseconds of a training step (forward, float32 loss, backward) of ampfx, autocast (the loss inside
    its region) and float32, the three interleaved step by step after two warm-up steps."""
    def autocast_step() -> None:
        with torch.autocast("cpu", low):
            value = F.cross_entropy(fp32(ids), labels)
        value.backward()

    steps = {"ampfx": lambda: F.cross_entropy(amp(ids), labels).backward(), "autocast": autocast_step,
             "float32": lambda: F.cross_entropy(fp32(ids), labels).backward()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for k in range(reps + 2):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            if k >= 2:
                times[name].append((time.perf_counter() - t0) * 1e3)
    fp32.zero_grad(set_to_none=True)
    amp.zero_grad(set_to_none=True)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _loss_scale(path: str | None, scale_log: dict | None, low: torch.dtype, echo: Callable[[str], None]) -> None:
    """Plot the GradScaler's scale to ``path``, or say why there is no plot."""
    if path and scale_log is not None:
        from .plots import loss_scale_plot as plot

        plot(**scale_log, path=path)
        echo(f"loss scale over {len(scale_log['scales'])} steps plotted to {path} ({len(scale_log['skipped'])} skipped)")
    elif path and low == torch.float16:
        echo(f"no loss-scale plot: torch {torch.__version__} has no GradScaler for CPU (torch >= 2.3 has)")
    elif path:
        echo("no loss-scale plot: bfloat16 trains without GradScaler (use --dtype fp16)")


def main(dtype: str = "bf16", steps: int = 200, echo: Callable[[str], None] = print,
         loss_scale_plot: str | None = None, out: str | None = "ampfx-demo", timings: bool = True) -> dict:
    """Run the demo; returns the figures it printed. The full decision log and the HTML page are saved
    in ``out`` (``None``: not saved). With float16 and ``loss_scale_plot`` (a PNG path), also plots the
    GradScaler's scale over steps. ``timings=False`` leaves out the conversion time (for a doctest)."""
    from rich.progress import Progress

    torch.manual_seed(0)
    ids, labels = make_data(2048)
    test_ids, test_labels = make_data(512, seed=1)
    fp32 = DemoClassifier()
    mixed = DemoClassifier()
    mixed.load_state_dict(fp32.state_dict())
    n_params = sum(p.numel() for p in fp32.parameters())
    echo(f"Task: label a sequence of 12 tokens (vocabulary 16) by which of tokens 0-3 it holds most often;\n"
         f"2048 synthetic training sequences, 512 test ones, no downloads. Model: embedding -> 2 transformer\n"
         f"encoder layers -> layer norm -> mean -> linear ({n_params:,} parameters), trained {steps} steps\n"
         f"in float32 and, from the same weights, converted by ampfx with gemm_min_flops=0: every GEMM of this\n"
         f"tiny model is under a CPU's break-even, where ampfx would keep it float32 (bfloat16 is slower there).\n")
    t0 = time.perf_counter()
    amp = convert(mixed, dtype, example_inputs=(ids[:64],), gemm_min_flops=0)
    seconds = time.perf_counter() - t0
    rep = amp.ampfx_report
    echo(rep.summary())
    if timings:
        echo(f"(converted in {seconds:.2f} s)")
    _stays_fp32(rep, echo)
    if out is not None:
        saved = rep.save(out)
        echo(f"\nFull log in {saved}/: decisions.jsonl (every node's dtype, rule and reason), casts.jsonl,\n"
             f"report.html (the graph coloured by dtype; open it in a browser), summary.txt.")
    low = rep.dtype
    ours, theirs = _casts(fp32, amp, ids[:64], labels[:64], low)
    fp32.zero_grad()
    mixed.zero_grad()
    scaler = _cpu_grad_scaler() if low == torch.float16 else None
    scale_log = {"scales": [], "skipped": []} if scaler is not None and loss_scale_plot else None
    results = {}
    with Progress(transient=True, disable=not sys.stdout.isatty()) as bar:
        task = bar.add_task("training", total=2 * steps)
        advance = lambda _: bar.advance(task)  # noqa: E731
        results["float32"] = (_train(fp32, fp32, ids, labels, steps, progress=advance),
                              _accuracy(fp32, test_ids, test_labels))
        results[f"ampfx {dtype_name(low)}"] = (_train(mixed, amp, ids, labels, steps, scaler, progress=advance,
                                                   scale_log=scale_log),
                                            _accuracy(amp, test_ids, test_labels))
    echo(f"\n{'run':<16}{'final loss':>12}{'test acc':>10}")
    for name, (loss, acc) in results.items():
        echo(f"{name:<16}{loss:>12.3f}{acc:>10.2f}")
    echo(f"\ncasts per training step (forward + backward): ampfx {ours}, torch.autocast {theirs}")
    if timings:
        ms = _step_ms(fp32, amp, ids[:64], labels[:64], low)
        echo(f"ms per training step (median of 21, interleaved, this machine): ampfx {ms['ampfx']:.2f}, "
             f"torch.autocast {ms['autocast']:.2f}, float32 {ms['float32']:.2f}")
    echo(textwrap.fill(
        "A cast is a dtype-changing copy of a tensor: memory traffic on top of the arithmetic. Both keep this "
        f"model's residual stream and norms float32, so the counts are close; the {dtype_name(low)} run is worth "
        "having if its test accuracy matches float32's above, and the log says why each op got its dtype.", 100))
    _loss_scale(loss_scale_plot, scale_log, low, echo)
    return {"results": results, "casts": {"ampfx": ours, "autocast": theirs}, "convert_seconds": seconds}
