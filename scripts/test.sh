#!/usr/bin/env bash
# Set up .venv if needed, lint, and run the whole test suite (unit, Ray integration, XLA on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -ra --durations=15 "$@"
