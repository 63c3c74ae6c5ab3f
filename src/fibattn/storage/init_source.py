"""``train --init-from SOURCE``: a trained model's weights as the starting point of a new run.

A sparse and a dense FibLM have the same parameters (attention only chooses which keys a query
reads; method.md §6), so any trained model of the same shape can start any schedule. SOURCE is

- a run folder (its newest verified checkpoint), ``RUN@STEP``, or a ``checkpoints/step-N`` folder;
- a fibattn export folder (``fibattn export``);
- a transformers Llama folder (``config.json`` + safetensors weights, one file or an index of
  shards): weights renamed to fibattn's, q/k rows taken from rotate-half RoPE to fibattn's pairs.

Everything is verified (checksums, shapes) before a tensor is used; pickled weights are refused.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as st_load

from ..config import ConfigError
from ..model.llama_names import from_llama
from . import checkpoint as ck
from .pretrained import WEIGHTS, is_export, read_meta, read_verified
from .runs import checkpoint_config, find_checkpoint, parse_step

# the fields that fix a model's parameters (and what they compute); everything else may differ
ARCH_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "tie_embeddings",
             "rope_theta", "norm_eps")
LLAMA_TYPES = ("llama", "fibattn_llama")
_CREATED_OK = re.compile(r"^blocks\.\d+\.attn\.alphas\.theta$|^head\.weight$")   # new in the target model
_IGNORED_OK = re.compile(r"^blocks\.\d+\.attn\.alphas\.theta$")                   # the source's learned alphas


@dataclass
class InitSource:
    """Verified weights under FibLM names, and where they came from."""

    spec: str                       # as the user wrote it
    kind: str                       # run | export | transformers
    path: Path                      # the folder read (a checkpoint folder for runs)
    step: int | None                # the source's training step, when it records one
    sha256: str                     # of the weights (for shards: of their hashes)
    architecture: dict              # ModelConfig fields (ARCH_KEYS)
    tensors: dict = field(repr=False, default_factory=dict)

    def label(self) -> str:
        return f"{self.path}" + (f" (step {self.step})" if self.step is not None else "")

    def record(self) -> dict:
        """What a run's config keeps of its source."""
        return {"path": str(self.path), "kind": self.kind, "step": self.step, "sha256": self.sha256}


def _split(spec: str) -> tuple[Path, object]:
    """``RUN@STEP`` -> (RUN, step); a path that exists as written keeps its '@'."""
    path = Path(spec).expanduser()
    if "@" in spec and not path.exists():
        head, tail = spec.rsplit("@", 1)
        return Path(head).expanduser(), parse_step(tail, f"--init-from {spec}: the step after '@'")
    return path, "latest"


def absolute_spec(spec: str) -> str:
    """``spec`` with its folder made absolute (so the run's config works from any directory)."""
    path, step = _split(str(spec).strip())
    return str(path.absolute()) + ("" if step == "latest" else f"@{step}")


def open_source(spec, *, weights: bool = True) -> InitSource:
    """The weights ``spec`` names, verified; a ValueError naming the folder and what is wrong otherwise.
    ``weights=False`` reads only the architecture (``tensors`` stays empty)."""
    if not isinstance(spec, (str, Path)) or not str(spec).strip():
        raise ConfigError(f"train.init_from must name a run, checkpoint, export or transformers folder, got {spec!r}")
    spec = str(spec).strip()
    path, step = _split(spec)
    if not path.exists():
        raise ConfigError(f"train.init_from {spec}: {path} does not exist")
    if not path.is_dir():
        raise ConfigError(f"train.init_from {spec}: {path} is not a folder (a run, checkpoint, export or "
                          f"transformers folder is expected)")
    if is_export(path):
        if step != "latest":
            raise ConfigError(f"train.init_from {spec}: {path} is an export (one fixed step); drop '@{step}'")
        return _from_export(spec, path.resolve(), weights)
    llama = _llama_config(path)
    if llama is not None:
        if step != "latest":
            raise ConfigError(f"train.init_from {spec}: {path} is a transformers folder; drop '@{step}'")
        return _from_transformers(spec, path.resolve(), llama, weights)
    if (path / ck.META).is_file() or ck.ckpt_root(path).is_dir():
        return _from_run(spec, path.resolve(), step, weights)
    raise ConfigError(f"train.init_from {spec}: {path} is neither a fibattn run, checkpoint or export folder nor "
                      f"a transformers Llama folder (config.json with model_type 'llama')")


