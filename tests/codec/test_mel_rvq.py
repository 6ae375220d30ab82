"""The offline mel-RVQ codec: EnCodec's interface (8 x 1024 codes at 75 Hz from 24 kHz audio),
encode/decode round trip, determinism, persistence, and how checkpoints find it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from valle.codec import (
    RECORD_FILE,
    check_ar_codebook_size,
    codec_for_checkpoint,
    first_codebook_size,
    read_codec_record,
    write_codec_record,
)
from valle.codec.mel_rvq import STATE_FILE, FitConfig, MelRvqCodec

TEXTS = [
    "The cat sat by the open window.", "Rain fell softly on the tin roof.",
    "Please pass me the salt and pepper.", "We walked home along the river.",
    "A small boat drifted across the lake.", "She painted the fence bright green.",
    "Seven birds sang in the old oak tree.", "He forgot his keys at the station.",
]


@pytest.fixture(scope="module")
def wavs() -> list[torch.Tensor]:
    from valle.codec.audio import to_mono_24k
    from valle.data.tiny import VOICES, EspeakSynth

    synth = EspeakSynth.get()
    return [to_mono_24k(synth.synthesize(t, VOICES[i % len(VOICES)]).astype(np.float32) / 32768,
                        synth.sample_rate) for i, t in enumerate(TEXTS)]


@pytest.fixture(scope="module")
def codec(wavs) -> MelRvqCodec:
    return MelRvqCodec.fit(wavs[:6], FitConfig(iterations=4))


def _mse(a: torch.Tensor, b: torch.Tensor) -> float:
    n = min(a.shape[0], b.shape[0])
    return float(((a[:n] - b[:n]) ** 2).mean())


def test_interface_shapes_and_ranges(codec, wavs):
    assert (codec.sample_rate, codec.frame_rate, codec.hop_length) == (24_000, 75, 320)
    assert (codec.num_quantizers, codec.codebook_size) == (8, 1024)
    n = min(w.numel() for w in wavs[6:])
    batch = torch.stack([w[:n] for w in wavs[6:]]).unsqueeze(1)  # (2, 1, n)
    codes = codec.encode(batch)
    assert codes.shape == (2, 8, -(-n // 320)) and codes.dtype == torch.long
    assert int(codes.min()) >= 0 and int(codes.max()) < 1024
    audio = codec.decode(codes)
    assert audio.shape == (2, 1, codes.shape[-1] * 320) and torch.isfinite(audio).all()
    # encode_batch: each item on its own, so padding in a batch changes nothing
    each = codec.encode_batch([w for w in wavs[6:]])
    assert [tuple(c.shape) for c in each] == [(8, -(-w.numel() // 320)) for w in wavs[6:]]
    t = codes.shape[-1] - 3  # the last frames of the cropped row see its end (window: 4 hops)
    assert torch.equal(each[0][:, :t], codes[0, :, :t]) and torch.equal(each[1][:, :t], codes[1, :, :t])
    with pytest.raises(ValueError, match=r"\(B, 1, N\)"):
        codec.encode(wavs[0])


def test_round_trip_keeps_the_spectrum(codec, wavs):
    held_out, other = wavs[6], wavs[7]
    feats = codec.features(held_out)
    codes = codec.encode(held_out.reshape(1, 1, -1))[0]
    # more codebooks, closer features: the residual stages refine codebook 0 (even on audio the
    # codebooks never saw, fitted here on six sentences)
    err = [_mse((codec.dequantize(codes[:q]) - codec.mean) / codec.std, feats) for q in (1, 2, 4, 8)]
    assert err == sorted(err, reverse=True) and err[-1] < 0.8 * err[0]
    # the decoded audio has the original's spectrum: far closer than another sentence's
    resyn = codec.decode(codes.unsqueeze(0)).reshape(-1)
    assert _mse(codec.features(resyn), feats) < 0.5 * _mse(codec.features(other), feats)


def test_deterministic_fit_encode_decode(codec, wavs):
    again = MelRvqCodec.fit(wavs[:6], FitConfig(iterations=4))
    assert torch.equal(again.codebooks, codec.codebooks)
    x = wavs[7].reshape(1, 1, -1)
    c1, c2 = codec.encode(x), again.encode(x)
    assert torch.equal(c1, c2)
    assert torch.equal(codec.decode(c1), codec.decode(c1))
    other_seed = MelRvqCodec.fit(wavs[:6], FitConfig(iterations=4, seed=1))
    assert not torch.equal(other_seed.codebooks, codec.codebooks)


def test_decode_rejects_padding_and_too_many_codebooks(codec):
    codes = torch.zeros(1, 8, 5, dtype=torch.long)
    codes[0, 3, 2] = 1024  # the collation's padding value
    with pytest.raises(ValueError, match="1024"):
        codec.decode(codes)
    with pytest.raises(ValueError, match="9 codebooks"):
        codec.dequantize(torch.zeros(9, 4, dtype=torch.long))


def test_save_load_and_checkpoint_lookup(codec, wavs, tmp_path):
    corpus = tmp_path / "tokenized"
    codec.save(corpus / STATE_FILE)
    write_codec_record(corpus, codec)
    assert json.loads((corpus / RECORD_FILE).read_text()) == {"codec": "mel-rvq", "state": STATE_FILE}
    assert read_codec_record(tmp_path) is None
    x = wavs[6].reshape(1, 1, -1)
    # a checkpoint's config names the manifest dir, or (absolute) a symbol table inside it
    for config in ({"manifest_dir": str(corpus)},
                   {"manifest_dir": "moved/away", "text_tokens": str(corpus / "unique_text_tokens.k2symbols")}):
        loaded = codec_for_checkpoint(config)
        assert isinstance(loaded, MelRvqCodec) and torch.equal(loaded.encode(x), codec.encode(x))
    with pytest.raises(FileNotFoundError, match="valle.codec fit"):
        MelRvqCodec.load(tmp_path / "nowhere" / STATE_FILE)
    with pytest.raises(FileNotFoundError, match="--codec-dir"):
        codec_for_checkpoint({"manifest_dir": str(tmp_path / "none")}, codec="mel-rvq")


def test_a_refitted_codec_is_refused_for_a_checkpoint_trained_on_the_old_one(codec, wavs, tmp_path):
    """Refitting (other data, other k-means) gives other codes for the same audio: a checkpoint
    records the state's sha256 and inference refuses a state file that differs."""
    from valle.codec import CodecMismatchError, codec_identity

    corpus = tmp_path / "tokenized"
    codec.save(corpus / STATE_FILE)
    write_codec_record(corpus, codec)
    identity = codec_identity(corpus)
    assert identity["codec"] == "mel-rvq" and len(identity["sha256"]) == 64
    config = {"manifest_dir": str(corpus), "audio_codec": identity}
    assert isinstance(codec_for_checkpoint(config), MelRvqCodec)  # the same state: accepted

    refitted = MelRvqCodec.fit(wavs[2:8], FitConfig(iterations=4))
    x = wavs[0].reshape(1, 1, -1)
    assert not torch.equal(refitted.encode(x), codec.encode(x))  # why it matters
    refitted.save(corpus / STATE_FILE)
    with pytest.raises(CodecMismatchError, match=f"{STATE_FILE}.*refitted"):
        codec_for_checkpoint(config)
    # The original state elsewhere (--codec-dir) is accepted again.
    original = tmp_path / "original"
    codec.save(original / STATE_FILE)
    write_codec_record(original, codec)
    assert torch.equal(codec_for_checkpoint(config, codec_dir=original).encode(x), codec.encode(x))
    # A checkpoint from before the hash was recorded keeps working (nothing to compare).
    assert isinstance(codec_for_checkpoint({"manifest_dir": str(corpus)}), MelRvqCodec)


