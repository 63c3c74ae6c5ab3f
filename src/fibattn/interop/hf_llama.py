"""Drop fibattn sparse attention into a Hugging Face ``transformers`` Llama-style model.

    from transformers import LlamaConfig, LlamaForCausalLM
    from fibattn.interop.hf_llama import apply_fibattn
    model = LlamaForCausalLM(LlamaConfig(...))
    apply_fibattn(model, window=12, base="fib", schedule="linear")    # per-layer alphas 0.5 .. 1.5

How: transformers' attention-function registry. ``apply_fibattn`` registers the function
:func:`fibattn_attention` under the name ``"fibattn"`` (``AttentionInterface.register``),
attaches a :class:`LayerSpec` (window, alpha, base, reach) to every attention module --
the layer index comes from the module's ``layer_idx`` -- and switches the model to
``attn_implementation="fibattn"``. The registered function receives the attention module
as its first argument, so it reads that layer's alpha from the module: no module swap is
needed, the model keeps its own projections, RoPE, KV cache and weights (checkpoints
stay loadable by plain transformers).

Layout, as transformers passes it: query ``(B, H, Tq, Dh)``, key/value ``(B, Hkv, Tk, Dh)``
(RoPE already applied); the function returns ``(B, Tq, H, Dh)`` and no weights.

Semantics: the query at position ``i`` attends keys ``i - d`` for ``d`` in the layer's
``attended_distances(window, alpha, base, T, reach=reach_len)``, ``T`` the sequence length so
far. Without a cache (``Tq == Tk``) this is :func:`fibattn.sparse_attention` (O(T·|D|)), padded
batches included: fibattn's mask function (:func:`~.hf_batch.padding_mask`) hands over the 2-D
padding mask, never a T x T one, and a row whose real tokens are one run (padded on the left, the
right or both) is three documents, the pads before, the run, the pads after, so its real tokens see
only each other, as unpadded, through the set of its own length (a call per distinct set where
they differ, :mod:`~.hf_documents`); the outputs at pads are not the dense path's, and nothing
reads them. With a cache (``Tq < Tk``, generation) each query reads only the keys at its distances,
gathered (O(Tq·|D|)); a mask with a gap inside a row, or another mask, takes the sparse boolean
pattern combined with it: exact (a left-padded row gives its real tokens the outputs of the
unpadded prompt), O(Tq·Tk).
Alphas are fixed per layer (``learned`` is not supported here).

Packed documents (padding-free batches, ``DataCollatorWithFlattening``): transformers passes the
attention function ``cu_seq_lens_q``/``cu_seq_lens_k`` (FlashAttention's varlen kwargs) and
``position_ids``; the documents come from ``cu_seq_lens_q`` when given, else from positions that
restart (a document starts wherever the position does not continue the previous one, as
transformers' own packed-sequence mask reads them). Each query then attends inside its document
through the set of that document's length, so every document gets the logits of its own
unpadded call: on :func:`fibattn.sparse_attention` with ``document_ids``, a call per distinct set
(:mod:`~.hf_documents`); a mask that hides keys inside a document takes a boolean pattern.
transformers' own packed-sequence mask (made without a cache) comes as a
:class:`~.hf_batch.DeferredMask`, read at the attended columns only. A padding mask still hides
its keys, and a document's length counts its real tokens (a left-padded row, whose pads restart
the positions, is such a batch).

Generation: ``model.generate`` keeps transformers' full cache by default, so memory grows with
the context. ``model.generate(..., cache=FibCache(model, context=...))`` with
:class:`fibattn.interop.hf_cache.FibCache` keeps only each layer's last ``max(D)`` keys:
constant memory, the full cache's tokens and logits. It hands over only those keys, the key
tensor marked with the absolute position of its first key (:data:`FIRST_KEY_POSITION`), from
which ``T`` is counted.

Saving: ``apply_fibattn`` records its settings in ``model.config.fibattn``, so
``save_pretrained`` keeps them. Plain transformers cannot know about them: load with
:func:`from_pretrained` here, or with ``attn_implementation="fibattn"`` after importing this
module; either way the layers rebuild their patterns from the saved config.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..checks import UsageError, check_keys
from ..ops import sparse_attention
from ..schedules import Base, as_base, attended_distances, layer_alphas
from .hf_batch import DeferredMask, causal, key_padding, packed_documents, padded_rows, padding_mask, pads_apart
from .hf_documents import attend, gathered, packed, padded

log = logging.getLogger("fibattn")

IMPL_NAME = "fibattn"
# attribute a cache puts on the key tensor it returns: the absolute position of its first key
FIRST_KEY_POSITION = "fibattn_first_key_position"
SCHEDULES = ("fixed", "linear", "coprime", "custom")
# what apply_fibattn saves in config.fibattn
SAVED_KEYS = ("window", "alphas", "reach_len", "backend", "schedule", "base")


@dataclass(frozen=True)
class LayerSpec:
    """One layer's sparse pattern."""

    layer_idx: int
    window: int
    alpha: float
    base: Base
    reach_len: int | None = None
    backend: str = "auto"

    def distances(self, seq_len: int) -> list[int]:
        return attended_distances(self.window, self.alpha, self.base, seq_len, reach=self.reach_len)


