#!/usr/bin/env bash
# LibriTTS (English) + AISHELL-3 (Mandarin) -> one bilingual tokenized dataset "vallex" for
# VALL-E X: each supervision phonemized in its own language (lhotse's recipes write "English"
# and "Chinese"; bin/tokenizer.py maps them to the espeak voices en-us and cmn and records the
# voice in each cut, custom["espeak_voice"], which becomes the cut's language id in training),
# one shared symbol table (both corpora are tokenized into the same directory, whose
# unique_text_tokens.k2symbols bin/tokenizer.py merges under a lock).
#   egs/vallex/prepare.sh [--stage 0] [--stop-stage 4] [--python python] [--data-dir data]
#       [--libritts-dir DIR] [--libritts-parts "dev-clean test-clean train-clean-100"]
#       [--aishell3-dir DIR] [--aishell3-num-dev 200]
#       [--encodec-checkpoint PATH] [--device auto] [--num-jobs 4] [--shar-shard-size 1000]
# Stages: 0 download (each corpus skipped when its directory already holds it), 1 lhotse
#         prepare (libritts_* and aishell3_* manifests), 2 tokenize both (restartable),
#         3 combine: LibriTTS train parts + AISHELL-3 train -> vallex_cuts_train; dev-clean + the
#         first --aishell3-num-dev cuts of AISHELL-3's test -> vallex_cuts_dev; test-clean + the
#         rest of AISHELL-3's test -> vallex_cuts_test; both corpora's text statistics ->
#         vallex_text_stats.json, 4 statistics (cuts per language), 5 (on request) Lhotse Shar
#         shards of train (--stop-stage 5; train with --shar-dir).
# Mandarin is phonemized by espeak's cmn voice (pinyin-like phonemes with tone digits), not by
# pypinyin: bin/infer.py and bin/evaluate.py phonemize with one text front end per run, and a
# cross-lingual item needs English and Mandarin from the same one.
set -euo pipefail

stage=0
stop_stage=4
python=${PYTHON:-python}
data_dir=data
libritts_dir=""
libritts_parts="dev-clean test-clean train-clean-100"
aishell3_dir=""
aishell3_num_dev=200
encodec_checkpoint=""
device=auto
num_jobs=4
shar_shard_size=1000
extra_tokenizer_flags=""

options="stage stop_stage python data_dir libritts_dir libritts_parts aishell3_dir aishell3_num_dev encodec_checkpoint device num_jobs shar_shard_size extra_tokenizer_flags"
. "$(dirname "${BASH_SOURCE[0]}")/../parse_options.sh"

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
libritts_dir=${libritts_dir:-$data_dir/download/LibriTTS}
# lhotse's download_aishell3 unpacks data_aishell3.tgz into its target: {target}/data_aishell3
aishell3_dir=${aishell3_dir:-$data_dir/download/data_aishell3}
tok=$data_dir/tokenized
recipe=("$python" -m valle.data.recipe)
log() { echo "$(date '+%F %T') [vallex stage $1] ${*:2}"; }

if [ "$stage" -le 0 ] && [ "$stop_stage" -ge 0 ]; then
  if [ -d "$libritts_dir" ]; then
    log 0 "LibriTTS found at $libritts_dir: no download"
  else
    log 0 "download LibriTTS ($libritts_parts) -> $(dirname "$libritts_dir")"
    # shellcheck disable=SC2086  # one argument per part
    "${recipe[@]}" download libritts "$(dirname "$libritts_dir")" $libritts_parts
  fi
  if [ -d "$aishell3_dir" ]; then
    log 0 "AISHELL-3 found at $aishell3_dir: no download"
  else
    log 0 "download AISHELL-3 (about 19 GB) -> $(dirname "$aishell3_dir")"
    "${recipe[@]}" download aishell3 "$(dirname "$aishell3_dir")"
  fi
fi

