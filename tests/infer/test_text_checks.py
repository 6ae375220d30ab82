"""Issue #42: bin/infer.py refuses, per item, text its language cannot read and text longer than
the checkpoint takes in one piece; the other items of the batch are still written."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models_testlib import tiny_model

from valle.infer_checks import DEFAULT_TRAINING_SECONDS, length_problem, script_problem, text_limit
from valle.models import NUM_AUDIO_TOKENS

PROMPT_TEXT = "the quick brown fox"
SENTENCES = ["jumps over the dog.", "the dog jumps."]


def _phonemes(text: str) -> list[str]:
    from valle.data.text import TextTokenizer

    return TextTokenizer(language="en-us")([text])[0]


def _save(model, config: dict, path) -> None:
    torch.save({"format": "valle-checkpoint-1", "model": model.state_dict(), "config": config}, path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny checkpoint whose config allows the longest of SENTENCES and not both at once."""
    sf = pytest.importorskip("soundfile")
    from valle.data.symbols import SymbolTable

    tmp = tmp_path_factory.mktemp("infer-checks")
    table = tmp / "unique_text_tokens.k2symbols"
    SymbolTable.from_symbols(sorted(set(_phonemes(PROMPT_TEXT + " " + " ".join(SENTENCES))))).to_file(table)
    model = tiny_model("valle", 1, share_embedding=False)
    with torch.no_grad():  # EOS logit 0 against 1024 random ones: greedy decoding runs to the cap
        model.ar_predict_layer.weight[NUM_AUDIO_TOKENS] = 0.0
    longest = max(len(_phonemes(s)) for s in SENTENCES)
    assert len(_phonemes(" ".join(SENTENCES))) > longest
    ckpt = tmp / "checkpoint.pt"
    _save(model, dict(model.hparams, text_tokens=str(table), max_text_tokens=longest), ckpt)
    prompt = tmp / "prompt.wav"
    sf.write(str(prompt), np.random.default_rng(0).uniform(-0.3, 0.3, 24000).astype(np.float32), 24000)
    return tmp, ckpt, prompt


def _argv(ckpt, prompt, out, text: str, *extra: str) -> list[str]:
    return ["--checkpoint", str(ckpt), "--text-prompts", PROMPT_TEXT, "--audio-prompts", str(prompt),
            "--text", text, "--output-dir", str(out), "--top-k", "1", "--max-len-ratio", "1",
            "--device", "cpu", "--allow-random-encodec", *extra]  # fmt: skip


@pytest.mark.timeout(300)
def test_an_item_in_a_script_its_language_cannot_read_fails_alone(setup, capsys):
    from valle.infer import main

    tmp, ckpt, prompt = setup
    out = tmp / "batch"
    texts = [SENTENCES[0], "你好世界，今天天气很好。", "Привет", SENTENCES[1]]
    assert main(_argv(ckpt, prompt, out, "|".join(texts), "--batch-size", "2")) == 1
    err = capsys.readouterr().err
    assert "2 item(s) gave no audio (2 written)" in err
    assert "item 1: the text has Han letters ('你好世界今天气很') that the en-us voice cannot read" in err
    assert "languages that can: cmn" in err
    assert "item 2: the text has Cyrillic letters ('Привет')" in err and "can: ru, uk" in err
    assert sorted(p.name for p in out.iterdir()) == ["0.wav", "3.wav"]


@pytest.mark.timeout(300)
def test_a_prompt_transcript_its_language_cannot_read_is_named(setup, capsys):
    from valle.infer import main

    tmp, ckpt, prompt = setup
    argv = _argv(ckpt, prompt, tmp / "prompt-script", SENTENCES[0], "--prompt-language", "cmn")
    assert main(argv) == 1
    assert "item 0: the prompt's transcript has Latin letters" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_a_text_past_the_checkpoints_limit_asks_for_sentence_splitting(setup, capsys):
    import soundfile as sf

    from valle.infer import main

    tmp, ckpt, prompt = setup
    whole = " ".join(SENTENCES)
    assert main(_argv(ckpt, prompt, tmp / "long", whole)) == 1
    err = capsys.readouterr().err
    assert f"item 0: the text is {len(_phonemes(whole))} text tokens long" in err
    assert "--max-text-tokens" in err and "turn on sentence splitting (bin/infer.py --split-sentences)" in err
    assert not (tmp / "long" / "0.wav").exists()
    # the way forward works: sentence by sentence, each fits
    assert main(_argv(ckpt, prompt, tmp / "split", whole, "--split-sentences")) == 0
    assert sf.info(str(tmp / "split" / "0.wav")).duration > 0


