"""A constant-memory transformers ``Cache`` for models switched to fibattn by :func:`~.hf_llama.apply_fibattn`,
and for ``fibattn export --format hf`` models loaded with ``trust_remote_code=True`` (whose own ``generate``
already defaults to the same kind of cache, shipped in the export: ``FibattnCache``).

    from fibattn.interop.hf_cache import FibCache
    cache = FibCache(model, context=len(prompt) + max_new_tokens)    # context=None when reach_len is set
    out = model.generate(ids, max_new_tokens=..., cache=cache)       # transformers < 5: past_key_values=cache

What a layer keeps. The query at position ``p`` reads the keys at ``p - d`` for ``d`` in its
layer's distance set ``D`` (docs/method.md §1), and transformers caches keys after RoPE, so a
later query can only ever need the last ``max(D)`` cached keys besides its own: layer ``i``
keeps exactly those, ``keep_i = max(D_i)`` keys and values per batch row (the new token's key
arrives with its step, so ``max(D_i) + 1`` are in hand while it runs), whatever the length, in a
buffer of :meth:`FibCacheLayer.rows` rows (room for the next steps' keys, so a step does not copy
the kept ones).
A prompt is first attended in full, then only its tail is kept.

Which ``D``. A set only grows with the length (the cap and a ``pow2`` base grow, nothing
leaves), so the sets of every length up to ``N`` lie in ``[0, max(D(N))]``:

- ``reach_len`` set (method.md §1 ``reach="train"``): ``D`` stops growing at ``reach_len``, so
  ``keep_i = max(D_i(reach_len))`` and ``context=None`` allows any length.
- no ``reach_len``: ``D`` grows with the length without bound, so the cache is sized for a
  ``context``, the longest sequence it will hold (left padding included), as fibattn's own
  decoder (:class:`fibattn.generation.decode.DecodeSession`) is: ``keep_i = max(D_i(context))``.
  A step past the context is an error, never a silently shortened set.

Semantics: a step at length ``T`` attends ``D(T)``, exactly as with transformers' full cache,
so the logits and greedy tokens equal the full cache's for every base (tested to 1e-5). Where a
layer's shorter sets are its longer set cut short (fib and custom bases, ``pow2`` with
``alpha >= 1``) every step also equals ``model(tokens_so_far)[:, -1]`` and fibattn's own
decoder. ``pow2`` with ``alpha < 1`` gains short distances as the length grows, so positions
cached earlier were computed with other sets: there cached decoding (either cache) differs
from a full forward pass, and from ``DecodeSession``, which fixes every set at its context.

How the attention function knows where the kept keys sit: transformers hands it the keys but
not the cache, so :meth:`FibCacheLayer.update` marks the key tensor it returns with the absolute
position of its first key (attribute :data:`~.hf_llama.FIRST_KEY_POSITION`); unmarked keys start
at 0 (no cache, or transformers' full cache).

Padding: the attention mask transformers builds covers the last ``max_i keep_i`` positions plus
the new ones (:meth:`FibCacheLayer.get_mask_sizes`); each layer reads its own tail of it, so a
left-padded batch gives every row the tokens of its unpadded prompt. Beam search works
(``reorder_cache``); assisted decoding, which must roll the cache back, is refused (``crop``).
Needs transformers' layered cache API (``transformers.cache_utils.DynamicLayer``); tested with 5.24.
"""
from __future__ import annotations

import torch

from ..checks import UsageError, check_int
from .hf_llama import FIRST_KEY_POSITION, IMPL_NAME, LayerSpec, _spec_from_config, attention_modules

try:
    from transformers.cache_utils import Cache, DynamicLayer
except ImportError as exc:                    # no transformers, or one without the layered cache API
    raise ImportError("fibattn.interop.hf_cache needs a transformers with layered caches (transformers.cache_utils."
                      "DynamicLayer; tested with 5.24): pip install -U 'fibattn[hf]'") from exc


# the attention of `fibattn export --format hf` remote code (hf_remote): it reads the same key marks
REMOTE_IMPL = "fibattn_llama"   # the remote code's names start with it (one per loaded copy)


