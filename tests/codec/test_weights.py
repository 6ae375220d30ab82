"""One weight resolver for EnCodec and Vocos: a given file, the cache, a hash-checked
download, random weights only when asked, else one line naming the flags."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from valle.codec import encodec, vocos
from valle.codec.weights import HubRepoFile, PretrainedWeights, TorchHubFile, WeightsError


def test_encodec_download_is_hash_checked_into_the_hub_cache(tmp_path, monkeypatch):
    seen = {}

    def fake_download(url, dst, hash_prefix=None, progress=True):
        seen.update(url=url, hash_prefix=hash_prefix)
        open(dst, "wb").close()

    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    monkeypatch.setattr(torch.hub, "download_url_to_file", fake_download)
    assert encodec.resolve_encodec_weights() == tmp_path / "checkpoints" / "encodec_24khz-d7cc33bc.th"
    assert seen == {"url": "https://dl.fbaipublicfiles.com/encodec/v0/encodec_24khz-d7cc33bc.th",
                    "hash_prefix": "d7cc33bc"}


def test_a_failed_download_leaves_no_empty_file_and_names_the_flags(tmp_path, monkeypatch):
    def bad_hash(url, dst, hash_prefix=None, progress=True):
        open(dst, "wb").close()
        raise RuntimeError('invalid hash value (expected "d7cc33bc", got "0000")')

    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    monkeypatch.setattr(torch.hub, "download_url_to_file", bad_hash)
    with pytest.raises(encodec.EncodecWeightsError) as e:
        encodec.resolve_encodec_weights()
    message = str(e.value)
    assert "\n" not in message and "invalid hash value" in message
    assert "--encodec-checkpoint" in message and "--allow-random-encodec" in message
    assert not (tmp_path / "checkpoints" / "encodec_24khz-d7cc33bc.th").exists()
    assert encodec.resolve_encodec_weights(allow_random=True) is None


def test_a_given_file_wins_and_a_missing_one_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    given = tmp_path / "mine.th"
    given.write_bytes(b"x")
    assert encodec.resolve_encodec_weights(given, download=False) == given
    with pytest.raises(encodec.EncodecWeightsError, match="--encodec-checkpoint .*nope.th: no such file"):
        encodec.resolve_encodec_weights(tmp_path / "nope.th")
    with pytest.raises(FileNotFoundError, match="downloads disabled"):
        encodec.resolve_encodec_weights(download=False)


def test_the_cache_is_used_without_a_download(tmp_path, monkeypatch):
    def no_network(*a, **k):
        raise AssertionError("downloaded although the file was cached")

    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)
    cached = tmp_path / "checkpoints" / "encodec_24khz-d7cc33bc.th"
    cached.parent.mkdir()
    cached.write_bytes(b"weights")
    assert encodec.WEIGHTS.present() and encodec.resolve_encodec_weights() == cached


def _fake_hub(tmp_path: Path, content: bytes, blob_name: str | None = None):
    """hf_hub_download as the hub cache lays files out: a snapshot link to a blob named by
    the file's sha256 (``blob_name`` overrides it: a damaged download)."""
    def download(repo_id, filename, local_files_only=False, **kw):
        if local_files_only:
            raise FileNotFoundError("not cached")
        blob = tmp_path / "blobs" / (blob_name or hashlib.sha256(content).hexdigest())
        blob.parent.mkdir(exist_ok=True)
        blob.write_bytes(content)
        link = tmp_path / "snapshots" / filename
        link.parent.mkdir(exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(blob)
        return str(link)
    return download


def test_hub_download_is_checked_against_the_blob_hash(tmp_path, monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    weights = PretrainedWeights("Vocos", HubRepoFile("org/repo", "model.bin"), "--vocos-checkpoint",
                                "--allow-random-vocos", WeightsError)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", _fake_hub(tmp_path, b"good"))
    assert weights.resolve().read_bytes() == b"good"
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", _fake_hub(tmp_path, b"damaged", "ab" * 32))
    with pytest.raises(WeightsError, match="sha256 differs") as e:
        weights.resolve()
    assert "org/repo/model.bin" in str(e.value) and "--vocos-checkpoint" in str(e.value)


def test_both_codecs_use_the_one_resolver():
    assert isinstance(encodec.WEIGHTS.source, TorchHubFile)
    assert isinstance(vocos.WEIGHTS.source, HubRepoFile)
    assert issubclass(encodec.EncodecWeightsError, WeightsError)
    assert issubclass(vocos.VocosWeightsError, WeightsError)
