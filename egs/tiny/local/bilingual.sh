#!/usr/bin/env bash
# VALL-E X on the bilingual tiny corpus (English + Mandarin eSpeak NG voices), on CPU, and
# cross-lingual synthesis (what egs/tiny/run.sh --bilingual true runs):
#   0 corpus (prepare.sh --bilingual true): --limit sentences per language, one symbol table,
#     one phoneme judge over both languages' phonemes
#   1 train AR and NAR together (--train-stage 0) with --num-languages 2 --languages en-us,cmn
#   2 bin/infer.py twice: English text from Mandarin prompts (--language en-us --prompt-language
#     cmn), Mandarin text from English prompts (--language cmn --prompt-language en-us)
#   3 bin/evaluate.py: PER per language (each text phonemized in its own language)
#   egs/tiny/local/bilingual.sh [--stage 0] [--stop-stage 3] [--limit 30] [--max-steps 400]
#       [--data-dir data/bilingual] [--exp exp/bilingual] [--num-items 2] [--judge-epochs 30]
#       [--speaker-model resemblyzer|none] [--codec encodec|mel-rvq|auto]
# Without EnCodec weights the codes come from a RANDOM EnCodec (--codec encodec) or the offline
# mel-rvq codec (--codec auto): a few hundred CPU steps on 2 x 30 sentences make no intelligible
# speech; the point is the pipeline, and the per-language PER is its measure.
set -euo pipefail

stage=0
stop_stage=3
limit=30
max_steps=400
data_dir=data/bilingual   # under egs/tiny
exp=exp/bilingual         # under egs/tiny
num_items=2
judge_epochs=30
speaker_model=resemblyzer
codec=encodec
python=${PYTHON:-python}

options="stage stop_stage limit max_steps data_dir exp num_items judge_epochs speaker_model codec python"
. "$(dirname "${BASH_SOURCE[0]}")/../../parse_options.sh"

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
root=$(cd "$here/../.." && pwd)
cd "$here"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
data=$data_dir/tokenized
log() { echo "$(date '+%F %T') [tiny bilingual stage $1] ${*:2}"; }

if [ "$stage" -le 0 ] && [ "$stop_stage" -ge 0 ]; then
  log 0 "bilingual corpus ($limit sentences per language), tokens, phoneme judge -> $data_dir"
  PYTHON="$python" bash "$here/prepare.sh" --data-dir "$data_dir" --bilingual true --limit "$limit" \
    --codec "$codec" --judge-epochs "$judge_epochs" --num-jobs 0
fi

if [ "$stage" -le 1 ] && [ "$stop_stage" -ge 1 ]; then
  log 1 "train VALL-E X (AR + NAR, --num-languages 2: en-us id 0, cmn id 1) for $max_steps steps -> $exp"
  "$python" "$root/bin/trainer.py" --model-name valle --decoder-dim 64 --nhead 2 --num-decoder-layers 2 \
    --prefix-mode 1 --dropout 0.0 --num-languages 2 --languages en-us,cmn \
    --manifest-dir "$data" --dataset tiny --max-duration 12 --num-buckets 1 --num-workers 0 \
    --device cpu --dtype float32 --train-stage 0 --num-epochs 100000 --max-steps "$max_steps" \
    --base-lr 0.05 --warmup-steps 10 --log-interval 10 --valid-interval "$max_steps" \
    --save-every-n "$max_steps" --exp-dir "$exp"
fi

infer=$exp/infer
if [ "$stage" -le 2 ] && [ "$stop_stage" -ge 2 ]; then
  log 2 "cross-lingual synthesis: English text / Mandarin prompt, Mandarin text / English prompt"
  "$python" "$here/local/crosslingual_items.py" --cuts "$data/tiny_cuts_test.jsonl.gz" \
    --num-items "$num_items" --out-dir "$infer"
  for direction in en-us:cmn:en_text_zh_prompt cmn:en-us:zh_text_en_prompt; do
    IFS=: read -r language prompt_language name <<< "$direction"
    "$python" "$root/bin/infer.py" --checkpoint "$exp" --device cpu --tsv "$infer/$name.tsv" \
      --language "$language" --prompt-language "$prompt_language" --output-dir "$infer" \
      --top-k 3 --min-len-ratio 2 --max-len-ratio 4 --seed 1 --allow-random-encodec ||
      log 2 "$name: some items gave no audio: the evaluation scores them as silence"
  done
fi

if [ "$stage" -le 3 ] && [ "$stop_stage" -ge 3 ]; then
  log 3 "evaluate: PER per language by the shared phoneme judge"
  "$python" "$root/bin/evaluate.py" --tsv "$infer/eval.tsv" --output-dir "$infer" --manifest-dir "$data" \
    --checkpoint "$exp/checkpoint-$max_steps.pt" --no-references --missing-as-empty \
    --speaker-model "$speaker_model" --max-len-ratio 4 --output-json "$exp/eval.json"
fi
