"""valle.engine: a request decoded in a batch gives what it gives alone (greedy, and sampled
with its seed), a row whose requester left stops at the next step, causal codecs decode
batches padded."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "models"))
from models_testlib import tiny_model  # noqa: E402

from valle.engine import Abandoned, Prepared, codes_to_audio, decode_prepared  # noqa: E402
from valle.models import NUM_AUDIO_TOKENS  # noqa: E402
from valle.models.generation import DecodeOptions  # noqa: E402


class CodesAsAudio:
    """A codec whose 'audio' is the codes themselves (so equal audio means equal codes)."""

    hop_length = 8

    def decode(self, codes):  # (1, Q, T)
        return codes.transpose(1, 2).reshape(1, 1, -1).float()


def _units(n: int = 4) -> list[Prepared]:
    g = torch.Generator().manual_seed(1)
    units = []
    for i, (s, p) in enumerate([(9, 12), (5, 7), (12, 3), (7, 10), (6, 6)][:n]):
        text = torch.randint(4, 40, (s,), generator=g)
        units.append(Prepared(f"unit {i}", text, 2, torch.randint(0, NUM_AUDIO_TOKENS, (p, 8), generator=g)))
    return units


def _decode(model, units, options, **kw):
    return decode_prepared(model, units, pad_id=1, device="cpu", audio_tokenizer=CodesAsAudio(),
                           options=options, **kw)  # fmt: skip


@pytest.fixture(scope="module")
def model():
    return tiny_model("valle", 1).eval()


@pytest.mark.parametrize("options, seeds", [
    (DecodeOptions(top_k=1, max_len_ratio=2.0), None),
    (DecodeOptions(top_k=-100, temperature=1.0, max_len_ratio=2.0, seed=42), [5, 6, 7, 8]),
    (DecodeOptions(top_k=20, top_p=0.9, max_len_ratio=2.0, num_candidates=2, seed=0), [5, None, 7, 5]),
])  # fmt: skip
def test_a_row_in_a_batch_decodes_as_it_does_alone(model, options, seeds):
    units = _units()
    together = _decode(model, units, options, row_seeds=seeds)
    for i, unit in enumerate(units):
        alone = _decode(model, [unit], options, row_seeds=None if seeds is None else [seeds[i]])[0]
        assert isinstance(together[i], torch.Tensor) and torch.equal(together[i], alone), unit.name
    if seeds is not None and options.top_k != 1:  # the seed matters: another one samples otherwise
        other = _decode(model, units[:1], options, row_seeds=[seeds[0] + 1])[0]
        assert not torch.equal(other, together[0])


def test_same_seed_same_row_in_one_batch_samples_alike(model):
    unit = _units(1)[0]
    options = DecodeOptions(top_k=-100, max_len_ratio=2.0, seed=3)
    a, b, c = _decode(model, [unit, unit, unit], options, row_seeds=[1, 1, 2])
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_an_abandoned_row_stops_at_the_next_step(model):
    units = _units()
    options = DecodeOptions(top_k=1, max_len_ratio=4.0)
    calls = {"n": 0}
    original = model.ar_logits

    def counting(h):
        calls["n"] += 1
        return original(h)

    gone = torch.zeros(len(units), dtype=torch.bool)

    def should_stop():
        if calls["n"] == 3:
            gone[1] = True  # row 1's client left after two decoding steps
        return gone

    model.ar_logits = counting
    try:
        out = _decode(model, units, options, should_stop=should_stop)
        alone = [_decode(model, [u], options)[0] for u in units]
        assert isinstance(out[1], Abandoned)
        for i in (0, 2, 3):
            assert torch.equal(out[i], alone[i])
        # every row gone: the AR stops at the next step instead of running to its cap
        calls["n"] = 0
        everyone = torch.zeros(len(units), dtype=torch.bool)

        def all_leave():
            if calls["n"] >= 3:
                everyone[:] = True
            return everyone

        out = _decode(model, units, options, should_stop=all_leave)
        assert all(isinstance(o, Abandoned) for o in out)
        assert calls["n"] == 3, "decoding went on after every requester left"
    finally:
        model.ar_logits = original


@pytest.mark.timeout(120)
def test_encodec_decodes_a_padded_batch_as_each_row_alone():
    from valle.codec.encodec import AudioTokenizer

    codec = AudioTokenizer("cpu", allow_random_weights=True, download=False)
    g = torch.Generator().manual_seed(0)
    codes = [torch.randint(0, 1024, (t, 8), generator=g) for t in (30, 11, 19)]
    together = codes_to_audio(codes, codec)
    for c, wav in zip(codes, together):
        alone = codes_to_audio([c], codec)[0]
        assert wav.shape == alone.shape == (c.shape[0] * 320,)
        assert torch.allclose(wav, alone, atol=1e-4)
