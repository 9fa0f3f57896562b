#!/usr/bin/env bash
# Set up, then run every test lane, each in its own virtual environment:
#   core: torch 2.13 CPU (.venv) - unit tests, doctests in ampfx/, the docs' examples, the examples'
#   smoke tests, and a headless-Chromium check of the HTML report (chromium installed here if missing).
#   models: torch 2.14.1 + torchvision + timm + transformers (.venv-models), scripts/test-models.sh.
#   dgl: torch 2.2.1 + dgl 2.1.0 (.venv-dgl, ~5 GB on first build), scripts/test-dgl.sh.
#   trainers: torch 2.13 + pytorch-lightning 2.6 + accelerate 1.x + transformers 4.57 (.venv-trainers), and the
#   wheel installed into a fresh venv, scripts/test-trainers.sh.
# Arguments go to the core lane's pytest; SKIP_LANES="models" (or "models dgl trainers") skips those lanes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Debian's chromium renders the HTML report in a browser test; skipped with a message if it cannot be had
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
    || echo "chromium could not be installed: the browser test will be skipped"
fi
.venv/bin/python -m pytest -q ampfx tests "$@"
bash scripts/test-models.sh
bash scripts/test-dgl.sh
bash scripts/test-trainers.sh