class FibCacheLayer(DynamicLayer):
    """One layer's last ``keep`` keys and values ``(B, Hkv, <= keep, Dh)``; see the module docstring.

    ``mask_keep``: the most any layer of the cache keeps (the mask transformers builds is sized
    by it); ``context``: the longest sequence allowed, ``None`` for no limit.
    """

    is_croppable = False

    def __init__(self, keep: int, mask_keep: int, context: int | None):
        super().__init__()
        self.keep, self.mask_keep, self.context = keep, mask_keep, context
        self.cumulative_length = 0            # positions seen; transformers' reset() zeroes this name

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.keys = key_states[..., :0, :].clone()
        self.values = value_states[..., :0, :].clone()
        self._buf = None                      # (keys, values) with room past the kept rows; see update
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new positions; return every kept key/value plus the new ones (a prompt: all of it).

        A step writes its rows into a buffer with room past the kept ones and returns a view of it, so a token
        copies its own rows, not every kept one (a ``torch.cat`` of the kept keys each step is O(keep), the
        largest cost of decoding at a long context); the kept rows move to the buffer's start when the room
        runs out, once every ``room`` tokens. A prompt, keys that were replaced (beam search reorders them) and
        a step with no room left while the layer holds fewer than ``keep`` rows go through ``torch.cat`` and
        start a new buffer; keys that carry gradients keep them, through ``torch.cat`` without a buffer."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        seen, new = self.cumulative_length, key_states.shape[-2]
        if self.context is not None and seen + new > self.context:
            raise UsageError(f"FibCache: length {seen + new} is past the cache's context {self.context}; build it "
                             f"with FibCache(model, context=N), N >= prompt (with padding) + max_new_tokens")
        if self._fits(key_states, value_states):
            keys, values = self._append(key_states, value_states)
        else:
            keys = torch.cat([self.keys, key_states], dim=-2)
            values = torch.cat([self.values, value_states], dim=-2)
            if keys.requires_grad or values.requires_grad:    # keep the history: gradients reach earlier steps
                cut = max(0, keys.shape[-2] - self.keep)       # clone: a view would keep the prompt alive
                self.keys, self.values, self._buf = keys[..., cut:, :].clone(), values[..., cut:, :].clone(), None
            else:
                self._start_buffer(keys, values)
        self.cumulative_length = seen + new
        setattr(keys, FIRST_KEY_POSITION, seen + new - keys.shape[-2])
        return keys, values

    @staticmethod
    def rows(kept: int) -> int:
        """A layer's buffer rows for ``kept`` kept ones: room for a quarter as many new ones (at least 16). Until a
        layer keeps its ``keep`` rows, the buffer grows (a quarter each time) with the tokens it holds."""
        return kept + max(16, kept // 4)

    def _fits(self, key_states, value_states) -> bool:
        buf = getattr(self, "_buf", None)
        if buf is None or self.keys is not self._kept[0] or self.values is not self._kept[1]:
            return False
        k = buf[0]
        return (not (key_states.requires_grad or value_states.requires_grad) and key_states.shape[:2] == k.shape[:2]
                and key_states.dtype == k.dtype and key_states.device == k.device
                and self.keys.shape[-2] + key_states.shape[-2] <= k.shape[-2])

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
        shape = keys.shape[:2] + (self.rows(n),) + keys.shape[3:]     # grows with the tokens seen, up to keep
        self._buf = (keys.new_empty(shape), values.new_empty(shape))
        self._buf[0][..., :n, :] = keys[..., keys.shape[-2] - n:, :]
        self._buf[1][..., :n, :] = values[..., values.shape[-2] - n:, :]
        self._keep_rows(0, n)

    def _keep_rows(self, start: int, end: int) -> None:
        self._span = (start, end)
        self.keys, self.values = self._buf[0][..., start:end, :], self._buf[1][..., start:end, :]
        self._kept = (self.keys, self.values)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The mask spans the last ``mask_keep`` seen positions and the new ones (same for every layer)."""
        kept = min(self.cumulative_length, self.mask_keep)
        return kept + query_length, self.cumulative_length - kept

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1 if self.context is None else self.context

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise UsageError(f"FibCache cannot crop {tokens_to_remove} tokens: it keeps only each layer's last keys "
                             f"(assisted decoding is not supported)")


def _specs(model) -> list[LayerSpec]:
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl != IMPL_NAME and not str(impl).startswith(REMOTE_IMPL):
        raise UsageError(f"FibCache needs a model switched to fibattn (apply_fibattn or hf_llama.from_pretrained) "
                         f"or an `export --format hf` model loaded with trust_remote_code=True; its "
                         f"attn_implementation is {impl!r}")
    specs = [getattr(m, "fibattn_spec", None) or _spec_from_config(m) for m in attention_modules(model)]
    if not specs or not all(isinstance(s, LayerSpec) for s in specs):
        raise UsageError(f"FibCache: {type(model).__name__} has attention layers without a fibattn spec; "
                         f"call apply_fibattn(model, ...) first")
    return specs


class FibCache(Cache):
    """Constant-memory cache for ``model.generate`` on a model after :func:`~.hf_llama.apply_fibattn`.

    ``context``: the longest sequence (prompt with its padding + new tokens) it will hold; needed
    unless every layer has a ``reach_len``, and then optional (``None``: no limit). See the
    module docstring for what is kept and why the tokens equal the full cache's.
    """

    def __init__(self, model, context: int | None = None):
        specs = _specs(model)
        if context is not None:
            context = check_int("context", context, 1)
        elif any(s.reach_len is None for s in specs):
            raise UsageError("FibCache(model, context=None) needs apply_fibattn(..., reach_len=N): without it the "
                             "distance sets grow with the length (method.md §1); pass context=prompt + max_new_tokens")
        self.context = context
        self.keeps = [max(s.distances(context if context is not None else s.reach_len)) for s in specs]
        super().__init__(layers=[FibCacheLayer(k, max(self.keeps), context) for k in self.keeps])

    @property
    def cache_bytes(self) -> int:
        """What the kept keys and values occupy now (see :func:`cache_bytes`)."""
        return cache_bytes(self)


def cache_bytes(cache) -> int:
    """Bytes of the storages behind every layer's keys and values (what the cache holds alive), for a
    :class:`FibCache` or any layered transformers cache such as the default ``DynamicCache``."""
    return sum(t.untyped_storage().nbytes() for layer in cache.layers if getattr(layer, "is_initialized", False)
               for t in (layer.keys, layer.values) if t is not None)
