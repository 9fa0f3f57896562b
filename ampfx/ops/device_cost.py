"""Does a low-precision GEMM pay on this device, at these sizes? Measured on the device, cached per device; for FP8,
the roofline of the device the plan is for.

Whether a GEMM runs faster in bfloat16 or float16 than in float32 is a fact of the device and of the sizes, not of
the op: on a CPU with avx512_bf16 or AMX a bfloat16 GEMM pays from some tens of millions of operations, on an
AVX2-only CPU (bfloat16 emulated) it is tens of times slower at every size, float16 is slow on most CPUs. So the
break-even behind ``Policy.gemm_min_flops`` / ``gemm_min_rows`` (:mod:`ampfx.ops.gemm_cost`) is **measured** the
first time a conversion needs it, as TensorRT's builder times layers and keeps a timing cache:

- :func:`measure` times one training step of a linear layer (forward and backward, with the casts of its input,
  weight, output and gradient that the low dtype needs between float32 neighbours, as a converted graph runs it)
  in float32 and in the low dtype, on a
  ladder of sizes (:data:`LADDER`: rows times width), interleaved, the least of a few repeats, within a time budget
  (:data:`BUDGET_S`, about 3 s on a CPU; a size whose step would not fit is skipped and said so); then, in the last
  quarter of the budget, 3x3 convolutions (:data:`CONV_LADDER`), whose kernels pay low from other sizes than a
  linear layer's; and, for the table, a cast and an elementwise op (their cost per element, float32 against the low
  dtype).
- :meth:`Table.break_even` fits the ``(flops, rows)`` that tells the measured sizes that run faster low from those
  that do not with the fewest mistakes (a rows criterion only where FLOPs alone do not; each threshold the size of
  a measured one that pays), with a margin (:data:`MARGIN`: a size counts as paying when it is at least 10% faster, as not paying when it is slower;
  those in between count either way), so that noise does not flip decisions; where no size pays, the low dtype
  **never pays** here (:attr:`BreakEven.never`): every GEMM stays float32, said as a warning and in the summary.
  Convolutions are fitted on their own sizes (``break_even(conv=True)``: the linear layers' where too few were
  measured).
- The table is cached on disk (:func:`cache_file`: ``$AMPFX_CACHE_DIR``, else ``$XDG_CACHE_HOME/ampfx``, else
  ``~/.cache/ampfx``, file ``device-cost.json``), one entry per device (its name, the CPU's bfloat16 / float16
  features, the threads torch uses), torch version and dtype: the same cached table gives the same plan, and a
  second conversion measures nothing. ``ampfx device`` prints it and measures again on request. A cache that
  cannot be read (corrupt, foreign) is measured again with a message; one that cannot be written is used from
  memory with a message.
- FP8 GEMMs are planned for a GPU that is not here (``fp8_roofline``): :class:`Roofline` is that device's cost model,
  from its datasheet (where an FP8 GEMM's time saved exceeds its operands' quantisation).
- The weight cache asks the same table which weights a cached low copy pays for (:meth:`Table.cache_min_numel`).
- ``gemm_min_flops="table"`` (``AMPFX_GEMM_MIN_FLOPS=table``) measures nothing and uses the datasheet table
  (:data:`ampfx.ops.gemm_cost.BREAK_EVEN`); so does a device this measures nothing on (GPUs for now: not checked
  on one here) and a measurement that fails (no kernel for the dtype), which the plan says.

>>> t = Table(device="cpu: example", torch="2.13", dtype="bfloat16", points=(
...     Point(64, 64, 1.0, 3.0), Point(1024, 64, 1.0, 1.2), Point(256, 256, 1.0, 0.6), Point(16, 1024, 1.0, 1.4),
...     Point(1024, 1024, 1.0, 0.5)))
>>> t.break_even()   # from 2 * 256 * 256**2 FLOPs, on weights used for at least 256 rows
BreakEven(flops=33554432, rows=256, never=False)
>>> Table("cpu: avx2", "2.13", "bfloat16", (Point(64, 64, 1.0, 40.0), Point(1024, 1024, 1.0, 55.0))).break_even().never
True
>>> limits(None, None, "cuda:0")[0], limits(0, 64, "cpu")[0], limits(None, 32, "cuda")
(BreakEven(flops=0, rows=0, never=False), BreakEven(flops=0, rows=0, never=False), (BreakEven(flops=0, rows=32, never=False), {'flops': 'on cuda (datasheet)', 'rows': 'set by gemm_min_rows'}))
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import platform
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import PolicyError, warn_user
from ..state import caller_threads
from . import gemm_cost
from .gemm_cost import NONE, BreakEven

log = logging.getLogger(__name__)

LADDER: tuple[tuple[int, int], ...] = (
    (64, 64), (16, 256), (64, 256), (256, 128), (16, 1024), (256, 256), (1024, 128), (64, 512), (64, 1024),
    (256, 512), (1024, 256), (256, 1024), (1024, 512), (1024, 1024))
"""The sizes measured, as ``(rows, width)``: a linear layer ``width -> width`` over ``rows`` rows, forward
operations ``2 * rows * width**2``. Ordered by operations, so the budget cuts the largest."""

CONV_LADDER: tuple[tuple[int, int], ...] = (
    (128, 16), (512, 16), (128, 64), (512, 32), (32, 256), (128, 128), (512, 64), (2048, 32), (512, 128))
"""The convolutions measured, as ``(rows, width)``: a 3x3 convolution ``width -> width`` channels over a batch of 2
images of ``rows / 2`` pixels (``rows``: the output pixels, each weight element's uses), forward operations
``2 * rows * width**2 * 9``. A convolution is a GEMM whose contracted size is its channels times its kernel,
but its kernels are not a linear layer's: on a CPU, oneDNN's bfloat16 convolutions pay from sizes where its
bfloat16 linear layers do not, so convolutions get a break-even of their own (:meth:`Table.break_even`)."""

CONV_TAPS = 9
"""The kernel elements of the convolutions measured (3x3)."""

MARGIN = 0.1
"""A size pays where the low dtype's step takes at most ``1 - MARGIN`` of float32's, and does not where it takes
more than float32's; in between it may go either way (noise)."""

BUDGET_S = {"cpu": 3.0, "cuda": 1.0}
"""Seconds a measurement may take, by device type."""

MEASURED_ON = ("cpu",)
"""Device types measured at first need; others use the datasheet table (``AMPFX_GEMM_MIN_FLOPS=measure`` measures
any device)."""

CACHE_VERSION = 3

CACHE_MIN_NUMEL = 1 << 16
"""The datasheet's smallest weight (elements) whose cached low copy pays (:func:`cache_limit`), for a device
without a measured table: a cast's fixed cost is a few microseconds, as is the Python autograd node that hands a
cached copy to the graph, and from about this size the cast's own work (two of them: the weight in the forward,
its gradient in the backward) is larger."""

MINIMUM = 4
"""A table is conclusive with at least this many sizes measured, one of them of :data:`LARGE` FLOPs or more."""

LARGE = 2 ** 25

CONV_MINIMUM = 3
"""Convolutions get their own break-even with at least this many of :data:`CONV_LADDER` measured; with fewer (a
budget cut short, a table cached before they were measured) they take the linear layers'."""


@dataclass(frozen=True)
class Point:
    """One size measured: ``rows`` x ``width`` (a linear ``width -> width``; with ``taps`` > 1 a convolution
    ``width -> width`` channels with that many kernel elements, over ``rows`` output pixels), the seconds of one
    training step in float32 and in the low dtype (``low_s`` ``None``: not measured, over the budget).

    Both are measured **alone**, between float32 neighbours: the low step casts its input and the gradient coming
    back. ``between_low`` is the same op **between low neighbours** (its input arrives low, its gradient too), as
    ``(float32 seconds, low seconds)``: float32 then casts its input, output and both gradients, the low dtype only
    its weight. Measured only for sizes that do not pay alone (``None`` otherwise, or not measured)."""

    rows: int
    width: int
    float32_s: float
    low_s: float | None
    taps: int = 1
    between_low: tuple[float, float] | None = None

    @property
    def flops(self) -> int:
        return 2 * self.rows * self.width * self.width * self.taps

    @property
    def ratio(self) -> float | None:
        """The low dtype's time over float32's alone (under 1: the low dtype is faster)."""
        return None if self.low_s is None else self.low_s / self.float32_s

    @property
    def ratio_between_low(self) -> float | None:
        """The same between low neighbours; a size not measured there that pays alone pays there too (it saves
        the casts alone costs it)."""
        if self.between_low is not None:
            return self.between_low[1] / self.between_low[0]
        ratio = self.ratio
        return ratio if ratio is not None and ratio <= 1 - MARGIN else None


@dataclass(frozen=True)
class Table:
    """What :func:`measure` found on one device for one low dtype: the GEMM :class:`Point` s, the cost of casting
    and of an elementwise op per element (float32 and low, in nanoseconds; ``None`` where not measured), how long
    measuring took, and ``source``: ``"measured"``, ``"cached"`` (read from :func:`cache_file`)."""

    device: str
    torch: str
    dtype: str
    points: tuple[Point, ...]
    cast_ns: float | None = None
    elementwise_ns: tuple[float, float] | None = None
    handoff_ns: float | None = None
    seconds: float = 0.0
    source: str = "measured"

    @property
    def key(self) -> str:
        return key_of(self.device, self.torch, self.dtype)

    def break_even(self, conv: bool = False, between_low: bool = False) -> BreakEven:
        """The smallest ``(flops, rows)`` from which the measured sizes pay low, fitted with :data:`MARGIN` (see
        the module docstring); ``never`` where no measured size pays. ``conv``: the convolutions'
        (:data:`CONV_LADDER`), where at least :data:`CONV_MINIMUM` were measured, else the linear layers'.
        ``between_low``: for an op between low neighbours (:attr:`Point.ratio_between_low`), where measured
        (:attr:`measured_between_low`), else the same as alone; never under the smallest size measured (below it
        nothing says the low dtype pays).

        >>> lin = [Point(64, 64, 1.0, 2.0), Point(256, 256, 1.0, 0.5)]
        >>> conv = [Point(128, 32, 1.0, 1.3, 9), Point(512, 32, 1.0, 0.8, 9), Point(512, 64, 1.0, 0.6, 9)]
        >>> t = Table("cpu: example", "2.13", "bfloat16", (*lin, *conv))
        >>> t.break_even(), t.break_even(conv=True)
        (BreakEven(flops=33554432, rows=0, never=False), BreakEven(flops=9437184, rows=0, never=False))
        >>> Table("cpu: example", "2.13", "bfloat16", tuple(lin)).break_even(conv=True)  # none measured
        BreakEven(flops=33554432, rows=0, never=False)

        A threshold is kept only where it makes fewer mistakes than "never": one small size that pays below larger
        ones that lose says nothing of a break-even.

        >>> slow = [Point(64, 64, 1.0, 3.6), Point(256, 256, 1.0, 28.0)]
        >>> odd = [Point(128, 16, 1.0, 0.8, 9), Point(512, 16, 1.0, 2.2, 9), Point(128, 64, 1.0, 6.0, 9)]
        >>> Table("cpu: avx2", "2.13", "bfloat16", (*slow, *odd)).break_even(conv=True).never
        True
        """
        if conv and self.convs_measured and not between_low:
            convs = [p for p in self.points if p.taps > 1]
            own = self._fit(convs, False)
            linear = self.break_even()
            if not own.never or linear.never:
                return own
            # convolutions slower at every size measured where linear layers pay: larger ones are not known to
            # lose, and take the linear layers' break-even from past the largest measured
            largest = max(p.flops for p in convs if p.ratio is not None)
            return BreakEven(max(linear.flops, largest + 1), linear.rows)
        return self._fit([p for p in self.points if (p.taps > 1) == (conv and self.convs_measured)], between_low)

    def _fit(self, kind: list[Point], between_low: bool) -> BreakEven:
        """:meth:`break_even` over the points ``kind``."""
        between = between_low and any(p.between_low is not None for p in kind)
        if between:
            seen = [(p, p.ratio_between_low) for p in kind if p.ratio_between_low is not None]
        else:
            seen = [(p, p.ratio) for p in kind if p.ratio is not None]
        pays = [p for p, ratio in seen if ratio <= 1 - MARGIN]
        if not pays:
            return BreakEven(0, 0, never=True)
        loses = [p for p, ratio in seen if ratio > 1]
        def fit(flops: int, rows: int) -> tuple[int, bool, int, int]:  # fewest wrong; a rows criterion if needed
            wrong = (sum(1 for p in pays if p.flops < flops or p.rows < rows)
                     + sum(1 for p in loses if p.flops >= flops and p.rows >= rows))
            return wrong, rows > 0, flops, rows

        # between low neighbours only the sizes that lose alone were measured: nothing under the smallest is known
        least = {0} if not between else set()
        best = min(fit(f, r) for f in {*least, *(p.flops for p in pays)} for r in {0, *(p.rows for p in pays)})
        if best[0] >= len(pays):  # no threshold tells them apart better than "never" (a lone paying size amid
            return BreakEven(0, 0, never=True)  # larger ones that lose is noise, not a break-even)
        return BreakEven(best[2], best[3])

    @property
    def conclusive(self) -> bool:
        """Were enough linear sizes measured to decide (:data:`MINIMUM`, up to :data:`LARGE` FLOPs)? A measurement
        cut short by its budget (a busy machine) is not: the datasheet is used instead, and it is not cached."""
        seen = [p for p in self.points if p.ratio is not None and p.taps == 1]
        return len(seen) >= MINIMUM and max(p.flops for p in seen) >= LARGE

    @property
    def measured_between_low(self) -> bool:
        """Were sizes measured between low neighbours (:attr:`Point.between_low`)?"""
        return any(p.between_low is not None for p in self.points)

    @property
    def convs_measured(self) -> bool:
        """Were enough convolutions measured (:data:`CONV_MINIMUM`) for a break-even of their own?"""
        return sum(1 for p in self.points if p.ratio is not None and p.taps > 1) >= CONV_MINIMUM

    def cache_min_numel(self) -> int:
        """The smallest weight (elements) whose cached low copy pays here: a cached read saves a cast of the
        weight in the forward and of its gradient in the backward (``2 * numel * cast_ns``) and costs the node
        that hands the copy to the graph (``handoff_ns`` more than a cast's fixed cost); it pays where the saving
        is larger, with :data:`MARGIN`. :data:`CACHE_MIN_NUMEL` where either was not measured.

        >>> Table("cpu: example", "2.13", "bfloat16", (), cast_ns=0.25, handoff_ns=9000.0).cache_min_numel()
        20000
        """
        if self.cast_ns is None or self.handoff_ns is None or self.cast_ns <= 0:
            return CACHE_MIN_NUMEL
        return max(0, math.ceil(self.handoff_ns / (2 * self.cast_ns * (1 - MARGIN))))

    def largest(self, conv: bool = False) -> Point | None:
        """The largest size measured in the low dtype: of the linear layers, or (``conv``) of the convolutions where
        they have a break-even of their own (:attr:`convs_measured`)."""
        own = conv and self.convs_measured
        seen = [p for p in self.points if p.ratio is not None and (p.taps > 1) == own]
        return max(seen, key=lambda p: p.flops) if seen else None

    def lines(self) -> list[str]:
        """The table as ``ampfx device`` prints it."""
        be = self.break_even()
        when = f"measured now, in {self.seconds:.1f} s" if self.source == "measured" else \
            f"{self.source}; measuring took {self.seconds:.1f} s"
        out = [f"{self.device}, torch {self.torch}, {self.dtype} against float32 ({when})",
               f"  {'op':<7} {'rows':>6} {'width':>6} {'FLOPs':>14} {'float32 ms':>11} {self.dtype + ' ms':>12} "
               f"{'ratio':>6}  between low neighbours: float32 ms, {self.dtype} ms, ratio"]
        for p in self.points:
            low = "skipped" if p.low_s is None else f"{p.low_s * 1e3:.3f}"
            ratio = "" if p.ratio is None else f"{p.ratio:.2f}"
            op = "linear" if p.taps == 1 else f"conv{round(p.taps ** 0.5)}x{round(p.taps ** 0.5)}"
            among = "" if p.between_low is None else \
                f"  {p.between_low[0] * 1e3:.3f} {p.between_low[1] * 1e3:.3f} {p.ratio_between_low:.2f}"
            out.append(f"  {op:<7} {p.rows:>6} {p.width:>6} {p.flops:>14,} {p.float32_s * 1e3:>11.3f} {low:>12} "
                       f"{ratio:>6}{among}")
        if self.cast_ns is not None:
            out.append(f"  a cast float32 -> {self.dtype}: {self.cast_ns:.2f} ns an element")
        if self.elementwise_ns is not None:
            out.append(f"  an elementwise op (gelu): float32 {self.elementwise_ns[0]:.2f} ns, {self.dtype} "
                       f"{self.elementwise_ns[1]:.2f} ns an element")
        if self.handoff_ns is not None:
            out.append(f"  handing a cached weight to a graph: {self.handoff_ns / 1e3:.1f} us more than casting it; "
                       f"the weight cache pays from {self.cache_min_numel():,} elements")
        out.append("  break-even: " + describe(be, self))
        if self.convs_measured:
            out.append("  convolutions' break-even: " + describe(self.break_even(conv=True), self, conv=True))
        else:
            out.append("  convolutions: too few measured, the linear layers' break-even is used")
        if self.measured_between_low:
            out.append("  between low neighbours: " + describe(self.break_even(between_low=True), self) + "; "
                       + describe(self.break_even(conv=True, between_low=True), self, conv=True))
        return out

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Table":
        points = tuple(Point(int(p["rows"]), int(p["width"]), float(p["float32_s"]),
                             None if p["low_s"] is None else float(p["low_s"]), int(p.get("taps", 1)),
                             None if p.get("between_low") is None else
                             (float(p["between_low"][0]), float(p["between_low"][1])))
                       for p in d["points"])
        ew = d.get("elementwise_ns")
        return cls(device=str(d["device"]), torch=str(d["torch"]), dtype=str(d["dtype"]), points=points,
                   cast_ns=None if d.get("cast_ns") is None else float(d["cast_ns"]),
                   elementwise_ns=None if ew is None else (float(ew[0]), float(ew[1])),
                   handoff_ns=None if d.get("handoff_ns") is None else float(d["handoff_ns"]),
                   seconds=float(d.get("seconds", 0.0)), source="cached")


def describe(be: BreakEven, table: Table | None = None, conv: bool = False) -> str:
    """A break-even in words (``conv``: the convolutions').

    >>> describe(BreakEven(2**24, 64))
    'GEMMs of at least 16,777,216 FLOPs a call whose weight is used for at least 64 rows run faster low'
    >>> describe(BreakEven(0, 0, never=True))
    'the low dtype is slower than float32 at every size measured: every GEMM stays float32'
    """
    gemms = "convolutions" if conv else "GEMMs"
    if be.never:
        largest = table.largest(conv) if table is not None else None
        upto = f" (up to {largest.flops:,} FLOPs)" if largest is not None else ""
        return f"the low dtype is slower than float32 at every size measured{upto}: every {gemms[:-1]} stays float32"
    if not be.flops and not be.rows:
        return f"every {gemms[:-1]} measured runs faster low"
    what = [f"of at least {be.flops:,} FLOPs a call"] if be.flops else []
    what += [f"whose weight is used for at least {be.rows:,} rows"] if be.rows else []
    return f"{gemms} {' '.join(what)} run faster low"


# ------------------------------------------------------------------ FP8: the roofline of a device not here
@dataclasses.dataclass(frozen=True)
class Roofline:
    """The cost model of a device that is not here, from its datasheet: its dense GEMM rates (TFLOP/s, bfloat16
    and FP8) and memory bandwidth (TB/s), and how many bytes current scaling moves per operand element to quantise it
    from 16 bits (read for the amax, read again and write one byte: 5). FP8 plans are made for such a device
    (``fp8_roofline``, :func:`ampfx.policy.fp8.roofline`): the ``fp8:cost`` rule asks :meth:`pays`."""

    name: str
    bf16_tflops: float
    fp8_tflops: float
    bandwidth_tbs: float
    quantize_bytes: float = 5.0

    def __post_init__(self) -> None:
        for which in ("bf16_tflops", "fp8_tflops", "bandwidth_tbs", "quantize_bytes"):
            value = getattr(self, which)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise PolicyError(f"Roofline {self.name!r}: {which}={value!r}: use a positive number")

    @property
    def threshold(self) -> float:
        """``M*N/(M+N)`` above which an FP8 GEMM pays: its time saved, ``2MNK (1/bf16 - 1/fp8)``, is more than the
        time its operands take to quantise, ``quantize_bytes (M + N) K / bandwidth``. K cancels out.

        >>> round(ROOFLINES["h100"].threshold)
        1475
        """
        saved = 2 * (1 / self.bf16_tflops - 1 / self.fp8_tflops) / 1e12
        if saved <= 0:
            return float("inf")
        return self.quantize_bytes / (self.bandwidth_tbs * 1e12) / saved

    def pays(self, m: int | None, n: int) -> tuple[bool, str]:
        """Does an FP8 GEMM with ``m`` rows (``None``: unknown, taken as large) and ``n`` outputs pay here, and the
        reason in words.

        >>> ROOFLINES["h100"].pays(8192, 4096)[0], ROOFLINES["h100"].pays(8192, 1024)[0]
        (True, False)
        """
        top = self.threshold
        if m is None:
            size, said = float(n), f"N={n} (M unknown, taken as large)"
        else:
            size, said = m * n / (m + n), f"M={m}, N={n}: M*N/(M+N)={m * n / (m + n):.0f}"
        if size > top:
            return True, f"{said} > {top:.0f}, where FP8 pays on {self.name}"
        rates = f"{self.bf16_tflops:g}/{self.fp8_tflops:g} TFLOP/s bf16/fp8, {self.bandwidth_tbs:g} TB/s"
        return False, (f"{said} <= {top:.0f}: on {self.name} ({rates}) quantising the operands costs more than the "
                       "FP8 GEMM saves (fp8_roofline='none' ignores cost)")


ROOFLINES: dict[str, Roofline] = {r.name: r for r in (
    Roofline("h100", 989.0, 1979.0, 3.35), Roofline("h200", 989.0, 1979.0, 4.8), Roofline("b200", 2250.0, 4500.0, 8.0))}
"""Dense peak rates of the presets (vendor datasheets, SXM parts, without sparsity)."""


# ------------------------------------------------------------------ the device and the cache
def _cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
                platform.machine())
    flags = next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())
    native = [f for f in ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16") if f in flags]
    return f"{name} ({', '.join(native) if native else 'no native bfloat16/float16'})"


def device_name(device: Any) -> str:
    """What a table is measured for: the device type, its name, and on a CPU its native bfloat16 / float16
    features and the threads torch uses (a table holds only on the same)."""
    kind = torch.device(device).type
    if kind == "cuda":
        index = torch.device(device).index or 0
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda: {torch.cuda.get_device_name(index)} (sm_{major}{minor})"
    if kind == "cpu":
        return f"cpu: {_cpu_name()}, {caller_threads()} thread{'s' if caller_threads() > 1 else ''}"
    return kind


def key_of(device: str, version: str, dtype: str) -> str:
    return f"{device} | torch {version} | {dtype}"


def cache_file() -> Path:
    """Where tables are kept: ``$AMPFX_CACHE_DIR/device-cost.json``, else under ``$XDG_CACHE_HOME/ampfx`` or
    ``~/.cache/ampfx``."""
    root = os.environ.get("AMPFX_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "ampfx")
    return Path(root) / "device-cost.json"


def _read_cache(path: Path) -> tuple[dict[str, Any], str | None]:
    """The cache's entries, and a message where it could not be read (then it is measured again)."""
    if not path.exists():
        return {}, None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("tables"),
                                                                                                  dict):
            return {}, f"ampfx: {path} is not a device-cost cache of this version: measuring again"
        return data["tables"], None
    except (OSError, ValueError) as e:
        return {}, f"ampfx: cannot read the device-cost cache {path} ({e}): measuring again"


def _write_cache(path: Path, table: Table) -> str | None:
    """Add ``table`` to the cache; a message where it cannot be written."""
    tables, _ = _read_cache(path)
    tables[table.key] = table.to_json()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "tables": tables}, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        return f"ampfx: cannot write the device-cost cache {path} ({e.strerror or e}): the table is kept in memory " \
               "(set AMPFX_CACHE_DIR to a writable directory)"
    return None


