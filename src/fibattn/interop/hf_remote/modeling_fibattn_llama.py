"""A Fibonacci-sparse Llama for transformers, written by ``fibattn export --format hf``.

    model = AutoModelForCausalLM.from_pretrained(PATH, trust_remote_code=True)

transformers' ``LlamaForCausalLM`` with one change: every layer's attention sees only the keys at
its attended distances (fibattn's docs/method.md §1). The query at position ``i`` reads key ``i - d``
for ``d`` in

    D = {0..W} ∪ {round(alpha * b) : b in base, W < round(alpha * b) <= cap}

with ``cap = T - 1`` (``T``: the keys so far), or ``reach_len - 1`` when smaller; ``round`` is Python's
(halves to even). Window, per-layer alphas, base and reach_len come from ``config.fibattn``.

Needs only torch and transformers: the pattern is a boolean mask over dense scores (correct, not
fast; O(Tq * Tk)). With fibattn installed, an unpadded forward without a cache runs on its
O(T * |D|) op instead.

Packed documents (padding-free batches, transformers' ``DataCollatorWithFlattening``): the documents
come from ``cu_seq_lens_q`` when given, else from ``position_ids`` that restart; each query attends
inside its document through the set of that document's length, so every document gets the logits of
its own unpadded call.
"""
import difflib
import inspect

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, LlamaForCausalLM

from .configuration_fibattn_llama import FibattnLlamaConfig

try:
    from fibattn import sparse_attention
except ImportError:  # not installed: the masked path below is the whole model
    sparse_attention = None
# an older fibattn's op knows no packed documents: they take the masked path
DOCUMENTS_OP = sparse_attention is not None and "document_ids" in inspect.signature(sparse_attention).parameters

IMPL = "fibattn_llama"
SETTINGS = ("alphas", "backend", "base", "reach_len", "schedule", "window")   # what hf_llama.apply_fibattn saves


def base_values(base: dict, cap: int) -> list:
    """The base's numbers: ``fib`` the first k Fibonacci numbers from 1, 2; ``pow2`` 1, 2, 4, ... up to the
    cap; ``custom`` its list."""
    if base["kind"] == "fib":
        out = [1, 2]
        while len(out) < base["k"]:
            out.append(out[-1] + out[-2])
        return out[:base["k"]]
    if base["kind"] == "pow2":
        return [2 ** i for i in range(cap.bit_length())]
    if base["kind"] == "custom":
        return list(base["values"])
    raise ValueError(f"config.fibattn base kind must be fib, pow2 or custom, got {base['kind']!r}")


def attended_distances(window: int, alpha: float, base: dict, seq_len: int, reach_len=None) -> list:
    """The sorted distances a query attends among ``seq_len`` keys (method.md §1)."""
    cap = seq_len - 1 if reach_len is None else min(seq_len, reach_len) - 1
    far = {round(alpha * b) for b in base_values(base, cap)}
    return sorted(set(range(min(window, cap) + 1)) | {d for d in far if window < d <= cap})


def packed_documents(batch: int, length: int, kwargs):
    """Document ids ``(B, T)`` of a packed batch: from ``cu_seq_lens_q`` (one row) when given, else from
    ``position_ids`` (a document starts wherever the position does not continue the previous one); None when
    every row is one document."""
    cu, pos = kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids")
    if cu is not None:
        cu_k = kwargs.get("cu_seq_lens_k")
        if batch != 1 or (cu_k is not None and not torch.equal(cu_k.cpu(), cu.cpu())):
            raise ValueError(f"fibattn_llama attention takes cu_seq_lens for one packed row with cu_seq_lens_q == "
                             f"cu_seq_lens_k (what DataCollatorWithFlattening makes), got batch size {batch}")
        cu = cu.long()
        ids = torch.bucketize(torch.arange(length, device=cu.device), cu[1:], right=True)[None]
    elif pos is not None:
        pos = pos.expand(batch, -1)
        ids = torch.cat([torch.zeros_like(pos[:, :1]), (pos[:, 1:] != pos[:, :-1] + 1).long().cumsum(-1)], 1)
    else:
        return None
    return ids if ids[:, -1].any() else None


