#!/usr/bin/env bash
# Tiny multi-speaker corpus, synthesised locally with eSpeak NG (no network), tokenized.
#   egs/tiny/prepare.sh [--stage 0] [--stop-stage 3] [--python python] [--data-dir data/tiny]
#                       [--layout split|heldout] [--codec encodec|mel-rvq|auto] [--generated 0]
#                       [--judge-epochs 30] [--judge-limit N] [--first-codebook-size 1024]
#                       [--train-voices 4] [--bilingual false]
# --layout split (default): 4 voices, every part split per speaker (the tests' corpus).
# --layout heldout: dev/test sentences never trained on, and test in 2 voices never trained on
#   (egs/tiny/local/heldout_corpus.py); stage 3 then trains the phoneme judge (valle/eval/judge.py)
#   on the training part's ground truth -> tokenized/judge.pt.
# --bilingual true (VALL-E X; split layout): English sentences.txt in 2 English voices and
#   sentences_cmn.txt in 2 Mandarin (eSpeak cmn) voices, --limit sentences per language, each
#   phonemized in its own language into one symbol table; stage 3 also trains one phoneme judge
#   over the shared phonemes (bin/evaluate.py reports its PER per language).
# --codec encodec: RANDOM weights unless --encodec-checkpoint is given (or the torch hub cache
#   holds encodec_24khz-d7cc33bc.th): the codes exercise the pipeline, they are not speech.
# --codec mel-rvq: the offline codec, fitted on the training part (tokenized/mel_rvq.pt).
# --codec auto: EnCodec where its weights are present, else mel-rvq.
set -euo pipefail

stage=0
stop_stage=3
python=${PYTHON:-python}
data_dir=data/tiny
num_jobs=1
encodec_checkpoint=""
limit=""
layout=split
codec=encodec
judge_epochs=30
judge_limit=""
voices_per_sentence=1
generated=0
train_voices=4  # heldout layout: eSpeak voices of the training part (up to 12)
first_codebook_size=1024
bilingual=false

options="stage stop_stage python data_dir num_jobs encodec_checkpoint limit layout codec judge_epochs judge_limit voices_per_sentence generated first_codebook_size train_voices bilingual"
. "$(dirname "${BASH_SOURCE[0]}")/../parse_options.sh"

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
log() { echo "$(date '+%F %T') [tiny stage $1] ${*:2}"; }
case "$layout" in split|heldout) ;; *) echo "$0: --layout must be split or heldout" >&2; exit 1 ;; esac
if [ "$bilingual" = true ] && [ "$layout" != split ]; then echo "$0: --bilingual true needs --layout split" >&2; exit 1; fi
if [ "$codec" = auto ]; then
  codec=$("$python" -c "import sys; from valle.codec import resolve_codec_name; print(resolve_codec_name('auto', sys.argv[1] or None))" "$encodec_checkpoint")
  log - "--codec auto: $codec"
fi
if [ "$layout" = heldout ]; then parts="train dev test"; else parts="all"; fi

if [ "$stage" -le 0 ] && [ "$stop_stage" -ge 0 ]; then
  log 0 "synthesise the corpus with eSpeak NG ($layout layout) -> $data_dir/corpus"
  if [ "$layout" = heldout ]; then
    "$python" "$here/local/heldout_corpus.py" synth --sentences "$here/sentences.txt" \
      --out-dir "$data_dir/corpus" --voices-per-sentence "$voices_per_sentence" --generated "$generated" --train-voices "$train_voices" \
      ${limit:+--limit "$limit"}
  else
    zh_flags=()
    if [ "$bilingual" = true ]; then zh_flags=(--zh-sentences "$here/sentences_cmn.txt"); fi
    "$python" -m valle.data.tiny synth --sentences "$here/sentences.txt" --out-dir "$data_dir/corpus" \
      ${limit:+--limit "$limit"} ${zh_flags[@]+"${zh_flags[@]}"}
  fi
fi

if [ "$stage" -le 1 ] && [ "$stop_stage" -ge 1 ]; then
  log 1 "lhotse manifests -> $data_dir/manifests"
  if [ "$layout" = heldout ]; then
    "$python" "$here/local/heldout_corpus.py" manifests --corpus-dir "$data_dir/corpus" \
      --output-dir "$data_dir/manifests"
  else
    "$python" -m valle.data.tiny manifests --corpus-dir "$data_dir/corpus" --output-dir "$data_dir/manifests"
  fi
