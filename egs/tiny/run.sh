#!/usr/bin/env bash
# The whole pipeline on a locally made corpus, on CPU (what `make demo` runs):
#   corpus (eSpeak NG) -> tokens -> AR stage -> NAR stage (torchrun, 2 ranks, one injected
#   OOM recovered) -> bin/infer.py writes a wav -> summary (wav, TensorBoard dir, loss-curve PNG).
#   egs/tiny/run.sh [--stage 0] [--stop-stage 4] [--nproc 2] [--epochs 12]
set -euo pipefail

stage=0
stop_stage=4
nproc=2
epochs=30
python=${PYTHON:-python}

options="stage stop_stage nproc epochs python"
. "$(dirname "${BASH_SOURCE[0]}")/../parse_options.sh"

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$here"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
exp=exp/valle
data=data/tiny/tokenized
log() { echo "$(date '+%F %T') [tiny run stage $1] ${*:2}"; }

# A small model: the point is the pipeline and the resilience, on 2 CPU cores.
model=(--model-name valle --decoder-dim 128 --nhead 4 --num-decoder-layers 2 --prefix-mode 1
       --dropout 0.0)
train=(--manifest-dir "$data" --dataset tiny --max-duration 16 --max-text-tokens 400
       --num-workers 0 --device cpu --dtype float32 --exp-dir "$exp" --num-epochs "$epochs"
       --base-lr 0.05 --warmup-steps 20 --lr-batches 200 --log-interval 10 --valid-interval 40
       --save-every-n 40 --average-period 5 --collective-timeout 120 --stall-min-seconds 300)
torchrun=("$python" -m torch.distributed.run --standalone --nproc_per_node "$nproc")

if [ "$stage" -le 0 ] && [ "$stop_stage" -ge 0 ]; then
  log 0 "corpus and tokens"
  PYTHON="$python" bash "$here/prepare.sh"
fi

if [ "$stage" -le 1 ] && [ "$stop_stage" -ge 1 ]; then
  log 1 "AR stage on $nproc ranks; an OOM is injected in rank 1's backward at step 7"
  "${torchrun[@]}" "$root/bin/trainer.py" "${model[@]}" "${train[@]}" --train-stage 1 \
    --inject-fault backward@7:$((nproc - 1))
fi

if [ "$stage" -le 2 ] && [ "$stop_stage" -ge 2 ]; then
  log 2 "NAR stage on $nproc ranks, starting from the AR weights"
  "${torchrun[@]}" "$root/bin/trainer.py" "${model[@]}" "${train[@]}" --train-stage 2
fi

prompt_tsv=$exp/infer/prompt.tsv
if [ "$stage" -le 3 ] && [ "$stop_stage" -ge 3 ]; then
  log 3 "synthesise with bin/infer.py (prompt: a held-out utterance)"
  mkdir -p "$exp/infer"
  "$python" - "$data/tiny_cuts_test.jsonl.gz" "$prompt_tsv" <<'PY'
import sys
from lhotse import CutSet
cut = next(iter(CutSet.from_file(sys.argv[1])))
with open(sys.argv[2], "w") as f:
    f.write(f"{cut.supervisions[0].text}\t{cut.recording.sources[0].source}\n")
PY
  IFS=$'\t' read -r prompt_text prompt_wav < "$prompt_tsv"
  checkpoint=$(ls -t "$exp"/epoch-*.pt | head -n 1)
  "$python" "$root/bin/infer.py" --checkpoint "$checkpoint" --device cpu \
    --text-prompts "$prompt_text" --audio-prompts "$prompt_wav" \
    --text "A tiny model trained on a tiny corpus says hello." \
    --output-dir "$exp/infer" --top-k 10 --seed 1 --allow-random-encodec
fi

if [ "$stage" -le 4 ] && [ "$stop_stage" -ge 4 ]; then
  log 4 "summary"
  "$python" "$root/scripts/demo_summary.py" --exp-dir "$exp"
fi
