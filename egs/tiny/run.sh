#!/usr/bin/env bash
# The whole pipeline on a locally made corpus, on CPU (what `make demo` runs), measured:
#   0 corpus (eSpeak NG; held-out sentences and held-out voices kept apart) -> codec (EnCodec where
#     its weights are present, else the offline mel-rvq codec fitted on the training part) ->
#     tokens -> phoneme judge trained on the training part's ground truth
#   1 AR stage (torchrun, 2 ranks, one injected OOM recovered)
#   2 NAR stage, from the AR stage's best-validation checkpoint
#   3 bin/infer.py: held-out sentences with held-out-voice prompts, from the best-validation checkpoint
#   4 bin/evaluate.py: PER, speaker similarity, duration, length-cap hits, beside their ceilings
#   5 summary (wavs, figures, TensorBoard dir, loss-curve PNG, how to listen)
# Training also synthesises a few held-out dev items every --samples-interval steps (TensorBoard's
# AUDIO and IMAGES tabs, PER and similarity by the judge: docs/training.md, "Hear it train").
#   egs/tiny/run.sh [--stage 0] [--stop-stage 5] [--nproc 2] [--ar-epochs 8] [--nar-epochs 2] [--quick true]
#                   [--ar-group-size 1] [--train-voices 4] [--generated 3000] [--valid-samples 4] [--samples-interval 400]
#                   [--exp exp/valle] [--data data/tiny/tokenized]
set -euo pipefail

stage=0
stop_stage=5
nproc=2
ar_epochs=8   # of 3224 training utterances: about 2930 AR steps, 5.6 minutes on 2 cores
nar_epochs=2
ar_max_steps=0   # >0: the AR stage also stops after this many steps
nar_max_steps=0
ar_group_size=1  # frames of codebook 0 per AR position (VALL-E 2's grouped code modeling)
train_voices=4  # eSpeak voices of the training part (prepare.sh --train-voices)
generated=3000  # more sentences, not more epochs, is what lowered held-out PER (docs/evaluation.md)
num_items=8
valid_samples=4  # held-out items synthesised during training (0: none)
samples_interval=400  # every 10th validation: a pass of 4 items took about 8 s on one CPU thread
quick=false
codec=auto
exp=exp/valle  # under egs/tiny
data=data/tiny/tokenized  # under egs/tiny; stage 0 prepares it
python=${PYTHON:-python}

bilingual=false  # true: VALL-E X on English + Mandarin voices instead (egs/tiny/local/bilingual.sh; its flags there)
options="stage stop_stage nproc ar_epochs nar_epochs ar_max_steps nar_max_steps ar_group_size train_voices generated num_items valid_samples samples_interval quick codec exp data python bilingual"
. "$(dirname "${BASH_SOURCE[0]}")/../parse_options.sh"
if [ "$bilingual" = true ]; then exec bash "$(dirname "${BASH_SOURCE[0]}")/local/bilingual.sh" --python "$python"; fi

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$here"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
judge_epochs=30
judge_limit=224  # the natural training sentences (listed first): about 850 CTC steps
valid_interval=40
if [ "$quick" = true ]; then  # the pipeline in a few minutes (tests): little data, short stages
  exp=exp/quick data=data/quick/tokenized generated=100 ar_epochs=1 nar_epochs=1 num_items=2
  judge_epochs=2 judge_limit=40 valid_interval=10 samples_interval=10
  [ "$valid_samples" -le 2 ] || valid_samples=2  # a pass costs seconds: two items are enough here
fi
log() { echo "$(date '+%F %T') [tiny run stage $1] ${*:2}"; }

# A small model, trained in minutes on 2 CPU cores. The guided-attention loss makes its AR read
# the text in order within this budget (docs/training.md; held-out PER 0.86 -> 0.77 measured).
# The AR's head is as wide as the corpus's codebook 0: with stage 0's offline codec 128 codes
# (129 classes with EOS, not 1025), with EnCodec all 1024 (read from the tokenized corpus below).
# 512 codes lowered the codec's floor and raised held-out PER (docs/results-log.md, 2026-12-08).
first_codebook_size=128
model=(--model-name valle --decoder-dim 128 --nhead 4 --num-decoder-layers 2 --prefix-mode 1
       --dropout 0.0 --guided-attention-weight 1.0 --ar-group-size "$ar_group_size")
# Decoding (scripts/bench_quality.py reads this line): top-k 3, best of 4 samples by the model's own
# likelihood, and no EOS before 3 frames per phoneme (an undertrained model ends rows at once).
# On one demo checkpoint these took held-out PER from 0.874 (top-k 10) to 0.753 (docs/evaluation.md).
# The NAR's codes: the least-squared-error code under its distribution, not its argmax (an unsure
# NAR then adds little instead of a wrong guess): 0.813 -> 0.766 on 16 items (docs/inference.md).
decode=(--top-k 3 --num-candidates 4 --min-len-ratio 3 --nar-decoding mmse --seed 1)
# Hear it train: the same decoding on fixed dev items (prompted by another utterance of their
# voice), at most 6 s each, with the judge's PER and speaker similarity, from rank 0.
samples=(--valid-samples "$valid_samples" --valid-samples-interval "$samples_interval"
         --valid-samples-max-seconds 6 --valid-samples-decode="${decode[*]}" --valid-judge "$data/judge.pt")
