#!/usr/bin/env bash
# LibriTTS -> tokenized lhotse cuts for valle.
#   egs/libritts/prepare.sh [--stage 0] [--stop-stage 4] [--python python] [--data-dir data]
#       [--dataset-parts "dev-clean test-clean"] [--encodec-checkpoint PATH] [--num-jobs 4]
# Stages: 0 download, 1 lhotse prepare, 2 tokenize (bin/tokenizer.py), 3 combine train parts,
#         4 statistics (lhotse cut describe).
# --dataset-parts "all" means every part (about 585 h: plan disk and time accordingly).
set -euo pipefail

stage=0
stop_stage=4
python=${PYTHON:-python}
data_dir=data
dataset_parts="dev-clean test-clean train-clean-100"
encodec_checkpoint=""
num_jobs=4

options="stage stop_stage python data_dir dataset_parts encodec_checkpoint num_jobs"
. "$(dirname "${BASH_SOURCE[0]}")/../parse_options.sh"

if [ "$dataset_parts" = "all" ]; then
  dataset_parts="dev-clean dev-other test-clean test-other train-clean-100 train-clean-360 train-other-500"
fi
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# lhotse's CLI through the chosen interpreter (its console script may not be on PATH).
lhotse=("$python" -c "import sys; from lhotse.bin.lhotse import cli; sys.argv[0] = 'lhotse'; sys.exit(cli())")
log() { echo "$(date '+%F %T') [libritts stage $1] ${*:2}"; }
part_flags=()
for p in $dataset_parts; do part_flags+=(-p "$p"); done

if [ "$stage" -le 0 ] && [ "$stop_stage" -ge 0 ]; then
  log 0 "download LibriTTS ($dataset_parts) -> $data_dir/download"
  "${lhotse[@]}" download libritts "${part_flags[@]}" "$data_dir/download"
fi

if [ "$stage" -le 1 ] && [ "$stop_stage" -ge 1 ]; then
  log 1 "lhotse prepare -> $data_dir/manifests"
  "${lhotse[@]}" prepare libritts -j "$num_jobs" "${part_flags[@]}" "$data_dir/download/LibriTTS" "$data_dir/manifests"
fi

if [ "$stage" -le 2 ] && [ "$stop_stage" -ge 2 ]; then
  if [ -n "$encodec_checkpoint" ]; then audio_flags=(--encodec-checkpoint "$encodec_checkpoint"); else audio_flags=(); fi
  log 2 "tokenize -> $data_dir/tokenized (restartable: finished parts are skipped)"
  "$python" "$root/bin/tokenizer.py" --src-dir "$data_dir/manifests" --output-dir "$data_dir/tokenized" \
    --prefix libritts --dataset-parts "$dataset_parts" --suffix jsonl.gz \
    --text-extractor espeak --audio-extractor Encodec --num-jobs "$num_jobs" ${audio_flags[@]+"${audio_flags[@]}"}
fi

if [ "$stage" -le 3 ] && [ "$stop_stage" -ge 3 ]; then
  log 3 "combine: train parts -> libritts_cuts_train, dev-clean -> dev, test-clean -> test"
  train=()
  for p in $dataset_parts; do
    case "$p" in train-*) train+=("$data_dir/tokenized/libritts_cuts_${p}.jsonl.gz") ;; esac
  done
  if [ ${#train[@]} -gt 0 ]; then
    "${lhotse[@]}" combine "${train[@]}" "$data_dir/tokenized/libritts_cuts_train.jsonl.gz"
  fi
  for pair in dev-clean:dev test-clean:test; do
    src=$data_dir/tokenized/libritts_cuts_${pair%%:*}.jsonl.gz
    if [ -f "$src" ]; then cp "$src" "$data_dir/tokenized/libritts_cuts_${pair##*:}.jsonl.gz"; fi
  done
fi

if [ "$stage" -le 4 ] && [ "$stop_stage" -ge 4 ]; then
  for part in train dev test; do
    f=$data_dir/tokenized/libritts_cuts_${part}.jsonl.gz
    if [ -f "$f" ]; then log 4 "statistics of $f"; "${lhotse[@]}" cut describe "$f"; fi
  done
fi
