#!/usr/bin/env bash
# `make bench`: every side-by-side benchmark in one run, written to docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
out=docs/benchmarks.md
tmp=$(mktemp)
{
  echo "# Benchmarks"
  echo
  echo "Written by \`make bench\` (scripts/bench.sh) on $(date -u '+%Y-%m-%d') — $(getconf _NPROCESSORS_ONLN) CPU cores,"
  echo "torch $(python -c 'import torch; print(torch.__version__)'), no GPU unless stated."
  echo "Each table is measured side by side in one run; ratios matter more than absolute times."
  echo
  echo "## Resilient step: guarded vs unguarded, and gradient sync modes"
  echo
  echo '```'
  echo "python scripts/bench_step.py"
  echo '```'
  echo
  python scripts/bench_step.py 2>/dev/null | grep -v -e '^command:' -e 'Gloo' -e 'connected to' -e 'peer ranks'
  echo
  echo "## Trainer vs bare loop: the trainer's own host time per step"
  echo
  echo '```'
  echo "python scripts/bench_host.py"
  echo "python scripts/bench_host.py --profile --sizes tiny"
  echo '```'
  echo
  python scripts/bench_host.py 2>/dev/null | grep -v -e '^command:' -e 'Gloo' -e 'connected to' -e 'peer ranks'
  python scripts/bench_host.py --profile --sizes tiny 2>/dev/null | grep -v -e '^command:' -e 'Gloo' -e 'connected to' -e 'peer ranks'
  echo
  echo "## Model: training-step FLOP/s and KV-cache decoding"
  echo
  echo '```'
  echo "python scripts/bench_models.py"
  echo '```'
  echo
  python scripts/bench_models.py 2>/dev/null | grep -v -e '^command:' -e 'Gloo' -e 'connected to' -e 'peer ranks'
  echo
  echo "## Preemption: steps redone, and SIGTERM to exit"
  echo
  echo '```'
  echo "python scripts/bench_preemption.py"
  echo '```'
  echo
  python scripts/bench_preemption.py 2>/dev/null | grep -v -e 'Gloo' -e 'connected to' -e 'peer ranks'
  echo
  echo "## Memory: activation checkpointing on/off, the CPU meter's cost, --max-duration auto"
  echo
  echo '```'
  echo "python scripts/bench_memory.py"
  echo '```'
  echo
  python scripts/bench_memory.py 2>/dev/null | grep -v -e '^command:' -e 'Gloo' -e 'connected to' -e 'peer ranks'
  echo "## Start-up against corpus size: launch to the end of 2 training steps, peak RSS"
  echo
  echo '```'
  echo "python scripts/bench_startup.py --sizes 10000,100000,400000,1000000"
  echo '```'
  echo
  python scripts/bench_startup.py --sizes 10000,100000,400000,1000000 2>/dev/null
  echo
  echo "## --compile: eager against torch.compile, steps/s (each size compiles first: minutes on CPU)"
  echo
  echo '```'
  echo "python scripts/bench_compile.py"
  echo '```'
  echo
  python scripts/bench_compile.py 2>/dev/null | grep -v -e 'Gloo' -e 'connected to' -e 'peer ranks'
  echo
  echo "## LoRA against full fine-tuning: optimizer state, peak memory, checkpoint size"
  echo
  echo '```'
  echo "python scripts/bench_lora.py"
  echo '```'
  echo
  python scripts/bench_lora.py 2>/dev/null | grep -v -e 'CPUAllocator' -e 'gpuGetDeviceCount'
  echo
  echo "## recipe combine against corpus size: time and peak RSS (ids checked in an on-disk table)"
  echo
  echo '```'
  echo "python scripts/bench_combine.py --sizes 100000,400000"
  echo '```'
  echo
  python scripts/bench_combine.py --sizes 100000,400000 2>/dev/null
  echo
  echo "## EnCodec: valle's own model against the encodec package (same weights, codes checked equal)"
  echo
  echo '```'
  echo "python scripts/bench_codec.py --threads 2"
  echo '```'
  echo
  python scripts/bench_codec.py --threads 2 2>/dev/null
  echo
  echo "## Synthesis server under load: batching across requests, refusals with a full queue"
  echo
  echo '```'
  echo "python scripts/bench_serve.py"
  echo '```'
  echo
  python scripts/bench_serve.py 2>/dev/null
  echo
  echo "## Tokenization throughput"
  echo
  echo '```'
  echo "python scripts/bench_tokenizer.py"
  echo '```'
  echo
  python scripts/bench_tokenizer.py 2>/dev/null
  echo
  echo "## Quality against training time (the demo's model and corpus)"
  echo
  echo '```'
  echo "python scripts/bench_quality.py"
  echo '```'
  echo
  python scripts/bench_quality.py 2>/dev/null
} > "$tmp"
# Keep notes written by hand below the generated part.
if [ -f "$out" ] && grep -q '^<!-- notes -->' "$out"; then
  sed -n '/^<!-- notes -->/,$p' "$out" >> "$tmp"
fi
mv "$tmp" "$out"
cat "$out"
