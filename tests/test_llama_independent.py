"""Llama interop against transformers' definitions written out here, not against fibattn's own
round trip: the tensors ``export --format hf`` writes run through a Llama forward pass coded from
the transformers model (rotate-half RoPE, RMSNorm, SwiGLU, grouped-query attention) and give the
FibLM's logits; a config.json without a key reads as transformers' LlamaConfig default."""
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fibattn.config import ModelConfig
from fibattn.model.llama_names import from_llama, to_llama
from fibattn.model.lm import FibLM
from fibattn.storage.init_source import _llama_arch


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def llama_forward(sd, ids, *, layers, heads, kv_heads, theta, eps):
    """transformers' LlamaForCausalLM.forward (eager attention, no scaling) on a state dict of its names."""
    x = sd["model.embed_tokens.weight"][ids]
    B, T, C = x.shape
    D = C // heads
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    mask = torch.full((T, T), float("-inf"), dtype=x.dtype).triu(1)
    for i in range(layers):
        p = f"model.layers.{i}."
        h = _rms(x, sd[p + "input_layernorm.weight"], eps)
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(B, T, heads, D).transpose(1, 2)
        k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(B, T, kv_heads, D).transpose(1, 2)
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(B, T, kv_heads, D).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D) + mask, dim=-1) @ v
        x = x + att.transpose(1, 2).reshape(B, T, C) @ sd[p + "self_attn.o_proj.weight"].T
        h = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        ffn = F.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T)
        x = x + ffn @ sd[p + "mlp.down_proj.weight"].T
    return _rms(x, sd["model.norm.weight"], eps) @ sd["lm_head.weight"].T


@pytest.mark.parametrize("tied, kv", [(True, 1), (False, 2)])
def test_exported_names_run_as_transformers_llama(tied, kv):
    cfg = ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2, n_kv_heads=kv, seq_len=32, attention="dense",
                      tie_embeddings=tied, rope_theta=500.0, norm_eps=1e-5)
    torch.manual_seed(0)
    model = FibLM(cfg).double().eval()
    with torch.no_grad():                  # every tensor distinct, norm gains included (they start at 1)
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0) + (1.0 if p.dim() == 1 else 0.0))
    sd = to_llama(model.state_dict(), heads=2, kv_heads=kv, head_dim=16, tied=tied)
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = llama_forward(sd, ids, layers=2, heads=2, kv_heads=kv, theta=500.0, eps=1e-5)
        torch.testing.assert_close(model(ids), want, rtol=1e-4, atol=1e-4)   # RoPE angles in fp32
    back = from_llama(sd, heads=2, kv_heads=kv, head_dim=16, tied=tied)
    assert set(back) == set(model.state_dict())


# transformers' LlamaConfig defaults (configuration_llama.py) for keys a config.json may leave out
LLAMA_DEFAULTS = {"num_key_value_heads": None, "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                  "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False, "head_dim": None}
FULL = {"model_type": "llama", "vocab_size": 40, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 64, "num_key_value_heads": 2, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True, "rope_theta": 5e5, "attention_bias": False, "mlp_bias": False, "head_dim": 8}


@pytest.mark.parametrize("key", sorted(LLAMA_DEFAULTS))
def test_a_config_json_without_a_key_reads_as_transformers_default(key):
    missing = {k: v for k, v in FULL.items() if k != key}
    explicit = dict(FULL, **{key: LLAMA_DEFAULTS[key]})
    if key == "num_key_value_heads":                    # None: as many key/value heads as query heads
        explicit[key] = FULL["num_attention_heads"]
    if key == "head_dim":
        explicit[key] = FULL["hidden_size"] // FULL["num_attention_heads"]
    got = _arch(missing)
    assert got == _arch(explicit)
    assert got != _arch(FULL) or FULL[key] == explicit[key]


def _arch(doc):
    return _llama_arch("src", Path("config.json"), doc)
