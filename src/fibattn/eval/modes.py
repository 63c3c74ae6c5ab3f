"""Evaluation modes: temporary changes to a model's attention for one evaluation, each
restored afterwards — the sparse ``reach`` (method.md) and a dense sliding window."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..checks import check_int
from ..model.attention import REACH_MODES

__all__ = ["REACH_MODES", "banded_attention", "dense_window_mode", "reach_mode"]


def _layers(model) -> list:
    return list(model.layers()) if hasattr(model, "layers") else []


@contextlib.contextmanager
def reach_mode(model, reach: str):
    """Set every attention layer's ``reach`` for the duration (``study`` | ``train``), then restore."""
    if reach not in REACH_MODES:
        raise ValueError(f"reach must be one of {', '.join(REACH_MODES)}, got {reach!r}")
    saved = [(layer, layer.reach) for layer in _layers(model)]
    for layer, _ in saved:
        if reach == "train" and layer.reach_len is None:
            raise ValueError("reach='train' needs the layers' training length (reach_len); this model has none")
        layer.reach = reach
    try:
        yield
    finally:
        for layer, old in saved:
            layer.reach = old


def banded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, band: int) -> torch.Tensor:
    """Causal attention where query ``i`` sees keys ``i-band+1 .. i``; q ``(B,H,T,Dh)``, k/v ``(B,Hkv,T,Dh)``."""
    T = q.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if T <= band:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    out = torch.empty_like(q)
    for s in range(0, T, band):
        e = min(s + band, T)
        ks = max(0, s - band + 1)
        d = torch.arange(s, e, device=q.device)[:, None] - torch.arange(ks, e, device=q.device)[None, :]
        mask = (d >= 0) & (d < band)
        out[:, :, s:e] = F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, ks:e], v[:, :, ks:e],
                                                        attn_mask=mask, enable_gqa=gqa)
    return out


@contextlib.contextmanager
def dense_window_mode(model, band: int):
    """Make every dense layer attend distances ``0..band-1`` only (restored afterwards)."""
    check_int("dense window", band, 1)
    layers = _layers(model)
    if not layers or any(layer.attention != "dense" for layer in layers):
        raise ValueError("--dense-window needs a dense model (model.attention=dense); this one is sparse or has no "
                         "attention layers")
    for layer in layers:
        layer.attend = lambda q, k, v: banded_attention(q, k, v, band)
    try:
        yield
    finally:
        for layer in layers:
            del layer.attend