# ------------------------------------------------------------------ measuring
def _clock(device: torch.device) -> Callable[[], float]:
    if device.type == "cuda":
        def now() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return now
    return time.perf_counter


def _step(rows: int, width: int, low: torch.dtype | None, device: torch.device,
          among: torch.dtype | None = None) -> Callable[[], None]:
    """One training step of a linear ``width -> width`` over ``rows`` rows: float32, or with its input and weight
    cast to ``low`` (the gradient reaches the float32 weight through the cast, as in a converted graph). ``among``:
    between neighbours of that dtype (its input and the gradient coming back arrive in it; the float32 step casts
    them, and its output, to and from float32)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, width, generator=gen).to(device)
    w = (torch.randn(width, width, generator=gen) / width ** 0.5).to(device).requires_grad_()
    g = torch.randn(rows, width, generator=gen).to(device)
    return _stepper(lambda a, b: torch.nn.functional.linear(a, b), x, w, g, low, among)


def _conv_step(rows: int, width: int, low: torch.dtype | None, device: torch.device,
               among: torch.dtype | None = None) -> Callable[[], None]:
    """:func:`_step` for a 3x3 convolution ``width -> width`` channels over 2 images of ``rows / 2`` pixels (square,
    padded to keep their size)."""
    side = max(1, round((rows // 2) ** 0.5))
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, width, side, side, generator=gen).to(device)
    w = (torch.randn(width, width, 3, 3, generator=gen) / (9 * width) ** 0.5).to(device).requires_grad_()
    g = torch.randn(2, width, side, side, generator=gen).to(device)
    return _stepper(lambda a, b: torch.nn.functional.conv2d(a, b, padding=1), x, w, g, low, among)


def _stepper(op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, w: torch.Tensor,
             g: torch.Tensor, low: torch.dtype | None, among: torch.dtype | None) -> Callable[[], None]:
    """``op(x, w)`` forward and backward (gradient ``g``), computed in ``low`` (float32: ``None``) with its
    neighbours in ``among`` (float32: ``None``): the casts a converted graph makes between them."""
    x = x.to(among or x.dtype).requires_grad_()
    g = g.to(among or g.dtype)

    def run() -> None:
        out = op(x.to(low or torch.float32), w.to(low) if low is not None else w)
        out.to(among or torch.float32).backward(g)
        x.grad = w.grad = None
    return run


def _time(fn: Callable[[], None], now: Callable[[], float], reps: int = 3, least_s: float = 2e-3) -> float:
    """The least, over ``reps``, of one call's seconds (calls batched to at least ``least_s``)."""
    fn()
    t0 = now()
    fn()
    once = max(now() - t0, 1e-7)
    n = max(1, int(least_s / once))
    best = once
    for _ in range(reps):
        t0 = now()
        for _ in range(n):
            fn()
        best = min(best, (now() - t0) / n)
    return best


