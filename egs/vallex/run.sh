#!/usr/bin/env bash
# Train VALL-E X on LibriTTS + AISHELL-3 after ./prepare.sh: a language-id embedding over two
# languages, ids in the order en-us (0), cmn (1) (recorded in every checkpoint's config, which
# bin/infer.py --prompt-language/--language read); two-stage (AR, then NAR) by default, every
# flag of egs/train.sh passes through.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
exec bash ../train.sh --dataset vallex --num-languages 2 --languages en-us,cmn "$@"
