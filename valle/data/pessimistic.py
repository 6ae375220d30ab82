"""The pessimistic batches of the OOM scan, built from the extremes record without a pass.

``CRITERIA`` scores a batch (a list of cuts) per criterion: lhotse's
``find_pessimistic_batches`` criteria plus the text ones (text that phonemizes into long
sequences is what blew up memory in the reference discussion; duration alone does not see
it). The scan runs, per criterion, the batch that scores highest.

Without a pass over the manifest (``worst_batches``), each criterion's batch is ``n(c)``
copies of one candidate cut ``c``, ``n(c)`` the most copies the batch budget admits
(``TextTokenConstraint.fits_sizes``: padded costs, as the sampler counts them). Why that is
at least as bad as any batch ``B`` the sampler can form from the corpus (every cut of ``B``
passes the training filters, ``B`` fits the budget):

1. Copies bound batches. Let ``c`` be the cut of ``B`` with the longest audio (audio
   criteria) or the longest text (text criteria). ``|B|`` copies of ``c`` spend no more
   padded budget than ``B``, so ``n(c) >= |B|``, and ``n(c)`` copies of ``c`` score at least
   ``B``'s score for every criterion: longest cut / longest text equal, number of cuts,
   total seconds and padded text ``n(c)`` times a value at least ``B``'s.
2. The record bounds copies. Per duration bin the record keeps Pareto frontiers
   (``valle.data.extremes``). A kept cut ``c`` of a bin is matched or beaten by a frontier
   cut ``f`` of its bin: on ``longest``, ``d_f >= d_c`` and ``t_f <= t_c``; take the
   shortest such ``f``, so ``d_c`` lies above the next frontier cut's duration (or the
   bin's start). Copies of ``c`` fit ``m = n(c)`` times, so ``d_c`` is at most the longest
   duration ``d_m`` at which ``m`` copies fit. The candidates from ``f`` are ``f`` itself
   and ``f`` cut down (lhotse truncation, its text kept) to each ``d_m`` and to the longest
   duration the filters keep, inside that range: one of them is at least as long as ``c``
   with no more text, fits ``m`` times and passes the filters, so it scores at least as
   high as ``c`` on every audio criterion. The ``longest_text`` frontier does the same
   along text (``t_f >= t_c``, ``d_f <= d_c``; candidates ``f`` with its text tokens cut
   to ``t_m`` and to the longest text that fits one batch), and ``shortest`` holds the cut
   of the most copies (fewest seconds and tokens). Among candidates of equal score the
   heavier batch wins (padded frames plus text tokens), so the longest cut is scanned
   with the most text found at that length, not the least.

So the best candidate per criterion scores at least as high as any batch of the corpus,
and it is a batch the sampler could form from cuts no larger than real ones. Candidates
cut down are marked in their id (``..._cut_to_2.4s``, ``..._text_to_180``). One limit:
``--filter-min-duration`` inside a bin can remove a frontier cut shorter than the bound
while longer cuts it stood for remain (a cut cannot be lengthened); the text criteria and
``max_num_cuts`` are then exact to within that bin (0.5 s). The default 0 never does.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

from valle.codec.constants import FRAME_RATE
from valle.data.collation import num_text_tokens
from valle.data.extremes import Entry, Extremes, bin_start

CRITERIA: dict[str, Callable[[Any], float]] = {
    "single_longest_cut": lambda cuts: max(c.duration for c in cuts),
    "largest_batch_cuts_duration": lambda cuts: sum(c.duration for c in cuts),
    "max_num_cuts": lambda cuts: len(cuts),
    "single_longest_text": lambda cuts: max(num_text_tokens(c) for c in cuts),
    "largest_batch_text_tokens": lambda cuts: len(cuts) * max(num_text_tokens(c) for c in cuts),
}


def worst_of(batches) -> dict[str, tuple[float, Any]]:
    """Per criterion, (score, batch) of the highest-scoring batch; the first one on a tie."""
    best: dict[str, tuple[float, Any]] = {}
    for cuts in batches:
        for name, score in CRITERIA.items():
            value = score(cuts)
            if name not in best or value > best[name][0]:
                best[name] = (value, cuts)
    return best


def copies_that_fit(constraint, duration: float, text_length: int) -> int:
    """The most copies of one cut (``text_length`` with bos/eos) that fit one batch (>= 1)."""
    most = _most_copies(constraint, text_length)
    bounds = [] if most is None else [most]
    if constraint.max_duration is not None:
        bounds.append(math.floor((constraint.max_duration + 1e-9) / max(constraint.duration_cost(duration), 1e-9)))
    n = max(1, min(bounds)) if bounds else 1
    while n > 1 and not constraint.fits_sizes(n, duration, text_length):  # float edges
        n -= 1
    return n


def longest_duration_allowed(cut_filter) -> float:
    """The longest duration the training filters keep: --filter-max-duration, or less when a
    cut that long alone would exceed --max-duration (with its quadratic term)."""
    constraint = cut_filter.constraint
    bound = cut_filter.max_duration
    if constraint.max_duration is not None:
        bound = min(bound, duration_for_cost(constraint, constraint.max_duration))
    return bound


def duration_for_cost(constraint, cost: float) -> float:
    """The duration whose padded cost is ``cost`` (solves d + d^2/q = cost)."""
    q = constraint.quadratic_duration
    return q * (math.sqrt(1 + 4 * cost / q) - 1) / 2 if q else cost


def _most_copies(constraint, text_length: int) -> int | None:
    """How many copies the text budget and --max-cuts allow at most (None: no bound)."""
    bounds = [constraint.max_cuts] if constraint.max_cuts is not None else []
    if constraint.max_text_tokens is not None:
        bounds.append(constraint.max_text_tokens // max(text_length, 1))
    return min(bounds) if bounds else None


def duration_steps(constraint, longest: float, shortest: float, text_length: int) -> list[float]:
    """The durations in (shortest, longest) at which one more copy starts to fit: d_m, the
    longest duration of which m copies fit, for every m above the copies at ``longest``."""
    if constraint.max_duration is None:
        return []
    most = _most_copies(constraint, text_length)
    m = copies_that_fit(constraint, longest, text_length) + 1
    out = []
    while most is None or m <= most:
        d = duration_for_cost(constraint, constraint.max_duration / m)
        if d <= shortest:
            break
        out.append(d)
        m += 1
    return out


def text_steps(constraint, longest: int, shortest: int, duration: float) -> list[int]:
    """The text lengths (bos/eos included) in (shortest, longest) at which one more copy
    starts to fit the text budget."""
    if constraint.max_text_tokens is None:
        return []
    m = copies_that_fit(constraint, duration, longest) + 1
    most_by_duration = copies_that_fit(constraint, duration, 1)  # text cut down adds no more
    out = []
    while m <= most_by_duration:
        t = constraint.max_text_tokens // m
        if t <= shortest:
            break
        if t < longest:
            out.append(t)
        m += 1
    return out


def candidates(record: Extremes, cut_filter) -> list[tuple[float, int, Entry]]:
    """(duration, text tokens, the record's cut it is made from) of every candidate the
    filters keep (see the module docstring)."""
    constraint = cut_filter.constraint
    extra = constraint.extra_tokens
    bound = longest_duration_allowed(cut_filter)
    longest_text = constraint.max_text_tokens  # with bos/eos; None: no bound
    out: dict[tuple[float, int, str], Entry] = {}

    def add(duration: float, text_tokens: int, entry: Entry) -> None:
        out[(duration, text_tokens, entry.cut_id)] = entry

    for index, b in record.bins.items():
        for e in b.best["shortest"]:
            add(e.duration, e.text_tokens, e)
        front = b.best["longest"]  # longest first
        for i, f in enumerate(front):
            below = front[i + 1].duration if i + 1 < len(front) else bin_start(index)
            durations = {f.duration, *duration_steps(constraint, min(f.duration, bound), below,
                                                     f.text_tokens + extra)}
            if below < bound < f.duration:
                durations.add(bound)
            for d in durations:
                if below < d <= f.duration:
                    add(d, f.text_tokens, f)
        front = b.best["longest_text"]  # most text first
        for i, f in enumerate(front):
            if f.duration > bound >= bin_start(index):  # its text on the longest audio kept
                add(bound, f.text_tokens, f)
            below = front[i + 1].text_tokens + extra if i + 1 < len(front) else extra - 1
            top = f.text_tokens + extra
            if longest_text is not None:
                top = min(top, longest_text)
            lengths = {f.text_tokens + extra, top, *text_steps(constraint, top, below, f.duration)}
            for t in lengths:
                if below < t <= f.text_tokens + extra:
                    add(f.duration, t - extra, f)
    return [(d, t, out[(d, t, cut_id)]) for d, t, cut_id in sorted(out, key=lambda k: (k[2], -k[0], -k[1]))
            if cut_filter.problem_of(d, t + extra) is None]


def scores(constraint, duration: float, text_tokens: int) -> tuple[int, dict[str, float]]:
    """(copies, the criteria's scores of a batch of that many copies of such a cut)."""
    n = copies_that_fit(constraint, duration, text_tokens + constraint.extra_tokens)
    return n, {"single_longest_cut": duration, "largest_batch_cuts_duration": n * duration,
               "max_num_cuts": n, "single_longest_text": text_tokens,
               "largest_batch_text_tokens": n * text_tokens}


def materialize(entry: Entry, duration: float, text_tokens: int):
    """The entry's cut as a lhotse cut, cut down to ``duration`` and ``text_tokens``."""
    from lhotse.serialization import deserialize_item
    from lhotse.utils import fastcopy

    cut = deserialize_item(copy.deepcopy(entry.cut))  # lhotse pops keys off the dict it reads
    if duration < entry.duration:
        cut = cut.truncate(duration=duration, keep_excessive_supervisions=True, preserve_id=True)
        cut = fastcopy(cut, id=f"{entry.cut_id}_cut_to_{duration:.3f}s")
    if text_tokens < entry.text_tokens:
        sup = cut.supervisions[0]
        custom = dict(sup.custom)
        custom["tokens"] = dict(custom["tokens"], text=list(custom["tokens"]["text"])[:text_tokens])
        custom["num_text_tokens"] = text_tokens
        cut = fastcopy(cut, id=f"{cut.id}_text_to_{text_tokens}",
                       supervisions=[fastcopy(sup, custom=custom), *cut.supervisions[1:]])
    return cut


def copy_batch(cut, n: int) -> list:
    """``n`` copies of ``cut`` with distinct ids (the collater keys rows by id)."""
    from lhotse.utils import fastcopy

    return [cut] + [fastcopy(cut, id=f"{cut.id}_copy{i}") for i in range(1, n)]


def worst_batches(record: Extremes, cut_filter) -> dict[str, tuple[float, list]]:
    """Per criterion, (score, cuts) of a batch at least as bad as any the sampler could form
    from the part the record describes (see the module docstring). Empty when the filters
    keep no candidate."""
    constraint = cut_filter.constraint
    best: dict[str, tuple[tuple[float, float], tuple]] = {}
    for cand in candidates(record, cut_filter):
        n, values = scores(constraint, cand[0], cand[1])
        # On a tie, the heavier batch: padded audio frames plus text tokens (what memory follows).
        weight = n * (cand[0] * FRAME_RATE + cand[1])
        for name, value in values.items():
            if name not in best or (value, weight) > best[name][0]:
                best[name] = ((value, weight), cand)
    out = {}
    for name, score in CRITERIA.items():
        if name in best:
            _key, (duration, tokens, entry) = best[name]
            # lhotse cuts a duration to whole samples: count and score the cut it made
            cut = materialize(entry, duration, tokens)
            batch = copy_batch(cut, copies_that_fit(constraint, cut.duration, constraint.text_length(cut)))
            out[name] = (score(batch), batch)
    return out
