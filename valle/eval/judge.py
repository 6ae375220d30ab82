"""An offline intelligibility judge: a small CTC phoneme recogniser trained on the corpus.

Why: no pretrained ASR is available offline for eSpeak speech (pocketsphinx gets 0.70 phone
error rate on the corpus's own ground truth). This judge is trained by the project on the
training split's ground-truth audio only (log-mel in, the project's phoneme symbols out), then
scores phoneme error rate (PER) on synthesised held-out sentences. Its PER on held-out ground
truth is the ceiling a TTS model can reach under this judge.

Robustness to unseen voices comes from what it hears, not from more data: per-utterance mean
normalisation of each mel bin (removes spectral tilt and loudness) and, in training, random
shifts of the mel axis (vocal-tract-length-like) and frequency masks.

CLI: python -m valle.eval.judge train --cuts data/tokenized/tiny_cuts_train.jsonl.gz \
         --output data/tokenized/judge.pt
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from valle.codec.mel import MelConfig, MelFrontend
from valle.eval.per import error_rate, spoken

logger = logging.getLogger(__name__)

FORMAT = "valle-phoneme-judge-1"
JUDGE_FILE = "judge.pt"
BLANK = "<blk>"


@dataclass
class JudgeConfig:
    conv_channels: int = 192
    hidden: int = 128
    layers: int = 2
    epochs: int = 40
    batch_size: int = 8
    lr: float = 5e-3
    seed: int = 0
    max_mel_shift: int = 3  # bins; random shift of the mel axis per training utterance
    freq_masks: int = 2
    freq_mask_width: int = 8


class PhonemeRecognizer(nn.Module):
    """Two convolutions (the second halves the frame rate to 37.5 Hz) and a bidirectional GRU."""

    def __init__(self, n_mels: int, vocab_size: int, conv_channels: int = 192, hidden: int = 128,
                 layers: int = 2) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv1d(n_mels, conv_channels, 5, padding=2), nn.GELU(),
            nn.Conv1d(conv_channels, conv_channels, 5, stride=2, padding=2), nn.GELU(),
        )
        self.rnn = nn.GRU(conv_channels, hidden, layers, batch_first=True, bidirectional=True)
        self.out = nn.Linear(2 * hidden, vocab_size)

    def forward(self, feats: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, n_mels) normalised features -> ((B, T', V) log-probs, (B,) T' lengths)."""
        x = self.conv(feats.transpose(1, 2)).transpose(1, 2)
        out_lens = torch.div(lens + 1, 2, rounding_mode="floor").clamp(min=1, max=x.shape[1])
        packed = nn.utils.rnn.pack_padded_sequence(x, out_lens.cpu(), batch_first=True,
                                                   enforce_sorted=False)
        y, _ = self.rnn(packed)
        y, _ = nn.utils.rnn.pad_packed_sequence(y, batch_first=True, total_length=x.shape[1])
        return self.out(y).log_softmax(-1), out_lens


def normalize(log_mel: torch.Tensor) -> torch.Tensor:
    """Per-utterance, per-bin mean removal and a global scale: loudness and channel colour go."""
    x = log_mel - log_mel.mean(dim=0, keepdim=True)
    return x / x.std().clamp_min(1e-3)


def _augment(x: torch.Tensor, cfg: JudgeConfig, rng: random.Random) -> torch.Tensor:
    shift = rng.randint(-cfg.max_mel_shift, cfg.max_mel_shift)
    if shift > 0:
        x = torch.cat([x[:, :1].expand(-1, shift), x[:, :-shift]], dim=1)
    elif shift < 0:
        x = torch.cat([x[:, -shift:], x[:, -1:].expand(-1, -shift)], dim=1)
    else:
        x = x.clone()
    for _ in range(cfg.freq_masks):
        w = rng.randint(0, cfg.freq_mask_width)
        f0 = rng.randint(0, max(0, x.shape[1] - w))
        x[:, f0 : f0 + w] = 0.0
    return x


