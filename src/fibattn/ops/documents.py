"""Packed documents: which keys a query may see when a row holds several documents (method.md §8).

A row of length ``T`` may pack several documents; ``document_ids`` ``(B, T)`` (integers,
equal values in one contiguous run per document) says which. A column at distance ``d``
is valid for query ``i`` only when key ``i - d`` lies in the query's own document. Since
documents are contiguous runs, that is one per-token number, the *offset* of ``i`` inside
its document (``off[b, i] = i - first position of i's document``): distance ``d`` is valid
when ``d <= off[b, i]``, and an interpolated rung's second tap is clamped at the document
start instead of row 0. So a packed row computes exactly what each document would on its
own, and every kernel takes ``off`` (int32 ``(B, T)``) in place of the position ``i``.

Also here: the conversions from the conventions other stacks use — FlashAttention's varlen
``cu_seqlens``, transformers' restarting ``position_ids`` — and from end-of-document tokens.
"""
from __future__ import annotations

import weakref

import torch

from ..checks import UsageError

__all__ = ["document_offsets", "document_ids_from_cu_seqlens", "document_ids_from_position_ids",
           "document_ids_from_eos"]

_last: list = [None, None, None]          # (weakref to the ids, their version, the offsets): layers share one tensor


def _check(document_ids, B: int, T: int, device) -> None:
    if not isinstance(document_ids, torch.Tensor):
        raise UsageError(f"document_ids must be an integer tensor (B={B}, T={T}), got {type(document_ids).__name__}")
    if document_ids.is_floating_point() or document_ids.is_complex() or document_ids.dtype == torch.bool:
        raise UsageError(f"document_ids must be an integer tensor, got {document_ids.dtype}")
    if tuple(document_ids.shape) != (B, T):
        raise UsageError(f"document_ids must have shape (B={B}, T={T}) to match q, got {tuple(document_ids.shape)}")
    if document_ids.device != torch.device(device):
        raise UsageError(f"document_ids must be on q's device {device}, got {document_ids.device}")


def _check_contiguous(ids: torch.Tensor, starts: torch.Tensor) -> None:
    """Each document one contiguous run: runs per row == distinct values per row."""
    if ids.shape[1] < 3:
        return
    runs = starts.sum(1)
    s = ids.sort(dim=1).values
    distinct = 1 + (s[:, 1:] != s[:, :-1]).sum(1)
    bad = (runs != distinct).nonzero()
    if bad.numel():
        row = int(bad[0, 0])
        seen, value = set(), None
        for j in starts[row].nonzero().flatten().tolist():
            x = int(ids[row, j])
            if x in seen:
                value = x
                break
            seen.add(x)
        raise UsageError(f"document_ids row {row}: document {value} appears in more than one run; each document "
                         "must be one contiguous run of positions (use document_ids_from_eos or "
                         "document_ids_from_cu_seqlens to build them)")


def offsets_unchecked(document_ids: torch.Tensor) -> torch.Tensor:
    """``off`` (int32 ``(B, T)``) of contiguous runs, with no validation (what the compiler traces)."""
    B, T = document_ids.shape
    pos = torch.arange(T, device=document_ids.device)
    first = torch.ones(B, T, dtype=torch.bool, device=document_ids.device)
    first[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start = torch.where(first, pos, 0).cummax(dim=1).values
    return (pos - start).to(torch.int32).contiguous()


def document_offsets(document_ids, B: int, T: int, device) -> torch.Tensor | None:
    """The kernels' ``off`` for ``document_ids`` (None stays None), after checking them.

    The contiguity check reads the ids (a device sync on CUDA) outside ``torch.compile``; the
    same tensor passed to every layer of a model is checked and converted once."""
    if document_ids is None:
        return None
    _check(document_ids, B, T, device)
    if torch.compiler.is_compiling():
        return offsets_unchecked(document_ids)
    version = None if document_ids.is_inference() else document_ids._version      # inference tensors have none
    ref, seen, off = _last
    if version is not None and ref is not None and ref() is document_ids and seen == version:
        return off
    off = offsets_unchecked(document_ids)
    if T:
        _check_contiguous(document_ids, off == 0)
    if version is not None:
        _last[:] = [weakref.ref(document_ids), version, off]
    return off


def _integer_rows(name: str, value, keep_shape: bool = False) -> torch.Tensor:
    """``value`` as an integer tensor of rows ``(B, T)`` (a 1-D one is one row; ``keep_shape``: as given, 1-D or
    2-D); anything else -- floats, text, more dimensions -- is refused naming ``name``: it would give ids of a
    wrong shape or from rounded values."""
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise UsageError(f"{name} must be an integer tensor of shape (T,) or (B, T), got {type(value).__name__}") \
            from None
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or t.dim() not in (1, 2):
        raise UsageError(f"{name} must be an integer tensor of shape (T,) or (B, T), got {t.dtype} of shape "
                         f"{tuple(t.shape)}")
    return t if keep_shape or t.dim() == 2 else t[None]


def document_ids_from_cu_seqlens(cu_seqlens, total: int | None = None) -> torch.Tensor:
    """``document_ids`` ``(1, total)`` from FlashAttention's varlen ``cu_seqlens`` (``[0, n0, n0+n1, …]``):
    the documents packed into one row, as varlen kernels see them."""
    cu = torch.as_tensor(cu_seqlens)
    if cu.dim() != 1 or cu.numel() < 1 or cu.is_floating_point() or int(cu[0]) != 0:
        raise UsageError(f"cu_seqlens must be a 1-D integer tensor starting at 0, got {cu.tolist()!r}")
    lengths = cu[1:] - cu[:-1]
    if (lengths < 0).any():
        raise UsageError(f"cu_seqlens must be non-decreasing, got {cu.tolist()}")
    end = int(cu[-1])
    total = end if total is None else int(total)
    if total < end:
        raise UsageError(f"total ({total}) must be >= cu_seqlens[-1] ({end})")
    ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)
    if total > end:                     # padding after the last document: a document of its own
        ids = torch.cat([ids, ids.new_full((total - end,), lengths.numel())])
    return ids[None]


def document_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``document_ids`` from positions that restart at each document (transformers' padding-free
    packing, ``DataCollatorWithFlattening``): a document starts wherever the position does not
    continue the previous one."""
    pos = _integer_rows("position_ids", position_ids)
    new = torch.ones_like(pos, dtype=torch.bool)
    new[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    return new.long().cumsum(1) - 1


def document_ids_from_eos(ids: torch.Tensor, eos: int) -> torch.Tensor:
    """``document_ids`` of token rows whose documents end at ``eos`` (the ``eos`` token belongs to
    the document it ends; the next token starts the next one)."""
    ids = _integer_rows("ids", ids, keep_shape=True)
    if isinstance(eos, bool) or not isinstance(eos, int) and not (torch.is_tensor(eos) and eos.numel() == 1
                                                                  and not eos.is_floating_point()):
        raise UsageError(f"eos must be an integer token id, got {eos!r}")
    ends = ids == eos
    return ends.long().cumsum(-1) - ends.long()
