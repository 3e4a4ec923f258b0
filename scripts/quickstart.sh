#!/usr/bin/env bash
# Set up .venv if needed (raytpu with the MSHNet job's extra), then train MSHNet small on 2 local Ray CPU workers
# (synthetic IRSTD-format data made on the fly) and test its best checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh mshnet   # what the quick start runs: the MSHNet job's extra
mkdir -p results
.venv/bin/raytpu train jobs/mshnet/small.yaml "$@" | tee results/.quickstart.log
best=$(sed -n 's/^best checkpoint: *//p' results/.quickstart.log | tail -1)
.venv/bin/raytpu test jobs/mshnet/small.yaml --checkpoint "$best" "$@"
