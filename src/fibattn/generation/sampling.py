"""How the next token is chosen from logits: temperature, top-k, top-p, one generator per row."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..checks import UsageError, check_int


@dataclass(frozen=True)
class Sampling:
    """``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 switch those filters off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise UsageError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        check_int("top_k", self.top_k, 0)
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise UsageError(f"top_p must be a number in (0, 1], got {p!r}")


def uniforms(generators: Sequence[torch.Generator], n: int) -> torch.Tensor:
    """The next ``n`` draws of every row's generator, ``(B, n)`` float64 on the host: the values :func:`sample`
    would draw over ``n`` steps, one at a time (a generator yields the same sequence either way)."""
    return torch.stack([torch.rand(n, generator=g, dtype=torch.float64) for g in generators])


def sample(logits: torch.Tensor, sampling: Sampling, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Next token per row ``(B,)`` int64 from logits ``(B, V)``; one generator per row."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    return pick(logits, sampling, u.to(logits.device))


def pick(logits: torch.Tensor, sampling: Sampling, u: torch.Tensor | None) -> torch.Tensor:
    """:func:`sample` with the rows' uniform draws ``u`` ``(B,)`` float64 given on the logits' device: device
    work alone, one shape at every step (a captured decode step samples so). ``u`` is unused when greedy."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    # shifted to max 0 and in float64 first, so any temperature > 0 (1e-300 or 1e300) gives finite or -inf
    # scores, never inf - inf = NaN: a tiny temperature tends to greedy, a huge one to uniform
    x = logits.double()
    x = (x - x.amax(dim=-1, keepdim=True)) / sampling.temperature
    if 0 < sampling.top_k < x.shape[-1]:
        kth = torch.topk(x, sampling.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    # ranked by score, not probability: at a huge temperature the probabilities tie while the scores still differ
    order = torch.argsort(x, dim=-1, descending=True, stable=True)
    probs = torch.softmax(x, dim=-1).gather(-1, order)
    if sampling.top_p < 1:
        before = torch.cumsum(probs, dim=-1) - probs           # mass of strictly more likely tokens
        probs = probs.masked_fill(before >= sampling.top_p, 0.0)
    cdf = torch.cumsum(probs.double(), dim=-1)
    u = (u * cdf[:, -1]).unsqueeze(1)
    j = torch.searchsorted(cdf, u, right=True)
    kept = (probs > 0).sum(dim=-1, keepdim=True)                 # the kept tokens come first
    return order.gather(1, torch.minimum(j, kept - 1)).squeeze(1)
