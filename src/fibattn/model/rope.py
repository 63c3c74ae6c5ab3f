"""Rotary position embeddings (RoPE), interleaved-pair convention, and RoPE scaling.

Layout: x ``(B, H, T, Dh)`` (any strides with a unit last stride) with ``Dh`` even; the
position of row ``t`` is ``offset + t``. Dimension pairs ``(2j, 2j + 1)`` are read as the
complex number ``x[2j] + i x[2j+1]`` and multiplied by ``exp(i * pos * theta ** (-2j / Dh))``
(one complex multiply forward and backward). The result is contiguous, in x's dtype;
the rotation is computed in float32 from float64 angle tables.

Tables are computed on demand for the positions asked for (never all of
``max_seq_len`` at once) and cached per device (and scaling) for the longest prefix seen so far.

Scaling (method.md §7): a :class:`RopeScaling` set on a :class:`RotaryEmbedding` (``scaling``;
``None`` is plain RoPE) changes the frequencies — ``linear`` (position interpolation), ``ntk``
(base change) or ``yarn`` (per-frequency ramp) — and, for ``yarn``, multiplies the rotation by
``qk_scale = 0.1 ln s + 1`` so that q·k, hence the logits, grow by ``qk_scale**2 = 1/t``.
:func:`rope_scaling_mode` sets it on every RoPE of a model for the duration of a ``with``.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from ..checks import UsageError

SCALING_KINDS = ("none", "linear", "ntk", "yarn")
_CACHE_MAX = 8                   # tables kept per module: a few (device, scaling) pairs


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling by ``factor`` (``s >= 1``) for a model trained at ``original_len``.

    ``alpha`` / ``beta``: yarn's ramp bounds, in rotations of a frequency over ``original_len``
    (the YaRN paper's values for Llama, 1 and 32)."""

    kind: str
    factor: float
    original_len: int
    alpha: float = 1.0
    beta: float = 32.0

    def __post_init__(self):
        if self.kind not in SCALING_KINDS[1:]:
            raise UsageError(f"rope scaling kind must be one of {', '.join(SCALING_KINDS[1:])} (no scaling: "
                             f"None), got {self.kind!r}")
        object.__setattr__(self, "factor", check_factor(self.factor))
        ol = self.original_len
        if isinstance(ol, bool) or not isinstance(ol, int) or ol < 1:
            raise UsageError(f"rope scaling original_len (the training length) must be an integer >= 1, got {ol!r}")
        if not (math.isfinite(self.alpha) and math.isfinite(self.beta) and 0 <= self.alpha < self.beta):
            raise UsageError(f"rope scaling yarn ramp needs finite 0 <= alpha < beta, got alpha={self.alpha}, "
                             f"beta={self.beta}")

    def inv_freq(self, theta: float, head_dim: int) -> torch.Tensor:
        """The scaled frequencies of pairs ``j = 0 .. Dh/2-1``, float64 on CPU (method.md §7)."""
        j = torch.arange(head_dim // 2, dtype=torch.float64)
        s = self.factor
        if self.kind == "linear":                # positions / s  ==  every frequency / s
            return theta ** (-2 * j / head_dim) / s
        if self.kind == "ntk":                   # a larger base; Dh = 2 has only the frequency 1, unchanged
            base = theta * s ** (head_dim / (head_dim - 2)) if head_dim > 2 else theta
            return base ** (-2 * j / head_dim)
        freq = theta ** (-2 * j / head_dim)
        rotations = self.original_len * freq / (2 * math.pi)      # original_len / wavelength
        gamma = ((rotations - self.alpha) / (self.beta - self.alpha)).clamp(0.0, 1.0)
        return (1 - gamma) * freq / s + gamma * freq

    @property
    def qk_scale(self) -> float:
        """Multiplier on q and on k (``sqrt(1/t)``): ``0.1 ln s + 1`` for yarn, else 1."""
        return 0.1 * math.log(self.factor) + 1.0 if self.kind == "yarn" else 1.0

    @property
    def temperature(self) -> float:
        """yarn's attention temperature ``t``: the logits are divided by it (``1/t = qk_scale**2``)."""
        return 1.0 / self.qk_scale ** 2

    def label(self) -> str:
        return f"{self.kind} x{self.factor:g} (trained at {self.original_len})"


def check_factor(factor, name: str = "rope factor") -> float:
    """A finite number >= 1 (a factor below 1 would shrink the context, not extend it)."""
    try:
        value = float(factor)
    except (TypeError, ValueError):
        raise UsageError(f"{name} must be a number >= 1, got {factor!r}") from None
    if isinstance(factor, bool) or not math.isfinite(value) or value < 1:
        raise UsageError(f"{name} must be a finite number >= 1, got {factor!r}")
    return value


def make_scaling(kind, original_len: int, *, factor=None, length: int | None = None) -> RopeScaling | None:
    """The scaling of ``kind`` (a name, a :class:`RopeScaling` or None) for a model trained at
    ``original_len``: ``factor`` if given, else ``max(1, length / original_len)``. None when there
    is nothing to change (kind ``none``, or a factor of exactly 1), so plain RoPE runs bit for bit."""
    if kind is None or isinstance(kind, RopeScaling):
        return kind
    if kind not in SCALING_KINDS:
        raise UsageError(f"rope scaling must be one of {', '.join(SCALING_KINDS)}, got {kind!r}")
    if kind == "none":
        return None
    if factor is None:
        if length is None:
            raise UsageError(f"rope scaling {kind!r} needs a factor or the length it is for (factor = length / "
                             f"training length)")
        factor = max(1.0, length / original_len)
    sc = RopeScaling(kind, factor, original_len)
    return None if sc.factor == 1.0 else sc


class RotaryEmbedding(nn.Module):
    """Applies RoPE to ``(B, H, T, Dh)`` tensors; ``forward(x, offset=0)``."""

    # reachable through an instance, for layers below this package (generation) that may not import it
    SCALING_KINDS = SCALING_KINDS
    Scaling = RopeScaling
    make_scaling = staticmethod(make_scaling)

    def __init__(self, head_dim: int, *, theta: float = 1e4, max_seq_len: int = 1 << 20):
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
            raise UsageError(f"head_dim must be an even integer >= 2 for RoPE, got {head_dim!r}")
        theta = float(theta)
        if not math.isfinite(theta) or theta <= 0:
            raise UsageError(f"rope theta must be a finite number > 0, got {theta}")
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise UsageError(f"max_seq_len must be an integer >= 1, got {max_seq_len!r}")
        self.head_dim, self.theta, self.max_seq_len = head_dim, theta, max_seq_len
        # a plain float64 CPU tensor, not a buffer: model.to(bfloat16) must not round it
        self._inv_freq = theta ** (-torch.arange(head_dim // 2, dtype=torch.float64, device="cpu") * 2 / head_dim)
        self.scaling: RopeScaling | None = None      # set for one evaluation by rope_scaling_mode
        self._cache: dict = {}        # (device, scaling) -> (lo, float32 (n, Dh/2, 2)): (cos, sin) of lo..lo+n-1

    @property
    def inv_freq(self) -> torch.Tensor:
        """The frequencies in use (float64, CPU): plain, or those of :attr:`scaling`."""
        return self._inv_freq if self.scaling is None else self.scaling.inv_freq(self.theta, self.head_dim)

    def rotations(self, end: int, device, start: int = 0) -> torch.Tensor:
        """``(cos, sin)`` of ``pos * freq`` as float32 ``(end - start, Dh/2, 2)`` for positions
        ``start..end-1`` (real, so that a compiled graph holds no complex tensor); times
        ``scaling.qk_scale`` under yarn. The cached table covers a range of positions, not a prefix:
        a context-parallel rank holding rows ``[r·c, (r+1)·c)`` keeps ``c`` rows, not ``(r+1)·c``
        (method.md §9); a decode step past the range rebuilds it from there, twice as long."""
        if end > self.max_seq_len:
            raise UsageError(f"position {end - 1} exceeds model.max_seq_len={self.max_seq_len}; "
                             f"raise model.max_seq_len (positions must be < max_seq_len)")
        key = (str(device), self.scaling)          # a scaling change selects other tables, never stale ones
        lo, hit = self._cache.get(key, (0, None))
        if hit is None or start < lo or lo + hit.shape[0] < end:
            n = end - start
            if hit is not None and start >= lo:     # growing past the range (decoding): amortised doubling
                n = max(n, 2 * hit.shape[0])
            lo = start
            n = min(max(n, 256), self.max_seq_len - lo)
            ang = torch.arange(lo, lo + n, dtype=torch.float64, device="cpu")[:, None] * self.inv_freq[None, :]
            table = torch.stack([ang.cos(), ang.sin()], dim=-1)
            if self.scaling is not None and self.scaling.qk_scale != 1.0:
                table = table * self.scaling.qk_scale
            hit = table.to(device=device, dtype=torch.float32)
            if key not in self._cache and len(self._cache) >= _CACHE_MAX:
                self._cache = {}
            self._cache[key] = (lo, hit)
        return hit[start - lo:end - lo]

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        if x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise UsageError(f"RoPE expects (B, H, T, {self.head_dim}), got {tuple(x.shape)}")
        if offset < 0:
            raise UsageError(f"offset must be >= 0, got {offset}")
        T = x.shape[2]
        return _rotate(x, self.rotations(offset + T, x.device, offset))

    def rotate_at(self, x: torch.Tensor, pos: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """RoPE for one token per row ``x`` ``(B, H, 1, Dh)`` at per-row positions ``pos`` ``(B,)`` on the
        device, from a table of :meth:`rotations` that covers them: no host read, one shape for every
        position (a captured decode step)."""
        return _rotate(x, table[pos].unsqueeze(1).unsqueeze(1))

    def rotate_rows(self, x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """RoPE for ``x`` ``(B, H, T, Dh)`` whose rows sit at ``positions`` ``(T,)`` (a device tensor), from a table
        of :meth:`rotations` covering them: one shape wherever the rows are (a traced prefill chunk)."""
        return _rotate(x, table[positions])

    @contextlib.contextmanager
    def scaled(self, scaling: RopeScaling | None):
        """``scaling`` in force for the duration of the ``with`` (None: plain RoPE), then the old one."""
        old, self.scaling = self.scaling, scaling
        try:
            yield scaling
        finally:
            self.scaling = old

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta:g}" + (
            f", scaling={self.scaling.label()}" if self.scaling is not None else "")

    def _apply(self, fn, recurse=True):      # .to(device) drops the cached tables
        self._cache = {}
        return super()._apply(fn, recurse)


def _rotate(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, H, T, Dh)`` rotated pairwise by ``rot`` (``(T, Dh/2, 2)`` or broadcastable to
    ``(B, H, T, Dh/2, 2)``), in float32, returned in ``x``'s dtype."""
    B, H, T, Dh = x.shape
    pairs = x.float().reshape(B, H, T, Dh // 2, 2)
    if torch.compiler.is_compiling():          # inductor has no complex kernels: the same rotation in reals
        c, s = rot[..., 0], rot[..., 1]
        x0, x1 = pairs[..., 0], pairs[..., 1]
        out = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1)
    else:
        out = torch.view_as_real(torch.view_as_complex(pairs) * torch.view_as_complex(rot.contiguous()))
    return out.reshape(B, H, T, Dh).to(x.dtype)


def _training_length(model) -> int | None:
    """The length a model was trained at: ``cfg.seq_len``, else its layers' ``reach_len``."""
    n = getattr(getattr(model, "cfg", None), "seq_len", None)
    if n is None:
        lens = {getattr(m, "reach_len", None) for m in model.modules()} - {None}
        n = lens.pop() if len(lens) == 1 else None
    return n


@contextlib.contextmanager
def rope_scaling_mode(model, kind, factor=None, *, length: int | None = None, original_len: int | None = None):
    """Scale every RoPE inside ``model`` for the duration of the ``with``, then restore it exactly.

    ``kind``: ``none | linear | ntk | yarn`` or a :class:`RopeScaling`. The factor is ``factor``
    if given, else ``max(1, length / original_len)``; ``original_len`` defaults to the training
    length (``model.cfg.seq_len``). Yields the :class:`RopeScaling` in force (None: plain RoPE)."""
    ropes = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    if isinstance(kind, RopeScaling) or kind in (None, "none"):
        sc = make_scaling(kind, 1)
    else:
        if original_len is None:
            original_len = _training_length(model)
        if original_len is None:
            raise UsageError(f"rope scaling {kind!r} needs the training length: pass original_len= (this model "
                             f"has no cfg.seq_len)")
        sc = make_scaling(kind, original_len, factor=factor, length=length)
    if sc is not None and not ropes:
        raise UsageError(f"rope scaling {sc.kind!r} needs a model with rotary embeddings; "
                         f"{type(model).__name__} has none")
    with contextlib.ExitStack() as stack:
        for rope in ropes:
            stack.enter_context(rope.scaled(sc))
        yield sc


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
