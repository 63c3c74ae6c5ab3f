"""Per-layer KV caches for streaming generation, and the one-token attention step.

Layout, stated once: cached keys and values ``(B, Hkv, S, Dh)`` (``S`` rows per batch row);
keys are stored *after* RoPE. ``pos`` is a ``(B,)`` int64 tensor: the absolute position of
each row's newest token (rows of a batch may be at different positions). A decode query
``q`` is ``(B, H, 1, Dh)``; the attention output has the same shape.

- :class:`RingCache` (sparse layers): exactly ``span`` rows, row of position ``p`` in slot
  ``p % span``. ``span`` is the furthest distance the layer ever reads plus one
  (``max(D) + 1``; for a learned alpha :attr:`InterpolationPlan.span`). A decode step gathers
  the ``|E|`` rows of the read plan: O(|E|·Dh) work per head, whatever the position.
- :class:`FullCache` (dense layers): every position, grown by doubling up to ``capacity``.

:class:`ReadPlan` says which rows a query reads and how they form attention columns; it is
built once per layer for the generation's *context* (its longest length), see
:func:`layer_read_plan`: distance sets are those a full forward pass at that length uses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..checks import UsageError
from ..schedules import attended_distances, interpolation_plan


@dataclass(frozen=True)
class ReadPlan:
    """What a decode query reads from a ring cache.

    ``entries``: distances whose rows are gathered. ``first[c]``: column ``c`` is usable when
    ``pos >= first[c]``. ``mix``: ``(C, E)`` weights building column keys/values from the
    gathered rows (method.md §3 interpolation); ``None`` when column ``c`` is entry ``c``.
    A row below position 0 is clamped to row 0, as in the full-sequence op.
    """

    entries: tuple[int, ...]
    first: tuple[int, ...]
    mix: tuple[tuple[float, ...], ...] | None = None

    @property
    def span(self) -> int:
        return max(self.entries) + 1


def _reach(layer) -> int | None:
    return layer.reach_len if layer.reach == "train" else None


def layer_read_plan(layer, context: int, dense_window: int | None = None) -> ReadPlan | None:
    """The read plan of a ``FibAttention`` layer at sequence length ``context``.

    ``None`` for a dense layer without ``dense_window`` (it needs a :class:`FullCache`).
    A dense layer with ``dense_window = w`` reads the last ``w`` positions (an approximation
    of full attention, exact while the sequence is no longer than ``w``).
    """
    if layer.attention == "dense":
        if dense_window is None:
            return None
        dists = tuple(range(dense_window))
        return ReadPlan(dists, dists)
    alpha = layer.current_alpha()
    if not layer.learned:
        dists = tuple(attended_distances(layer.window, alpha, layer.base, context, reach=_reach(layer)))
        return ReadPlan(dists, dists)
    plan = interpolation_plan(layer.window, alpha, layer.base, context, reach=_reach(layer))
    entries = plan.entries
    where = {e: j for j, e in enumerate(entries)}
    rows = []
    for d in plan.window:
        row = [0.0] * len(entries)
        row[where[d]] = 1.0
        rows.append(tuple(row))
    for lo, b in plan.rungs:
        frac = alpha * b - lo
        row = [0.0] * len(entries)
        row[where[lo]], row[where[lo + 1]] = 1.0 - frac, frac
        rows.append(tuple(row))
    first = tuple(plan.window) + tuple(lo for lo, _ in plan.rungs)
    return ReadPlan(tuple(entries), first, tuple(rows))


def learned_prefill_base(layer, context: int) -> list[int]:
    """Base values of the rungs a learned layer uses at ``context`` (for the prefill op)."""
    plan = interpolation_plan(layer.window, layer.current_alpha(), layer.base, context, reach=_reach(layer))
    return [b for _, b in plan.rungs]


# ----------------------------------------------------------------------------- caches
class _KV:
    """Keys and values side by side in one tensor ``kv`` ``(B, Hkv, S, 2 * Dh)`` (one
    scatter per write, one gather per read); ``k`` and ``v`` are views."""

    kv: torch.Tensor

    @property
    def k(self) -> torch.Tensor:
        return self.kv[..., : self.kv.shape[-1] // 2]

    @property
    def v(self) -> torch.Tensor:
        return self.kv[..., self.kv.shape[-1] // 2:]

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    @property
    def rows(self) -> int:
        return self.kv.shape[2]

    def _scatter(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        B, Hkv, _, Dh = k.shape
        idx = slots.view(B, 1, 1, 1).expand(B, Hkv, 1, 2 * Dh)
        self.kv.scatter_(2, idx, torch.cat([k, v], dim=-1).to(self.kv.dtype))


class RingCache(_KV):
    """The last ``span`` keys/values of every batch row (constant memory)."""

    def __init__(self, batch: int, n_kv: int, head_dim: int, span: int, *, dtype, device):
        self.kv = torch.zeros(batch, n_kv, span, 2 * head_dim, dtype=dtype, device=device)
        self.span = span

    def fill(self, row: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """Store a prompt's keys/values ``(1, Hkv, T, Dh)`` (positions ``start..start+T-1``) in ``row``."""
        T = k.shape[2]
        first = max(0, T - self.span)                   # only the last span of them stay
        slots = torch.arange(start + first, start + T, device=k.device) % self.span
        self.kv[row][:, slots] = torch.cat([k[0, :, first:], v[0, :, first:]], dim=-1).to(self.kv.dtype)

    def before(self, rows: list[int], start: int) -> torch.Tensor:
        """The cached rows of positions ``[start - n, start)`` of batch rows ``rows``, ``n = min(start, span)``
        (what a prompt's chunk from ``start`` on reads): ``(len(rows), Hkv, n, 2 * Dh)``."""
        n = min(start, self.span)
        slots = torch.arange(start - n, start, device=self.kv.device) % self.span
        return self.kv[rows][:, :, slots]

    def write(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Store one new key/value ``(B, Hkv, 1, Dh)`` per row at positions ``pos``."""
        self._scatter(k, v, pos % self.span)

    def gather(self, pos: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """Rows at ``max(pos - e, 0)`` for each entry ``e``: ``(B, Hkv, E, 2 * Dh)``."""
        B, Hkv, _, D2 = self.kv.shape
        slots = (pos[:, None] - entries[None, :]).clamp_min_(0).remainder_(self.span)
        return self.kv.gather(2, slots.view(B, 1, -1, 1).expand(B, Hkv, slots.shape[1], D2))

    def randomize(self, generator: torch.Generator | None = None) -> None:
        """Fill with random keys/values (benchmarks: a cache 'at' any position without a prefill)."""
        self.kv.copy_(torch.randn(self.kv.shape, generator=generator).to(self.kv))


class FullCache(_KV):
    """Every key/value of every row, grown by doubling up to ``capacity`` rows."""

    def __init__(self, batch: int, n_kv: int, head_dim: int, capacity: int, *, dtype, device,
                 initial: int = 256):
        self.capacity = capacity
        self.kv = torch.zeros(batch, n_kv, min(capacity, initial), 2 * head_dim, dtype=dtype, device=device)
        self.length = 0          # rows in use: max position written + 1

    def _ensure(self, n: int) -> None:
        if n > self.capacity:
            raise UsageError(f"position {n - 1} is past the cache capacity {self.capacity} (the context)")
        have = self.kv.shape[2]
        if n > have:
            new = min(self.capacity, max(n, 2 * have))
            pad = self.kv.new_zeros(*self.kv.shape[:2], new - have, self.kv.shape[3])
            self.kv = torch.cat([self.kv, pad], dim=2)

    def fill(self, row: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        end = start + k.shape[2]
        self._ensure(end)
        self.kv[row, :, start:end] = torch.cat([k[0], v[0]], dim=-1).to(self.kv.dtype)
        self.length = max(self.length, end)

    def before(self, rows: list[int], start: int) -> torch.Tensor:
        """Every cached row before position ``start`` of batch rows ``rows``: ``(len(rows), Hkv, start, 2 * Dh)``."""
        return self.kv[rows][:, :, :start]

    def write(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, max_pos: int) -> None:
        self._ensure(max_pos + 1)
        self._scatter(k, v, pos)
        self.length = max(self.length, max_pos + 1)

    def write_at(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """:meth:`write` into a cache already whole (``initial = capacity``): no growth, no host value."""
        self._scatter(k, v, pos)

    def randomize(self, length: int, generator: torch.Generator | None = None) -> None:
        """Benchmarks: pretend ``length`` positions were seen, with random keys/values."""
        self._ensure(length)
        view = self.kv[:, :, :length]
        view.copy_(torch.randn(view.shape, generator=generator).to(view))
        self.length = length


# ------------------------------------------------------------------------ the decode step
@dataclass
class LayerState:
    """A layer's cache plus its read plan turned into tensors on the cache's device."""

    cache: RingCache | FullCache
    plan: ReadPlan | None
    entries: torch.Tensor | None = None       # (E,) int64
    first: torch.Tensor | None = None         # (C,) int64
    mix: torch.Tensor | None = None           # (C, E) float32
    last_first: int = 0                       # every column is usable from this position on

    @classmethod
    def build(cls, plan: ReadPlan | None, cache, device) -> "LayerState":
        if plan is None:
            return cls(cache, None)
        mix = None if plan.mix is None else torch.tensor(plan.mix, dtype=torch.float32, device=device)
        return cls(cache, plan, torch.tensor(plan.entries, dtype=torch.long, device=device),
                   torch.tensor(plan.first, dtype=torch.long, device=device), mix, max(plan.first))


@dataclass(frozen=True)
class Positions:
    """Where each row's new token sits: ``pos`` ``(B,)`` on the device, plus its min and max."""

    pos: torch.Tensor
    lo: int
    hi: int


def _softmax_attend(q, k, v, valid):
    """q ``(B, Hkv, G, Dh)``, k/v ``(B, Hkv, N, Dh)``, valid ``(B, N)`` or None -> ``(B, Hkv, G, Dh)``."""
    Dh = q.shape[-1]
    scale = 1.0 / math.sqrt(Dh)
    s = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)      # scores in float32
    if valid is not None:
        s = s.masked_fill_(~valid[:, None, None, :], float("-inf"))
    # softmax by hand: torch.softmax starts an OpenMP region even for a handful of scores,
    # which costs milliseconds on a busy CPU; these few element-wise ops stay serial
    e = s.sub_(s.amax(dim=-1, keepdim=True)).exp_()
    return torch.matmul(e.div_(e.sum(dim=-1, keepdim=True)).to(v.dtype), v)


