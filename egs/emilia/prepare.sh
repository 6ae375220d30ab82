#!/usr/bin/env bash
# Emilia (about 101,000 h in six languages: en, zh, de, fr, ja, ko) -> one multilingual tokenized
# dataset "emilia" for VALL-E X: each language phonemized in its own espeak voice (en-us, de,
# fr-fr, ja, ko; Mandarin through pypinyin, --zh-text-extractor), one shared symbol table.
#   egs/emilia/prepare.sh [--stage 0] [--stop-stage 4] [--python python] [--data-dir data]
#       [--corpus-dir DIR] [--languages "en zh de fr ja ko"] [--min-dnsmos 0]
#       [--zh-text-extractor pypinyin|espeak] [--num-dev 200] [--num-test 200]
#       [--encodec-checkpoint PATH] [--device auto] [--num-jobs 4] [--shar-shard-size 1000]
# Stages: 0 check the corpus is there (Emilia is gated: apply for it on huggingface,
#         amphion/Emilia-Dataset, and unpack it so that --corpus-dir holds raw/EN/*.jsonl ...),
#         1 manifests per language: emilia_{recordings,supervisions}_{lang}; rows below
#           --min-dnsmos, rows whose mp3 is missing or unreadable, malformed rows and repeated
#           ids are listed in data/manifests/emilia_skipped_{lang}.tsv,
#         2 tokenize (bin/tokenizer.py, restartable; one run for the espeak languages, one for
#           zh; on many GPUs and nodes with --tokenizer-launcher "torchrun ...", or as the tasks
#           of a SLURM array: docs/data.md),
#         3 held-out parts: per language the first --num-dev cuts -> dev, the next --num-test
#           -> test, the rest -> train; all languages combined -> emilia_cuts_{train,dev,test} (train
#           interleaved: every stretch of it holds the languages in proportion) with their
#           extremes records (emilia_extremes_{train,dev,test}.json, for the trainer's start-up;
#           split, interleave and combine write them in their pass over the cuts),
#         4 statistics (cuts per language), 5 (on request) Lhotse Shar shards of train.
# Japanese: espeak's ja voice reads kana only; pykakasi (the `ja` extra) first turns kanji into
# hiragana (valle/data/japanese.py), and stage 2 stops if it is not installed (docs/data.md).
set -euo pipefail

stage=0
stop_stage=4
python=${PYTHON:-python}
data_dir=data
corpus_dir=""
languages="en zh de fr ja ko"
min_dnsmos=0
zh_text_extractor=pypinyin
num_dev=200
num_test=200
encodec_checkpoint=""
device=auto
num_jobs=4
shar_shard_size=1000
extra_tokenizer_flags=""
# what runs bin/tokenizer.py in stage 2 (default: --python): e.g. "torchrun --nnodes 4
# --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500" (docs/data.md)
tokenizer_launcher=""

options="stage stop_stage python data_dir corpus_dir languages min_dnsmos zh_text_extractor num_dev num_test encodec_checkpoint device num_jobs shar_shard_size extra_tokenizer_flags tokenizer_launcher"
. "$(dirname "${BASH_SOURCE[0]}")/../parse_options.sh"

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
corpus_dir=${corpus_dir:-$data_dir/download/Emilia}
tok=$data_dir/tokenized
recipe=("$python" -m valle.data.recipe)
log() { echo "$(date '+%F %T') [emilia stage $1] ${*:2}"; }

if [ "$stage" -le 0 ] && [ "$stop_stage" -ge 0 ]; then
  for lang in $languages; do
    d=$corpus_dir/raw/$(echo "$lang" | tr '[:lower:]' '[:upper:]')
    [ -d "$d" ] || { echo "$0: no $d: Emilia is downloaded by hand after applying for access" \
      "(huggingface.co/datasets/amphion/Emilia-Dataset); unpack it so that --corpus-dir holds raw/" >&2; exit 1; }
  done
  log 0 "corpus found at $corpus_dir ($languages): no download"
fi

if [ "$stage" -le 1 ] && [ "$stop_stage" -ge 1 ]; then
  log 1 "manifests per language (--min-dnsmos $min_dnsmos) -> $data_dir/manifests"
  "$python" -m valle.data.emilia prepare --corpus-dir "$corpus_dir" --output-dir "$data_dir/manifests" \
    --languages "$languages" --min-dnsmos "$min_dnsmos" --num-jobs "$num_jobs"
fi

