"""``--add-language NAME`` on a VALL-E X checkpoint (Plachtaa/VALL-E-X#14's recipe): the AR and
NAR language tables grow by one row, that row trains with the LoRA adapters while the base stays
bit-identical, the checkpoints record the grown table, and synthesis and --merge-lora carry it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.scenarios import TINY_MODEL
from valle.models.convert import load_model_checkpoint
from valle.models.lora import LoraError, is_adapter_key
from valle.train.checkpoint import load_checkpoint
from valle.train.cli import parse_config
from valle.train.loop import train

pytestmark = pytest.mark.timeout(300)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vallex"
BASE = FIXTURE / "vallex_tiny.pt"
TABLES = ("ar_language_embedding", "nar_language_embedding")


def _flags(exp: Path, *extra: str, epochs: int = 1) -> list[str]:
    # 4 synthetic cuts per language of the grown table, batches of 8: every batch has the new one
    return TINY_MODEL + [
        "--exp-dir", str(exp), "--synthetic-data", "16", "--synthetic-batch-size", "8",
        "--num-epochs", str(epochs), "--start-from", str(BASE), "--optimizer-name", "AdamW",
        "--weight-decay", "0.1", "--base-lr", "0.01", "--warmup-steps", "1",
        "--average-period", "0", "--log-interval", "1", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two steps of --add-language de --lora-rank 16 from the tiny VALL-E X fixture."""
    exp = tmp_path_factory.mktemp("newlang") / "exp"
    summary = train(parse_config(_flags(exp, "--add-language", "de", "--lora-rank", "16")))
    return exp, summary


def test_the_table_grows_and_only_the_new_row_and_adapters_change(run):
    _, summary = run
    base, _ = load_model_checkpoint(BASE)
    assert summary.steps == 2
    state = summary.model_state
    for key, value in base.items():  # weight decay included: the base is bit-identical
        assert torch.equal(state[key], value.to(state[key].dtype)), key
    for table in TABLES:
        rows = base[f"{table}.weight"]
        assert state[f"{table}.weight"].shape == rows.shape  # the base's 3 rows, frozen
        added = state[f"{table}.added_rows"]
        assert added.shape == (1, rows.shape[1])
        # it started as the mean of the others (--add-language-init mean) and trained
        assert not torch.allclose(added, rows.mean(0, keepdim=True))
    trained = {k for k in state if is_adapter_key(k)}
    assert {f"{t}.added_rows" for t in TABLES} <= trained


def test_the_checkpoint_records_the_new_language(run):
    exp, summary = run
    saved = load_checkpoint(exp / "epoch-1.pt")
    assert all(is_adapter_key(k) for k in saved["model"])
    for table in TABLES:
        assert torch.equal(saved["model"][f"{table}.added_rows"], summary.model_state[f"{table}.added_rows"])
    assert saved["lora"]["added_languages"] == ["de"] and saved["lora"]["added_language_init"] == "mean"
    assert saved["lora"]["languages"] == ["en", "zh", "ja", "de"]
    assert saved["config"]["languages"] == ["en", "zh", "ja", "de"]
    assert saved["config"]["num_languages"] == 4 and saved["config"]["add_language"] == "de"
    assert saved["config"]["text_frontend"] == "vallex-bpe"


def test_inference_and_merge_carry_the_new_language(run, tmp_path):
    from valle.infer import load_model, main

    exp, _ = run
    adapters, merged = exp / "epoch-1.pt", tmp_path / "merged.pt"
    assert main(["--checkpoint", str(adapters), "--merge-lora", str(merged)]) == 0
    e = torch.load(FIXTURE / "expected.pt")
    codes = []
    for path in (adapters, merged):
        model, config = load_model(path)
        assert config["languages"] == ["en", "zh", "ja", "de"] and model.num_languages == 4
        # prompt in English (row 0), text in the new language (row 3)
        langs = torch.tensor([[0] * 5 + [3] * 8])
        codes.append(model.inference(e["text"], torch.tensor([13]), e["prompt"], text_languages=langs,
                                     top_k=1, max_len_ratio=2.0))  # fmt: skip
    assert torch.equal(codes[0], codes[1])
    merged_state = torch.load(merged, weights_only=False)
    assert merged_state["model"]["ar_language_embedding.weight"].shape[0] == 4
    assert merged_state["config"]["languages"] == ["en", "zh", "ja", "de"]


