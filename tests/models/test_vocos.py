"""--decoder vocos: random-weight decoding, offline error, mel-rvq refused."""

import pytest
import torch

pytest.importorskip("vocos")

import valle.vocos_decoder as vd  # noqa: E402
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
    monkeypatch.setattr(vd, "_hub_cached", lambda: None)
    monkeypatch.setattr(vd, "_download", lambda: (None, "OSError: offline"))
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
