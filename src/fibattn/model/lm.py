"""``FibLM``: the pre-norm decoder of method.md §4.

Layout: token ids ``idx`` ``(B, T)`` int64 -> logits ``(B, T, V)``; hidden states
``(B, T, C)`` with ``C = d_model``.

Block: ``x + Attn(RMSNorm(x))`` then ``x + SwiGLU(RMSNorm(x))``; SwiGLU hidden is
``model_cfg.ffn_hidden`` (``2 * round(d * 8 / 3 / 2)`` unless ``ffn_dim`` sets it); a final
RMSNorm, and the output head reuses the token embedding (tied; ``tie_embeddings=False`` gives
it weights of its own, as most converted Llama models need). No biases, no dropout. Init: normal with
``init_std``; the two residual projections per block (attention output, FFN down)
use ``init_std / sqrt(2 * n_layers)`` (GPT-2's scaled init).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..checks import UsageError
from .attention import FibAttention
from .head_loss import head_loss, logits_loss
from ..config import ACTIVATION_CHECKPOINTING, LOSS_HEADS, ModelConfig
from ..validation import validate_model


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``: ``(B, T, C) -> (B, T, C)`` through ``hidden``."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, out_std: float):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = FibAttention.from_config(cfg, layer_idx, out_std=out_std)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.ffn = SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, offset: int = 0, attend=None, document_ids=None) -> torch.Tensor:
        """``attend(attn, h) -> (B, H, T, Dh)``, when given, replaces the layer's own projections
        and attention core on the normalised input ``h`` (generation reads and fills its caches
        there); norms, residuals and the feed-forward stay this block's."""
        return self.feed_forward(self.attention(x, offset, attend, document_ids))

    def attention(self, x: torch.Tensor, offset: int = 0, attend=None, document_ids=None) -> torch.Tensor:
        """The block's first half: ``x`` plus its attention."""
        h = self.attn_norm(x)
        return x + (self.attn(h, offset, document_ids) if attend is None else self.attn.merge(attend(self.attn, h)))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's second half: ``x`` plus its feed-forward."""
        return x + self.ffn(self.ffn_norm(x))


def _attention_with(block: Block, core, x: torch.Tensor, offset: int, document_ids) -> torch.Tensor:
    """``block.attention`` with the layer's attention core ``core`` (None: its own) in force, as it was when the
    forward ran: the backward recomputes a checkpointed block after the forward's context (``parallel.sharded``,
    which installs a context-parallel core) has restored the layer, and must attend as the forward did."""
    attn = block.attn
    before = attn.__dict__.get("attend")
    if before is core:
        return block.attention(x, offset, None, document_ids)
    if core is None:
        del attn.attend
    else:
        attn.attend = core
    try:
        return block.attention(x, offset, None, document_ids)
    finally:
        if before is None:
            attn.__dict__.pop("attend", None)
        else:
            attn.attend = before


