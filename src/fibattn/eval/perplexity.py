"""Token-level perplexity, bits per byte and per-position loss across lengths.

:func:`evaluate` takes any model and token arrays in memory; for a run folder (its
checkpoint, validation splits, ``RUN/eval.json``, the results database and plots) see
:func:`fibattn.eval.run_folder.evaluate_run` and the ``fibattn eval`` command.

Layout: a validation split is a 1-D token array ``toks``. A window of length ``L`` starting
at ``s`` has inputs ``toks[s : s+L]`` and targets ``toks[s+1 : s+L+1]``; logits ``(B, L, V)``.

Rules (what a result means):

- **Same tokens at every length.** The budget ``min(tokens, len(toks) - 1)`` is rounded
  down to a multiple ``N`` of the largest length; every length cuts the targets
  ``toks[1 : N+1]`` into ``floor(N / L)`` back-to-back windows, so a 4096 window covers the
  same text as four 1024 windows. Every position of every window is scored (the study's
  token-level perplexity), so a shorter length scores more tokens with little context.
- **Any set of lengths works.** When a length ``L`` does not divide ``N`` (``33`` and ``47``
  together, say), the ``r = N mod L`` targets left after the back-to-back windows are
  scored by one more full-length window, the one that ends at target ``N`` (inputs
  ``toks[N-L : N]``); only its last ``r`` positions are scored, the rest is context. So
  every length still scores exactly the same ``N`` targets, each once, every forward pass
  has length ``L`` (the model and its distances are those of length ``L``), and lengths
  that divide ``N`` are scored exactly as before. The tail window's scored positions hold
  one window more than the others in the per-position loss (it is a mean per position).
- ``ppl = exp(mean token NLL)`` (natural log). ``bpb = sum NLL / (ln 2 * bytes)``, where
  ``bytes`` is the UTF-8 size of the scored targets: with the byte tokenizer every
  token other than end-of-document is one byte (eos counts 0); otherwise the scored
  targets are decoded in one piece and the UTF-8 bytes of that text are counted.
- ``reach="study"`` rebuilds the attended distances at the evaluation length;
  ``"train"`` caps them at the training length (method.md §1). Set for the evaluation only.
- ``dense_window``: a dense model evaluated with a sliding window of its training length
  ``S``: each query sees distances ``0..S-1`` only (exactly what it saw in training). It
  runs blockwise: query block ``[s, s+S)`` attends keys ``[s-S+1, s+S)`` through SDPA with
  a banded mask, so cost is O(T·2S) and the result is exact (no chunk-overlap approximation).
  It is the ``window`` member of the evaluation modes (:mod:`fibattn.eval.modes`, method.md §7).
- ``mode`` ``linear | ntk | yarn``: RoPE scaling, set per length with the factor ``rope_factor``
  or, by default, ``max(1, L / S)`` (so at and below the training length nothing changes).
- Per-position loss: mean NLL by position within the window, in ``buckets`` equal spans.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import time
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..checks import UsageError, check_int
from ..config import ModelConfig
from ..ops.backends import check_model_runs
from ..ops.documents import document_ids_from_eos
from ..parallel import sharded
from ..validation import check_sizes_fit
from .records import EvalRecord, EvalReport
from .modes import (REACH_MODES, SCALING_KINDS, WINDOW_MODE, banded_attention, check_factor, dense_window_mode,
                    mode_name, reach_mode, resolve_mode, rope_scaling_mode)

log = logging.getLogger("fibattn")

__all__ = ["REACH_MODES", "SCALING_KINDS", "WINDOW_MODE", "EvalRecord", "EvalReport", "banded_attention",
           "bits_per_byte", "count_bytes", "dense_window_mode", "evaluate", "position_buckets", "reach_mode",
           "rope_scaling_mode", "scored_budget", "scored_target_positions", "token_nll", "window_plan",
           "window_starts"]

_LOGIT_ELEMS = 1 << 25           # logits materialised at once (B * chunk * V), ~128 MB in fp32
PROGRESS_S = 10.0                # scoring that takes longer says how far it is, this often
_logged: set = set()


def _log_once(msg: str, *args) -> None:
    key = msg % args
    if key not in _logged:
        _logged.add(key)
        log.info(msg, *args)


# ----------------------------------------------------------------------------- validation
def check_lengths(lengths) -> list[int]:
    """The evaluation lengths as a sorted list without repeats; a ValueError naming ``lengths``
    (``--lengths``), the value and what is allowed otherwise. Any lengths >= 1 go together."""
    if isinstance(lengths, (int, np.integer)) and not isinstance(lengths, bool):
        lengths = [lengths]
    if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__iter__"):
        raise UsageError(f"lengths (--lengths) must be a list of integers >= 1, got {lengths!r}")
    lengths = list(lengths)
    if not lengths:
        raise UsageError("lengths (--lengths) must hold at least one evaluation length (integers >= 1), got []")
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise UsageError(f"lengths (--lengths): each evaluation length must be an integer >= 1, got {n!r} "
                             f"in {lengths!r}")
    return sorted({int(n) for n in lengths})


# ----------------------------------------------------------------------------- pure helpers
def scored_budget(available: int, tokens: int, lengths: Sequence[int], name: str = "split") -> int:
    """Number of scored targets: ``min(tokens, available - 1)`` rounded down to a multiple of ``max(lengths)``."""
    longest = max(lengths)
    n = (min(tokens, available - 1) // longest) * longest
    if n < longest:
        fits = max(min(tokens, available - 1), 0)
        raise UsageError(f"validation split {name!r} has {available} tokens and the budget is tokens={tokens}; "
                         f"evaluating at lengths (--lengths) up to {longest} needs at least {longest + 1} tokens in "
                         f"the split and tokens >= {longest}; allowed here: lengths up to {fits}")
    return n


def window_plan(n_scored: int, length: int) -> list[tuple[int, int]]:
    """The windows of ``length`` that score targets ``1..n_scored`` once each: ``(start, first)``.

    A window has inputs ``toks[start : start+length]`` and targets ``toks[start+1 :
    start+length+1]``; its positions ``first..length-1`` are scored (``first`` is 0 except for
    the tail window that ends at target ``n_scored`` when ``length`` does not divide it).
    """
    length = check_int("length (one of lengths)", length, 1)
    n_scored = check_int("n_scored", n_scored, 0)
    if length > n_scored:
        raise UsageError(f"lengths (--lengths): length {length} is longer than the {n_scored} scored targets; "
                         f"allowed: lengths up to {n_scored}")
    full = n_scored // length * length
    plan = [(s, 0) for s in range(0, full, length)]
    if full < n_scored:
        plan.append((n_scored - length, length - (n_scored - full)))
    return plan


def window_starts(n_scored: int, length: int) -> list[int]:
    """Start offsets of the windows of ``length`` covering ``n_scored`` targets (see :func:`window_plan`)."""
    return [s for s, _ in window_plan(n_scored, length)]


def scored_target_positions(n_scored: int, length: int) -> np.ndarray:
    """Indices into the split of every scored target, in window order (for tests and audits)."""
    return np.concatenate([np.arange(s + first + 1, s + length + 1) for s, first in window_plan(n_scored, length)])


def bits_per_byte(total_nll: float, n_bytes: int) -> float:
    """``sum NLL (nats) / (ln 2 * bytes)``."""
    if n_bytes <= 0:
        raise UsageError(f"bits per byte needs a positive byte count, got {n_bytes}")
    return total_nll / (math.log(2) * n_bytes)


def count_bytes(tokenizer, targets: np.ndarray) -> int:
    """UTF-8 bytes of the scored targets (byte tokenizer: non-eos tokens; else: decoded text)."""
    if getattr(tokenizer, "name", None) == "byte":
        return int(np.count_nonzero(np.asarray(targets) != tokenizer.eos_id))
    return len(tokenizer.decode(np.asarray(targets).tolist()).encode("utf-8"))


def bucket_edges(length: int, buckets: int) -> list[int]:
    nb = min(buckets, length)
    return [round(i * length / nb) for i in range(nb + 1)]


def position_buckets(pos_sum: np.ndarray, per_position_count, buckets: int) -> list[dict]:
    """Mean loss of positions ``[start, end)`` for ``min(buckets, L)`` equal spans of the window.

    ``per_position_count``: scored windows per position, one number or an array ``(L,)``."""
    edges = bucket_edges(len(pos_sum), buckets)
    count = np.broadcast_to(np.asarray(per_position_count, dtype=np.float64), np.shape(pos_sum))
    return [{"start": a, "end": b, "loss": float(pos_sum[a:b].sum() / count[a:b].sum())}
            for a, b in zip(edges[:-1], edges[1:])]


def safe_exp(x: float) -> float:
    return math.exp(x) if x < 700 else float("inf")


def token_nll(model, x: torch.Tensor, y: torch.Tensor, document_ids: torch.Tensor | None = None,
              offset: int = 0) -> torch.Tensor:
    """Per-token NLL ``(B, L)`` in float32; a FibLM's head runs in chunks to bound logits memory.
    ``document_ids``: packed documents scored each on its own; ``offset``: the global position of
    ``x[:, 0]`` (a context-parallel chunk) — a FibLM only."""
    if hasattr(model, "hidden") and hasattr(model, "embed"):
        h = model.hidden(x, offset, document_ids) if document_ids is not None or offset else model.hidden(x)
        weight = getattr(model, "output_weight", model.embed.weight)
        chunk = max(1, _LOGIT_ELEMS // max(1, x.shape[0] * weight.shape[0]))
        parts = []
        for c in range(0, x.shape[1], chunk):
            logits = F.linear(h[:, c:c + chunk], weight).float()
            parts.append(F.cross_entropy(logits.transpose(1, 2), y[:, c:c + chunk], reduction="none"))
        return torch.cat(parts, dim=1)
    if document_ids is not None or offset:
        raise UsageError("document masking and context parallelism need a fibattn model (FibLM), got "
                         + type(model).__name__)
    logits = model(x)
    return F.cross_entropy(logits.float().transpose(1, 2), y, reduction="none")


def _window_nll(model, x, y, document_ids, context) -> torch.Tensor:
    """:func:`token_nll` of whole windows; with a context group each rank scores its chunk and every
    rank gets the whole window's values (a window that does not split is scored whole)."""
    if context is None or x.shape[1] % context.size:
        return token_nll(model, x, y, document_ids)
    shard = context.shard(x.shape[1], document_ids)
    with sharded(model, shard):
        return context.gather(token_nll(model, shard.local(x), shard.local(y), offset=shard.start))


