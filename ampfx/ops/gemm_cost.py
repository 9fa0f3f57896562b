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

This table is the **datasheet**: where measuring is possible the break-even is measured on the device itself at
first need and cached (:mod:`ampfx.ops.device_cost`); the table serves ``gemm_min_flops="table"``, devices not
measured (GPUs for now), and a measurement that fails.

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
BreakEven(flops=16777216, rows=64, never=False)
"""
from __future__ import annotations

from typing import NamedTuple


class BreakEven(NamedTuple):
    """From which size a low-precision GEMM pays: ``flops``, forward operations of one call (0: any); ``rows``, how
    many rows each weight element is used for in one call (0: any); ``never``: at no size measured (every GEMM
    stays float32)."""

    flops: int
    rows: int
    never: bool = False


NONE = BreakEven(0, 0)
"""Every GEMM low."""

CPU = BreakEven(2 ** 24, 64)
"""A CPU's break-even (see the module docstring)."""
BREAK_EVEN: dict[str, BreakEven] = {"cpu": CPU}
"""The break-even by device type (see the module docstring); a type not here: :data:`NONE`."""
