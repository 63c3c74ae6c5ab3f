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

from ..checks import UsageError, check_int
from .hf_llama import IMPL_NAME, LayerSpec, _spec_from_config, attention_modules

try:
    from transformers.cache_utils import Cache, DynamicLayer  # noqa: F401  (the check: layered caches)
except ImportError as exc:                    # no transformers, or one without the layered cache API
    raise ImportError("fibattn.interop.hf_cache needs a transformers with layered caches (transformers.cache_utils."
                      "DynamicLayer; tested with 5.24): pip install -U 'fibattn[hf]'") from exc
from .hf_remote.modeling_fibattn_llama import FibattnCacheLayer  # noqa: E402  (needs the layered caches too)


# the attention of `fibattn export --format hf` remote code (hf_remote): it reads the same key marks
REMOTE_IMPL = "fibattn_llama"   # the remote code's names start with it (one per loaded copy)


class FibCacheLayer(FibattnCacheLayer):
    """One layer's last ``keep`` keys and values ``(B, Hkv, <= keep, Dh)``; see the module docstring. The
    keeping (a buffer with room for the next steps' keys, :meth:`rows`) is the export's own cache layer's
    (``hf_remote``), which ships without fibattn.

    ``mask_keep``: the most any layer of the cache keeps (the mask transformers builds is sized
    by it); ``context``: the longest sequence allowed, ``None`` for no limit.
    """

    def __init__(self, keep: int, mask_keep: int, context: int | None):
        super().__init__(keep, context)
        self.mask_keep = mask_keep

    def past_context(self, length: int):
        raise UsageError(f"FibCache: length {length} is past the cache's context {self.context}; build it "
                         f"with FibCache(model, context=N), N >= prompt (with padding) + max_new_tokens")

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
