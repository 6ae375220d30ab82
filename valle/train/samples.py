"""Hear it train: at each validation, rank 0 synthesises a few fixed held-out items and writes
them to TensorBoard (docs/training.md, "Hear it train").

Per item: the output's audio and mel spectrogram, the AR's attention on the text of one probed
head (teacher-forced on what it just said), and once the ground truth (its codes through the
codec) and the prompt. With ``--valid-judge``: held-out PER and speaker similarity, scored as
bin/evaluate.py scores them. Without a codec (``--synthetic-data``) the codes are images.

The decoding is bin/infer.py's: the model's ``inference`` (valle/models/generation.py) with
bin/infer.py's decoding flags (``--valid-samples-decode``, parsed into ``DecodeOptions`` once
by valle/train/config.py), and ``valle.infer.decode_codes``.
The items come already tokenized from the validation cuts, so only the phonemizer and the
prompt's wav encoding of ``Synthesizer`` are left out.

The loop's one call is ``write_samples(run)``. It is rank-local work
(``ResilientStep.local``: an OOM is reported and the pass skipped), with the model in eval
mode and every RNG restored after, so training is bit-identical with samples on or off. It
issues no collective: the other ranks wait in their next one, under --collective-timeout.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from valle.codec.constants import CODEBOOK_SIZE, FRAME_RATE, SAMPLE_RATE
from valle.models.generation import DecodeOptions
from valle.train.storage import quiet_tensorboard_thread

logger = logging.getLogger(__name__)

SAMPLES_DIR = "samples"  # under the run's TensorBoard dir: its own run in the TensorBoard UI
MIN_IMAGE_SIZE = 128  # small images (8 codebooks, a few text tokens) are repeated up to this


# ------------------------------------------------------------------ configuration
@dataclass(frozen=True)
class SampleConfig:
    """What the writer needs of the run's --valid-samples* flags (valle/train/config.py)."""

    count: int = 4
    max_seconds: float = 10.0
    decoding: DecodeOptions = field(default_factory=DecodeOptions)  # --valid-samples-decode's
    codec_dir: str = ""
    judge: str = ""

    @classmethod
    def from_train_config(cls, cfg: Any) -> SampleConfig:
        return cls(cfg.valid_samples, cfg.valid_samples_max_seconds, cfg.valid_samples_decoding,
                   cfg.valid_samples_codec_dir, cfg.valid_judge)

    @property
    def max_frames(self) -> int:
        return max(1, int(self.max_seconds * FRAME_RATE))


def item_decoding(options: DecodeOptions, max_len_ratio: float) -> DecodeOptions:
    """How one item is decoded: --valid-samples-decode's options with the length cap lowered to
    the item's share of --valid-samples-max-seconds. No CUDA graphs: capturing them inside the
    training process is not worth its memory for a few items."""
    return replace(options, max_len_ratio=min(options.max_len_ratio, max_len_ratio),
                   cuda_graphs=False, on_empty="mark")


# ------------------------------------------------------------------------ items
@dataclass
class HeldOutItem:
    """One validation cut to say, in the voice of another utterance (the prompt)."""

    name: str  # the target cut's id
    prompt_name: str
    text: str  # what TensorBoard shows
    text_tokens: torch.Tensor  # (S,) ids: [BOS] prompt transcript [sep] text [EOS]
    prompt_text_len: int  # tokens after BOS (if any) that belong to the prompt's transcript
    prompt_codes: torch.Tensor  # (P, Q)
    target_codes: torch.Tensor  # (T, Q) the ground truth
    reference: list[str] = field(default_factory=list)  # the text's phonemes (PER); [] synthetic
    languages: torch.Tensor | None = None  # (S,) per-token language ids (VALL-E X)


def pair_by_speaker(speakers: Sequence[str | None], count: int) -> list[tuple[int, int]]:
    """(target, prompt) indices into ``speakers`` (cuts in id order): consecutive utterances of
    one speaker, speakers taken in turn (sorted) so the items cover several voices.
    Deterministic; a speaker with a single utterance gives none."""
    by_speaker: dict[str, list[int]] = {}
    for i, spk in enumerate(speakers):
        if spk is not None:
            by_speaker.setdefault(spk, []).append(i)
    queues = [by_speaker[s] for s in sorted(by_speaker)]
    pairs: list[tuple[int, int]] = []
    for r in range(0, max((len(q) for q in queues), default=0) - 1, 2):
        for q in queues:
            if r + 1 < len(q) and len(pairs) < count:
                pairs.append((q[r], q[r + 1]))
    return pairs