def _per_element(fn: Callable[[torch.Tensor], Any], x: torch.Tensor, now: Callable[[], float]) -> float:
    return _time(lambda: fn(x), now) / x.numel() * 1e9


class _Handoff(torch.autograd.Function):
    """A cached low copy handed to a graph as the weight cache hands it (:mod:`ampfx.runtime.weight_cache`): a
    Python autograd node whose backward sends the gradient to the float32 master. Only its cost is measured here."""

    @staticmethod
    def forward(ctx: Any, master: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        ctx.master = master
        return low.view_as(low)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.master.dtype), None


def _handoff_ns(dev: torch.device, dtype: torch.dtype, now: Callable[[], float]) -> float:
    """What handing a cached copy of a small weight to a graph costs more than casting it (forward and backward:
    the fixed costs, the elements' own work being :attr:`Table.cast_ns`), in nanoseconds."""
    w = torch.randn(64, device=dev, requires_grad=True)
    low = w.detach().to(dtype)

    def cast() -> None:
        w.to(dtype).sum().backward()

    def handed() -> None:
        _Handoff.apply(w, low).sum().backward()
    return (_time(handed, now, reps=5) - _time(cast, now, reps=5)) * 1e9


def measure(device: Any, dtype: torch.dtype, budget_s: float | None = None) -> Table:
    """Measure :data:`LADDER` on ``device`` in float32 and ``dtype`` (see the module docstring), within
    ``budget_s`` seconds (default :data:`BUDGET_S` of the device type). Raises ``RuntimeError`` where the device
    has no kernel for ``dtype``."""
    dev = torch.device(device)
    budget = BUDGET_S.get(dev.type, 3.0) if budget_s is None else budget_s
    now = _clock(dev)
    threads = torch.get_num_threads()
    torch.set_num_threads(caller_threads())  # as the model will run, not as a conversion runs its example
    try:
        return _measure(dev, dtype, budget, now)
    finally:
        torch.set_num_threads(threads)


