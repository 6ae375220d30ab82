"""Does the AR read the text in step with the audio? Per layer and head, teacher-forced.

For each AR attention head, over the valid audio frames of a set of utterances:

* ``text_mass``: the share of its attention on text tokens (the rest is on past audio; 1 for
  VALL-F's cross-attention);
* ``off_diagonal``: of its attention renormalised over the text, the share the guided-attention
  penalty (sigma 0.2) counts as off the diagonal: about 0.55 for a head that ignores position,
  near 0 for one that follows the text;
* ``order``: the correlation between the relative position of the text token the head looks at
  most and the frame's relative position: 1 when the head reads the text in order.

A model that reads the text has heads with ``order`` near 1. The demo's AR without
``--guided-attention-weight`` had none above 0.8 after 8 epochs (best 0.66 at its best
validation); with it, the 4 guided heads are at 0.98 (docs/training.md).

CLI: python -m valle.eval.alignment --checkpoint exp/valle/ar/best-valid-loss.pt \\
         --cuts data/tokenized/tiny_cuts_test.jsonl.gz [--max-cuts 32]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from valle.models.layout import lengths_to_valid
from valle.models.losses import GuidedAttention
from valle.models.transformer import AttentionProbe, prefix_causal_mask


@dataclass
class HeadAlignment:
    layer: int
    head: int
    text_mass: float
    off_diagonal: float
    order: float


def text_attention(model, text, text_valid, codes0, audio_valid, langs=None):
    """Per layer: (attention probabilities over the text (B, H, T, S), text mass (B, H, T))."""
    x = model.ar_embed_text(text, text_valid, langs)
    y = model.ar_embed_audio(codes0, torch.arange(codes0.shape[1], device=codes0.device))
    layers = len(model.ar_decoder.layers)
    if model.cross_attention:  # VALL-F: the cross-attention sees only the text
        probe = AttentionProbe()
        model.ar_core(x, text_valid, y, audio_valid, probe=probe, probe_last=layers)
        return [(s.softmax(-1), torch.ones(s.shape[:-1], device=s.device)) for s in probe.scores]
    s_len = x.shape[1]
    mask = prefix_causal_mask(torch.cat([text_valid, audio_valid], dim=1), s_len)
    probe = AttentionProbe(queries=slice(s_len, None))  # audio queries over every key
    model.ar_decoder(torch.cat([x, y], dim=1), mask, probe=probe, probe_last=layers)
    out = []
    for audio_rows in probe.scores:
        mass = audio_rows.softmax(-1)[..., :s_len].sum(-1)
        out.append((audio_rows[..., :s_len].softmax(-1), mass))
    return out


@torch.no_grad()
def head_alignment(
    model, text, text_lens, codes0, audio_lens, langs=None, sigma: float = 0.2
) -> list[HeadAlignment]:
    """Alignment figures of every AR head on one padded batch (codebook 0 (B, T), pad 1024)."""
    g = model.ar_group_size
    if g > 1:  # grouped code modeling: one AR position per group of G frames
        audio_lens = torch.div(audio_lens, g, rounding_mode="floor")
        t = int(audio_lens.max()) * g
        codes0 = codes0[:, :t].reshape(codes0.shape[0], t // g, g)
    was_training = model.training
    model.eval()
    try:
        text_valid = lengths_to_valid(text_lens, text.shape[1])
        audio_valid = lengths_to_valid(audio_lens, codes0.shape[1])
        per_layer = text_attention(model, text, text_valid, codes0, audio_valid, langs)
    finally:
        model.train(was_training)
    grid = GuidedAttention(1.0, sigma, 1, 1).penalty_grid(text_valid, audio_valid)
    frames = audio_valid.sum().clamp(min=1)
    t_pos = (
        torch.arange(codes0.shape[1], device=codes0.device)[None, :] / audio_lens[:, None].float()
    )
    result = []
    for layer, (probs, mass) in enumerate(per_layer):
        for head in range(probs.shape[1]):
            p = probs[:, head]
            looked = p.argmax(-1).float() / text_lens[:, None].float()
            pair = torch.stack([looked[audio_valid], t_pos[audio_valid]])
            order = torch.corrcoef(pair)[0, 1] if pair.shape[1] > 1 else torch.tensor(float("nan"))
            result.append(HeadAlignment(
                layer, head,
                text_mass=float((mass[:, head] * audio_valid).sum() / frames),
                off_diagonal=float((p * grid).sum() / frames),
                order=float(torch.nan_to_num(order, nan=0.0)),
            ))  # fmt: skip
    return result


def format_table(heads: list[HeadAlignment]) -> str:
    lines = ["layer | head | text mass | off-diagonal | order"]
    lines += [f"{h.layer:5d} | {h.head:4d} | {h.text_mass:9.2f} | {h.off_diagonal:12.2f} | {h.order:5.2f}"
              for h in heads]  # fmt: skip
    best = max(heads, key=lambda h: h.order)
    lines.append(f"best head: layer {best.layer} head {best.head}, order {best.order:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m valle.eval.alignment", description=__doc__.split("\n")[0]
    )
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument(
        "--cuts", type=Path, required=True, help="tokenized cuts (bin/tokenizer.py output)"
    )
    p.add_argument("--text-tokens", type=Path, default=None,
                   help="symbol table (default: unique_text_tokens.k2symbols beside --cuts)")  # fmt: skip
    p.add_argument("--max-cuts", type=int, default=32)
    args = p.parse_args(argv)
    from lhotse import CutSet

    from valle.data.collation import get_text_token_collater
    from valle.data.dataset import SpeechSynthesisDataset
    from valle.infer import InputError, load_model

    table = args.text_tokens or args.cuts.parent / "unique_text_tokens.k2symbols"
    try:
        for path in (args.cuts, table):
            if not path.is_file():
                raise InputError(f"{path}: no such file")
        model, _ = load_model(args.checkpoint, "cpu")
        cuts = CutSet.from_file(args.cuts).subset(first=args.max_cuts)
        batch = SpeechSynthesisDataset(get_text_token_collater(table))[cuts]
    except (InputError, FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if model.num_languages:
        print(
            "error: VALL-E X checkpoints need per-cut language ids; not supported here",
            file=sys.stderr,
        )
        return 2
    heads = head_alignment(model, batch["text_tokens"], batch["text_tokens_lens"],
                           batch["audio_features"][..., 0], batch["audio_features_lens"])  # fmt: skip
    print(f"{args.checkpoint}: {len(cuts)} cuts of {args.cuts}, teacher-forced")
    print(format_table(heads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
