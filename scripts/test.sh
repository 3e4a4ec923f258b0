#!/usr/bin/env bash
# Set up .venv if needed, lint, and run the whole test suite (unit, Ray integration, XLA on CPU):
# first in two test processes (pytest-xdist, a file to a process: most of the suite waits on Ray and
# on subprocesses, so two keep both cores busy), then the tests marked `quiet` (they time a run to
# 10%) alone on the machine. Arguments go to both pytest runs; -n 0 runs the first in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check .
status=0
.venv/bin/python -m pytest -ra --durations=15 -n 2 --dist loadfile -m "not quiet" "$@" || status=$?
.venv/bin/python -m pytest -ra -m quiet "$@" || {
    code=$?
    [ "$code" -eq 5 ] || status=$code # 5: the arguments chose no quiet test
}
exit "$status"
