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

import numbers

import torch

from ..checks import UsageError

__all__ = ["document_offsets", "check_document_ids", "document_ids_from_cu_seqlens",
           "document_ids_from_position_ids", "document_ids_from_eos"]

_ONE_RUN = ("each document must be one contiguous run of positions (use document_ids_from_eos or "
            "document_ids_from_cu_seqlens to build them)")


def _check(document_ids, B: int, T: int, device) -> None:
    if not isinstance(document_ids, torch.Tensor):
        raise UsageError(f"document_ids must be an integer tensor (B={B}, T={T}), got {type(document_ids).__name__}")
    if document_ids.is_floating_point() or document_ids.is_complex() or document_ids.dtype == torch.bool:
        raise UsageError(f"document_ids must be an integer tensor, got {document_ids.dtype}")
    if tuple(document_ids.shape) != (B, T):
        raise UsageError(f"document_ids must have shape (B={B}, T={T}) to match q, got {tuple(document_ids.shape)}")
    if document_ids.device != torch.device(device):
        raise UsageError(f"document_ids must be on q's device {device}, got {document_ids.device}")


def _one_run_each(ids: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Per row: whether each document is one contiguous run (runs == distinct values), as a bool tensor."""
    s = ids.sort(dim=1).values
    return starts.sum(1) == 1 + (s[:, 1:] != s[:, :-1]).sum(1)


def _refuse_split(ids: torch.Tensor, starts: torch.Tensor, ok: torch.Tensor) -> None:
    """The one-line refusal naming the first row and document in more than one run (host tensors)."""
    row = int((~ok).nonzero()[0, 0])
    seen = set()
    for j in starts[row].nonzero().flatten().tolist():
        x = int(ids[row, j])
        if x in seen:
            raise UsageError(f"document_ids row {row}: document {x} appears in more than one run; {_ONE_RUN}")
        seen.add(x)


def check_document_ids(document_ids) -> None:
    """Refuse, in one line, ``document_ids`` ``(B, T)`` in which a document is split into several runs. The ops
    check this themselves; on CUDA and under ``torch.compile`` they do it on the device (an asynchronous assert,
    which fails at the next synchronisation), so callers that want the refusal up front call this on the host
    copy. Ids made by the ``document_ids_from_*`` helpers are contiguous by construction."""
    if not isinstance(document_ids, torch.Tensor) or document_ids.dim() != 2:
        raise UsageError(f"document_ids must be an integer tensor (B, T), got "
                         f"{tuple(document_ids.shape) if isinstance(document_ids, torch.Tensor) else document_ids!r}")
    _check(document_ids, *document_ids.shape, document_ids.device)
    ids = document_ids.cpu()
    starts = offsets_unchecked(ids) == 0
    if ids.shape[1] >= 3:
        ok = _one_run_each(ids, starts)
        if not bool(ok.all()):
            _refuse_split(ids, starts, ok)


def offsets_unchecked(document_ids: torch.Tensor) -> torch.Tensor:
    """``off`` (int32 ``(B, T)``) of contiguous runs, with no validation."""
    B, T = document_ids.shape
    pos = torch.arange(T, device=document_ids.device)
    first = torch.ones(B, T, dtype=torch.bool, device=document_ids.device)
    first[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start = torch.where(first, pos, 0).cummax(dim=1).values
    return (pos - start).to(torch.int32).contiguous()


def document_offsets(document_ids, B: int, T: int, device) -> torch.Tensor | None:
    """The kernels' ``off`` for ``document_ids`` (None stays None), checked on every call: nothing derived from
    the ids is kept between calls, since a batch buffer refilled in place (numpy, ``.data``, shared memory)
    may not change the tensor's version. Each document must be one contiguous run: checked on the host for
    CPU tensors in eager mode (a :class:`UsageError`), otherwise on the device without a synchronisation
    (``torch._assert_async``: a RuntimeError with the same text at the next sync; traced by the compiler)."""
    if document_ids is None:
        return None
    _check(document_ids, B, T, device)
    off = offsets_unchecked(document_ids)
    if T < 3:                                    # one or two positions: every labelling is contiguous
        return off
    starts = off == 0
    ok = _one_run_each(document_ids, starts)
    if document_ids.device.type == "cpu" and not torch.compiler.is_compiling():
        if not bool(ok.all()):
            _refuse_split(document_ids, starts, ok)
    else:
        torch._assert_async(ok.all(), f"document_ids: a document appears in more than one run; {_ONE_RUN}")
    return off


def _integer_rows(name: str, value, keep_shape: bool = False) -> torch.Tensor:
    """``value`` as an integer tensor of rows ``(B, T)`` (a 1-D one is one row; ``keep_shape``: as given, 1-D or
    2-D); anything else -- floats, text, more dimensions, integers past 64 bits -- is refused naming ``name``:
    it would give ids of a wrong shape or from rounded values."""
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise UsageError(f"{name} must be an integer tensor of shape (T,) or (B, T) with values that fit 64 bits, "
                         f"got {type(value).__name__}") from None
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or t.dim() not in (1, 2):
        raise UsageError(f"{name} must be an integer tensor of shape (T,) or (B, T), got {t.dtype} of shape "
                         f"{tuple(t.shape)}")
    return t if keep_shape or t.dim() == 2 else t[None]


def _int64(name: str, value, minimum: int) -> int:
    """A Python or NumPy integer (or a one-element integer tensor) from ``minimum`` to 2**63 - 1."""
    if torch.is_tensor(value) and value.numel() == 1 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not minimum <= value < 2 ** 63:
        low = "-2**63" if minimum == -2 ** 63 else minimum
        raise UsageError(f"{name} must be an integer from {low} to 2**63 - 1, got {value!r}")
    return int(value)


def document_ids_from_cu_seqlens(cu_seqlens, total: int | None = None) -> torch.Tensor:
    """``document_ids`` ``(1, total)`` from FlashAttention's varlen ``cu_seqlens`` (``[0, n0, n0+n1, …]``):
    the documents packed into one row, as varlen kernels see them."""
    cu = _integer_rows("cu_seqlens", cu_seqlens, keep_shape=True)
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0:
        raise UsageError(f"cu_seqlens must be a 1-D integer tensor starting at 0, got {cu.tolist()!r}")
    lengths = cu[1:] - cu[:-1]
    if (lengths < 0).any():
        raise UsageError(f"cu_seqlens must be non-decreasing, got {cu.tolist()}")
    end = int(cu[-1])
    total = end if total is None else _int64("total", total, 0)
    if total < end:
        raise UsageError(f"total ({total}) must be >= cu_seqlens[-1] ({end})")
    from ..validation import check_sizes_fit          # the ids are int64 (B=1, total): refused before allocating
    check_sizes_fit("total (cu_seqlens[-1] when not given)", [total], lambda n: 8 * n, "the document ids",
                    cu.device)
    ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)
    if total > end:                     # padding after the last document: a document of its own
        ids = torch.cat([ids, ids.new_full((total - end,), lengths.numel())])
    return ids[None]


def document_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``document_ids`` from positions that restart at each document (transformers' padding-free
    packing, ``DataCollatorWithFlattening``): a document starts wherever the position does not
    continue the previous one. Positions are >= 0."""
    pos = _integer_rows("position_ids", position_ids)
    if pos.numel() and not torch.compiler.is_compiling() and pos.device.type != "meta" and bool((pos < 0).any()):
        raise UsageError(f"position_ids must be >= 0, got {int(pos.min())}")
    new = torch.ones_like(pos, dtype=torch.bool)
    new[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    return new.long().cumsum(1) - 1


def document_ids_from_eos(ids: torch.Tensor, eos: int) -> torch.Tensor:
    """``document_ids`` of token rows whose documents end at ``eos`` (the ``eos`` token belongs to
    the document it ends; the next token starts the next one)."""
    ids = _integer_rows("ids", ids, keep_shape=True)
    eos = _int64("eos", eos, -2 ** 63)
    ends = ids == eos
    return ends.long().cumsum(-1) - ends.long()
