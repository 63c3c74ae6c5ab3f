"""Evaluation modes: temporary changes to a model for one evaluation, each restored afterwards.

One family (method.md §7), chosen per run without retraining: ``none`` (the model as trained),
``linear`` / ``ntk`` / ``yarn`` (RoPE scaling, any model; on a sparse one it changes the angles of
the attended distances) and ``window`` (a dense model with a sliding window of its training
length). The sparse ``reach`` (method.md §1) is orthogonal to RoPE scaling and combines with it.

The recorded ``mode`` of a result (:func:`mode_name`; eval.json and the results DB key on it):
``study`` / ``train`` (the reach, no scaling), ``dense-window``, ``<reach>+<kind>`` (scaling at the
default factor, evaluation length / training length) and ``<reach>+<kind>@<factor>`` (a fixed
factor), e.g. ``study+yarn``, ``train+ntk@4``; ``+docs`` ends the name of a document-masked evaluation.
Results recorded before scaling existed keep their names.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..checks import UsageError, check_int
from ..model.attention import REACH_MODES
from ..model.rope import SCALING_KINDS, RopeScaling, check_factor, make_scaling, rope_scaling_mode

__all__ = ["EVAL_MODES", "REACH_MODES", "SCALING_KINDS", "WINDOW_MODE", "RopeScaling", "banded_attention",
           "check_factor", "dense_window_mode", "make_scaling", "mode_name", "reach_mode", "resolve_mode",
           "rope_scaling_mode"]

EVAL_MODES = SCALING_KINDS + ("window",)
WINDOW_MODE = "dense-window"          # the recorded name of the window mode (unchanged since it was added)


def resolve_mode(mode=None, *, dense_window: bool = False) -> str:
    """The one evaluation mode named (``none`` when none is): ``mode`` is ``fibattn eval --mode``;
    ``dense_window=True`` (:func:`fibattn.eval.perplexity.evaluate`'s keyword) spells ``window``."""
    if mode is not None and mode not in EVAL_MODES:
        raise UsageError(f"--mode must be one of {', '.join(EVAL_MODES)}, got {mode!r}")
    if dense_window and mode not in (None, "window"):
        raise UsageError(f"dense_window=True is mode 'window' and does not combine with mode {mode!r}; "
                         f"choose one of {', '.join(EVAL_MODES)}")
    return "window" if dense_window else mode or "none"


def mode_name(mode: str, reach: str, factor=None, documents: bool = False) -> str:
    """The recorded name of an evaluation in ``mode`` with ``reach`` (and a fixed ``factor``, if any);
    ``documents`` (document masking, method.md §8) adds ``+docs``."""
    if mode not in EVAL_MODES:
        raise UsageError(f"--mode must be one of {', '.join(EVAL_MODES)}, got {mode!r}")
    docs = "+docs" if documents else ""
    if mode == "window":
        return WINDOW_MODE + docs
    if mode == "none":
        return reach + docs
    return f"{reach}+{mode}" + ("" if factor is None else f"@{check_factor(factor, '--rope-factor'):g}") + docs


def _layers(model) -> list:
    return list(model.layers()) if hasattr(model, "layers") else []


@contextlib.contextmanager
def reach_mode(model, reach: str):
    """Set every attention layer's ``reach`` for the duration (``study`` | ``train``), then restore."""
    if reach not in REACH_MODES:
        raise UsageError(f"reach must be one of {', '.join(REACH_MODES)}, got {reach!r}")
    saved = [(layer, layer.reach) for layer in _layers(model)]
    for layer, _ in saved:
        if reach == "train" and layer.reach_len is None:
            raise UsageError("reach='train' needs the layers' training length (reach_len); this model has none")
        layer.reach = reach
    try:
        yield
    finally:
        for layer, old in saved:
            layer.reach = old


def banded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, band: int,
                     document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention where query ``i`` sees keys ``i-band+1 .. i`` (of its own document, with
    ``document_ids``); q ``(B,H,T,Dh)``, k/v ``(B,Hkv,T,Dh)``."""
    T = q.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if T <= band and document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    out = torch.empty_like(q)
    for s in range(0, T, band):
        e = min(s + band, T)
        ks = max(0, s - band + 1)
        d = torch.arange(s, e, device=q.device)[:, None] - torch.arange(ks, e, device=q.device)[None, :]
        mask = (d >= 0) & (d < band)
        if document_ids is not None:
            mask = (mask & (document_ids[:, s:e, None] == document_ids[:, None, ks:e]))[:, None]
        out[:, :, s:e] = F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, ks:e], v[:, :, ks:e],
                                                        attn_mask=mask, enable_gqa=gqa)
    return out


@contextlib.contextmanager
def dense_window_mode(model, band: int):
    """Make every dense layer attend distances ``0..band-1`` only (restored afterwards)."""
    check_int("dense window", band, 1)
    layers = _layers(model)
    if not layers or any(layer.attention != "dense" for layer in layers):
        raise UsageError("--mode window needs a dense model (model.attention=dense); this one is "
                         "sparse or has no attention layers")
    for layer in layers:
        layer.attend = lambda q, k, v, document_ids=None: banded_attention(q, k, v, band, document_ids)
        layer.window_band = band          # what context parallelism reads: the band is a distance set (method.md §9)
    try:
        yield
    finally:
        for layer in layers:
            del layer.attend, layer.window_band
