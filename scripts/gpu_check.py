#!/usr/bin/env python3
"""Every GPU check in one run (`make gpu-check`); needs torch and a CUDA device only.

1. Real OOMs (the allocator really fails) in forward and in backward are
   recovered by the resilient step; the run completes with consistent state.
2. The pessimistic scan's peak memory against the measured peak of the same
   batch in a real training step.
3. The NAR backward reserve on a fragmented pool (expandable segments off):
   does backward still fit with and without the reserve.
4. The step and model benchmarks on the GPU.
5. --max-duration auto: a short run at the chosen budget, its peak against the memory
   budget (goal >= 85%) and its OOM events (goal 0).
6. The trainer against a bare training loop at the demo's size, and the same step with
   16x the audio per step (goal: 16x the audio costs <= 2x the time).
7. AR decoding at batch 1 and 8: the growing KV cache, the static cache, and the static
   step captured in a CUDA graph (`--cuda-graphs`), at the paper's size in bf16.
8. --compile: real OOMs inside the compiled forward/backward recovered, and steps/s
   eager vs --compile at the demo size (scripts/bench_compile.py).
9. EnCodec tokenization throughput: hours of audio per GPU-hour, batched as bin/tokenizer.py
   batches (about 300 s of audio per encoder batch on a GPU, sorted by duration), and what
   1,000 hours of a corpus cost in GPU-hours (docs/data.md).

Results go to $OUT/gpu-check.md (or ./out/gpu-check.md). `--device cpu --quick` runs
items 5 to 9 at tiny sizes on the CPU (a smoke test of the script; the CUDA-only items
say they were skipped), so a drawn device only has to run it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = Path(os.environ.get("OUT") or ROOT / "out")
MODEL = ["--decoder-dim", "512", "--nhead", "8", "--num-decoder-layers", "6", "--dropout", "0",
         "--device", "cuda", "--tensorboard", "false"]


def trainer(exp: Path, *extra: str, timeout: int = 300, model: list[str] = MODEL
            ) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "bin/trainer.py"), *model, "--exp-dir", str(exp),
           "--synthetic-data", "64", "--synthetic-batch-size", "16", "--num-epochs", "1",
           "--log-interval", "1", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def check_real_ooms(lines: list[str]) -> None:
    exp = OUT / "real-oom"
    # 64 synthetic cuts in batches of 16: one epoch is 4 steps (--max-steps 5 does not cut it short).
    proc = trainer(exp, "--dtype", "float16", "--inject-fault-real", "true", "--inject-fault", "forward@1",
                   "--inject-fault", "backward@3", "--max-steps", "5", "--check-consistency-every", "1",
                   "--oom-check", "false")
    events = []
    events_file = exp / "oom" / "events-rank0.jsonl"
    if events_file.exists():
        events = [json.loads(x) for x in events_file.read_text().splitlines()]
    summary = exp / "summary-rank0.json"
    data = json.loads(summary.read_text()) if summary.exists() else {"steps": None, "epochs": [{}]}
    steps, epoch = data["steps"], (data.get("epochs") or [{}])[0]
    lines += ["## Real OOMs in forward and backward (fp16, GradScaler)", "",
              f"exit code {proc.returncode}, steps {steps} (expected 4: 64 cuts in batches of 16); "
              f"cuts drawn {epoch.get('cuts_drawn')} = trained {epoch.get('cuts_trained')} + quarantined "
              f"{epoch.get('cuts_quarantined')} + skipped {epoch.get('cuts_skipped')}; OOM events "
              f"{epoch.get('oom_events')}, retries {epoch.get('retries')}", "",
              "| phase | injected | message | allocated MiB | reserved MiB |", "|---|---|---|---|---|"]
    for e in events:
        lines.append(f"| {e['phase']} | {e['injected']} | {e['message'][:60]} | "
                     f"{e['memory'].get('allocated', 0) >> 20} | {e['memory'].get('reserved', 0) >> 20} |")
    if proc.returncode:
        lines += ["", "```", proc.stderr[-3000:], "```"]
    lines.append("")


def check_scan_vs_step(lines: list[str]) -> None:
    import torch

    from valle.train.build import build_run
    from valle.train.cli import parse_config
    from valle.train.dist import init_distributed
    from valle.train.resilience.scan import scan_pessimistic_batches

    cfg = parse_config(MODEL + ["--exp-dir", str(OUT / "scan"), "--synthetic-data", "64",
                                "--synthetic-batch-size", "16"])
    run = build_run(cfg, init_distributed("cuda"))
    batches = run.data.pessimistic_batches()
    rows = scan_pessimistic_batches(run.stepper, batches, cfg)
    lines += ["## Scan peak vs training-step peak", "",
              "| criterion | scan peak MiB | step peak MiB | ratio |", "|---|---|---|---|"]
    for row, (name, batch) in zip(rows, batches.items()):
        torch.cuda.reset_peak_memory_stats()
        run.stepper.run(0, batch)
        measured = torch.cuda.max_memory_allocated()
        lines.append(f"| {name} | {row.peak_bytes >> 20} | {measured >> 20} | "
                     f"{row.peak_bytes / max(measured, 1):.3f} |")
    lines.append("")


FRAGMENT_SNIPPET = r"""
import sys, torch
sys.path.insert(0, {root!r})
from valle.train.resilience.memory import BackwardReserve
from valle.models import get_model, MODEL_DEFAULTS
import argparse
reserve_mb = int(sys.argv[1])
torch.manual_seed(0)
model = get_model(argparse.Namespace(**{{**MODEL_DEFAULTS, "decoder_dim": 1024, "nhead": 16,
    "num_decoder_layers": 12, "dropout": 0.0}})).cuda()
