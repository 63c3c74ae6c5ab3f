"""``fibattn export --format hf``: a Hugging Face ``transformers`` Llama folder of a fibattn model.

A FibLM is a Llama-architecture decoder (RMSNorm, SwiGLU, RoPE, grouped-query attention, tied or untied
embeddings), so its weights load into ``LlamaForCausalLM`` with three changes:

- names: ``embed`` -> ``model.embed_tokens``, ``blocks.i.attn`` -> ``model.layers.i.self_attn``,
  ``ffn.gate/up/down`` -> ``mlp.gate_proj/up_proj/down_proj``, the norms likewise;
- RoPE: fibattn rotates interleaved pairs ``(2j, 2j+1)``, transformers rotates halves
  ``(j, j + Dh/2)``; permuting the rows of every q and k head from ``[0, 2, 4, ..., 1, 3, 5, ...]``
  gives the same scores (``q·k`` is unchanged when both are permuted alike);
- the sparse attention: the settings go to ``config.fibattn`` (:mod:`fibattn.interop.hf_llama`), and
  the folder becomes transformers remote code: ``config.json`` names its own model type
  (``fibattn_llama``) and, through ``auto_map``, the two files of :mod:`fibattn.interop.hf_remote`,
  copied verbatim. ``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)`` loads it
  without fibattn (only the attended columns, in plain PyTorch, and a constant-memory cache that
  ``generate`` uses by default); without ``trust_remote_code`` transformers
  refuses the folder rather than load it dense. ``hf_llama.from_pretrained(OUT)`` loads it onto
  fibattn's op. A dense model is a plain Llama folder.

The tokenizer files are those of every export (:mod:`fibattn.data.autotokenizer`): ``AutoTokenizer``
encodes and decodes every input as fibattn's tokenizer does. Learned-alpha
models are refused: their attention interpolates between distances, which the drop-in does not.
"""
from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import torch

from ..checks import UsageError
from ..config import to_dict
from ..data.autotokenizer import hf_tokenizer_files
from ..model.llama_names import to_llama
from ..storage.checkpoint import Checkpoint
from ..storage.export import run_card
from ..storage.runs import find_checkpoint, load_run


REMOTE_DIR = Path(__file__).with_name("hf_remote")
REMOTE_FILES = ("configuration_fibattn_llama", "modeling_fibattn_llama")
REMOTE_TYPE = "fibattn_llama"
SPARSE_LOAD = [
    "from transformers import AutoModelForCausalLM, AutoTokenizer",
    "model = AutoModelForCausalLM.from_pretrained(\"PATH\", trust_remote_code=True)   # torch + transformers only",
    "tokenizer = AutoTokenizer.from_pretrained(\"PATH\", trust_remote_code=True)",
    "# the sparse attention is modeling_fibattn_llama.py (here); without trust_remote_code=True transformers refuses",
    "# the folder (model type fibattn_llama) rather than load it dense. It computes only the attended columns and",
    "# model.generate keeps a constant-memory cache (FibattnCache, in the folder). With fibattn installed, unpadded",
    "# forwards run on its fast op; or load the weights into transformers' own Llama on that op, without remote code:",
    "# from fibattn.interop import hf_llama; model = hf_llama.from_pretrained(\"PATH\")"]
DENSE_LOAD = [
    "from transformers import AutoModelForCausalLM, AutoTokenizer",
    "model = AutoModelForCausalLM.from_pretrained(\"PATH\")   # a plain Llama: this model's attention is dense",
    "tokenizer = AutoTokenizer.from_pretrained(\"PATH\")"]
_COMMON_FILES = ("`model.safetensors`, `tokenizer.json` / `tokenizer_config.json` (AutoTokenizer), "
                 "`fibattn_source.json` (the run, step and fibattn model config).")
SPARSE_FILES = ("transformers remote code (`fibattn export --format hf`): `config.json` (model type `fibattn_llama`, a "
                "LlamaConfig with the sparse settings in `fibattn`, `auto_map` naming the next two files), "
                "`configuration_fibattn_llama.py` and `modeling_fibattn_llama.py` (a LlamaForCausalLM whose attention "
                "computes only each layer's attended distances, and its constant-memory generation cache), " + _COMMON_FILES)
DENSE_FILES = "transformers' Llama folder (`fibattn export --format hf`): `config.json` (LlamaConfig), " + _COMMON_FILES