def synthetic_items(cuts: Sequence[dict], count: int) -> list[HeldOutItem]:
    """Synthetic validation cuts (no speakers): the next cut is the prompt."""
    items = []
    for i in range(min(count, len(cuts) - 1)):
        target, prompt = cuts[i], cuts[i + 1]
        text = torch.cat([prompt["text"], target["text"]])
        languages = None
        if "language" in target:
            languages = torch.cat([torch.full_like(prompt["text"], prompt["language"]),
                                   torch.full_like(target["text"], target["language"])])
        items.append(HeldOutItem(target["id"], prompt["id"], " ".join(map(str, target["text"].tolist())),
                                 text, len(prompt["text"]), prompt["codes"], target["codes"],
                                 languages=languages))
    return items


def manifest_items(module: Any, count: int) -> list[HeldOutItem]:
    """Items from the validation cuts of a TtsDataModule (valle/data/datamodule.py)."""
    from lhotse import CutSet

    from valle.data.collation import cut_text_symbols, get_text_token_collater
    from valle.data.text import WORD_SEP

    part = module.cfg.valid_part
    cuts = sorted(CutSet.from_jsonl_lazy(module.cuts_path(part)), key=lambda c: c.id)
    speakers = [c.supervisions[0].speaker if c.supervisions else None for c in cuts]
    collater = get_text_token_collater(module.text_tokens_path())
    language_ids = {lang: i for i, lang in enumerate(module.languages() or [])}
    items = []
    for t, p in pair_by_speaker(speakers, count):
        target, prompt = cuts[t], cuts[p]
        problem = unsayable_text(target, prompt)
        if problem:
            logger.warning("validation samples: item %s (prompt %s) skipped: %s", target.id, prompt.id, problem)
            continue
        said, heard = cut_text_symbols(target), cut_text_symbols(prompt)
        prompt_part = heard + [WORD_SEP] if heard and said else heard
        tokens, lens = collater([prompt_part + said], ids=[target.id])
        text_tokens = tokens[0, : int(lens[0])]
        languages = None
        if language_ids:  # as Synthesizer: BOS and the prompt's transcript in its language
            cols = torch.arange(len(text_tokens))
            languages = torch.where(cols < len(prompt_part) + 1, language_ids[_voice(prompt)],
                                    language_ids[_voice(target)])
        items.append(HeldOutItem(
            target.id, prompt.id, target.supervisions[0].text, text_tokens, len(prompt_part),
            _codes(prompt), _codes(target), reference=said, languages=languages))
    return items


def unsayable_text(target, prompt) -> str:
    """Why a held-out pair cannot be synthesised as bin/infer.py would (valle/infer_checks.py):
    a transcript in a script its voice cannot read; "" when it can be."""
    from valle.infer_checks import script_problem

    for cut, field_name in ((target, "text"), (prompt, "prompt_text")):
        text, voice = (cut.supervisions[0].text or "" if cut.supervisions else ""), _voice(cut)
        problem = script_problem(text, voice, field_name) if voice else None  # no voice: not checked
        if problem is not None:
            return f"cut {cut.id}: {problem.message}"
    return ""


def _codes(cut) -> torch.Tensor:
    return torch.as_tensor(cut.load_features()).long()


def _voice(cut) -> str:
    return (cut.supervisions[0].custom or {}).get("espeak_voice", "")


def choose_items(data: Any, count: int) -> list[HeldOutItem]:
    """The items, chosen once from the run's validation data (synthetic or manifests)."""
    valid = getattr(data, "valid", None)
    if hasattr(valid, "cuts"):  # valle.train.data.SyntheticData
        return synthetic_items(valid.cuts, count)
    if valid is None:  # LhotseTrainData without a validation part (said when it loaded)
        return []
    return manifest_items(data.module, count)


