"""Checkpoint -> bin/infer.py round trip, and the messages bad input gets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from models_testlib import tiny_model

from valle.models import NUM_AUDIO_TOKENS

REPO = Path(__file__).resolve().parents[2]
PROMPT_TEXT = "the quick brown fox"
TEXT = "jumps over the dog"
RATIO = 1.0  # frames per text token: keeps EnCodec decoding short


def _phonemes(text: str) -> list[str]:
    from valle.data.text import TextTokenizer

    return TextTokenizer(language="en-us")([text])[0]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    sf = pytest.importorskip("soundfile")
    from valle.data.symbols import SymbolTable

    tmp = tmp_path_factory.mktemp("infer")
    symbols = set(_phonemes(f"{PROMPT_TEXT} {TEXT}")) | set(_phonemes("the dog jumps"))
    table_path = tmp / "unique_text_tokens.k2symbols"
    SymbolTable.from_symbols(sorted(symbols)).to_file(table_path)
    model = tiny_model("valle", 1, share_embedding=False)
    with torch.no_grad():
        # EOS logit 0 against 1024 random ones: greedy decoding runs to the length cap.
        model.ar_predict_layer.weight[NUM_AUDIO_TOKENS] = 0.0
    config = dict(model.hparams, text_tokens=str(table_path), train_stage=0, base_lr=0.05)
    ckpt = tmp / "checkpoint.pt"
    torch.save({"format": "valle-checkpoint-1", "model": model.state_dict(), "model_avg": None,
                "step": 1, "epoch": 1, "batch_in_epoch": 1, "train_stage": 0, "config": config,
                "rng": {"numpy": np.random.get_state()}, "quarantine": []}, ckpt)  # fmt: skip
    prompt = tmp / "prompt.wav"
    sf.write(
        str(prompt), np.random.default_rng(0).uniform(-0.3, 0.3, 24000).astype(np.float32), 24000
    )
    return tmp, ckpt, prompt


def _args(ckpt, prompt, out, **over):
    args = {"--checkpoint": ckpt, "--text-prompts": PROMPT_TEXT, "--audio-prompts": prompt,
            "--text": TEXT, "--output-dir": out, "--top-k": 1, "--max-len-ratio": RATIO,
            "--device": "cpu"}  # fmt: skip
    args.update(over)
    argv = [str(x) for kv in args.items() for x in kv]
    return argv + ["--allow-random-encodec"]


def test_round_trip_writes_wav_of_expected_length(setup):
    import soundfile as sf

    tmp, ckpt, prompt = setup
    out = tmp / "out"
    proc = subprocess.run([sys.executable, str(REPO / "bin" / "infer.py"), *_args(ckpt, prompt, out)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    wav, sr = sf.read(str(out / "0.wav"))
    text_len = len(_phonemes(f"{PROMPT_TEXT} {TEXT}")) + 2  # + <bos>, <eos>
    frames = int(text_len * RATIO)
    assert sr == 24000
    assert wav.shape == (frames * 320,)
    assert np.isfinite(wav).all() and np.abs(wav).max() > 0


def test_tsv_batch_and_continual(setup):
    import soundfile as sf

    from valle.infer import main

    tmp, ckpt, prompt = setup
    tsv = tmp / "items.tsv"
    tsv.write_text("prompt_text\tprompt_wav\ttext\tout_wav\n"
                   f"{PROMPT_TEXT}\t{prompt}\t{TEXT}\ta.wav\n"
                   f"the dog\t{prompt}\tjumps\tsub/b.wav\n")  # fmt: skip
    argv = [a for a in _args(ckpt, prompt, tmp / "tsv", **{"--tsv": tsv})]
    for flag in ("--text-prompts", "--audio-prompts", "--text"):  # the TSV names them
        k = argv.index(flag)
        del argv[k : k + 2]
    assert main(argv) == 0
    for name, text in (("a.wav", f"{PROMPT_TEXT} {TEXT}"), ("sub/b.wav", "the dog jumps")):
        wav, _ = sf.read(str(tmp / "tsv" / name))
        assert wav.shape == ((len(_phonemes(text)) + 2) * 320,)
    # Continual: the prompt's second half (75 frames of 1 s -> 38) is resynthesised.
    argv = _args(ckpt, prompt, tmp / "cont", **{"--text": ""}) + ["--continual"]
    assert main(argv) == 0
    wav, _ = sf.read(str(tmp / "cont" / "0.wav"))
    assert wav.shape == ((75 - 75 // 2) * 320,)


@pytest.mark.parametrize(
    "override, message",
    [
        ({"--text": "zebra quartz"}, "unknown text symbol"),
        ({"--text": "  "}, "item 0: the text to synthesise is empty"),
        ({"--audio-prompts": "/nonexistent/prompt.wav"}, "/nonexistent/prompt.wav"),
        ({"--checkpoint": "/nonexistent/ckpt.pt"}, "/nonexistent/ckpt.pt"),
    ],
)
def test_bad_input_is_named(setup, capsys, override, message):
    from valle.infer import main

    tmp, ckpt, prompt = setup
    assert main(_args(ckpt, prompt, tmp / "bad", **override)) == 2
    assert message in capsys.readouterr().err


def test_bad_prompt_file_is_named(setup, capsys):
    from valle.infer import main

    tmp, ckpt, _ = setup
    junk = tmp / "junk.wav"
    junk.write_bytes(b"not audio at all")
    assert main(_args(ckpt, junk, tmp / "bad")) == 2
    assert str(junk) in capsys.readouterr().err
