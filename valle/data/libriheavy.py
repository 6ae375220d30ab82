"""Libriheavy (egs/libriheavy): its published lhotse cuts -> the manifests bin/tokenizer.py reads.

Libriheavy (k2-fsa/libriheavy, manifests on huggingface.co/datasets/pkufool/libriheavy) is
about 50,000 hours of LibriLight with the books' cased, punctuated text. Each part is one file
of lhotse cuts, ``libriheavy_cuts_{part}.jsonl.gz``; every cut is a segment (start, duration)
of a long LibriLight recording, whose source path is written relative to the place the
authors kept LibriLight (``download/librilight/small/100/.../x.flac``). Each supervision holds
two transcripts in ``custom["texts"]``: [0] the book's text (cased, punctuated), [1] the ASR
text that aligned it (upper case, no punctuation); ``custom["pre_texts"]`` is the preceding
book text (kilobytes per cut: not kept).

    python -m valle.data.libriheavy download MANIFESTS_DIR [--parts "small dev"] [--librilight-dir DIR]
    python -m valle.data.libriheavy prepare --manifests-dir D --librilight-dir L --output-dir O
        [--parts "small medium large dev test_clean test_other"] [--text cased|upper]

``prepare`` writes, per part, ``libriheavy_{recordings,supervisions}_{part}.jsonl.gz`` (each
recording once, its path under --librilight-dir; one supervision per cut, placed at the cut's
start in the recording) and ``libriheavy_skipped_{part}.tsv`` (cuts whose audio file is not
there). It streams: memory holds the ids of the recordings seen, not the cuts.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from valle.data import validation as V
from valle.data.corpus_parts import MISSING_AUDIO, PartManifestWriter
from valle.data.manifests import ManifestError, read_jsonl

logger = logging.getLogger("libriheavy")

PREFIX = "libriheavy"
PARTS = ("small", "medium", "large", "dev", "test_clean", "test_other")
TRAIN_PARTS = ("small", "medium", "large")  # disjoint: "the large subset" is all three
LIBRILIGHT_PARTS = ("small", "medium", "large")  # the LibriLight tars the parts' audio is in
MANIFEST_URL = "https://huggingface.co/datasets/pkufool/libriheavy/resolve/main/libriheavy_cuts_{part}.jsonl.gz"
LIBRILIGHT_URL = "https://dl.fbaipublicfiles.com/librilight/data/{part}.tar"
# Where the published cuts say LibriLight is: source paths start with this.
SOURCE_ROOT = "download/librilight/"
# Which of custom["texts"] the supervision's text is.
TEXT_INDEX = {"cased": 0, "upper": 1}


def cuts_path(manifests_dir: Path, part: str) -> Path:
    return Path(manifests_dir) / f"{PREFIX}_cuts_{part}.jsonl.gz"


def check_parts(parts: list[str]) -> None:
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ManifestError(f"unknown Libriheavy part(s) {unknown} (known: {' '.join(PARTS)})")


def audio_path(source: str, librilight_dir: Path) -> Path:
    """The published path ``download/librilight/small/...flac`` under the user's LibriLight."""
    rel = source[len(SOURCE_ROOT):] if source.startswith(SOURCE_ROOT) else source
    if Path(rel).is_absolute():
        return Path(rel)
    return Path(librilight_dir) / rel


def supervision_text(sup: dict, text: str) -> str:
    """The transcript chosen by ``--text`` (``custom["texts"]``; a plain ``text`` when the
    manifest has only that, as the normalised releases do)."""
    texts = (sup.get("custom") or {}).get("texts") or []
    index = TEXT_INDEX[text]
    if len(texts) > index and texts[index]:
        return str(texts[index]).strip()
    return str(sup.get("text") or "").strip()


def relocated_recording(recording: dict, librilight_dir: Path) -> dict:
    sources = [dict(s, source=str(audio_path(s["source"], librilight_dir))) if s.get("type") == "file" else s
               for s in recording["sources"]]
    return dict(recording, sources=sources)


def supervision_of(cut: dict, text: str) -> dict:
    """The cut's (first) supervision in recording time, with only the chosen text."""
    sup = cut["supervisions"][0]
    start = float(cut.get("start", 0.0)) + float(sup.get("start", 0.0))
    out = {"id": cut["id"], "recording_id": cut["recording"]["id"], "start": round(start, 6),
           "duration": float(sup.get("duration", cut["duration"])), "channel": sup.get("channel", 0),
           "text": supervision_text(sup, text), "language": sup.get("language") or "English"}
    if sup.get("speaker") is not None:
        out["speaker"] = sup["speaker"]
    return out


