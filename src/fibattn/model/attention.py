"""``FibAttention``: a drop-in causal self-attention layer with Fibonacci sparse distances.

Layout, stated once: input and output x ``(B, T, C)``; inside, q ``(B, H, T, Dh)`` and
k, v ``(B, Hkv, T, Dh)`` (grouped-query attention, ``H % Hkv == 0``).

The layer owns its q/k/v/o projections (no bias), RoPE (applied to q and k before any
gather or interpolation) and its spacing scale alpha:

- a fixed float: ``fibattn.sparse_attention`` over ``attended_distances(W, alpha, base,
  T, reach=...)``; the distance list is cached per ``(T, reach)``;
- learned (``learned=True``): a :class:`fibattn.schedules.LearnedAlphas` with one layer,
  started at ``alpha``; ``fibattn.interpolated_sparse_attention`` receives the alpha
  tensor so its gradient flows (method.md §3);
- ``attention="dense"``: full causal attention through ``F.scaled_dot_product_attention``.

``reach="study"`` rebuilds the distances at the current length; ``reach="train"``
caps them at ``reach_len`` (the training length, method.md §1 Decision).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import UsageError, check_int, check_positive
from ..ops import BACKENDS, interpolated_sparse_attention, sparse_attention
from .rope import RotaryEmbedding
from ..schedules import Base, LearnedAlphas, as_base, attended_distances, layer_alphas

ATTENTION_KINDS = ("dense", "sparse")
REACH_MODES = ("study", "train")
_CACHE_MAX = 64


# ------------------------------------------------------------------ config helpers
def config_base(model_cfg) -> Base:
    """The :class:`Base` a :class:`fibattn.config.ModelConfig` describes."""
    if model_cfg.base == "fib":
        return Base("fib", k=model_cfg.base_k)
    if model_cfg.base in ("pow2", "none"):
        return Base(model_cfg.base)
    if model_cfg.base == "custom":
        return Base("custom", values=tuple(model_cfg.base_values))
    raise UsageError(f"model.base must be one of fib, pow2, custom, none, got {model_cfg.base!r}")


def config_layer_alphas(model_cfg) -> list[float]:
    """Per-layer alpha of a config (for ``learned``: the start values from ``learned_init``)."""
    m = model_cfg
    if m.schedule == "learned":
        if m.learned_init == "fixed":
            return layer_alphas("learned", m.n_layers, a_min=m.a_min, a_max=m.a_max, value=m.alpha)
        return layer_alphas(m.learned_init, m.n_layers, a_min=m.a_min, a_max=m.a_max)
    values = list(m.alphas) if m.schedule == "custom" else None
    return layer_alphas(m.schedule, m.n_layers, a_min=m.a_min, a_max=m.a_max, value=m.alpha, values=values)


# ------------------------------------------------------------------------- the layer
def document_mask(document_ids: torch.Tensor, T: int) -> torch.Tensor:
    """Dense attention's mask for packed documents: causal and block-diagonal, ``(B, 1, T, T)``."""
    pos = torch.arange(T, device=document_ids.device)
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return (same & (pos[:, None] >= pos[None, :]))[:, None]


