"""Generation: AR decoding of codebook 0 with its options, best-of-N, NAR decoding of the
other codebooks, and continuation (codebook 0 from ground truth).

The public API, used by the models' ``inference``/``continual`` methods, by
``valle/eval`` and by ``scripts/bench_models.py``:

* ``DecodeOptions``: the AR decoding options (sampling, length limits, stop rule, N).
* ``synthesize(model, ...)``: text + prompt -> codes, the whole pipeline.
* ``ar_generate(model, ...)``: codebook 0 after the prompt, as an ``ARResult``.
* ``nar_generate(model, ...)``: codebooks 1..Q-1 after a given codebook 0.
* ``continual(model, ...)``: codebook 0 from the audio itself, the NAR predicts the rest.

A batch may carry one seed per row (``row_seeds``: each row samples from its own
counter-based numbers, so its tokens do not depend on the rows beside it) and a stop hook
(``should_stop``: rows whose requester left end at the next step, with length 0).

Every step is one batched model call and tensor ops: no Python loop over rows.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from valle.config_flags import flag, from_namespace

from .layout import (
    MAX_PROMPT_FRAMES,
    NUM_AUDIO_TOKENS,
    PrefixMode,
    ar_prompt_layout,
    generated_frames,
    language_ids,
    lengths_to_valid,
    nar_text,
    pack_sequences,
)
from .rng import uniform_from_seeds
from .sampling import nearest_to_expectation, sample

STOP_RULES = ("argmax_or_sampled", "sampled")
ON_EMPTY = ("raise", "mark")
# Best-of-N: subtracted from the mean log-likelihood of a candidate that ran to the length cap,
# so that it ranks below every candidate that stopped (log-likelihoods per frame are far smaller).
CAPPED_CANDIDATE_PENALTY = 1e4


DECODING_GROUP = "decoding"
EXPERIMENTAL_DECODING_GROUP = "decoding (experimental)"
DECODING_GROUP_DESCRIPTIONS = {
    EXPERIMENTAL_DECODING_GROUP: "kept for experiments, off by default (docs/inference.md)",
}
NAR_DECODINGS = ("argmax", "mmse")


def _decoding(default: Any, help: str | None = None, **spec: Any) -> Any:
    """A ``DecodeOptions`` field with its bin/infer.py flag (in the decoding group)."""
    return flag(default, help, group=spec.pop("group", DECODING_GROUP), **spec)


@dataclass(frozen=True)
class DecodeOptions:
    """How the AR decodes (the keywords of the models' ``inference``; docs/inference.md).

    The fields with a flag are bin/infer.py's decoding flags (and those --valid-samples-decode
    takes); the others are the library's.

    * ``top_k`` (<= 0: off), ``top_p`` (1: off), ``temperature``: sampling; ``seed`` seeds
      the sampler's generator (None: torch's global RNG; bin/infer.py's default is 42).
    * ``max_len_ratio``: at most this many frames per text token (prompt text included).
    * ``min_len_ratio`` > 0: no EOS before this many frames per token of the text to say.
    * ``num_candidates`` N > 1: best of N AR samples per row by mean log-likelihood.
    * ``static_cache``: the KV cache preallocated to the longest row and a per-token step of
      fixed shapes (``StaticStep``); ``cuda_graphs``: that step captured once per batch in a
      CUDA graph and replayed (CUDA only). Same tokens as the growing cache.
    * ``nar_decoding``: ``mmse`` asks the caller to pass the codec's ``code_vectors`` (the
      models decode by them whenever they are given); ``argmax`` passes none.
    * ``stop_rule``: ``argmax_or_sampled`` (lifeiteng) stops a row when EOS is the most
      likely token or is sampled; ``sampled`` (experimental) only when it is sampled
      (the flag's spelling ``argmax-or-sampled`` is accepted too).
    * ``use_kv_cache``: decode with the per-layer key/value cache (same tokens, faster).
    * ``force_len``: ignore EOS and decode exactly this many frames (benchmarks).
    * ``on_empty``: a row whose first token is EOS raises (``raise``) or gets length 0
      (``mark``).
    """

    top_k: int = _decoding(-100, "top-k sampling (<= 0: off, 1: greedy)")
    top_p: float = _decoding(1.0, "nucleus sampling mass (1: off)")
    temperature: float = _decoding(1.0)
    seed: int | None = _decoding(None, cli_default=42, parse=int)
    max_len_ratio: float = _decoding(
        16.0, "at most this many frames per text token (prompt text included)")
    min_len_ratio: float = _decoding(
        0.0, "no EOS before this many frames per token of the text to say (0: no floor, "
        "as lifeiteng); guards an undertrained model against empty rows")
    num_candidates: int = _decoding(
        1, "best of N AR samples per text by the model's mean log-likelihood per frame")
    static_cache: bool = _decoding(
        False, "AR decoding with a KV cache preallocated to the longest row and a "
        "per-token step of fixed shapes (same tokens)", switch=True)
    cuda_graphs: bool = _decoding(
        False, "--static-cache with its step captured in a CUDA graph per batch and "
        "replayed (CUDA only; same tokens, fewer kernel launches)", switch=True)
    nar_decoding: str = _decoding(
        "argmax", "codebooks 1-7: the most likely code (VALL-E), or the code nearest the "
        "expected codec vector under the NAR's distribution (an unsure NAR then "
        "adds little instead of a wrong guess; docs/inference.md)", choices=NAR_DECODINGS)
    stop_rule: str = _decoding(
        "argmax_or_sampled", "stop a row when EOS is the most likely token or is sampled "
        "(lifeiteng), or only when it is sampled (experimental: rows then run longer, 81 vs 52 "
        "frames on the demo checkpoint in issue #11)", group=EXPERIMENTAL_DECODING_GROUP,
        choices=tuple(r.replace("_", "-") for r in STOP_RULES), cli_default="argmax-or-sampled")
    use_kv_cache: bool = True
    force_len: int | None = None
    on_empty: str = "raise"

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_rule", str(self.stop_rule).replace("-", "_"))
        if (self.static_cache or self.cuda_graphs) and not self.use_kv_cache:
            raise ValueError("static_cache and cuda_graphs decode with the KV cache: "
                             "use_kv_cache must stay on")  # fmt: skip
        if self.stop_rule not in STOP_RULES:
            raise ValueError(f"stop_rule must be one of {STOP_RULES}, got {self.stop_rule!r}")
        if self.on_empty not in ON_EMPTY:
            raise ValueError(f"on_empty must be 'raise' or 'mark', got {self.on_empty!r}")
        if self.nar_decoding not in NAR_DECODINGS:
            raise ValueError(f"--nar-decoding must be one of {NAR_DECODINGS}, got {self.nar_decoding!r}")
        if self.num_candidates < 1:
            raise ValueError(f"--num-candidates must be >= 1, got {self.num_candidates}")

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> DecodeOptions:
        """The options a user gave as flags (bin/infer.py, --valid-samples-decode), checked
        as flags: a floor at or above the cap is a mistake there (a caller lowering the cap
        later, as the training samples do, may cross it on purpose)."""
        options = from_namespace(cls, args)
        if not 0 <= options.min_len_ratio < options.max_len_ratio:
            raise ValueError(f"--min-len-ratio must be in [0, --max-len-ratio {options.max_len_ratio}), "
                             f"got {options.min_len_ratio}")
        return options


class ARResult(NamedTuple):
    codes: torch.Tensor  # (B, T) codebook 0 after the prompt, padded with EOS/pad 1024
    lens: torch.Tensor  # (B,) frames per row (0: EOS first)
    scores: torch.Tensor | None  # (B,) mean log-likelihood per frame, when asked for
    ended_on_eos: torch.Tensor  # (B,) False where the row ran to its length cap


# ------------------------------------------------------------------ pipeline
@torch.no_grad()
def synthesize(
    model: Any,
    text_tokens: torch.Tensor,
    text_tokens_lens: torch.Tensor,
    prompt_codes: torch.Tensor,
    prompt_lens: torch.Tensor | None = None,
    *,
    prompt_text_lens: torch.Tensor | None = None,
    text_languages: torch.Tensor | None = None,
    options: DecodeOptions = DecodeOptions(),
    code_vectors: list[torch.Tensor] | None = None,
    row_seeds: torch.Tensor | None = None,
    should_stop: Callable[[], torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (B, T, Q) and lengths (B,) for several texts at once, each after its prompt
    (the arguments are those of the models' ``inference``).

    ``row_seeds`` (B,): a sampling seed per row instead of ``options.seed`` (a row then samples
    the same tokens alone or in any batch). ``should_stop``: called before each decoding step,
    a (B,) bool tensor (or None) of rows to abandon; they end with length 0 and skip the NAR.
    """
    device = text_tokens.device
    bsz, p_max = prompt_codes.shape[0], prompt_codes.shape[1]
    if prompt_lens is None:
        prompt_lens = torch.full((bsz,), p_max, dtype=torch.long, device=device)
    prompt_codes = prompt_codes[..., : model.num_quantizers]
    langs = language_ids(text_tokens, text_languages, model.num_languages)
    mode = PrefixMode(model.prefix_mode)
    nar_tokens, nar_lens = nar_text(text_tokens, text_tokens_lens, prompt_text_lens, mode)
    nar_langs = None
    if langs is not None:
        nar_langs = nar_text(langs, text_tokens_lens, prompt_text_lens, mode)[0]
    n = options.num_candidates
    rep = (lambda t: t.repeat_interleave(n, dim=0)) if n > 1 else (lambda t: t)
    min_lens = _min_lens(text_tokens_lens.to(device), prompt_text_lens, options.min_len_ratio)
    keys = None if row_seeds is None else candidate_keys(row_seeds.to(device), n)
    stop = should_stop
    if should_stop is not None and n > 1:  # the hook speaks of rows, the AR decodes candidates
        stop = lambda: None if (gone := should_stop()) is None else gone.repeat_interleave(n)  # noqa: E731
    result = ar_generate(
        model, rep(text_tokens), rep(text_tokens_lens), rep(prompt_codes[..., 0]),
        rep(prompt_lens), options, langs=None if langs is None else rep(langs),
        min_lens=None if min_lens is None else rep(min_lens), want_scores=n > 1,
        row_keys=keys, should_stop=stop,
    )  # fmt: skip
    gen0, gen_lens = best_of_candidates(result, n) if n > 1 else result[:2]
    if should_stop is not None and (gone := should_stop()) is not None:
        gen_lens = gen_lens.masked_fill(gone.to(device), 0)
    else:
        _check_empty(gen_lens, options.on_empty)
    codes = _nar_rows_with_frames(
        model, nar_tokens, nar_lens, prompt_codes, prompt_lens, gen0, gen_lens, nar_langs,
        code_vectors,
    )  # fmt: skip
    return codes, gen_lens


def _nar_rows_with_frames(model, text, text_lens, prompt, prompt_lens, gen0, gen_lens, langs,
                          code_vectors):
    """``nar_generate`` on the rows that have frames (an abandoned or empty row costs nothing)."""
    has = gen_lens > 0
    if bool(has.all()):
        return nar_generate(model, text, text_lens, prompt, prompt_lens, gen0, gen_lens, langs,
                            code_vectors=code_vectors)  # fmt: skip
    codes = gen0.new_full((*gen0.shape, model.num_quantizers), NUM_AUDIO_TOKENS)
    rows = has.nonzero().flatten()
    if rows.numel():
        sub = nar_generate(model, text[rows], text_lens[rows], prompt[rows], prompt_lens[rows],
                           gen0[rows], gen_lens[rows], None if langs is None else langs[rows],
                           code_vectors=code_vectors)  # fmt: skip
        codes[rows, : sub.shape[1]] = sub
    return codes


def candidate_keys(row_seeds: torch.Tensor, n: int) -> torch.Tensor:
    """(B * n,) sampling keys: row b's candidate j from (seed b, j), so candidates differ and a
    row's keys do not depend on its batch (32-bit hash of the seed, then the candidate)."""
    base = (uniform_from_seeds(row_seeds.long(), stream=0) * 2**32).long()
    return (base.repeat_interleave(n) << 16) + torch.arange(n, device=base.device).repeat(base.numel())


def _min_lens(
    text_lens: torch.Tensor, prompt_text_lens: torch.Tensor | None, ratio: float
) -> torch.Tensor | None:
    """Per row, the frames before which EOS is not allowed: ``ratio`` x the tokens of the
    text to say (prompt transcript, BOS and EOS not counted); None without a floor."""
    if ratio <= 0:
        return None
    to_say = text_lens - 2
    if prompt_text_lens is not None:
        to_say = to_say - prompt_text_lens.to(device=text_lens.device, dtype=torch.long)
    return torch.floor(to_say.clamp(min=0).double() * ratio).long()


def best_of_candidates(result: ARResult, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Of N consecutive candidates per row (``want_scores`` on), the one with the highest
    mean log-likelihood: codes (B, T) and lengths (B,)."""
    # A candidate that never emitted EOS ran to the length cap, often looping on a few codes
    # the model finds likely: it wins only when every candidate of its row did.
    scores = torch.where(
        result.ended_on_eos, result.scores, result.scores - CAPPED_CANDIDATE_PENALTY
    )
    bsz = scores.shape[0] // n
    scores = scores.masked_fill(result.lens == 0, float("-inf")).view(bsz, n)
    pick = torch.arange(bsz, device=scores.device) * n + scores.argmax(dim=1)
    gen0, gen_lens = result.codes[pick], result.lens[pick]
    return gen0[:, : int(gen_lens.max())], gen_lens


def _check_empty(gen_lens: torch.Tensor, on_empty: str) -> None:
    empty = gen_lens == 0
    if on_empty == "raise" and bool(empty.any()):
        rows = empty.nonzero().flatten().tolist()
        raise ValueError(
            f"the AR model emitted EOS as the first token for batch row(s) {rows}: "
            "no audio to synthesise (untrained checkpoint, or text/prompt mismatch)"
        )


@torch.no_grad()
def continual(
    model: Any,
    text_tokens: torch.Tensor,
    text_tokens_lens: torch.Tensor,
    audio_features: torch.Tensor,
    audio_features_lens: torch.Tensor | None = None,
    *,
    prompt_lens: torch.Tensor | None = None,
    text_languages: torch.Tensor | None = None,
    code_vectors: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codebook 0 from ground truth, the NAR predicts the rest: codes (B, T, Q) of the
    frames after each row's prompt (default min(len/2, 3 s)) and their lengths (B,)."""
    bsz, t_max, _ = audio_features.shape
    device = audio_features.device
    audio_features = audio_features[..., : model.num_quantizers]
    if audio_features_lens is None:
        audio_features_lens = torch.full((bsz,), t_max, dtype=torch.long, device=device)
    if prompt_lens is None:
        prompt_lens = (audio_features_lens // 2).clamp(max=MAX_PROMPT_FRAMES)
    gen_lens = audio_features_lens - prompt_lens
    g_max = max(int(gen_lens.max()), 0)
    idx = (prompt_lens[:, None] + torch.arange(g_max, device=device)).clamp(max=t_max - 1)
    gen0 = audio_features[..., 0].gather(1, idx)
    gen0 = gen0.masked_fill(~lengths_to_valid(gen_lens, g_max), NUM_AUDIO_TOKENS)
    langs = language_ids(text_tokens, text_languages, model.num_languages)
    codes = nar_generate(
        model, text_tokens, text_tokens_lens, audio_features, prompt_lens, gen0, gen_lens, langs,
        code_vectors=code_vectors,
    )  # fmt: skip
    return codes, gen_lens


# ------------------------------------------------------------------------ AR
def _length_caps(
    text_lens: torch.Tensor, options: DecodeOptions, bsz: int, device: torch.device
) -> torch.Tensor:
    """Per row, the most frames it may get (``force_len``: exactly that many)."""
    if options.force_len is not None:
        caps = torch.full((bsz,), int(options.force_len), device=device, dtype=torch.long)
    else:
        caps = torch.floor(text_lens.double() * options.max_len_ratio).long()
    if bool((caps < 1).any()):
        rows = (caps < 1).nonzero().flatten().tolist()
        raise ValueError(
            f"no frames allowed for batch row(s) {rows}: "
            f"max_len_ratio={options.max_len_ratio} too small"
        )
    return caps


def _forbid_eos(
    logits: torch.Tensor,
    frame: torch.Tensor,
    caps: torch.Tensor,
    min_lens: torch.Tensor | None,
    force_len: int | None,
) -> None:
    """In place on (B, G, 1025) logits: no EOS under ``force_len``, nor before a row's
    floor (its cap still wins)."""
    eos = NUM_AUDIO_TOKENS
    if force_len is not None:
        logits[..., eos] = float("-inf")
    elif min_lens is not None:
        early = (frame[None, :] < min_lens[:, None]) & (frame[None, :] < caps[:, None])
        logits[..., eos] = logits[..., eos].masked_fill(early, float("-inf"))


@torch.no_grad()
def ar_generate(
    model: Any,
    text: torch.Tensor,
    text_lens: torch.Tensor,
    prompt0: torch.Tensor,
    prompt_lens: torch.Tensor,
    options: DecodeOptions = DecodeOptions(),
    *,
    langs: torch.Tensor | None = None,
    min_lens: torch.Tensor | None = None,
    want_scores: bool = False,
    row_keys: torch.Tensor | None = None,
    should_stop: Callable[[], torch.Tensor | None] | None = None,
) -> ARResult:
    """Codebook 0 per row after its prompt (``prompt0`` (B, P), ``prompt_lens`` (B,)).

    ``langs``: per-token language ids (B, S) of a VALL-E X model; ``min_lens``: per row,
    the frames before which EOS is not allowed; ``want_scores``: also the mean
    log-likelihood per frame (EOS included when it stopped). A row whose first token is EOS
    gets length 0. A row ends at the first slot of a group that stops it.

    ``row_keys`` (B,) int64: each row samples frame f from ``uniform_from_seeds`` of its key
    and f (``options.seed`` unused); ``should_stop``: before each step, the rows to abandon
    ((B,) bool or None): they are done from that step on, with length 0.
    """
    device, bsz = text.device, text.shape[0]
    eos = NUM_AUDIO_TOKENS
    if int(text.max()) >= model.num_text_tokens or int(text.min()) < 0:
        raise ValueError(
            f"text token ids must be in [0, {model.num_text_tokens}), got {int(text.max())}"
        )
    text_valid = lengths_to_valid(text_lens, text.shape[1])
    g = model.ar_group_size
    tokens, positions, audio_valid, n_in = ar_prompt_layout(
        prompt0, prompt_lens, g, model.prepend_bos
    )
    caps = _length_caps(text_lens, options, bsz, device)
    max_new = -(-int(caps.max()) // g)  # decoding steps: G frames each
    generator = None
    if options.seed is not None and row_keys is None:
        generator = torch.Generator(device=device).manual_seed(int(options.seed))
    if row_keys is not None:  # 32 bits of the key, then 4 for the slot, so no int64 overflow
        row_keys = (uniform_from_seeds(row_keys.to(device), stream=1) * 2**32).long()
        slot_keys = (row_keys[:, None] << 4) + torch.arange(g, device=device)  # (B, G)

    x = model.ar_embed_text(text, text_valid, langs)
    logits, step = _start_decoding(
        model, x, text_valid, tokens, positions, audio_valid, n_in, max_new, options
    )

    out: list[torch.Tensor] = []
    done = torch.zeros(bsz, dtype=torch.bool, device=device)
    lens = torch.zeros(bsz, dtype=torch.long, device=device)
    ended_on_eos = torch.zeros(bsz, dtype=torch.bool, device=device)
    score = torch.zeros(bsz, dtype=torch.float32, device=device)
    counted = torch.zeros(bsz, dtype=torch.float32, device=device)
    slot = torch.arange(g, device=device)
    abandoned = torch.zeros(bsz, dtype=torch.bool, device=device)
    for i in range(max_new):
        if should_stop is not None and (gone := should_stop()) is not None:
            abandoned = abandoned | gone.to(device)
            done = done | abandoned
            if bool(done.all()):
                break
        logits = logits.reshape(bsz, g, -1)  # (B, G, 1025): one distribution per frame
        frame = i * g + slot  # (G,) the frame index each slot would be
        _forbid_eos(logits, frame, caps, min_lens, options.force_len)
        uniforms = None
        if row_keys is not None:
            uniforms = uniform_from_seeds(slot_keys, stream=2 + i).reshape(-1)
        tok = sample(
            logits.reshape(bsz * g, -1), top_k=options.top_k, top_p=options.top_p,
            temperature=options.temperature, generator=generator, uniforms=uniforms,
        ).view(bsz, g)  # fmt: skip
        is_eos = tok == eos
        if options.stop_rule == "argmax_or_sampled":
            # lifeiteng: also stop when EOS is the most likely token, sampled or not.
            is_eos = is_eos | (logits.argmax(dim=-1) == eos)
        stop = is_eos | (frame[None, :] >= caps[:, None])  # (B, G)
        # A row ends at its group's first stopping slot: that frame and the ones after
        # it are not kept.
        stops_here = stop.any(dim=1) & ~done
        first = torch.where(stop.any(dim=1), stop.int().argmax(dim=1), g)
        kept = ~done[:, None] & (slot[None, :] < first[:, None])
        ends_on_eos = stops_here & is_eos.gather(1, first.clamp(max=g - 1)[:, None]).squeeze(1)
        if want_scores:
            logp = torch.log_softmax(logits.float(), dim=-1)
            picked = logp.gather(2, torch.where(is_eos, eos, tok)[..., None]).squeeze(2)
            # the frames kept, and the EOS that ended the row
            counts = kept | (ends_on_eos[:, None] & (slot[None, :] == first[:, None]))
            score = score + torch.where(counts, picked, torch.zeros_like(picked)).sum(1)
            counted = counted + counts.float().sum(1)
        lens = torch.where(stops_here, i * g + first, lens)
        ended_on_eos = ended_on_eos | ends_on_eos
        done = done | stops_here
        tok = tok.masked_fill(~kept, eos)
        out.append(tok)
        if bool(done.all()) or i + 1 == max_new:
            break  # no further token will be sampled: skip the last model call
        step_tokens = tok.view(bsz, 1, g) if g > 1 else tok  # one column: (B, 1[, G])
        logits = step(step_tokens)
    lens = torch.where(done, lens, torch.full_like(lens, len(out) * g))
    lens = lens.masked_fill(abandoned, 0)
    if not out:  # every row abandoned before the first token
        out.append(torch.full((bsz, g), eos, dtype=torch.long, device=device))
    gen = torch.cat(out, dim=1)[:, : int(lens.max())]
    scores = score / counted.clamp(min=1) if want_scores else None
    return ARResult(gen, lens, scores, ended_on_eos)


def fixed_shapes(options: DecodeOptions) -> bool:
    """Whether the static cache's attention reads its whole buffer every step (what a CUDA
    graph replays) or only the columns written so far (faster without a graph)."""
    return options.cuda_graphs


def _start_decoding(model, x, text_valid, tokens, positions, audio_valid, n_in, max_new, options):
    """Runs the AR over the text and prompt: (logits of the first frame after the prompt,
    the step that takes each next column's tokens and gives the logits after them)."""
    device = tokens.device
    # Self-attention columns before the first generated one: the text (decoder-only) + prompt.
    prefill = tokens.shape[1] + (0 if model.cross_attention else text_valid.shape[1])
    static = options.static_cache or options.cuda_graphs
    if options.cuda_graphs and device.type != "cuda":
        raise ValueError(f"--cuda-graphs needs a CUDA device, the model is on {device}")
    cursor = torch.zeros(1, dtype=torch.long, device=device) if static else None
    caches = None
    if options.use_kv_cache:
        caches = model.ar_decoder.new_caches(prefill + max_new, cursor, fixed_shapes(options))
    h = model.ar_core(x, text_valid, model.ar_embed_audio(tokens, positions), audio_valid, caches)
    logits = model.ar_logits(h[:, -1])
    if not static:
        return logits, GrowingStep(model, x, text_valid, tokens, positions, audio_valid, n_in, caches)
    cursor.fill_(prefill)
    step = StaticStep(model, text_valid, audio_valid, n_in, max_new, caches, cursor)
    return logits, GraphedStep(step) if options.cuda_graphs else step


class GrowingStep:
    """One AR decoding step on sequences that grow by a column per step: with the growing
    KV cache (``caches``), or without a cache the whole sequence recomputed."""

    def __init__(self, model, x, text_valid, tokens, positions, audio_valid, n_in, caches):
        self.model, self.x, self.text_valid, self.caches = model, x, text_valid, caches
        self.tokens, self.positions, self.audio_valid = tokens, positions, audio_valid
        self.n_in, self.steps = n_in, 0

    def __call__(self, step_tokens: torch.Tensor) -> torch.Tensor:
        model = self.model
        new_pos = (self.n_in + self.steps)[:, None]
        self.steps += 1
        valid = self.audio_valid
        self.audio_valid = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=1)
        if self.caches is not None:
            y_new = model.ar_embed_audio(step_tokens, new_pos)
            h = model.ar_core_step(y_new, self.text_valid, self.audio_valid, self.caches)
        else:
            self.tokens = torch.cat([self.tokens, step_tokens], dim=1)
            self.positions = torch.cat([self.positions, new_pos], dim=1)
            y = model.ar_embed_audio(self.tokens, self.positions)
            h = model.ar_core(self.x, self.text_valid, y, self.audio_valid)
        return model.ar_logits(h[:, -1])


class StaticStep:
    """One AR decoding step whose shapes never change: the next column's tokens go in, the
    logits of the frame after them come out.

    Every other input lives in buffers it updates in place with tensor ops: the valid audio
    columns (the prompt's, then one more per step, to the cache's width), each row's next
    position and the cache's write column. A step thus has no Python-side state and no
    host synchronisation: ``GraphedStep`` can capture it once and replay it.
    """

    def __init__(self, model, text_valid, audio_valid, n_in, max_new, caches, cursor):
        self.model, self.text_valid, self.caches, self.cursor = model, text_valid, caches, cursor
        bsz, width = audio_valid.shape
        self.audio_valid = torch.cat([audio_valid, audio_valid.new_zeros(bsz, max_new)], dim=1)
        self.column = torch.full((1,), width, dtype=torch.long, device=audio_valid.device)
        self.positions = n_in[:, None].clone()
        g = model.ar_group_size
        shape = (bsz, 1, g) if g > 1 else (bsz, 1)
        self.tokens = torch.full(shape, NUM_AUDIO_TOKENS, dtype=torch.long, device=n_in.device)

    def state(self) -> list[torch.Tensor]:
        """The buffers a step changes (besides the cache column it writes)."""
        return [self.audio_valid, self.column, self.positions, self.cursor, self.tokens]

    def run(self) -> torch.Tensor:
        """The step on the buffers: logits (B, [G,] 1025) of the next frame."""
        self.audio_valid.index_fill_(1, self.column, True)
        y = self.model.ar_embed_audio(self.tokens, self.positions)
        h = self.model.ar_core_step(y, self.text_valid, self.audio_valid, self.caches)
        logits = self.model.ar_logits(h[:, -1])
        for counter in (self.column, self.positions, self.cursor):
            counter.add_(1)
        return logits

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        return self.run()


class GraphedStep:
    """A ``StaticStep`` captured in a CUDA graph (``torch.cuda.CUDAGraph``) and replayed
    per token: one launch instead of one per kernel, which dominates small-batch decoding.
    Captured per batch (its buffers are that batch's)."""

    def __init__(self, step: StaticStep):
        self.step = step
        saved = [t.clone() for t in step.state()]
        # Warm up on a side stream (kernels picked and workspaces allocated before capture).
        # It writes the cache at the cursor's column, which the first real step rewrites.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step.run()
        torch.cuda.current_stream().wait_stream(stream)
        for buffer, value in zip(step.state(), saved):
            buffer.copy_(value)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # recorded, not run: the state stays as restored
            self.logits = step.run()

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.step.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits


# ----------------------------------------------------------------------- NAR
@torch.no_grad()
def nar_generate(
    model: Any,
    text: torch.Tensor,
    text_lens: torch.Tensor,
    prompt: torch.Tensor,
    prompt_lens: torch.Tensor,
    gen0: torch.Tensor,
    gen_lens: torch.Tensor,
    langs: torch.Tensor | None = None,
    code_vectors: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Greedy NAR over codebooks 1..Q-1 after the AR (or ground-truth) codebook 0 ``gen0``
    (B, T): the most likely code, or with ``code_vectors`` (one (K_j, D) tensor per
    codebook) the code nearest the expected vector. Returns codes (B, T, Q)."""
    q, bsz = model.num_quantizers, gen0.shape[0]
    if code_vectors is not None and len(code_vectors) < q:
        raise ValueError(f"code_vectors has {len(code_vectors)} codebooks, the model {q}")
    gen = gen0.new_full((bsz, gen0.shape[1], q), NUM_AUDIO_TOKENS)
    gen[..., 0] = gen0
    if q == 1 or gen0.shape[1] == 0:
        return gen
    text_valid = lengths_to_valid(text_lens, text.shape[1])
    packed, lens = pack_sequences(prompt, prompt_lens, gen, gen_lens, NUM_AUDIO_TOKENS)
    cols = torch.arange(packed.shape[1], device=packed.device)[None, :]
    audio_valid = cols < lens[:, None]
    is_gen = audio_valid & (cols >= prompt_lens[:, None])
    # Prefix mode 0 never saw a prompt carrying all codebooks: give it what it was trained on.
    prompt_full = model.prefix_mode != PrefixMode.NONE
    for j in range(1, q):
        stage = torch.full((bsz,), j, dtype=torch.long, device=packed.device)
        h = model.nar_hidden(
            text, text_valid, packed, prompt_lens, audio_valid, stage, prompt_full, langs
        )
        logits = model.nar_head(h, stage)
        if code_vectors is None:
            pred = logits.argmax(-1)
        else:
            pred = nearest_to_expectation(logits, code_vectors[j])
        packed[..., j] = torch.where(is_gen, pred, packed[..., j])
    return generated_frames(packed, prompt_lens, gen_lens, gen.shape[1])
