#!/usr/bin/env bash
# Set up .venv if needed, lint, and run the whole test suite (unit, Ray integration, XLA on CPU):
# first in two test processes (pytest-xdist, a file to a process: most of the suite waits on Ray and
# on subprocesses, so two keep both cores busy; the files in collection order, the longest first:
# tests/conftest.py), then the tests marked `quiet` (they time a run to 10%) alone on the machine,
# collected from their own files only (collecting all of them imports torch, Ray, Transformers...:
# 10 s against 2.5 s). Arguments go to both pytest runs (and then the second
# collects what they name); -n 0 runs the first in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check .
status=0
.venv/bin/python -m pytest -ra --durations=15 -n 2 --dist loadfile --no-loadscope-reorder -m "not quiet" "$@" || status=$?
quiet_files=()
[ "$#" -gt 0 ] || mapfile -t quiet_files < <(grep -l "mark.quiet" tests/test_*.py)
.venv/bin/python -m pytest -ra -m quiet "${quiet_files[@]}" "$@" || {
    code=$?
    [ "$code" -eq 5 ] || status=$code # 5: the arguments chose no quiet test
}
exit "$status"
