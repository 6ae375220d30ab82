"""bin/evaluate.py on multilingual rows (VALL-E X): a TSV names each row's text and prompt
languages, each text is phonemized in its own language, and PER is summed per language."""

from __future__ import annotations

import math

import torch

from valle.eval.evaluate import (
    Row,
    RowResult,
    Scores,
    Tools,
    format_table,
    read_rows_tsv,
    row_languages,
    summarize,
)


def test_a_header_names_each_rows_languages(tmp_path):
    tsv = tmp_path / "eval.tsv"
    tsv.write_text("prompt_text\tprompt_wav\ttext\tout_wav\tlanguage\tprompt_language\n"
                   "你好\tzh.wav\tHello.\ta.wav\ten-us\tcmn\n"
                   "Hi.\ten.wav\t谢谢\tb.wav\tcmn\ten-us\n", encoding="utf-8")
    rows = read_rows_tsv(tsv, tmp_path)
    assert [(r.language, r.prompt_language) for r in rows] == [("en-us", "cmn"), ("cmn", "en-us")]
    assert rows[0].out_wav == str(tmp_path / "a.wav")


def test_rows_without_languages_take_the_runs_flags():
    tools = Tools(judge=None, phonemize=None, language="cmn", prompt_language="en-us")
    assert row_languages(tools, Row("r", "谢谢", "p.wav", "o.wav")) == ("cmn", "en-us")
    assert row_languages(Tools(judge=None, phonemize=None, language="cmn"), Row("r", "t", "p", "o")) == ("cmn", "cmn")
    assert row_languages(tools, Row("r", "t", "p", "o", language="en-us", prompt_language="cmn")) == ("en-us", "cmn")


def _result(edits: int, phonemes: int) -> RowResult:
    return RowResult(Row("r", "t", "p", "o"), Scores(per=edits / phonemes, edits=edits, ref_phonemes=phonemes))


def test_per_is_summed_per_language_and_printed_a_row_each():
    results = [_result(1, 10), _result(3, 10), _result(5, 20)]
    summary = summarize(results, ["en-us", "en-us", "cmn"])
    assert summary["output"]["per"] == 9 / 40
    assert summary["per_language"]["en-us"]["output"]["per"] == 4 / 20
    assert summary["per_language"]["en-us"]["output"]["rows"] == 2
    assert summary["per_language"]["cmn"]["output"]["per"] == 5 / 20
    summary["output"].update(duration_ratio=math.nan, hit_length_cap=0.0)
    table = format_table(results, summary)
    assert "cmn            |    1 | 0.250 | -" in table and "en-us          |    2 | 0.200 | -" in table
    # one language: no per-language block (the aggregate says it all)
    assert "per_language" not in summarize(results, ["en-us"] * 3)


def test_rows_are_phonemized_in_their_language(tmp_path):
    import soundfile as sf

    from valle.data.text import TextTokenizer
    from valle.eval.evaluate import evaluate_row
    from valle.eval.per import spoken

    class SilentJudge:
        def transcribe(self, wavs):
            return [[] for _ in wavs]

    for name in ("p.wav", "o.wav"):
        sf.write(tmp_path / name, torch.zeros(4800).numpy(), 24000)
    tt = TextTokenizer()
    tools = Tools(judge=SilentJudge(), phonemize=lambda text, lang: tt([text], language=lang)[0])
    row = Row("r", "我们回家", str(tmp_path / "p.wav"), str(tmp_path / "o.wav"), prompt_text="The cat.",
              language="cmn", prompt_language="en-us")
    result = evaluate_row(tools, row, references=False)
    assert result.output.ref_phonemes == len(spoken(tt.phonemize_one("我们回家", "cmn").symbols))
    assert result.output.per == 1.0
