#!/usr/bin/env bash
# What more compute buys the demo: its recipe (egs/tiny/run.sh stages 1-2) trained on one GPU for a
# fixed wall time, two models side by side on the same GPU, on an already tokenized demo corpus:
#   A  the demo's model (d=128, 2 layers), fp32, the demo's global batch (32 s of audio a step)
#   B  a larger one (d=256, 4 layers), bf16 autocast, 64 s a step
# The GPU machine has no phoneme judge or speaker encoder, so the checkpoints come back stripped
# (weights only, each file < 16 MiB: scripts/gpu_quality.py pack) and are scored on CPU with
# `python scripts/gpu_quality.py score DIR...` (docs/evaluation.md, "More compute").
#
#   OUT=dir bash scripts/gpu_quality.sh          # on the GPU machine, from the repository root
#   DEVICE=cpu AR_SECONDS=40 NAR_SECONDS=30 INTERVAL=10 bash scripts/gpu_quality.sh   # smoke run
#
# Needs egs/tiny/$DATA (default data/gen10k/tokenized: `egs/tiny/run.sh --stop-stage 0
# --generated 10000 --data data/gen10k/tokenized`). Where lhotse is missing it installs the wheels
# under .whl/ (git-ignored; where pip works: `python3 -m pip download --no-deps --only-binary=:all:
# --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform
# manylinux2014_x86_64 -d .whl lhotse==1.33.0 cytoolz==1.2.0 intervaltree==3.2.1 soundfile==0.14.0
# cffi pycparser audioread==3.1.0`; the device tool carries it with `carry: [".whl", DATA]`);
# where that fails it runs `make gpu-check` instead.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$root/out/gpu-quality}
device=${DEVICE:-cuda}
ar_seconds=${AR_SECONDS:-270}
nar_seconds=${NAR_SECONDS:-150}
interval=${INTERVAL:-250}  # steps between validations (and checkpoints)
data=${DATA:-data/gen10k/tokenized}
py=${PYTHON:-python3}
[[ "$py" == */* ]] && py=$(cd "$(dirname "$py")" && pwd)/$(basename "$py")  # the stages run in egs/tiny
mkdir -p "$out"
exec > >(tee "$out/run.log") 2>&1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 PYTHONPATH="$root"
if ! "$py" -c "import lhotse" 2>/dev/null && [ -d "$root/.whl" ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$root"/.whl/*.whl && export PYTHONPATH="$root:/tmp/site"
fi
if ! "$py" -c "import lhotse, h5py, soundfile, torch; print('lhotse', lhotse.__version__, 'torch', torch.__version__)"; then
  echo "gpu_quality: the data stack does not import here; running the GPU check instead"
  bash "$root/scripts/gpu_check.sh"
  exit
fi
[ "$device" = cuda ] && nvidia-smi -L

cd "$root/egs/tiny"
exp=exp/gpu-quality
rm -rf "$exp" && mkdir -p "$exp"
model_a=(--decoder-dim 128 --nhead 4 --num-decoder-layers 2 --max-duration 32 --dtype float32)
model_b=(--decoder-dim 256 --nhead 8 --num-decoder-layers 4 --max-duration 64 --dtype bfloat16)
# --ar-codebook-size 128: the demo's flag since 953e3ef (its corpus has 128 codes in codebook 0);
# the GPU table in docs/evaluation.md was measured before it, with the 1025-class head.
common=(--model-name valle --prefix-mode 1 --dropout 0.0 --guided-attention-weight 1.0 --ar-codebook-size 128
        --manifest-dir "$data" --dataset tiny --max-text-tokens 400 --num-workers 2 --device "$device"
        --base-lr 0.05 --warmup-steps 20 --lr-batches 200 --log-interval 100 --valid-interval "$interval"
        --save-every-n "$interval" --keep-last-k 1000 --average-period 5 --num-epochs 1000
        --tensorboard false)

# train NAME STAGE SECONDS MODEL-FLAGS...: one stage, stopped after SECONDS (its checkpoints stay).
train() {
  local name=$1 stage=$2 seconds=$3 dir
  shift 3
  dir=$exp/$name/$([ "$stage" = 1 ] && echo ar || echo nar)
  mkdir -p "$dir"
  timeout -k 15 "$seconds" "$py" "$root/bin/trainer.py" "${common[@]}" "$@" --train-stage "$stage" \
    --exp-dir "$dir" >"$exp/$name-stage$stage.log" 2>&1
  local rc=$?
  echo "$(date +%T) $name stage $stage ended ($rc; 124 = stopped by its time limit): $(grep -c 'validation at' "$exp/$name-stage$stage.log") validations"
}

echo "$(date +%T) AR stage: A and B side by side for ${ar_seconds}s"
train A 1 "$ar_seconds" "${model_a[@]}" & a=$!
train B 1 "$ar_seconds" "${model_b[@]}" & b=$!
wait $a $b  # not a bare wait: it would wait for the tee above too
for name in A B; do
  best=$exp/$name/ar/best-valid-loss.pt
  [ -f "$best" ] || { echo "no $best"; tail -20 "$exp/$name-stage1.log"; continue; }
  mkdir -p "$exp/$name/nar" && cp "$best" "$exp/$name/nar/epoch-0.pt"
done
echo "$(date +%T) NAR stage: A and B side by side for ${nar_seconds}s, from their best AR"
train A 2 "$nar_seconds" "${model_a[@]}" & a=$!
train B 2 "$nar_seconds" "${model_b[@]}" & b=$!
wait $a $b  # not a bare wait: it would wait for the tee above too

"$py" "$root/scripts/gpu_quality.py" pack "$exp" "$out" --snapshots A
tar czf "$out/logs.tgz" --exclude='*.pt' --exclude='*.tmp' "$exp"
ls -la "$out"