CONV_SHARE = 0.25
"""The part of the budget kept for :data:`CONV_LADDER`, measured after the linear layers."""


def _measure(dev: torch.device, dtype: torch.dtype, budget: float, now: Callable[[], float]) -> Table:
    start = now()
    points: list[Point] = []
    with torch.random.fork_rng(devices=[] if dev.type == "cpu" else [dev]):
        points += _ladder((LADDER, 1, _step), dev, dtype, now, start, budget * (1 - CONV_SHARE), MINIMUM)
        try:
            points += _ladder((CONV_LADDER, CONV_TAPS, _conv_step), dev, dtype, now, now(),
                              budget - (now() - start), CONV_MINIMUM)
        except (RuntimeError, NotImplementedError, TypeError) as e:  # no convolution kernel for the dtype here
            log.info("ampfx: convolutions in %s not measured on %s (%s): they take the linear layers' break-even",
                     dtype, dev, str(e).splitlines()[0][:200])
        x = torch.randn(1 << 20, device=dev)
        cast = _per_element(lambda t: t.to(dtype), x, now)
        elementwise = (_per_element(torch.nn.functional.gelu, x, now),
                       _per_element(torch.nn.functional.gelu, x.to(dtype), now))
        handoff = _handoff_ns(dev, dtype, now)
    return Table(device=device_name(dev), torch=torch.__version__.split("+")[0], dtype=str(dtype).split(".")[-1],
                 points=tuple(points), cast_ns=cast, elementwise_ns=elementwise, handoff_ns=handoff,
                 seconds=now() - start)


