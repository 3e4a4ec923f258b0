#!/usr/bin/env bash
# Set up .venv if needed, lint, and run the whole test suite (unit, Ray integration, XLA on CPU)
# in two test processes (pytest-xdist), a file to a process: most of the suite waits on Ray and on
# subprocesses, so two processes keep both cores busy. One process: scripts/test.sh -n 0
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -ra --durations=15 -n 2 --dist loadfile "$@"
