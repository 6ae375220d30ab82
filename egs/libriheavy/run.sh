#!/usr/bin/env bash
# Train VALL-E on Libriheavy after ./prepare.sh (libriheavy_cuts_train: small, medium and large
# as asked for; dev for validation): two-stage (AR, then NAR) by default, every flag of
# egs/train.sh passes through (e.g. --nproc 8 --shar-dir data/shar/train).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
exec bash ../train.sh --dataset libriheavy "$@"
