"""A FibLM's tensors under transformers' Llama names, both ways (``export --format hf`` writes them,
``train --init-from`` reads them). The architectures match (RMSNorm, SwiGLU, RoPE, grouped-query
attention); two things differ: the names, and the order of q/k rows, since fibattn rotates
interleaved pairs and transformers rotates halves (:func:`.rope.interleaved_to_halves`)."""
from __future__ import annotations

import re

import torch

from .rope import halves_to_interleaved, interleaved_to_halves

# a block's tensors: fibattn name -> Llama name (under blocks.i. / model.layers.i.)
BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "attn.q_proj": "self_attn.q_proj", "attn.k_proj": "self_attn.k_proj", "attn.v_proj": "self_attn.v_proj",
         "attn.o_proj": "self_attn.o_proj", "ffn.gate": "mlp.gate_proj", "ffn.up": "mlp.up_proj",
         "ffn.down": "mlp.down_proj"}
TOP = {"embed": "model.embed_tokens", "norm": "model.norm", "head": "lm_head"}
_FROM_BLOCK = {v: k for k, v in BLOCK.items()}
_FROM_TOP = {v: k for k, v in TOP.items()}
_BLOCK_RE = re.compile(r"^(blocks|model\.layers)\.(\d+)\.(.+)\.weight$")


def _rows(inner: str, heads: int, kv_heads: int) -> int | None:
    return heads if inner == "attn.q_proj" else kv_heads if inner == "attn.k_proj" else None


def llama_name(name: str) -> str | None:
    """The Llama name of a FibLM tensor (None for fibattn's own, the learned alphas)."""
    m = _BLOCK_RE.match(name)
    if m and m.group(3) in BLOCK:
        return f"model.layers.{m.group(2)}.{BLOCK[m.group(3)]}.weight"
    top = TOP.get(name.removesuffix(".weight"))
    return None if top is None else f"{top}.weight"


def llama_shapes(shapes: dict) -> dict[str, tuple]:
    """FibLM tensor shapes under Llama names (the q/k row order changes, no shape does); ``lm_head`` has the
    embedding's shape whether tied or not."""
    out = {llama_name(k): tuple(v) for k, v in shapes.items() if llama_name(k)}
    out.setdefault("lm_head.weight", out["model.embed_tokens.weight"])
    return out


def to_llama(state: dict, *, heads: int, kv_heads: int, head_dim: int, tied: bool) -> dict[str, torch.Tensor]:
    """A FibLM state dict under Llama names (``lm_head`` is the embedding when ``tied``)."""
    out = {}
    for name, t in state.items():
        m, target = _BLOCK_RE.match(name), llama_name(name)
        if target is not None:
            n = _rows(m.group(3), heads, kv_heads) if m else None
            out[target] = t if n is None else interleaved_to_halves(t, n, head_dim)
    if tied:
        out["lm_head.weight"] = state["embed.weight"]
    return {k: v.detach().clone() for k, v in out.items()}


def from_llama(tensors: dict, *, heads: int, kv_heads: int, head_dim: int, tied: bool) -> dict[str, torch.Tensor]:
    """Llama tensors under FibLM names; names it does not know are kept as they are (the caller reports
    them), and a tied model's ``lm_head`` is dropped (it is the embedding)."""
    out = {}
    for name, t in tensors.items():
        m = _BLOCK_RE.match(name)
        top = _FROM_TOP.get(name.removesuffix(".weight"))
        if m and m.group(3) in _FROM_BLOCK:
            inner = _FROM_BLOCK[m.group(3)]
            n = _rows(inner, heads, kv_heads)
            out[f"blocks.{m.group(2)}.{inner}.weight"] = t if n is None else halves_to_interleaved(t, n, head_dim)
        elif top == "head" and tied:
            continue
        elif top is not None:
            out[f"{top}.weight"] = t
        else:
            out[name] = t
    return out
