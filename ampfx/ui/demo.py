"""The built-in example behind ``ampfx demo``: convert a small transformer
classifier, show the report, then train it in float32 and with ampfx side by
side on a synthetic task (no downloads), counting casts against autocast.
"""
from __future__ import annotations

import statistics
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..tools.measure import count_casts
from ..api import convert
from ..ops import ENTRIES, Category, device_cost
from ..paths import check_writable
from ..report.records import Rule, dtype_name


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


def _times_in_words(ms: dict[str, float], low: torch.dtype) -> str:
    """What the measured step times (:func:`_step_ms`) say: ampfx's step against float32's and autocast's.

    >>> print(_times_in_words({"ampfx": 213.0, "autocast": 239.0, "float32": 57.0}, torch.bfloat16))
    On this machine the ampfx bfloat16 step took 3.7x float32's time: slower than float32 at this model's
    sizes. Against torch.autocast in bfloat16 it took 0.89x the time: faster.
    """
    def compared(ratio: float, slower: str, faster: str) -> str:
        shown = f"{ratio:.1f}x" if ratio >= 1.95 else f"{ratio:.2f}x"
        if ratio > 1.1:
            return f"{shown} {slower}"
        return f"{shown} {faster}" if ratio < 0.9 else f"{shown} {slower.split(':')[0]}: about the same"

    name = dtype_name(low)
    vs32 = compared(ms["ampfx"] / ms["float32"], "float32's time: slower than float32 at this model's sizes",
                    "float32's time: faster than float32")
    vsac = compared(ms["ampfx"] / ms["autocast"], "the time: slower", "the time: faster")
    return f"On this machine the ampfx {name} step took {vs32}. Against torch.autocast in {name} it took {vsac}."


def _default_plan(model: nn.Module, example: torch.Tensor, low: torch.dtype) -> str:
    """What ampfx's default plan (no ``gemm_min_flops``, no ``AMPFX_*`` variables) does with this demo's GEMMs on this
    machine's CPU, from the device's break-even (:func:`ampfx.ops.device_cost.limits`: measured, cached or the
    datasheet) and, where it depends on their sizes, from converting ``model`` with the defaults."""
    name = dtype_name(low)
    be, where = device_cost.limits(None, None, "cpu", None, low)
    source = where["flops"]
    if be.never:
        return (f"On this CPU {name} GEMMs are slower than float32 at every size measured ({source}): ampfx's "
                f"default plan keeps every GEMM float32 here (rule {Rule.COST_LOW_SLOWER.value}), the faster plan; "
                "the demo lowers them (gemm_min_flops=0) to show the mechanics. `ampfx device` prints the table.")
    if not be.flops and not be.rows:
        return (f"On this CPU ampfx takes {name} GEMMs to pay at every size ({source}): its default plan runs "
                f"every GEMM in {name}, as the demo does.")
    with warnings.catch_warnings():  # the plan's own warning says what the sentence below says
        warnings.filterwarnings("ignore", message="no GEMM runs in")
        plan = convert(model, low, example_inputs=(example,), environ={}).ampfx_report
    gemms = [r for r in plan.compute if r.op in ENTRIES and ENTRIES[r.op].category is Category.ALLOW]
    small = [r for r in gemms if r.rule is Rule.COST_SMALL_GEMM]
    rows = f" whose weight is used for at least {be.rows:,} rows" if be.rows else ""
    pays = f"On this CPU {name} GEMMs pay from {be.flops:,} FLOPs a call{rows} ({source})"
    if not small:
        return f"{pays}: this demo's GEMMs are over it, so ampfx's default plan runs them in {name} too, as here."
    if len(small) == len(gemms):
        kept = (f"this demo's GEMMs are all under it, so ampfx's default plan keeps its {len(gemms)} GEMM nodes "
                f"float32 (rule {Rule.COST_SMALL_GEMM.value})")
    else:
        kept = (f"{len(small)} of this demo's {len(gemms)} GEMM nodes are under it: ampfx's default plan keeps "
                f"those float32 (rule {Rule.COST_SMALL_GEMM.value}) and runs the others in {name}")
    return (f"{pays}: {kept}; the demo lowers every GEMM (gemm_min_flops=0) to show the mechanics. Larger GEMMs "
            "(a wider model, a larger batch) get the low dtype where it pays.")


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


def _closing(fp32: nn.Module, amp: nn.Module, batch: tuple, casts: tuple[int, int], timings: bool,
             echo: Callable[[str], None]) -> None:
    """The demo's closing lines: the casts of a step against autocast's; with ``timings``, the step times and what
    they mean on this machine, and what ampfx's default plan does with the demo's GEMMs here; what it all means."""
    low = amp.ampfx_report.dtype
    echo(f"\ncasts per training step (forward + backward): ampfx {casts[0]}, torch.autocast {casts[1]}")
    if timings:
        ms = _step_ms(fp32, amp, *batch, low)
        echo(f"ms per training step (median of 21, interleaved, this machine): ampfx {ms['ampfx']:.2f}, "
             f"torch.autocast {ms['autocast']:.2f}, float32 {ms['float32']:.2f}")
    echo(textwrap.fill(
        "A cast is a dtype-changing copy of a tensor: memory traffic on top of the arithmetic. Both keep this "
        f"model's residual stream and norms float32, so the counts are close; the {dtype_name(low)} run trains as "
        "well as float32 if its test accuracy matches float32's above, and the log says why each op got its dtype. "
        "Whether it is also faster depends on the machine and on the GEMMs' sizes"
        + (" (below)." if timings else ": `ampfx demo` times a step of each run and says what ampfx's default plan "
           "does on your machine."), 100))
    if timings:
        plan = _default_plan(DemoClassifier(), batch[0], low)
        echo("\n" + textwrap.fill(f"{_times_in_words(ms, low)} {plan}", 100))


def main(dtype: str = "bf16", steps: int = 200, echo: Callable[[str], None] = print,
         loss_scale_plot: str | None = None, out: str | None = "ampfx-demo", timings: bool = True) -> dict:
    """Run the demo; returns the figures it printed. The full decision log and the HTML page are saved
    in ``out`` (``None``: not saved). With float16 and ``loss_scale_plot`` (a PNG path), also plots the
    GradScaler's scale over steps. ``timings=False`` leaves out what depends on the machine (for a doctest): the
    conversion time, the step times and what ampfx's default plan does on this CPU. Both paths are checked before
    any work (:func:`ampfx.paths.check_writable`)."""
    from rich.progress import Progress

    if out is not None:
        check_writable(out, f"out={str(out)!r}", directory=True)
    if loss_scale_plot:
        check_writable(loss_scale_plot, f"loss_scale_plot={str(loss_scale_plot)!r}")

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
         f"in float32 and, from the same weights, converted by ampfx with gemm_min_flops=0, which lowers every\n"
         f"GEMM whatever its size: by default ampfx keeps a GEMM float32 where it is too small to pay on the\n"
         f"device, as this tiny model's are on most CPUs (the end says what the default does on this machine).\n")
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
    _closing(fp32, amp, (ids[:64], labels[:64]), (ours, theirs), timings, echo)
    _loss_scale(loss_scale_plot, scale_log, low, echo)
    return {"results": results, "casts": {"ampfx": ours, "autocast": theirs}, "convert_seconds": seconds}