def _pad(feats: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor([f.shape[0] for f in feats])
    out = torch.zeros(len(feats), int(lens.max()), feats[0].shape[1])
    for i, f in enumerate(feats):
        out[i, : f.shape[0]] = f
    return out, lens


class Judge:
    """Transcribes 24 kHz waveforms into phoneme symbols and scores PER against references."""

    def __init__(self, model: PhonemeRecognizer, vocab: Sequence[str], mel: MelConfig | None = None,
                 config: JudgeConfig | None = None, info: dict | None = None) -> None:
        self.model = model.eval()
        self.vocab = list(vocab)  # index 0 is the CTC blank
        self.index = {s: i for i, s in enumerate(self.vocab)}
        self.mel_config = mel or MelConfig()
        self.config = config or JudgeConfig()
        self.info = dict(info or {})
        self.frontend = MelFrontend(self.mel_config)

    # ---- inference
    def features(self, wav: torch.Tensor) -> torch.Tensor:
        return normalize(self.frontend(torch.as_tensor(wav, dtype=torch.float32).reshape(-1)))

    @torch.inference_mode()
    def transcribe(self, wavs: Sequence[torch.Tensor]) -> list[list[str]]:
        """Greedy CTC: best symbol per frame, repeats merged, blanks dropped."""
        if not wavs:
            return []
        feats = [self.features(w) for w in wavs]
        keep = [i for i, f in enumerate(feats) if f.shape[0] >= 2]  # shorter: nothing to hear
        if not keep:
            return [[] for _ in wavs]
        x, lens = _pad([feats[i] for i in keep])
        logp, out_lens = self.model(x, lens)
        heard = dict(zip(keep, self._greedy(logp, out_lens)))
        return [heard.get(i, []) for i in range(len(wavs))]

    def _greedy(self, logp: torch.Tensor, out_lens: torch.Tensor) -> list[list[str]]:
        best = logp.argmax(-1)
        result = []
        for row, n in zip(best, out_lens):
            seq, prev = [], -1
            for i in row[: int(n)].tolist():
                if i != prev and i != 0:
                    seq.append(self.vocab[i])
                prev = i
            result.append(seq)
        return result

    def per(self, wavs: Sequence[torch.Tensor], references: Sequence[Sequence[str]]) -> list[float]:
        """PER of each wav against its reference phoneme symbols (punctuation, '_' ignored)."""
        return [error_rate(spoken(ref), hyp) for ref, hyp in zip(references, self.transcribe(wavs))]

    # ---- persistence
    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        torch.save({"format": FORMAT, "state_dict": self.model.state_dict(), "vocab": self.vocab,
                    "mel": self.mel_config.to_dict(), "config": asdict(self.config), "info": self.info}, tmp)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Judge:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"phoneme judge {path} not found: train it with `python -m valle.eval.judge train "
                f"--cuts <train cuts> --output {path}` (egs/tiny/prepare.sh does)")
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError(f"{path}: not a phoneme judge ({FORMAT!r} expected)")
        cfg = JudgeConfig(**state["config"])
        mel = MelConfig(**state["mel"])
        model = PhonemeRecognizer(mel.n_mels, len(state["vocab"]), cfg.conv_channels, cfg.hidden, cfg.layers)
        model.load_state_dict(state["state_dict"])
        return cls(model, state["vocab"], mel, cfg, state.get("info"))

    # ---- training
    @classmethod
    def train(cls, examples: Sequence[tuple[torch.Tensor, Sequence[str]]], config: JudgeConfig | None = None,
              mel: MelConfig | None = None, log_every: int = 5) -> Judge:
        """Train on (24 kHz waveform, phoneme symbols) pairs: ground-truth audio of the training split."""
        cfg = config or JudgeConfig()
        mel = mel or MelConfig()
        if not examples:
            raise ValueError("phoneme judge: no training examples")
        torch.manual_seed(cfg.seed)
        rng = random.Random(cfg.seed)
        frontend = MelFrontend(mel)
        feats = [normalize(frontend(w.reshape(-1))) for w, _ in examples]
        targets_sym = [spoken(s) for _, s in examples]
        vocab = [BLANK] + sorted({s for t in targets_sym for s in t})
        index = {s: i for i, s in enumerate(vocab)}
        targets = [torch.tensor([index[s] for s in t], dtype=torch.long) for t in targets_sym]
        model = PhonemeRecognizer(mel.n_mels, len(vocab), cfg.conv_channels, cfg.hidden, cfg.layers)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=1e-2)
        order = sorted(range(len(feats)), key=lambda i: feats[i].shape[0])
        batches = [order[i : i + cfg.batch_size] for i in range(0, len(order), cfg.batch_size)]
        total = cfg.epochs * len(batches)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=total, pct_start=0.15)
        ctc = nn.CTCLoss(blank=0, zero_infinity=True)
        t0, step = time.time(), 0
        model.train()
        for epoch in range(cfg.epochs):
            rng.shuffle(batches)
            loss_sum = 0.0
            for b in batches:
                x, lens = _pad([_augment(feats[i], cfg, rng) for i in b])
                logp, out_lens = model(x, lens)
                tgt = [targets[i] for i in b]
                loss = ctc(logp.transpose(0, 1), torch.cat(tgt), out_lens, torch.tensor([len(t) for t in tgt]))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
                sched.step()
                loss_sum += float(loss.detach())
                step += 1
            if (epoch + 1) % log_every == 0 or epoch + 1 == cfg.epochs:
                rate = step / max(1e-6, time.time() - t0)
                logger.info("judge epoch %d/%d: CTC loss %.3f, %.1f batches/s, ETA %.0fs", epoch + 1,
                            cfg.epochs, loss_sum / len(batches), rate, (total - step) / max(rate, 1e-6))
        info = {"train_utterances": len(examples), "epochs": cfg.epochs, "seconds": round(time.time() - t0, 1),
                "final_ctc_loss": round(loss_sum / len(batches), 4)}
        if not math.isfinite(info["final_ctc_loss"]):
            raise RuntimeError(f"phoneme judge training diverged: {info}")
        return cls(model, vocab, mel, cfg, info)


