"""The static decode step (``decode="static"`` / ``"compiled"``): one token per row with one shape at every
position and nothing read back, so that a CUDA graph can replay it (gpt-fast's recipe).

Every piece of state is a device tensor allocated once, before the first token: the caches (a dense layer's
:class:`~fibattn.generation.kvcache.FullCache` whole at the context's length, the ring caches as they are),
the rows' positions ``pos`` ``(B,)``, the last tokens ``tok`` ``(B,)`` (-1 for a row that stopped), the
rows' ``done`` flags, this step's uniform draws ``u`` ``(B,)`` and the logits ``(B, V)``. One
:meth:`StaticStep.advance` moves every row one position on at its own position (ragged batches need no
grouping), applies RoPE from a table indexed on the device, attends (:func:`attend_static`), samples
(:func:`~fibattn.generation.sampling.pick`, the draws of each row's generator made ahead on the host) and
marks rows that drew a stop token. ``compiled`` traces it with ``torch.compile(fullgraph=True)`` (and the prompt's prefill, chunk by chunk:
:meth:`~fibattn.generation.decode.DecodeSession.compile_prefill`); on CUDA the
step (compiled or not) is captured once in a ``torch.cuda.CUDAGraph`` and replayed per token: its launches
cost one call, and the replay allocates nothing. The eager :meth:`DecodeSession.step` stays the reference.
"""
from __future__ import annotations

import logging

import torch

from ..checks import UsageError
from .kvcache import attend_static
from .sampling import Sampling, pick, uniforms

log = logging.getLogger("fibattn")

DECODE_MODES = ("auto", "eager", "static", "compiled")
DRAW_BLOCK = 256                  # steps of uniform draws made on the host and copied over together
RECOMPILE_LIMIT = 256            # compiled steps (shapes) kept before dynamo falls back to eager
_WARMUP = 3                       # calls on a side stream before capture (cuBLAS handles, the compiler's)
_logged: set = set()


def resolve_decode(how: str, device: torch.device) -> str:
    """``decode`` resolved: ``auto`` is ``compiled`` on CUDA (a captured graph per token) and ``eager`` elsewhere
    (a CPU gains nothing from static shapes and pays the compile); logged once per device kind."""
    if how not in DECODE_MODES:
        raise UsageError(f"decode must be one of {', '.join(DECODE_MODES)}, got {how!r}")
    if how != "auto":
        return how
    how = "compiled" if device.type == "cuda" else "eager"
    if device.type not in _logged:
        _logged.add(device.type)
        log.info("fibattn generate: decode auto -> %s (%s)", how, "CUDA: torch.compile, one CUDA graph per token"
                 if how == "compiled" else f"{device.type}: set decode=static or compiled to trace it")
    return how


def rope_tables(session) -> list:
    """Each block's RoPE table over the whole context (scaling included), built once and shared by layers of one
    RoPE (256 MB at a 1M context): indexed on the device by the static step and the compiled prefill."""
    shared: dict = {}
    tables = []
    with session._scaled():
        for rope in (b.attn.rope for b in session.model.blocks):
            key = (rope.theta, rope.head_dim, rope.scaling)
            if key not in shared:
                shared[key] = rope.rotations(session.context, session.device)
            tables.append(shared[key])
    return tables


