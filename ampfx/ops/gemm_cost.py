"""Where a low-precision GEMM starts to pay, by device: the table behind ``Policy.gemm_min_flops`` and
``Policy.gemm_min_rows``.

A GEMM in bfloat16 or float16 runs faster than in float32 only from some size on. Two costs come first: the
call's own (on CPUs, oneDNN's bfloat16 call costs about 30 us whatever its size), and casting the weight, once
each way a step (forward copy, gradient back), which the arithmetic saved repays only when the weight is used
for enough rows (tokens, pixels times batch). :data:`BREAK_EVEN` holds, per device type, a
:class:`BreakEven`: the forward floating-point operations of one call (``2 M N K``) and the rows per weight
element from which the low dtype is taken; a GEMM under either stays float32 (``ampfx.passes.gemm_cost``, rule
``cost:small-gemm``).

Measured, not guessed (``benchmarks/gemm_break_even.py`` prints both for the machine it runs on; docs/benchmarks.md
has this machine's):

- ``cpu``: 2**24 operations (16.8 million) and 64 rows. On an x86-64 CPU with avx512_bf16 and AMX, one thread:
  a linear layer's forward and backward with its casts took 1.9-3.7x float32's time in bfloat16 under a million
  operations, 1.3-2.3x at 1-4 million, 1.0-1.25x at 13-17 million, 0.23-0.81x from 50 million on; inside a
  model's forward and backward (two MLP blocks), a weight used for 8 or 16 rows made bfloat16 1.29-1.53x
  float32's time at 38-75 million operations a call, 32 rows 0.94-0.97x, 64 rows and more 0.53-0.87x. On CPUs without native bfloat16 or
  float16 arithmetic the low dtype is slower at every size (float16 here: 1.03x float32 at 2.4 billion); the
  table keeps the same break-even there, so the large GEMMs still take the dtype the user asked for.
- with ``fp8=`` (FP8 GEMMs, planned for the GPU of ``fp8_roofline``): none, unless given.
- every other device (``cuda``, ...): none, every GEMM low. Not measured on GPUs here.

>>> CPU
BreakEven(flops=16777216, rows=64)
>>> limits(None, None, "cuda:0")[0], limits(0, 64, "cpu")[0], limits(None, 32, "cuda")
(BreakEven(flops=0, rows=0), BreakEven(flops=0, rows=0), (BreakEven(flops=0, rows=32), {'flops': 'on cuda', 'rows': 'set by gemm_min_rows'}))
"""
from __future__ import annotations

from typing import Any, NamedTuple


class BreakEven(NamedTuple):
    """From which size a low-precision GEMM pays: ``flops``, forward operations of one call (0: any); ``rows``, how
    many rows each weight element is used for in one call (0: any)."""

    flops: int
    rows: int


NONE = BreakEven(0, 0)
"""Every GEMM low."""

CPU = BreakEven(2 ** 24, 64)
"""A CPU's break-even (see the module docstring)."""
BREAK_EVEN: dict[str, BreakEven] = {"cpu": CPU}
"""The break-even by device type (see the module docstring); a type not here: :data:`NONE`."""


def limits(flops: int | None, rows: int | None, device: Any, fp8: Any = None) -> tuple[BreakEven, dict[str, str]]:
    """The break-even that applies, and where each of its two figures comes from (``{"flops": ..., "rows": ...}``):
    ``flops`` and ``rows`` (``Policy.gemm_min_flops`` and ``Policy.gemm_min_rows``) where given, else the table's
    entry for ``device``'s type; with ``fp8`` (a recipe: the plan is for the GPU whose roofline decides FP8) none
    for those not given. A given ``flops=0`` turns the rule off: every GEMM low, whatever ``rows``."""
    kind = str(device).split(":")[0]
    if fp8 is not None:
        table, where = NONE, "under fp8= (planned for the FP8 roofline's device)"
    else:
        table, where = BREAK_EVEN.get(kind, NONE), f"on {kind}"
    if flops == 0:
        return NONE, {"flops": "set by gemm_min_flops", "rows": "set by gemm_min_flops"}
    chosen = BreakEven(table.flops if flops is None else flops, table.rows if rows is None else rows)
    return chosen, {"flops": where if flops is None else "set by gemm_min_flops",
                    "rows": where if rows is None else "set by gemm_min_rows"}