def _model_device(model) -> torch.device:
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def _autocast(precision: str, device: torch.device):
    if precision not in ("fp32", "bf16"):
        raise UsageError(f"precision must be fp32 or bf16 here, got {precision!r}")
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------- the evaluation
def _check_arrays(token_arrays) -> dict:
    if not isinstance(token_arrays, dict) or not token_arrays:
        raise UsageError("token_arrays must be a non-empty dict {split name: 1-D token array}")
    out = {}
    for name, arr in token_arrays.items():
        a = np.asarray(arr)
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
            raise UsageError(f"validation split {name!r} must be a 1-D integer token array, got "
                             f"shape {a.shape} dtype {a.dtype}")
        out[name] = a
    return out


def _score_length(model, arr: np.ndarray, n: int, length: int, batch_size: int, precision: str,
                  device: torch.device, eos: int | None = None, context=None,
                  label: str = "") -> tuple[np.ndarray, np.ndarray, int]:
    """Summed NLL and scored count per window position ``(L,)``, and the number of windows,
    over the windows of :func:`window_plan`; ``eos``: documents end at it and are scored each on
    its own (document masking), else None; ``context``: a :class:`fibattn.parallel.ContextGroup`
    sharing each window (method.md §9); ``label``: what a progress line every :data:`PROGRESS_S` names."""
    pos_sum = np.zeros(length, dtype=np.float64)
    pos_count = np.zeros(length, dtype=np.int64)
    plan = window_plan(n, length)
    start = last = time.perf_counter()
    for j in range(0, len(plan), batch_size):
        now = time.perf_counter()
        if j and now - last >= PROGRESS_S:
            last = now
            log.info("fibattn eval: %s: %d/%d windows (%.0f%%), eta %.0fs", label, j, len(plan), 100 * j / len(plan),
                     (now - start) / j * (len(plan) - j))
        chunk = plan[j:j + batch_size]
        x = torch.from_numpy(np.stack([arr[s:s + length] for s, _ in chunk]).astype(np.int64)).to(device)
        y = torch.from_numpy(np.stack([arr[s + 1:s + length + 1] for s, _ in chunk]).astype(np.int64)).to(device)
        with _autocast(precision, device):
            nll = _window_nll(model, x, y, None if eos is None else document_ids_from_eos(x, eos), context)
        if not torch.isfinite(nll).all():
            raise FloatingPointError(f"non-finite loss at length {length}, windows starting {chunk[0][0]}.."
                                     f"{chunk[-1][0]}")
        nll = nll.double().cpu().numpy()
        for row, (_, first) in enumerate(chunk):
            pos_sum[first:] += nll[row, first:]
            pos_count[first:] += 1
    return pos_sum, pos_count, len(plan)


