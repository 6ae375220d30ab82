#!/usr/bin/env bash
# LJSpeech -> tokenized lhotse cuts for valle (single speaker).
#   egs/ljspeech/prepare.sh [--stage 0] [--stop-stage 4] [--python python] [--data-dir data]
#       [--encodec-checkpoint PATH] [--num-jobs 4] [--num-dev 300] [--num-test 300]
# Stages: 0 download, 1 lhotse prepare, 2 tokenize (bin/tokenizer.py), 3 split train/dev/test
#         (lhotse subset), 4 statistics (lhotse cut describe).
set -euo pipefail

stage=0
stop_stage=4
python=${PYTHON:-python}
data_dir=data
encodec_checkpoint=""
num_jobs=4
num_dev=300
num_test=300

options="stage stop_stage python data_dir encodec_checkpoint num_jobs num_dev num_test"
. "$(dirname "${BASH_SOURCE[0]}")/../parse_options.sh"

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# lhotse's CLI through the chosen interpreter (its console script may not be on PATH).
lhotse=("$python" -c "import sys; from lhotse.bin.lhotse import cli; sys.argv[0] = 'lhotse'; sys.exit(cli())")
log() { echo "$(date '+%F %T') [ljspeech stage $1] ${*:2}"; }
tok=$data_dir/tokenized

if [ "$stage" -le 0 ] && [ "$stop_stage" -ge 0 ]; then
  log 0 "download LJSpeech -> $data_dir/download"
  "${lhotse[@]}" download ljspeech "$data_dir/download"
fi

if [ "$stage" -le 1 ] && [ "$stop_stage" -ge 1 ]; then
  log 1 "lhotse prepare -> $data_dir/manifests"
  "${lhotse[@]}" prepare ljspeech "$data_dir/download/LJSpeech-1.1" "$data_dir/manifests"
fi

if [ "$stage" -le 2 ] && [ "$stop_stage" -ge 2 ]; then
  if [ -n "$encodec_checkpoint" ]; then audio_flags=(--encodec-checkpoint "$encodec_checkpoint"); else audio_flags=(); fi
  log 2 "tokenize -> $tok (restartable)"
  "$python" "$root/bin/tokenizer.py" --src-dir "$data_dir/manifests" --output-dir "$tok" \
    --prefix ljspeech --dataset-parts all --suffix jsonl.gz \
    --text-extractor espeak --audio-extractor Encodec --num-jobs "$num_jobs" ${audio_flags[@]+"${audio_flags[@]}"}
fi

if [ "$stage" -le 3 ] && [ "$stop_stage" -ge 3 ]; then
  log 3 "split: first $num_dev cuts -> dev, next $num_test -> test, the rest -> train"
  all=$tok/ljspeech_cuts_all.jsonl.gz
  total=$("$python" -c "import sys; from lhotse import CutSet; print(len(CutSet.from_file(sys.argv[1])))" "$all")
  held=$((num_dev + num_test))
  if [ "$total" -le "$held" ]; then echo "only $total cuts: cannot hold out $held" >&2; exit 1; fi
  "${lhotse[@]}" subset --first "$held" "$all" "$tok/ljspeech_cuts_heldout.jsonl.gz"
  "${lhotse[@]}" subset --first "$num_dev" "$tok/ljspeech_cuts_heldout.jsonl.gz" "$tok/ljspeech_cuts_dev.jsonl.gz"
  "${lhotse[@]}" subset --last "$num_test" "$tok/ljspeech_cuts_heldout.jsonl.gz" "$tok/ljspeech_cuts_test.jsonl.gz"
  "${lhotse[@]}" subset --last "$((total - held))" "$all" "$tok/ljspeech_cuts_train.jsonl.gz"
fi

if [ "$stage" -le 4 ] && [ "$stop_stage" -ge 4 ]; then
  for part in train dev test; do
    log 4 "statistics of ljspeech_cuts_$part"
    "${lhotse[@]}" cut describe "$tok/ljspeech_cuts_${part}.jsonl.gz"
  done
fi