def _ladder(kind: tuple[tuple[tuple[int, int], ...], int, Callable[..., Callable[[], None]]], dev: torch.device,
            dtype: torch.dtype, now: Callable[[], float], start: float, budget: float, first: int) -> list[Point]:
    """The :class:`Point` s of ``kind``, ``(sizes, taps, step)`` (``step(rows, width, dtype or None, dev)`` one
    training step), within ``budget`` seconds from ``start``: a size whose predicted time would not fit is skipped
    (its ``low_s`` ``None``); the ``first`` few always run, within half the budget."""
    sizes, taps, step = kind
    points: list[Point] = []
    per_flop = None  # the least seconds a forward FLOP cost so far, float32 and low together
    for rows, width in sizes:
        flops = 2 * rows * width * width * taps
        spent = now() - start
        # a size runs about 2 + 3 batched steps of each dtype
        early = len(points) < first and spent < budget / 2
        if per_flop is not None and not early and 8 * flops * per_flop > budget - spent:
            points.append(Point(rows, width, float("nan"), None, taps))
            continue
        f32 = _time(step(rows, width, None, dev), now)
        low = _time(step(rows, width, dtype, dev), now)
        per_flop = min(per_flop or math.inf, (f32 + low) / flops)
        among = None
        if low / f32 > 1 - MARGIN and now() - start < budget:  # does not pay alone: between low neighbours?
            among = (_time(step(rows, width, None, dev, dtype), now), _time(step(rows, width, dtype, dev, dtype), now))
        points.append(Point(rows, width, f32, low, taps, among))
    return points


