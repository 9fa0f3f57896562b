#!/usr/bin/env bash
# Set up, then run the main job on the built-in example: convert it, say what stays float32 and why,
# save the full log and its HTML page in ampfx-demo/, train it in float32 and with ampfx side by side.
# Extra arguments go to `ampfx demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
# The arguments first, before the set-up: ampfx's parser needs only the standard library (no torch, no venv), so the
# Python that creates the venv checks them (ampfx.ui.cli.check). A bad one is named at once (exit 2); --help prints
# the help, the only thing the check writes to stdout, and nothing is set up.
help=$("${PYTHON:-python3}" -c 'import sys; from ampfx.ui.cli import check; sys.exit(check(["demo", *sys.argv[1:]]))' "$@")
if [ -n "$help" ]; then
  printf '%s\n' "$help"
  exit 0
fi
bash scripts/setup.sh >&2
exec .venv/bin/ampfx demo "$@"