if [ "$stage" -le 1 ] && [ "$stop_stage" -ge 1 ]; then
  for dir in "$libritts_dir" "$aishell3_dir"; do
    [ -d "$dir" ] || { echo "$0: no corpus at $dir (run stage 0 or pass --libritts-dir/--aishell3-dir)" >&2; exit 1; }
  done
  log 1 "lhotse prepare $libritts_dir and $aishell3_dir -> $data_dir/manifests"
  # shellcheck disable=SC2086  # one argument per part
  "${recipe[@]}" prepare libritts --num-jobs "$num_jobs" "$libritts_dir" "$data_dir/manifests" $libritts_parts
  "${recipe[@]}" prepare aishell3 "$aishell3_dir" "$data_dir/manifests"  # its parts: train, test
fi

if [ "$stage" -le 2 ] && [ "$stop_stage" -ge 2 ]; then
  audio_flags=()
  if [ -n "$encodec_checkpoint" ]; then audio_flags=(--encodec-checkpoint "$encodec_checkpoint"); fi
  common=(--src-dir "$data_dir/manifests" --output-dir "$tok" --suffix jsonl.gz --device "$device"
          --text-extractor espeak --audio-extractor Encodec --num-jobs "$num_jobs")
  log 2 "tokenize LibriTTS (en-us) and AISHELL-3 (cmn) -> $tok, one shared symbol table (restartable)"
  # --language: the voice of a supervision without a language (lhotse's recipes give each one)
  # shellcheck disable=SC2086  # extra_tokenizer_flags is a list of flags
  "$python" "$root/bin/tokenizer.py" "${common[@]}" --prefix libritts --dataset-parts "$libritts_parts" \
    --language en-us ${audio_flags[@]+"${audio_flags[@]}"} $extra_tokenizer_flags
  # shellcheck disable=SC2086
  "$python" "$root/bin/tokenizer.py" "${common[@]}" --prefix aishell3 --dataset-parts "train test" \
    --language cmn ${audio_flags[@]+"${audio_flags[@]}"} $extra_tokenizer_flags
fi

if [ "$stage" -le 3 ] && [ "$stop_stage" -ge 3 ]; then
  log 3 "combine both corpora: vallex_cuts_{train,dev,test}, vallex_text_stats.json"
  # AISHELL-3 has train and test only: its dev is the first --aishell3-num-dev cuts of test
  "${recipe[@]}" split "$tok/aishell3_cuts_test.jsonl.gz" --output-dir "$tok" --prefix aishell3_heldout \
    --dev "$aishell3_num_dev" --test 0 --rest test
  train=()
  for p in $libritts_parts; do
    case "$p" in train-*) train+=("$tok/libritts_cuts_${p}.jsonl.gz") ;; esac
  done
  "${recipe[@]}" combine "$tok/vallex_cuts_train.jsonl.gz" ${train[@]+"${train[@]}"} "$tok/aishell3_cuts_train.jsonl.gz"
  for pair in dev-clean:dev test-clean:test; do
    libri=$tok/libritts_cuts_${pair%%:*}.jsonl.gz
    parts=()
    if [ -f "$libri" ]; then parts+=("$libri"); fi
    "${recipe[@]}" combine "$tok/vallex_cuts_${pair##*:}.jsonl.gz" ${parts[@]+"${parts[@]}"} \
      "$tok/aishell3_heldout_cuts_${pair##*:}.jsonl.gz"
  done
  # the trainer's --max-text-tokens auto and language list read {dataset}_text_stats.json
  "${recipe[@]}" merge-stats "$tok/vallex_text_stats.json" "$tok/libritts_text_stats.json" \
    "$tok/aishell3_text_stats.json"
fi

if [ "$stage" -le 4 ] && [ "$stop_stage" -ge 4 ]; then
  log 4 "statistics"
  "${recipe[@]}" describe "$tok"/vallex_cuts_{train,dev,test}.jsonl.gz
fi

if [ "$stage" -le 5 ] && [ "$stop_stage" -ge 5 ]; then
  log 5 "Lhotse Shar shards of train -> $data_dir/shar/train (train with --shar-dir)"
  "${recipe[@]}" shar "$tok/vallex_cuts_train.jsonl.gz" "$data_dir/shar/train" --shard-size "$shar_shard_size"
fi