from valle.train.synthetic import SyntheticCorpus, SyntheticSpec, collate
batch = collate(SyntheticCorpus(SyntheticSpec(num_cuts=24, text_len=(150, 150), audio_len=(1000, 1000))).cuts)
batch = {{k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}}
free, total = torch.cuda.mem_get_info()
# Fragment: fill memory with small blocks, free every other one.
blocks = []
try:
    while True:
        blocks.append(torch.empty(96 << 20, dtype=torch.uint8, device="cuda"))
except torch.OutOfMemoryError:
    pass
for i in range(0, len(blocks), 2):
    blocks[i] = None
from valle.train.resilience.memory import is_oom_error
reserve = BackwardReserve(torch.device("cuda"), reserve_mb)
ok, how = True, "-"
try:
    reserve.hold()
    loss, _ = model(batch["text_tokens"], batch["text_tokens_lens"], batch["audio_features"],
                    batch["audio_features_lens"], train_stage=2)
    reserve.release()
    loss.backward()
    torch.cuda.synchronize()
except Exception as e:  # the OOM may arrive as a CUDA/cuBLAS error, not OutOfMemoryError
    if not is_oom_error(e):
        raise
    ok = False
    how = type(e).__name__ + ": " + str(e).strip().splitlines()[0][:90].replace("|", "/")
