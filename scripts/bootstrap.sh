#!/usr/bin/env bash
# Create .venv and install raytpu with the extras named (default: every job, torch_xla and the test
# tools, as the test command needs them; the quick start names only its job's). Every set-up installs
# torch==2.9.0, the one torch torch_xla 2.9.0 works with, so that the quick start and the tests share
# one torch (the quick start first, then the tests: torch is downloaded once).
# The interpreter: $PYTHON (default python3), 3.10 or newer, with its venv module.
# Idempotent: a run whose extras are already installed (`mshnet` after the default) only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-all,xla,dev}"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    if ! "$PYTHON" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        echo "raytpu: error: $PYTHON is not a Python 3.10+ with its venv module: install one (Debian/Ubuntu:" \
            "apt install python3-venv) or name it with PYTHON=/path/to/python3" >&2
        exit 2
    fi
    "$PYTHON" -m venv .venv
fi
# installed: every requirement of the extras named (and of those they name, as `all` names every
# job's) is there at a version it accepts, by raytpu's installed metadata, and pyproject.toml has not
# changed since the last install; `mshnet` after `all` only checks
marker=".venv/.raytpu-installed"
if ! .venv/bin/python - "$EXTRAS" 2>/dev/null <<'PY' || [ ! -e "$marker" ] || [ pyproject.toml -nt "$marker" ]; then
import sys
from importlib.metadata import PackageNotFoundError, distribution, version

from packaging.requirements import Requirement


def satisfied(name: str, extras: set[str]) -> bool:
    """Whether every requirement of ``name`` with ``extras``, and of theirs, is installed."""
    for text in distribution(name).requires or []:
        req = Requirement(text)
        if req.marker is not None and not any(req.marker.evaluate({"extra": extra}) for extra in extras):
            continue
        try:
            if not req.specifier.contains(version(req.name), prereleases=True):
                return False
        except PackageNotFoundError:
            return False
        if req.extras and not satisfied(req.name, set(req.extras) | {""}):
            return False
    return True


sys.exit(not satisfied("raytpu", set(sys.argv[1].split(",")) | {""}))
PY
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".[$EXTRAS]" "torch==2.9.0"
    touch "$marker"
fi
# raytpu's own sources compiled to bytecode once (pip compiles site-packages, not an editable
# install's folders): every process that imports them, each Ray worker among them, then reads the
# bytecode, also where PYTHONDONTWRITEBYTECODE keeps Python from writing it (Docker images set it)
.venv/bin/python -m compileall -q -j 0 raytpu jobs examples > /dev/null
TORCH_DEVICE_BACKEND_AUTOLOAD=0 .venv/bin/python - <<'PY'
import importlib.util

import ray
import torch

found = f"torch {torch.__version__}, ray {ray.__version__}"
if importlib.util.find_spec("torch_xla"):
    import torch_xla

    assert torch.__version__.split("+")[0] == torch_xla.__version__.split("+")[0], (torch.__version__, torch_xla.__version__)
    found += f", torch_xla {torch_xla.__version__}"
if importlib.util.find_spec("torch_tpu"):
    from importlib.metadata import version

    found += f", torch_tpu {version('torch-tpu')}"
print(f"raytpu environment ready: {found}")
PY
