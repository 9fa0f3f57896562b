"""Where a low-precision GEMM starts to pay, by device: the table behind ``Policy.gemm_min_flops``.

A GEMM in bfloat16 or float16 runs faster than in float32 only from some size on: below it the call's fixed
cost and the casts around it outweigh the arithmetic saved. :data:`BREAK_EVEN` holds, per device type, the
forward floating-point operations of one GEMM call (``2 M N K``) from which the low dtype is taken; a GEMM
under it stays float32 (``ampfx.passes.gemm_cost``, rule ``cost:small-gemm``).

Measured, not guessed (``benchmarks/gemm_break_even.py`` prints it for the machine it runs on):

- ``cpu``: 2**24 (16.8 MFLOP). On an x86-64 CPU with avx512_bf16 and AMX, one thread, a linear layer's forward
  and backward with its casts: bfloat16 1.7-2.8x float32's time at 0.26-4 MFLOP (oneDNN's bfloat16 call costs
  about 30 us), even at 13-17 MFLOP (0.9-1.2x), 0.3-0.6x from 50 MFLOP on; 3x3 convolutions pay from about 30
  MFLOP, depthwise ones do not at these sizes. On CPUs without native bfloat16 or float16 arithmetic the low
  dtype is slower at every size (float16 here: 1.03x float32 at 2.4 GFLOP); the table keeps the same
  break-even there, so the large GEMMs still take the dtype the user asked for.
- with ``fp8=`` (FP8 GEMMs, planned for the GPU of ``fp8_roofline``): 0, unless ``gemm_min_flops`` is given.
- every other device (``cuda``, ...): 0, every GEMM low. Not measured on GPUs here; a GEMM under 16 MFLOP is
  launch-bound there in either dtype.

>>> CPU_BREAK_EVEN
16777216
>>> threshold(None, "cuda:0"), threshold(0, "cpu")
((0, 'on cuda'), (0, 'set by gemm_min_flops'))
"""
from __future__ import annotations

from typing import Any

CPU_BREAK_EVEN = 2 ** 24
"""A CPU's break-even (see the module docstring)."""
BREAK_EVEN: dict[str, int] = {"cpu": CPU_BREAK_EVEN}
"""Forward FLOPs of one GEMM call from which the low dtype pays, by device type; absent: 0 (always)."""


def threshold(given: int | None, device: Any, fp8: Any = None) -> tuple[int, str]:
    """The break-even that applies, and where it comes from: ``given`` (``Policy.gemm_min_flops``) when set, else
    the table's entry for ``device``'s type; with ``fp8`` (an FP8 recipe: the plan is for the GPU whose roofline
    decides FP8, ``Policy.fp8_roofline``) 0 unless given."""
    if given is not None:
        return given, "set by gemm_min_flops"
    kind = str(device).split(":")[0]
    if fp8 is not None:
        return 0, "under fp8= (planned for the FP8 roofline's device)"
    return BREAK_EVEN.get(kind, 0), f"on {kind}"
