#!/usr/bin/env bash
# Set up, then run the main job on the built-in example: convert it, print the report,
# train it in float32 and with ampfx side by side. Extra arguments go to `ampfx demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >&2
exec .venv/bin/ampfx demo "$@"
