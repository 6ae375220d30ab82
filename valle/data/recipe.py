"""Recipe steps on tokenized cut manifests (egs/*/prepare.sh stages 3-5), streaming.

    python -m valle.data.recipe combine OUT IN [IN ...]     join parts; repeated cut ids dropped
    python -m valle.data.recipe split ALL --dev N --test M --prefix P --output-dir D [--rest train]
        (both write each output's extremes record next to it: {prefix}_extremes_{part}.json)
    python -m valle.data.recipe describe CUTS [CUTS ...]     counts, hours, durations, text tokens, languages
    python -m valle.data.recipe shar CUTS OUT_DIR [--shard-size 1000]
    python -m valle.data.recipe merge-stats OUT IN [IN ...]  several corpora's text stats as one dataset's
    python -m valle.data.recipe extremes CUTS [CUTS ...]     the extremes record of a combined/split part
    python -m valle.data.recipe merge-extremes OUT IN [IN ...]  disjoint parts' extremes records as one
    python -m valle.data.recipe download|prepare libritts|ljspeech|aishell3|aishell PATHS...   lhotse's recipes

Errors are one line naming the file (exit 2); dropped items are listed, never silent.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import shutil
import sys
from pathlib import Path

from valle.data import validation as V
from valle.data.extremes import Extremes, extremes_path_of
from valle.data.manifests import ManifestError

logger = logging.getLogger("recipe")


def _iter(path: Path):
    """Cut dicts of a manifest (plain JSON: these steps need no lhotse, so they start fast);
    a missing or truncated file is one error line naming it."""
    from valle.data.manifests import read_jsonl

    yield from read_jsonl(path)


class _Writer:
    """A ``.jsonl.gz`` written under a temporary name; ``finish`` renames it into place."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(".tmp." + self.path.name)
        self.f = gzip.open(self.tmp, "wt", encoding="utf-8")

    def write(self, item: dict) -> None:
        self.f.write(json.dumps(item, ensure_ascii=False) + "\n")

    def close(self) -> None:
        self.f.close()

    def finish(self) -> None:
        self.close()
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        self.close()
        self.tmp.unlink(missing_ok=True)


class _SeenIds:
    """The cut ids written so far, in an SQLite table next to the output (deleted after): flat
    memory at any corpus size (Libriheavy large's 10M ids are ~1 GB as a Python set). A disk
    set, not a per-part check: parts are disjoint only by how they were made, and a repeated
    cut would train twice per epoch, so every id is checked against every other, exactly."""

    def __init__(self, near: Path) -> None:
        import sqlite3

        self.path = Path(near).with_name(f".ids.{os.getpid()}.{Path(near).name}.sqlite")
        self.path.unlink(missing_ok=True)
        self.db = sqlite3.connect(self.path, isolation_level=None)
        # a scratch table: no journal, no fsync; SQLite's page cache (2 MB) bounds the memory
        self.db.execute("PRAGMA journal_mode=OFF")
        self.db.execute("PRAGMA synchronous=OFF")
        self.db.execute("CREATE TABLE ids (id TEXT PRIMARY KEY) WITHOUT ROWID")
        self.db.execute("BEGIN")
        self.count = 0

    def add(self, cut_id: str) -> bool:
        """True when ``cut_id`` is new (and now recorded), False when it was seen before."""
        new = self.db.execute("INSERT OR IGNORE INTO ids VALUES (?)", (cut_id,)).rowcount == 1
        self.count += new
        return new

    def close(self) -> None:
        self.db.close()
        self.path.unlink(missing_ok=True)