def _arch(model: dict) -> dict:
    from ..config import ModelConfig
    defaults = ModelConfig()
    return {k: model.get(k, getattr(defaults, k)) for k in ARCH_KEYS}


def _from_run(spec: str, path: Path, step, weights: bool) -> InitSource:
    folder = find_checkpoint(path, step)
    c = ck.Checkpoint.open(folder)
    cfg = checkpoint_config(c)
    from ..config import to_dict
    return InitSource(spec, "run", folder, c.step, c.meta["files"]["model.safetensors"]["sha256"],
                      _arch(to_dict(cfg.model)), c.tensors("model") if weights else {})


def _from_export(spec: str, path: Path, weights: bool) -> InitSource:
    meta = read_meta(path)
    data = read_verified(path, WEIGHTS, meta) if weights else None
    step = (meta.get("source") or {}).get("step")
    return InitSource(spec, "export", path, step if isinstance(step, int) else None, meta["files"][WEIGHTS]["sha256"],
                      _arch(meta["model"]), st_load(data) if weights else {})


# ------------------------------------------------------------------------------ transformers Llama
def _llama_config(path: Path) -> dict | None:
    cfg = path / "config.json"
    if not cfg.is_file():
        return None
    try:
        doc = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("model_type") in LLAMA_TYPES else None


