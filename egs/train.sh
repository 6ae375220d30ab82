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
# Fine-tuning (docs/training.md, "Fine-tuning with LoRA"): --start-from CHECKPOINT (ours or
#   lifeiteng/vall-e's; its architecture wins over the model flags below) with --lora-rank R
#   trains rank-R adapters on the frozen weights with settings for a few hours of data: AdamW,
#   lr --finetune-lr 5e-4, 100 warm-up steps then cosine to 0 over --finetune-steps 2000 steps
#   per stage (AR, then NAR), validation, held-out samples in TensorBoard and a checkpoint
#   every 250 steps, in --exp-dir (default exp/lora). The corpus must be tokenized with the
#   base's symbol table, given as --text-tokens (prepare.sh --extra-tokenizer-flags
#   "--text-tokens TABLE"). --start-from without --lora-rank trains every weight from there.
#   --add-language NAME (a VALL-E X checkpoint): its language tables grow by NAME's row, which
#   trains with the adapters (docs/training.md, "A new language").
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
start_from=""       # initial weights: ours or lifeiteng/vall-e's
lora_rank=0         # > 0 (needs --start-from): LoRA fine-tuning with the settings above
lora_alpha=""       # default: 2 x --lora-rank
lora_targets=attn,ffn
finetune_steps=2000 # per stage, with --lora-rank
finetune_lr=5e-4
text_tokens=""      # the symbol table (default: data/tokenized's); with --start-from: the base's
add_language=""     # with --start-from a VALL-E X checkpoint: teach it this language (espeak voice, e.g. de)
add_language_init=mean  # its row starts as the mean of the others, or a copy of one (e.g. en)
options="dataset recipe nproc dtype num_epochs max_duration memory_budget_gb max_text_tokens shar_dir exp_dir num_languages languages python start_from lora_rank lora_alpha lora_targets finetune_steps finetune_lr text_tokens add_language add_language_init"
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
if [ -n "$text_tokens" ]; then train+=(--text-tokens "$text_tokens"); fi
if [ "$lora_rank" -gt 0 ]; then
  [ -n "$start_from" ] || { echo "$0: --lora-rank needs --start-from (the weights to adapt)" >&2; exit 1; }
  [ "$exp_dir" != exp/valle ] || train+=(--exp-dir exp/lora)
  # Later flags win: these replace the from-scratch schedule above.
  train+=(--start-from "$start_from" --lora-rank "$lora_rank" --lora-alpha "${lora_alpha:-$((2 * lora_rank))}"
          --lora-targets "$lora_targets" --lora-dropout 0.05
          --optimizer-name AdamW --scheduler-name Cosine --base-lr "$finetune_lr" --warmup-steps 100
          --max-steps "$finetune_steps" --num-epochs 1000
          --valid-interval 250 --save-every-n 250 --valid-samples 4 --tensorboard true)
elif [ -n "$start_from" ]; then
  train+=(--start-from "$start_from")
fi
if [ -n "$add_language" ]; then train+=(--add-language "$add_language" --add-language-init "$add_language_init"); fi
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