def fibattn_llama_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """query ``(B, H, Tq, Dh)``, key/value ``(B, Hkv, Tk, Dh)``; the queries are the last Tq positions."""
    if dropout:
        raise ValueError(f"fibattn_llama attention has no dropout; set config.attention_dropout=0, got {dropout}")
    s = module.config.fibattn

    def distances(seq_len):
        return attended_distances(s["window"], s["alphas"][module.layer_idx], s["base"], seq_len, s.get("reach_len"))

    tq, tk, dev = query.shape[2], key.shape[2], query.device
    docs = packed_documents(query.shape[0], tq, kwargs) if tq == tk else None
    docs = None if docs is None else docs.to(dev)
    pad = None
    if attention_mask is not None:  # transformers' causal + padding mask: bool, or additive (0 where allowed)
        pad = attention_mask[:, 0, :, :tk]
        pad = pad if pad.dtype == torch.bool else pad == 0
        if docs is not None:        # transformers' own packed mask adds nothing to the documents
            q = torch.arange(tq, device=dev)
            inside = (docs[:, :, None] == docs[:, None, :]) & (q[:, None] >= q)
            pad = None if torch.equal(inside & pad, inside) else pad
    if sparse_attention is not None and pad is None and tq == tk:
        full = distances(tk)
        if docs is None:
            out = sparse_attention(query, key, value, full, scale=scaling, backend=s.get("backend", "auto"))
            return out.transpose(1, 2).contiguous(), None
        lengths = {n for row in docs for n in torch.unique_consecutive(row, return_counts=True)[1].tolist()}
        if DOCUMENTS_OP and all(distances(n) == [d for d in full if d < n] for n in lengths):
            out = sparse_attention(query, key, value, full, scale=scaling, backend=s.get("backend", "auto"),
                                   document_ids=docs)
            return out.transpose(1, 2).contiguous(), None
    gap = torch.arange(tk - tq, tk, device=dev)[:, None] - torch.arange(tk, device=dev)
    seen = (gap >= 0)[None]
    if docs is not None:
        seen = seen & (docs[:, :, None] == docs[:, None, :])
    if pad is not None:
        seen = seen & pad
    # D depends on the length (pow2 grows with it): a query's set is that of its document's (else its row's) real
    # length, the keys the document's last query sees, pads not
    group = docs if docs is not None else torch.zeros(seen.shape[:2], dtype=torch.long, device=dev)
    end = torch.ones_like(group, dtype=torch.bool)
    end[:, :-1] = group[:, 1:] != group[:, :-1]
    q = torch.arange(tq, device=dev)
    real = seen.sum(-1).gather(1, torch.where(end, q, tq).flip(-1).cummin(-1).values.flip(-1))
    allowed = torch.zeros_like(seen)
    for n in real.unique().tolist():
        allowed |= (real == n)[..., None] & torch.isin(gap, torch.tensor(distances(max(n, 1)), device=dev))
    allowed = (allowed & seen)[:, None]
    # a padding query may see no key at all: let it see itself so no NaN reaches the real tokens
    allowed = allowed | (~allowed.any(-1, keepdim=True) & (gap == 0))
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(IMPL, fibattn_llama_attention)
try:  # transformers >= 4.53 builds masks per implementation: boolean, None when nothing is padded
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionMaskInterface.register(IMPL, sdpa_mask)
except ImportError:
    pass


class FibattnLlamaForCausalLM(LlamaForCausalLM):
    config_class = FibattnLlamaConfig

    def __init__(self, config):
        if not isinstance(getattr(config, "fibattn", None), dict):
            raise ValueError("FibattnLlamaForCausalLM: config.fibattn (the sparse settings) is missing; "
                             "re-export the model with fibattn export --format hf")
        unknown = sorted(set(config.fibattn) - set(SETTINGS))    # a misspelt key would change the pattern silently
        if unknown:
            close = difflib.get_close_matches(unknown[0], SETTINGS, n=1)
            raise ValueError(f"config.fibattn: unknown key {unknown[0]!r} (allowed: {', '.join(SETTINGS)})"
                             + (f"; did you mean {close[0]!r}?" if close else ""))
        if len(config.fibattn["alphas"]) != config.num_hidden_layers:
            raise ValueError(f"config.fibattn alphas must hold one value per layer ({config.num_hidden_layers}), "
                             f"got {len(config.fibattn['alphas'])}")
        config._attn_implementation = IMPL  # the only attention this model has: never a dense fallback
        super().__init__(config)
