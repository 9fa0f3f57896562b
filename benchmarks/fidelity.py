"""Fidelity against float32, ampfx vs torch.autocast: ``python benchmarks/fidelity.py [--batches 5]``.

For each model of tests/support/fidelity_models.py (pre-LN GPT, post-LN encoder, ResNet blocks,
iterative refinement with grid_sample, SSM scan, positions into ``.long()``, a LayerNorm over 3
features, a ViT with layer scale) and each dtype (bf16, fp16), on the same weights and batches as the float32 model, one
training step (forward + backward, training mode) per batch for: ampfx by default, ampfx with each
fidelity switch of ``ampfx.Policy`` off (those the policy has), and ``torch.autocast("cpu")`` with
the loss inside the region. It prints a markdown table and a verdict per model and dtype: ampfx's
output error <= 1.5 x autocast's and its worst gradient error <= 2 x, and no more wrong
indices than autocast.

- out err: ``||y - y32|| / ||y32||`` over the float outputs, the mean over the batches;
- worst grad err: per parameter ``||g - g32|| / ||g32||``, the mean over the batches, then the
  worst parameter (named); parameters whose float32 gradient is zero are left out;
- wrong idx: entries of integer outputs (indices after ``.long()``) that differ from float32's;
- casts, cast MB, MB written: one forward + backward on the first batch
  (``ampfx.tools.measure.measure_step``: dtype-changing copies, the model's own ``.long()`` included, which
  is float32's one cast on the positions model; the bytes they write; the bytes every op writes).

The reference is CPU autocast, as measured on this torch: it runs ``layer_norm`` and
``batch_norm`` in whatever dtype their input has (CUDA autocast lists ``layer_norm`` as float32), so
a norm after a GEMM runs low, one on the float32 residual stream (an add promotes) runs float32.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support import fidelity_models as fm  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HEADER = ("| model | dtype | variant | out err | worst grad err (param) | wrong idx | casts | cast MB | MB written |\n"
          "|---|---|---|---|---|---|---|---|---|")


def row_line(r: fm.Fidelity, dtype_name: str) -> str:
    """One markdown row of the table."""
    if r.failed:
        return f"| {r.family} | {dtype_name} | {r.variant} | failed: {r.failed} | | | | | |"
    grad = f"{r.grad_err:.3g} ({r.grad_param})" if r.grad_param else f"{r.grad_err:.3g}"
    return (f"| {r.family} | {dtype_name} | {r.variant} | {r.out_err:.3g} | {grad} | {r.wrong} | {r.casts} | "
            f"{r.cast_mb:.2f} | {r.mb_written:.2f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=5, help="batches averaged per model (default 5)")
    ap.add_argument("--models", nargs="*", default=list(fm.FAMILIES), choices=list(fm.FAMILIES))
    ap.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    args = ap.parse_args(argv)
    if args.batches < 1:
        ap.error("--batches must be positive")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    print(f"torch {torch.__version__}; errors are means over {args.batches} batches (seeds 0..{args.batches - 1}) "
          f"of one model per family; fidelity switches in ampfx.Policy: {list(fm.fidelity_switches()) or 'none'}\n")
    print(HEADER)
    verdicts = []
    for name in args.models:
        for dname in args.dtypes:
            rows = fm.measure_fidelity(name, DTYPES[dname], batches=args.batches)
            print("\n".join(row_line(r, dname) for r in rows), flush=True)
            by = {r.variant: r for r in rows}
            ok, text = fm.verdict(by["ampfx"], by["autocast"])
            verdicts.append(f"- {name} {dname}: {'PASS' if ok else 'FAIL'}: {text}")
    print("\nVerdict: ampfx (default) <= 1.5x autocast (out) and <= 2x (grad), no more wrong indices\n")
    print("\n".join(verdicts))
    print(f"\n({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