train=(--manifest-dir "$data" --dataset tiny --max-duration 16 --max-text-tokens 400
       --num-workers 0 --device cpu --dtype float32
       --base-lr 0.05 --warmup-steps 20 --lr-batches 200 --log-interval 20 --valid-interval "$valid_interval"
       --save-every-n 40 --average-period 5 --collective-timeout 120 --stall-min-seconds 300 "${samples[@]}")
torchrun=("$python" -m torch.distributed.run --standalone --nproc_per_node "$nproc")

if [ "$stage" -le 0 ] && [ "$stop_stage" -ge 0 ]; then
  log 0 "corpus (held-out sentences and voices), codec, tokens, phoneme judge"
  PYTHON="$python" bash "$here/prepare.sh" --data-dir "$(dirname "$data")" --layout heldout \
    --codec "$codec" --generated "$generated" --train-voices "$train_voices" --judge-epochs "$judge_epochs" --judge-limit "$judge_limit" \
    --first-codebook-size "$first_codebook_size" --num-jobs 0
fi

if [ "$stage" -le 2 ] && [ "$stop_stage" -ge 1 ]; then
  ar_codebook_size=$("$python" -c "import sys; from valle.codec import first_codebook_size as f; print(f(sys.argv[1]) or 1024)" "$data")
  model+=(--ar-codebook-size "$ar_codebook_size")
fi

if [ "$stage" -le 1 ] && [ "$stop_stage" -ge 1 ]; then
  log 1 "AR stage on $nproc ranks; an OOM is injected in rank $((nproc - 1))'s backward at step 7"
  "${torchrun[@]}" "$root/bin/trainer.py" "${model[@]}" "${train[@]}" --train-stage 1 \
    --exp-dir "$exp/ar" --num-epochs "$ar_epochs" --max-steps "$ar_max_steps" --inject-fault backward@7:$((nproc - 1))
fi

if [ "$stage" -le 2 ] && [ "$stop_stage" -ge 2 ]; then
  # The NAR run starts from the AR stage's best-validation weights: a fresh exp dir holding only
  # that checkpoint, which the trainer resumes in another --train-stage (weights kept, optimizer,
  # scheduler and counters dropped: docs/training.md).
  best_ar=$exp/ar/best-valid-loss.pt
  [ -f "$best_ar" ] || { echo "no $best_ar: did the AR stage validate?" >&2; exit 1; }
  mkdir -p "$exp/nar"
  [ -n "$(ls "$exp"/nar/*.pt 2>/dev/null)" ] || cp "$best_ar" "$exp/nar/epoch-0.pt"
  log 2 "NAR stage on $nproc ranks, from $best_ar"
  "${torchrun[@]}" "$root/bin/trainer.py" "${model[@]}" "${train[@]}" --train-stage 2 \
    --exp-dir "$exp/nar" --num-epochs "$nar_epochs" --max-steps "$nar_max_steps"
fi

checkpoint=$exp/nar/best-valid-loss.pt
items=$exp/infer/items.tsv
if [ "$stage" -le 3 ] && [ "$stop_stage" -ge 3 ]; then
  log 3 "synthesise $num_items held-out sentences with held-out-voice prompts ($checkpoint)"
  mkdir -p "$exp/infer"
  "$python" "$here/local/test_items.py" --cuts "$data/tiny_cuts_test.jsonl.gz" --num-items "$num_items" \
    --infer-tsv "$exp/infer/infer.tsv" --eval-tsv "$items"
  "$python" "$root/bin/infer.py" --checkpoint "$checkpoint" --device cpu --tsv "$exp/infer/infer.tsv" \
    --output-dir "$exp/infer" "${decode[@]}" --batch-size 4 --allow-random-encodec ||
    log 3 "some items gave no audio: the evaluation scores them as silence"
fi

if [ "$stage" -le 4 ] && [ "$stop_stage" -ge 4 ]; then
  log 4 "evaluate: PER (phoneme judge), speaker similarity, duration, beside ground truth and codec resynthesis"
  "$python" "$root/bin/evaluate.py" --tsv "$items" --output-dir "$exp/infer" --checkpoint "$checkpoint" \
    --manifest-dir "$data" --output-json "$exp/eval.json" --exp-dir "$exp" --allow-random-encodec \
    --missing-as-empty
fi

if [ "$stage" -le 5 ] && [ "$stop_stage" -ge 5 ]; then
  log 5 "summary"
  "$python" "$root/scripts/demo_summary.py" --exp-dir "$exp"
fi