class FibAttention(nn.Module):
    """Causal self-attention ``(B, T, C) -> (B, T, C)`` with a per-layer alpha."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, *,
                 attention: str = "sparse", window: int = 12, base="fib", alpha: float = 1.0,
                 learned: bool = False, a_min: float = 0.5, a_max: float = 1.5,
                 reach: str = "study", reach_len: int | None = None, rope_theta: float = 1e4,
                 max_seq_len: int = 1 << 20, backend: str = "auto", init_std: float = 0.02,
                 out_std: float | None = None):
        super().__init__()
        check_int("d_model", d_model, 1)
        check_int("n_heads", n_heads, 1)
        n_kv_heads = n_heads if n_kv_heads is None else check_int("n_kv_heads", n_kv_heads, 1)
        if d_model % n_heads:
            raise UsageError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        if n_heads % n_kv_heads:
            raise UsageError(f"n_heads ({n_heads}) must be divisible by n_kv_heads ({n_kv_heads})")
        if (d_model // n_heads) % 2:
            raise UsageError(f"head dim d_model / n_heads must be even for RoPE, got {d_model // n_heads}")
        if attention not in ATTENTION_KINDS:
            raise UsageError(f"attention must be one of {', '.join(ATTENTION_KINDS)}, got {attention!r}")
        if reach not in REACH_MODES:
            raise UsageError(f"reach must be one of {', '.join(REACH_MODES)}, got {reach!r}")
        if reach == "train" and reach_len is None:
            raise UsageError("reach='train' needs reach_len (the training length, an integer >= 1)")
        if reach_len is not None:
            check_int("reach_len", reach_len, 1)
        if backend not in BACKENDS + ("auto",):
            raise UsageError(f"backend must be one of auto, {', '.join(BACKENDS)}, got {backend!r}")
        if learned and attention == "dense":
            raise UsageError("learned=True needs attention='sparse' (dense attention has no alpha)")
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.attention, self.reach, self.reach_len, self.backend = attention, reach, reach_len, backend
        self.window = check_int("window", window, 0)
        self.base = as_base(base)
        self.init_std = check_positive("init_std", init_std)
        self.out_std = self.init_std if out_std is None else check_positive("out_std", out_std)
        alpha = check_positive("alpha", alpha)
        self.learned = bool(learned)
        if self.learned:
            self.alphas = LearnedAlphas(1, a_min=a_min, a_max=a_max, init=[alpha])
            self._alpha = None
        else:
            self.alphas = None
            self._alpha = alpha
        kv = n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, kv, bias=False)
        self.v_proj = nn.Linear(d_model, kv, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        self.rope = RotaryEmbedding(self.head_dim, theta=rope_theta, max_seq_len=max_seq_len)
        self._dist_cache: dict = {}
        self.reset_parameters()

    @classmethod
    def from_config(cls, model_cfg, layer_idx: int, *, out_std: float | None = None) -> "FibAttention":
        """The layer ``layer_idx`` of a :class:`fibattn.config.ModelConfig`."""
        m = model_cfg
        check_int("layer_idx", layer_idx, 0)
        if layer_idx >= m.n_layers:
            raise UsageError(f"layer_idx must be < model.n_layers={m.n_layers}, got {layer_idx}")
        alpha = config_layer_alphas(m)[layer_idx] if m.attention == "sparse" else 1.0
        return cls(m.d_model, m.n_heads, m.n_kv_heads, attention=m.attention, window=m.window,
                   base=config_base(m), alpha=alpha, learned=m.attention == "sparse" and m.schedule == "learned",
                   a_min=m.a_min, a_max=m.a_max, reach=m.reach, reach_len=m.seq_len, rope_theta=m.rope_theta,
                   max_seq_len=m.max_seq_len, backend=m.backend, init_std=m.init_std, out_std=out_std)

    def reset_parameters(self) -> None:
        for lin in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.normal_(lin.weight, std=self.init_std)
        nn.init.normal_(self.o_proj.weight, std=self.out_std)

    # ---------------------------------------------------------------- alpha
    def alpha_tensor(self) -> torch.Tensor | None:
        """The learned alpha as a 0-d tensor (in the graph), or ``None`` for a static layer."""
        return self.alphas.alpha(0) if self.learned else None

    def current_alpha(self) -> float:
        return float(self.alphas.alpha(0).detach()) if self.learned else self._alpha

    def _reach_arg(self) -> int | None:
        return self.reach_len if self.reach == "train" else None

    def distances(self, seq_len: int) -> list[int]:
        """Attended distances at length ``seq_len`` (learned layers: ``round(alpha * b)``)."""
        check_int("seq_len", seq_len, 1)
        if self.attention == "dense":
            return list(range(seq_len))
        if self.learned:
            return attended_distances(self.window, self.current_alpha(), self.base, seq_len,
                                      reach=self._reach_arg())
        key = (seq_len, self._reach_arg())
        hit = self._dist_cache.get(key)
        if hit is None:
            if len(self._dist_cache) >= _CACHE_MAX:
                self._dist_cache.clear()
            hit = attended_distances(self.window, self._alpha, self.base, seq_len, reach=self._reach_arg())
            self._dist_cache[key] = hit
        return hit

    def warm(self, seq_len: int, device=None) -> None:
        """Build the tables a forward at ``seq_len`` reads (RoPE's rotations, a static layer's distances) now.
        Filled inside ``torch.compile``'s first trace instead, they would change the module between its first
        two calls, and the compiler would compile it a second time."""
        self.rope.rotations(seq_len, device if device is not None else self.q_proj.weight.device)
        if self.attention == "sparse" and not self.learned:
            self.distances(seq_len)

    # ---------------------------------------------------------------- forward pieces
    def _project(self, x: torch.Tensor):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def qkv(self, x: torch.Tensor, offset: int = 0):
        """Projections with RoPE applied: q ``(B, H, T, Dh)``, k and v ``(B, Hkv, T, Dh)``."""
        q, k, v = self._project(x)
        return self.rope(q, offset), self.rope(k, offset), v

    def qkv_rows(self, x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor):
        """:meth:`qkv` of rows ``x`` ``(B, T, C)`` at positions ``positions`` ``(T,)`` (a device tensor), RoPE from
        ``table``."""
        q, k, v = self._project(x)
        return self.rope.rotate_rows(q, positions, table), self.rope.rotate_rows(k, positions, table), v

    def qkv_at(self, x: torch.Tensor, pos: torch.Tensor, table: torch.Tensor):
        """:meth:`qkv` of one token per row ``x`` ``(B, 1, C)`` at per-row positions ``pos`` ``(B,)`` (a device
        tensor), RoPE from ``table`` (``rope.rotations`` covering them)."""
        q, k, v = self._project(x)
        return self.rope.rotate_at(q, pos, table), self.rope.rotate_at(k, pos, table), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The attention core on RoPE'd heads; returns ``(B, H, T, Dh)``. ``document_ids`` ``(B, T)``:
        packed documents, each query attends inside its own (method.md §8), dense layers too."""
        T = q.shape[2]
        if self.attention == "dense":
            gqa = self.n_heads != self.n_kv_heads
            if document_ids is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(document_ids, T), enable_gqa=gqa)
        if self.learned:
            return interpolated_sparse_attention(q, k, v, alpha=self.alphas.alpha(0), base=self.base,
                                                 window=self.window, reach=self._reach_arg(),
                                                 backend=self.backend, document_ids=document_ids)
        return sparse_attention(q, k, v, self.distances(T), backend=self.backend, document_ids=document_ids)

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        """``(B, H, T, Dh)`` heads -> output projection ``(B, T, C)``."""
        B, H, T, Dh = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * Dh))

    def forward(self, x: torch.Tensor, offset: int = 0, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise UsageError(f"FibAttention expects x of shape (B, T, {self.d_model}), got {tuple(x.shape)}")
        return self.merge(self.attend(*self.qkv(x, offset), document_ids=document_ids))

    def extra_repr(self) -> str:
        if self.attention == "dense":
            return f"dense, heads={self.n_heads}/{self.n_kv_heads}"
        kind = "learned" if self.learned else "static"
        return (f"sparse, heads={self.n_heads}/{self.n_kv_heads}, window={self.window}, base={self.base.kind}, "
                f"alpha={self.current_alpha():.4f} ({kind}), reach={self.reach}")

