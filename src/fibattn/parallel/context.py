"""Context parallelism: one sequence split across a group of ranks, each layer exchanging only the
halo its distances reach (method.md §9, :mod:`fibattn.parallel.halo`).

Rank ``r`` of a group of ``P`` holds rows ``[r·c, (r+1)·c)`` of every activation (RoPE at their
global positions). Before each layer's attention it receives the earlier rows of keys and
values its queries read — exactly those, from their owners — and runs the ordinary op on
``[halo; chunk]`` with its queries as the last ``c`` rows; in the backward the halo's key and
value gradients go back to their owners, which add them to their own. The op's distances are
those of the *global* length, so a rank computes exactly its rows of the one-process result.

Use :func:`sharded` around a forward of the chunk (``model(x_chunk, y_chunk, offset=shard.start)``);
each rank's loss is then the mean over its chunk's tokens, and averaging gradients over the
group (what DDP over the whole mesh does) gives the one-process gradient.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as tdist
import torch.nn.functional as F

from ..checks import UsageError
from ..launch import launch
from ..ops import interpolated_sparse_attention, sparse_attention
from ..schedules import as_base, interpolation_plan
from .halo import HaloPlan, halo_plan

RECEIVED: list | None = None          # when a list: rows received by each exchange (fibattn bench context-parallel)


@dataclass(frozen=True)
class ContextGroup:
    """A context-parallel group: its process group (None: the default one), its global ranks in chunk
    order, and this process's index in it."""

    group: object
    ranks: tuple[int, ...]
    rank: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    def shard(self, seq_len: int, document_ids=None) -> "ContextShard":
        return ContextShard(self.group, self.ranks, self.rank, seq_len, document_ids)

    def gather(self, part: torch.Tensor) -> torch.Tensor:
        """Every rank's ``(B, c, ...)`` part of a sequence, concatenated in chunk order along dim 1."""
        parts = [torch.empty_like(part) for _ in self.ranks]
        tdist.all_gather(parts, part.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)


