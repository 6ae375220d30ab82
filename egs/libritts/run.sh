#!/usr/bin/env bash
# Train VALL-E on LibriTTS after ./prepare.sh: two-stage (AR, then NAR) by default,
# --recipe single-stage for both at once; every flag of egs/train.sh passes through.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
exec bash ../train.sh --dataset libritts "$@"
