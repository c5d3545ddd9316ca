"""Tournaments within a group of samples: who is compared with whom, and each sample's win fraction.

Patterns (the cookbook's ``TournamentPattern`` names):
- ``all_pairs_one_way`` — every unordered pair once, ``(i, j)`` with ``i < j``: n(n−1)/2 comparisons;
- ``all_pairs_both_ways`` — every ordered pair, ``(i, j)`` with ``i != j``: n(n−1) comparisons (each pair
  judged with each sample first; with a judge that already averages both orders this doubles the cost
  for nothing, so one way is our default);
- chunked (``chunk_size > 0``): the pattern within consecutive chunks of ``chunk_size`` samples only,
  about n·chunk_size/2 comparisons instead of n²/2, for large groups. A last chunk of one sample joins
  the chunk before it, so every sample has an opponent.

A comparison ``(i, j)`` gives ``j`` (the second) a win ``w`` in [0, 1] and ``i`` the complement ``1 − w``;
a sample's reward is its **win fraction**: its wins divided by the comparisons it took part in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

TournamentPattern = Literal["all_pairs_one_way", "all_pairs_both_ways"]
TOURNAMENT_PATTERNS: tuple[str, ...] = get_args(TournamentPattern)
Pair = tuple[int, int]


def all_pairs_one_way(n: int) -> list[Pair]:
    return [(i, j) for i in range(n) for j in range(i + 1, n)]


def all_pairs_both_ways(n: int) -> list[Pair]:
    return [(i, j) for i in range(n) for j in range(n) if i != j]


PATTERNS = {"all_pairs_one_way": all_pairs_one_way, "all_pairs_both_ways": all_pairs_both_ways}


def chunks(n: int, chunk_size: int) -> list[range]:
    """Consecutive index ranges of ``chunk_size`` (0 = one chunk); a trailing single joins the previous chunk."""
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 0 (0 = no chunking), got {chunk_size}")
    if chunk_size == 0 or chunk_size >= n:
        return [range(n)]
    if chunk_size == 1:
        raise ValueError("chunk_size=1 leaves every sample without an opponent; use 0 (no chunking) or >= 2")
    found = [range(start, min(start + chunk_size, n)) for start in range(0, n, chunk_size)]
    if len(found) > 1 and len(found[-1]) == 1:
        found[-2:] = [range(found[-2].start, n)]
    return found


def tournament_pairs(n: int, pattern: str = "all_pairs_one_way", chunk_size: int = 0) -> list[Pair]:
    """The comparisons of a group of ``n`` samples under ``pattern``, within chunks when ``chunk_size > 0``."""
    if pattern not in PATTERNS:
        raise ValueError(f"tournament pattern {pattern!r} is not one of {TOURNAMENT_PATTERNS}")
    if n < 2:
        raise ValueError(f"a tournament needs at least 2 samples, got {n}: raise group_size")
    return [
        (chunk.start + i, chunk.start + j) for chunk in chunks(n, chunk_size) for i, j in PATTERNS[pattern](len(chunk))
    ]


def win_fractions(n: int, pairs: Sequence[Pair], second_wins: Sequence[float]) -> list[float]:
    """Each sample's wins over the comparisons it took part in (``second_wins[k]``: j's win in pair k)."""
    if len(pairs) != len(second_wins):
        raise ValueError(f"{len(pairs)} pairs but {len(second_wins)} verdicts; give one verdict per pair")
    wins = [0.0] * n
    played = [0] * n
    for (i, j), win in zip(pairs, second_wins):
        if not 0.0 <= win <= 1.0:
            raise ValueError(f"pair ({i}, {j}): win {win} is outside [0, 1]")
        wins[j] += win
        wins[i] += 1.0 - win
        played[i] += 1
        played[j] += 1
    missing = [index for index in range(n) if played[index] == 0]
    if missing:
        raise ValueError(f"samples {missing} took part in no comparison: every sample needs an opponent")
    return [w / p for w, p in zip(wins, played)]
