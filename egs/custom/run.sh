#!/usr/bin/env bash
# Train VALL-E from scratch on your own corpus after ./prepare.sh: two-stage (AR, then NAR) by
# default, --recipe single-stage for both at once; every flag of egs/train.sh passes through
# (--nproc, --dtype, --max-duration, --num-epochs, --exp-dir, ...). A corpus in several
# languages also needs --num-languages N --languages a,b (as egs/vallex/run.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
exec bash ../train.sh --dataset custom "$@"
