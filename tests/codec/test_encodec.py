"""EnCodec tokenizer: weights, shapes, seeded random weights, audio loading, code vectors."""

import numpy as np
import pytest
import soundfile as sf
import torch

from valle.codec.audio import AudioLoadError, load_audio_24k
from valle.codec.constants import FRAME_RATE
from valle.codec.encodec import AudioTokenizer


def _signal(seconds: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = int(seconds * 24000)
    t = torch.arange(n) / 24000
    return (0.3 * torch.sin(2 * torch.pi * 220 * t * (1 + t)) + 0.05 * torch.randn(n, generator=g)).reshape(1, 1, n)


def test_refuses_without_weights(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    with pytest.raises(FileNotFoundError, match="--allow-random-encodec"):
        AudioTokenizer()


def test_shapes_frame_rate_and_decode(random_audio_tokenizer):
    tok = random_audio_tokenizer
    for seconds in (1.0, 2.5):
        codes = tok.encode(_signal(seconds))
        assert codes.dtype == torch.long
        assert codes.shape[:2] == (1, 8)
        assert abs(codes.shape[-1] - seconds * FRAME_RATE) <= 1
        assert 0 <= int(codes.min()) and int(codes.max()) < 1024
    assert tok.decode(codes).shape[:2] == (1, 1)
    assert (tok.sample_rate, tok.num_quantizers, tok.frame_rate) == (24000, 8, 75)


def test_random_weights_are_seeded_and_codes_follow_the_input(random_audio_tokenizer):
    x = _signal(1.5)
    first = random_audio_tokenizer.encode(x)
    other = AudioTokenizer(allow_random_weights=True, seed=0).encode(x)
    assert torch.equal(first, other)
    assert len(torch.unique(first[0, 0])) > 5  # not a constant code stream
    assert not torch.equal(first, random_audio_tokenizer.encode(_signal(1.5, seed=1)))


def test_load_audio_24k_resamples_and_names_bad_files(tmp_path):
    path = tmp_path / "a.wav"
    sf.write(path, np.zeros((22050, 2), dtype=np.float32), 22050)
    wav = load_audio_24k(path)
    assert wav.shape == (1, 1, 24000)
    bad = tmp_path / "corrupt.wav"
    bad.write_bytes(b"RIFF not really a wave file")
    with pytest.raises(AudioLoadError, match="corrupt.wav"):
        load_audio_24k(bad)


def test_code_vectors_are_what_the_decoder_sums(random_audio_tokenizer):
    """code_vectors() (--nar-decoding mmse): each code's vector in EnCodec's latent; their sum
    over the 8 codebooks is the quantised latent the decoder receives."""
    tok = random_audio_tokenizer
    vectors = tok.code_vectors()
    assert [tuple(v.shape) for v in vectors] == [(1024, 128)] * 8
    codes = tok.encode(_signal(0.5))[0]  # (8, T)
    latent = tok.model.quantizer.vq.decode(codes[None])  # (1, 128, T)
    summed = sum(vectors[j][codes[j]] for j in range(8))  # (T, 128)
    torch.testing.assert_close(summed.T, latent[0])
