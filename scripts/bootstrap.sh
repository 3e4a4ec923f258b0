#!/usr/bin/env bash
# Create .venv and install raytpu with the extras named (default: every job, torch_xla and the test
# tools, as the test command needs them; the quick start names only its job's). torch==2.9.0 comes
# with the xla extra, the one torch torch_xla 2.9.0 works with.
# Idempotent: a second run with the same extras only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-all,xla,dev}"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
marker=".venv/.raytpu-installed-${EXTRAS//,/-}"
if ! .venv/bin/python -c "import raytpu, ray" 2>/dev/null || [ ! -e "$marker" ] || [ pyproject.toml -nt "$marker" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".[$EXTRAS]"
    touch "$marker"
fi
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
