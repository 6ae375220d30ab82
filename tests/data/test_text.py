import pytest
import torch

from valle.data.symbols import SymbolTable
from valle.data.text import TextTokenCollater, TextTokenizer, split_phonemized


def test_tokenizer_keeps_punctuation_and_word_boundaries():
    tok = TextTokenizer()
    out = tok(["Hello, world!", "Two words."])
    assert len(out) == 2
    hello = out[0]
    assert hello[:4] == ["h", "ə", "l", "oʊ"]
    assert "," in hello and hello[-1] == "!"
    assert hello.count("_") == 1
    assert out[1][-1] == "."
    # cached backend: a second call gives the same answer
    assert tok(["Hello, world!"])[0] == hello
    assert tok([""]) == [[]]


def test_tokenizer_language_argument_and_switches():
    tok = TextTokenizer()
    fr = tok.phonemize_one("Bonjour", "fr-fr").symbols
    en = tok.phonemize_one("Bonjour").symbols
    assert fr != en
    assert set(tok._backends) == {"en-us", "fr-fr"}


def test_tone_and_length_marks_stay_inside_their_phoneme():
    # espeak's Mandarin writes retroflexes and tones with "." ('s.', 'ts.h', 'i.5'): never split.
    assert split_phonemized("w|o2_s.|i.5_ts.h|a1") == ["w", "o2", "_", "s.", "i.5", "_", "ts.h", "a1"]
    symbols = TextTokenizer().phonemize_one("我是中国人。四十。", "cmn").symbols
    assert "s." in symbols and "i.5" in symbols
    # the only "." symbols are the two full stops (the CJK "。" becomes ".")
    assert symbols.count(".") == 2 and symbols[-1] == "."


def test_collater_pads_and_adds_bos_eos():
    table = SymbolTable.from_symbols({"a", "b", "c"})
    col = TextTokenCollater(table)
    tokens, lens = col([["a", "b", "c"], ["b"]])
    a, b, c = (table.get(s) for s in "abc")
    assert tokens.dtype == torch.long and tokens.shape == (2, 5)
    assert tokens[0].tolist() == [col.bos_id, a, b, c, col.eos_id]
    assert tokens[1].tolist() == [col.bos_id, b, col.eos_id, col.pad_id, col.pad_id]
    assert lens.tolist() == [5, 3]
    plain, plain_lens = TextTokenCollater(table, add_bos=False, add_eos=False)([["a"], ["a", "b"]])
    assert plain.tolist() == [[a, table.pad_id], [a, b]] and plain_lens.tolist() == [1, 2]


def test_collater_unknown_symbol_names_symbol_and_cut():
    col = TextTokenCollater(SymbolTable.from_symbols({"a"}))
    with pytest.raises(KeyError, match="'ʒ'.*cut-7"):
        col([["a"], ["a", "ʒ"]], ids=["cut-6", "cut-7"])
