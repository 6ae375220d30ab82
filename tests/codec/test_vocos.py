"""--decoder vocos: random-weight decoding, offline error, mel-rvq refused."""

import pytest
import torch

pytest.importorskip("vocos")

import valle.codec.vocos as vd  # noqa: E402
from valle.infer import InputError, build_parser, build_vocos, decode_codes, resolve_vocos  # noqa: E402


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


def test_published_layout_loads_and_decodes_as_vocos_does(tmp_path, monkeypatch):
    """A state dict in charactr/vocos-encodec-24khz's layout (what the hub's pytorch_model.bin
    holds: feature_extractor.codebook_weights, backbone.*, head.*), made by the vocos package's
    own classes with random weights, loads through --vocos-checkpoint and decodes exactly as
    vocos's Vocos.decode(codes_to_features(codes)) does."""
    import encodec
    from vocos import Vocos
    from vocos.feature_extractors import EncodecFeatures
    from vocos.heads import ISTFTHead
    from vocos.models import VocosBackbone

    offline_encodec = encodec.EncodecModel.encodec_model_24khz
    monkeypatch.setattr(encodec.EncodecModel, "encodec_model_24khz",
                        staticmethod(lambda pretrained=True, **kw: offline_encodec(pretrained=False, **kw)))
    torch.manual_seed(3)
    reference = Vocos(
        feature_extractor=EncodecFeatures("encodec_24khz", bandwidths=[1.5, 3.0, 6.0, 12.0]),
        backbone=VocosBackbone(input_channels=128, dim=384, intermediate_dim=1152, num_layers=8,
                               adanorm_num_embeddings=4),
        head=ISTFTHead(dim=384, n_fft=1280, hop_length=320, padding="same")).eval()
    # An untrained EnCodec's codebooks are zeros (k-means fills them): make them matter.
    reference.feature_extractor.codebook_weights.data.normal_()
    published = {k: v for k, v in reference.state_dict().items()
                 if not k.startswith("feature_extractor.encodec.")}
    weights = tmp_path / "pytorch_model.bin"
    torch.save(published, weights)

    ours = vd.VocosDecoder("cpu", checkpoint=weights, download=False)
    codes = torch.randint(0, 1024, (30, 8))  # (T, Q) as the model writes them
    with torch.inference_mode():
        expected = reference.decode(reference.codes_to_features(codes.T),
                                    bandwidth_id=torch.tensor([2])).reshape(-1)
    got = ours.decode(codes)
    assert got.shape == expected.shape == (30 * 320,)
    assert expected.abs().max() > 0
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
