"""What starting costs (not a test): wall seconds of fresh processes, the fastest of ``--reps`` each.

    python benchmarks/startup.py [--reps 7]

Rows: Python alone; ``import torch``; ``import torch, ampfx``; ``import ampfx``; ``ampfx.convert``'s first use
(what converting imports: torch, sympy, the passes); ``python -m ampfx --help`` (the ``ampfx`` script runs the same
``main``); an argument error (``explian``); ``bash scripts/demo.sh --steps abc`` (checked before the set-up). The
rows take turns, one run each per round, and the fastest run is the one least disturbed by other work on the
machine. Last, what ``import ampfx`` adds to ``import torch`` as ``python -X importtime`` counts it (ampfx's
cumulative time after torch), which the machine's load moves less than a difference of two wall times.
``tests/test_startup.py`` bounds what each start imports.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commands() -> list[tuple[str, list[str]]]:
    """``(label, argv)`` of each row, run from the checkout (so ``-m ampfx`` is the checkout's)."""
    py = sys.executable
    runs = [("python -c pass", [py, "-c", "pass"]),
            ("import torch", [py, "-c", "import torch"]),
            ("import torch, ampfx", [py, "-c", "import torch, ampfx"]),
            ("import ampfx", [py, "-c", "import ampfx"]),
            ("import ampfx; ampfx.convert", [py, "-c", "import ampfx; ampfx.convert"]),
            ("python -m ampfx --help", [py, "-m", "ampfx", "--help"]),
            ("python -m ampfx explian", [py, "-m", "ampfx", "explian"])]
    if shutil.which("bash"):
        runs.append(("bash scripts/demo.sh --steps abc", ["bash", "scripts/demo.sh", "--steps", "abc"]))
    return runs


def fastest(runs: list[tuple[str, list[str]]], reps: int) -> dict[str, float]:
    """The fastest of ``reps`` runs of each command, in seconds (any exit status: errors are timed), the rows
    taking turns so that a slow spell of the machine does not fall on one row."""
    best = {label: float("inf") for label, _ in runs}
    for _ in range(reps):
        for label, argv in runs:
            start = time.perf_counter()
            subprocess.run(argv, cwd=ROOT, capture_output=True, check=False)
            best[label] = min(best[label], time.perf_counter() - start)
    return best


def ampfx_after_torch(reps: int) -> float:
    """Seconds ``python -X importtime`` gives ``import ampfx`` (its cumulative time) after ``import torch``."""
    found = []
    for _ in range(reps):
        err = subprocess.run([sys.executable, "-X", "importtime", "-c", "import torch; import ampfx"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stderr
        found.append(int(re.search(r"^import time:\s+\d+ \|\s+(\d+) \| ampfx$", err, re.M).group(1)) / 1e6)
    return min(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="fresh processes per row; the fastest is shown")
    args = parser.parse_args()
    import torch

    print(f"fastest of {args.reps} fresh processes (torch {torch.__version__}, python {sys.version.split()[0]})")
    measured = fastest(commands(), args.reps)
    width = max(map(len, measured))
    for label, seconds in measured.items():
        print(f"  {label:<{width}}  {seconds:5.2f} s")
    print(f"  import ampfx after import torch, by -X importtime: {ampfx_after_torch(args.reps):.3f} s")


if __name__ == "__main__":
    main()