def test_limit_comes_from_the_training_config():
    assert text_limit({}).max_tokens == 625  # 20 s (the default) x 1.25 x 25 text tokens/s
    assert DEFAULT_TRAINING_SECONDS == 20.0
    short = text_limit({"filter_max_duration": 4.0, "max_text_tokens": 1000})
    assert short.max_tokens == 125 and "--filter-max-duration 4 s" in short.source
    budget = text_limit({"filter_max_duration": 20.0, "max_text_tokens": 300})
    assert budget.max_tokens == 300 and "--max-text-tokens 300" in budget.source
    assert text_limit({"max_text_tokens": None}).max_tokens == 625  # "off": the length alone
    assert length_problem(625, text_limit({}), False) is None
    split = length_problem(626, text_limit({}), True)
    assert split.field == "text" and "shorten this sentence" in split.message


@pytest.mark.parametrize(
    "text, language, model_languages, expected",
    [
        ("hello there, café", "en-us", None, None),
        ("42 + 7 = 49!", "cmn", None, None),  # digits and marks are read in any script
        ("你好", "cmn", None, None),
        ("日本語のテキスト", "ja", None, None),
        ("pin1 yin1", "cmn-latn-pinyin", None, None),
        ("你好", "en-us", None, "Han letters ('你好')"),
        ("我叫John", "cmn", None, "Latin letters ('John') that the cmn voice"),
        ("我叫John", "cmn", ["en-us", "cmn"], "languages that can: en-us"),
        ("Привет", "en-us", ["en-us", "cmn"], "none of this checkpoint's languages can"),
        ("안녕 Привет", "fr-fr", None, "Hangul letters ('안녕') that the fr-fr voice cannot read as "
                                       "words (eSpeak would spell them out); languages that can: ko; "
                                       "and Cyrillic letters"),
        ("ＡＢＣ", "cmn", None, "Latin letters ('ＡＢＣ')"),  # full-width Latin is Latin
    ],
)
def test_script_problem_names_the_script_and_who_can_say_it(text, language, model_languages, expected):
    problem = script_problem(text, language, "text", model_languages)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and problem.field == "text" and expected in problem.message


def test_auto_segments_split_a_sentence_by_script():
    from valle.data.scripts import script_runs
    from valle.infer_checks import Segment, TextProblem, auto_segments

    text = "我叫John，你好。"
    assert "".join(piece for _, piece in script_runs(text)) == text
    every = lambda piece, language: True  # noqa: E731
    assert auto_segments(text, ["en-us", "cmn"], every) == [
        Segment("我叫", "cmn"), Segment("John，", "en-us"), Segment("你好。", "cmn")]  # fmt: skip
    # no model languages: the common voices of each script, the first the table covers
    only_yue = lambda piece, language: language in ("en-us", "yue")  # noqa: E731
    assert auto_segments("Hello 你好", None, only_yue) == [Segment("Hello ", "en-us"), Segment("你好", "yue")]
    assert auto_segments("12, 34.", ["cmn", "en-us"], every) == [Segment("12, 34.", "cmn")]
    refused = auto_segments("Привет", ["en-us", "cmn"], every)
    assert isinstance(refused, TextProblem) and "none of this checkpoint's languages reads it" in refused.message
    refused = auto_segments("你好", None, lambda piece, language: False, "prompt_text")
    assert refused.field == "prompt_text"
    assert "none of the languages that read it (cmn, yue, hak, ja, ko) has phonemes" in refused.message
