"""VALL-E X end to end on a local two-language eSpeak corpus (English and German voices):
tokenize (each text phonemized in its supervision's language), batches carry per-row
language ids, bin/trainer.py --num-languages 2 trains and records the id order in its
checkpoints, and bin/infer.py synthesises German text from an English prompt."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)

GERMAN = [
    "Guten Morgen, wie geht es dir heute?",
    "Das Wetter ist schön und die Sonne scheint.",
    "Ich habe ein kleines Haus am See gekauft.",
    "Wir fahren morgen mit dem Zug nach Berlin.",
    "Der Hund schläft neben dem warmen Ofen.",
    "Sie liest jeden Abend ein gutes Buch.",
]
MODEL = ["--model-name", "valle", "--decoder-dim", "32", "--nhead", "2", "--num-decoder-layers", "1",
         "--prefix-mode", "1", "--dropout", "0.0", "--num-languages", "2"]


def _run(*cmd: str) -> str:
    proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def bilingual(tmp_path_factory) -> Path:
    """Tokenized dir of 12 English + 12 German utterances, two voices per language."""
    from valle.data.tiny import Voice, make_manifests, read_sentences, synthesize_items

    english = read_sentences(ROOT / "egs/tiny/sentences.txt")[:6]
    voices = {
        "en-us": (Voice("en_f", "en-us+f3", 170, 60), Voice("en_m", "en-us+m1", 180, 40)),
        "German": (Voice("de_f", "de+f4", 170, 65, language="German"),
                   Voice("de_m", "de+m3", 165, 40, language="German")),
    }
    items = [(text, v) for texts, lang in ((english, "en-us"), (GERMAN, "German"))
             for text in texts for v in voices[lang]]
    tmp = tmp_path_factory.mktemp("bilingual")
    synthesize_items(items, tmp / "corpus")
    make_manifests(tmp / "corpus", tmp / "manifests")
    _run(str(ROOT / "bin/tokenizer.py"), "--src-dir", str(tmp / "manifests"), "--output-dir",
         str(tmp / "tokenized"), "--prefix", "tiny", "--dataset-parts", "all", "--suffix", "jsonl.gz",
         "--num-jobs", "0", "--allow-random-encodec")
    return tmp / "tokenized"


def _data_args(data: Path) -> list[str]:
    return ["--manifest-dir", str(data), "--dataset", "tiny", "--train-part", "all", "--valid-part", "all",
            "--max-duration", "20", "--num-workers", "0", "--num-buckets", "1"]


def test_batches_carry_each_rows_language(bilingual):
    import argparse

    from valle.data.datamodule import TtsDataModule, add_data_flags
    from valle.models import add_model_arguments

    parser = argparse.ArgumentParser()
    add_data_flags(parser)
    add_model_arguments(parser)
    args = parser.parse_args([*_data_args(bilingual), "--num-languages", "2"])
    module = TtsDataModule.from_flags(args)
    # the default order: the voices bin/tokenizer.py recorded, sorted
    assert module.languages() == ["de", "en-us"]
    rows = 0
    for batch in module.train_dataloader():
        expected = [0 if cut_id.startswith("de_") else 1 for cut_id in batch["cut_ids"]]
        assert batch["text_languages"].tolist() == expected
        rows += len(expected)
    assert rows == 24

    args.languages = "en-us,de"  # an explicit order wins
    assert TtsDataModule.from_flags(args).languages() == ["en-us", "de"]
    args.languages, args.num_languages = None, 1
    with pytest.raises(ValueError, match="--num-languages 1 but 2 languages"):
        TtsDataModule.from_flags(args).languages()


def test_train_then_synthesise_german_from_an_english_prompt(bilingual, tmp_path):
    exp = tmp_path / "exp"
    log = _run(str(ROOT / "bin/trainer.py"), *MODEL, *_data_args(bilingual), "--device", "cpu",
               "--dtype", "float32", "--exp-dir", str(exp), "--num-epochs", "100", "--max-steps", "4",
               "--train-stage", "0", "--valid-interval", "2", "--save-every-n", "4", "--log-interval", "1")
    assert "languages (id order): de, en-us" in log
    checkpoint = exp / "checkpoint-4.pt"
    payload = torch.load(checkpoint, map_location="cpu", weights_only=False)
    assert payload["config"]["languages"] == ["de", "en-us"]
    assert payload["model"]["ar_language_embedding.weight"].shape[0] == 2

    from lhotse import CutSet

    prompt = next(c for c in CutSet.from_file(bilingual / "tiny_cuts_all.jsonl.gz") if c.id.startswith("en_f"))
    out = tmp_path / "out"
    _run(str(ROOT / "bin/infer.py"), "--checkpoint", str(checkpoint), "--device", "cpu",
         "--text-prompts", prompt.supervisions[0].text, "--audio-prompts", prompt.recording.sources[0].source,
         "--prompt-language", "en-us", "--language", "de", "--text", GERMAN[0],
         "--output-dir", str(out), "--top-k", "1", "--max-len-ratio", "1", "--allow-random-encodec")
    assert list(out.glob("*.wav")), sorted(out.iterdir())


def test_synthetic_batches_carry_languages_and_survive_row_surgery():
    from valle.train.batching import concat_batches, split_batch
    from valle.train.synthetic import SyntheticCorpus, SyntheticSpec, collate

    corpus = SyntheticCorpus(SyntheticSpec(num_cuts=6, num_languages=3))
    batch = collate(corpus.cuts)
    assert batch["text_languages"].tolist() == [0, 1, 2, 0, 1, 2]
    halves = split_batch(batch, 2)
    assert [h["text_languages"].tolist() for h in halves] == [[0, 1, 2], [0, 1, 2]]
    assert concat_batches(halves)["text_languages"].tolist() == [0, 1, 2, 0, 1, 2]
    assert "text_languages" not in collate(SyntheticCorpus(SyntheticSpec(num_cuts=2)).cuts)