print("RESULT", reserve_mb, ok, len(blocks), how)
"""


def check_reserve(lines: list[str]) -> None:
    lines += ["## NAR backward reserve on a fragmented pool (expandable segments off)", "",
              "| reserve MiB | backward fits | how it failed |", "|---|---|---|"]
    env = {**os.environ, "PYTORCH_ALLOC_CONF": "expandable_segments:False",
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    for reserve_mb in (0, 1024):
        proc = subprocess.run([sys.executable, "-c", FRAGMENT_SNIPPET.format(root=str(ROOT)),
                               str(reserve_mb)], capture_output=True, text=True, timeout=300, env=env)
        result = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
        if result:
            _, _, fits, _, how = result[0].split(" ", 4)
            lines.append(f"| {reserve_mb} | {fits} | {how} |")
        else:  # not an out-of-memory error: show where it came from
            err = [x for x in proc.stderr.splitlines() if "Error" in x][-1:] or [proc.stderr[-300:]]
            lines.append(f"| {reserve_mb} | error | {err[0][:200].replace('|', '/')} |")
    lines.append("")


def check_host_overhead(lines: list[str], device: str, quick: bool) -> None:
    """bin/trainer.py's marginal step time against a bare zero_grad/forward/backward/AdamW
    loop on the same model and batches (scripts/bench_host.py), at the demo's size, with
    the demo's 8 cuts per step and with 16x that: is the GPU filled, or host-bound?"""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_host

    bench_host.CLOCK[0] = time.perf_counter  # wall time: the GPU works asynchronously
    size, batches, steps = ("tiny", (2, 32), 2) if quick else ("demo", (8, 128), 20)
    results = {}
    for batch in batches:
        args = argparse.Namespace(batch=batch, device=device, threads=1, repeats=1,
                                  steps={size: steps})
        results[batch] = bench_host.one_rank(args, size)
    small, large = batches
    lines += [f"## Trainer vs bare loop ({size} model, synthetic data, {device}, fp32)", "",
              "| cuts per step | variant | ms/step | vs bare loop |", "|---|---|---|---|"]
    for batch, times in results.items():
        base = times["bare loop (torch fused AdamW)"]
        for name, t in times.items():
            lines.append(f"| {batch} | {name} | {t * 1e3:.2f} | {t / base:.3f}x |")
    trainer = "trainer, AdamW"
    ratio = results[large][trainer] / results[small][trainer]
    lines += ["", f"{large // small}x the audio per step costs {ratio:.2f}x the step time "
              "(goal on a GPU: <= 2x, i.e. the demo's batch leaves the GPU mostly idle and "
              "larger batches are nearly free)", ""]


def check_decoding(lines: list[str], device: str, quick: bool) -> None:
    """AR decoding frames/s at batch 1 and 8: growing cache, static cache, CUDA graphs."""
    import torch

    from valle.models import MODEL_DEFAULTS, NUM_AUDIO_TOKENS, get_model
    from valle.models.generation import DecodeOptions, ar_generate

    dims = dict(decoder_dim=64, nhead=4, num_decoder_layers=2) if quick else dict(
        decoder_dim=1024, nhead=16, num_decoder_layers=12)
    frames, prompt_frames, text_len = (40, 30, 20) if quick else (600, 225, 60)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = get_model(argparse.Namespace(**{**MODEL_DEFAULTS, **dims, "dropout": 0.0}))
    model = model.to(device=device, dtype=dtype).eval()
    modes = {"growing KV cache": {}, "static cache": {"static_cache": True}}
    if device == "cuda":
        modes["static cache + CUDA graph"] = {"cuda_graphs": True}
    lines += [f"## AR decoding ({dims['decoder_dim']} dim, {dims['num_decoder_layers']} layers, "
              f"{str(dtype).split('.')[-1]}, {frames} frames after a {prompt_frames}-frame prompt)",
              "", "| batch | mode | s | frames/s | x real time |", "|---|---|---|---|---|"]
    g = torch.Generator().manual_seed(1)
    for batch in (1, 8):
        text = torch.randint(4, 200, (batch, text_len), generator=g).to(device)
        prompt = torch.randint(0, NUM_AUDIO_TOKENS, (batch, prompt_frames), generator=g).to(device)
        lens = torch.full((batch,), text_len, device=device)
        prompt_lens = torch.full((batch,), prompt_frames, device=device)
        for name, extra in modes.items():
            options = DecodeOptions(seed=0, force_len=frames, **extra)
            times = []
            with torch.no_grad():
                for _ in range(1 if quick else 3):  # the first also warms up / captures
                    start = time.perf_counter()
                    ar_generate(model, text, lens, prompt, prompt_lens, options)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
            t = statistics.median(times[1:] or times)
            rate = batch * frames / t
            lines.append(f"| {batch} | {name} | {t:.3f} | {rate:.0f} | {rate / 75:.1f} |")
    lines.append("")


