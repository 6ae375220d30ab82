"""Resampling, the mel filterbank and Griffin-Lim in plain torch equal torchaudio's (where it
imports: the ``ref`` extra), so prompts, evaluation audio and fitted mel-rvq codes are what
they were; elsewhere their own properties are checked."""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.codec_reference import signal
from valle.codec.audio import resample
from valle.codec.mel import MelConfig, MelFrontend, MelInverter, mel_filterbank

RATES = [(22050, 24000), (16000, 24000), (44100, 24000), (48000, 24000), (24000, 16000), (8000, 24000)]


@pytest.mark.smoke
@pytest.mark.parametrize("orig,new", RATES)
def test_resampled_sine_keeps_its_frequency_and_level(orig, new):
    t = torch.arange(orig) / orig
    y = resample(torch.sin(2 * math.pi * 440 * t), orig, new)
    assert y.shape == (math.ceil(new * orig / orig),)
    mid = y[new // 4: 3 * new // 4]  # away from the edges
    expected = torch.sin(2 * math.pi * 440 * torch.arange(new // 4, 3 * new // 4) / new)
    torch.testing.assert_close(mid, expected, atol=2e-3, rtol=0)
    assert torch.equal(resample(y, new, new), y)
    with pytest.raises(ValueError, match="whole sample rates"):
        resample(y, 22050.5, 24000)


@pytest.mark.smoke
def test_filterbank_is_slaneys():
    fb = mel_filterbank(MelConfig())
    assert fb.shape == (641, 80) and (fb >= 0).all()
    hz_per_bin = 24000 / 2 / 640
    area = fb.sum(0) * hz_per_bin  # unit area per Hz: the triangles' areas are ~1
    assert torch.allclose(area[10:], torch.ones(70), atol=0.08)


@pytest.fixture(scope="module")
def torchaudio():
    return pytest.importorskip("torchaudio", reason="torchaudio (pip install .[ref]) is the reference")


@pytest.mark.parametrize("orig,new", RATES)
def test_resample_equals_torchaudio(torchaudio, orig, new):
    x = signal(0.8, seed=orig, batch=2)[:, 0, : int(0.8 * orig)]
    torch.testing.assert_close(resample(x, orig, new), torchaudio.functional.resample(x, orig, new),
                               rtol=1e-5, atol=1e-6)


def test_mel_frontend_equals_torchaudio(torchaudio):
    c = MelConfig()
    theirs = torchaudio.transforms.MelSpectrogram(
        sample_rate=c.sample_rate, n_fft=c.n_fft, hop_length=c.hop_length, n_mels=c.n_mels,
        f_min=c.f_min, f_max=c.f_max, power=1.0, center=True, norm="slaney", mel_scale="slaney")
    torch.testing.assert_close(mel_filterbank(c), theirs.mel_scale.fb, rtol=1e-6, atol=1e-9)
    x = signal(1.1, seed=4, batch=2)[:, 0]
    torch.testing.assert_close(MelFrontend(c).mel(x), theirs(x), rtol=1e-5, atol=1e-6)


def test_griffin_lim_equals_torchaudio(torchaudio):
    c = MelConfig()
    log_mel = MelFrontend(c)(signal(0.6, seed=2)[0, 0])
    inverter = MelInverter(c, n_iter=8)
    ours = inverter(log_mel)
    mag = (torch.exp(log_mel) @ inverter.inverse).clamp_min(0.0).T[None]
    t = log_mel.shape[0]
    mag = torch.cat([mag, mag[..., -1:]], dim=-1)
    theirs = torchaudio.functional.griffinlim(mag, inverter.window, c.n_fft, c.hop_length, c.n_fft, 1.0, 8,
                                              0.99, t * c.hop_length, False)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.smoke
def test_lhotse_resamples_the_same_without_torchaudio(tmp_path, monkeypatch):
    """lhotse would switch to scipy's filter without torchaudio: a 22.05 kHz corpus would get
    other audio, hence other codes, than it got with torchaudio installed."""
    import numpy as np
    import soundfile as sf
    from lhotse import Recording
    from lhotse.augmentation import torchaudio as lhotse_ta

    from valle.codec.audio import use_torch_resampling_in_lhotse

    path = tmp_path / "a.wav"
    sf.write(path, signal(0.5, seed=1)[0, 0, :11025].numpy(), 22050)
    recording = Recording.from_file(path).resample(24000)
    monkeypatch.setattr(lhotse_ta, "is_torchaudio_available", lambda: True)
    with_torchaudio = recording.load_audio()
    monkeypatch.setattr(lhotse_ta, "is_torchaudio_available", lambda: False)
    use_torch_resampling_in_lhotse()
    without = recording.load_audio()
    assert with_torchaudio.shape == without.shape == (1, 12000)
    assert np.array_equal(with_torchaudio, without)
    torch.testing.assert_close(torch.from_numpy(without[0]), resample(torch.from_numpy(
        sf.read(path, dtype="float32")[0]), 22050, 24000), rtol=1e-5, atol=1e-6)
