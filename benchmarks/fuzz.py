"""The long fuzz run: ``python benchmarks/fuzz.py --n 2000 [--seed S]``.

Runs :func:`fuzzgraphs.run_case` (tests/support/fuzzgraphs.py, the generator and checks of
tests/test_fuzz.py) on seeds ``S .. S+n-1`` and prints, at the end, what was generated,
how many cases passed each check, every failure counted by check and class, the seeds that
failed with their first failure, and how ampfx's error compares with autocast's. Record the figures in
docs/fuzz.md.
"""
from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support import fuzzgraphs as fg  # noqa: E402


def _quantiles(values: list[float], qs: tuple[float, ...] = (0.5, 0.9, 0.99, 1.0)) -> str:
    if not values:
        return "-"
    values = sorted(values)
    return ", ".join(f"p{int(q * 100)} {values[min(len(values) - 1, int(q * len(values)))]:.3g}" for q in qs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="number of cases (default 2000)")
    ap.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    ap.add_argument("--progress", type=int, default=100, help="print a line every this many cases")
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error("--n must be positive")
    _init()
    made, passed, failed, refused = Counter(), Counter(), Counter(), Counter()
    bad_seeds: list[tuple[int, str]] = []
    ratios: list[float] = []
    start = time.time()
    seeds = range(args.seed, args.seed + args.n)
    with multiprocessing.get_context("spawn").Pool(args.jobs, initializer=_init) as pool:
        for i, outcome in enumerate(pool.imap(_run, seeds)):
            _count(outcome, made, passed, failed, refused, bad_seeds, ratios)
            if args.progress and (i + 1) % args.progress == 0:
                print(f"{i + 1} cases, {time.time() - start:.0f} s, {len(bad_seeds)} failing", flush=True)
    _print(args, made, passed, failed, refused, bad_seeds, ratios, time.time() - start)
    return 1 if bad_seeds else 0


def _init() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")


def _run(seed: int) -> fg.Outcome:
    return fg.run_case(fg.generate(seed))


def _count(outcome, made, passed, failed, refused, bad_seeds, ratios) -> None:  # noqa: ANN001
    """Add one case's outcome to the counters."""
    case = outcome.case
    made.update([f"dtype {case.dtype}", f"tracer {case.options['tracer']}", f"pad {case.options['pad']}",
                 f"dynamic_dims {sorted(case.options.get('dynamic_dims') or {})}",
                 f"mode {'train' if case.train else 'eval'}", *(f"op {o}" for o in set(case.ops))])
    made["steps"] += case.steps
    passed.update(set(outcome.passed) - {f.check for f in outcome.failures})
    refused.update(r.split(":")[0] for r in outcome.refused)
    ratios.extend(a / max(c, 1e-12) for _, a, c in outcome.ratios if c == c and c != float("inf"))
    if outcome.failures:
        failed.update((f.check, f.kind) for f in outcome.failures)
        bad_seeds.append((case.seed, str(outcome.failures[0])))


def _print(args, made, passed, failed, refused, bad_seeds, ratios, elapsed) -> None:  # noqa: ANN001
    print(f"\nfuzz: {args.n} cases, seeds {args.seed}..{args.seed + args.n - 1}, {elapsed:.0f} s "
          f"(torch {torch.__version__})")
    print(f"  ops per case: {made.pop('steps') / args.n:.1f} on average")
    for prefix in ("dtype", "tracer", "pad", "dynamic_dims", "mode"):
        print(f"  {prefix}: " + ", ".join(f"{k[len(prefix) + 1:]} {v}" for k, v in sorted(made.items())
                                           if k.startswith(prefix + " ")))
    print("  cases using each op: " + ", ".join(f"{k[3:]} {v}" for k, v in sorted(made.items())
                                              if k.startswith("op ")))
    print("cases that passed each check (every time it ran):")
    for check, n in sorted(passed.items()):
        print(f"  {check:20s} {n}")
    print(f"other sizes refused with an ampfx error: {dict(refused) or 0}")
    print(f"failures: {sum(failed.values())} in {len(bad_seeds)} cases")
    for (check, kind), n in failed.most_common():
        print(f"  {check:20s} {kind:30s} {n}")
    for seed, first in bad_seeds[:30]:
        print(f"  seed {seed}: {first[:300]}")
    print(f"ampfx error / autocast error (output and gradients): {_quantiles(ratios)}")


if __name__ == "__main__":
    raise SystemExit(main())
