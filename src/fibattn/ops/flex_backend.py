"""Integer distances through ``torch.nn.attention.flex_attention``: a comparison point.

Layout: q ``(B, H, T, Dh)``, k and v ``(B, Hkv, T, Dh)`` (grouped heads via ``enable_gqa``).
The block mask comes from a boolean lookup over ``q_idx - kv_idx``; it is built once per
(distances, T, device) and cached; with packed documents it also keeps each query inside its
document (built per call). On CUDA the op runs through ``torch.compile`` (a fused
kernel). On CPU, torch 2.13 offers only the unfused eager path (it materialises T×T scores)
and no backward, so there the backend is a forward-only correctness check.
"""
from __future__ import annotations

import functools
import warnings

import torch

from ..checks import BackendUnavailable
from .backends import FLEX_NO_CPU_BACKWARD
from .torch_backend import clean_rows

name = "flex"
_MASK_CACHE = 16


def _api():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    return flex_attention, create_block_mask


def unavailable(device) -> str | None:
    """``None`` when flex_attention can run on ``device``, else the reason it cannot."""
    try:
        _api()
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    kind = torch.device(device).type
    if kind not in ("cuda", "cpu"):
        return f"flex_attention runs on CUDA (and CPU, forward only), got device {device}"
    return None


@functools.lru_cache(maxsize=_MASK_CACHE)
def _block_mask(dists: tuple[int, ...], T: int, device: str):
    _, create_block_mask = _api()
    allowed = torch.zeros(T, dtype=torch.bool, device=device)
    allowed[torch.tensor(dists, dtype=torch.long, device=device)] = True

    def mask_mod(b, h, q_idx, kv_idx):
        rel = q_idx - kv_idx
        return (rel >= 0) & allowed[rel.clamp(min=0)]

    return create_block_mask(mask_mod, None, None, T, T, device=device)


@functools.lru_cache(maxsize=1)
def _compiled():
    flex_attention, _ = _api()
    return torch.compile(flex_attention, dynamic=False)


def _document_mask(dists: tuple[int, ...], document_ids: torch.Tensor):
    """FlexAttention's document mask: the distance mask, and key and query in one document."""
    _, create_block_mask = _api()
    B, T = document_ids.shape
    allowed = torch.zeros(T, dtype=torch.bool, device=document_ids.device)
    allowed[torch.tensor(dists, dtype=torch.long, device=document_ids.device)] = True

    def mask_mod(b, h, q_idx, kv_idx):
        rel = q_idx - kv_idx
        return (rel >= 0) & allowed[rel.clamp(min=0)] & (document_ids[b, q_idx] == document_ids[b, kv_idx])

    return create_block_mask(mask_mod, B, None, T, T, device=document_ids.device)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dists: list[int],
                     scale: float, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    T = q.shape[2]
    on_cpu = q.device.type == "cpu"
    if on_cpu and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise BackendUnavailable(FLEX_NO_CPU_BACKWARD)
    used = tuple(d for d in dists if d < T)
    mask = _block_mask(used, T, str(q.device)) if document_ids is None else _document_mask(used, document_ids)
    # FlexAttention weights a masked key inside a partly masked block by 0, which a NaN survives: the keys and
    # values go in cleaned, and the queries that do attend a non-finite row get NaN (_poisoned)
    (k, kbad), (v, vbad) = (clean_rows(x.contiguous()) for x in (k, v))
    q = q.contiguous()
    gqa = k.shape[1] != q.shape[1]
    if not on_cpu:
        out = _compiled()(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    else:
        flex_attention, _ = _api()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            out = flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    bad = _poisoned(kbad | vbad, used, document_ids).repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return out.masked_fill(bad[..., None], float("nan"))


def _poisoned(bad: torch.Tensor, dists: tuple[int, ...], document_ids) -> torch.Tensor:
    """``(B, Hkv, T)``: the queries that attend a row marked in ``bad`` (one shifted slice per distance)."""
    T = bad.shape[-1]
    out = torch.zeros_like(bad)
    for d in dists:
        hit = bad[..., :T - d]
        if document_ids is not None:
            hit = hit & (document_ids[:, None, d:] == document_ids[:, None, :T - d])
        out[..., d:] |= hit
    return out