def _require_transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("fibattn.interop.hf_llama needs transformers: pip install 'fibattn[hf]'") from exc
    return transformers


def _cached_mask(dists: list[int], tq: int, tk: int, device) -> torch.Tensor:
    """``(Tq, Tk)`` bool: query ``tk - tq + i`` may see key ``j`` when ``pos - j`` is in ``dists``
    (counted within the keys handed over, which end at the last query)."""
    dist = torch.tensor(dists, device=device)
    pos = torch.arange(tk - tq, tk, device=device)[:, None]
    gap = pos - torch.arange(tk, device=device)[None, :]
    return torch.isin(gap, dist) & (gap >= 0)


def _spec_from_config(module) -> LayerSpec | None:
    """A layer's spec rebuilt from ``config.fibattn`` (what :func:`apply_fibattn` saved), if there is one."""
    saved = getattr(getattr(module, "config", None), "fibattn", None)
    if not isinstance(saved, dict) or not isinstance(getattr(module, "layer_idx", None), int):
        return None
    base = saved.get("base", {})
    spec = LayerSpec(module.layer_idx, int(saved["window"]), float(saved["alphas"][module.layer_idx]),
                     Base(base.get("kind", "fib"), int(base.get("k", 15)), tuple(base.get("values", ()))),
                     saved.get("reach_len"), saved.get("backend", "auto"))
    module.fibattn_spec = spec
    return spec


def _masked(dists, query, key, value, pad, scaling):
    """Attention through the sparse pattern and transformers' boolean mask ``pad`` ``(B, 1, Tq, >= Tk)``
    (a :class:`~.hf_cache.FibCache` mask spans its longest layer: each layer reads its own tail).
    ``dists``: one distance list for every row, or a function of a row's own length (its real tokens)."""
    tq, tk = query.shape[2], key.shape[2]
    pad = pad[..., pad.shape[-1] - tk:].to(torch.bool)
    if callable(dists):     # a padded row's set is that of its real length (a pow2 set changes with it)
        lengths = pad[:, 0, -1].sum(-1).clamp(min=1).tolist()
        pattern = torch.stack([_cached_mask(dists(int(n)), tq, tk, query.device) for n in lengths])[:, None]
    else:
        pattern = _cached_mask(dists, tq, tk, query.device)[None, None]
    return attend(query, key, value, pattern & pad, scaling)


