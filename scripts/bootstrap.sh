#!/usr/bin/env bash
# Create .venv and install raytpu with its extras, pinned (torch==2.9.0 for torch_xla 2.9.0).
# Idempotent: a second run only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import raytpu, torch_xla, ray, pytest" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.raytpu-installed ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e '.[all,xla,dev]'
    touch .venv/.raytpu-installed
fi
.venv/bin/python - <<'PY'
import torch, torch_xla, ray
assert torch.__version__.split("+")[0] == torch_xla.__version__.split("+")[0], (torch.__version__, torch_xla.__version__)
print(f"raytpu environment ready: torch {torch.__version__}, torch_xla {torch_xla.__version__}, ray {ray.__version__}")
PY