def evaluate(model, token_arrays: dict, lengths, *, tokens: int = 1 << 20, reach: str = "study",
             batch_size: int = 4, dense_window: bool = False, tokenizer=None, buckets: int = 32,
             precision: str = "fp32", mode: str | None = None, rope_factor: float | None = None,
             document_eos: int | None = None, context=None) -> EvalReport:
    """Perplexity (and bits per byte with a ``tokenizer``) of ``model`` on each split at each length.

    ``model``: a :class:`fibattn.model.lm.FibLM`, or any module mapping ``(B, L)`` ids to
    ``(B, L, V)`` logits. Runs in eval mode under ``torch.inference_mode`` on the model's
    device; the model's training flag and layer settings are restored afterwards.
    ``mode``: ``none | linear | ntk | yarn | window`` (``dense_window=True`` is ``window``);
    ``rope_factor`` fixes the RoPE scaling factor (default: ``max(1, L / training length)``).
    ``document_eos``: document masking — each window's documents, ended by this token, are scored
    each on its own (method.md §8); the mode name then ends in ``+docs``, so masked and unmasked
    results are never mixed. ``context``: a :class:`fibattn.parallel.ContextGroup` whose ranks share
    each window (each computes its chunk's activations, method.md §9), or None.
    """
    lengths = check_lengths(lengths)
    tokens = check_int("tokens", tokens, 1)
    batch_size = check_int("batch_size", batch_size, 1)
    buckets = check_int("buckets", buckets, 1)
    arrays = _check_arrays(token_arrays)
    cfg = getattr(model, "cfg", None)
    train_len = getattr(cfg, "seq_len", None)
    limit = getattr(cfg, "max_seq_len", None)
    if limit is not None and max(lengths) > limit:
        raise UsageError(f"lengths (--lengths): evaluation length {max(lengths)} exceeds model.max_seq_len={limit}; "
                         f"allowed: lengths up to {limit}")
    kind = resolve_mode(mode, dense_window=dense_window)
    dense_window = kind == "window"
    scaling = kind if kind in SCALING_KINDS[1:] else None
    if rope_factor is not None and scaling is None:
        raise UsageError(f"rope_factor (--rope-factor) applies to the RoPE scaling modes "
                         f"({', '.join(SCALING_KINDS[1:])}), not to mode {kind!r}; got {rope_factor!r}")
    if rope_factor is not None:
        rope_factor = check_factor(rope_factor, "rope_factor (--rope-factor)")
    if dense_window and train_len is None:
        raise UsageError("dense_window needs a model with cfg.seq_len (the training length)")
    if scaling and train_len is None:
        raise UsageError(f"mode {scaling!r} needs a model with cfg.seq_len (the training length)")
    device = _model_device(model)
    if isinstance(cfg, ModelConfig):
        check_model_runs(cfg, device, grad=False)         # a backend that cannot run, before any scoring
    if hasattr(cfg, "vocab_size") and hasattr(cfg, "d_model"):
        # per scored position at least its float32 logits and a few hidden states; batches are capped by the budget
        per_token = 4 * (cfg.vocab_size + 4 * cfg.d_model)
        share = context.size if context is not None else 1           # each rank holds its chunk's activations
        check_sizes_fit("lengths (--lengths)", lengths,
                        lambda n: max(1, min(batch_size, tokens // n)) * n * per_token // share,
                        f"a batch of up to {batch_size} windows (--batch-size) with their logits", device)
    if document_eos is not None:
        document_eos = check_int("document_eos", document_eos, 0)
    report = EvalReport(settings={"lengths": lengths, "tokens_budget": tokens, "reach": reach,
                                  "mode": mode_name(kind, reach, rope_factor, document_eos is not None),
                                  "eval_mode": kind,
                                  "document_masking": document_eos is not None, "document_eos": document_eos,
                                  "rope_scaling": scaling, "rope_factor": rope_factor,
                                  "dense_window": train_len if dense_window else None, "batch_size": batch_size,
                                  "buckets": buckets, "precision": precision, "device": str(device),
                                  "train_len": train_len, "context_parallel": context.size if context else 1})
    if scaling and any(getattr(m, "attention", None) == "sparse" for m in model.modules()):
        report.settings["scaling_note"] = (f"RoPE scaling {scaling} on a sparse model: the angles of the attended "
                                           f"distances change (method.md §7)")
    was_training = model.training
    model.eval()
    window = dense_window_mode(model, train_len) if dense_window else contextlib.nullcontext()
    try:
        with torch.inference_mode(), reach_mode(model, reach), window:
            for name, arr in arrays.items():
                _evaluate_split(model, report, name, arr, lengths, tokens, batch_size, tokenizer, buckets,
                                precision, device, context)
    finally:
        model.train(was_training)
    return report


def _evaluate_split(model, report: EvalReport, name: str, arr: np.ndarray, lengths: list[int], tokens: int,
                    batch_size: int, tokenizer, buckets: int, precision: str, device: torch.device,
                    context=None) -> None:
    s = report.settings
    n = scored_budget(len(arr), tokens, lengths, name)
    targets = arr[1:n + 1]
    nbytes = count_bytes(tokenizer, targets) if tokenizer is not None else None
    sha = hashlib.sha256(targets.astype(np.int64).tobytes()).hexdigest()
    report.datasets[name] = {"tokens": n, "bytes": nbytes, "sha256": sha, "first": 1, "last": n}
    log.info("fibattn eval: %s: scoring the same %d tokens (of %d; budget tokens=%d) at length%s %s", name, n,
             len(arr) - 1, tokens, "s" if len(lengths) > 1 else "", ", ".join(map(str, lengths)))
    for length in lengths:
        t0 = time.perf_counter()
        with rope_scaling_mode(model, s["rope_scaling"] or "none", s["rope_factor"], length=length,
                               original_len=s["train_len"]) as sc:
            pos_sum, pos_count, windows = _score_length(model, arr, n, length, batch_size, precision, device,
                                                        s["document_eos"], context, f"{name} @ {length}")
        if int(pos_count.sum()) != n:                                  # each target once, at every length
            raise RuntimeError(f"internal error: length {length} scored {int(pos_count.sum())} targets, not {n}")
        total = float(pos_sum.sum())
        mean = total / n
        rec = EvalRecord(dataset=name, length=length, reach=s["reach"], mode=s["mode"], tokens=n,
                         windows=windows, nll=mean, ppl=safe_exp(mean),
                         bpb=bits_per_byte(total, nbytes) if nbytes else None, bytes=nbytes,
                         dense_window=s["dense_window"], train_len=s["train_len"], scored_sha256=sha,
                         buckets=position_buckets(pos_sum, pos_count, buckets),
                         seconds=round(time.perf_counter() - t0, 3), rope_scaling=s["rope_scaling"],
                         rope_factor=(sc.factor if sc else 1.0) if s["rope_scaling"] else None,
                         document_masking=s["document_masking"])
        report.records.append(rec)
        log.info("fibattn eval: %s @ %d (%s): ppl %.3f over %d tokens in %.1fs", name, length, rec.mode, rec.ppl, n,
                 rec.seconds)