def prepare_part(manifests_dir: Path, librilight_dir: Path, output_dir: Path, part: str,
                 text: str = "cased") -> PartManifestWriter:
    """One part's manifests (see the module's docstring); returns the finished writer."""
    from tqdm import tqdm

    src = cuts_path(manifests_dir, part)
    if not src.is_file():
        raise ManifestError(f"{src}: no such Libriheavy manifest (run stage 0 or pass --manifests-dir)")
    audio_ok: dict[str, str | None] = {}  # recording id -> None, or the missing file
    with PartManifestWriter(output_dir, PREFIX, part) as writer:
        for cut in tqdm(read_jsonl(src), desc=f"libriheavy {part}", unit="cut", disable=None):
            try:
                rec = cut["recording"]
                if not cut.get("supervisions"):
                    writer.skip(cut["id"], V.NO_SUPERVISION, f"{src.name}: a cut without a supervision")
                    continue
                if rec["id"] not in audio_ok:
                    rec = relocated_recording(rec, librilight_dir)
                    missing = [s["source"] for s in rec["sources"]
                               if s.get("type") == "file" and not Path(s["source"]).is_file()]
                    audio_ok[rec["id"]] = missing[0] if missing else None
                    if not missing:
                        writer.add_recording(rec)
                if audio_ok[rec["id"]] is not None:
                    writer.skip(cut["id"], MISSING_AUDIO, f"no file {audio_ok[rec['id']]} "
                                                          f"(recording {rec['id']}; check --librilight-dir)")
                    continue
                writer.add_supervision(supervision_of(cut, text))
            except (KeyError, TypeError, ValueError) as e:
                cut_id = cut.get("id", "<no id>") if isinstance(cut, dict) else "<not an object>"
                writer.skip(str(cut_id), V.BAD_MANIFEST_ITEM, f"{src.name}: {type(e).__name__}: {e}"[:300])
    print(f"libriheavy prepare: {writer.summary()}")
    return writer


def fetch(url: str, target: Path) -> None:
    """``url`` -> ``target``, resumed across interruptions under ``{target}.part`` and renamed
    when complete, so a file that exists is whole."""
    import os

    from lhotse.utils import resumable_download

    if target.is_file():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    resumable_download(url, filename=str(partial))
    os.replace(partial, target)


def librilight_parts_of(path: Path) -> set[str]:
    """The LibriLight parts (small, medium, large) a cut manifest's audio lies in."""
    found = set()
    for cut in read_jsonl(path):
        for source in cut["recording"]["sources"]:
            top = source["source"].removeprefix(SOURCE_ROOT).split("/")[0]
            if top in LIBRILIGHT_PARTS:
                found.add(top)
    return found


def download(manifests_dir: Path, parts: list[str], librilight_dir: Path | None = None) -> None:
    """The parts' cut manifests from huggingface; with ``librilight_dir``, LibriLight's tars
    too (small 577 h, medium 5,193 h, large 51,934 h: tens of terabytes), unpacked there.
    Files already present are kept."""
    import os
    import shutil
    import tarfile

    Path(manifests_dir).mkdir(parents=True, exist_ok=True)
    for part in parts:
        target = cuts_path(manifests_dir, part)
        if target.is_file():
            logger.info("%s is there: not downloaded again", target)
            continue
        fetch(MANIFEST_URL.format(part=part), target)
    if librilight_dir is None:
        return
    needed = {p for p in parts if p in LIBRILIGHT_PARTS}
    for part in parts:  # held-out parts: their cuts say which LibriLight part holds the audio
        if part not in LIBRILIGHT_PARTS:
            needed |= librilight_parts_of(cuts_path(manifests_dir, part))
    for part in sorted(needed):
        out = Path(librilight_dir)
        if (out / part).is_dir():
            logger.info("%s is there: not downloaded again", out / part)
            continue
        tar, unpacking = out / f"{part}.tar", out / f".unpacking-{part}"
        fetch(LIBRILIGHT_URL.format(part=part), tar)
        shutil.rmtree(unpacking, ignore_errors=True)  # an unpacking cut short starts again
        with tarfile.open(tar) as f:
            f.extractall(unpacking, filter="data")
        # renamed into place only when whole (the tar holds {part}/...)
        os.replace(unpacking / part if (unpacking / part).is_dir() else unpacking, out / part)
        shutil.rmtree(unpacking, ignore_errors=True)
        tar.unlink()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m valle.data.libriheavy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("download", help="the cut manifests (and with --librilight-dir, the audio)")
    d.add_argument("manifests_dir", type=Path)
    d.add_argument("--parts", default=" ".join(PARTS))
    d.add_argument("--librilight-dir", type=Path, default=None)
    r = sub.add_parser("prepare", help="recordings + supervisions manifests for bin/tokenizer.py")
    r.add_argument("--manifests-dir", type=Path, required=True, help="holds libriheavy_cuts_{part}.jsonl.gz")
    r.add_argument("--librilight-dir", type=Path, required=True,
                   help="LibriLight's root (holds small/, medium/, large/)")
    r.add_argument("--output-dir", type=Path, required=True)
    r.add_argument("--parts", default=" ".join(PARTS))
    r.add_argument("--text", choices=sorted(TEXT_INDEX), default="cased",
                   help="cased: the book's text, cased and punctuated (custom texts[0]); "
                        "upper: the ASR text, upper case without punctuation (texts[1])")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parts = args.parts.split()
    try:
        check_parts(parts)
        if args.cmd == "download":
            download(args.manifests_dir, parts, args.librilight_dir)
        else:
            if not args.librilight_dir.is_dir():
                raise ManifestError(f"--librilight-dir {args.librilight_dir}: no such directory")
            for part in parts:
                prepare_part(args.manifests_dir, args.librilight_dir, args.output_dir, part, args.text)
    except ManifestError as e:
        print(f"{p.prog} {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
