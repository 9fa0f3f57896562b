#!/usr/bin/env bash
# Set up, then run every test lane available here:
#   core: torch 2.13 CPU (.venv) - unit tests, doctests in ampfx/, the examples' smoke test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q ampfx tests "$@"