class FibLM(nn.Module):
    """Decoder-only language model with per-layer sparse (or dense) attention."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise UsageError(f"FibLM expects a fibattn.config.ModelConfig, got {type(cfg).__name__}")
        validate_model(cfg)
        self.cfg = cfg
        self.activation_checkpointing = "none"
        self.loss_head = "plain"
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i, out_std) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights(out_std)

    @property
    def output_weight(self) -> torch.Tensor:
        """The output head's ``(V, C)`` weight: the token embedding unless the head is untied."""
        return self.embed.weight if self.cfg.tie_embeddings else self.head.weight

    def _init_weights(self, out_std: float) -> None:
        std = self.cfg.init_std
        nn.init.normal_(self.embed.weight, std=std)
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.head.weight, std=std)
        for block in self.blocks:
            block.attn.reset_parameters()
            nn.init.normal_(block.ffn.gate.weight, std=std)
            nn.init.normal_(block.ffn.up.weight, std=std)
            nn.init.normal_(block.ffn.down.weight, std=out_std)

    # ------------------------------------------------------------------ forward
    def _check_idx(self, idx: torch.Tensor) -> None:
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2:
            raise UsageError(f"idx must be a (B, T) tensor of token ids, got "
                             f"{tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__}")
        if idx.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise UsageError(f"idx must hold integer token ids, got {idx.dtype}")
        if idx.shape[1] > self.cfg.max_seq_len:
            raise UsageError(f"sequence length {idx.shape[1]} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        if not idx.numel():
            return
        if idx.device.type == "cpu" and not torch.compiler.is_compiling():
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= self.cfg.vocab_size:
                raise UsageError(f"token ids must lie in [0, model.vocab_size={self.cfg.vocab_size}), "
                                 f"got values in [{lo}, {hi}]")
        else:              # on the device without a read back (and in a compiled graph): fails at the next sync
            torch._assert_async(((idx >= 0) & (idx < self.cfg.vocab_size)).all(),
                                f"token ids must lie in [0, model.vocab_size={self.cfg.vocab_size})")

    def hidden(self, idx: torch.Tensor, offset: int = 0, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Final normalised hidden states ``(B, T, C)``; ``document_ids`` ``(B, T)``: packed documents
        (each token attends inside its own; RoPE needs no restart, method.md §8)."""
        self._check_idx(idx)
        x = self.embed(idx.long())
        recompute = self.activation_checkpointing == "full" and torch.is_grad_enabled()   # inference never does
        for block in self.blocks:
            if recompute:        # each half on its own: the attention's activations are gone by the FFN's backward
                core = block.attn.__dict__.get("attend")    # an attention core in force now (context parallelism)
                x = checkpoint(_attention_with, block, core, x, offset, document_ids, use_reentrant=False)
                x = checkpoint(block.feed_forward, x, use_reentrant=False)
            else:
                x = block(x, offset, None, document_ids)
        return self.norm(x)

    def set_activation_checkpointing(self, mode: str) -> FibLM:
        """``full``: keep only each block's input and recompute the block in the backward
        (``torch.utils.checkpoint``, non-reentrant; same losses and gradients); ``none``: keep every activation.
        A runtime choice (``train.activation_checkpointing``), not part of the weights."""
        if mode not in ACTIVATION_CHECKPOINTING:
            raise UsageError(f"activation checkpointing must be one of {', '.join(ACTIVATION_CHECKPOINTING)}, "
                             f"got {mode!r}")
        self.activation_checkpointing = mode
        return self

    def set_loss_head(self, how: str) -> FibLM:
        """How ``forward(..., return_logits=False)`` makes the loss (:mod:`fibattn.model.head_loss`): ``plain``
        (the logits, then cross-entropy), ``chunked`` (never the whole ``(B, T, V)`` logits) or ``liger``
        (liger-kernel's fused kernels). A runtime choice (``train.loss_head``), not part of the weights."""
        if how not in LOSS_HEADS:
            raise UsageError(f"loss head must be one of {', '.join(LOSS_HEADS)}, got {how!r}")
        self.loss_head = how
        return self

    def warm(self, seq_len: int | None = None) -> FibLM:
        """Build every layer's tables for sequences of ``seq_len`` (default ``cfg.seq_len``) on the model's
        device, before ``torch.compile``: then the first compiled call finds them and the second call runs the
        same graph (:meth:`FibAttention.warm`). Moving the model (``.to``) drops them; warm after moving."""
        for layer in self.layers():
            layer.warm(seq_len or self.cfg.seq_len, self.embed.weight.device)
        return self

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The output head on normalised hidden states."""
        return F.linear(h, self.output_weight)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *,
                document_ids: torch.Tensor | None = None, offset: int = 0, return_logits: bool = True):
        """Logits ``(B, T, V)``; with ``targets`` ``(B, T)`` also the mean token cross-entropy.

        Target positions equal to -100 are ignored (PyTorch's ``ignore_index``). ``document_ids``
        ``(B, T)``: packed documents (``fibattn.sparse_attention``); logits of each document equal
        those of the document run on its own. ``offset``: the global position of ``idx[:, 0]`` (a
        context-parallel chunk, ``fibattn.parallel``). ``return_logits=False`` (with ``targets``): ``(None, loss)``,
        the loss made the :meth:`set_loss_head` way, which for ``chunked`` and ``liger`` never holds the logits.
        """
        if targets is not None and targets.shape != idx.shape:
            raise UsageError(f"targets must have idx's shape {tuple(idx.shape)}, got {tuple(targets.shape)}")
        h = self.hidden(idx, offset, document_ids)
        if targets is not None and not return_logits:
            return None, head_loss(h, self.output_weight, targets, self.loss_head)
        logits = self.logits(h)
        if targets is None:
            return logits
        return logits, logits_loss(logits, targets)

    # ------------------------------------------------------------------ reports
    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; the tied embedding counts once, and not at all if ``non_embedding``."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if non_embedding else n

    def layers(self) -> list[FibAttention]:
        return [block.attn for block in self.blocks]

    def alphas(self) -> list[float]:
        """Current alpha per layer (1.0 for dense attention)."""
        return [layer.current_alpha() for layer in self.layers()]

    def distances(self, seq_len: int) -> list[list[int]]:
        """Attended distances per layer at ``seq_len`` (dense: ``0..seq_len-1``)."""
        return [layer.distances(seq_len) for layer in self.layers()]

    def stream(self, prompt_ids, **kwargs):
        """Stream new tokens with constant-memory sparse KV caches: one step object (tokens, logits, finished)
        per step; arguments as :func:`fibattn.generation.decode.generate`."""
        from ..generation.decode import generate
        return generate(self, prompt_ids, **kwargs)

    def generate(self, prompt, *, tokenizer=None, **kwargs):
        """New tokens after ``prompt``, like other libraries' ``generate``.

        ``prompt`` as token ids (a list, a list of lists or a tensor) gives the new ids of every row, a
        stop token included (a flat list or 1-D tensor gives one list); as text (a string or a list of
        strings) it gives the continuation as text, stopping at the end-of-document token, with
        ``tokenizer`` (default: the one :func:`fibattn.from_pretrained` attached). ``kwargs`` are
        :func:`fibattn.generation.decode.generate`'s (``max_new_tokens``, ``temperature``, ``top_k``,
        ``top_p``, ``seed``, ``stop_ids``, ``context``, ``rope_scaling``, ``rope_factor``, ``decode``); :meth:`stream`
        yields the steps as they come.
        """
        from ..generation.decode import generate_tokens
        texts = [prompt] if isinstance(prompt, str) else prompt
        if isinstance(texts, (list, tuple)) and texts and all(isinstance(t, str) for t in texts):
            new = self._generate_text(list(texts), tokenizer, kwargs)
            return new[0] if isinstance(prompt, str) else new
        flat = (isinstance(prompt, torch.Tensor) and prompt.dim() == 1) or \
            (isinstance(prompt, (list, tuple)) and bool(prompt) and not isinstance(prompt[0], (list, tuple, str)))
        new = generate_tokens(self, prompt, **kwargs)
        return new[0] if flat else new

    def _generate_text(self, prompts: list[str], tokenizer, kwargs) -> list[str]:
        from ..generation.decode import generate_tokens
        tok = tokenizer if tokenizer is not None else getattr(self, "tokenizer", None)
        if tok is None:
            raise UsageError("generate(text) needs a tokenizer: load the model with fibattn.from_pretrained or pass "
                             "tokenizer=")
        rows = [tok.encode(p) for p in prompts]
        if not all(rows):
            raise UsageError("prompt encodes to no tokens; give a non-empty prompt")
        eos = getattr(tok, "eos_id", None)
        kwargs.setdefault("stop_ids", () if eos is None else (eos,))
        return [tok.decode([t for t in new if t != eos]) for new in generate_tokens(self, rows, **kwargs)]
