"""A Plachtaa/VALL-E-X checkpoint through bin/infer.py and the Synthesizer: its text frontend,
its language table, its .npz prompts, and codes equal to Plachtaa's own inference end to end.

The checkpoint and Plachtaa's outputs are tests/fixtures/vallex (see PROVENANCE.md there).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from valle.infer import InputError, Item, Synthesizer, build_parser, load_model, main, read_items
from valle.models import NUM_AUDIO_TOKENS
from valle.models.generation import DecodeOptions

for _module in ("tokenizers", "inflect", "unidecode", "eng_to_ipa", "cn2an", "jieba", "pypinyin", "langid"):
    pytest.importorskip(_module, reason="the vallex extra: pip install -e '.[vallex]'")

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vallex"


class RecordingCodec:
    """Codes in from the prompt's samples, out as 320 samples a frame; keeps what it decoded."""

    def __init__(self):
        self.decoded = []

    def encode(self, wav):
        frames = max(1, wav.shape[-1] // 320)
        return torch.arange(frames * 8).reshape(1, 8, frames) * 37 % NUM_AUDIO_TOKENS

    def decode(self, codes):  # (1, Q, T)
        self.decoded.append(codes)
        return torch.full((1, 1, codes.shape[-1] * 320), 0.1)


@pytest.fixture(scope="module")
def vallex(tmp_path_factory):
    """The tiny checkpoint as a user has the real one: the file and bpe_69.json side by side."""
    tmp = tmp_path_factory.mktemp("vallex")
    shutil.copy(FIXTURE / "vallex_tiny.pt", tmp / "vallex-checkpoint.pt")
    shutil.copy(FIXTURE / "bpe_69.json", tmp / "bpe_69.json")
    model, config = load_model(tmp / "vallex-checkpoint.pt")
    return tmp, model, config


def write_prompt(path: Path, codes: torch.Tensor, text_ids, lang_code: int) -> Path:
    """A prompt file as VALL-E X's make_prompt writes it."""
    np.savez(path, audio_tokens=codes.numpy().astype(np.int64), text_tokens=np.array([text_ids]),
             lang_code=np.array([lang_code]))  # fmt: skip
    return path


def test_the_checkpoint_names_its_frontend_and_languages(vallex):
    _, model, config = vallex
    assert config["text_frontend"] == "vallex-bpe" and config["languages"] == ["en", "zh", "ja"]
    assert model.num_languages == 3


def test_text_and_languages_from_the_vallex_frontend(vallex, tmp_path):
    tmp, model, config = vallex
    synth = Synthesizer(model, tmp / "bpe_69.json", RecordingCodec(), "cpu", language="zh",
                        prompt_language="en-us", checkpoint_config=config)  # fmt: skip
    prompt_wav = tmp_path / "p.wav"
    import soundfile as sf

    sf.write(prompt_wav, np.zeros(24000, dtype=np.float32), 24000)
    unit = synth.prepare(Item("Hello there.", str(prompt_wav), "你好。", tmp_path / "o.wav", "item 0"))
    prompt_ids, _ = synth.text_tokenizer.encode("Hello there.", "en")
    text_ids, _ = synth.text_tokenizer.encode("你好。", "zh")
    # VALL-E X's layout: the prompt's ids then the text's, no BOS/EOS
    assert unit.text.tolist() == prompt_ids + text_ids and unit.prompt_text_len == len(prompt_ids)
    # by the model's table: en 0 for the prompt, zh 1 for the text
    assert unit.text_languages.tolist() == [0] * len(prompt_ids) + [1] * len(text_ids)
    # tagged mixed text: each token in its span's language
    synth = Synthesizer(model, tmp / "bpe_69.json", RecordingCodec(), "cpu", language="mix",
                        prompt_language="en", checkpoint_config=config)  # fmt: skip
    unit = synth.prepare(Item("", str(prompt_wav), "[EN]OK.[EN][ZH]好[ZH]", tmp_path / "o.wav", "m"))
    ok, _ = synth.text_tokenizer.encode("OK.", "en")
    assert unit.prompt_text_len == 0
    assert unit.text_languages.tolist() == [0] * len(ok) + [1] * (unit.text.numel() - len(ok))


def test_npz_prompt_decodes_as_plachtaa(vallex, tmp_path, monkeypatch):
    """Their prompt file (lang_code numbered zh 0, ja 1, en 2) + a text -> the codes their
    VALLE.inference gave for the same ids and languages."""
    tmp, model, config = vallex
    e = torch.load(FIXTURE / "expected.pt")
    ids = e["text"][0].tolist()
    prompt = write_prompt(tmp_path / "speaker.npz", e["prompt"], ids[: e["enroll_x_lens"]], lang_code=2)
    codec = RecordingCodec()
    synth = Synthesizer(model, tmp / "bpe_69.json", codec, "cpu", language="zh", checkpoint_config=config)
    # The text's ids as the fixture has them (random ids: no text gives them), in Mandarin.
    text_ids = ids[e["enroll_x_lens"] :]
    monkeypatch.setattr(synth.text_tokenizer, "encode", lambda text, lang: (text_ids, ["zh"] * len(text_ids)))
    item = Item("", str(prompt), "你好", tmp_path / "o.wav", "item 0")
    unit = synth.prepare(item)
    assert unit.text.tolist() == ids and unit.text_languages.tolist() == [0] * 5 + [1] * 8
    assert torch.equal(unit.prompt, e["prompt"][0])
    [wav] = synth.synthesize([item], options=DecodeOptions(top_k=1))
    expected = e["en_prompt_zh_text"]["codes"]
    assert torch.equal(codec.decoded[0], expected[0].T.unsqueeze(0))
    assert wav.numel() == expected.shape[1] * 320


def test_bin_infer_with_the_public_layout(vallex, tmp_path, monkeypatch):
    tmp, _, _ = vallex
    import valle.codec as codec

    monkeypatch.setattr(codec, "codec_for_checkpoint", lambda *a, **k: RecordingCodec())
    e = torch.load(FIXTURE / "expected.pt")
    prompt = write_prompt(tmp_path / "speaker.npz", e["prompt"], e["text"][0, :5].tolist(), lang_code=0)
    rc = main(["--checkpoint", str(tmp / "vallex-checkpoint.pt"), "--audio-prompts", str(prompt),
               "--text", "Hello, world!", "--language", "en", "--output-dir", str(tmp_path),
               "--top-k", "1", "--max-len-ratio", "1", "--device", "cpu"])  # fmt: skip
    assert rc == 0 and (tmp_path / "0.wav").is_file()
    # the vocabulary elsewhere: --bpe-vocab; missing: one line naming the file and the flag
    elsewhere = tmp_path / "vocab" / "bpe.json"
    elsewhere.parent.mkdir()
    shutil.copy(tmp / "bpe_69.json", elsewhere)
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(tmp / "vallex-checkpoint.pt", lone / "vallex-checkpoint.pt")
    argv = ["--checkpoint", str(lone / "vallex-checkpoint.pt"), "--audio-prompts", str(prompt),
            "--text", "你好", "--language", "zh", "--output-dir", str(tmp_path / "out"),
            "--top-k", "1", "--max-len-ratio", "1", "--device", "cpu"]  # fmt: skip
    assert main(argv) == 2
    assert main(argv + ["--bpe-vocab", str(elsewhere)]) == 0 and (tmp_path / "out" / "0.wav").is_file()


def test_npz_prompts_need_no_transcript_and_bad_ones_are_named(vallex, tmp_path):
    tmp, model, config = vallex
    args = build_parser().parse_args(["--checkpoint", "x", "--audio-prompts", "a.npz", "--text", "hi"])
    [item] = read_items(args)
    assert item.prompt_wavs == ["a.npz"] and item.prompt_text == ""
    synth = Synthesizer(model, tmp / "bpe_69.json", RecordingCodec(), "cpu", language="en",
                        checkpoint_config=config)  # fmt: skip
    bad = tmp_path / "bad.npz"
    np.savez(bad, audio_tokens=np.zeros((1, 4, 8), dtype=np.int64))
    with pytest.raises(InputError, match=r"item 0: prompt file .*bad.npz lacks text_tokens, lang_code"):
        synth.prepare(Item("", str(bad), "hi", tmp_path / "o.wav", "item 0"))
    odd = write_prompt(tmp_path / "odd.npz", torch.zeros(1, 4, 8, dtype=torch.long), [5], lang_code=7)
    with pytest.raises(InputError, match="lang_code 7"):
        synth.prepare(Item("", str(odd), "hi", tmp_path / "o.wav", "item 0"))
    with pytest.raises(InputError, match="--language fr: this VALL-E X checkpoint reads en, zh, ja"):
        Synthesizer(model, tmp / "bpe_69.json", RecordingCodec(), "cpu", language="fr",
                    checkpoint_config=config)  # fmt: skip


def test_decoder_auto_takes_vocos_for_vallex_where_its_weights_are_on_disk(vallex, monkeypatch, caplog):
    import logging

    import valle.codec.vocos as vocos
    import valle.infer as infer

    _, _, config = vallex
    args = build_parser().parse_args(["--checkpoint", "x"])
    assert args.decoder == "auto"
    built = []
    monkeypatch.setattr(infer, "build_vocos", lambda config, device, weights, args: built.append(weights) or "vocos")
    monkeypatch.setattr(vocos, "resolve_vocos_weights", lambda path, allow_random, download=True: (
        Path("/cache/vocos.bin") if not download else pytest.fail("auto must not download")))  # fmt: skip
    assert infer.auto_vocos(config, "cpu", args) == "vocos" and built == [Path("/cache/vocos.bin")]
    assert infer.auto_vocos({"languages": ["en"]}, "cpu", args) is None  # not VALL-E X: EnCodec

    def absent(path, allow_random, download=True):
        raise vocos.VocosWeightsError("Vocos weights are not in the hub cache")

    monkeypatch.setattr(vocos, "resolve_vocos_weights", absent)
    with caplog.at_level(logging.INFO):
        assert infer.auto_vocos(config, "cpu", args) is None
    assert "decoding with EnCodec's decoder: Vocos" in caplog.text and "not in the hub cache" in caplog.text


def test_accent_gives_every_text_token_one_language(vallex, tmp_path):
    tmp, model, config = vallex
    prompt = write_prompt(tmp_path / "p.npz", torch.zeros(1, 4, 8, dtype=torch.long), [16, 21], lang_code=2)
    item = Item("", str(prompt), "Hello.", tmp_path / "o.wav", "item 0")
    plain, accented = (
        Synthesizer(model, tmp / "bpe_69.json", RecordingCodec(), "cpu", language="en",
                    checkpoint_config=config, accent=accent).prepare(item)
        for accent in (None, "zh")
    )  # fmt: skip
    assert torch.equal(plain.text, accented.text)
    assert plain.text_languages.tolist() == [0] * plain.text.numel()
    assert accented.text_languages.tolist() == [0, 0] + [1] * (plain.text.numel() - 2)
    with pytest.raises(InputError, match="--accent mix: one of en, zh, ja"):
        Synthesizer(model, tmp / "bpe_69.json", RecordingCodec(), "cpu", checkpoint_config=config,
                    accent="mix")  # fmt: skip


@pytest.mark.timeout(300)
def test_the_page_takes_npz_prompts_without_a_transcript(vallex, tmp_path, monkeypatch):
    """An example .npz prompt is listed with nothing to play, and synthesises with no transcript;
    an uploaded .npz is read as bin/infer.py reads it (a bad one refused on the prompt field)."""
    from fastapi.testclient import TestClient

    import valle.codec as codec
    from valle.serve.cli import create_app_from_args, parse_args

    tmp, _, _ = vallex
    monkeypatch.setattr(codec, "codec_for_checkpoint", lambda *a, **k: RecordingCodec())
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    e = torch.load(FIXTURE / "expected.pt")
    prompt = write_prompt(prompts / "speaker.npz", e["prompt"], e["text"][0, :5].tolist(), lang_code=2)
    argv = ["--checkpoint", str(tmp / "vallex-checkpoint.pt"), "--prompt-dir", str(prompts),
            "--results-dir", str(tmp_path / "results"), "--top-k", "1", "--max-len-ratio", "1",
            "--device", "cpu", "--language", "en"]  # fmt: skip
    client = TestClient(create_app_from_args(*parse_args(argv)), raise_server_exceptions=False)
    options = client.get("/api/options").json()
    assert options["prompts"] == [{"name": "speaker.npz", "transcript": "", "url": None}]
    checkpoint = options["checkpoints"][0]["id"]
    form = {"checkpoint": checkpoint, "text": "Hello, world!", "prompt_text": ""}
    response = client.post("/api/synthesize", data={**form, "prompt_name": "speaker.npz"})
    assert response.status_code == 200, response.text
    assert client.get(response.json()["wav_url"]).content[:4] == b"RIFF"
    uploaded = client.post("/api/synthesize", data=form,
                           files={"prompt": ("mine.npz", prompt.read_bytes(), "application/octet-stream")})
    assert uploaded.status_code == 200, uploaded.text
    bad = client.post("/api/synthesize", data=form,
                      files={"prompt": ("bad.npz", b"not an npz", "application/octet-stream")})
    assert bad.status_code == 400 and bad.json()["field"] == "prompt" and "bad.npz" in bad.json()["error"]