class StaticStep:
    """The captured step of a :class:`fibattn.generation.decode.DecodeSession` built with ``static=True``."""

    def __init__(self, session, sampling: Sampling, stops, *, compiled: bool):
        if any(s.plan is None and s.cache.kv.shape[2] != session.context for s in session.layers):
            raise UsageError("StaticStep needs a DecodeSession built with static=True (whole dense caches)")
        self.session, self.sampling = session, sampling
        B, dev = session.batch, session.device
        vocab = session.model.embed.weight.shape[0]
        self.tables = rope_tables(session)
        if compiled:
            session.compile_prefill(self.tables)
        self.tok = torch.zeros(B, dtype=torch.long, device=dev)
        self.done = torch.zeros(B, dtype=torch.bool, device=dev)
        self.u = torch.zeros(B, dtype=torch.float64, device=dev)
        self.logits = torch.zeros(B, vocab, dtype=torch.float32, device=dev)
        self.stops = torch.tensor(sorted(stops), dtype=torch.long, device=dev)
        self._fn = self._advance
        if compiled:              # each (batch, context) is its own graph: more than dynamo's 8 per process
            step = torch.compile(self._advance, fullgraph=True, dynamic=False)

            def limited():
                with torch._dynamo.config.patch(recompile_limit=max(RECOMPILE_LIMIT,
                                                                    torch._dynamo.config.recompile_limit)):
                    step()
            self._fn = limited
        self.graph = self._capture() if dev.type == "cuda" else None

    def _advance(self) -> None:
        model, s = self.session.model, self.session
        s.pos.add_(1)
        pos = s.pos
        x = model.embed(self.tok.clamp_min(0).view(-1, 1))
        for block, state, table in zip(model.blocks, s.layers, self.tables):
            x = block(x, attend=lambda attn, h, state=state, table=table:
                      attend_static(state, *attn.qkv_at(h, pos, table), pos))
        self.logits.copy_(model.logits(model.norm(x))[:, 0].float())
        self.take(self.logits)

    def take(self, logits: torch.Tensor) -> None:
        """Sample the next tokens from ``logits`` into ``tok`` (-1 where a row is done) and mark stopped rows."""
        nxt = pick(logits, self.sampling, self.u).masked_fill(self.done, -1)
        self.done |= torch.isin(nxt, self.stops)
        self.tok.copy_(nxt)

    @torch.no_grad()
    def _capture(self):
        """Warm up on a side stream, capture one step, then clear what the dummy steps wrote."""
        side = torch.cuda.Stream(self.session.device)
        side.wait_stream(torch.cuda.current_stream(self.session.device))
        with torch.cuda.stream(side):
            for _ in range(_WARMUP):
                self.session.pos.zero_()           # positions stay inside the context however short
                self._fn()
        torch.cuda.current_stream(self.session.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        self.session.pos.zero_()
        with torch.cuda.graph(graph):
            self._fn()
        self.session.reset()
        self.tok.zero_()
        self.done.zero_()
        return graph

    @torch.no_grad()
    def advance(self) -> None:
        """One step for every row: ``tok`` fed at ``pos + 1``, the next ``tok``, ``done`` and ``logits`` left."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self._fn()


def static_steps(session, rows, max_new: int, sampling: Sampling, generators, stops, *, compiled: bool):
    """Prefill ``rows`` into ``session`` (built ``static=True``), then yield ``(index, engine)`` after each of
    ``max_new`` steps: the engine's ``tok``, ``done`` and ``logits`` are that step's."""
    engine = StaticStep(session, sampling, stops, compiled=compiled)
    logits = session.prefill_rows(rows)               # after the capture, which leaves the caches cleared
    draws = None
    for index in range(max_new):
        if sampling.temperature and index % DRAW_BLOCK == 0:     # a bounded block of draws, copied at once
            draws = uniforms(generators, min(DRAW_BLOCK, max_new - index)).to(session.device)
        if draws is not None:
            engine.u.copy_(draws[:, index % DRAW_BLOCK])
        if index == 0:
            engine.logits.copy_(logits)
            engine.take(engine.logits)
        else:
            engine.advance()
        yield index, engine


SYNC_EVERY = 32           # collecting with stop tokens: steps between reads of the rows' done flags


@torch.no_grad()
def collect_static(session, rows, max_new: int, sampling: Sampling, generators, stops, *,
                   compiled: bool) -> list[list[int]]:
    """All new tokens per row, nothing read back per token: the steps' tokens gather on the device and are
    read once at the end; with stop tokens, whether every row has stopped is read every :data:`SYNC_EVERY`
    steps."""
    if max_new == 0:
        return [[] for _ in rows]
    history = torch.full((len(rows), max_new), -1, dtype=torch.long, device=session.device)
    for index, engine in static_steps(session, rows, max_new, sampling, generators, stops, compiled=compiled):
        history[:, index] = engine.tok
        if stops and (index + 1) % SYNC_EVERY == 0 and bool(engine.done.all()):
            break
    return [[t for t in row if t >= 0] for row in history.tolist()]
