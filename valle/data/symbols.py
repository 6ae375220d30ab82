"""Symbol tables in k2's text format (``symbol id`` per line, ``<eps> 0`` first).

k2 and icefall are not required: this module reads and writes the same file
format, so k2/icefall tools can read our tables and we can read theirs. The *ids* are
ours: ``<pad> <bos> <eos>`` are reserved at 1-3 and the phonemes follow (sorted per part,
in the order parts finish when jobs run in parallel), and our phonemes differ from
lifeiteng/vall-e's (punctuation handling, tone marks kept inside phonemes), so a table or
checkpoint from that project cannot be swapped in id for id.
"""

from __future__ import annotations

import os
from pathlib import Path

EPS = "<eps>"
PAD = "<pad>"
BOS = "<bos>"
EOS = "<eos>"
# Reserved right after <eps> so the collater can use the table directly.
RESERVED = (EPS, PAD, BOS, EOS)


class SymbolTable:
    """A bidirectional symbol <-> id map with ids 0..3 reserved for eps/pad/bos/eos."""

    def __init__(self, reserve: bool = True) -> None:
        self._sym2id: dict[str, int] = {}
        self._id2sym: dict[int, str] = {}
        if reserve:
            for sym in RESERVED:
                self.add(sym)

    # ---- construction -------------------------------------------------
    @classmethod
    def from_symbols(cls, symbols: list[str] | set[str]) -> SymbolTable:
        """A table holding the reserved symbols then ``symbols`` sorted (stable ids across runs)."""
        table = cls()
        for sym in sorted(symbols):
            table.add(sym)
        return table

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> SymbolTable:
        table = cls(reserve=False)
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                # Split on the last whitespace: the id is the last field.
                fields = line.rsplit(maxsplit=1)
                if len(fields) != 2 or not fields[1].lstrip("-").isdigit():
                    raise ValueError(f"{path}:{lineno}: expected 'symbol id', got {line!r}")
                sym, idx = fields[0], int(fields[1])
                if sym in table._sym2id:
                    raise ValueError(f"{path}:{lineno}: duplicate symbol {sym!r}")
                if idx in table._id2sym:
                    raise ValueError(f"{path}:{lineno}: duplicate id {idx} ({sym!r})")
                table._sym2id[sym] = idx
                table._id2sym[idx] = sym
        if table._sym2id.get(EPS) != 0:
            raise ValueError(f"{path}: k2 symbol tables must map '{EPS}' to 0")
        return table

    def to_file(self, path: str | os.PathLike) -> None:
        """Write atomically (temp file + rename) so a crash never leaves half a table."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for idx in sorted(self._id2sym):
                f.write(f"{self._id2sym[idx]} {idx}\n")
        os.replace(tmp, path)

    # ---- mutation -----------------------------------------------------
    def add(self, sym: str) -> int:
        """Add ``sym`` (if new) with the next free id; return its id."""
        if sym in self._sym2id:
            return self._sym2id[sym]
        if not sym or any(c.isspace() for c in sym):
            raise ValueError(f"symbol {sym!r} is empty or contains whitespace (k2 format forbids it)")
        idx = max(self._id2sym, default=-1) + 1
        self._sym2id[sym] = idx
        self._id2sym[idx] = sym
        return idx

    # ---- lookup -------------------------------------------------------
    def get(self, sym: str) -> int:
        try:
            return self._sym2id[sym]
        except KeyError:
            raise KeyError(f"symbol {sym!r} is not in the symbol table") from None

    def __getitem__(self, key: int | str) -> int | str:
        if isinstance(key, str):
            return self.get(key)
        try:
            return self._id2sym[key]
        except KeyError:
            raise KeyError(f"id {key} is not in the symbol table") from None

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            return key in self._sym2id
        return key in self._id2sym

    def __len__(self) -> int:
        return len(self._sym2id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SymbolTable) and self._sym2id == other._sym2id

    @property
    def symbols(self) -> list[str]:
        return [self._id2sym[i] for i in sorted(self._id2sym)]

    @property
    def ids(self) -> list[int]:
        return sorted(self._id2sym)

    @property
    def pad_id(self) -> int:
        return self.get(PAD)

    @property
    def bos_id(self) -> int:
        return self.get(BOS)

    @property
    def eos_id(self) -> int:
        return self.get(EOS)