def _llama_arch(spec: str, doc: dict) -> dict:
    def bad(what: str):
        raise ConfigError(f"train.init_from {spec}: config.json {what}; a FibLM cannot express it")
    if doc.get("hidden_act", "silu") != "silu":
        bad(f"hidden_act is {doc.get('hidden_act')!r} (only 'silu', SwiGLU)")
    for flag in ("attention_bias", "mlp_bias"):
        if doc.get(flag):
            bad(f"{flag} is true (FibLM has no biases)")
    heads, d = doc.get("num_attention_heads"), doc.get("hidden_size")
    if not all(isinstance(v, int) and v > 0 for v in (heads, d)) or d % heads:
        bad(f"hidden_size {d!r} / num_attention_heads {heads!r} is not a whole head size")
    if doc.get("head_dim") not in (None, d // heads):
        bad(f"head_dim {doc.get('head_dim')} differs from hidden_size / num_attention_heads = {d // heads}")
    rope = doc.get("rope_parameters") or doc.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        bad(f"uses RoPE scaling {rope.get('rope_type', rope.get('type'))!r} (only unscaled RoPE)")
    theta = rope.get("rope_theta", doc.get("rope_theta", 1e4))
    return {"vocab_size": doc.get("vocab_size"), "d_model": d, "n_layers": doc.get("num_hidden_layers"),
            "n_heads": heads, "n_kv_heads": doc.get("num_key_value_heads") or heads,
            "ffn_dim": doc.get("intermediate_size"), "tie_embeddings": bool(doc.get("tie_word_embeddings", False)),
            "rope_theta": float(theta), "norm_eps": float(doc.get("rms_norm_eps", 1e-6))}


def _weight_files(spec: str, path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if (path / WEIGHTS).is_file():
        return [path / WEIGHTS]
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"train.init_from {spec}: {index} is not a safetensors index ({exc})") from None
        bad = [n for n in names if Path(n).name != n or not (path / n).is_file()]
        if bad:
            raise ConfigError(f"train.init_from {spec}: {index} names shard {bad[0]!r}, which is not a file there")
        return [path / n for n in names]
    pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
    hint = f" ({pickled[0]} is a pickle, which fibattn never loads: save the model with safetensors)" if pickled else ""
    raise ConfigError(f"train.init_from {spec}: no {WEIGHTS} or model.safetensors.index.json in {path}{hint}")


def _from_transformers(spec: str, path: Path, doc: dict, weights: bool) -> InitSource:
    arch = _llama_arch(spec, doc)
    files = _weight_files(spec, path)
    if not weights:
        return InitSource(spec, "transformers", path, None, "", arch)
    tensors, digests = {}, []
    for f in files:
        data = f.read_bytes()
        digests.append(f"{f.name}:{hashlib.sha256(data).hexdigest()}")
        try:
            tensors.update(st_load(data))
        except Exception as exc:            # safetensors refuses anything that is not safetensors
            raise ConfigError(f"train.init_from {spec}: {f} is not a valid safetensors file ({exc})") from None
    sha = digests[0].split(":", 1)[1] if len(digests) == 1 else hashlib.sha256("\n".join(digests).encode()).hexdigest()
    return InitSource(spec, "transformers", path, None, sha, arch, _llama_to_fib(tensors, arch))


def _llama_to_fib(tensors: dict, arch: dict) -> dict:
    return from_llama(tensors, heads=arch["n_heads"], kv_heads=arch["n_kv_heads"],
                      head_dim=arch["d_model"] // arch["n_heads"], tied=arch["tie_embeddings"])


# ------------------------------------------------------------------------------ into a model
def _grouped(names) -> str:
    counts: dict[str, int] = {}
    for n in names:
        key = re.sub(r"^blocks\.\d+\.", "blocks.*.", n)
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} ×{v}" if v > 1 else k for k, v in counts.items()) or "none"


def plan(source: InitSource, shapes: dict) -> dict:
    """Which of the target's tensors (name -> shape) are loaded, created or ignored; a ConfigError naming
    every tensor whose shape differs or that only one side has (other than the learned alphas and an
    untied head, which start fresh: the head from the embedding)."""
    src = source.tensors
    wrong = [f"{k} {tuple(src[k].shape)} -> {tuple(s)}" for k, s in shapes.items() if k in src
             and tuple(src[k].shape) != tuple(s)]
    missing = [k for k in shapes if k not in src and not _CREATED_OK.match(k)]
    extra = [k for k in src if k not in shapes and not _IGNORED_OK.match(k)]
    problems = []
    if wrong:
        problems.append(f"shapes differ (source -> this model): {', '.join(wrong[:6])}"
                        + (f" and {len(wrong) - 6} more" if len(wrong) > 6 else ""))
    if missing:
        problems.append(f"this model has tensors the source lacks: {_grouped(missing)}")
    if extra:
        problems.append(f"the source has tensors this model lacks: {_grouped(extra)}")
    if problems:
        raise ConfigError(f"train.init_from {source.spec}: the source does not fit the model the config describes: "
                          f"{'; '.join(problems)}. Match the model.* settings to the source "
                          f"({', '.join(f'{k}={v}' for k, v in source.architecture.items())})")
    return {"loaded": [k for k in shapes if k in src], "created": [k for k in shapes if k not in src],
            "ignored": [k for k in src if k not in shapes]}


@torch.no_grad()
def load_into(model, source: InitSource) -> dict:
    """Copy the source's weights into ``model`` (a FibLM) in place; returns :func:`plan`'s lists.
    Created tensors keep their fresh values, except an untied head, which starts as the embedding."""
    state = model.state_dict()
    parts = plan(source, {k: v.shape for k, v in state.items()})
    for k in parts["loaded"]:
        state[k].copy_(source.tensors[k].to(state[k].dtype))
    if "head.weight" in parts["created"]:
        state["head.weight"].copy_(state["embed.weight"])
    return parts


def describe(source: InitSource, parts: dict) -> str:
    return (f"init-from {source.label()} [{source.kind}, sha256 {source.sha256[:12]}]: loaded "
            f"{len(parts['loaded'])} tensors; created {_grouped(parts['created'])}; ignored "
            f"{_grouped(parts['ignored'])}")
