"""Streaming generation with constant-memory sparse KV caches, and ``fibattn generate``.

Layout: prompt rows are lists of token ids (any lengths); hidden states ``(B, T, C)``;
a decode step takes one token per row ``(B,)`` at per-row positions ``pos`` ``(B,)`` and
returns logits ``(B, V)``. Caches: see :mod:`fibattn.generation.kvcache`.

Semantics. All distance sets are those of a full forward pass at the generation's
*context* ``N`` (default: longest prompt + ``max_new_tokens``), built once: ring sizes
come from ``D(N)`` (for ``reach="study"`` a ``fib`` set stops growing once every rung
fits, a ``pow2`` set grows like ``log N``; with ``reach="train"`` the set is fixed).
So the logits of every step equal those of one full forward pass over the generated
text at length ``N``. Whenever a layer's set at a shorter length is the set at ``N``
cut to the shorter cap -- every ``fib`` / ``custom`` base, dense layers, ``pow2`` with
``alpha >= 1`` -- the model is prefix-stable and every step also equals
``model(tokens_so_far)[:, -1]``. (``pow2`` with ``alpha < 1`` is not: its base grows
with the length, so earlier positions change as ``T`` grows; there the context matters.)

Batches: each prompt is prefilled alone (rows of equal length together), then rows decode
together at their own positions; row ``r`` equals a single run of prompt ``r`` with the
same ``context`` and seed ``seeds[r]`` (an int ``seed`` gives row ``r`` the seed ``seed + r``).

RoPE scaling (method.md §7): ``rope_scaling`` ``linear | ntk | yarn`` is in force during every
prefill and step (and only then: the model is left as it was between steps), with the factor
``rope_factor`` or by default ``max(1, context / training length)``; the logits of every step equal
a full forward pass at ``context`` inside ``rope_scaling_mode(model, kind, factor)``.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from ..checks import UsageError, check_int
from ..config import ModelConfig
from .arguments import check_caches_fit, keyword_arguments, prompt_rows, row_generators, session_scaling
from .sampling import Sampling, sample
from .static import collect_static, resolve_decode, static_steps
from .kvcache import FullCache, LayerState, Positions, RingCache, attend_step, layer_read_plan, learned_prefill_base
from ..ops import interpolated_sparse_attention, sparse_attention
from ..ops.backends import check_model_runs

log = logging.getLogger("fibattn")


# ----------------------------------------------------------------------------- arguments
@dataclass
class GenerationStep:
    """One decode step. ``tokens`` ``(B,)`` int64 on CPU, -1 for rows that had already
    stopped; ``finished`` ``(B,)``: the row produces no more tokens after this step;
    ``logits`` ``(B, V)`` float32: the raw logits the tokens were sampled from."""

    index: int
    tokens: torch.Tensor
    finished: torch.Tensor
    logits: torch.Tensor


# ----------------------------------------------------------------------------- the engine
def _qkv_at(attn, h: torch.Tensor, groups):
    """The layer's own projections + RoPE for one new token per row at per-row positions."""
    if len(groups) == 1:
        return attn.qkv(h, groups[0][1])
    parts = [(idx, attn.qkv(h[idx], p)) for idx, p in groups]
    out = []
    for j in range(3):
        t = parts[0][1][j]
        full = t.new_empty(h.shape[0], *t.shape[1:])
        for idx, qkv in parts:
            full[idx] = qkv[j]
        out.append(full)
    return out


PREFILL_CHUNK = 8192      # prompt tokens per prefill pass by default: the activations of one chunk, at any length