def fibattn_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """The function registered as ``"fibattn"``; see the module docstring."""
    spec = getattr(module, "fibattn_spec", None) or _spec_from_config(module)
    if not isinstance(spec, LayerSpec):
        raise UsageError(f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) has no fibattn "
                         f"spec: call fibattn.interop.hf_llama.apply_fibattn(model, ...) instead of setting "
                         f"attn_implementation='{IMPL_NAME}' by hand")
    if dropout:
        raise UsageError(f"fibattn attention has no dropout; set config.attention_dropout=0, got {dropout}")
    tq, tk = query.shape[2], key.shape[2]
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        raise UsageError(f"fibattn attention takes a boolean attention mask, got {attention_mask.dtype}")
    cached = hasattr(key, FIRST_KEY_POSITION)          # keys from a FibCache
    fresh = tq == tk and not cached
    documents = packed_documents(query, kwargs) if fresh else None
    dists = spec.distances(getattr(key, FIRST_KEY_POSITION, 0) + tk)     # D at the length so far
    if isinstance(attention_mask, DeferredMask):  # packed sequences: whole only where documents do not tell it all
        used = set(dists).union(*(spec.distances(n) for n in documents[1])) if documents is not None else None
        attention_mask = None if used is not None and not attention_mask.hides(documents[0], used) \
            else attention_mask.build()
    real = None if attention_mask is None else key_padding(attention_mask, tq, tk)   # None: another mask
    if real is not None and documents is not None and pads_apart(documents[0], real):
        attention_mask = real = None    # the pads are documents of their own (left padding, restarting positions)
    rows = padded_rows(real) if real is not None and documents is None and tq == tk else None
    if tq != tk and (attention_mask is None or real is not None):
        out = gathered(spec, dists, query, key, value, real, not cached, scaling)   # a cached step: its keys only
    elif rows is not None:      # each row's real tokens one run: the sparse op's documents, with the row's set
        out = padded(spec, dists, query, key, value, *rows, not cached, scaling)   # a FibCache's: the set at T
    else:
        if attention_mask is not None and attention_mask.dim() == 2:   # padding_mask's: add the causal part
            pad = attention_mask[:, None, attention_mask.shape[-1] - tk:]
            attention_mask = (causal(tq, tk, query.device) & pad)[:, None]
        if documents is not None:
            out = packed(spec, dists, query, key, value, documents[0], attention_mask, scaling)
        elif attention_mask is not None:
            # every key in hand (no FibCache): each row's own length is countable from its mask
            out = _masked(spec.distances if not cached else dists, query, key, value, attention_mask, scaling)
        else:
            out = sparse_attention(query, key, value, dists, scale=scaling, backend=spec.backend)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register :func:`fibattn_attention` as ``"fibattn"`` with transformers (idempotent)."""
    transformers = _require_transformers()
    if not hasattr(transformers, "AttentionInterface"):
        raise ImportError(f"fibattn.interop.hf_llama needs transformers >= 4.48 (AttentionInterface); found "
                          f"{transformers.__version__}")
    transformers.AttentionInterface.register(IMPL_NAME, fibattn_attention)
    masks = getattr(getattr(transformers, "masking_utils", None), "AttentionMaskInterface", None)
    if masks is not None:                  # the 2-D padding mask, None when nothing is padded: never T x T
        masks.register(IMPL_NAME, padding_mask)


def attention_modules(model) -> list:
    """The model's self-attention modules in layer order (modules with ``layer_idx`` and ``q_proj``)."""
    found = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "q_proj")]
    return sorted(found, key=lambda m: m.layer_idx)


def plan_alphas(n_layers: int, schedule: str, *, a_min: float = 0.5, a_max: float = 1.5, alpha: float = 1.0,
                alphas=None) -> list[float]:
    if schedule not in SCHEDULES:
        raise UsageError(f"schedule must be one of {', '.join(SCHEDULES)} (learned alphas are not supported in "
                         f"the transformers drop-in), got {schedule!r}")
    if schedule == "custom" and (alphas is None or len(alphas) != n_layers):
        raise UsageError(f"schedule='custom' needs alphas: a list of {n_layers} values (one per layer), got {alphas!r}")
    return layer_alphas(schedule, n_layers, a_min=a_min, a_max=a_max, value=alpha,
                        values=list(alphas) if alphas is not None else None)


def apply_fibattn(model, *, window: int = 12, base="fib", schedule: str = "linear", a_min: float = 0.5,
                  a_max: float = 1.5, alpha: float = 1.0, alphas=None, reach_len: int | None = None,
                  backend: str = "auto"):
    """Switch a transformers Llama-style model to fibattn attention in place; returns the model.

    ``base``: ``"fib"``, ``"pow2"``, ``"none"`` (the window alone), a :class:`fibattn.schedules.Base` or a
    list of integers;
    ``schedule``: fixed | linear | coprime | custom (``alphas``, one per layer);
    ``reach_len``: cap distances at ``reach_len - 1`` (method.md §1 ``reach="train"``); ``None``
    rebuilds them at every length (the study's behaviour).
    """
    register()
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise UsageError(f"window must be an integer >= 0, got {window!r}")
    if reach_len is not None and (isinstance(reach_len, bool) or not isinstance(reach_len, int) or reach_len < 1):
        raise UsageError(f"reach_len must be None or an integer >= 1, got {reach_len!r}")
    layers = attention_modules(model)
    if not layers:
        raise UsageError(f"{type(model).__name__} has no attention modules with layer_idx and q_proj "
                         f"(a Llama-style transformers model is expected)")
    idx = [m.layer_idx for m in layers]
    if idx != list(range(len(layers))):
        raise UsageError(f"attention layer indices must be 0..{len(layers) - 1}, got {idx}")
    base = as_base(base)
    values = plan_alphas(len(layers), schedule, a_min=a_min, a_max=a_max, alpha=alpha, alphas=alphas)
    for module, a in zip(layers, values):
        module.fibattn_spec = LayerSpec(module.layer_idx, window, float(a), base, reach_len, backend)
    model.config.fibattn = {"window": window, "alphas": [float(a) for a in values], "reach_len": reach_len,
                            "backend": backend, "schedule": schedule,
                            "base": {"kind": base.kind, "k": base.k, "values": list(base.values)}}
    _set_impl(model, IMPL_NAME)
    wrong = [m.layer_idx for m in layers if m.config._attn_implementation != IMPL_NAME]
    if wrong:
        raise UsageError(f"could not switch layers {wrong} to attn_implementation='{IMPL_NAME}'")
    log.info("fibattn.interop.hf_llama: %d layers, window %d, base %s, schedule %s, alphas %s", len(layers), window,
             base.kind, schedule, [round(a, 4) for a in values])
    return model


