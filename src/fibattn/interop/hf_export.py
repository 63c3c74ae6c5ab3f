"""``fibattn export --format hf``: a Hugging Face ``transformers`` Llama folder of a fibattn model.

A FibLM is a Llama-architecture decoder (RMSNorm, SwiGLU, RoPE, grouped-query attention, tied
embeddings), so its weights load into ``LlamaForCausalLM`` with three changes:

- names: ``embed`` -> ``model.embed_tokens``, ``blocks.i.attn`` -> ``model.layers.i.self_attn``,
  ``ffn.gate/up/down`` -> ``mlp.gate_proj/up_proj/down_proj``, the norms likewise;
- RoPE: fibattn rotates interleaved pairs ``(2j, 2j+1)``, transformers rotates halves
  ``(j, j + Dh/2)``; permuting the rows of every q and k head from ``[0, 2, 4, ..., 1, 3, 5, ...]``
  gives the same scores (``q·k`` is unchanged when both are permuted alike);
- the sparse attention: the settings go to ``config.fibattn`` (:mod:`fibattn.interop.hf_llama`),
  so ``hf_llama.from_pretrained(OUT)`` (or ``attn_implementation="fibattn"``) rebuilds it. Plain
  ``AutoModelForCausalLM.from_pretrained(OUT)`` loads the same weights with dense attention.

The tokenizer is written as a ``tokenizers`` file ``AutoTokenizer`` reads: the byte tokenizer as a
byte-level model whose ids are the byte values, a BPE tokenizer as it is. (One difference: the
literal text ``<|endoftext|>`` is plain text to fibattn's BPE tokenizer and the end-of-document
token to transformers'.) Learned-alpha models are refused: their attention interpolates between
distances, which the drop-in does not.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import to_dict
from ..storage.checkpoint import Checkpoint
from ..storage.export import run_card
from ..storage.runs import find_checkpoint, load_run


def _require():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("fibattn export --format hf needs transformers: pip install 'fibattn[hf]'") from exc
    return transformers


def _interleaved_to_halves(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return w.view(heads, head_dim, -1)[:, order].reshape(heads * head_dim, -1)


def llama_state_dict(model) -> dict[str, torch.Tensor]:
    """A FibLM's weights under ``LlamaForCausalLM`` names, q/k rows in transformers' RoPE order."""
    m = model.cfg
    out = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight,
           "lm_head.weight": model.embed.weight}
    for i, block in enumerate(model.blocks):
        p, a = f"model.layers.{i}.", block.attn
        out.update({
            p + "input_layernorm.weight": block.attn_norm.weight,
            p + "post_attention_layernorm.weight": block.ffn_norm.weight,
            p + "self_attn.q_proj.weight": _interleaved_to_halves(a.q_proj.weight, m.n_heads, m.head_dim),
            p + "self_attn.k_proj.weight": _interleaved_to_halves(a.k_proj.weight, m.n_kv_heads, m.head_dim),
            p + "self_attn.v_proj.weight": a.v_proj.weight,
            p + "self_attn.o_proj.weight": a.o_proj.weight,
            p + "mlp.gate_proj.weight": block.ffn.gate.weight,
            p + "mlp.up_proj.weight": block.ffn.up.weight,
            p + "mlp.down_proj.weight": block.ffn.down.weight,
        })
    return {k: v.detach().clone() for k, v in out.items()}


def _byte_tokenizer_fast(transformers):
    """The fibattn byte tokenizer (id = byte value, eos 255) as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    table = _bytes_to_unicode()
    tk = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=table[255])


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what the ByteLevel pre-tokenizer uses)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


def export_hf(run_dir, out_dir, *, step="latest") -> Path:
    """Write ``out_dir`` as a transformers Llama folder with fibattn's settings in ``config.fibattn``."""
    transformers = _require()
    from ..files import check_creatable
    from .hf_llama import apply_fibattn
    from ..model.attention import config_base
    out = check_creatable(out_dir, "the export folder (OUT)")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"OUT {out} is not empty; --format hf writes a new folder (choose an empty or new one)")
    ckpt = find_checkpoint(run_dir, step)
    model, cfg, tokenizer = load_run(ckpt)
    m = cfg.model
    if m.attention == "sparse" and m.schedule == "learned":
        raise ValueError("--format hf: a learned-alpha model attends interpolated distances, which the transformers "
                         "drop-in does not; export it in fibattn's format (the default)")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.ffn_hidden, num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads, max_position_embeddings=m.max_seq_len,
        rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta, tie_word_embeddings=True, attention_bias=False,
        mlp_bias=False, attention_dropout=0.0, eos_token_id=getattr(tokenizer, "eos_id", None))
    llama = transformers.LlamaForCausalLM(hf_cfg)
    llama.load_state_dict(llama_state_dict(model), strict=True)
    if m.attention == "sparse":
        apply_fibattn(llama, window=m.window, base=config_base(m), schedule="custom", alphas=model.alphas(),
                      reach_len=m.seq_len if m.reach == "train" else None)
    llama.save_pretrained(out)
    if tokenizer is not None:
        if type(tokenizer).__name__ == "ByteTokenizer":
            _byte_tokenizer_fast(transformers).save_pretrained(out)
        else:
            fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer._tok, eos_token="<|endoftext|>")
            fast.save_pretrained(out)
    c = Checkpoint.open(ckpt)
    load = ["from fibattn.interop import hf_llama",
            "model = hf_llama.from_pretrained(\"PATH\")   # sparse attention from config.fibattn",
            "# transformers.AutoModelForCausalLM.from_pretrained(\"PATH\") loads the same weights, dense"]
    files = ("transformers' Llama folder (`fibattn export --format hf`): `config.json` (LlamaConfig with the sparse "
             "settings in `fibattn`), `model.safetensors`, `tokenizer.json` / `tokenizer_config.json` "
             "(AutoTokenizer), `fibattn_source.json` (the run, step and fibattn model config).")
    (out / "README.md").write_text(run_card(run_dir, model, cfg, c, load=load, files=files))
    source = {"run": cfg.name, "step": c.step, "fibattn_model": to_dict(m)}
    (out / "fibattn_source.json").write_text(json.dumps(source, indent=1) + "\n")
    return out