class DecodeSession:
    """Caches and state for ``batch`` rows of a :class:`fibattn.model.lm.FibLM` up to ``context``; prompts are
    prefilled ``prefill_chunk`` tokens at a time (default :data:`PREFILL_CHUNK`)."""

    def __init__(self, model, batch: int, context: int, *, dense_window: int | None = None,
                 rope_scaling=None, size_flag: str = "context (longest prompt + --max-new-tokens)",
                 static: bool = False, prefill_chunk: int | None = None):
        for name in ("embed", "blocks", "norm", "logits"):
            if not hasattr(model, name):
                raise UsageError(f"generate needs a fibattn FibLM (missing .{name}), got {type(model).__name__}")
        max_len = getattr(getattr(model, "cfg", None), "max_seq_len", None)
        if max_len is not None and context > max_len:
            raise UsageError(f"context {context} (prompt + max_new_tokens) exceeds model.max_seq_len={max_len}")
        if dense_window is not None:
            check_int("dense_window", dense_window, 1)
        if rope_scaling is not None and not isinstance(rope_scaling, model.blocks[0].attn.rope.Scaling):
            raise UsageError(f"DecodeSession rope_scaling must be a RopeScaling or None, got {rope_scaling!r}")
        self.model, self.batch, self.context, self.rope_scaling = model, batch, context, rope_scaling
        p = model.embed.weight
        self.device, self.dtype = p.device, p.dtype
        self.layers: list[LayerState] = []
        if isinstance(getattr(model, "cfg", None), ModelConfig):    # a backend that cannot run: before the prompt
            check_model_runs(model.cfg, self.device, grad=False)
        plans = [layer_read_plan(block.attn, context, dense_window) for block in model.blocks]
        check_caches_fit(model, plans, batch, context, self.dtype, self.device, size_flag)
        for block, plan in zip(model.blocks, plans):
            attn = block.attn
            dims = (batch, attn.n_kv_heads, attn.head_dim)
            if plan is None:
                cache = FullCache(*dims, context, dtype=self.dtype, device=self.device,
                                  **({"initial": context} if static else {}))      # static: never regrown
            else:
                cache = RingCache(*dims, min(plan.span, context), dtype=self.dtype, device=self.device)
            self.layers.append(LayerState.build(plan, cache, self.device))
        self.pos = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.prefill_chunk = PREFILL_CHUNK if prefill_chunk is None else check_int("prefill_chunk", prefill_chunk, 1)
        self._chunk_fn = self._forward_chunk
        self._tables = [None] * len(model.blocks)             # RoPE tables of a compiled prefill (compile_prefill)
        # a learned layer's rungs at the context, read from alpha once (not in every prefill, nor in a traced one)
        self._bases = {id(b.attn): learned_prefill_base(b.attn, context) for b in model.blocks
                       if b.attn.attention == "sparse" and b.attn.learned}

    def _scaled(self):
        """The session's RoPE scaling, in force for one prefill or step (a no-op without one)."""
        stack = contextlib.ExitStack()
        if self.rope_scaling is not None:
            for block in self.model.blocks:
                stack.enter_context(block.attn.rope.scaled(self.rope_scaling))
        return stack

    def reset(self) -> None:
        """Every row back before its first token: caches zeroed, positions 0 (the storage is kept)."""
        for state in self.layers:
            state.cache.kv.zero_()
            if isinstance(state.cache, FullCache):
                state.cache.length = 0
        self.pos.zero_()

    @property
    def cache_bytes(self) -> int:
        return sum(s.cache.nbytes for s in self.layers)

    @property
    def cache_rows(self) -> list[int]:
        return [s.cache.rows for s in self.layers]

    def random_history(self, length: int, generator: torch.Generator | None = None) -> None:
        """Benchmarks: put every row at position ``length - 1`` with random cached keys/values
        (the cache a prefill of ``length`` tokens would leave, without running it)."""
        if not 1 <= length < self.context:
            raise UsageError(f"length must be in [1, context={self.context}), got {length}")
        for state in self.layers:
            if isinstance(state.cache, FullCache):
                state.cache.randomize(length, generator)
            else:
                state.cache.randomize(generator)
        self.pos.fill_(length - 1)

    # ------------------------------------------------------------------ prefill
    def _prefill_core(self, attn, state: LayerState, q, k, v):
        if state.plan is None:
            return attn.attend(q, k, v)
        if attn.attention == "dense" or not attn.learned:
            return sparse_attention(q, k, v, list(state.plan.entries), backend=attn.backend)
        base = self._bases[id(attn)]
        if not base:
            return sparse_attention(q, k, v, list(state.plan.first), backend=attn.backend)
        return interpolated_sparse_attention(q, k, v, alpha=attn.alpha_tensor(), base=base, window=attn.window,
                                             backend=attn.backend)

    def _chunk_core(self, attn, state: LayerState, q, k, v, before):
        """The attention of a prompt chunk's queries ``q`` over the cached rows ``before`` it (``(b, Hkv, n, 2Dh)``,
        None for the first chunk) and its own keys ``k``: the chunk's ``(b, H, C, Dh)``. The op runs on
        ``[before; chunk]`` with zero queries ahead (their rows are dropped): every column a query reads lies in
        it, so the result is the whole prompt's, chunk by chunk (as context parallelism's halo, method.md §9)."""
        if before is None:
            return self._prefill_core(attn, state, q, k, v)
        n, Dh = before.shape[2], k.shape[-1]
        k = torch.cat([before[..., :Dh].to(k.dtype), k], dim=2)
        v = torch.cat([before[..., Dh:].to(v.dtype), v], dim=2)
        if state.plan is None:                      # dense: every earlier row, causal inside the chunk
            L = k.shape[2]
            mask = torch.arange(n, L, device=q.device)[:, None] >= torch.arange(L, device=q.device)[None, :]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        q = torch.cat([q.new_zeros(*q.shape[:2], n, Dh), q], dim=2)
        return self._prefill_core(attn, state, q, k, v)[:, :, n:]

    def compile_prefill(self, tables: list) -> None:
        """Prefill through ``torch.compile(fullgraph=True)``, RoPE from ``tables`` (one per block, covering the
        context; ``static.rope_tables``) at positions given as a device tensor: one graph for a prompt's first
        chunk, one for its middle chunks and one for a shorter last chunk, whatever their positions (a dense
        layer's growing prefix is marked dynamic, the rings' is fixed)."""
        self._tables = tables
        traced = torch.compile(self._forward_chunk, fullgraph=True)

        def chunk_fn(ids, at, befores):
            # sizes that happen to be equal (a dense prefix of one chunk's length) are not the same size
            with torch.fx.experimental._config.patch(use_duck_shape=False):
                return traced(ids, at, befores)
        self._chunk_fn = chunk_fn

    def _forward_chunk(self, ids: torch.Tensor, at, befores: list):
        """One prompt chunk ``ids`` ``(b, C)`` at positions ``at`` (an int, the first one; or, compiled, a ``(C,)``
        device tensor): the last position's logits ``(b, V)`` and each layer's new keys/values (the caller writes
        them), nothing else changed (what ``compiled`` traces)."""
        model, written = self.model, []

        def attend(attn, h, state, before, table):
            q, k, v = attn.qkv(h, at) if table is None else attn.qkv_rows(h, at, table)
            written.append((k, v))
            return self._chunk_core(attn, state, q, k, v, before)

        x = model.embed(ids)
        for block, state, before, table in zip(model.blocks, self.layers, befores, self._tables):
            x = block(x, attend=lambda attn, h, state=state, before=before, table=table:
                      attend(attn, h, state, before, table))
        return model.logits(model.norm(x[:, -1:]))[:, 0].float(), written

    @torch.no_grad()
    def prefill(self, rows: list[int], ids: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        """Run prompts ``ids`` ``(b, T)`` (one length) into batch rows ``rows``; last logits ``(b, V)``.

        The prompt goes through ``chunk`` tokens at a time (default :attr:`prefill_chunk`): each chunk reads the
        cached rows before it and leaves its own in the caches, so a prompt of any length takes the memory of
        one chunk, with the logits of one pass."""
        chunk = self.prefill_chunk if chunk is None else check_int("chunk", chunk, 1)
        ids = ids.to(self.device)
        T = ids.shape[1]
        compiled = self._tables[0] is not None
        with self._scaled():
            for start in range(0, T, chunk):
                befores = [None if start == 0 else s.cache.before(rows, start) for s in self.layers]
                at = start
                if compiled:
                    at = torch.arange(start, min(T, start + chunk), device=self.device)
                    for state, before in zip(self.layers, befores):
                        if before is not None and state.plan is None:        # a dense layer's whole prefix
                            torch._dynamo.maybe_mark_dynamic(before, 2)
                logits, written = self._chunk_fn(ids[:, start:start + chunk].contiguous(), at, befores)
                for state, (k, v) in zip(self.layers, written):
                    for j, row in enumerate(rows):
                        state.cache.fill(row, k[j:j + 1], v[j:j + 1], start)
        self.pos[rows] = T - 1
        return logits

    def prefill_rows(self, rows: list[list[int]]) -> torch.Tensor:
        """Every prompt into its batch row (rows of one length together); the last logits ``(B, V)``."""
        logits = torch.empty(len(rows), self.model.embed.weight.shape[0], device=self.device)
        by_len: dict[int, list[int]] = {}
        for r, row in enumerate(rows):
            by_len.setdefault(len(row), []).append(r)
        for _, group in sorted(by_len.items()):
            logits[group] = self.prefill(group, torch.tensor([rows[r] for r in group], dtype=torch.long))
        return logits

    # ------------------------------------------------------------------ decode
    def _position_groups(self) -> list[tuple[torch.Tensor | None, int]]:
        """Rows sharing a position (one group, index ``None``, when all rows agree)."""
        where: dict[int, list[int]] = {}
        for r, p in enumerate(self.pos.tolist()):
            where.setdefault(p, []).append(r)
        if len(where) == 1:
            return [(None, next(iter(where)))]
        return [(torch.tensor(rows, device=self.device), p) for p, rows in where.items()]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row at position ``pos + 1``; logits ``(B, V)``."""
        model = self.model
        self.pos += 1
        pos = self.pos
        groups = self._position_groups()
        max_pos = max(p for _, p in groups)
        at = Positions(pos, min(p for _, p in groups), max_pos)
        if max_pos >= self.context:
            raise UsageError(f"position {max_pos} is past the context {self.context}")
        B = tokens.shape[0]
        x = model.embed(tokens.to(self.device).view(B, 1))
        with self._scaled():
            for block, state in zip(model.blocks, self.layers):
                x = block(x, attend=lambda attn, h, state=state: attend_step(state, *_qkv_at(attn, h, groups), at))
        return model.logits(model.norm(x))[:, 0].float()


# ----------------------------------------------------------------------------- the API
def generate(model, prompt_ids, *, max_new_tokens: int = 128, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, seed=None, stop_ids: Sequence[int] = (), context: int | None = None,
             dense_window: int | None = None, rope_scaling=None, rope_factor: float | None = None,
             decode: str = "auto", prefill_chunk: int | None = None) -> Iterator[GenerationStep]:
    """Stream new tokens for one prompt or a batch of prompts of any lengths.

    Yields one :class:`GenerationStep` per step until every row has hit a ``stop_ids``
    token (which is yielded) or ``max_new_tokens`` steps were taken. Arguments are checked
    here, before the first step. ``context`` (default: longest prompt + ``max_new_tokens``)
    fixes the distance sets and cache sizes; ``dense_window`` makes dense layers keep only
    their last ``w`` positions (an approximation beyond ``w``). ``rope_scaling``: ``none | linear
    | ntk | yarn`` (or a :class:`fibattn.model.rope.RopeScaling`), with the factor ``rope_factor``
    (default: ``max(1, context / training length)``; method.md §7). ``decode``: ``eager`` (the reference
    step), ``static`` (one shape at every position, nothing read back; captured in a CUDA graph on CUDA),
    ``compiled`` (``static`` through ``torch.compile(fullgraph=True)``) or ``auto`` (``compiled`` on CUDA,
    ``eager`` elsewhere; :mod:`fibattn.generation.static`). Streaming reads each step's tokens back once;
    under ``static`` / ``compiled`` a step's ``logits`` are the step's buffer, overwritten by the next step.
    ``prefill_chunk``: prompt tokens per prefill pass (default :data:`PREFILL_CHUNK`; a prompt of any length then
    takes one chunk's activations, with the same logits).
    """
    return _stream(_prepare(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, stop_ids, context,
                            dense_window, rope_scaling, rope_factor, decode, prefill_chunk))


@dataclass
class _Job:
    session: DecodeSession
    rows: list[list[int]]
    max_new: int
    sampling: Sampling
    generators: list[torch.Generator]
    stops: set
    mode: str


def _prepare(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, stop_ids, context, dense_window,
             rope_scaling, rope_factor, decode, prefill_chunk=None) -> _Job:
    """:func:`generate`'s arguments checked, before the first token; the session built."""
    vocab = model.embed.weight.shape[0] if hasattr(model, "embed") else None
    if vocab is None:
        raise UsageError(f"generate needs a fibattn FibLM, got {type(model).__name__}")
    check_int("max_new_tokens", max_new_tokens, 0)
    sampling = Sampling(temperature, top_k, top_p)
    rows = prompt_rows(prompt_ids, vocab)
    stops = set()
    for s in stop_ids or ():
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < vocab:
            raise UsageError(f"stop_ids must be token ids in [0, {vocab}), got {s!r}")
        stops.add(s)
    need = max(len(r) for r in rows) + max_new_tokens
    if context is None:
        context = need
    elif check_int("context", context, 1) < need:
        raise UsageError(f"context must be >= longest prompt + max_new_tokens = {need}, got {context}")
    scaling = session_scaling(model, rope_scaling, rope_factor, context)
    generators = row_generators(seed, len(rows))
    mode = resolve_decode(decode, model.embed.weight.device)
    session = DecodeSession(model, len(rows), context, dense_window=dense_window, rope_scaling=scaling,
                            static=mode != "eager", prefill_chunk=prefill_chunk)
    return _Job(session, rows, max_new_tokens, sampling, generators, stops, mode)


@torch.no_grad()
def _stream(job: _Job) -> Iterator[GenerationStep]:
    if job.max_new == 0:
        return
    if job.mode != "eager":
        yield from _stream_static(job)
        return
    session, sampling, generators, stops = job.session, job.sampling, job.generators, job.stops
    logits = session.prefill_rows(job.rows)
    done = torch.zeros(len(job.rows), dtype=torch.bool)
    stop_t = torch.tensor(sorted(stops), dtype=torch.long)
    for index in range(job.max_new):
        tokens = sample(logits, sampling, generators).cpu()
        tokens = tokens.masked_fill(done, -1)
        now_done = done | torch.isin(tokens, stop_t) if stops else done.clone()
        last = index == job.max_new - 1 or bool(now_done.all())
        yield GenerationStep(index, tokens, now_done | last, logits)
        if last:
            return
        done = now_done
        logits = session.step(tokens.clamp_min(0))


def _stream_static(job: _Job) -> Iterator[GenerationStep]:
    for index, engine in static_steps(job.session, job.rows, job.max_new, job.sampling, job.generators, job.stops,
                                      compiled=job.mode == "compiled"):
        tokens, done = torch.stack([engine.tok, engine.done.long()]).tolist()     # the step's one read back
        last = index == job.max_new - 1 or all(done)
        yield GenerationStep(index, torch.tensor(tokens), torch.tensor(done, dtype=torch.bool) | last, engine.logits)
        if last:
            return


def generate_tokens(model, prompt_ids, **kwargs) -> list[list[int]]:
    """All new tokens per row (stop tokens included), as :func:`generate` yields them; under a static decode
    nothing is read back until the end (:func:`fibattn.generation.static.collect_static`)."""
    job = _prepare(model, prompt_ids, *keyword_arguments(generate, kwargs))
    if job.mode != "eager":
        return collect_static(job.session, job.rows, job.max_new, job.sampling, job.generators, job.stops,
                              compiled=job.mode == "compiled")
    out: list[list[int]] = [[] for _ in job.rows]
    for st in _stream(job):
        for r, t in enumerate(st.tokens.tolist()):
            if t >= 0:
                out[r].append(t)
    return out