def check_compile_real_ooms(lines: list[str], device: str = "cuda") -> None:
    """--compile at the demo size: a real OOM in the forward phase and one inside the compiled
    backward (--inject-fault-real fills the GPU, so the compiled backward's own allocations
    fail); the run must finish every step with nothing lost and consistent state."""
    exp = OUT / "compile-real-oom"
    model = ["--decoder-dim", "128", "--nhead", "4", "--num-decoder-layers", "2", "--dropout", "0",
             "--device", device, "--tensorboard", "false"]
    # on CPU (the smoke test) aot_eager: the same graphs and compiled backward without
    # inductor's minutes of C++ generation
    real = ["--inject-fault-real", "true"] if device == "cuda" else ["--compile-backend", "aot_eager"]
    proc = trainer(exp, "--compile", "--inject-fault", "forward@1", "--inject-fault", "backward@2",
                   *real, "--max-steps", "4", "--check-consistency-every", "1", "--oom-check",
                   "false", model=model, timeout=900)
    summary = exp / "summary-rank0.json"
    data = json.loads(summary.read_text()) if summary.exists() else {"steps": None, "epochs": [{}]}
    epoch = (data.get("epochs") or [{}])[0]
    compile_lines = [x for x in proc.stderr.splitlines() + proc.stdout.splitlines()
                     if "compile:" in x and "done:" in x]
    lines += ["## --compile: real OOMs in the forward phase and inside the compiled backward", "",
              f"exit code {proc.returncode}, steps {data['steps']} (expected 4); cuts drawn "
              f"{epoch.get('cuts_drawn')} = trained {epoch.get('cuts_trained')} + quarantined "
              f"{epoch.get('cuts_quarantined')} + skipped {epoch.get('cuts_skipped')}; OOM events "
              f"{epoch.get('oom_events')}", "",
              (compile_lines[-1].split("|")[-1].strip() if compile_lines else "no compile note"), ""]
    if proc.returncode:
        lines += ["```", proc.stderr[-3000:], "```", ""]