class RecordOnTheWay:
    """The extremes record of a manifest being written, built from the cuts as they pass
    (bounded memory); none, said once, for a name the trainer never reads."""

    def __init__(self, output: Path) -> None:
        self.output = Path(output)
        self.target = extremes_path_of(output)
        if self.target is None:
            print(f"no extremes record: {output} is not named {{prefix}}_cuts_{{part}}.jsonl.gz")
        self.record = Extremes()

    def add(self, cut: dict, source: Path) -> None:
        if self.target is None:
            return
        try:
            self.record.add_dict(cut)
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{source}: cut {cut.get('id')!r} has no {e} for the extremes record "
                                f"({type(e).__name__}); is it a tokenized cut?") from None

    def save(self, step: str) -> None:
        if self.target is not None:
            self.record.write(self.target)
            print(f"{step}: extremes record of {self.output.name} ({self.record.count} cuts) -> {self.target}")


def combine(output: Path, inputs: list[Path]) -> V.ValidationReport:
    """Concatenate cut manifests (one input is fine). A cut id seen before is dropped and
    reported: a duplicated cut would train twice per epoch. The output's extremes record is
    made in the same pass (it is correct with dropped duplicates, where merging the inputs'
    records would count them twice, and it costs no extra read)."""
    report, record = V.ValidationReport(), RecordOnTheWay(output)
    writer, seen = _Writer(output), _SeenIds(output)
    try:
        for path in inputs:
            for cut in _iter(path):
                report.checked += 1
                if not seen.add(cut["id"]):
                    report.add(cut["id"], V.DUPLICATE_ID, f"repeated in {path.name} (the first is kept)")
                    continue
                writer.write(cut)
                record.add(cut, path)
    except BaseException:
        writer.discard()
        raise
    finally:
        seen.close()
    writer.finish()
    record.save("combine")
    for e in report.entries:
        print(f"combine: dropped {e.cut_id}: {e.reason} ({e.detail})")
    print(f"combine: {seen.count} cuts from {len(inputs)} manifest(s) -> {output}; {report.summary()}")
    return report


def split(all_path: Path, output_dir: Path, prefix: str, num_dev: int, num_test: int,
          rest: str = "train") -> dict[str, int]:
    """First ``num_dev`` cuts -> dev, next ``num_test`` -> test, the rest -> ``rest`` (train;
    a corpus whose only held-out part is "test", AISHELL-3, takes its dev from it with
    ``--test 0 --rest test``). Each part's extremes record is made in the same pass."""
    counts = {"dev": 0, "test": 0, rest: 0}
    paths = {k: output_dir / f"{prefix}_cuts_{k}.jsonl.gz" for k in counts}
    if Path(all_path).resolve() in {p.resolve() for p in paths.values()}:
        raise ManifestError(f"{all_path}: split would overwrite its own input (choose another --prefix)")
    records = {k: RecordOnTheWay(p) for k, p in paths.items()}
    writers = {k: _Writer(p) for k, p in paths.items()}
    try:
        for i, cut in enumerate(_iter(all_path)):
            part = "dev" if i < num_dev else "test" if i < num_dev + num_test else rest
            writers[part].write(cut)
            records[part].add(cut, all_path)
            counts[part] += 1
        if counts[rest] == 0:
            raise ManifestError(f"{all_path}: only {sum(counts.values())} cuts, cannot hold out "
                                f"{num_dev} for dev and {num_test} for test (lower --num-dev/--num-test)")
    except BaseException:
        for w in writers.values():
            w.discard()
        raise
    for w in writers.values():
        w.finish()
    for record in records.values():
        record.save("split")
    print(f"split: {counts} -> {output_dir}")
    return counts


