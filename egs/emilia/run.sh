#!/usr/bin/env bash
# Train VALL-E X on Emilia after ./prepare.sh: a language-id embedding over its six languages,
# ids in the order en-us (0), cmn (1), de (2), fr-fr (3), ja (4), ko (5) (recorded in every
# checkpoint's config, which bin/infer.py --prompt-language/--language read); two-stage (AR,
# then NAR) by default, every flag of egs/train.sh passes through. A recipe prepared with fewer
# --languages passes its own: ./run.sh --num-languages 2 --languages en-us,cmn
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
exec bash ../train.sh --dataset emilia --num-languages 6 --languages en-us,cmn,de,fr-fr,ja,ko "$@"
