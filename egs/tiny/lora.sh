#!/usr/bin/env bash
# LoRA fine-tuning on CPU, end to end (docs/training.md, "Fine-tuning with LoRA"): a small base
# model trained on egs/tiny's 4 eSpeak voices, then rank-R adapters fitted to a voice it never
# heard (eSpeak en-us+f2, egs/tiny/local/new_voice.py) with the base frozen, then merged.
#   egs/tiny/lora.sh [--stage 0] [--stop-stage 5] [--python python] [--data-dir data/tiny-lora]
#                    [--exp-dir exp/tiny-lora] [--limit 48] [--base-steps 120] [--lora-steps 60]
#                    [--lora-rank 2] [--voice en-us+f2]
# Stages: 0 the base corpus (egs/tiny/prepare.sh)    1 the base model (every weight trains)
#         2 the new voice's corpus, tokenized with the BASE's symbol table
#         3 the base's validation loss on the new voice (a LoRA run with lr 0: B = 0, the base)
#         4 LoRA fine-tuning (adapters alone train; validation samples in TensorBoard)
#         5 merge (bin/infer.py --merge-lora) and the summary: losses, file sizes
set -euo pipefail

stage=0
stop_stage=5
python=${PYTHON:-python}
data_dir=data/tiny-lora
exp_dir=exp/tiny-lora
limit=48
base_steps=120
lora_steps=60
lora_rank=2
voice=en-us+f2
options="stage stop_stage python data_dir exp_dir limit base_steps lora_steps lora_rank voice"
. "$(dirname "${BASH_SOURCE[0]}")/../parse_options.sh"

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
log() { echo "$(date '+%F %T') [tiny lora stage $1] ${*:2}"; }
base_data=$data_dir/base/tokenized
voice_data=$data_dir/voice/tokenized
table=$base_data/unique_text_tokens.k2symbols
base=$exp_dir/base/best-valid-loss.pt
model=(--model-name valle --decoder-dim 128 --nhead 4 --num-decoder-layers 2 --prefix-mode 1 --dropout 0.0)
common=(--max-duration 16 --num-workers 0 --device cpu --dtype float32 --log-interval 10
        --average-period 0 --oom-check false --collective-timeout 120)
# The fine-tuning settings of egs/train.sh --lora-rank, scaled to this corpus: AdamW, cosine
# schedule over --lora-steps, alpha = 2 x rank.
lora=(--start-from "$base" --lora-rank "$lora_rank" --lora-alpha $((2 * lora_rank)) --lora-targets attn,ffn
      --optimizer-name AdamW --scheduler-name Cosine --warmup-steps 5 --manifest-dir "$voice_data"
      --dataset voice --text-tokens "$table" --num-epochs 1000)

if [ "$stage" -le 0 ] && [ "$stop_stage" -ge 0 ]; then
  log 0 "the base corpus: $limit sentences in egs/tiny's 4 voices -> $base_data"
  PYTHON="$python" bash "$here/prepare.sh" --data-dir "$data_dir/base" --limit "$limit" --num-jobs 0
fi

if [ "$stage" -le 1 ] && [ "$stop_stage" -ge 1 ]; then
  log 1 "the base model: $base_steps steps, every weight -> $exp_dir/base"
  "$python" "$root/bin/trainer.py" "${model[@]}" "${common[@]}" --manifest-dir "$base_data" --dataset tiny \
    --optimizer-name AdamW --base-lr 0.003 --scheduler-name Cosine --warmup-steps 10 \
    --max-steps "$base_steps" --num-epochs 1000 --valid-interval "$base_steps" \
    --save-every-n "$base_steps" --valid-samples 0 --exp-dir "$exp_dir/base"
fi

if [ "$stage" -le 2 ] && [ "$stop_stage" -ge 2 ]; then
  log 2 "the new voice ($voice): $limit sentences, tokenized with the base's symbol table -> $voice_data"
  "$python" "$here/local/new_voice.py" --sentences "$here/sentences.txt" --out-dir "$data_dir/voice/corpus" \
    --voice "$voice" --limit "$limit"
  "$python" -m valle.data.tiny manifests --corpus-dir "$data_dir/voice/corpus" \
    --output-dir "$data_dir/voice/manifests" --prefix voice
  "$python" "$root/bin/tokenizer.py" --src-dir "$data_dir/voice/manifests" --output-dir "$voice_data" \
    --prefix voice --dataset-parts all --suffix jsonl.gz --num-jobs 0 --allow-random-encodec \
    --text-tokens "$table"
  "$python" -m valle.data.tiny split --cuts "$voice_data/voice_cuts_all.jsonl.gz" \
    --output-dir "$voice_data" --prefix voice
fi

if [ "$stage" -le 3 ] && [ "$stop_stage" -ge 3 ]; then
  log 3 "the base's validation loss on the new voice (lr 0: the adapters' B stays 0)"
  "$python" "$root/bin/trainer.py" "${model[@]}" "${common[@]}" "${lora[@]}" --base-lr 0 --warmup-steps 0 --max-steps 1 \
    --valid-interval 1 --save-every-n 1 --valid-samples 0 --exp-dir "$exp_dir/before"
fi

if [ "$stage" -le 4 ] && [ "$stop_stage" -ge 4 ]; then
  log 4 "LoRA rank $lora_rank on the frozen base: $lora_steps steps -> $exp_dir/lora"
  "$python" "$root/bin/trainer.py" "${model[@]}" "${common[@]}" "${lora[@]}" --base-lr 0.01 \
    --max-steps "$lora_steps" --valid-interval $((lora_steps / 2)) --save-every-n "$lora_steps" \
    --valid-samples 1 --valid-samples-max-seconds 2 --exp-dir "$exp_dir/lora"
fi

if [ "$stage" -le 5 ] && [ "$stop_stage" -ge 5 ]; then
  log 5 "merge the adapters into the base -> $exp_dir/lora/merged.pt"
  "$python" "$root/bin/infer.py" --checkpoint "$base" --lora "$exp_dir/lora/best-valid-loss.pt" \
    --merge-lora "$exp_dir/lora/merged.pt"
  before=$(grep -ho 'validation at step 1: loss [0-9.]*' "$exp_dir"/before/log/log-* | tail -1 | awk '{print $NF}')
  after=$(grep -ho "validation at step [0-9]*: loss [0-9.]*" "$exp_dir"/lora/log/log-* | tail -1 | awk '{print $NF}')
  adapters=$(stat -c %s "$exp_dir/lora/best-valid-loss.pt")
  merged=$(stat -c %s "$exp_dir/lora/merged.pt")
  echo "new voice $voice: validation loss per frame $before (base) -> $after (LoRA rank $lora_rank, $lora_steps steps)"
  echo "adapters file $adapters bytes = $(awk -v a="$adapters" -v m="$merged" 'BEGIN {printf "%.1f", 100 * a / m}')% of the merged checkpoint ($merged bytes)"
  echo "TensorBoard (validation samples): $exp_dir/lora/tensorboard"
fi
