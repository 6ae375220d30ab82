"""Static KV cache decoding (``static_cache=True``; ``cuda_graphs=True`` on CUDA): the same
tokens as the growing cache, from a step whose shapes never change."""

from __future__ import annotations

import pytest
import torch
from models_testlib import Q, tiny_model

from valle.models import NUM_AUDIO_TOKENS, generation

TEXT_LENS = (9, 4, 12, 6, 3, 10, 7, 5)  # 8 rows: different length caps, so different ends
PROMPT_LENS = (6, 3, 8, 4, 5, 2, 7, 4)
PROMPT_TEXT_LENS = (3, 1, 4, 2, 1, 3, 2, 1)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    bsz = len(TEXT_LENS)
    text = torch.full((bsz, max(TEXT_LENS)), 1, dtype=torch.long)
    prompt = torch.full((bsz, max(PROMPT_LENS), Q), NUM_AUDIO_TOKENS, dtype=torch.long)
    for b in range(bsz):
        text[b, : TEXT_LENS[b]] = torch.randint(4, 40, (TEXT_LENS[b],), generator=g)
        prompt[b, : PROMPT_LENS[b]] = torch.randint(0, 64, (PROMPT_LENS[b], Q), generator=g)
    return text, torch.tensor(TEXT_LENS), prompt, torch.tensor(PROMPT_LENS)


def _decode(model, device="cpu", languages=None, **options):
    text, text_lens, prompt, prompt_lens = (t.to(device) for t in _batch())
    return model.inference(
        text, text_lens, prompt, prompt_lens, prompt_text_lens=torch.tensor(PROMPT_TEXT_LENS, device=device),
        text_languages=None if languages is None else languages.to(device), max_len_ratio=1.5,
        on_empty="mark", return_lens=True, **options,
    )  # fmt: skip


CASES = {
    "valle": dict(name="valle"),
    "vallf": dict(name="vallf"),
    "prefix-mode-2": dict(name="valle", prefix_mode=2),
    "prefix-mode-4": dict(name="vallf", prefix_mode=4),
    "group-2": dict(name="valle", ar_group_size=2),
    "group-2-vallf-bos": dict(name="vallf", ar_group_size=2, prepend_bos=True),
    "vall-e-x": dict(name="valle", num_languages=2),
}


def _model(case: str):
    hp = dict(CASES[case])
    # An untied AR head: a tied random one mostly repeats its input token (a weak check).
    return tiny_model(hp.pop("name"), share_embedding=False, **hp).eval()


def _languages(case: str):
    if "num_languages" not in CASES[case]:
        return None
    return (torch.arange(max(TEXT_LENS))[None, :] > torch.tensor(PROMPT_TEXT_LENS)[:, None]).long()


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("decoding", ["greedy", "best-of-3"])
def test_static_cache_gives_the_growing_caches_tokens(case, decoding):
    model, langs = _model(case), _languages(case)
    options = dict(top_k=1) if decoding == "greedy" else dict(top_k=8, seed=5, num_candidates=3)
    codes, lens = _decode(model, languages=langs, **options)
    static_codes, static_lens = _decode(model, languages=langs, static_cache=True, **options)
    assert torch.equal(static_lens, lens) and torch.equal(static_codes, codes)
    assert len(set(lens.tolist())) >= 4  # rows ended at different steps
    assert min(len(torch.unique(row[:n])) for row, n in zip(codes[..., 0], lens)) > 1


def test_rows_stopping_on_eos_at_different_steps():
    """EOS made likely after a few frames by scaling its logit: rows stop on EOS (not only at
    their caps) at different steps, and the static cache follows them."""
    model = _model("valle")
    with torch.no_grad():
        model.ar_predict_layer.weight[NUM_AUDIO_TOKENS] *= 6.0
    codes, lens = _decode(model, top_k=1, stop_rule="sampled", min_len_ratio=0.5)
    static_codes, static_lens = _decode(
        model, top_k=1, stop_rule="sampled", min_len_ratio=0.5, static_cache=True
    )
    assert torch.equal(static_lens, lens) and torch.equal(static_codes, codes)
    caps = torch.floor(torch.tensor(TEXT_LENS) * 1.5).long()
    assert bool((lens < caps).any()) and len(set(lens.tolist())) >= 3


@pytest.mark.parametrize("name", ["valle", "vallf"])
def test_every_static_step_has_the_same_shapes(name, monkeypatch):
    model = _model("valle" if name == "valle" else "vallf")
    shapes = []
    original = generation.StaticStep.run

    def spy(self):
        shapes.append((tuple(self.tokens.shape), tuple(self.audio_valid.shape),
                       tuple(self.caches[0].self_attn.k.shape)))  # fmt: skip
        return original(self)

    monkeypatch.setattr(generation.StaticStep, "run", spy)
    _, lens = _decode(model, top_k=1, static_cache=True)
    assert len(shapes) == int(lens.max()) - 1 > 5 and len(set(shapes)) == 1


def test_options_that_cannot_hold_are_refused():
    model = _model("valle")
    with pytest.raises(ValueError, match="use_kv_cache must stay on"):
        _decode(model, top_k=1, static_cache=True, use_kv_cache=False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--cuda-graphs needs a CUDA device"):
            _decode(model, top_k=1, cuda_graphs=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("case", ["valle", "vallf", "group-2", "vall-e-x", "prefix-mode-4"])
def test_cuda_graphs_give_the_same_tokens(case):
    model, langs = _model(case).cuda(), _languages(case)
    for options in (dict(top_k=1), dict(top_k=8, seed=5, num_candidates=3)):
        codes, lens = _decode(model, "cuda", langs, **options)
        static = _decode(model, "cuda", langs, static_cache=True, **options)
        graphed = _decode(model, "cuda", langs, cuda_graphs=True, **options)
        for other_codes, other_lens in (static, graphed):
            assert torch.equal(other_lens, lens) and torch.equal(other_codes, codes)



@pytest.mark.parametrize("case", sorted(CASES))
def test_the_fixed_shape_path_that_graphs_replay_gives_the_same_tokens_on_cpu(case, monkeypatch):
    """--cuda-graphs reads the whole cache buffer every step (masked); without a graph the
    static cache reads only its written columns. The graph's arithmetic, checked here on
    CPU by forcing fixed shapes without capturing."""
    model, langs = _model(case), _languages(case)
    codes, lens = _decode(model, languages=langs, top_k=1)
    monkeypatch.setattr(generation, "fixed_shapes", lambda options: True)
    fixed_codes, fixed_lens = _decode(model, languages=langs, top_k=1, static_cache=True)
    assert torch.equal(fixed_lens, lens) and torch.equal(fixed_codes, codes)