# ------------------------------------------------------------------ the table a conversion uses
_TABLES: dict[str, Table] = {}
_LOCK = threading.Lock()
_SAID: set[str] = set()  # the tables whose cut-short measurement was said (once each)
_FAILED: set[str] = set()  # the devices and dtypes whose measurement failed (said once each)


def table(device: Any, dtype: torch.dtype, refresh: bool = False,
          say: Callable[[str], None] | None = None) -> Table:
    """The measured table for ``device`` and ``dtype``: from this process's memory, else the cache file, else
    measured now (and cached); ``refresh`` measures again. ``say`` receives the messages (a cache that cannot be
    read or written). Raises ``RuntimeError`` where measuring fails.

    In a run of several processes (``torch.distributed`` initialised), every rank plans from rank 0's table, passed
    through the process group's store (rank 0 writes it, the others wait for it: :func:`_shared`), so the ranks'
    plans, and FSDP2's gathers that follow them, do not differ."""
    say = say or (lambda message: log.warning(message))
    key = key_of(device_name(device), torch.__version__.split("+")[0], str(dtype).split(".")[-1])
    store = _store()
    if store is not None:
        shared = f"{key} | ranks {id(store)}"
        with _LOCK:
            if not refresh and shared in _TABLES:
                return _TABLES[shared]
        got = _shared(store, key, lambda: _local(device, dtype, key, refresh, say), say)
        if got is None:  # rank 0's did not come in time: this rank's own, said once (no second wait)
            got = _local(device, dtype, key, refresh, say)
        with _LOCK:
            _TABLES[shared] = got
            return got
    return _local(device, dtype, key, refresh, say)