def attend_step(state: LayerState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, at: Positions) -> torch.Tensor:
    """Write the new key/value, then attend the new query ``(B, H, 1, Dh)`` over the cache."""
    cache = state.cache
    if state.plan is None:
        cache.write(k, v, at.pos, at.hi)
        n = at.hi + 1
        valid = None if at.lo == at.hi else torch.arange(n, device=q.device)[None, :] <= at.pos[:, None]
        return _attend_rows(q, cache.k[:, :, :n], cache.v[:, :, :n], valid, cache.kv.dtype)
    return _attend_ring(state, q, k, v, at.pos, at.lo < state.last_first)


def attend_static(state: LayerState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  pos: torch.Tensor) -> torch.Tensor:
    """:func:`attend_step` with one shape at every position and nothing read back (a captured decode step):
    a dense layer's :class:`FullCache` is whole from the start and every row past a row's position is masked,
    a ring layer's columns are always masked by position."""
    cache = state.cache
    if state.plan is None:
        cache.write_at(k, v, pos)
        valid = torch.arange(cache.rows, device=q.device)[None, :] <= pos[:, None]
        return _attend_rows(q, cache.k, cache.v, valid, cache.kv.dtype)
    return _attend_ring(state, q, k, v, pos, True)


def _attend_rows(q, k, v, valid, dtype):
    """q ``(B, H, 1, Dh)`` over cached rows k/v ``(B, Hkv, N, Dh)`` in the cache's ``dtype``."""
    B, H, _, Dh = q.shape
    qg = q.reshape(B, k.shape[1], H // k.shape[1], Dh).to(dtype)
    return _softmax_attend(qg, k, v, valid).reshape(B, H, 1, Dh).to(q.dtype)


def _attend_ring(state: LayerState, q, k, v, pos: torch.Tensor, masked: bool) -> torch.Tensor:
    """A ring layer's step: write, gather the plan's rows, mix them into columns (float32); ``masked``:
    mask the columns not yet usable at ``pos`` (False when the caller knows every one is)."""
    B, H, _, Dh = q.shape
    state.cache.write(k, v, pos)
    rows = state.cache.gather(pos, state.entries).float()          # (B, Hkv, E, 2 Dh)
    if state.mix is not None:
        rows = torch.matmul(state.mix, rows)                         # (B, Hkv, C, 2 Dh)
    valid = pos[:, None] >= state.first[None, :] if masked else None
    qg = q.reshape(B, k.shape[1], H // k.shape[1], Dh).float()
    out = _softmax_attend(qg, rows[..., :Dh], rows[..., Dh:], valid)
    return out.reshape(B, H, 1, Dh).to(q.dtype)
