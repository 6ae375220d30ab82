#!/usr/bin/env bash
# Your own folder of audio -> tokenized lhotse cuts for valle (docs/data.md, "Your own data").
#   egs/custom/prepare.sh --corpus-dir DIR [--stage 0] [--stop-stage 4] [--python python]
#       [--data-dir data] [--layout auto|kaldi|ljspeech|sidecar] [--language en-us]
#       [--speaker-languages FILE] [--max-segment-duration 14] [--min-duration 0.5]
#       [--whisper-model base] [--whisper-backend openai-whisper] [--valid-fraction 0.05]
#       [--encodec-checkpoint PATH] [--device auto] [--num-jobs 4] [--extra-tokenizer-flags ""]
# Layouts: kaldi (wav.scp + text [+ utt2spk]), ljspeech (metadata.csv id|text[|normalized]),
#   sidecar (a .txt or .lab beside each audio file); auto picks the first present. Audio: any
#   format lhotse reads (wav, flac, mp3, ...), any rate, mono or stereo (channel 0 is used).
# Stages: 0 read the corpus: check every file, cut long untranscribed recordings at silences
#           (no piece over --max-segment-duration) -> data/manifests, bad items named in
#           data/manifests/custom_bad_items.tsv
#         1 transcribe what has no transcript with Whisper where its weights are on disk;
#           otherwise those files stay out, each named in the report
#         2 tokenize (bin/tokenizer.py: phonemes in each speaker's language + codec codes;
#           its bad items in data/tokenized/custom_bad_cuts_all.tsv)
#         3 hold out --valid-fraction of each speaker's utterances as dev (deterministic;
#           every speaker keeps utterances in train) -> custom_cuts_{train,dev}
#         4 statistics
set -euo pipefail

stage=0
stop_stage=4
python=${PYTHON:-python}
data_dir=data
corpus_dir=""
layout=auto
language=en-us
speaker_languages=""
max_segment_duration=14  # egs/train.sh trains on cuts up to 14 s (--filter-max-duration)
min_duration=0.5
whisper_model=base
whisper_backend=openai-whisper
valid_fraction=0.05
encodec_checkpoint=""
device=auto
num_jobs=4
extra_tokenizer_flags=""

options="stage stop_stage python data_dir corpus_dir layout language speaker_languages max_segment_duration min_duration whisper_model whisper_backend valid_fraction encodec_checkpoint device num_jobs extra_tokenizer_flags"
. "$(dirname "${BASH_SOURCE[0]}")/../parse_options.sh"

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
man=$data_dir/manifests
tok=$data_dir/tokenized
log() { echo "$(date '+%F %T') [custom stage $1] ${*:2}"; }

if [ "$stage" -le 0 ] && [ "$stop_stage" -ge 0 ]; then
  [ -n "$corpus_dir" ] || { echo "$0: --corpus-dir is required (the folder of your audio)" >&2; exit 1; }
  log 0 "read $corpus_dir ($layout layout) -> $man"
  "$python" -m valle.data.custom manifests --corpus-dir "$corpus_dir" --output-dir "$man" \
    --layout "$layout" --language "$language" ${speaker_languages:+--speaker-languages "$speaker_languages"} \
    --max-segment-duration "$max_segment_duration" --min-duration "$min_duration"
fi

if [ "$stage" -le 1 ] && [ "$stop_stage" -ge 1 ]; then
  log 1 "transcribe utterances without a transcript (Whisper $whisper_model, if its weights are on disk)"
  "$python" "$here/local/transcribe.py" --manifest-dir "$man" --whisper-model "$whisper_model" \
    --whisper-backend "$whisper_backend"
fi

if [ "$stage" -le 2 ] && [ "$stop_stage" -ge 2 ]; then
  audio_flags=()
  if [ -n "$encodec_checkpoint" ]; then audio_flags=(--encodec-checkpoint "$encodec_checkpoint"); fi
  log 2 "tokenize -> $tok (restartable: finished chunks are kept)"
  # shellcheck disable=SC2086  # extra_tokenizer_flags is a list of flags
  "$python" "$root/bin/tokenizer.py" --src-dir "$man" --output-dir "$tok" --prefix custom \
    --dataset-parts all --suffix jsonl.gz --device "$device" --language "$language" \
    --num-jobs "$num_jobs" ${audio_flags[@]+"${audio_flags[@]}"} $extra_tokenizer_flags
fi

if [ "$stage" -le 3 ] && [ "$stop_stage" -ge 3 ]; then
  log 3 "hold out $valid_fraction of each speaker's utterances -> custom_cuts_{train,dev}"
  "$python" -m valle.data.custom split --cuts "$tok/custom_cuts_all.jsonl.gz" --output-dir "$tok" \
    --valid-fraction "$valid_fraction"
fi

if [ "$stage" -le 4 ] && [ "$stop_stage" -ge 4 ]; then
  log 4 "statistics"
  "$python" -m valle.data.recipe describe "$tok/custom_cuts_train.jsonl.gz" "$tok/custom_cuts_dev.jsonl.gz"
  for report in "$man/custom_bad_items.tsv" "$tok/custom_bad_cuts_all.tsv"; do
    if [ -f "$report" ]; then echo "bad items: $(($(wc -l < "$report") - 1)) in $report"; fi
  done
fi