RANK_WAIT_S = 120.0
"""How long a rank other than 0 waits for rank 0's table before it uses its own (with a warning)."""


def _store() -> Any:
    """The default process group's store where torch.distributed runs several processes, else ``None``."""
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return dist.distributed_c10d._get_default_store()


def _shared(store: Any, key: str, local: Callable[[], Table], say: Callable[[str], None]) -> Table | None:
    """Rank 0's table through the process group's store: rank 0 makes it and writes it (a failure too, which every
    rank then raises); the others wait for it (:data:`RANK_WAIT_S`), ``None`` where it does not come. No rank
    waits on another's collective: a rank that converts alone never hangs."""
    import datetime

    name = f"ampfx/device-cost/{key}"
    if torch.distributed.get_rank() == 0:
        try:
            made = local().to_json()
        except Exception as e:  # every rank learns it failed: none waits for it
            store.set(name, json.dumps({"error": f"{type(e).__name__}: {e}"}))
            raise
        store.set(name, json.dumps(made))
        return dataclasses.replace(Table.from_json(made), source="rank 0's")
    try:
        store.wait([name], datetime.timedelta(seconds=RANK_WAIT_S))
        made = json.loads(store.get(name))
    except (RuntimeError, ValueError) as e:  # DistStoreError (a RuntimeError): it did not come in time
        say(f"ampfx: rank 0's device-cost table did not come within {RANK_WAIT_S:.0f} s ({str(e).splitlines()[0]}): "
            "this rank measures its own, and its plan may differ from rank 0's")
        return None
    if "error" in made:
        raise RuntimeError(f"on rank 0: {made['error']}")
    return dataclasses.replace(Table.from_json(made), source="rank 0's")


def _local(device: Any, dtype: torch.dtype, key: str, refresh: bool, say: Callable[[str], None]) -> Table:
    """:func:`table` in this process alone."""
    with _LOCK:
        if not refresh and key in _TABLES:
            return _TABLES[key]
        path = cache_file()
        if not refresh:
            tables, problem = _read_cache(path)
            if problem:
                say(problem)
            elif key in tables:
                try:
                    _TABLES[key] = Table.from_json(tables[key])
                    return _TABLES[key]
                except (KeyError, TypeError, ValueError, IndexError) as e:
                    say(f"ampfx: the device-cost cache {path} has a broken entry for this device ({e!r}): "
                        "measuring again")
        log.info("ampfx: measuring where %s GEMMs pay on %s (once; cached in %s)", key, device, path)
        measured = measure(device, dtype)
        problem = _write_cache(path, measured) if measured.conclusive else None
        if problem:
            say(problem)
        _TABLES[key] = measured
        return measured


def forget() -> None:
    """Drop the tables this process holds in memory (the cache file stays)."""
    with _LOCK:
        _TABLES.clear()
        _SAID.clear()
        _FAILED.clear()


# ------------------------------------------------------------------ the break-even a plan uses
def measure_on(kinds: tuple[str, ...]) -> tuple[str, ...]:
    """Measure the break-even at first need on these device types (default ``("cpu",)``; ``()``: none, every
    device uses :data:`ampfx.ops.gemm_cost.BREAK_EVEN`); returns the types before."""
    global MEASURED_ON
    before, MEASURED_ON = MEASURED_ON, tuple(kinds)
    return before