espeak_parts=""
zh_part=""
for lang in $languages; do
  if [ "$lang" = zh ] && [ "$zh_text_extractor" = pypinyin ]; then zh_part=zh; else espeak_parts="$espeak_parts $lang"; fi
done

if [ "$stage" -le 2 ] && [ "$stop_stage" -ge 2 ]; then
  audio_flags=()
  if [ -n "$encodec_checkpoint" ]; then audio_flags=(--encodec-checkpoint "$encodec_checkpoint"); fi
  common=(--src-dir "$data_dir/manifests" --output-dir "$tok" --prefix emilia --suffix jsonl.gz
          --device "$device" --audio-extractor Encodec --num-jobs "$num_jobs")
  # One process by default; under --tokenizer-launcher "torchrun ..." (or as the tasks of a
  # SLURM array, which bin/tokenizer.py recognises itself) the workers split each part
  # (docs/data.md, "Tokenizing on many GPUs and nodes").
  # shellcheck disable=SC2206  # the launcher is a command line
  launch=(${tokenizer_launcher:-$python})
  log 2 "tokenize -> $tok with ${launch[*]}, one shared symbol table (restartable)"
  # Most of Emilia's JA is written with kanji, which espeak's ja voice cannot read: without
  # the kanji reader those rows would all be reported and left out.
  if [[ " $espeak_parts " == *" ja "* ]] && ! "$python" -c "import pykakasi" 2>/dev/null; then
    echo "$0: ja needs pykakasi to read kanji as kana: pip install -e '.[ja]' (or drop ja from --languages)" >&2
    exit 1
  fi
  # Each row's language ("en", "de", ...) picks its espeak voice; one run per text front end.
  if [ -n "${espeak_parts// /}" ]; then
    # shellcheck disable=SC2086  # extra_tokenizer_flags is a list of flags
    "${launch[@]}" "$root/bin/tokenizer.py" "${common[@]}" --dataset-parts "${espeak_parts# }" \
      --text-extractor espeak ${audio_flags[@]+"${audio_flags[@]}"} $extra_tokenizer_flags
  fi
  if [ -n "$zh_part" ]; then
    # shellcheck disable=SC2086
    "${launch[@]}" "$root/bin/tokenizer.py" "${common[@]}" --dataset-parts zh --language cmn \
      --text-extractor pypinyin ${audio_flags[@]+"${audio_flags[@]}"} $extra_tokenizer_flags
  fi
fi

if [ "$stage" -le 3 ] && [ "$stop_stage" -ge 3 ]; then
  log 3 "held out per language ($num_dev dev, $num_test test), combined -> emilia_cuts_{train,dev,test}"
  for name in train dev test; do declare -a "parts_$name=()"; done
  for lang in $languages; do
    "${recipe[@]}" split "$tok/emilia_cuts_${lang}.jsonl.gz" --output-dir "$tok" --prefix "emilia_${lang}" \
      --dev "$num_dev" --test "$num_test"
    parts_train+=("$tok/emilia_${lang}_cuts_train.jsonl.gz")
    parts_dev+=("$tok/emilia_${lang}_cuts_dev.jsonl.gz")
    parts_test+=("$tok/emilia_${lang}_cuts_test.jsonl.gz")
  done
  # interleaved, not concatenated: the trainer shuffles inside a buffer, and a manifest in
  # language blocks would train on one language at a time
  "$python" -m valle.data.emilia interleave "$tok/emilia_cuts_train.jsonl.gz" "${parts_train[@]}"
  # interleave and combine also write the parts' extremes records (emilia_extremes_*.json),
  # which the trainer's start-up reads instead of the manifests
  "${recipe[@]}" combine "$tok/emilia_cuts_dev.jsonl.gz" "${parts_dev[@]}"
  "${recipe[@]}" combine "$tok/emilia_cuts_test.jsonl.gz" "${parts_test[@]}"
fi

if [ "$stage" -le 4 ] && [ "$stop_stage" -ge 4 ]; then
  log 4 "statistics"
  "${recipe[@]}" describe "$tok"/emilia_cuts_{train,dev,test}.jsonl.gz
fi

if [ "$stage" -le 5 ] && [ "$stop_stage" -ge 5 ]; then
  log 5 "Lhotse Shar shards of train -> $data_dir/shar/train (train with --shar-dir)"
  "${recipe[@]}" shar "$tok/emilia_cuts_train.jsonl.gz" "$data_dir/shar/train" --shard-size "$shar_shard_size"
fi
