"""Codes stored as lhotse features (valle.data.codes)."""

import numpy as np
import soundfile as sf
import torch

from valle.data.codes import EncodecCodes, EncodecConfig, fit_frames


def _signal(seconds: float) -> torch.Tensor:
    n = int(seconds * 24000)
    t = torch.arange(n) / 24000
    return 0.3 * torch.sin(2 * torch.pi * 220 * t * (1 + t))


def test_codes_stored_as_lhotse_features(tmp_path):
    from lhotse import NumpyFilesWriter, Recording
    from lhotse.features.base import FeatureExtractor

    path = tmp_path / "b.wav"
    sf.write(path, _signal(1.2).numpy(), 24000)
    cut = Recording.from_file(path).to_cut()
    extractor = EncodecCodes(EncodecConfig(allow_random_weights=True))
    with NumpyFilesWriter(tmp_path / "feats") as storage:
        cut = cut.compute_and_store_features(extractor, storage)
    codes = cut.load_features()
    assert codes.shape == (90, 8) and codes.dtype == np.int16
    assert type(FeatureExtractor.from_dict(extractor.to_dict())) is EncodecCodes


def test_fit_frames_trims_or_repeats_the_last_frame():
    codes = np.arange(6, dtype=np.int16).reshape(3, 2)
    assert fit_frames(codes, 2).tolist() == [[0, 1], [2, 3]]
    assert fit_frames(codes, 5).tolist() == [[0, 1], [2, 3], [4, 5], [4, 5], [4, 5]]
