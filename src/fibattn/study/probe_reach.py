"""Which distances a stack of attention layers can carry information across, in principle.

One layer moves information from position ``i - d`` to ``i`` for every ``d`` in its attended
set (method.md §1); the residual stream lets a layer pass information on unmoved (distance 0).
So ``n`` layers reach exactly the sums ``d_1 + … + d_n``, one distance from each layer's set
(0 allowed): the sumset of the sets. This is an upper bound on retrieval — whether a trained
model routes the key and value along such a path is what the probe measures.

Distances are grouped into power-of-two buckets ``[1], [2, 3], [4, 7], …`` so that one table
serves every evaluation length.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..checks import check_int


def reachable(distance_sets: Sequence[Sequence[int]], length: int) -> np.ndarray:
    """Boolean ``(length,)``: entry ``d`` says whether ``d`` is a sum of one distance per set
    (each set taken with 0, the residual path); sums ``>= length`` are dropped."""
    check_int("length", length, 1)
    reach = np.zeros(length, dtype=bool)
    reach[0] = True
    for ds in distance_sets:
        nxt = reach.copy()                                   # distance 0: the residual path
        for d in sorted(set(int(d) for d in ds)):
            if 0 < d < length:
                nxt[d:] |= reach[:length - d]
        reach = nxt
    return reach


def distance_buckets(max_distance: int) -> list[tuple[int, int]]:
    """Power-of-two buckets ``(lo, hi)`` covering ``1 .. max_distance``; the last one is cut at it."""
    check_int("max_distance", max_distance, 1)
    out, lo = [], 1
    while lo <= max_distance:
        out.append((lo, min(2 * lo - 1, max_distance)))
        lo *= 2
    return out


def bucket_label(bucket: tuple[int, int]) -> str:
    """``"1"`` or ``"4-7"``; a cut last bucket keeps the label of the whole one (its columns line up)."""
    lo = bucket[0]
    return str(lo) if lo == 1 else f"{lo}-{2 * lo - 1}"


def coverage(reach: np.ndarray, buckets: Sequence[tuple[int, int]]) -> dict:
    """Share of each bucket's distances that ``reach`` holds, by :func:`bucket_label`."""
    return {bucket_label(b): float(reach[b[0]:b[1] + 1].mean()) for b in buckets}


def smallest_unreachable(reach: np.ndarray, upto: int) -> int | None:
    """The smallest distance in ``1 .. upto`` that ``reach`` misses; None when it holds them all."""
    missing = np.flatnonzero(~reach[1:upto + 1])
    return int(missing[0]) + 1 if missing.size else None
