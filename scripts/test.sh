#!/usr/bin/env bash
# Set up .venv if needed, lint, and run the whole test suite (unit, Ray integration, XLA on CPU) in two
# test processes (pytest-xdist, a file to a process: most of the suite waits on Ray and on
# subprocesses, so two keep both cores busy; the files in collection order, the longest first:
# tests/conftest.py). Arguments go to pytest; `--fast` first runs only what needs neither Ray nor
# torch_xla (not marked integration or xla), for the edit-test cycle.
set -euo pipefail
cd "$(dirname "$0")/.."
markers=()
if [ "${1:-}" = "--fast" ]; then
    shift
    markers=(-m "not integration and not xla")
fi
bash scripts/bootstrap.sh
.venv/bin/ruff check .
.venv/bin/python -m compileall -q -j 0 tests bench > /dev/null  # as bootstrap.sh compiles raytpu's
exec .venv/bin/python -m pytest -ra --durations=25 -n 2 --dist loadfile --no-loadscope-reorder "${markers[@]}" "$@"
