"""Rotary position embeddings (RoPE), "rotate-half" convention.

Layout: x ``(B, H, T, Dh)`` with ``Dh`` even; position of row ``t`` is ``offset + t``.
Dimension pairs are ``(j, j + Dh/2)`` rotated by angle ``pos * theta ** (-2j / Dh)``.
cos/sin tables are computed in float64 on demand for the positions asked for (never
for all of ``max_seq_len`` at once) and cached for the longest prefix seen so far.
"""
from __future__ import annotations

import math

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Applies RoPE to ``(B, H, T, Dh)`` tensors; ``forward(x, offset=0)``."""

    def __init__(self, head_dim: int, *, theta: float = 1e4, max_seq_len: int = 1 << 20):
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
            raise ValueError(f"head_dim must be an even integer >= 2 for RoPE, got {head_dim!r}")
        theta = float(theta)
        if not math.isfinite(theta) or theta <= 0:
            raise ValueError(f"rope theta must be a finite number > 0, got {theta}")
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise ValueError(f"max_seq_len must be an integer >= 1, got {max_seq_len!r}")
        self.head_dim, self.theta, self.max_seq_len = head_dim, theta, max_seq_len
        half = head_dim // 2
        # a plain float64 CPU tensor, not a buffer: model.to(bfloat16) must not round it
        self._inv_freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / head_dim)
        self._cache: dict = {}        # (device, dtype) -> (cos, sin) for positions 0..n-1

    def tables(self, end: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape ``(end, Dh/2)`` for positions ``0..end-1``."""
        if end > self.max_seq_len:
            raise ValueError(f"position {end - 1} exceeds model.max_seq_len={self.max_seq_len}; "
                             f"raise model.max_seq_len (positions must be < max_seq_len)")
        key = (str(device), dtype)
        hit = self._cache.get(key)
        if hit is None or hit[0].shape[0] < end:
            n = max(end, 2 * hit[0].shape[0] if hit is not None else 0)
            n = min(max(n, 256), self.max_seq_len)
            pos = torch.arange(n, dtype=torch.float64)
            ang = pos[:, None] * self._inv_freq[None, :]
            hit = (ang.cos().to(device=device, dtype=dtype), ang.sin().to(device=device, dtype=dtype))
            self._cache[key] = hit
        return hit[0][:end], hit[1][:end]

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        if x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise ValueError(f"RoPE expects (B, H, T, {self.head_dim}), got {tuple(x.shape)}")
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        T = x.shape[2]
        cos, sin = self.tables(offset + T, x.device, torch.float32)
        cos, sin = cos[offset:], sin[offset:]
        xf = x.float()
        half = self.head_dim // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return out.to(x.dtype)

    def _apply(self, fn, recurse=True):      # .to(device) / .half() drop the cached tables
        self._cache = {}
        return super()._apply(fn, recurse)