def limits(flops: Any, rows: int | None, device: Any, fp8: Any = None,
           dtype: Any = None, conv: bool = False, between_low: bool = False) -> tuple[BreakEven, dict[str, str]]:
    """The break-even that applies, and where each of its two figures comes from (``{"flops": ..., "rows": ...}``,
    for the reasons): ``flops`` and ``rows`` (``Policy.gemm_min_flops`` and ``Policy.gemm_min_rows``) where given;
    else, for ``dtype`` on ``device``, the measured table (:func:`table`: on the device types in
    :data:`MEASURED_ON`, or any with ``flops="measure"``), or the datasheet (:data:`ampfx.ops.gemm_cost.BREAK_EVEN`:
    with ``flops="table"``, on other devices, or where measuring fails: a warning says so); with ``fp8`` (a recipe: the plan is for the GPU whose roofline decides FP8) none
    for those not given. A given ``flops=0`` turns the rule off: every GEMM low, whatever ``rows``. ``conv``: the
    break-even of convolutions (a measured table's own for them, :meth:`Table.break_even`); ``between_low``: of a
    GEMM between low neighbours (a measured table's, where it measured them; else the same as alone)."""
    kind = str(device).split(":")[0]
    if flops == 0:
        return NONE, {"flops": "set by gemm_min_flops", "rows": "set by gemm_min_flops"}
    given = flops if isinstance(flops, int) else None
    if given is not None and rows is not None:  # both given: nothing to measure
        return BreakEven(given, rows), {"flops": "set by gemm_min_flops", "rows": "set by gemm_min_rows"}
    if fp8 is not None:
        device_be, where = NONE, "under fp8= (planned for the FP8 roofline's device)"
    else:
        device_be, where = _device(kind, device, dtype, flops, conv, between_low)
    if device_be.never and given is None:  # the low dtype is slower at every size: only a given break-even lowers
        return device_be, {"flops": where, "rows": where}
    chosen = BreakEven(device_be.flops if given is None else given, device_be.rows if rows is None else rows)
    return chosen, {"flops": where if given is None else "set by gemm_min_flops",
                    "rows": where if rows is None else "set by gemm_min_rows"}


def _measures(kind: str, how: Any) -> bool:
    """Is a table measured for this device type, given the policy's ``gemm_min_flops`` (``how``): on the types in
    :data:`MEASURED_ON`, or any with ``"measure"``; never with ``"table"``."""
    return how != "table" and (how == "measure" or kind in MEASURED_ON)


def _device(kind: str, device: Any, dtype: Any, how: Any, conv: bool = False,
            between_low: bool = False) -> tuple[BreakEven, str]:
    """The device's break-even for ``dtype`` (``conv``: of convolutions) and where it comes from: measured
    (:func:`table`) or the datasheet (:data:`ampfx.ops.gemm_cost.BREAK_EVEN`)."""
    failed = f"{device} | {dtype}"
    if dtype is not None and _measures(kind, how) and failed not in _FAILED:
        try:
            measured = table(device, dtype, say=warn_user)
        except (RuntimeError, NotImplementedError, TypeError) as e:  # no kernel for the dtype on this device
            _FAILED.add(failed)  # said once; not measured again by this process (forget() clears it)
            warn_user(f"ampfx: measuring {dtype} GEMMs on {device} failed ({str(e).splitlines()[0][:200]}): the "
                      "datasheet break-even is used")
        else:
            if measured.conclusive:
                own = " for convolutions" if conv and measured.convs_measured else ""
                own += " between low neighbours" if between_low and measured.measured_between_low else ""
                return (measured.break_even(conv, between_low),
                        f"measured{own} on {measured.device} ({measured.source})")
            if measured.key not in _SAID:
                _SAID.add(measured.key)
                warn_user(f"ampfx: measuring {dtype} GEMMs on {device} ran out of its time budget before enough "
                          "sizes were measured (a busy machine?): the datasheet break-even is used; `ampfx device "
                          "--refresh` measures again")
    return gemm_cost.BREAK_EVEN.get(kind, NONE), f"on {kind} (datasheet)"


def cache_limit(device: Any, dtype: torch.dtype, how: Any = None) -> tuple[int, str]:
    """The smallest weight (elements) whose cached low copy pays on ``device`` (:meth:`Table.cache_min_numel`), and
    where that comes from: the device's measured table where the GEMM break-even is measured (``how``: the policy's
    ``gemm_min_flops``; a number or ``"table"`` measures nothing, as in :func:`limits`), else
    :data:`CACHE_MIN_NUMEL` (the datasheet).

    >>> before = measure_on(())
    >>> cache_limit("cpu", torch.bfloat16)
    (65536, 'on cpu (datasheet)')
    >>> _ = measure_on(before)
    """
    kind = str(device).split(":")[0]
    if not isinstance(how, int) and _measures(kind, how):  # a break-even given as a number measures nothing
        try:
            measured = table(device, dtype, say=warn_user)
        except (RuntimeError, NotImplementedError, TypeError):  # said where the GEMM break-even was asked for
            pass
        else:
            if measured.conclusive and measured.handoff_ns is not None:
                return measured.cache_min_numel(), f"measured on {measured.device} ({measured.source})"
    return CACHE_MIN_NUMEL, f"on {kind} (datasheet)"
