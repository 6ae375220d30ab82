#!/usr/bin/env bash
# `make gpu-check`: every GPU check in one run. Uses the venv when there is one,
# else the machine's own python (a stock torch is enough: valle.models/valle.train need torch only).
set -euo pipefail
cd "$(dirname "$0")/.."
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
export PYTHONUNBUFFERED=1
"$py" scripts/gpu_check.py "$@"  # --device cpu: a smoke run without a GPU
