"""--decoder vocos: valle's own Vocos equals the vocos package (directly where it imports,
else through the fixture it wrote); random-weight decoding, offline error, mel-rvq refused."""

import json

import pytest
import torch

import valle.codec.vocos as vd
from tests.support import codec_reference as ref
from valle.infer import InputError, build_parser, build_vocos, decode_codes, resolve_vocos

FIXTURE = json.loads(ref.VOCOS_FIXTURE.read_text())


def test_random_vocos_decodes_codes_to_24k_of_the_right_length(caplog):
    decoder = vd.VocosDecoder("cpu", allow_random_weights=True, download=False)
    assert "RANDOM" in caplog.text
    codes = torch.randint(0, 1024, (1, 40, 8))
    wav = decode_codes(codes[0], {}, audio_tokenizer=None, decoder=decoder)
    assert wav.dim() == 1 and wav.dtype == torch.float32
    assert wav.numel() == 40 * 24000 // 75  # 320 samples per EnCodec frame
    assert torch.isfinite(wav).all() and wav.abs().sum() > 0
    with pytest.raises(ValueError, match="codebooks"):
        decoder.decode(torch.randint(0, 1024, (40, 3)))


def test_offline_error_names_the_flag_before_any_work(monkeypatch):
    import huggingface_hub

    def offline(repo_id, filename, local_files_only=False, **kw):
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    args = build_parser().parse_args(["--decoder", "vocos", "--checkpoint", "x.pt", "--text", "a"])
    with pytest.raises(InputError, match="--vocos-checkpoint") as e:
        resolve_vocos(args)
    assert "\n" not in str(e.value) and "--allow-random-vocos" in str(e.value)
    with pytest.raises(InputError, match="--vocos-checkpoint /nope.bin: no such file"):
        resolve_vocos(build_parser().parse_args(
            ["--decoder", "vocos", "--vocos-checkpoint", "/nope.bin", "--checkpoint", "x.pt", "--text", "a"]))
    random_args = build_parser().parse_args(
        ["--decoder", "vocos", "--allow-random-vocos", "--checkpoint", "x.pt", "--text", "a"])
    assert resolve_vocos(random_args) is None


def test_mel_rvq_corpus_refuses_vocos(monkeypatch):
    import valle.codec

    monkeypatch.setattr(valle.codec, "find_codec_record", lambda config: ({"codec": "mel-rvq"}, None))
    args = build_parser().parse_args(["--decoder", "vocos", "--checkpoint", "x.pt", "--text", "a"])
    with pytest.raises(InputError, match="mel-rvq.*--decoder encodec"):
        build_vocos({}, "cpu", None, args)


def _seeded_weights(tmp_path, config_yaml: str | None = None):
    """Seeded weights in the published pytorch_model.bin layout, built by our own model."""
    ours = vd.VocosDecoder("cpu", allow_random_weights=True, download=False)
    state = {("feature_extractor.codebook_weights" if k == "codebook_weights" else k): v
             for k, v in ours.state_dict().items()}
    ref.fill_seeded(state)
    path = tmp_path / "pytorch_model.bin"
    torch.save(state, path)
    if config_yaml is not None:
        (tmp_path / "config.yaml").write_text(config_yaml)
    return path


@pytest.mark.smoke
def test_decodes_as_the_vocos_package_did(tmp_path):
    """The published layout's keys, and the audio the package decoded from these seeded
    weights and codes (the fixture), within float rounding."""
    path = _seeded_weights(tmp_path)
    published = torch.load(path, weights_only=True)
    assert {k: list(v.shape) for k, v in published.items()} == FIXTURE["state_dict_shapes"]
    got = vd.VocosDecoder("cpu", checkpoint=path, download=False).decode(ref.fixture_codes())
    assert got.numel() == FIXTURE["num_samples"] == 40 * 320
    head = torch.tensor(FIXTURE["audio_head"])
    torch.testing.assert_close(got[: head.numel()], head, rtol=1e-4, atol=1e-4 * head.abs().max().item())
    assert got.abs().mean().item() == pytest.approx(FIXTURE["audio_abs_mean"], rel=1e-4)


CONFIG = """feature_extractor:
  class_path: vocos.feature_extractors.EncodecFeatures
  init_args: {encodec_model: encodec_24khz, bandwidths: [1.5, 3.0, 6.0, 12.0], train_codebooks: false}
backbone:
  class_path: vocos.models.VocosBackbone
  init_args: {input_channels: 128, dim: 384, intermediate_dim: 1152, num_layers: 8, adanorm_num_embeddings: 4}
head:
  class_path: vocos.heads.ISTFTHead
  init_args: {dim: 384, n_fft: 1280, hop_length: 320, padding: same}
"""


def test_config_yaml_beside_the_weights_is_read_and_other_vocoders_refused(tmp_path):
    path = _seeded_weights(tmp_path, CONFIG)
    assert vd.VocosDecoder("cpu", checkpoint=path).config == vd.VocosConfig()
    (tmp_path / "config.yaml").write_text(CONFIG.replace("num_layers: 8", "num_layers: 4"))
    with pytest.raises(vd.VocosWeightsError, match="pytorch_model.bin: not a charactr/vocos-encodec-24khz"):
        vd.VocosDecoder("cpu", checkpoint=path)  # 4 layers configured, 8 in the file
    (tmp_path / "config.yaml").write_text(CONFIG.replace("EncodecFeatures", "MelSpectrogramFeatures"))
    with pytest.raises(vd.VocosWeightsError, match="config.yaml: feature_extractor is .*MelSpectrogramFeatures"):
        vd.VocosDecoder("cpu", checkpoint=path)
    # bin/infer.py and the page: one line, not a traceback
    args = build_parser().parse_args(["--decoder", "vocos", "--vocos-checkpoint", str(path), "--checkpoint", "x.pt",
                                      "--text", "a"])
    with pytest.raises(InputError, match="MelSpectrogramFeatures"):
        build_vocos({}, "cpu", path, args)


def test_decodes_as_the_vocos_package_does(tmp_path):
    """Against the package itself (the ref extra): its model, its state dict, its decode."""
    pytest.importorskip("vocos", reason="the vocos package (pip install .[ref]) is the reference")
    reference = ref.vocos_package_model(seed=5)
    weights = tmp_path / "pytorch_model.bin"
    torch.save(ref.vocos_published_state(reference), weights)
    ours = vd.VocosDecoder("cpu", checkpoint=weights, download=False)
    for q in (2, 8, 16):
        codes = ref.fixture_codes(seed=q, frames=30, q=q)  # (T, Q) as the model writes them
        expected = ref.vocos_package_decode(reference, codes)
        got = ours.decode(codes)
        assert got.shape == expected.shape == (30 * 320,)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
