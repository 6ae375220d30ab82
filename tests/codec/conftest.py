"""Shared fixtures of the codec tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def random_audio_tokenizer():
    """EnCodec with seeded random weights (no download): the codes follow the input."""
    from valle.codec.encodec import AudioTokenizer

    return AudioTokenizer(allow_random_weights=True, seed=0, download=False)
