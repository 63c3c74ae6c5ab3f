"""Rotary position embeddings (RoPE), interleaved-pair convention.

Layout: x ``(B, H, T, Dh)`` (any strides with a unit last stride) with ``Dh`` even; the
position of row ``t`` is ``offset + t``. Dimension pairs ``(2j, 2j + 1)`` are read as the
complex number ``x[2j] + i x[2j+1]`` and multiplied by ``exp(i * pos * theta ** (-2j / Dh))``
(one complex multiply forward and backward). The result is contiguous, in x's dtype;
the rotation is computed in float32 from float64 angle tables.

Tables are computed on demand for the positions asked for (never all of
``max_seq_len`` at once) and cached per device for the longest prefix seen so far.
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
        # a plain float64 CPU tensor, not a buffer: model.to(bfloat16) must not round it
        self._inv_freq = theta ** (-torch.arange(head_dim // 2, dtype=torch.float64, device="cpu") * 2 / head_dim)
        self._cache: dict = {}        # device -> float32 (n, Dh/2, 2): (cos, sin) for positions 0..n-1

    def rotations(self, end: int, device) -> torch.Tensor:
        """``(cos, sin)`` of ``pos * freq`` as float32 ``(end, Dh/2, 2)`` for positions ``0..end-1``
        (real, so that a compiled graph holds no complex tensor)."""
        if end > self.max_seq_len:
            raise ValueError(f"position {end - 1} exceeds model.max_seq_len={self.max_seq_len}; "
                             f"raise model.max_seq_len (positions must be < max_seq_len)")
        key = str(device)
        hit = self._cache.get(key)
        if hit is None or hit.shape[0] < end:
            n = max(end, 2 * hit.shape[0] if hit is not None else 0)
            n = min(max(n, 256), self.max_seq_len)
            ang = torch.arange(n, dtype=torch.float64, device="cpu")[:, None] * self._inv_freq[None, :]
            hit = torch.stack([ang.cos(), ang.sin()], dim=-1).to(device=device, dtype=torch.float32)
            self._cache[key] = hit
        return hit[:end]

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        if x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise ValueError(f"RoPE expects (B, H, T, {self.head_dim}), got {tuple(x.shape)}")
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        B, H, T, Dh = x.shape
        rot = self.rotations(offset + T, x.device)[offset:]
        pairs = x.float().reshape(B, H, T, Dh // 2, 2)
        if torch.compiler.is_compiling():          # inductor has no complex kernels: the same rotation in reals
            c, s = rot[..., 0], rot[..., 1]
            x0, x1 = pairs[..., 0], pairs[..., 1]
            out = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1)
        else:
            out = torch.view_as_real(torch.view_as_complex(pairs) * torch.view_as_complex(rot))
        return out.reshape(B, H, T, Dh).to(x.dtype)

    def _apply(self, fn, recurse=True):      # .to(device) drops the cached tables
        self._cache = {}
        return super()._apply(fn, recurse)


def _pair_order(head_dim: int) -> torch.Tensor:
    """Row order that takes interleaved pairs ``(2j, 2j+1)`` to halves ``(j, j + Dh/2)``."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def interleaved_to_halves(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Rows of a q or k projection ``(heads * Dh, C)`` from this module's interleaved RoPE pairs to the
    rotate-half convention (transformers' Llama): the scores ``q·k`` are unchanged when both are permuted."""
    return w.reshape(heads, head_dim, -1)[:, _pair_order(head_dim)].reshape(heads * head_dim, -1)


def halves_to_interleaved(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """The inverse of :func:`interleaved_to_halves`."""
    inverse = torch.argsort(_pair_order(head_dim))
    return w.reshape(heads, head_dim, -1)[:, inverse].reshape(heads * head_dim, -1)
