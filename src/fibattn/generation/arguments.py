"""``generate``'s arguments checked before the first token (:mod:`fibattn.generation.decode`): prompt rows of token
ids, one random generator per row, the RoPE scaling in force for a session, and whether the caches fit."""
from __future__ import annotations

import inspect
import numbers

import torch

from ..checks import UsageError, check_int
from ..validation import check_sizes_fit


def prompt_rows(prompt_ids, vocab: int) -> list[list[int]]:
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() not in (1, 2):
            raise UsageError(f"prompt_ids must be 1-D (T,) or 2-D (B, T), got shape {tuple(prompt_ids.shape)}")
        prompt_ids = prompt_ids.tolist()
    rows = list(prompt_ids) if isinstance(prompt_ids, (list, tuple)) else None
    if rows is None:
        raise UsageError(f"prompt_ids must be a list of token ids, a list of such lists or a tensor, "
                         f"got {type(prompt_ids).__name__}")
    if not rows:
        raise UsageError("prompt_ids is empty: give at least one token")
    if not isinstance(rows[0], (list, tuple)):
        rows = [rows]
    out = []
    for r, row in enumerate(rows):
        row = list(row)
        if not row:
            raise UsageError(f"prompt_ids row {r} is empty: every prompt needs at least one token")
        for t in row:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab:
                raise UsageError(f"prompt_ids must hold integer token ids in [0, {vocab}), got {t!r} in row {r}")
        out.append([int(t) for t in row])
    return out


def row_generators(seed, batch: int) -> list[torch.Generator]:
    if seed is None:
        gens = [torch.Generator() for _ in range(batch)]
        for g in gens:
            g.seed()
        return gens
    seeds = [seed + r for r in range(batch)] if isinstance(seed, int) and not isinstance(seed, bool) else seed
    if not isinstance(seeds, (list, tuple)) or len(seeds) != batch:
        raise UsageError(f"seed must be an integer >= 0 or a list of {batch} such integers (one per row), got {seed!r}")
    return [torch.Generator().manual_seed(check_int("seed", s, 0)) for s in seeds]


def session_scaling(model, kind, factor, context: int):
    """The :class:`fibattn.model.rope.RopeScaling` of ``generate``'s options (None: plain RoPE); reached
    through the model's RoPE module, since this package sits below ``fibattn.model``."""
    rope = model.blocks[0].attn.rope
    named = isinstance(kind, str) and kind != "none"
    if factor is not None and not named:
        raise UsageError(f"rope_factor applies with rope_scaling linear, ntk or yarn (given as a name), "
                         f"got rope_scaling={kind!r}, rope_factor={factor!r}")
    if kind is None or isinstance(kind, rope.Scaling):
        return kind
    if not isinstance(kind, str) or kind not in rope.SCALING_KINDS:
        raise UsageError(f"rope_scaling must be one of {', '.join(rope.SCALING_KINDS)}, got {kind!r}")
    train_len = getattr(getattr(model, "cfg", None), "seq_len", None)
    if named and train_len is None:
        raise UsageError(f"rope_scaling {kind!r} needs the model's training length (model.cfg.seq_len)")
    return rope.make_scaling(kind, train_len or 1, factor=factor, length=context)


def check_caches_fit(model, plans, batch: int, context: int, dtype, device, flag: str) -> None:
    """Refuse a context whose full caches (grown on demand) will not fit, before the first token."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    row = [batch * b.attn.n_kv_heads * 2 * b.attn.head_dim * itemsize for b in model.blocks]
    rings = sum(r * min(p.span, context) for r, p in zip(row, plans) if p is not None)
    full = sum(r for r, p in zip(row, plans) if p is None)
    check_sizes_fit(flag, [context], lambda c: rings + full * c, "the key/value caches", device)


def keyword_arguments(generate, kwargs: dict) -> tuple:
    """``generate``'s keyword arguments after its first two, in order, defaults filled, unknown names refused (what
    ``generate_tokens`` passes on)."""
    params = list(inspect.signature(generate).parameters.values())[2:]
    unknown = set(kwargs) - {p.name for p in params}
    if unknown:
        raise TypeError(f"generate_tokens() got an unexpected keyword argument {sorted(unknown)[0]!r}")
    return tuple(kwargs.get(p.name, p.default) for p in params)
