"""A Fibonacci-sparse Llama for transformers, written by ``fibattn export --format hf``.

    model = AutoModelForCausalLM.from_pretrained(PATH, trust_remote_code=True)
    model.generate(ids, max_new_tokens=...)      # a constant-memory cache by default (FibattnCache)

transformers' ``LlamaForCausalLM`` with one change: every layer's attention sees only the keys at
its attended distances (fibattn's docs/method.md §1). The query at position ``i`` reads key ``i - d``
for ``d`` in

    D = {0..W} ∪ {round(alpha * b) : b in base, W < round(alpha * b) <= cap}

with ``cap = T - 1`` (``T``: the length so far, a padded row's own real tokens), or ``reach_len - 1``
when smaller; ``round`` is Python's (halves to even). Window, per-layer alphas, base and reach_len come
from ``config.fibattn``. The export carries integer-valued patterns only (learned, interpolated alphas
are refused by the exporter), so every column is one key.

Needs only torch and transformers. The attention computes only the attended columns: one shifted
slice of the keys per distance, one softmax over the ``|D|`` columns, O(T * |D| * Dh) time and
O(T * |D|) memory, no T x T mask anywhere (the padding mask handed to it is transformers' 2-D one).
With fibattn installed, an unpadded forward without a cache runs on its op instead.

Packed documents (padding-free batches, transformers' ``DataCollatorWithFlattening``): the documents
come from ``cu_seq_lens_q`` when given, else from ``position_ids`` that restart; each query attends
inside its document through the set of that document's length.

RoPE angles are computed in float64 (as fibattn does): transformers' float32 angles drift with the
position (about 2e-4 rad at position 4096), which moved the logits past 1e-5 at 4x the training length.

Generation keeps only each layer's last ``max(D)`` keys (:class:`FibattnCache`), so memory does not grow
with the generated length; fibattn's ``FibCache`` works here too (both mark the key tensor with the
position of its first kept key).
"""
import difflib
import hashlib
import inspect

import torch
from torch import nn
from transformers import AttentionInterface, LlamaForCausalLM

from .configuration_fibattn_llama import FibattnLlamaConfig

try:
    from fibattn import sparse_attention
except ImportError:  # not installed: the gathered columns below are the whole model
    sparse_attention = None
try:   # transformers' layered caches (>= 4.56); without them generate keeps its own full cache
    from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
except ImportError:
    Cache = DynamicCache = DynamicLayer = None
# an older fibattn's op knows no packed documents: they take the gathered path
DOCUMENTS_OP = sparse_attention is not None and "document_ids" in inspect.signature(sparse_attention).parameters

# transformers looks attention functions up by name in one table for the whole process: a name of this copy's
# own (each export folder loads its own copy) keeps a model from running another folder's code, loaded later
IMPL = "fibattn_llama_" + hashlib.sha256(f"{__name__} {__file__}".encode()).hexdigest()[:12]
SETTINGS = ("alphas", "backend", "base", "reach_len", "schedule", "window")   # what hf_llama.apply_fibattn saves
FIRST_KEY_POSITION = "fibattn_first_key_position"   # same name as fibattn.interop.hf_llama's: FibCache marks it


def base_values(base: dict, cap: int) -> list:
    """The base's numbers: ``fib`` the first k Fibonacci numbers from 1, 2; ``pow2`` 1, 2, 4, ... up to the
    cap; ``custom`` its list; ``none`` nothing (the window alone)."""
    if base["kind"] == "fib":
        out = [1, 2]
        while len(out) < base["k"]:
            out.append(out[-1] + out[-2])
        return out[:base["k"]]
    if base["kind"] == "pow2":
        return [2 ** i for i in range(cap.bit_length())]
    if base["kind"] == "custom":
        return list(base["values"])
    if base["kind"] == "none":
        return []
    raise ValueError(f"config.fibattn base kind must be fib, pow2, custom or none, got {base['kind']!r}")


def attended_distances(window: int, alpha: float, base: dict, seq_len: int, reach_len=None) -> list:
    """The sorted distances a query attends among ``seq_len`` keys (method.md §1)."""
    cap = seq_len - 1 if reach_len is None else min(seq_len, reach_len) - 1
    far = {round(alpha * b) for b in base_values(base, cap)}
    return sorted(set(range(min(window, cap) + 1)) | {d for d in far if window < d <= cap})