def describe(path: Path) -> dict:
    import numpy as np

    durations, tokens, speakers, languages = [], [], set(), {}
    for cut in _iter(path):
        sup = (cut.get("supervisions") or [{}])[0]
        custom = sup.get("custom") or {}
        durations.append(float(cut["duration"]))
        tokens.append(int(custom.get("num_text_tokens", len((custom.get("tokens") or {}).get("text", [])))))
        speakers.add(sup.get("speaker"))
        # the voice the text was phonemized with: what VALL-E X's language ids are made of
        voice = custom.get("espeak_voice") or "?"
        languages[voice] = languages.get(voice, 0) + 1
    d = np.array(durations or [0.0])
    t = np.array(tokens or [0])
    info = {"cuts": len(durations), "hours": float(d.sum() / 3600), "speakers": len(speakers - {None}),
            "languages": dict(sorted(languages.items()))}
    langs = ", ".join(f"{k} {n}" for k, n in info["languages"].items()) or "none"
    print(f"{path}: {info['cuts']} cuts, {info['hours']:.3f} h, {info['speakers']} speakers; duration s "
          f"min/median/p99/max {d.min():.2f}/{np.median(d):.2f}/{np.percentile(d, 99):.2f}/{d.max():.2f}; "
          f"text tokens/s {t.sum() / max(d.sum(), 1e-9):.1f}; longest text {int(t.max())} tokens; "
          f"cuts per language: {langs}")
    return info


def merge_stats(output: Path, inputs: list[Path]) -> dict:
    """Several corpora's ``{prefix}_text_stats.json`` (bin/tokenizer.py) as one dataset's: the
    trainer's --max-text-tokens auto and VALL-E X's language list read ``{dataset}_text_stats.json``
    of the combined dataset. Parts are named ``{prefix}/{part}``."""
    from valle.data.pipeline import Stats, _atomic_write

    parts, total = {}, Stats()
    for path in inputs:
        if not Path(path).is_file():
            raise ManifestError(f"{path}: no such text stats file (run bin/tokenizer.py first)")
        prefix = Path(path).name.removesuffix("_text_stats.json")
        for part, d in json.loads(Path(path).read_text(encoding="utf-8"))["parts"].items():
            parts[f"{prefix}/{part}"] = d
            total.merge(Stats.from_json(d))
    data = {"parts": parts, "total": {k: v for k, v in total.to_json().items() if k != "rate_hist"}}
    _atomic_write(Path(output), json.dumps(data, indent=1, ensure_ascii=False))
    langs = ", ".join(f"{k} {int(v['cuts'])}" for k, v in sorted(total.languages.items()))
    print(f"merge-stats: {len(parts)} parts from {len(inputs)} file(s) -> {output}; cuts per language: {langs}")
    return data


def shar(path: Path, out_dir: Path, shard_size: int) -> list[str]:
    from valle.data.pipeline import export_shar

    if not Path(path).is_file():
        raise ManifestError(f"{path}: no such cut manifest")
    files = export_shar(Path(path), Path(out_dir), shard_size)
    record = extremes_path_of(path)
    if record is not None and record.is_file():
        # beside the shard dir, where the trainer's --shar-dir looks for it (valle/data/shar.py)
        prefix = record.name.split("_extremes_")[0]
        shutil.copyfile(record, Path(out_dir).parent / f"{prefix}_extremes_{Path(out_dir).name}.json")
    print(f"shar: {path} -> {out_dir} ({sum(1 for f in files if '/cuts.' in f)} shard(s))")
    return files


def extremes_of_manifest(path: Path) -> Path:
    """``{prefix}_extremes_{part}.json`` for ``{prefix}_cuts_{part}.jsonl.gz``: where the trainer
    looks for the part's extremes record (``valle.data.extremes``)."""
    out = extremes_path_of(path)
    if out is None:
        raise ManifestError(f"{path}: not named {{prefix}}_cuts_{{part}}.jsonl.gz: no extremes record name for it")
    return out


def write_extremes(path: Path) -> Path:
    """The extremes record of a combined or split manifest, in one streaming pass (bounded
    memory): parts made by combine/split/interleave have no tokenizer record of their own."""
    from lhotse import CutSet

    from valle.data.extremes import Extremes

    if not Path(path).is_file():
        raise ManifestError(f"{path}: no such cut manifest")
    out = extremes_of_manifest(path)
    record = Extremes.of(CutSet.from_jsonl_lazy(path))
    record.write(out)
    print(f"extremes: {record.count} cuts of {path} -> {out}")
    return out