def test_code_vectors_are_what_decoding_sums(codec, wavs):
    """code_vectors() (--nar-decoding mmse) lives in the space dequantize sums codes in: the
    codes in use of each codebook, and their sum is the decoded frame (before un-standardising)."""
    vectors = codec.code_vectors()
    assert [tuple(v.shape) for v in vectors] == [(size, 80) for size in codec.sizes]
    codes = codec.encode(wavs[6][None, None])[0]  # (8, T)
    summed = sum(vectors[j][codes[j]] for j in range(8))
    torch.testing.assert_close(summed * codec.std + codec.mean, codec.dequantize(codes))
    small = MelRvqCodec.fit(wavs[:6], FitConfig(iterations=2, first_codebook_size=16))
    assert [v.shape[0] for v in small.code_vectors()][:2] == [16, small.sizes[1]]


def test_the_trainer_refuses_an_ar_head_smaller_than_codebook_0(wavs, tmp_path):
    """--ar-codebook-size is checked against the corpus's codec before the first step."""
    small = MelRvqCodec.fit(wavs[:6], FitConfig(iterations=2, first_codebook_size=16))
    corpus = tmp_path / "tokenized"
    small.save(corpus / STATE_FILE)
    write_codec_record(corpus, small)
    assert first_codebook_size(corpus) == 16
    check_ar_codebook_size(16, corpus)
    check_ar_codebook_size(1024, corpus)  # a wider head only wastes compute
    with pytest.raises(ValueError, match=r"--ar-codebook-size 8: .* has 16 codes; use --ar-codebook-size 16"):
        check_ar_codebook_size(8, corpus)
    # EnCodec's codebooks have 1024 codes; a corpus without a codec record is not checked.
    (corpus / RECORD_FILE).write_text(json.dumps({"codec": "encodec", "random_weights": False}))
    assert first_codebook_size(corpus) == 1024
    with pytest.raises(ValueError, match="--ar-codebook-size 128"):
        check_ar_codebook_size(128, corpus)
    assert first_codebook_size(tmp_path) is None
    check_ar_codebook_size(8, tmp_path)
