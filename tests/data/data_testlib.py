"""Small corpora in the real on-disk layouts (fake audio), and a way to run recipe stages."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
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


MANDARIN = [("我们回家", "wo3 men5 hui2 jia1"), ("天气很好", "tian1 qi4 hen3 hao3"),
            ("猫在睡觉", "mao1 zai4 shui4 jiao4"), ("请开门", "qing3 kai1 men2"),
            ("他笑了", "ta1 xiao4 le5"), ("下雨了", "xia4 yu3 le5")]


def make_aishell3(root: Path, parts: dict[str, list[str]], sr: int = 44100) -> Path:
    """data_aishell3/ as openslr's data_aishell3.tgz unpacks (lhotse's prepare_aishell3 reads
    exactly these): spk-info.txt (speaker, age group, gender, accent; '#' comments),
    {part}/content.txt ('{utt}.wav<TAB>' then each character followed by its pinyin),
    {part}/wav/{spk}/{utt}.wav at 44.1 kHz, and train/label_train-set.txt ('id|pinyin|text'
    with prosody marks; '#' header lines). Speakers are 'SSB' and 4 digits; utterance ids are
    the speaker and 4 more digits."""
    corpus = root / "data_aishell3"
    corpus.mkdir(parents=True)
    speakers = sorted({s for spks in parts.values() for s in spks})
    (corpus / "spk-info.txt").write_text(
        "# AISHELL-3 speaker info\n# speaker\tage group\tgender\taccent\n"
        + "".join(f"{s}\tA\t{'female' if i % 2 == 0 else 'male'}\tnorth\n" for i, s in enumerate(speakers)),
        encoding="utf-8")
    k = 0
    labels = ["# AISHELL-3 tone labels", "# id|pinyin|text"]
    for part, spks in parts.items():
        content = []
        for spk in spks:
            for n in range(2):
                utt = f"{spk}{n + 1:04d}"
                text, pinyin = MANDARIN[k % len(MANDARIN)]
                wav = corpus / part / "wav" / spk / f"{utt}.wav"
                wav.parent.mkdir(parents=True, exist_ok=True)
                sf.write(wav, tone(1.4 + 0.1 * n, sr, 50 + k), sr, subtype="PCM_16")
                content.append(f"{utt}.wav\t" + " ".join(f"{c} {p}" for c, p in zip(text, pinyin.split())))
                if part == "train":
                    labels.append(f"{utt}|{pinyin} %|{' '.join(text)} %")
                k += 1
        (corpus / part / "content.txt").write_text("\n".join(content) + "\n", encoding="utf-8")
    (corpus / "train").mkdir(exist_ok=True)
    (corpus / "train" / "label_train-set.txt").write_text("\n".join(labels) + "\n", encoding="utf-8")
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


def run_sh_launches(script: str, tmp_path: Path, *args: str) -> list[str]:
    """The trainer command lines a recipe's run.sh launches (python replaced by a stand-in
    that prints them)."""
    fake = tmp_path / "python"
    fake.write_text('#!/usr/bin/env bash\necho "LAUNCH $*"\n')
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(ROOT / script), "--python", str(fake), "--nproc", "1", *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stdout.splitlines() if line.startswith("LAUNCH -m torch.distributed.run")]


def train_two_steps(manifest_dir: Path, dataset: str, exp: Path, *model_args: str) -> str:
    """bin/trainer.py on a recipe's tokenized cuts: a tiny model, two steps, a checkpoint;
    returns the log."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bin/trainer.py"), "--model-name", "valle", "--decoder-dim", "32",
         "--nhead", "2", "--num-decoder-layers", "1", "--dropout", "0.0", *model_args, "--device", "cpu",
         "--dtype", "float32", "--manifest-dir", str(manifest_dir), "--dataset", dataset,
         "--max-duration", "4", "--num-workers", "0", "--num-buckets", "1", "--exp-dir", str(exp),
         "--max-steps", "2", "--num-epochs", "10", "--train-stage", "0", "--valid-interval", "2",
         "--save-every-n", "2", "--tensorboard", "false", "--log-interval", "1"],
        cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (exp / "checkpoint-2.pt").is_file()
    return proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- processes left behind
def alive(pid: int) -> bool:
    """A process that still exists and is not a zombie (which holds no files)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def killed_workers(pids_file: Path) -> list[int]:
    """The pids a killed run's workers wrote, one a line."""
    return [int(x) for x in pids_file.read_text().split()] if pids_file.is_file() else []


def survivors(pids: list[int], grace: float = 3.0) -> list[int]:
    """Those of ``pids`` still alive after ``grace`` seconds (returns as soon as none is)."""
    deadline = time.monotonic() + grace
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def end_processes(pids: list[int]) -> None:
    """A test's own leftovers (on the code before a fix: workers sleeping on), ended by id."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
