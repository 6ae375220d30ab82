"""valle.infer in-process with a fake codec: batches with a failing row, languages, prompts,
sentences, flags, checkpoint selection, lifeiteng checkpoints end to end."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from models_testlib import tiny_model

from valle.infer import (
    Failure,
    InputError,
    Item,
    Synthesizer,
    build_parser,
    decode_options,
    load_model,
    main,
    read_items,
    select_checkpoint,
    split_sentences,
    synthesize_items,
)
from valle.models import NUM_AUDIO_TOKENS
from valle.models.generation import DecodeOptions

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "lifeiteng"
TEXTS = [
    "the dog",
    "a fox",
    "the quick fox",
    "dog",
    "a brown dog",
    "the fox jumps",
    "jumps",
    "quick",
]


class FakeCodec:
    """75 frames per second of audio; codes from the samples; decode gives 320 samples a frame."""

    def encode(self, wav):
        frames = max(1, wav.shape[-1] // 320)
        return torch.arange(frames * 8).reshape(1, 8, frames) * 37 % NUM_AUDIO_TOKENS

    def decode(self, codes):  # (1, Q, T)
        return torch.full((1, 1, codes.shape[-1] * 320), 0.1)


def _phonemes(texts, language="en-us"):
    from valle.data.text import TextTokenizer

    return {s for t in texts for s in TextTokenizer(language=language)([t])[0]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    sf = pytest.importorskip("soundfile")
    import numpy as np

    from valle.data.symbols import SymbolTable
    from valle.data.text import WORD_SEP

    tmp = tmp_path_factory.mktemp("synth")
    symbols = _phonemes(TEXTS + ["the dog. a fox!"]) | _phonemes(["你好"], "cmn") | {WORD_SEP}
    table = tmp / "unique_text_tokens.k2symbols"
    SymbolTable.from_symbols(sorted(symbols)).to_file(table)
    prompt = tmp / "prompt.wav"
    sf.write(
        str(prompt), np.random.default_rng(0).uniform(-0.3, 0.3, 4800).astype(np.float32), 24000
    )
    return tmp, table, prompt


def _args(tmp: Path, **over) -> argparse.Namespace:
    argv = ["--checkpoint", "x", "--output-dir", str(tmp), "--top-k", "1", "--max-len-ratio", "1"]
    for k, v in over.items():
        argv += [k] if v is True else [k, str(v)]
    return build_parser().parse_args(argv)


def test_batch_of_8_with_one_degenerate_row(setup, tmp_path):
    _, table, prompt = setup
    model = tiny_model("valle", 1).eval()
    original, step = model.ar_logits, {"n": 0}

    def eos_first_for_row_5(h):
        logits = original(h)
        if step["n"] == 0:
            logits[5, NUM_AUDIO_TOKENS] = 1e4  # row 5 says EOS at once
        step["n"] += 1
        return logits

    model.ar_logits = eos_first_for_row_5
    synth = Synthesizer(model, table, FakeCodec(), "cpu")
    items = [
        Item("the dog", str(prompt), t, tmp_path / f"{i}.wav", f"item {i}")
        for i, t in enumerate(TEXTS)
    ]
    result = synthesize_items(synth, items, _args(tmp_path, **{"--batch-size": 8}))
    assert step["n"] > 1  # one batch of 8 decoded together
    assert result.failures == [Failure("item 5", result.failures[0].reason)]
    assert "EOS as its first token" in result.failures[0].reason
    assert sorted(p.name for p in result.written) == [f"{i}.wav" for i in range(8) if i != 5]
    assert not (tmp_path / "5.wav").exists()


class VectorCodec(FakeCodec):
    """FakeCodec with code vectors (every code far from the others, code 3 at the origin);
    records the codes it decodes."""

    def __init__(self):
        self.decoded = []

    def code_vectors(self):
        table = 10.0 * torch.eye(NUM_AUDIO_TOKENS)
        table[3] = 0.0
        return [table] * 8

    def decode(self, codes):
        self.decoded.append(codes)
        return super().decode(codes)


@pytest.mark.parametrize("continual", [False, True])
def test_nar_decoding_mmse_uses_the_codecs_code_vectors(setup, tmp_path, continual):
    _, table, prompt = setup
    model = tiny_model("valle", 1).eval()
    sharp = model.nar_head
    model.nar_head = lambda h, stage: sharp(h, stage) * 0.01  # unsure everywhere
    items = [Item("the dog", str(prompt), t, tmp_path / f"{i}.wav", f"item {i}")
             for i, t in enumerate(TEXTS[:2])]  # fmt: skip
    flags = {"--batch-size": 2, "--continual": True} if continual else {"--batch-size": 2}
    for mode in ("argmax", "mmse"):
        codec = VectorCodec()
        result = synthesize_items(Synthesizer(model, table, codec, "cpu"), items,
                                  _args(tmp_path, **flags, **{"--nar-decoding": mode}))  # fmt: skip
        assert len(result.written) == 2 and len(codec.decoded) == 2
        all3 = all(bool((c[0, 1:] == 3).all()) for c in codec.decoded)
        assert all3 == (mode == "mmse")
    # A codec without code vectors: one line naming the flag.
    with pytest.raises(InputError, match="--nar-decoding mmse: the codec FakeCodec"):
        synthesize_items(Synthesizer(model, table, FakeCodec(), "cpu"), items,
                         _args(tmp_path, **flags, **{"--nar-decoding": "mmse"}))  # fmt: skip


def test_prompt_and_text_are_phonemized_in_their_own_languages(setup):
    from valle.data.text import WORD_SEP, TextTokenizer

    _, table, prompt = setup
    model = tiny_model("valle", 4).eval()
    synth = Synthesizer(model, table, FakeCodec(), "cpu", language="cmn", prompt_language="en-us")
    item = Item("the dog", str(prompt), "你好", Path("x.wav"), "item 0")
    unit = synth.prepare(item)
    en = TextTokenizer()(["the dog"], language="en-us")[0]
    cmn = TextTokenizer()(["你好"], language="cmn")[0]
    ids = [synth.collater.symbol_table.get(s) for s in en + [WORD_SEP] + cmn]
    assert unit.text.tolist() == [synth.collater.bos_id, *ids, synth.collater.eos_id]
    assert unit.prompt_text_len == len(en) + 1
    # One language for both: English espeak cannot read the Mandarin text (issue #42).
    with pytest.raises(InputError, match="item 0: the text has Han letters"):
        Synthesizer(model, table, FakeCodec(), "cpu", language="en-us").prepare(item)


def test_long_text_is_split_into_sentences_and_joined(setup, tmp_path):
    import soundfile as sf

    _, table, prompt = setup
    assert split_sentences("The dog.  A fox! Quick") == ["The dog.", "A fox!", "Quick"]
    assert split_sentences("你好。你好") == ["你好。", "你好"]
    model = tiny_model("valle", 1).eval()
    synth = Synthesizer(model, table, FakeCodec(), "cpu")
    item = Item("the dog", str(prompt), "the dog. a fox!", tmp_path / "long.wav", "item 0")
    args = _args(tmp_path, **{"--split-sentences": True, "--sentence-gap": 0.5})
    assert synthesize_items(synth, [item], args).written == [tmp_path / "long.wav"]
    wav, _ = sf.read(str(tmp_path / "long.wav"))
    # Each sentence runs to the cap (1 frame per text token: its phonemes + prompt + bos/eos).
    ids = sum(synth.prepare(Item("the dog", str(prompt), text, Path(), "")).text.numel()
              for text in ("the dog.", "a fox!"))  # fmt: skip
    assert wav.shape == (ids * 320 + 12000,)


def test_read_items_prompt_join_and_messages(setup):
    tmp, _, prompt = setup
    args = _args(
        tmp, **{"--text-prompts": "a|b", "--audio-prompts": "p1.wav|p2.wav", "--text": "x|y"}
    )
    items = read_items(args)  # lifeiteng: one prompt made of both, used for each text
    assert [(i.prompt_text, i.prompt_wavs, i.text) for i in items] == [
        ("a b", ["p1.wav", "p2.wav"], "x"), ("a b", ["p1.wav", "p2.wav"], "y")]  # fmt: skip
    args.prompt_join = "pair"
    assert [(i.prompt_text, i.prompt_wavs) for i in read_items(args)] == [
        ("a", ["p1.wav"]),
        ("b", ["p2.wav"]),
    ]
    for over, message in [
        ({"--audio-prompts": "p.wav", "--text": "x"}, "--text-prompts is required"),
        ({"--audio-prompts": "p.wav", "--text-prompts": "a", "--continual": True, "--text": "x"}, "leave out --text"),
        ({"--audio-prompts": "p.wav", "--text-prompts": "a"}, "--text is required"),
        ({"--audio-prompts": "p1.wav|p2.wav", "--text-prompts": "a", "--text": "x"}, "one transcript per prompt"),
    ]:  # fmt: skip
        with pytest.raises(InputError, match=message):
            read_items(_args(tmp, **over))
    assert read_items(_args(tmp, **{"--audio-prompts": "p.wav", "--text-prompts": "a",
                                    "--continual": "true"}))[0].text == ""  # fmt: skip


def test_concatenated_prompts_are_joined_in_time(setup):
    _, table, prompt = setup
    synth = Synthesizer(tiny_model("valle", 1).eval(), table, FakeCodec(), "cpu")
    codes = synth.prepare(Item("the dog", [str(prompt), str(prompt)], "a fox", Path(), "item 0")).prompt
    assert codes.shape[0] == 30 and torch.equal(codes[:15], codes[15:])  # 2 x 15 frames


def test_checkpoint_dir_picks_best_validation(tmp_path):
    (tmp_path / "epoch-1.pt").write_bytes(b"")
    assert select_checkpoint(tmp_path) == tmp_path / "epoch-1.pt"
    (tmp_path / "best-valid-loss.pt").write_bytes(b"")
    assert select_checkpoint(tmp_path) == tmp_path / "best-valid-loss.pt"
    assert select_checkpoint(tmp_path / "epoch-1.pt") == tmp_path / "epoch-1.pt"
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="without best-valid-loss.pt or epoch"):
        select_checkpoint(tmp_path / "empty")


def test_bad_checkpoints_get_one_line(tmp_path, capsys):
    torch.save({"model": {"w": torch.zeros(1)}}, tmp_path / "plain.pt")
    assert main(["--checkpoint", str(tmp_path / "plain.pt"), "--text-prompts", "a",
                 "--audio-prompts", "p.wav", "--text", "b"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "plain.pt: no 'config'" in err


def test_lifeiteng_checkpoint_synthesises(setup, tmp_path, monkeypatch):
    _, table, prompt = setup
    model, config = load_model(FIXTURE / "lifeiteng_tiny.pt", dtype=torch.bfloat16)
    assert (
        config["source_format"] == "lifeiteng"
        and model.ar_text_embedding.weight.dtype == torch.bfloat16
    )
    import valle.codec.encodec as audio

    monkeypatch.setattr(audio, "AudioTokenizer", lambda *a, **k: FakeCodec())
    try:  # the codec package (#13) picks the checkpoint's codec
        import valle.codec as codec

        monkeypatch.setattr(codec, "codec_for_checkpoint", lambda *a, **k: FakeCodec())
    except ImportError:
        pass
    rc = main(["--checkpoint", str(FIXTURE / "lifeiteng_tiny.pt"), "--text-tokens", str(table),
               "--text-prompts", "the dog", "--audio-prompts", str(prompt), "--text", "a fox",
               "--output-dir", str(tmp_path), "--top-k", "1", "--device", "cpu", "--dtype", "bfloat16"])  # fmt: skip
    assert rc == 0 and (tmp_path / "0.wav").is_file()


def test_docs_show_every_flag():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "inference.md").read_text()
    flags = {f for a in build_parser()._actions for f in a.option_strings if f.startswith("--")}
    assert sorted(f for f in flags - {"--help"} if f"`{f}`" not in doc) == []


def _bilingual(table, language: str):
    """(a tiny VALL-E X model of en-us and cmn, its Synthesizer for ``language`` and English prompts)."""
    model = tiny_model("valle", 1, num_languages=2).eval()
    return model, Synthesizer(model, table, FakeCodec(), "cpu", language=language, prompt_language="en-us",
                              checkpoint_config={"languages": ["en-us", "cmn"]})  # fmt: skip


def test_cross_lingual_synthesis(setup, tmp_path):
    _, table, prompt = setup
    model, synth = _bilingual(table, "cmn")
    item = Item("the dog", str(prompt), "你好", tmp_path / "x.wav", "item 0")
    unit = synth.prepare(item)
    langs = unit.text_languages
    n_prompt = unit.prompt_text_len + 1  # BOS + the English transcript (+ word separator)
    assert langs[:n_prompt].tolist() == [0] * n_prompt
    assert langs[n_prompt:].tolist() == [1] * (unit.text.numel() - n_prompt)
    [wav] = synth.synthesize([item], options=DecodeOptions(top_k=1, max_len_ratio=1.0))
    assert wav.numel() == unit.text.numel() * 320
    with pytest.raises(InputError, match="pass --languages"):
        Synthesizer(model, table, FakeCodec(), "cpu", language="cmn")
    with pytest.raises(InputError, match="--language fr-fr: not one of"):
        Synthesizer(model, table, FakeCodec(), "cpu", language="fr-fr", languages="en-us,cmn")


def test_experimental_decoding_flags_are_grouped_and_removed_ones_refused(tmp_path):
    parser = build_parser()
    group = next(g for g in parser._action_groups if g.title == "decoding (experimental)")
    [stop_rule] = group._group_actions
    assert stop_rule.dest == "stop_rule" and "experimental" in stop_rule.help
    assert _args(tmp_path, **{"--stop-rule": "sampled"}).stop_rule == "sampled"
    for removed in ("--repetition-aware", "--ras-window"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--checkpoint", "x", removed])


def test_static_cache_flag_gives_the_same_audio_and_cuda_graphs_refuse_cpu(setup, tmp_path, capsys):
    _, table, prompt = setup
    model = tiny_model("valle", 1, share_embedding=False).eval()
    synth = Synthesizer(model, table, FakeCodec(), "cpu")
    items = [Item("the dog", str(prompt), t, tmp_path / f"{i}.wav", f"item {i}")
             for i, t in enumerate(TEXTS)]  # fmt: skip
    args = _args(tmp_path, **{"--max-len-ratio": 2})
    static = _args(tmp_path, **{"--max-len-ratio": 2, "--static-cache": True})
    options = decode_options(static)
    assert options.static_cache and not options.cuda_graphs
    plain = synth.synthesize(items, options=decode_options(args))
    assert [w.shape for w in synth.synthesize(items, options=options)] == [w.shape for w in plain]
    rc = main(["--checkpoint", str(tmp_path / "none.pt"), "--text-prompts", "the dog",
               "--audio-prompts", str(prompt), "--text", "a fox", "--output-dir", str(tmp_path),
               "--device", "cpu", "--cuda-graphs"])  # fmt: skip
    assert rc == 2 and "--cuda-graphs needs a CUDA device" in capsys.readouterr().err


def test_language_auto_says_each_script_in_its_language(setup, tmp_path):
    from valle.data.text import WORD_SEP, TextTokenizer

    _, table, prompt = setup
    _, synth = _bilingual(table, "auto")
    item = Item("the dog", str(prompt), "你好 the fox。", tmp_path / "x.wav", "item 0")
    unit = synth.prepare(item)
    en, cmn = TextTokenizer(), TextTokenizer(language="cmn")
    said = [en(["the dog"])[0], [WORD_SEP], cmn(["你好"])[0], [WORD_SEP], en(["the fox."])[0]]
    ids = [synth.collater.symbol_table.get(s) for part in said for s in part]
    assert unit.text.tolist() == [synth.collater.bos_id, *ids, synth.collater.eos_id]
    # BOS, the prompt and its separator in English; the Han run (and the separator after it) in
    # Mandarin; the English words and EOS in English: ids in the checkpoint's order
    lengths = [1 + len(said[0]) + 1, len(said[2]) + 1, len(said[4]) + 1]
    expected = [0] * lengths[0] + [1] * lengths[1] + [0] * lengths[2]
    assert unit.text_languages.tolist() == expected
    [wav] = synth.synthesize([item], options=DecodeOptions(top_k=1, max_len_ratio=1.0))
    assert wav.numel() == unit.text.numel() * 320
    # a script none of the model's languages reads is refused, naming it
    problem = synth.text_problem(Item("the dog", str(prompt), "Привет", Path(), "item 1"))
    assert problem.field == "text" and "Cyrillic letters ('Привет'): none of this checkpoint's" in problem.message


def test_language_auto_without_model_languages_asks_the_symbol_table(setup, tmp_path):
    _, table, prompt = setup
    synth = Synthesizer(tiny_model("valle", 1).eval(), table, FakeCodec(), "cpu", language="auto")
    assert synth.text_problem(Item("the dog", str(prompt), "你好。the dog!", Path(), "item 0")) is None
    problem = synth.text_problem(Item("the dog", str(prompt), "Привет", Path(), "item 1"))
    assert "Cyrillic letters ('Привет'): none of the languages that read it (ru, uk" in problem.message
    assert "has phonemes this checkpoint's symbol table holds" in problem.message
    items = [Item("the dog", str(prompt), t, tmp_path / f"{i}.wav", f"item {i}")
             for i, t in enumerate(["你好。the dog!", "Привет"])]  # fmt: skip
    result = synthesize_items(synth, items, _args(tmp_path))
    assert result.written == [tmp_path / "0.wav"] and [f.name for f in result.failures] == ["item 1"]