def from_pretrained(path, *, model_class=None, **kwargs):
    """Load a model saved after :func:`apply_fibattn` with its sparse attention (``kwargs`` go to
    transformers' ``from_pretrained``); a folder without fibattn settings is an error, never a silent
    dense model. A ``fibattn export --format hf`` folder (model type ``fibattn_llama``) loads as the
    ``LlamaForCausalLM`` it is, without its remote code, its RoPE angles in float64 as the FibLM's
    (:func:`float64_rope`)."""
    transformers = _require_transformers()
    register()
    cls = model_class or transformers.AutoModelForCausalLM
    exported = False
    if model_class is None and "config" not in kwargs:
        hub = {k: kwargs[k] for k in ("cache_dir", "revision", "token", "local_files_only", "subfolder") if k in kwargs}
        saved = transformers.LlamaConfig.get_config_dict(path, **hub)[0]
        if saved.get("model_type") == "fibattn_llama":  # `export --format hf` remote code: its Llama, no remote code
            saved = {k: v for k, v in saved.items() if k not in ("model_type", "auto_map", "architectures")}
            cls, kwargs["config"] = transformers.LlamaForCausalLM, transformers.LlamaConfig.from_dict(saved)
            exported = True
    model = cls.from_pretrained(path, attn_implementation=IMPL_NAME, **kwargs)
    if exported:            # a FibLM's export: its RoPE angles as fibattn computes them (float64)
        float64_rope(model)
    if not isinstance(getattr(model.config, "fibattn", None), dict):
        raise UsageError(f"{path}: its config.json has no 'fibattn' settings (it was not saved after apply_fibattn); "
                         f"load it with transformers and call apply_fibattn(model, ...)")
    saved = model.config.fibattn
    check_keys(f"{path}: config.json 'fibattn'", saved, SAVED_KEYS)       # a misspelt key would change the pattern
    check_keys(f"{path}: config.json 'fibattn.base'", saved.get("base") or {}, ("kind", "k", "values"))
    for module in attention_modules(model):
        _spec_from_config(module)
    return model


class _Float64Rotary:
    """transformers' default RoPE with float64 angles, as fibattn's tables (model/rope.py): float32 angles drift
    with the position (about 2e-4 rad at 4096), which moved an export's logits past 1e-5 at 4x its length."""

    def forward(self, x, position_ids):
        params = getattr(self.config, "rope_parameters", None) or {}
        theta = params.get("rope_theta", getattr(self.config, "rope_theta", 10000.0))
        half = self.inv_freq.shape[-1]
        dev = x.device if x.device.type != "mps" else torch.device("cpu")      # mps has no float64
        inv = theta ** (-torch.arange(half, dtype=torch.float64, device=dev) * 2 / (2 * half))
        ang = position_ids[..., None].to(dev, torch.float64) * inv
        emb = torch.cat((ang, ang), dim=-1)
        scale = getattr(self, "attention_scaling", 1.0)
        return (emb.cos() * scale).to(x.device, x.dtype), (emb.sin() * scale).to(x.device, x.dtype)


def float64_rope(model):
    """Compute the model's default (unscaled) RoPE angles in float64, as a FibLM does; returns the model."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is not None and getattr(rotary, "rope_type", "default") == "default" \
            and not isinstance(rotary, _Float64Rotary):
        rotary.__class__ = type(f"Float64{type(rotary).__name__}", (_Float64Rotary, type(rotary)), {})
    return model


def remove_fibattn(model, implementation: str = "sdpa"):
    """Back to a built-in attention (``sdpa`` or ``eager``); the specs and saved settings are removed."""
    for module in attention_modules(model):
        if hasattr(module, "fibattn_spec"):
            del module.fibattn_spec
    if hasattr(model.config, "fibattn"):
        del model.config.fibattn
    _set_impl(model, implementation)
    return model


def _set_impl(model, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:                                   # older transformers: the config field is read per call
        model.config._attn_implementation = name