def _require():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("fibattn export --format hf needs transformers: pip install 'fibattn[hf]'") from exc
    return transformers


def llama_state_dict(model) -> dict[str, torch.Tensor]:
    """A FibLM's weights under ``LlamaForCausalLM`` names, q/k rows in transformers' RoPE order."""
    m = model.cfg
    return to_llama(model.state_dict(), heads=m.n_heads, kv_heads=m.n_kv_heads, head_dim=m.head_dim,
                    tied=m.tie_embeddings)


def export_hf(run_dir, out_dir, *, step="latest") -> Path:
    """Write ``out_dir`` as a transformers folder: remote code for a sparse model (settings in
    ``config.fibattn``), a plain Llama for a dense one."""
    _require()
    from ..files import check_creatable, give_usual_modes, make_parents
    out = check_creatable(out_dir, "the export folder (OUT)")
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"OUT {out} is not empty; --format hf writes a new folder (choose an empty or new one)")
    ckpt = find_checkpoint(run_dir, step)
    model, cfg, tokenizer = load_run(ckpt)
    m = cfg.model
    if m.attention == "sparse" and m.schedule == "learned":
        raise UsageError("--format hf: a learned-alpha model attends interpolated distances, which the transformers "
                         "drop-in does not; export it in fibattn's format (the default)")
    make_parents(out)                         # a new exports/ gets a .gitignore of "*"
    sparse = save_model(model, out, tokenizer)
    c = Checkpoint.open(ckpt)
    (out / "README.md").write_text(run_card(run_dir, model, cfg, c, load=SPARSE_LOAD if sparse else DENSE_LOAD,
                                            files=SPARSE_FILES if sparse else DENSE_FILES, library="transformers",
                                            tags=("llama", "custom_code") if sparse else ("llama",)))
    source = {"run": cfg.name, "step": c.step, "fibattn_model": to_dict(m)}
    (out / "fibattn_source.json").write_text(json.dumps(source, indent=1) + "\n")
    give_usual_modes(out)                     # save_pretrained leaves model.safetensors 0600
    return out


def save_model(model, out: Path, tokenizer=None) -> bool:
    """``model`` (a FibLM, static distances) as a transformers folder ``out`` (existing): remote code when sparse
    (returned True), a plain Llama when dense; its tokenizer files when given."""
    transformers = _require()
    from .hf_llama import apply_fibattn
    from ..model.attention import config_base
    m = model.cfg
    hf_cfg = transformers.LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.ffn_hidden, num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads, max_position_embeddings=m.max_seq_len,
        rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta, tie_word_embeddings=m.tie_embeddings, attention_bias=False,
        mlp_bias=False, attention_dropout=0.0, eos_token_id=getattr(tokenizer, "eos_id", None),
        bos_token_id=getattr(tokenizer, "bos_id", None), pad_token_id=None)   # fibattn's tokenizers add no BOS
    llama = transformers.LlamaForCausalLM(hf_cfg)
    llama.load_state_dict(llama_state_dict(model), strict=True)
    sparse = m.attention == "sparse"
    if sparse:
        apply_fibattn(llama, window=m.window, base=config_base(m), schedule="custom", alphas=model.alphas(),
                      reach_len=m.seq_len if m.reach == "train" else None)
    with _no_progress_bar(transformers):      # a bar over one shard file says nothing; the CLI says what it wrote
        llama.save_pretrained(out)
    if sparse:
        _as_remote_code(out)
    if tokenizer is not None:
        for name, data in hf_tokenizer_files(tokenizer).items():
            (out / name).write_bytes(data)
    return sparse


def _as_remote_code(out: Path) -> None:
    """Give the saved sparse model its own model type and the remote-code files that implement it."""
    for name in REMOTE_FILES:
        shutil.copyfile(REMOTE_DIR / f"{name}.py", out / f"{name}.py")
    path = out / "config.json"
    config = json.loads(path.read_text())
    config.update(model_type=REMOTE_TYPE, architectures=["FibattnLlamaForCausalLM"], auto_map={
        "AutoConfig": "configuration_fibattn_llama.FibattnLlamaConfig",
        "AutoModelForCausalLM": "modeling_fibattn_llama.FibattnLlamaForCausalLM"})
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def _no_progress_bar(transformers):
    """transformers' progress bars off for the block (as they were after)."""
    tl = transformers.utils.logging
    was = tl.is_progress_bar_enabled()
    tl.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            tl.enable_progress_bar()