def merge_extremes(output: Path, inputs: list[Path]) -> None:
    """Disjoint parts' extremes records as the record of their union (Libriheavy's small,
    medium and large -> train), with no pass over the cuts."""
    from valle.data.extremes import Extremes

    total = Extremes()
    for path in inputs:
        if not Path(path).is_file():
            raise ManifestError(f"{path}: no such extremes record (bin/tokenizer.py writes one per part)")
        try:
            total.merge(Extremes.read(path))
        except ValueError as e:
            raise ManifestError(str(e)) from None
    total.write(output)
    print(f"merge-extremes: {total.count} cuts from {len(inputs)} record(s) -> {output}")


def lhotse_step(step: str, corpus: str, args: list[str], num_jobs: int = 1) -> None:
    """lhotse's download_/prepare_<corpus> (stages 0-1), a failure as one line naming the corpus
    directory instead of lhotse's assertion traceback."""
    import importlib

    mod = importlib.import_module(f"lhotse.recipes.{corpus}")
    fn = getattr(mod, f"{step}_{corpus}")
    try:
        if step == "download":
            target, *parts = args
            fn(target, dataset_parts=parts) if parts else fn(target)
        else:
            src, out, *parts = args
            fn(src, parts, out, num_jobs=max(1, num_jobs)) if parts else fn(src, out)
    except Exception as e:  # lhotse raises AssertionError/OSError/ValueError on bad corpora
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ManifestError(f"lhotse {step}_{corpus} {args[0]}: {type(e).__name__}: {msg}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m valle.data.recipe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("combine")
    c.add_argument("output", type=Path)
    c.add_argument("inputs", type=Path, nargs="+")
    s = sub.add_parser("split")
    s.add_argument("all", type=Path)
    s.add_argument("--output-dir", type=Path, required=True)
    s.add_argument("--prefix", required=True)
    s.add_argument("--dev", type=int, default=300)
    s.add_argument("--test", type=int, default=300)
    s.add_argument("--rest", default="train", help="the part the cuts after dev and test go to")
    d = sub.add_parser("describe")
    d.add_argument("cuts", type=Path, nargs="+")
    h = sub.add_parser("shar")
    h.add_argument("cuts", type=Path)
    h.add_argument("output_dir", type=Path)
    h.add_argument("--shard-size", type=int, default=1000)
    m = sub.add_parser("merge-stats")
    m.add_argument("output", type=Path)
    m.add_argument("inputs", type=Path, nargs="+")
    e = sub.add_parser("extremes", help="write each manifest's extremes record next to it (one pass)")
    e.add_argument("cuts", type=Path, nargs="+")
    me = sub.add_parser("merge-extremes", help="disjoint parts' extremes records as one")
    me.add_argument("output", type=Path)
    me.add_argument("inputs", type=Path, nargs="+")
    for step in ("download", "prepare"):
        x = sub.add_parser(step, help=f"lhotse's {step}_<corpus> with a one-line error")
        x.add_argument("corpus", choices=["libritts", "ljspeech", "aishell3", "aishell"])
        x.add_argument("paths", nargs="+", help="download: TARGET [PARTS...]; prepare: CORPUS_DIR OUT_DIR [PARTS...]")
        x.add_argument("--num-jobs", type=int, default=1)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.cmd == "combine":
            combine(args.output, args.inputs)
        elif args.cmd == "split":
            split(args.all, args.output_dir, args.prefix, args.dev, args.test, args.rest)
        elif args.cmd == "describe":
            for path in args.cuts:
                describe(path)
        elif args.cmd == "merge-stats":
            merge_stats(args.output, args.inputs)
        elif args.cmd == "extremes":
            for path in args.cuts:
                write_extremes(path)
        elif args.cmd == "merge-extremes":
            merge_extremes(args.output, args.inputs)
        elif args.cmd == "shar":
            shar(args.cuts, args.output_dir, args.shard_size)
        else:
            lhotse_step(args.cmd, args.corpus, args.paths, args.num_jobs)
    except ManifestError as e:
        print(f"{p.prog} {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