@dataclass
class ContextShard:
    """Rank ``rank`` (index within the group) of a context-parallel group whose global ranks are
    ``ranks`` in chunk order, for sequences of ``seq_len`` tokens; ``document_ids`` ``(B, seq_len)``:
    the whole sequence's packed documents, or None."""

    group: object
    ranks: tuple[int, ...]
    rank: int
    seq_len: int
    document_ids: torch.Tensor | None = None
    _plans: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        P = len(self.ranks)
        if P < 1 or self.seq_len % P:
            raise UsageError(f"model.seq_len ({self.seq_len}) must be divisible by train.context_parallel ({P})")

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def chunk(self) -> int:
        return self.seq_len // self.size

    @property
    def start(self) -> int:
        return self.rank * self.chunk

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a ``(B, seq_len, ...)`` tensor."""
        return x[:, self.start:self.start + self.chunk]

    def plan(self, dists) -> HaloPlan:
        key = None if dists is None else tuple(dists)
        if key not in self._plans:
            self._plans[key] = halo_plan(key, self.rank, self.size, self.chunk)
        return self._plans[key]


def _rows(intervals, offset: int, device) -> torch.Tensor:
    return torch.cat([torch.arange(lo - offset, hi - offset, device=device) for lo, hi in intervals])


def _exchange(shard: ContextShard, outgoing: dict, incoming: dict) -> dict:
    """Send ``outgoing[peer]`` to, and receive ``incoming[peer]`` (a buffer) from, each peer; all
    posted before any wait, so no order between ranks can deadlock."""
    reqs = [tdist.isend(t.contiguous(), shard.ranks[p], group=shard.group) for p, t in outgoing.items()]
    reqs += [tdist.irecv(buf, shard.ranks[p], group=shard.group) for p, buf in incoming.items()]
    for r in reqs:
        r.wait()
    return incoming


class _Halo(torch.autograd.Function):
    """``(k, v)`` of the chunk -> ``(k, v)`` of ``[halo; chunk]`` (rows nobody reads stay zero)."""

    @staticmethod
    def forward(ctx, k, v, plan: HaloPlan, shard: ContextShard):
        kv = torch.stack([k, v])                                      # (2, B, Hkv, c, Dh)
        two, B, Hkv, c, Dh = kv.shape
        sent = {dst: kv[:, :, :, _rows(ivs, shard.start, k.device)] for dst, ivs in plan.send}
        got = _exchange(shard, sent, {src: kv.new_empty(two, B, Hkv, sum(b - a for a, b in ivs), Dh)
                                      for src, ivs in plan.recv})
        if RECEIVED is not None:
            RECEIVED.append(sum(t.shape[3] for t in got.values()))
        ext = kv.new_zeros(two, B, Hkv, plan.before + c, Dh)
        ext[:, :, :, plan.before:] = kv
        first = shard.start - plan.before
        for src, ivs in plan.recv:
            ext[:, :, :, _rows(ivs, first, k.device)] = got[src]
        ctx.plan, ctx.shard = plan, shard
        return ext[0], ext[1]

    @staticmethod
    def backward(ctx, dk, dv):
        plan, shard = ctx.plan, ctx.shard
        g = torch.stack([dk, dv])
        first = shard.start - plan.before
        back = {src: g[:, :, :, _rows(ivs, first, g.device)] for src, ivs in plan.recv}
        shape = g.shape[:3]
        got = _exchange(shard, back, {dst: g.new_empty(*shape, sum(b - a for a, b in ivs), g.shape[-1])
                                      for dst, ivs in plan.send})
        local = g[:, :, :, plan.before:].clone()
        for dst, ivs in plan.send:                                    # in rank order: deterministic sums
            local.index_add_(3, _rows(ivs, shard.start, g.device), got[dst])
        return local[0], local[1], None, None


def layer_dists(layer, seq_len: int) -> list[int] | None:
    """Distances a layer reads at the global length (both taps of an interpolated rung); None for dense
    (a dense layer under evaluation's window mode, ``window_band`` set: its band ``0..band-1``)."""
    if layer.attention == "dense":
        band = getattr(layer, "window_band", None)
        return None if band is None else list(range(min(band, seq_len)))
    if not layer.learned:
        return layer.distances(seq_len)
    plan = interpolation_plan(layer.window, layer.current_alpha(), layer.base, seq_len, reach=layer._reach_arg())
    return sorted(set(plan.window) | {t for lo, _ in plan.rungs for t in (lo, lo + 1)})


def attend(layer, shard: ContextShard, q, k, v, document_ids=None):
    """A layer's attention core on its chunk: halo in, the op on ``[halo; chunk]``, the chunk's rows out."""
    if document_ids is not None:
        raise UsageError("under context parallelism the documents are the shard's (ContextShard.document_ids)")
    T = shard.seq_len
    dists = layer_dists(layer, T)
    plan = shard.plan(dists)
    k, v = _Halo.apply(k, v, plan, shard)
    n = plan.before
    q = torch.cat([q.new_zeros(*q.shape[:2], n, q.shape[3]), q], dim=2) if n else q    # queries: the last rows
    first = shard.start - n
    ids = None if shard.document_ids is None else shard.document_ids[:, first:shard.start + shard.chunk]
    if dists is None:
        L = q.shape[2]
        pos = torch.arange(L, device=q.device)
        mask = pos[:, None] >= pos[None, :]
        if ids is not None:
            mask = mask & (ids[:, :, None] == ids[:, None, :])[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    elif layer.learned:
        values = as_base(layer.base).resolve(T, layer._reach_arg())      # the global length's base
        out = interpolated_sparse_attention(q, k, v, alpha=layer.alphas.alpha(0), base=values, window=layer.window,
                                            reach=layer._reach_arg(), backend=layer.backend, document_ids=ids)
    else:
        out = sparse_attention(q, k, v, dists, backend=layer.backend, document_ids=ids)
    return out[:, :, n:]


@contextlib.contextmanager
def sharded(model, shard: ContextShard):
    """Every attention layer of ``model`` attends as rank ``shard.rank`` of its group (restored after)."""
    layers = list(model.layers())
    before = [layer.__dict__.get("attend") for layer in layers]      # another mode's override (window mode)
    for layer in layers:
        layer.attend = lambda q, k, v, document_ids=None, layer=layer: attend(layer, shard, q, k, v, document_ids)
    try:
        yield shard
    finally:
        for layer, old in zip(layers, before):
            if old is None:
                del layer.attend
            else:
                layer.attend = old



@contextlib.contextmanager
def joined(size: int, flag: str = "--context-parallel", device=None):
    """The context group of all ``size`` processes torchrun started (``None`` when ``size`` is 1): the
    process group is created from torchrun's environment if needed, and torn down together after."""
    if size == 1:
        yield None
        return
    place = launch()                        # torchrun's variables, checked as a whole
    world, rank = place.world_size, place.rank
    if world != size:
        raise UsageError(f"{flag} {size} needs {size} processes under torchrun (torchrun --nproc_per_node {size} "
                         f"-m fibattn.cli ...); this run has {world}")
    made = not tdist.is_initialized()
    if made:
        backend = "nccl" if device is not None and torch.device(device).type == "cuda" else "gloo"
        tdist.init_process_group(backend, init_method="env://", rank=rank, world_size=world)
    try:
        yield ContextGroup(None, tuple(range(size)), rank)
        tdist.barrier()                     # every rank done before any tears down (gloo hangs otherwise)
    finally:
        if made:
            tdist.destroy_process_group()
