#!/usr/bin/env bash
# LJSpeech -> tokenized lhotse cuts for valle (single speaker, 22.05 kHz: cuts are resampled
# to the codec's 24 kHz; the text phonemized is the corpus's normalized text).
#   egs/ljspeech/prepare.sh [--stage 0] [--stop-stage 4] [--python python] [--data-dir data]
#       [--corpus-dir DIR] [--encodec-checkpoint PATH] [--device auto] [--num-jobs 4]
#       [--num-dev 300] [--num-test 300] [--shar-shard-size 1000]
# Stages: 0 download (skipped when --corpus-dir already holds the corpus), 1 lhotse prepare,
#         2 tokenize (bin/tokenizer.py; restartable), 3 split: first --num-dev cuts -> dev,
#         next --num-test -> test, the rest -> train, 4 statistics, 5 (on request) Lhotse
#         Shar shards of train (--stop-stage 5; train with --shar-dir).
set -euo pipefail

stage=0
stop_stage=4
python=${PYTHON:-python}
data_dir=data
corpus_dir=""
encodec_checkpoint=""
device=auto
num_jobs=4
num_dev=300
num_test=300
shar_shard_size=1000
extra_tokenizer_flags=""

options="stage stop_stage python data_dir corpus_dir encodec_checkpoint device num_jobs num_dev num_test shar_shard_size extra_tokenizer_flags"
. "$(dirname "${BASH_SOURCE[0]}")/../parse_options.sh"

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
corpus_dir=${corpus_dir:-$data_dir/download/LJSpeech-1.1}
tok=$data_dir/tokenized
recipe=("$python" -m valle.data.recipe)
log() { echo "$(date '+%F %T') [ljspeech stage $1] ${*:2}"; }

if [ "$stage" -le 0 ] && [ "$stop_stage" -ge 0 ]; then
  if [ -d "$corpus_dir" ]; then
    log 0 "corpus found at $corpus_dir: no download"
  else
    log 0 "download LJSpeech -> $(dirname "$corpus_dir")"
    "${recipe[@]}" download ljspeech "$(dirname "$corpus_dir")"
  fi
fi

if [ "$stage" -le 1 ] && [ "$stop_stage" -ge 1 ]; then
  [ -d "$corpus_dir" ] || { echo "$0: no corpus at $corpus_dir (run stage 0 or pass --corpus-dir)" >&2; exit 1; }
  log 1 "lhotse prepare $corpus_dir -> $data_dir/manifests"
  "${recipe[@]}" prepare ljspeech "$corpus_dir" "$data_dir/manifests"
fi

if [ "$stage" -le 2 ] && [ "$stop_stage" -ge 2 ]; then
  audio_flags=()
  if [ -n "$encodec_checkpoint" ]; then audio_flags=(--encodec-checkpoint "$encodec_checkpoint"); fi
  log 2 "tokenize -> $tok (restartable: finished chunks are kept)"
  # shellcheck disable=SC2086  # extra_tokenizer_flags is a list of flags
  "$python" "$root/bin/tokenizer.py" --src-dir "$data_dir/manifests" --output-dir "$tok" \
    --prefix ljspeech --dataset-parts all --suffix jsonl.gz --device "$device" \
    --text-extractor espeak --audio-extractor Encodec --num-jobs "$num_jobs" \
    ${audio_flags[@]+"${audio_flags[@]}"} $extra_tokenizer_flags
fi

if [ "$stage" -le 3 ] && [ "$stop_stage" -ge 3 ]; then
  log 3 "split: first $num_dev cuts -> dev, next $num_test -> test, the rest -> train"
  "${recipe[@]}" split "$tok/ljspeech_cuts_all.jsonl.gz" --output-dir "$tok" --prefix ljspeech \
    --dev "$num_dev" --test "$num_test"
fi

if [ "$stage" -le 4 ] && [ "$stop_stage" -ge 4 ]; then
  log 4 "statistics"
  "${recipe[@]}" describe "$tok"/ljspeech_cuts_{train,dev,test}.jsonl.gz
fi

if [ "$stage" -le 5 ] && [ "$stop_stage" -ge 5 ]; then
  log 5 "Lhotse Shar shards of train -> $data_dir/shar/train (train with --shar-dir)"
  "${recipe[@]}" shar "$tok/ljspeech_cuts_train.jsonl.gz" "$data_dir/shar/train" --shard-size "$shar_shard_size"
fi