# ----------------------------------------------------------------------------- corpus helpers
def load_cut_examples(cuts_path: str | os.PathLike, limit: int | None = None):
    """(24 kHz waveform, phoneme symbols, cut) for each tokenized cut of a manifest."""
    from lhotse import CutSet

    from valle.codec.audio import to_mono_24k, use_torch_resampling_in_lhotse
    from valle.data.collation import cut_text_symbols

    path = Path(cuts_path)
    if not path.is_file():
        raise FileNotFoundError(f"cut manifest {path}: no such file")
    use_torch_resampling_in_lhotse()
    out = []
    for cut in CutSet.from_file(path):
        try:
            samples = cut.load_audio()
        except Exception as e:
            raise RuntimeError(f"{path}: cannot load audio of cut {cut.id}: {e}") from e
        out.append((to_mono_24k(samples, cut.sampling_rate), cut_text_symbols(cut), cut))
        if limit and len(out) >= limit:
            break
    return out


def per_by_language(pers: Sequence[float], cuts: Sequence) -> dict[str, float]:
    """Mean PER per language: the espeak voice each cut's text was phonemized with."""
    groups: dict[str, list[float]] = {}
    for per, cut in zip(pers, cuts):
        voice = (cut.supervisions[0].custom or {}).get("espeak_voice", "?")
        groups.setdefault(voice, []).append(per)
    return {voice: round(sum(v) / len(v), 4) for voice, v in sorted(groups.items())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m valle.eval.judge", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train the judge on ground-truth training audio")
    t.add_argument("--cuts", type=Path, required=True, help="tokenized TRAINING cuts (never held-out ones)")
    t.add_argument("--output", type=Path, required=True, help="e.g. {manifest-dir}/judge.pt")
    t.add_argument("--epochs", type=int, default=JudgeConfig.epochs)
    t.add_argument("--limit", type=int, default=None)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--valid-cuts", type=Path, default=None, help="report PER on these ground-truth cuts")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    try:
        examples = load_cut_examples(args.cuts, args.limit)
        judge = Judge.train([(w, s) for w, s, _ in examples], JudgeConfig(epochs=args.epochs, seed=args.seed))
        if args.valid_cuts:
            valid = load_cut_examples(args.valid_cuts)
            pers = judge.per([w for w, _, _ in valid], [s for _, s, _ in valid])
            judge.info["valid_per"] = round(sum(pers) / len(pers), 4)
            logger.info("judge PER on %s (ground truth): %.3f", args.valid_cuts, judge.info["valid_per"])
            by_language = per_by_language(pers, [c for _, _, c in valid])
            if len(by_language) > 1:  # a multilingual corpus (VALL-E X): the judge's ceiling per language
                judge.info["valid_per_by_language"] = by_language
                logger.info("judge PER per language: %s", by_language)
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    judge.save(args.output)
    logger.info("phoneme judge (%d symbols) -> %s; %s", len(judge.vocab) - 1, args.output, judge.info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
