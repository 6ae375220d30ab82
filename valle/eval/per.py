"""Phoneme error rate: edit distance between phoneme sequences, over spoken symbols only."""

from __future__ import annotations

from collections.abc import Sequence


def is_spoken(symbol: str) -> bool:
    """Phonemes hold a letter (IPA letters and length marks are alphabetic); word separators
    ('_') and punctuation are not heard as sounds, so they are not scored."""
    return any(ch.isalpha() for ch in symbol)


def spoken(symbols: Sequence[str]) -> list[str]:
    return [s for s in symbols if is_spoken(s)]


def edit_distance(ref: Sequence, hyp: Sequence) -> int:
    """Levenshtein distance (substitutions, insertions, deletions all cost 1)."""
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, start=1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, start=1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1]


def error_rate(ref: Sequence, hyp: Sequence) -> float:
    """Edits / reference length; can exceed 1 when the hypothesis is much longer."""
    if not ref:
        return 0.0 if not hyp else 1.0
    return edit_distance(ref, hyp) / len(ref)
