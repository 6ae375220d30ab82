#!/usr/bin/env bash
# Libriheavy (about 50,000 h of LibriLight with the books' cased, punctuated text) -> tokenized
# lhotse cuts for valle.
#   egs/libriheavy/prepare.sh [--stage 0] [--stop-stage 4] [--python python] [--data-dir data]
#       [--manifests-dir DIR] [--librilight-dir DIR] [--dataset-parts "small dev test_clean test_other"]
#       [--text cased|upper] [--encodec-checkpoint PATH] [--device auto] [--num-jobs 4]
#       [--shar-shard-size 1000]
# Stages: 0 download (Libriheavy's cut manifests from huggingface, LibriLight's tars for the
#         parts asked for; each skipped when its file or folder is already there),
#         1 manifests: the published cuts -> libriheavy_{recordings,supervisions}_{part} with the
#           audio paths under --librilight-dir and the text chosen by --text (cased: the book's
#           text, custom["texts"][0]; upper: the ASR text, texts[1]); cuts whose flac is missing
#           are listed in data/manifests/libriheavy_skipped_{part}.tsv,
#         2 tokenize (bin/tokenizer.py; restartable; on many GPUs and nodes with
#           --tokenizer-launcher "torchrun --nnodes N --nproc-per-node G ...", or as the tasks
#           of a SLURM array: docs/data.md),
#         3 combine the train parts (small, medium, large: disjoint) -> libriheavy_cuts_train
#           and, in the same pass, its extremes record libriheavy_extremes_train.json (the
#           trainer's start-up reads it); dev -> libriheavy_cuts_dev (--valid-part) as tokenized,
#         4 statistics, 5 (on request) Lhotse Shar shards of train (--stop-stage 5; --shar-dir).
# Parts: small (509 h), medium (5,042 h), large (50,794 h), dev, test_clean, test_other.
# --dataset-parts "all" means every part.
set -euo pipefail

stage=0
stop_stage=4
python=${PYTHON:-python}
data_dir=data
manifests_dir=""
librilight_dir=""
dataset_parts="small dev test_clean test_other"
text=cased
encodec_checkpoint=""
device=auto
num_jobs=4
shar_shard_size=1000
extra_tokenizer_flags=""
# what runs bin/tokenizer.py in stage 2 (default: --python): e.g. "torchrun --nnodes 4
# --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500" (docs/data.md)
tokenizer_launcher=""

options="stage stop_stage python data_dir manifests_dir librilight_dir dataset_parts text encodec_checkpoint device num_jobs shar_shard_size extra_tokenizer_flags tokenizer_launcher"
. "$(dirname "${BASH_SOURCE[0]}")/../parse_options.sh"

if [ "$dataset_parts" = "all" ]; then
  dataset_parts="small medium large dev test_clean test_other"
fi
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
manifests_dir=${manifests_dir:-$data_dir/download/libriheavy}
librilight_dir=${librilight_dir:-$data_dir/download/librilight}
tok=$data_dir/tokenized
heavy=("$python" -m valle.data.libriheavy)
recipe=("$python" -m valle.data.recipe)
log() { echo "$(date '+%F %T') [libriheavy stage $1] ${*:2}"; }

if [ "$stage" -le 0 ] && [ "$stop_stage" -ge 0 ]; then
  log 0 "download what is missing: manifests -> $manifests_dir, LibriLight -> $librilight_dir"
  "${heavy[@]}" download "$manifests_dir" --parts "$dataset_parts" --librilight-dir "$librilight_dir"
fi

if [ "$stage" -le 1 ] && [ "$stop_stage" -ge 1 ]; then
  log 1 "manifests ($text text, audio under $librilight_dir) -> $data_dir/manifests"
  "${heavy[@]}" prepare --manifests-dir "$manifests_dir" --librilight-dir "$librilight_dir" \
    --output-dir "$data_dir/manifests" --parts "$dataset_parts" --text "$text"
fi

if [ "$stage" -le 2 ] && [ "$stop_stage" -ge 2 ]; then
  audio_flags=()
  if [ -n "$encodec_checkpoint" ]; then audio_flags=(--encodec-checkpoint "$encodec_checkpoint"); fi
  # One process by default; under --tokenizer-launcher "torchrun ..." (or as the tasks of a
  # SLURM array, which bin/tokenizer.py recognises itself) the workers split each part
  # (docs/data.md, "Tokenizing on many GPUs and nodes").
  # shellcheck disable=SC2206  # the launcher is a command line
  launch=(${tokenizer_launcher:-$python})
  log 2 "tokenize -> $tok with ${launch[*]} (restartable: finished parts and chunks are kept)"
  # shellcheck disable=SC2086  # extra_tokenizer_flags is a list of flags
  "${launch[@]}" "$root/bin/tokenizer.py" --src-dir "$data_dir/manifests" --output-dir "$tok" \
    --prefix libriheavy --dataset-parts "$dataset_parts" --suffix jsonl.gz --device "$device" \
    --text-extractor espeak --language en-us --audio-extractor Encodec --num-jobs "$num_jobs" \
    ${audio_flags[@]+"${audio_flags[@]}"} $extra_tokenizer_flags
fi

if [ "$stage" -le 3 ] && [ "$stop_stage" -ge 3 ]; then
  log 3 "combine: small medium large -> libriheavy_cuts_train (dev stays libriheavy_cuts_dev)"
  train=()
  for p in $dataset_parts; do
    case "$p" in small|medium|large) train+=("$tok/libriheavy_cuts_${p}.jsonl.gz") ;; esac
  done
  if [ ${#train[@]} -gt 0 ]; then
    # also writes libriheavy_extremes_train.json, which the trainer's start-up reads
    "${recipe[@]}" combine "$tok/libriheavy_cuts_train.jsonl.gz" "${train[@]}"
  fi
fi

if [ "$stage" -le 4 ] && [ "$stop_stage" -ge 4 ]; then
  files=()
  for part in train dev test_clean test_other; do
    f=$tok/libriheavy_cuts_${part}.jsonl.gz
    if [ -f "$f" ]; then files+=("$f"); fi
  done
  log 4 "statistics"
  "${recipe[@]}" describe "${files[@]}"
fi

if [ "$stage" -le 5 ] && [ "$stop_stage" -ge 5 ]; then
  log 5 "Lhotse Shar shards of train -> $data_dir/shar/train (train with --shar-dir)"
  "${recipe[@]}" shar "$tok/libriheavy_cuts_train.jsonl.gz" "$data_dir/shar/train" --shard-size "$shar_shard_size"
fi
