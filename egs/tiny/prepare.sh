#!/usr/bin/env bash
# Tiny multi-speaker corpus, synthesised locally with eSpeak NG (no network), tokenized.
#   egs/tiny/prepare.sh [--stage 0] [--stop-stage 3] [--python python] [--data-dir data/tiny]
# EnCodec runs with RANDOM weights unless --encodec-checkpoint is given (or the torch hub
# cache holds encodec_24khz-d7cc33bc.th): the codes exercise the pipeline, they are not speech.
set -euo pipefail

stage=0
stop_stage=3
python=${PYTHON:-python}
data_dir=data/tiny
num_jobs=1
encodec_checkpoint=""
limit=""

options="stage stop_stage python data_dir num_jobs encodec_checkpoint limit"
. "$(dirname "${BASH_SOURCE[0]}")/../parse_options.sh"

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
log() { echo "$(date '+%F %T') [tiny stage $1] ${*:2}"; }

if [ "$stage" -le 0 ] && [ "$stop_stage" -ge 0 ]; then
  log 0 "synthesise the corpus with eSpeak NG -> $data_dir/corpus"
  "$python" -m valle.data.tiny synth --sentences "$here/sentences.txt" --out-dir "$data_dir/corpus" \
    ${limit:+--limit "$limit"}
fi

if [ "$stage" -le 1 ] && [ "$stop_stage" -ge 1 ]; then
  log 1 "lhotse manifests -> $data_dir/manifests"
  "$python" -m valle.data.tiny manifests --corpus-dir "$data_dir/corpus" --output-dir "$data_dir/manifests"
fi

if [ "$stage" -le 2 ] && [ "$stop_stage" -ge 2 ]; then
  if [ -n "$encodec_checkpoint" ]; then
    audio_flags=(--encodec-checkpoint "$encodec_checkpoint")
  else
    log 2 "no --encodec-checkpoint: EnCodec uses RANDOM weights (--allow-random-encodec)"
    audio_flags=(--allow-random-encodec)
  fi
  log 2 "tokenize (phonemes + EnCodec codes) -> $data_dir/tokenized"
  "$python" "$root/bin/tokenizer.py" --src-dir "$data_dir/manifests" --output-dir "$data_dir/tokenized" \
    --prefix tiny --dataset-parts all --suffix jsonl.gz --num-jobs "$num_jobs" "${audio_flags[@]}"
fi

if [ "$stage" -le 3 ] && [ "$stop_stage" -ge 3 ]; then
  log 3 "split train/dev/test per speaker"
  "$python" -m valle.data.tiny split --cuts "$data_dir/tokenized/tiny_cuts_all.jsonl.gz" \
    --output-dir "$data_dir/tokenized" --prefix tiny
  ls -l "$data_dir/tokenized"
fi