# ----------------------------------------------------------------------- images
def _visible(image: torch.Tensor) -> torch.Tensor:
    """(H, W) in [0, 1], each side repeated up to MIN_IMAGE_SIZE pixels (nearest)."""
    h, w = image.shape
    image = image.repeat_interleave(max(1, -(-MIN_IMAGE_SIZE // h)), dim=0)
    return image.repeat_interleave(max(1, -(-MIN_IMAGE_SIZE // w)), dim=1)


def _unit(x: torch.Tensor) -> torch.Tensor:
    lo, hi = x.min(), x.max()
    return (x - lo) / (hi - lo) if hi > lo else torch.zeros_like(x)


def mel_image(wav: torch.Tensor) -> torch.Tensor:
    """(n_mels, frames) log-mel in [0, 1], low frequencies at the bottom."""
    from valle.codec.mel import MelFrontend

    return _visible(_unit(MelFrontend()(wav.float().reshape(1, -1))[0].T.flip(0)))


def codes_image(codes: torch.Tensor) -> torch.Tensor:
    """(codebooks, frames) in [0, 1], codebook 0 at the top (no codec to hear them)."""
    return _visible(codes.T.float().clamp(0, CODEBOOK_SIZE - 1) / (CODEBOOK_SIZE - 1))


def attention_image(model: Any, item: HeldOutItem, output: torch.Tensor) -> torch.Tensor:
    """(text tokens, AR positions) in [0, 1], first token at the bottom: the attention of head 0
    of the AR's last layer (a guided head with --guided-attention-weight > 0), teacher-forced on
    the prompt and the output's codebook 0, as valle.eval.alignment measures it."""
    from valle.eval.alignment import text_attention
    from valle.models.layout import language_ids, lengths_to_valid

    device = next(model.parameters()).device
    text = item.text_tokens[None].to(device)
    text_lens = torch.tensor([text.shape[1]], device=device)
    codes0 = torch.cat([item.prompt_codes[:, 0], output[:, 0]])[None].to(device)
    g = model.ar_group_size
    t = codes0.shape[1] // g * g
    codes0 = codes0[:, :t] if g == 1 else codes0[:, :t].reshape(1, t // g, g)
    audio_lens = torch.tensor([codes0.shape[1]], device=device)
    languages = None if item.languages is None else item.languages[None].to(device)
    langs = language_ids(text, languages, model.num_languages)
    per_layer = text_attention(model, text, lengths_to_valid(text_lens, text.shape[1]), codes0,
                                lengths_to_valid(audio_lens, codes0.shape[1]), langs)
    probs = per_layer[-1][0][0, 0].float().cpu()  # (positions, text tokens)
    return _visible(_unit(probs.T.flip(0)))


# ------------------------------------------------------------------------ state
@contextlib.contextmanager
def preserved_state(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Eval mode, no gradients, and every RNG (torch CPU and CUDA, Python, NumPy) and the
    training mode restored after: what runs inside leaves the training's course unchanged."""
    import numpy as np

    was_training = model.training
    py_state, np_state = random.getstate(), np.random.get_state()
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            model.eval()
            yield
    finally:
        model.train(was_training)
        random.setstate(py_state)
        np.random.set_state(np_state)


# ----------------------------------------------------------------------- writer
@dataclass
class Listeners:
    """What turns codes into audio and scores it; loaded at the first pass, on the CPU."""

    codec: Any = None
    code_vectors: list[torch.Tensor] | None = None
    judge: Any = None
    embedder: Any = None


class SampleWriter:
    """Synthesises the items at each call and writes them under ``log_dir``."""

    def __init__(self, model: torch.nn.Module, items: list[HeldOutItem], cfg: SampleConfig,
                 log_dir: Path, codec_config: dict[str, Any], synthetic: bool) -> None:
        self.model, self.items, self.cfg, self.log_dir = model, items, cfg, Path(log_dir)
        self.codec_config, self.synthetic = codec_config, synthetic
        self.listeners: Listeners | None = None
        self.prompt_audio: dict[str, torch.Tensor] = {}
        self.passes = 0

    @classmethod
    def for_run(cls, run: Any) -> SampleWriter:
        cfg = SampleConfig.from_train_config(run.cfg)
        items = choose_items(run.data, cfg.count)
        if not items:
            logger.warning("validation samples: no held-out item (no validation data, or no "
                           "speaker with two validation utterances): none written")
        synthetic = run.cfg.synthetic_data > 0
        return cls(run.model, items, cfg, Path(run.tb.log_dir) / SAMPLES_DIR, run.cfg.checkpoint_config(), synthetic)

    # ---- one pass
    def write(self, step: int, stop: Callable[[], bool] = lambda: False) -> None:
        if not self.items:
            return
        from torch.utils.tensorboard import SummaryWriter

        started = time.monotonic()
        if self.listeners is None:
            self.listeners = self._load_listeners()
        quiet_tensorboard_thread()  # a full disk: said once by the storage policy
        writer = SummaryWriter(str(self.log_dir))  # one per pass: nothing left open between them
        try:
            if self.passes == 0:
                writer.add_text("samples/items", self._describe(), step)
            scores, written = [], 0
            for k, item in enumerate(self.items):
                if stop():
                    logger.warning("samples at step %d: stopped after %d items (preemption)", step, k)
                    break
                scores.append(self._sample(writer, f"samples/{k}", item, step))
                written += 1
            self._write_scores(writer, scores, step)
            seconds = time.monotonic() - started
            writer.add_scalar("valid_samples/wall_seconds", seconds, step)
        finally:
            writer.close()
        self.passes += 1
        logger.info("samples at step %d: %d items, %.1f s", step, written, seconds)

    def _sample(self, writer: Any, tag: str, item: HeldOutItem, step: int):
        listeners = self.listeners
        if self.passes == 0:
            self._write_reference(writer, tag, item, step)
        output = self._decode(item)
        writer.add_scalar(f"{tag}/seconds", 0.0 if output is None else len(output) / FRAME_RATE, step)
        if output is None:
            logger.info("samples at step %d: %s: EOS first, no audio", step, item.name)
            return self._score(torch.zeros(0), item)
        writer.add_image(f"{tag}/attention", attention_image(self.model, item, output), step,
                         dataformats="HW")
        if listeners.codec is None:
            writer.add_image(f"{tag}/codes_output", codes_image(output), step, dataformats="HW")
            return None
        wav = self._audio(output)
        writer.add_audio(f"{tag}/output", wav[None], step, sample_rate=SAMPLE_RATE)
        writer.add_image(f"{tag}/mel_output", mel_image(wav), step, dataformats="HW")
        return self._score(wav, item)

    def _write_reference(self, writer: Any, tag: str, item: HeldOutItem, step: int) -> None:
        """The ground truth and the prompt, once."""
        if self.listeners.codec is None:
            writer.add_image(f"{tag}/codes_ground_truth", codes_image(item.target_codes), step,
                             dataformats="HW")
            return
        truth = self._audio(item.target_codes)
        writer.add_audio(f"{tag}/ground_truth", truth[None], step, sample_rate=SAMPLE_RATE)
        writer.add_audio(f"{tag}/prompt", self._audio(item.prompt_codes)[None], step,
                         sample_rate=SAMPLE_RATE)
        writer.add_image(f"{tag}/mel_ground_truth", mel_image(truth), step, dataformats="HW")

    def _decode(self, item: HeldOutItem) -> torch.Tensor | None:
        """The output's codes (T, Q) on the CPU, None when the AR stopped at once."""
        device = next(self.model.parameters()).device
        text = item.text_tokens[None].to(device)
        prompt = item.prompt_codes[None].to(device)
        ratio = self.cfg.max_frames / text.shape[1]  # the cap, floor(S x ratio) frames
        languages = None if item.languages is None else item.languages[None].to(device)
        vectors = self.listeners.code_vectors
        codes, lens = self.model.inference(
            text, torch.tensor([text.shape[1]], device=device), prompt,
            torch.tensor([prompt.shape[1]], device=device),
            prompt_text_lens=torch.tensor([item.prompt_text_len], device=device),
            text_languages=languages, return_lens=True,
            code_vectors=None if vectors is None else [v.to(device) for v in vectors],
            options=item_decoding(self.cfg.decoding, ratio))
        n = int(lens[0])
        return codes[0, :n].cpu() if n else None

    def _audio(self, codes: torch.Tensor) -> torch.Tensor:
        from valle.infer import decode_codes

        return decode_codes(codes, self.codec_config, self.listeners.codec).clamp(-1.0, 1.0)

    # ---- scores
    def _score(self, wav: torch.Tensor, item: HeldOutItem):
        """bin/evaluate.py's figures for one output (None without a judge)."""
        listeners = self.listeners
        if listeners.judge is None or not item.reference:
            return None
        from valle.eval.evaluate import Tools, score_wav

        tools = Tools(judge=listeners.judge, phonemize=None, embedder=listeners.embedder)
        prompt = None
        if listeners.embedder is not None:  # the same every pass: decoded once
            prompt = self.prompt_audio.setdefault(item.name, self._audio(item.prompt_codes))
        return score_wav(tools, wav, item.reference, item.text, prompt)

    def _write_scores(self, writer: Any, scores: list, step: int) -> None:
        from valle.eval.evaluate import aggregate

        scored = [s for s in scores if s is not None]
        if not scored:
            return
        figures = aggregate(scored)
        for name, key in (("per", "per"), ("similarity", "similarity"),
                          ("output_seconds", "seconds")):
            if not math.isnan(figures[key]):
                writer.add_scalar(f"valid_samples/{name}", figures[key], step)

    # ---- set-up
    def _load_listeners(self) -> Listeners:
        listeners = Listeners(codec=self._load_codec())
        if listeners.codec is not None and self.cfg.decoding.nar_decoding != "argmax":
            get = getattr(listeners.codec, "code_vectors", None)
            if get is None:
                logger.warning("validation samples: the codec gives no code vectors: "
                               "--nar-decoding argmax")
            else:
                listeners.code_vectors = list(get())
        if self.cfg.judge:
            listeners.judge, listeners.embedder = self._load_judges()
        return listeners

    def _load_codec(self):
        from valle.codec import codec_for_checkpoint, find_codec_record, read_codec_record

        codec_dir = self.cfg.codec_dir or None
        if self.synthetic and codec_dir is None:
            logger.info("validation samples: --synthetic-data and no --valid-samples-codec-dir: the "
                        "codes are written as images, no audio")
            return None
        try:
            if codec_dir:
                record = read_codec_record(codec_dir) or {}
            else:
                record = (find_codec_record(self.codec_config) or ({},))[0]
            # A corpus tokenized with random EnCodec weights (tests) is heard with the same ones.
            return codec_for_checkpoint(self.codec_config, "cpu", codec_dir=codec_dir,
                                        allow_random_encodec=bool(record.get("random_weights")))
        except Exception as e:  # noqa: BLE001 - no codec: images instead of audio, said once
            logger.warning("validation samples: no codec (%s): the codes are written as images, "
                           "no audio", str(e).splitlines()[0][:300])
            return None

    def _load_judges(self):
        from valle.eval.judge import Judge

        if not Path(self.cfg.judge).is_file():
            logger.warning("validation samples: --valid-judge %s: no such file: PER and speaker "
                           "similarity not measured", self.cfg.judge)
            return None, None
        judge = Judge.load(self.cfg.judge)
        from valle.eval.similarity import SpeakerEmbedder, SpeakerModelUnavailable

        try:
            return judge, SpeakerEmbedder("resemblyzer")
        except SpeakerModelUnavailable as e:
            logger.warning("validation samples: speaker similarity not measured: %s", e)
            return judge, None

    def _describe(self) -> str:
        lines = ["| # | item | prompt | text |", "|---|---|---|---|"]
        lines += [f"| {k} | {it.name} | {it.prompt_name} | {it.text} |"
                  for k, it in enumerate(self.items)]
        return "\n".join(lines)


# ------------------------------------------------------------------------ loop
def write_samples(run: Any) -> None:
    """The loop's call after each validation: rank 0 only, with TensorBoard on, every
    --valid-samples-interval steps. Rank-local work:
    an OOM is reported and the pass skipped; any other error is logged and training goes on."""
    cfg = run.cfg
    if cfg.valid_samples <= 0 or not run.ctx.is_main or not run.tb.enabled:
        return
    if cfg.valid_samples_interval and run.step % cfg.valid_samples_interval:
        return

    def work() -> None:
        from valle.train.resilience.memory import is_oom_error

        try:
            with preserved_state(run.model, run.ctx.device):
                if run.samples is None:
                    run.samples = SampleWriter.for_run(run)
                run.storage.write("samples", Path(run.tb.log_dir) / SAMPLES_DIR,
                                  lambda: run.samples.write(run.step, stop=run.preemption.requested))
        except Exception as e:  # noqa: BLE001 - diagnostics never stop training
            if is_oom_error(e):
                raise  # to ResilientStep.local: reported, memory freed
            logger.exception("samples at step %d failed (training goes on): %s", run.step, e)

    run.stepper.local("samples", work, retries=0)
