#!/usr/bin/env bash
# LibriTTS -> tokenized lhotse cuts for valle.
#   egs/libritts/prepare.sh [--stage 0] [--stop-stage 4] [--python python] [--data-dir data]
#       [--corpus-dir DIR] [--dataset-parts "dev-clean test-clean train-clean-100"]
#       [--encodec-checkpoint PATH] [--device auto] [--num-jobs 4] [--shar-shard-size 1000]
# Stages: 0 download (skipped when --corpus-dir already holds the corpus), 1 lhotse prepare,
#         2 tokenize (bin/tokenizer.py; restartable), 3 combine train parts -> train,
#         dev-clean -> dev, test-clean -> test, 4 statistics, 5 (on request) Lhotse Shar
#         shards of train for many-node training (--stop-stage 5; train with --shar-dir).
# --dataset-parts "all" means every part (about 585 h: plan disk and time accordingly).
set -euo pipefail

stage=0
stop_stage=4
python=${PYTHON:-python}
data_dir=data
corpus_dir=""
dataset_parts="dev-clean test-clean train-clean-100"
encodec_checkpoint=""
device=auto
num_jobs=4
shar_shard_size=1000
extra_tokenizer_flags=""

options="stage stop_stage python data_dir corpus_dir dataset_parts encodec_checkpoint device num_jobs shar_shard_size extra_tokenizer_flags"
. "$(dirname "${BASH_SOURCE[0]}")/../parse_options.sh"

if [ "$dataset_parts" = "all" ]; then
  dataset_parts="dev-clean dev-other test-clean test-other train-clean-100 train-clean-360 train-other-500"
fi
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
corpus_dir=${corpus_dir:-$data_dir/download/LibriTTS}
tok=$data_dir/tokenized
recipe=("$python" -m valle.data.recipe)
log() { echo "$(date '+%F %T') [libritts stage $1] ${*:2}"; }

if [ "$stage" -le 0 ] && [ "$stop_stage" -ge 0 ]; then
  if [ -d "$corpus_dir" ]; then
    log 0 "corpus found at $corpus_dir: no download"
  else
    log 0 "download LibriTTS ($dataset_parts) -> $(dirname "$corpus_dir")"
    # shellcheck disable=SC2086  # one argument per part
    "${recipe[@]}" download libritts "$(dirname "$corpus_dir")" $dataset_parts
  fi
fi

if [ "$stage" -le 1 ] && [ "$stop_stage" -ge 1 ]; then
  [ -d "$corpus_dir" ] || { echo "$0: no corpus at $corpus_dir (run stage 0 or pass --corpus-dir)" >&2; exit 1; }
  log 1 "lhotse prepare $corpus_dir -> $data_dir/manifests"
  # shellcheck disable=SC2086  # one argument per part
  "${recipe[@]}" prepare libritts --num-jobs "$num_jobs" "$corpus_dir" "$data_dir/manifests" $dataset_parts
fi

if [ "$stage" -le 2 ] && [ "$stop_stage" -ge 2 ]; then
  audio_flags=()
  if [ -n "$encodec_checkpoint" ]; then audio_flags=(--encodec-checkpoint "$encodec_checkpoint"); fi
  log 2 "tokenize -> $tok (restartable: finished parts and chunks are kept)"
  # shellcheck disable=SC2086  # extra_tokenizer_flags is a list of flags
  "$python" "$root/bin/tokenizer.py" --src-dir "$data_dir/manifests" --output-dir "$tok" \
    --prefix libritts --dataset-parts "$dataset_parts" --suffix jsonl.gz --device "$device" \
    --text-extractor espeak --audio-extractor Encodec --num-jobs "$num_jobs" \
    ${audio_flags[@]+"${audio_flags[@]}"} $extra_tokenizer_flags
fi

if [ "$stage" -le 3 ] && [ "$stop_stage" -ge 3 ]; then
  log 3 "combine: train parts -> libritts_cuts_train, dev-clean -> dev, test-clean -> test"
  train=()
  for p in $dataset_parts; do
    case "$p" in train-*) train+=("$tok/libritts_cuts_${p}.jsonl.gz") ;; esac
  done
  if [ ${#train[@]} -gt 0 ]; then
    "${recipe[@]}" combine "$tok/libritts_cuts_train.jsonl.gz" "${train[@]}"
  fi
  for pair in dev-clean:dev test-clean:test; do
    src=$tok/libritts_cuts_${pair%%:*}.jsonl.gz
    # one part: its cut ids are unique already (bin/tokenizer.py makes one cut per supervision id)
    if [ -f "$src" ]; then cp "$src" "$tok/libritts_cuts_${pair##*:}.jsonl.gz"; fi
    # and its tokenizer extremes record, under the name the trainer looks for
    record=$tok/libritts_extremes_${pair%%:*}.json
    if [ -f "$record" ]; then cp "$record" "$tok/libritts_extremes_${pair##*:}.json"; fi
  done
fi

if [ "$stage" -le 4 ] && [ "$stop_stage" -ge 4 ]; then
  files=()
  for part in train dev test; do
    f=$tok/libritts_cuts_${part}.jsonl.gz
    if [ -f "$f" ]; then files+=("$f"); fi
  done
  log 4 "statistics"
  "${recipe[@]}" describe "${files[@]}"
fi

if [ "$stage" -le 5 ] && [ "$stop_stage" -ge 5 ]; then
  log 5 "Lhotse Shar shards of train -> $data_dir/shar/train (train with --shar-dir)"
  "${recipe[@]}" shar "$tok/libritts_cuts_train.jsonl.gz" "$data_dir/shar/train" --shard-size "$shar_shard_size"
fi
