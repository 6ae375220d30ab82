#!/usr/bin/env bash
# The smoke set on the newest CPU torch (make smoke-newest-torch; .ci/run after `make test`):
# a second venv with that torch and valle's own requirements only (no torchaudio, encodec or
# vocos: it proves valle runs without them), then the tests marked `smoke` (pyproject):
# tokenize the tiny corpus with EnCodec, train a few steps on 2 gloo ranks, synthesize with
# EnCodec and Vocos, the page's API, and the codecs against their recorded references.
#   SMOKE_TORCH=2.13.0 SMOKE_VENV=.venv-newtorch bash scripts/smoke_newest_torch.sh
set -euo pipefail
cd "$(dirname "$0")/.."
torch_version=${SMOKE_TORCH:-2.13.0}  # the newest CPU wheel this machine holds (pip takes it from disk)
venv=${SMOKE_VENV:-.venv-newtorch}
python=${PYTHON:-python3}
stamp=$venv/.installed-torch-$torch_version

test -x "$venv/bin/python" || "$python" -m venv "$venv"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  "$venv/bin/python" -m pip install -q --upgrade pip
  # torch first and alone: a bare `torch` requirement would otherwise fetch a CUDA build.
  "$venv/bin/python" -m pip install -q "torch==$torch_version"
  "$venv/bin/python" -m pip install -q -e '.[dev,serve]' "torch==$torch_version"
  touch "$stamp"
fi
"$venv/bin/python" - <<'PY'
import importlib.util, sys, torch
present = [m for m in ("torchaudio", "encodec", "vocos") if importlib.util.find_spec(m)]
if present:
    sys.exit(f"smoke venv: {present} installed; the smoke set proves valle runs without them")
print(f"smoke: torch {torch.__version__}, no torchaudio/encodec/vocos")
PY
VALLE_SMOKE=1 OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest -q -m smoke -p no:cacheprovider --durations=5 \
  tests/test_smoke.py tests/test_serve.py tests/codec/test_encodec_model.py tests/codec/test_vocos.py \
  tests/codec/test_audio.py
