#!/usr/bin/env bash
# Set up, then run the main job on the built-in example: convert it, say what stays float32 and why,
# save the full log and its HTML page in ampfx-demo/, train it in float32 and with ampfx side by side.
# Extra arguments go to `ampfx demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >&2
exec .venv/bin/ampfx demo "$@"