fi

if [ "$stage" -le 2 ] && [ "$stop_stage" -ge 2 ]; then
  # Tokens from before bin/tokenizer.py recorded its sources cannot be checked by it: a corpus
  # re-made after them (another plan) would be trained on stale tokens. Say so and stop.
  cuts=$data_dir/tokenized/tiny_cuts_train.jsonl.gz
  if [ -f "$cuts" ] && [ ! -f "$data_dir/tokenized/tiny_sources_train.json" ] &&
     [ "$data_dir/corpus/plan.tsv" -nt "$cuts" ]; then
    echo "$0: $data_dir/corpus was synthesised again after $data_dir/tokenized was made" \
      "(another plan: --generated, --train-voices, --limit?): delete $data_dir/tokenized and rerun" >&2
    exit 1
  fi
  if [ "$codec" = mel-rvq ]; then
    if [ ! -f "$data_dir/tokenized/mel_rvq.pt" ]; then
      train_part=train; [ "$layout" = heldout ] || train_part=all
      log 2 "fit the offline mel-rvq codec on the $train_part part -> $data_dir/tokenized/mel_rvq.pt"
      "$python" -m valle.codec fit --recordings "$data_dir/manifests/tiny_recordings_$train_part.jsonl.gz" \
        --output-dir "$data_dir/tokenized" --max-frames 30000 --iterations 8 \
        --first-codebook-size "$first_codebook_size"
    fi
    audio_flags=(--codec mel-rvq)
  elif [ -n "$encodec_checkpoint" ]; then
    audio_flags=(--encodec-checkpoint "$encodec_checkpoint")
  else
    log 2 "no --encodec-checkpoint: EnCodec uses RANDOM weights (--allow-random-encodec)"
    audio_flags=(--allow-random-encodec)
  fi
  log 2 "tokenize (phonemes + $codec codes) -> $data_dir/tokenized"
  "$python" "$root/bin/tokenizer.py" --src-dir "$data_dir/manifests" --output-dir "$data_dir/tokenized" \
    --prefix tiny --dataset-parts "$parts" --suffix jsonl.gz --num-jobs "$num_jobs" "${audio_flags[@]}"
fi

if [ "$stage" -le 3 ] && [ "$stop_stage" -ge 3 ]; then
  if [ "$layout" = heldout ] && [ -f "$data_dir/tokenized/judge.pt" ]; then
    # As the tokenizer does with its cuts: kept, so every run is measured with the same judge.
    log 3 "$data_dir/tokenized/judge.pt exists, skipping (delete it to retrain the phoneme judge)"
  elif [ "$layout" = heldout ]; then
    log 3 "train the phoneme judge on the training part's ground truth -> $data_dir/tokenized/judge.pt"
    "$python" -m valle.eval.judge train --cuts "$data_dir/tokenized/tiny_cuts_train.jsonl.gz" \
      --valid-cuts "$data_dir/tokenized/tiny_cuts_test.jsonl.gz" --epochs "$judge_epochs" \
      ${judge_limit:+--limit "$judge_limit"} \
      --output "$data_dir/tokenized/judge.pt"
  else
    log 3 "split train/dev/test per speaker"
    "$python" -m valle.data.tiny split --cuts "$data_dir/tokenized/tiny_cuts_all.jsonl.gz" \
      --output-dir "$data_dir/tokenized" --prefix tiny
    if [ "$bilingual" = true ]; then
      # One judge over the shared phoneme set (not one per language): the symbol table is one,
      # a symbol both languages use is the same target, and no row needs routing to a judge.
      log 3 "train one phoneme judge over both languages' phonemes -> $data_dir/tokenized/judge.pt"
      "$python" -m valle.eval.judge train --cuts "$data_dir/tokenized/tiny_cuts_train.jsonl.gz" \
        --valid-cuts "$data_dir/tokenized/tiny_cuts_test.jsonl.gz" --epochs "$judge_epochs" \
        ${judge_limit:+--limit "$judge_limit"} --output "$data_dir/tokenized/judge.pt"
    fi
  fi
  ls -l "$data_dir/tokenized"
fi
