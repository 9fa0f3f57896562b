"""What ``import ampfx`` costs (not a test): ``python -X importtime -c "import ampfx"`` in a fresh process, split into
ampfx's own modules, torch (with what torch imports), and the rest ampfx imports beyond torch (sympy, rich, ...).
Best of ``--reps`` runs; also the wall time of ``python -m ampfx --help``.

    python benchmarks/import_time.py [--reps 5]
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time


def one() -> dict[str, float]:
    """Seconds of one ``import ampfx``: total, ampfx's own modules (self time), torch's subtree, the rest."""
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", "import ampfx"], capture_output=True,
                         text=True, check=True).stderr
    rows = []
    for line in err.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)", line)
        if m:
            rows.append((int(m.group(1)), int(m.group(2)), len(m.group(3)), m.group(4)))
    total = next(c for s, c, depth, name in rows if name == "ampfx") / 1e6
    own = sum(s for s, c, depth, name in rows if name == "ampfx" or name.startswith("ampfx.")) / 1e6
    torch_total = max((c for s, c, depth, name in rows if name == "torch"), default=0) / 1e6
    return {"total": total, "ampfx": own, "torch": torch_total, "other": total - own - torch_total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    runs = [one() for _ in range(args.reps)]
    best = min(runs, key=lambda r: r["total"])
    helps = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "ampfx", "--help"], capture_output=True, check=True)
        helps.append(time.perf_counter() - t0)
    import torch
    print(f"import ampfx, best of {args.reps} (torch {torch.__version__}, python {sys.version.split()[0]}): "
          f"{best['total']:.2f} s = ampfx's own modules {best['ampfx']:.2f} s + torch {best['torch']:.2f} s + "
          f"other libraries {best['other']:.2f} s; python -m ampfx --help: {min(helps):.2f} s")


if __name__ == "__main__":
    main()