def longest_distance(s: dict, layer: int, context=None) -> int:
    """``max(D)`` over every length up to ``context`` (None: any length). Sets only grow with the length, so
    this is the set at ``context``, or at ``reach_len``; fib, custom and none bases stop growing by themselves."""
    n = context if context is not None else s.get("reach_len")
    if n is None:
        if s["base"]["kind"] == "pow2":
            raise ValueError("FibattnCache: a pow2 base without reach_len grows with the length; pass "
                             "context=prompt length (with padding) + max_new_tokens")
        far = [round(s["alphas"][layer] * b) for b in base_values(s["base"], 0)]
        n = max([s["window"]] + far) + 1
    return max(attended_distances(s["window"], s["alphas"][layer], s["base"], n, s.get("reach_len")))


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


def key_validity(attention_mask, tk: int):
    """``(valid keys (B, Tk) in hand, real tokens so far per row (B,))`` from the mask transformers hands over:
    the 2-D padding mask (our mask function's), or a 4-D one (its last query's row); None when nothing is padded."""
    if attention_mask is None:
        return None, None
    m = attention_mask
    if m.dim() == 4:      # a prepared mask: what the last query may see is every real key
        m = m[:, 0, -1]
    m = m if m.dtype == torch.bool else (m == 0 if m.is_floating_point() else m != 0)
    if m.shape[-1] < tk:
        raise ValueError(f"fibattn_llama attention: the attention mask covers {m.shape[-1]} positions, fewer than "
                         f"the {tk} keys in hand")
    if bool(m.all()):
        return None, None
    return m[:, -tk:], m.sum(-1)


