#!/usr/bin/env bash
# Train VALL-E on a tokenized corpus (egs/<corpus>/run.sh calls this), as in the original recipes.
#   egs/train.sh --dataset libritts [--recipe two-stage|single-stage] [--nproc 8] [--dtype auto]
#       [--max-duration auto|80] [--memory-budget-gb G] [--max-text-tokens auto|N|off]
#       [--shar-dir data/shar/train]
#       [--num-languages 2 --languages en-us,cmn]   (VALL-E X: egs/vallex/run.sh)
# two-stage (default): the AR (--train-stage 1), then the NAR (--train-stage 2) in the same
#   --exp-dir: stage 2 starts from the newest AR checkpoint (weights kept; optimizer,
#   scheduler and sampler state dropped, as the log says), then continues its own.
# single-stage: AR and NAR together (--train-stage 0).
# Every run resumes from the newest valid checkpoint in --exp-dir (torchrun --max-restarts too).
# --dtype auto (default): bfloat16 autocast where torch sees a GPU, float32 on CPU (bf16 autocast
#   there is slower than fp32); --dtype float16 trains with a GradScaler instead.
set -euo pipefail

dataset=""
recipe=two-stage
nproc=8
dtype=auto
num_epochs=20
# "": auto on a GPU (the largest batches that fit its memory, measured before training,
# docs/oom.md), 80 s on CPU; or seconds.
max_duration=""
memory_budget_gb=0  # --max-duration auto fills this much per GPU (0: its free memory at start)
# auto: from --max-duration and the corpus's text tokens per second (data/tokenized/
# <dataset>_text_stats.json, written by bin/tokenizer.py); the trainer logs the number.
max_text_tokens=auto
shar_dir=""   # e.g. data/shar/train (prepare.sh stage 5): stream train from Lhotse Shar shards
exp_dir=exp/valle
num_languages=0  # > 0: VALL-E X's language-id embedding; --languages gives the id order
languages=""
python=${PYTHON:-python}
options="dataset recipe nproc dtype num_epochs max_duration memory_budget_gb max_text_tokens shar_dir exp_dir num_languages languages python"
. "$(dirname "${BASH_SOURCE[0]}")/parse_options.sh"

[ -n "$dataset" ] || { echo "$0: --dataset is required" >&2; exit 1; }
# Runs in the recipe directory (egs/<dataset>): data/ and exp/ live there.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
has_gpu=false
if "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  has_gpu=true
fi
if [ "$dtype" = auto ]; then
  if $has_gpu; then dtype=bfloat16; else dtype=float32; fi
fi
if [ -z "$max_duration" ]; then
  if $has_gpu; then max_duration=auto; else max_duration=80; fi
fi

model=(--model-name valle --decoder-dim 1024 --nhead 16 --num-decoder-layers 12
       --prefix-mode 1 --share-embedding true --norm-first true --add-prenet false)
train=(--manifest-dir data/tokenized --dataset "$dataset" --max-duration "$max_duration"
       --max-text-tokens "$max_text_tokens" --memory-budget-gb "$memory_budget_gb"
       --filter-min-duration 0.5 --filter-max-duration 14 --num-buckets 6 --dtype "$dtype"
       --optimizer-name ScaledAdam --scheduler-name Eden --base-lr 0.05 --warmup-steps 200
       --average-period 0 --save-every-n 10000 --keep-last-k 20 --valid-interval 10000
       --num-epochs "$num_epochs" --exp-dir "$exp_dir")
if [ -n "$shar_dir" ]; then train+=(--shar-dir "$shar_dir"); fi
if [ "$num_languages" -gt 0 ]; then model+=(--num-languages "$num_languages"); fi
if [ -n "$languages" ]; then train+=(--languages "$languages"); fi
launch=("$python" -m torch.distributed.run --standalone --nproc_per_node "$nproc" --max-restarts 3
        "$root/bin/trainer.py")

case "$recipe" in
  two-stage)
    "${launch[@]}" "${model[@]}" "${train[@]}" --train-stage 1
    "${launch[@]}" "${model[@]}" "${train[@]}" --train-stage 2 ;;
  single-stage)
    "${launch[@]}" "${model[@]}" "${train[@]}" --train-stage 0 ;;
  *) echo "$0: --recipe must be two-stage or single-stage" >&2; exit 1 ;;
esac
