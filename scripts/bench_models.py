#!/usr/bin/env python3
"""Model benchmarks, side by side in one run (``make bench``):

1. one training step (stage 0, forward + backward, fp32): achieved FLOP/s, counted with
   torch.utils.flop_counter, against this machine's measured fp32 matmul rate;
2. the AR training step with the guided-attention loss (--guided-attention-weight, which
   computes the probed layers' attention explicitly instead of by SDPA) against without;
3. AR decoding of 8.5 s of audio (638 frames at 75 Hz) after a 3 s prompt (225
   frames), with and without the KV cache (EOS ignored so both run the same length);
4. grouped code modeling (--ar-group-size 2, VALL-E 2) against the plain AR: the AR training
   step and KV-cache decoding of the same frames.

Prints the exact command first, then markdown tables.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count  # noqa: E402

from valle.models import NUM_AUDIO_TOKENS, get_model  # noqa: E402
from valle.models.generation import DecodeOptions, ar_generate, nar_generate  # noqa: E402

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
              "aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
              "aten::_scaled_dot_product_efficient_attention",
              "aten::_scaled_dot_product_flash_attention")  # fmt: skip


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward_flops(
    grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
):
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _custom_flops() -> dict:
    """FlopCounterMode knows the CUDA attention kernels but not the CPU flash ones (torch 2.9)."""
    mapping = {}
    aten = torch.ops.aten
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mapping[aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_sdpa_flops
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        mapping[aten._scaled_dot_product_flash_attention_for_cpu_backward] = (
            _cpu_sdpa_backward_flops
        )
    return mapping


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, repeats: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def matmul_rate(n: int, m: int, k: int, device, repeats: int) -> float:
    """Best-of-N FLOP/s of an (n x k) @ (k x m) fp32 matmul (best: the machine may be shared)."""
    a = torch.randn(n, k, device=device)
    b = torch.randn(k, m, device=device)
    times = _time(lambda: a @ b, device, repeats)
    return 2 * n * m * k / min(times)


def make_batch(bsz: int, text_len: int, audio_len: int, q: int, vocab: int, device):
    g = torch.Generator().manual_seed(0)
    text = torch.randint(4, vocab, (bsz, text_len), generator=g)
    audio = torch.randint(0, NUM_AUDIO_TOKENS, (bsz, audio_len, q), generator=g)
    full = torch.full((bsz,), 0, dtype=torch.long)
    return (
        text.to(device),
        (full + text_len).to(device),
        audio.to(device),
        (full + audio_len).to(device),
    )


def bench_train(model, batch, device, repeats: int):
    seeds = torch.arange(batch[0].shape[0], device=device)

    def step():
        model.zero_grad(set_to_none=True)
        loss, _ = model(*batch, train_stage=0, sample_seeds=seeds)
        loss.backward()

    with FlopCounterMode(display=False, custom_mapping=_custom_flops()) as counter:
        step()
    flops = counter.get_total_flops()
    times = _time(step, device, repeats)
    # Where the time goes: matmul-class kernels vs everything else (norms, softmax,
    # cross entropy, elementwise, embedding, allocator).
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    by_kind: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        kind = "matmul/attention" if ev.key in MATMUL_OPS else "other"
        by_kind[kind] += ev.self_cpu_time_total
        top[ev.key] += ev.self_cpu_time_total
    return flops, times, by_kind, sorted(top.items(), key=lambda kv: -kv[1])[:6]


def bench_decode(
    model, text_len: int, prompt_frames: int, frames: int, device, repeats: int, vocab: int,
    nar: bool = True,
):
    g = torch.Generator().manual_seed(1)
    text = torch.randint(4, vocab, (1, text_len), generator=g).to(device)
    text_lens = torch.tensor([text_len], device=device)
    prompt = torch.randint(
        0, NUM_AUDIO_TOKENS, (1, prompt_frames, model.num_quantizers), generator=g
    ).to(device)
    prompt_lens = torch.tensor([prompt_frames], device=device)
    def ar(cache: bool, static: bool = False):
        options = DecodeOptions(seed=0, force_len=frames, use_kv_cache=cache, static_cache=static)
        return lambda: ar_generate(model, text, text_lens, prompt[..., 0], prompt_lens, options)

    with torch.no_grad():
        if not nar:  # the AR with its cache only
            return statistics.median(_time(ar(True), device, repeats, warmup=1)), None, None, None, None
        # Interleaved, so both caches see the same machine load.
        _time(ar(True), device, 0, warmup=1)
        _time(ar(True, static=True), device, 0, warmup=1)
        cached, static = [], []
        for _ in range(repeats):
            cached += _time(ar(True), device, 1, warmup=0)
            static += _time(ar(True, static=True), device, 1, warmup=0)
        full = _time(ar(False), device, 1, warmup=0)
        # Per-token steps are tiny ops: with other processes on the cores, OpenMP threads
        # waiting on a descheduled peer can cost far more than the work. Show 1 thread too.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        cached_1t = _time(ar(True), device, repeats, warmup=1)
        torch.set_num_threads(threads)
        gen, lens, _scores, _ended = ar(True)()
        nar = _time(
            lambda: nar_generate(model, text, text_lens, prompt, prompt_lens, gen, lens),
            device,
            repeats,
            1,
        )
    assert gen.shape[1] == frames
    return (statistics.median(cached), statistics.median(cached_1t), full[0],
            statistics.median(nar), statistics.median(static))


def build(args, dropout: float, vocab: int, device, **extra):
    return get_model(dict(model_name="valle", decoder_dim=args.decoder_dim, nhead=args.nhead,
                          num_decoder_layers=args.num_decoder_layers, dropout=dropout,
                          prefix_mode=1, num_text_tokens=vocab, **extra)).to(device)  # fmt: skip


def report_guided(args, vocab: int, device) -> None:
    """AR step (stage 1, fwd+bwd, dropout 0) with the guided-attention loss vs without, interleaved."""
    batch = make_batch(args.batch_size, args.text_len, args.audio_len, 8, vocab, device)
    steps = {}
    for name, weight in (("without", 0.0), ("with", 1.0)):
        torch.manual_seed(0)
        model = build(args, 0.0, vocab, device, guided_attention_weight=weight).train()

        def step(model=model):
            model.zero_grad(set_to_none=True)
            model(*batch, train_stage=1)[0].backward()

        steps[name] = step
    for step in steps.values():
        _time(step, device, 0)  # warm-up only
    times = {name: [] for name in steps}
    for _ in range(args.repeats):  # interleaved: both see the same machine load
        for name, step in steps.items():
            times[name] += _time(step, device, 1, warmup=0)
    plain, guided = min(times["without"]), min(times["with"])
    print(f"## AR training step with the guided-attention loss (default: first 2 heads of the last 2 "
          f"layers; batch {args.batch_size} x ({args.text_len} text, {args.audio_len} frames), stage 1, "
          f"fp32, dropout 0)\n")  # fmt: skip
    print(f"| AR step | time (best of {args.repeats}) |\n| --- | --- |")
    print(f"| without (SDPA everywhere) | {plain * 1e3:.0f} ms |")
    print(f"| with --guided-attention-weight 1 | {guided * 1e3:.0f} ms |")
    print(f"| ratio | {guided / plain:.2f}x |\n")


def report_grouped(args, vocab: int, device) -> None:
    """--ar-group-size 1 vs 2: the AR training step (interleaved) and KV-cache decoding."""
    batch = make_batch(args.batch_size, args.text_len, args.audio_len, 8, vocab, device)
    models, steps = {}, {}
    for group in (1, 2):
        torch.manual_seed(0)
        models[group] = model = build(args, 0.0, vocab, device, ar_group_size=group).train()

        def step(model=model):
            model.zero_grad(set_to_none=True)
            model(*batch, train_stage=1)[0].backward()

        steps[group] = step
        _time(step, device, 0)  # warm-up only
    times = {group: [] for group in steps}
    for _ in range(args.repeats):  # interleaved: both see the same machine load
        for group, step in steps.items():
            times[group] += _time(step, device, 1, warmup=0)
    decode = {}
    if not args.skip_decode:
        for group, model in models.items():
            decode[group] = bench_decode(model.eval(), args.text_len, args.prompt_frames,
                                         args.decode_frames, device, max(1, args.repeats // 2),
                                         vocab, nar=False)[0]  # fmt: skip
    print(f"## Grouped code modeling: --ar-group-size 2 against 1 (batch {args.batch_size} x "
          f"({args.text_len} text, {args.audio_len} frames), stage 1, fp32, dropout 0; decoding "
          f"{args.decode_frames} frames with the KV cache)\n")  # fmt: skip
    print(f"| --ar-group-size | AR step (best of {args.repeats}) | AR decoding |\n| --- | --- | --- |")
    for group in steps:
        dec = f"{decode[group]:.2f} s" if decode else "not run"
        print(f"| {group} | {min(times[group]) * 1e3:.0f} ms | {dec} |")
    ratio_dec = f"{decode[2] / decode[1]:.2f}x" if decode else ""
    print(f"| ratio 2 / 1 | {min(times[2]) / min(times[1]):.2f}x | {ratio_dec} |\n")


def report_train(args, model, dropout: float, vocab: int, device) -> None:
    batch = make_batch(
        args.batch_size, args.text_len, args.audio_len, model.num_quantizers, vocab, device
    )
    model.train()
    flops, times, by_kind, top = bench_train(model, batch, device, args.repeats)
    step_s = statistics.median(times)
    # Best-of-N on both sides: other processes on a shared machine only ever slow a run down.
    achieved = flops / min(times)
    tokens = args.batch_size * (args.text_len + args.audio_len)
    # Measured right after the step, so both see the same machine load.
    sq = matmul_rate(1024, 1024, 1024, device, args.repeats)
    ff = matmul_rate(tokens, 4 * args.decoder_dim, args.decoder_dim, device, args.repeats)
    total_prof = sum(by_kind.values()) or 1.0
    print(f"## Training step (VALL-E d={args.decoder_dim}, {args.nhead} heads, {args.num_decoder_layers} layers, "
          f"batch {args.batch_size} x ({args.text_len} text, {args.audio_len} frames), stage 0, fp32, "
          f"dropout {dropout})\n")  # fmt: skip
    print("| quantity | value |\n| --- | --- |")
    print(f"| FLOPs per step (fwd+bwd, FlopCounterMode) | {flops / 1e9:.2f} GFLOP |")
    print(
        f"| step time (median of {args.repeats}) | {step_s * 1e3:.0f} ms (min {min(times) * 1e3:.0f}) |"
    )
    print(f"| achieved (FLOPs / fastest step) | {achieved / 1e9:.1f} GFLOP/s |")
    print(
        f"| fp32 matmul 1024x1024x1024 (measured, best of {args.repeats}) | {sq / 1e9:.1f} GFLOP/s |"
    )
    print(
        f"| fp32 matmul {tokens}x{args.decoder_dim}x{4 * args.decoder_dim} (the FF shape) | {ff / 1e9:.1f} GFLOP/s |"
    )
    print(f"| achieved / square matmul rate | {100 * achieved / sq:.0f}% |")
    print(
        f"| profiled time in matmul/attention kernels | {100 * by_kind['matmul/attention'] / total_prof:.0f}% |"
    )
    print("\nTop ops by self CPU time (one profiled step):\n")
    print("| op | share |\n| --- | --- |")
    for name, t in top:
        print(f"| {name} | {100 * t / total_prof:.0f}% |")
    print()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--decoder-dim", type=int, default=256)
    p.add_argument("--nhead", type=int, default=8)
    p.add_argument("--num-decoder-layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--text-len", type=int, default=60)
    p.add_argument("--audio-len", type=int, default=300)
    p.add_argument(
        "--dropouts",
        default="0.1,0.0",
        help="training step at each dropout: attention dropout forces CPU SDPA onto its math path",
    )
    p.add_argument("--prompt-frames", type=int, default=225, help="3 s at 75 Hz")
    p.add_argument("--decode-frames", type=int, default=638, help="8.5 s at 75 Hz")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-decode", action="store_true")
    args = p.parse_args()
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, device {device}, torch threads {torch.get_num_threads()}\n")

    vocab = 512
    for dropout in [float(x) for x in args.dropouts.split(",")]:
        torch.manual_seed(0)
        model = build(args, dropout, vocab, device)
        report_train(args, model, dropout, vocab, device)

    report_guided(args, vocab, device)
    report_grouped(args, vocab, device)
    if args.skip_decode:
        return
    model = build(args, 0.0, vocab, device).eval()
    cached, cached_1t, full, nar, static = bench_decode(model, args.text_len, args.prompt_frames, args.decode_frames,
                                     device, max(1, args.repeats // 2), vocab)  # fmt: skip
    print(f"\n## AR decoding: {args.decode_frames} frames ({args.decode_frames / 75:.1f} s) after a "
          f"{args.prompt_frames}-frame prompt, {args.text_len} text tokens, batch 1\n")  # fmt: skip
    print("| mode | time | frames/s |\n| --- | --- | --- |")
    print(f"| AR with KV cache | {cached:.2f} s | {args.decode_frames / cached:.0f} |")
    print(
        f"| AR recomputing the prefix each step | {full:.2f} s | {args.decode_frames / full:.0f} |"
    )
    print(
        f"| AR with KV cache, 1 torch thread | {cached_1t:.2f} s | {args.decode_frames / cached_1t:.0f} |"
    )
    print(f"| AR with the static KV cache (`--static-cache`: preallocated, in-place step; "
          f"`--cuda-graphs` captures its fixed-shape form) | {static:.2f} s | "
          f"{args.decode_frames / static:.0f} |")
    print(f"| speed-up (same threads) | {full / cached:.1f}x | |")
    print(f"| static / dynamic cache time | {static / cached:.2f}x | |")
    print(f"| NAR, 7 stages (same for both) | {nar:.2f} s | |")


if __name__ == "__main__":
    main()