def gathered_attention(query, key, value, dists, allowed, scaling):
    """Softmax attention over the columns ``dists``: query ``i`` (one of the last Tq of the Tk keys in hand) reads
    key row ``Tk - Tq + i - d``, where ``allowed (B, Tq, n)`` lets it. Same arithmetic as fibattn's ``torch``
    backend: one shifted slice per distance, O(Tq * n) scores."""
    B, H, tq, dh = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    q = query.reshape(B, hkv, H // hkv, tq, dh)
    k, v = key.unsqueeze(2), value.unsqueeze(2)
    scores = query.new_zeros(B, hkv, H // hkv, tq, len(dists))
    starts = []
    for j, d in enumerate(dists):
        lo = max(0, d - (tk - tq))         # the first query whose key row is in hand
        starts.append(lo)
        if lo < tq:
            scores[..., lo:, j] = (q[..., lo:, :] * k[..., tk - tq + lo - d:tk - d, :]).sum(-1)
    scores = (scores * scaling).masked_fill(~allowed[:, None, None], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    out = torch.zeros_like(q)
    for j, (d, lo) in enumerate(zip(dists, starts)):
        if lo < tq:
            out[..., lo:, :] += p[..., lo:, j, None] * v[..., tk - tq + lo - d:tk - d, :]
    return out.reshape(B, H, tq, dh)


def fibattn_llama_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """query ``(B, H, Tq, Dh)``, key/value ``(B, Hkv, Tk, Dh)``; the queries are the last Tq positions, the keys
    start at absolute position ``first`` (a constant-memory cache marks it on the key tensor; else 0)."""
    if dropout:
        raise ValueError(f"fibattn_llama attention has no dropout; set config.attention_dropout=0, got {dropout}")
    s = module.config.fibattn
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling

    def distances(seq_len):
        return attended_distances(s["window"], s["alphas"][module.layer_idx], s["base"], max(seq_len, 1),
                                  s.get("reach_len"))

    B, tq, tk, dev = query.shape[0], query.shape[2], key.shape[2], query.device
    first = getattr(key, FIRST_KEY_POSITION, 0)
    valid, real = key_validity(attention_mask, tk)
    docs = packed_documents(B, tq, kwargs) if tq == tk and first == 0 else None
    docs = None if docs is None else docs.to(dev)
    full = distances(first + tk)
    if sparse_attention is not None and valid is None and tq == tk and first == 0:
        if docs is None:
            out = sparse_attention(query, key, value, full, scale=scaling, backend=s.get("backend", "auto"))
            return out.transpose(1, 2).contiguous(), None
        lengths = {n for row in docs for n in torch.unique_consecutive(row, return_counts=True)[1].tolist()}
        if DOCUMENTS_OP and all(distances(n) == [d for d in full if d < n] for n in lengths):
            out = sparse_attention(query, key, value, full, scale=scaling, backend=s.get("backend", "auto"),
                                   document_ids=docs)
            return out.transpose(1, 2).contiguous(), None
    # each query's length: its document's real tokens, else its row's (a pow2 set changes with it)
    if docs is not None:
        counts = torch.zeros(B, tq, dtype=torch.long, device=dev)
        ones = valid.long() if valid is not None else torch.ones_like(docs)
        real = counts.scatter_add_(1, docs.expand(B, -1), ones.expand(B, -1)).gather(1, docs.expand(B, -1))
    elif real is not None:
        real = real.to(dev)[:, None]
    else:
        real = torch.full((1, 1), first + tk, dtype=torch.long, device=dev)
    sets = {n: distances(n) for n in real.unique().tolist()}
    cols = sorted(set().union(*sets.values()))
    col = torch.tensor(cols, device=dev)
    allowed = torch.zeros(real.shape + (len(cols),), dtype=torch.bool, device=dev)
    for n, ds in sets.items():
        allowed |= (real == n)[..., None] & torch.isin(col, torch.tensor(ds, device=dev))
    row = torch.arange(tk - tq, tk, device=dev)[:, None] - col          # (Tq, n): the key row each column reads
    allowed = allowed & (row >= 0)
    at = row.clamp(min=0)
    if valid is not None:
        allowed = allowed & valid.to(dev)[:, at]
    if docs is not None:
        allowed = allowed & (docs[:, at] == docs[:, :, None])
    # a padding query may see no key at all: let it see itself (distance 0) so no NaN reaches the real tokens
    allowed = allowed.expand(B, tq, len(cols)).clone()
    allowed[..., 0] |= ~allowed.any(-1)
    out = gathered_attention(query, key, value, cols, allowed, scaling)
    return out.transpose(1, 2).contiguous(), None


def padding_mask(batch_size=None, *args, attention_mask=None, **kwargs):
    """transformers' mask function for this attention: the 2-D padding mask itself (None when nothing is
    padded); the causal and sparse pattern is the attention's own, so no T x T mask is ever built."""
    if attention_mask is None or attention_mask.dim() != 2:
        return attention_mask
    return None if bool(attention_mask.all()) else attention_mask.to(torch.bool)


AttentionInterface.register(IMPL, fibattn_llama_attention)
try:  # transformers >= 4.53 builds masks per implementation
    from transformers.masking_utils import AttentionMaskInterface
    AttentionMaskInterface.register(IMPL, padding_mask)
except ImportError:
    pass


if DynamicLayer is not None:
    class FibattnCacheLayer(DynamicLayer):
        """One layer's last ``keep`` keys and values (``keep = max(D)``): the next query reads nothing older.

        A step writes its keys into a buffer with room past the kept ones (:meth:`rows`) and hands over a view
        of it, so a token copies its own keys, not every kept one (a ``torch.cat`` of the kept keys each step is
        O(keep)); the kept rows move to the buffer's start when the room runs out. A prompt, keys replaced
        (beam search reorders them) and a step with no room left while the layer keeps fewer than ``keep``
        rows go through ``torch.cat`` and start a new buffer; keys with gradients keep them, without one."""

        is_croppable = False

        def __init__(self, keep: int, context=None):
            super().__init__()
            self.keep, self.mask_keep, self.context = keep, keep, context
            self.cumulative_length = 0            # positions seen; transformers' reset() zeroes this name

        def lazy_initialization(self, key_states, value_states):
            self.device = key_states.device
            self.keys, self.values = key_states[..., :0, :].clone(), value_states[..., :0, :].clone()
            self._buf = None
            self.is_initialized = True

        def past_context(self, length: int):
            raise ValueError(f"FibattnCache: length {length} is past the cache's context {self.context}")

        def update(self, key_states, value_states, *args, **kwargs):
            """Append the new positions; return the kept keys/values plus the new ones, the keys marked."""
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            seen, new = self.cumulative_length, key_states.shape[-2]
            if self.context is not None and seen + new > self.context:
                self.past_context(seen + new)
            if self._fits(key_states, value_states):
                keys, values = self._append(key_states, value_states)
            else:
                keys = torch.cat([self.keys, key_states], dim=-2)
                values = torch.cat([self.values, value_states], dim=-2)
                if keys.requires_grad or values.requires_grad:    # keep the history: gradients reach past steps
                    cut = max(0, keys.shape[-2] - self.keep)       # clone: a view would keep the prompt alive
                    self.keys, self.values, self._buf = keys[..., cut:, :].clone(), values[..., cut:, :].clone(), None
                else:
                    self._start_buffer(keys, values)
            self.cumulative_length = seen + new
            setattr(keys, FIRST_KEY_POSITION, seen + new - keys.shape[-2])
            return keys, values

        @staticmethod
        def rows(kept: int) -> int:
            """Buffer rows for ``kept`` kept ones: room for a quarter as many new ones (at least 16); until a layer
            keeps its ``keep`` rows, the buffer grows (a quarter each time) with the tokens it holds."""
            return kept + max(16, kept // 4)

        def _fits(self, key_states, value_states) -> bool:
            buf = getattr(self, "_buf", None)
            if buf is None or self.keys is not self._kept[0] or self.values is not self._kept[1]:
                return False
            k = buf[0]
            return (not (key_states.requires_grad or value_states.requires_grad)
                    and key_states.shape[:2] == k.shape[:2] and key_states.dtype == k.dtype
                    and key_states.device == k.device and self.keys.shape[-2] + key_states.shape[-2] <= k.shape[-2])

        def _append(self, key_states, value_states):
            (k, v), (start, end), new = self._buf, self._span, key_states.shape[-2]
            if end + new > k.shape[-2]:                          # out of room: the kept rows to the start
                k[..., :end - start, :] = k[..., start:end, :].clone()
                v[..., :end - start, :] = v[..., start:end, :].clone()
                start, end = 0, end - start
            k[..., end:end + new, :] = key_states
            v[..., end:end + new, :] = value_states
            keys, values = k[..., start:end + new, :], v[..., start:end + new, :]
            self._keep_rows(max(start, end + new - self.keep), end + new)
            return keys, values

        def _start_buffer(self, keys, values) -> None:
            n = min(self.keep, keys.shape[-2])
            shape = keys.shape[:2] + (self.rows(n),) + keys.shape[3:]   # grows with the tokens seen, up to keep
            self._buf = (keys.new_empty(shape), values.new_empty(shape))
            self._buf[0][..., :n, :] = keys[..., keys.shape[-2] - n:, :]
            self._buf[1][..., :n, :] = values[..., values.shape[-2] - n:, :]
            self._keep_rows(0, n)

        def _keep_rows(self, start: int, end: int) -> None:
            self._span = (start, end)
            self.keys, self.values = self._buf[0][..., start:end, :], self._buf[1][..., start:end, :]
            self._kept = (self.keys, self.values)

        def get_mask_sizes(self, query_length: int):
            kept = min(self.cumulative_length, self.mask_keep)
            return kept + query_length, self.cumulative_length - kept

        def get_seq_length(self) -> int:
            return self.cumulative_length

        def get_max_length(self) -> int:
            return -1 if self.context is None else self.context

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove:
                raise ValueError("FibattnCache keeps only each layer's last keys: it cannot be cropped "
                                 "(assisted decoding is not supported)")

    class FibattnCache(Cache):
        """Constant-memory cache: layer ``i`` keeps its last ``max(D_i)`` keys and values (the new token's
        arrives with its step). ``context``: the longest sequence it will hold (needed for a pow2 base
        without reach_len, whose sets grow with the length); ``generate`` passes its ``max_length``."""

        def __init__(self, model_or_config, context=None):
            config = getattr(model_or_config, "config", model_or_config)
            s = config.fibattn
            self.context = context
            self.keeps = [longest_distance(s, i, context) for i in range(len(s["alphas"]))]
            super().__init__(layers=[FibattnCacheLayer(k, context) for k in self.keeps])
else:
    FibattnCache = None


class PreciseRotary(nn.Module):
    """transformers' default RoPE with float64 angles (fibattn's tables are float64), cast to the input's dtype."""

    def forward(self, x, position_ids):
        params = getattr(self.config, "rope_parameters", None) or {}
        theta = params.get("rope_theta", getattr(self.config, "rope_theta", 10000.0))
        half = self.inv_freq.shape[-1]
        dev = x.device if x.device.type != "mps" else torch.device("cpu")    # mps has no float64
        inv = theta ** (-torch.arange(half, dtype=torch.float64, device=dev) * 2 / (2 * half))
        freqs = position_ids[..., None].to(dev, torch.float64) * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = getattr(self, "attention_scaling", 1.0)
        return (emb.cos() * scale).to(x.device, x.dtype), (emb.sin() * scale).to(x.device, x.dtype)


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
        rotary = getattr(self.model, "rotary_emb", None)
        if rotary is not None and getattr(rotary, "rope_type", "default") == "default":
            rotary.__class__ = type("PreciseLlamaRotary", (PreciseRotary, type(rotary)), {})

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """generate's default cache is the constant-memory :class:`FibattnCache` (a cache passed in, or a
        ``cache_implementation`` asked for, is kept)."""
        before = {k: model_kwargs.get(k) for k in ("cache", "past_key_values")}
        out = super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if FibattnCache is None:
            return out
        bound = inspect.signature(super()._prepare_cache_for_generation).bind(
            generation_config, model_kwargs, *args, **kwargs)
        context = bound.arguments.get("max_cache_length")
        for name, old in before.items():
            new = model_kwargs.get(name)
            if new is not None and new is not old and type(new) is DynamicCache:
                model_kwargs[name] = FibattnCache(self, context=context)
        return out