def check_auto_batch(lines: list[str], device: str, quick: bool) -> None:
    """--max-duration auto (synthetic data: the batch size in cuts) fills the memory budget:
    a short run at the chosen budget peaks at >= 85% of it with 0 OOM events. On the GPU the
    budget is --memory-budget-gb (enforced with set_per_process_memory_fraction) so that the
    synthetic corpus can fill it; on CPU (--quick) the memory meter is the device."""
    exp = OUT / "auto-batch"
    if quick:
        model, cuts, budget = ["--decoder-dim", "32", "--nhead", "2", "--num-decoder-layers", "1",
                               "--dropout", "0", "--device", device, "--tensorboard", "false"], 64, "0.05"
    else:
        model, cuts, budget = MODEL, 4096, "8"
    cmd = [sys.executable, str(ROOT / "bin/trainer.py"), *model, "--exp-dir", str(exp),
           "--synthetic-data", str(cuts), "--num-epochs", "1", "--max-steps", "20",
           "--log-interval", "1", "--max-duration", "auto", "--memory-budget-gb", budget,
           *(["--dtype", "bfloat16"] if device == "cuda" else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    summary = exp / "summary-rank0.json"
    data = json.loads(summary.read_text()) if summary.exists() else {}
    peak, total = data.get("peak_memory_bytes", 0), data.get("memory_budget_bytes", 0)
    fraction = peak / total if total else 0.0
    chosen = [x.split("INFO")[-1] for x in proc.stderr.splitlines() if "auto =" in x]
    lines += ["## --max-duration auto: the chosen budget's peak against the memory budget", "",
              f"exit code {proc.returncode}; {chosen[-1].strip() if chosen else 'no choice logged'}; "
              f"steps {data.get('steps')}; peak {peak / 2**20:.0f} MiB of {total / 2**20:.0f} MiB = "
              f"{fraction:.1%} (goal >= 85%); OOM events {data.get('oom_events')} (goal 0)", ""]
    if proc.returncode:
        lines += ["```", proc.stderr[-3000:], "```", ""]
def check_tokenizer_throughput(lines: list[str], device: str, quick: bool) -> None:
    """EnCodec encoding as the tokenizer runs it: utterances of LibriTTS-like lengths (2-20 s),
    batched by ``duration_batches`` at the tokenizer's default batch duration, random weights
    (the same cost as the real ones). Audio loading is left out: DataLoader workers overlap it."""
    import torch

    from valle.codec.encodec import AudioTokenizer
    from valle.data.pipeline import duration_batches

    codec = AudioTokenizer(torch.device(device), None, allow_random_weights=True, seed=0, download=False)
    n, batch_duration = (12, 10.0) if quick else (600, 300.0)
    rng = torch.Generator().manual_seed(0)
    lengths = (2 + 18 * torch.rand(n, generator=rng)).tolist()
    if quick:
        lengths = [1 + x / 10 for x in lengths]

    class Cut:  # what duration_batches reads
        def __init__(self, duration: float) -> None:
            self.duration = duration

    cuts = [Cut(x) for x in lengths]
    wavs = [0.1 * torch.randn(int(x * codec.sample_rate), generator=rng) for x in lengths]
    batches = duration_batches(cuts, batch_duration)
    codec.encode_batch([wavs[i] for i in batches[0]])  # warm-up (cuDNN autotuning, allocator)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    for batch in batches:
        codec.encode_batch([wavs[i] for i in batch])
    sync()
    elapsed = time.perf_counter() - started
    audio = sum(lengths)
    per_hour = audio / elapsed
    lines += ["## EnCodec tokenization throughput (bin/tokenizer.py's batching)", "",
              f"{n} utterances, {audio / 3600:.3f} h of audio, {len(batches)} batches of about "
              f"{batch_duration:.0f} s, {device}", "",
              "| hours of audio per GPU-hour | GPU-hours per 1,000 h of audio | x real time |",
              "|---|---|---|",
              f"| {per_hour:.1f} | {1000 / per_hour:.2f} | {per_hour:.1f}x |", ""]


def run_bench(lines: list[str], script: str, *args: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], capture_output=True,
                          text=True, timeout=600)
    lines += [f"## {script} {' '.join(args)}", "", proc.stdout[-6000:] or proc.stderr[-3000:], ""]


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the CPU smoke test)")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device visible; nothing to do (--device cpu --quick: the "
              "script's smoke test)", file=sys.stderr)
        sys.exit(1)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    lines = ["# GPU check", "", f"{name} — torch {torch.__version__} — "
             f"{time.strftime('%Y-%m-%d')}", ""]

    def run_check(check, *extra) -> None:
        started = time.monotonic()
        try:
            check(lines, *extra)
        except Exception as exc:  # noqa: BLE001 - one failed check must not hide the others
            lines.extend([f"## {check.__name__} failed: {type(exc).__name__}: {exc}", ""])
        lines.append(f"({check.__name__}: {time.monotonic() - started:.0f} s)\n")
        (OUT / "gpu-check.md").write_text("\n".join(lines))

    if args.device == "cuda":
        for check in (check_real_ooms, check_scan_vs_step, check_reserve):
            run_check(check)
    else:
        lines += ["(real OOMs, scan peak and backward reserve need CUDA: skipped)", ""]
    run_check(check_auto_batch, args.device, args.quick)
    run_check(check_host_overhead, args.device, args.quick)
    run_check(check_decoding, args.device, args.quick)
    run_check(check_compile_real_ooms, args.device)
    run_check(check_tokenizer_throughput, args.device, args.quick)
    if args.device == "cuda":
        run_bench(lines, "bench_step.py", "--device", "cuda", "--dim", "1024", "--layers", "12",
                  "--batch", "16", "--text", "100", "--frames", "600")
        run_bench(lines, "bench_models.py", "--device", "cuda")
        run_bench(lines, "bench_compile.py", "--device", "cuda", "--sizes", "demo")
        run_bench(lines, "bench_memory.py", "--device", "cuda", "--budget-gb", "0")
    else:
        # the CPU smoke test checks the plumbing: inductor's CPU code generation takes minutes
        # and has its own test (tests/train/test_compile.py)
        run_bench(lines, "bench_compile.py", "--device", "cpu", "--sizes", "tiny", "--blocks", "1",
                  "--block-steps", "2", "--backend", "aot_eager")
    (OUT / "gpu-check.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