def test_synthesis_by_name(run, tmp_path, monkeypatch, capsys):
    """bin/infer.py --language de on the adapters: the text's tokens get the new row (3)."""
    pytest.importorskip("tokenizers", reason="the vallex extra: pip install -e '.[vallex]'")
    from valle.infer import Item, Synthesizer, load_model, main

    exp, _ = run
    model, config = load_model(exp / "epoch-1.pt")
    synth = Synthesizer(model, str(FIXTURE / "bpe_69.json"), None, "cpu", language="de",
                        checkpoint_config=config)  # fmt: skip
    item = Item(prompt_text="Hallo.", prompt_wav=[], text="Guten Tag.", out_wav=tmp_path / "x.wav", name="x")
    ids, prompt_len, langs = synth._text_ids(item, continual=False)
    # espeak's "ɡˈuːtən tˈɑːk." in the table's characters: g for ɡ, no length marks
    assert ids[prompt_len:].tolist() == synth.text_tokenizer.bpe.encode("gˈutən_tˈɑk.").ids
    assert set(langs.tolist()) == {3}
    # bin/infer.py itself, an English .npz prompt (VALL-E X's lang_code 2) and German text
    import numpy as np

    import valle.codec as codec

    class Codec:  # codes in, a constant wave out: the codec is not under test
        def encode(self, wav):
            return torch.zeros(1, 8, max(1, wav.shape[-1] // 320), dtype=torch.long)

        def decode(self, codes):
            return torch.full((1, 1, codes.shape[-1] * 320), 0.1)

    monkeypatch.setattr(codec, "codec_for_checkpoint", lambda *a, **k: Codec())
    e = torch.load(FIXTURE / "expected.pt")
    np.savez(tmp_path / "en.npz", audio_tokens=e["prompt"].numpy().astype(np.int64),
             text_tokens=e["text"][:, :5].numpy(), lang_code=np.array([2]))  # fmt: skip
    assert main(["--checkpoint", str(exp / "epoch-1.pt"), "--bpe-vocab", str(FIXTURE / "bpe_69.json"),
                 "--audio-prompts", str(tmp_path / "en.npz"), "--text", "Guten Tag.", "--language", "de",
                 "--output-dir", str(tmp_path / "out"), "--top-k", "1", "--max-len-ratio", "1",
                 "--device", "cpu"]) == 0  # fmt: skip
    assert (tmp_path / "out" / "0.wav").is_file()
    assert main(["--checkpoint", str(BASE), "--bpe-vocab", str(FIXTURE / "bpe_69.json"),
                 "--audio-prompts", str(tmp_path / "en.npz"), "--text", "Guten Tag.", "--language", "de",
                 "--output-dir", str(tmp_path / "base"), "--device", "cpu"]) == 2  # the base has no de
    assert "--language de: this VALL-E X checkpoint reads en, zh, ja" in capsys.readouterr().err


def test_resume_keeps_the_new_row(run, tmp_path):
    exp, summary = run
    resumed = train(parse_config(_flags(exp, "--add-language", "de", "--lora-rank", "16", epochs=2)))
    assert resumed.steps == 4
    base, _ = load_model_checkpoint(BASE)
    for key, value in base.items():
        assert torch.equal(resumed.model_state[key], value.to(resumed.model_state[key].dtype)), key
    # it went on from epoch 1's row (one more epoch moves it, from there)
    first = summary.model_state["ar_language_embedding.added_rows"]
    assert not torch.equal(resumed.model_state["ar_language_embedding.added_rows"], first)
    with pytest.raises(LoraError, match="--add-language"):  # the adapters' language, not another
        train(parse_config(_flags(exp, "--add-language", "fr", "--lora-rank", "16", epochs=3)))


def test_full_fine_tuning_grows_a_plain_table(tmp_path):
    summary = train(parse_config(_flags(tmp_path / "exp", "--add-language", "de", "--add-language-init", "en")))
    assert summary.steps == 2
    saved = load_checkpoint(tmp_path / "exp" / "epoch-1.pt")
    assert saved["model"]["ar_language_embedding.weight"].shape[0] == 4
    assert saved["config"]["languages"] == ["en", "zh", "ja", "de"]
    from valle.infer import load_model

    model, config = load_model(tmp_path / "exp" / "epoch-1.pt")
    assert model.num_languages == 4 and config["languages"][3] == "de"


@pytest.mark.parametrize("flags, message", [
    (["--add-language", "en"], r"--add-language en: already in the language table \['en', 'zh', 'ja'\]"),
    (["--add-language", "en-us"], "--add-language en-us: already in the language table"),
    (["--add-language", "de", "--add-language-init", "ko"], "--add-language-init ko: mean, or one of"),
    (["--add-language", "mix"], "--add-language 'mix': name the language as espeak"),
])  # fmt: skip
def test_bad_uses_are_refused_naming_the_flag(tmp_path, flags, message):
    with pytest.raises(LoraError, match=message):
        train(parse_config(_flags(tmp_path / "exp", *flags, "--lora-rank", "16")))


def test_a_base_without_a_language_table_is_refused(tmp_path):
    plain = train(parse_config(TINY_MODEL + [
        "--exp-dir", str(tmp_path / "base"), "--synthetic-data", "8", "--synthetic-batch-size", "8",
        "--num-epochs", "1", "--average-period", "0"]))  # fmt: skip
    assert plain.steps == 1
    with pytest.raises(LoraError, match="--add-language de: --start-from .*epoch-1.pt has no language table"):
        train(parse_config(TINY_MODEL + [
            "--exp-dir", str(tmp_path / "exp"), "--synthetic-data", "8", "--num-epochs", "1",
            "--start-from", str(tmp_path / "base" / "epoch-1.pt"), "--add-language", "de",
            "--lora-rank", "4", "--optimizer-name", "AdamW"]))  # fmt: skip
    with pytest.raises(ValueError, match="--add-language: .* --start-from"):
        parse_config(TINY_MODEL + ["--synthetic-data", "8", "--add-language", "de"])


GERMAN = ["Guten Morgen, wie geht es dir heute?", "Das Wetter ist schön und die Sonne scheint.",
          "Wir fahren morgen mit dem Zug nach Berlin.", "Der Hund schläft neben dem warmen Ofen."]


@pytest.mark.timeout(600)
def test_a_german_corpus_teaches_the_new_row(tmp_path):
    """The whole path: German eSpeak recordings tokenized into VALL-E X's ids
    (bin/tokenizer.py --text-extractor vallex-bpe, the supervisions' language German), then
    --add-language de trains its row on them: their cuts get id 3 (the grown table's order)."""
    import os
    import subprocess
    import sys

    from valle.data.tiny import Voice, make_manifests, synthesize_items
    from valle.data.vallex_text import main as vallex_text

    root = Path(__file__).resolve().parents[2]
    voices = (Voice("de_f", "de+f4", 170, 65, language="German"), Voice("de_m", "de+m3", 165, 40, language="German"))
    synthesize_items([(text, v) for text in GERMAN for v in voices], tmp_path / "corpus")
    make_manifests(tmp_path / "corpus", tmp_path / "manifests")
    table = tmp_path / "vallex.k2symbols"
    assert vallex_text(["symbols", "--bpe-vocab", str(FIXTURE / "bpe_69.json"), "--output", str(table)]) == 0
    proc = subprocess.run(
        [sys.executable, str(root / "bin/tokenizer.py"), "--src-dir", str(tmp_path / "manifests"),
         "--output-dir", str(tmp_path / "tokenized"), "--prefix", "tiny", "--dataset-parts", "all",
         "--suffix", "jsonl.gz", "--num-jobs", "0", "--allow-random-encodec",
         "--text-extractor", "vallex-bpe", "--text-tokens", str(table)],
        cwd=root, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "left out, not in the vallex-bpe table" in proc.stdout  # ø of schön, at least
    summary = train(parse_config(TINY_MODEL + [
        "--exp-dir", str(tmp_path / "exp"), "--manifest-dir", str(tmp_path / "tokenized"),
        "--dataset", "tiny", "--train-part", "all", "--valid-part", "all", "--max-duration", "20",
        "--num-workers", "0", "--num-buckets", "1", "--text-tokens", str(table), "--num-epochs", "1",
        "--start-from", str(BASE), "--add-language", "de", "--lora-rank", "4", "--weight-decay", "0",
        "--optimizer-name", "AdamW", "--base-lr", "0.01", "--warmup-steps", "1", "--average-period", "0"]))  # fmt: skip
    assert summary.steps >= 1
    saved = load_checkpoint(tmp_path / "exp" / "epoch-1.pt")
    assert saved["config"]["languages"] == ["en", "zh", "ja", "de"]
    # No weight decay: a row moves only where its id is used. The German cuts got id 3.
    base, _ = load_model_checkpoint(BASE)
    for table_name in TABLES:
        start = base[f"{table_name}.weight"].mean(0, keepdim=True)
        assert not torch.allclose(saved["model"][f"{table_name}.added_rows"], start), table_name
        assert torch.equal(summary.model_state[f"{table_name}.weight"], base[f"{table_name}.weight"])
