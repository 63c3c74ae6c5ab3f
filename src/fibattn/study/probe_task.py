"""The retrieval probe's synthetic task (method.md §5): a pure function of a seed.

A sample is ``T`` token ids; the answer is read at the final position ``q = T - 1``.

- Vocabulary, in disjoint ranges: ``filler`` ids, ``key`` ids, ``value`` ids and (marked
  variant) one ``marker`` id per distance: ``[0, F)``, ``[F, F+K)``, ``[F+K, F+K+V)``, then markers.
- The queried pair: its key at ``q - d - 1`` and its value at ``q - d``, so the value sits
  exactly ``d`` tokens before the query; position ``q`` repeats the key; the model must
  output the value there (it is the next-token prediction at ``q``).
- ``n_distractors`` further key–value pairs at random free places; their keys never equal
  the queried key (values are unconstrained). Every other position is a random filler id.
- plain variant: each sample plants one pair at a distance drawn from ``distances``.
- marked variant (**Decision**): one pair *per* distance, all with the queried key and
  distinct values, and a marker token at ``q - 1`` naming the asked distance; the answer
  is the value at that distance. One model must therefore serve every distance at once,
  and only the position (not the key) tells the pairs apart.

Everything is drawn from ``numpy.random.default_rng(seed)``; the same seed gives the same batch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..checks import UsageError, check_int


@dataclass(frozen=True)
class ProbeTask:
    seq_len: int = 48
    distances: tuple = (20, 32)
    marked: bool = False
    n_keys: int = 16
    n_values: int = 16
    n_filler: int = 8
    n_distractors: int = 6

    def __post_init__(self):
        object.__setattr__(self, "distances", tuple(int(d) for d in self.distances))
        self.validate()

    def validate(self) -> None:
        check_int("probe seq_len (--seq-len)", self.seq_len, 4)
        check_int("probe n_keys", self.n_keys, 2)
        check_int("probe n_values", self.n_values, max(2, len(self.distances) if self.marked else 2))
        check_int("probe n_filler", self.n_filler, 1)
        check_int("probe n_distractors", self.n_distractors, 0)
        if not self.distances:
            raise UsageError("probe distances must hold at least one distance (--distances)")
        if len(set(self.distances)) != len(self.distances):
            raise UsageError(f"probe distances must be distinct (--distances), got {self.distances}")
        low = 2 if self.marked else 1
        for d in self.distances:
            check_int("probe distance (--distances)", d, low)
            if d + 2 > self.seq_len:
                raise UsageError(f"probe distance {d} needs seq_len >= {d + 2} (key at q-d-1), got {self.seq_len}; "
                                 "raise --seq-len or lower --distances")
        if self.marked:
            ds = sorted(self.distances)
            if any(b - a < 2 for a, b in zip(ds, ds[1:])):
                raise UsageError(f"marked probe distances must differ by >= 2 (pairs must not overlap), got {ds}")
        free = self.seq_len - 1 - (1 if self.marked else 0) - 2 * (len(self.distances) if self.marked else 1)
        if 2 * self.n_distractors > free // 2:
            raise UsageError(f"probe n_distractors={self.n_distractors} is too many for seq_len={self.seq_len}: "
                             f"at most {free // 4} distractor pairs fit comfortably")

    # ------------------------------------------------------------------ vocabulary
    @property
    def key_base(self) -> int:
        return self.n_filler

    @property
    def value_base(self) -> int:
        return self.n_filler + self.n_keys

    @property
    def marker_base(self) -> int:
        return self.value_base + self.n_values

    @property
    def vocab_size(self) -> int:
        return self.marker_base + (len(self.distances) if self.marked else 0)

    @property
    def chance(self) -> float:
        """Accuracy of guessing a value uniformly."""
        return 1.0 / self.n_values

    def to_dict(self) -> dict:
        return {**asdict(self), "distances": list(self.distances)}


@dataclass
class ProbeBatch:
    """``tokens (N, T)`` int64; per sample the answer value id, its distance, the queried key id
    and the value's position; ``query_pos = T - 1``."""

    tokens: np.ndarray
    answers: np.ndarray
    distances: np.ndarray
    keys: np.ndarray
    value_pos: np.ndarray
    query_pos: int


def _place_distractors(row: np.ndarray, free: np.ndarray, task: ProbeTask, key: int, rng) -> None:
    for _ in range(task.n_distractors):
        starts = np.flatnonzero(free[:-1] & free[1:])
        if starts.size == 0:
            return
        p = int(starts[rng.integers(starts.size)])
        other = int(rng.integers(task.n_keys - 1))
        other += other >= key                                    # any key but the queried one
        row[p] = task.key_base + other
        row[p + 1] = task.value_base + int(rng.integers(task.n_values))
        free[p:p + 2] = False


def _sample(task: ProbeTask, rng, asked: int | None) -> tuple[np.ndarray, int, int, int]:
    T, q = task.seq_len, task.seq_len - 1
    row = rng.integers(task.n_filler, size=T).astype(np.int64)
    free = np.ones(T, dtype=bool)
    free[q] = False
    key = int(rng.integers(task.n_keys))
    row[q] = task.key_base + key
    j = int(rng.integers(len(task.distances))) if asked is None else task.distances.index(asked)
    if task.marked:
        values = rng.choice(task.n_values, size=len(task.distances), replace=False)
        planted = list(zip(task.distances, values))
        row[q - 1] = task.marker_base + j
        free[q - 1] = False
    else:
        planted = [(task.distances[j], int(rng.integers(task.n_values)))]
    for d, value in planted:
        row[q - d - 1] = task.key_base + key
        row[q - d] = task.value_base + int(value)
        free[q - d - 1:q - d + 1] = False
    _place_distractors(row, free, task, key, rng)
    d = task.distances[j]
    return row, int(row[q - d]), d, task.key_base + key


def make_batch(task: ProbeTask, n: int, seed, *, distance: int | None = None) -> ProbeBatch:
    """``n`` samples drawn from ``seed`` (an int or a sequence of ints for numpy's SeedSequence).

    ``distance``: ask every sample at this distance (it must be one of ``task.distances``).
    """
    check_int("probe batch size n", n, 1)
    if distance is not None and distance not in task.distances:
        raise UsageError(f"probe distance {distance} is not one of the task's distances {task.distances}")
    rng = np.random.default_rng(seed)
    rows, answers, dists, keys = [], [], [], []
    for _ in range(n):
        row, ans, d, key = _sample(task, rng, distance)
        rows.append(row)
        answers.append(ans)
        dists.append(d)
        keys.append(key)
    q = task.seq_len - 1
    dists = np.asarray(dists, dtype=np.int64)
    return ProbeBatch(np.stack(rows), np.asarray(answers, dtype=np.int64), dists, np.asarray(keys, dtype=np.int64),
                      q - dists, q)
