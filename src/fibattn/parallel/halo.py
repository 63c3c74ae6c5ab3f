"""Which rows each rank needs under context parallelism: the halo of a distance set (method.md §9).

A sequence of length ``T`` is split into ``P`` contiguous chunks of ``c = T / P`` rows; rank
``r`` owns rows ``[r·c, (r+1)·c)``. A query ``i`` reads keys ``i − d`` for ``d`` in a fixed set
``D``, so rank ``r`` needs, before its chunk, exactly the rows
``∪_{d ∈ D} [r·c − d, r·c − d + c) ∩ [0, r·c)`` — one interval of ``max(D)`` rows from the
previous rank while ``max(D) < c``, whatever ``T`` and ``P`` are, and only the referenced
intervals (never the whole prefix) when distances reach past a chunk. Dense attention
references every earlier row: its halo is the whole prefix (what ring attention moves).

Rows are kept as sorted, disjoint half-open intervals ``(lo, hi)`` of global positions, so a
plan at ``T = 1M`` costs a few hundred integers, not a million.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..checks import UsageError

Intervals = tuple[tuple[int, int], ...]


def merge(intervals) -> Intervals:
    """Sorted, disjoint, non-empty intervals covering the same rows."""
    out: list[list[int]] = []
    for lo, hi in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def clip(intervals: Intervals, lo: int, hi: int) -> Intervals:
    return merge((max(a, lo), min(b, hi)) for a, b in intervals)


def count(intervals: Intervals) -> int:
    return sum(b - a for a, b in intervals)


def needed(dists, rank: int, chunk: int) -> Intervals:
    """Rows before rank ``rank``'s chunk that its queries read; ``dists`` None: every earlier row
    (dense attention)."""
    start = rank * chunk
    if dists is None:
        return merge([(0, start)])
    return merge((max(0, start - d), min(start, start - d + chunk)) for d in dists if d > 0)


@dataclass(frozen=True)
class HaloPlan:
    """One rank's part of the exchange for one distance set: ``recv`` ``(source rank, rows)`` and
    ``send`` ``(destination rank, rows of its own chunk)``, in rank order; ``before``: the rows the
    local buffer holds ahead of the chunk (from the first needed row to the chunk's start)."""

    rank: int
    ranks: int
    chunk: int
    recv: tuple[tuple[int, Intervals], ...]
    send: tuple[tuple[int, Intervals], ...]
    before: int

    @property
    def rows_received(self) -> int:
        return sum(count(ivs) for _, ivs in self.recv)

    @property
    def rows_sent(self) -> int:
        return sum(count(ivs) for _, ivs in self.send)


def halo_plan(dists, rank: int, ranks: int, chunk: int) -> HaloPlan:
    """The exchange of rank ``rank`` of ``ranks`` for distance set ``dists`` (None: dense)."""
    if ranks < 1 or not 0 <= rank < ranks or chunk < 1:
        raise UsageError(f"a halo plan needs 0 <= rank < ranks and chunk >= 1, got rank {rank}, ranks {ranks}, "
                         f"chunk {chunk}")
    mine = needed(dists, rank, chunk)
    recv = tuple((src, ivs) for src in range(rank) if (ivs := clip(mine, src * chunk, (src + 1) * chunk)))
    send = tuple((dst, ivs) for dst in range(rank + 1, ranks)
                 if (ivs := clip(needed(dists, dst, chunk), rank * chunk, (rank + 1) * chunk)))
    before = rank * chunk - mine[0][0] if mine else 0
    return HaloPlan(rank, ranks, chunk, recv, send, before)


def ring_rows(ranks: int, chunk: int) -> int:
    """Rows a rank receives per layer under ring attention or an all-gather of keys and values."""
    return chunk * (ranks - 1)
