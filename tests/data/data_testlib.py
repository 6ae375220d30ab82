"""Small corpora in the real on-disk layouts (fake audio), and a way to run recipe stages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import soundfile as sf

ROOT = Path(__file__).resolve().parents[2]

TEXTS = ["The cat sat down.", "Rain fell today.", "Where is it?", "We walked home.",
         "A bird sang.", "It is late now.", "Open the door.", "She smiled."]


def tone(seconds: float, sr: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    x = 0.3 * np.sin(2 * np.pi * (150 + 50 * seed % 200) * t) + 0.05 * rng.standard_normal(t.size)
    return x.astype(np.float32)


def make_libritts(root: Path, parts: dict[str, list[str]], sr: int = 24000) -> Path:
    """LibriTTS/{part}/{spk}/{chapter}/{spk}_{chapter}_{n}_000000.wav with .trans.tsv and
    .book.tsv per chapter (lhotse's prepare_libritts reads exactly these)."""
    corpus = root / "LibriTTS"
    k = 0
    for part, speakers in parts.items():
        for spk in speakers:
            chapter = f"{100 + k}"
            d = corpus / part / spk / chapter
            d.mkdir(parents=True)
            trans, book = [], []
            for n in range(2):
                utt = f"{spk}_{chapter}_{n:06d}_000000"
                text = TEXTS[k % len(TEXTS)]
                sf.write(d / f"{utt}.wav", tone(0.9 + 0.1 * n, sr, k), sr, subtype="PCM_16")
                trans.append(f"{utt}\t{text}\t{text}")
                book.append(f"{utt}\t{text}\t{text}\t0\t0\t20.0")
                k += 1
            (d / f"{spk}_{chapter}.trans.tsv").write_text("\n".join(trans) + "\n")
            (d / f"{spk}_{chapter}.book.tsv").write_text("\n".join(book) + "\n")
    return corpus


def make_ljspeech(root: Path, rows: list[tuple[str, str]], sr: int = 22050) -> Path:
    """LJSpeech-1.1/metadata.csv (id|text|normalized text) and wavs/{id}.wav at 22.05 kHz."""
    corpus = root / "LJSpeech-1.1"
    (corpus / "wavs").mkdir(parents=True)
    lines = []
    for i, (text, normalized) in enumerate(rows):
        utt = f"LJ001-{i + 1:04d}"
        sf.write(corpus / "wavs" / f"{utt}.wav", tone(1.0 + 0.3 * (i % 3), sr, i), sr, subtype="PCM_16")
        lines.append(f"{utt}|{text}|{normalized}")
    (corpus / "metadata.csv").write_text("\n".join(lines) + "\n")
    return corpus


def start_recipe(script: str, *args: str) -> subprocess.Popen:
    """A recipe run in the background (tests overlap the two corpora on two cores)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen(["bash", str(ROOT / script), "--python", sys.executable, *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_recipe(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err


def run_recipe(script: str, *args: str, timeout: float = 240) -> tuple[int, str, str]:
    return finish_recipe(start_recipe(script, *args), timeout)
