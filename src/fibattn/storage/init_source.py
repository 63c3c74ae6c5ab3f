"""``train --init-from SOURCE``: a trained model's weights as the starting point of a new run.

A sparse and a dense FibLM have the same parameters (attention only chooses which keys a query
reads; method.md §6), so any trained model of the same shape can start any schedule. SOURCE is

- a run folder (its newest verified checkpoint), ``RUN@STEP``, or a ``checkpoints/step-N`` folder;
- a fibattn export folder (``fibattn export``);
- a transformers Llama folder (``config.json`` + safetensors weights, one file or an index of
  shards): weights renamed to fibattn's, q/k rows taken from rotate-half RoPE to fibattn's pairs.

Everything is verified before a tensor is used: checksums, the source's own config (each key of a Llama
``config.json`` and shard index), and every tensor's full shape against that config, under the source's
names and layout (:mod:`.shapes`); pickled weights are refused.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as st_load

from ..files import read_json
from ..config import ConfigError
from ..model.llama_names import from_llama, llama_shapes
from . import checkpoint as ck
from .pretrained import WEIGHTS, ExportError, _model_config, is_export, read_meta, read_verified
from .runs import checkpoint_config, find_checkpoint, parse_step
from .shapes import check_shapes, expected_shapes

# the fields that fix a model's parameters (and what they compute); everything else may differ
ARCH_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "tie_embeddings",
             "rope_theta", "norm_eps")
LLAMA_TYPES = ("llama", "fibattn_llama")
_CREATED_OK = re.compile(r"^blocks\.\d+\.attn\.alphas\.theta$|^head\.weight$")   # new in the target model
_IGNORED_OK = re.compile(r"^blocks\.\d+\.attn\.alphas\.theta$")                   # the source's learned alphas
NUMBER = (int, float)
_KIND_WORDS = {int: "an integer", NUMBER: "a number", bool: "true or false", str: "a string", dict: "an object"}
# how messages name the source: the CLI flag on the command line, the config field elsewhere
_LABEL = contextvars.ContextVar("init_from_label", default="train.init_from")


@contextlib.contextmanager
def naming(label: str):
    """Errors about the source name it as ``label`` (``--init-from`` under ``fibattn train``)."""
    token = _LABEL.set(label)
    try:
        yield
    finally:
        _LABEL.reset(token)


def _who(spec) -> str:
    return f"{_LABEL.get()} {spec}"


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
        return Path(head).expanduser(), parse_step(tail, f"{_who(spec)}: the step after '@'")
    return path, "latest"


def absolute_spec(spec: str) -> str:
    """``spec`` with its folder made absolute (so the run's config works from any directory)."""
    path, step = _split(str(spec).strip())
    return str(path.absolute()) + ("" if step == "latest" else f"@{step}")


def open_source(spec, *, weights: bool = True) -> InitSource:
    """The weights ``spec`` names, verified; a ValueError naming the folder and what is wrong otherwise.
    ``weights=False`` reads only the architecture (``tensors`` stays empty)."""
    if not isinstance(spec, (str, Path)) or not str(spec).strip():
        raise ConfigError(f"{_LABEL.get()} must name a run, checkpoint, export or transformers folder, got {spec!r}")
    spec = str(spec).strip()
    path, step = _split(spec)
    if not path.exists():
        raise ConfigError(f"{_who(spec)}: {path} does not exist")
    if not path.is_dir():
        raise ConfigError(f"{_who(spec)}: {path} is not a folder (a run, checkpoint, export or "
                          f"transformers folder is expected)")
    if is_export(path):
        if step != "latest":
            raise ConfigError(f"{_who(spec)}: {path} is an export (one fixed step); drop '@{step}'")
        return _from_export(spec, path.resolve(), weights)
    llama = _foreign_config(spec, path)
    if llama is not None:
        if step != "latest":
            raise ConfigError(f"{_who(spec)}: {path} is a transformers folder; drop '@{step}'")
        return _from_transformers(spec, path.resolve(), llama, weights)
    if _is_run(path):
        return _from_run(spec, path.resolve(), step, weights)
    raise ConfigError(f"{_who(spec)}: {path} is neither a fibattn run, checkpoint or export folder nor "
                      f"a transformers Llama folder (config.json with model_type 'llama')")


def _is_run(path: Path) -> bool:
    return (path / ck.META).is_file() or ck.ckpt_root(path).is_dir()


def _arch(model) -> dict:
    return {k: getattr(model, k) for k in ARCH_KEYS}


def _model(arch: dict):
    """The (dense) ModelConfig of an architecture."""
    from ..config import ModelConfig
    return ModelConfig(**arch, attention="dense")


def _check_buildable(spec: str, described, model) -> None:
    """The source's own config describes a model fibattn can build (else nothing of it is loaded)."""
    from ..validation import validate_model
    try:
        validate_model(model if not isinstance(model, dict) else _model(model))
    except ConfigError as exc:
        raise ConfigError(f"{_who(spec)}: {described} describes a model fibattn cannot build ({exc})") from None


@contextlib.contextmanager
def _named(spec: str):
    """A checkpoint's or export's own error (it names the file) prefixed with the source as the user gave it."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as exc:               # CheckpointError, ExportError
        raise ConfigError(f"{_who(spec)}: {exc}") from None


def _from_run(spec: str, path: Path, step, weights: bool) -> InitSource:
    with _named(spec):
        folder = find_checkpoint(path, step)
        c = ck.Checkpoint.open(folder)
        cfg = checkpoint_config(c)
        tensors = c.tensors("model") if weights else {}
    described = f"its {ck.CONFIG} ({folder / ck.CONFIG})"
    _check_buildable(spec, described, cfg.model)
    check_shapes(tensors, expected_shapes(cfg.model), where=f"{_who(spec)}: {folder / ck.MODEL}", described=described,
                 error=ConfigError)
    return InitSource(spec, "run", folder, c.step, c.meta["files"][ck.MODEL]["sha256"], _arch(cfg.model), tensors)


def _from_export(spec: str, path: Path, weights: bool) -> InitSource:
    with _named(spec):
        meta = read_meta(path)
        model = _model_config(meta, path)
        data = read_verified(path, WEIGHTS, meta) if weights else None
        try:
            tensors = st_load(data) if weights else {}
        except Exception as exc:            # safetensors refuses anything that is not safetensors
            raise ExportError(f"{path}: file {WEIGHTS} is not a valid safetensors file ({exc})") from None
    described = f"its config.json ({path / 'config.json'})"
    _check_buildable(spec, described, model)
    check_shapes(tensors, expected_shapes(model), where=f"{_who(spec)}: {path / WEIGHTS}", described=described,
                 error=ConfigError)
    step = (meta.get("source") or {}).get("step")
    return InitSource(spec, "export", path, step if isinstance(step, int) and not isinstance(step, bool) else None,
                      meta["files"][WEIGHTS]["sha256"], _arch(model), tensors)


# ------------------------------------------------------------------------------ transformers Llama
def _foreign_config(spec: str, path: Path) -> dict | None:
    """A transformers Llama folder's ``config.json``; None when the folder has none, or it is a run's own.
    A config.json of a folder that is not a run and not a Llama is refused naming what is wrong with it."""
    cfg = path / "config.json"
    if not cfg.is_file() or _is_run(path):
        return None
    try:
        doc = read_json(cfg)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{_who(spec)}: {cfg} is not valid JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{_who(spec)}: {cfg} must hold a JSON object, got {type(doc).__name__}")
    if "model_type" in doc and doc["model_type"] not in LLAMA_TYPES:
        raise ConfigError(f"{_who(spec)}: {cfg} key 'model_type' is {doc['model_type']!r}; only a transformers Llama "
                          f"({', '.join(LLAMA_TYPES)}) or a fibattn run, checkpoint or export can start a run")
    return doc if "model_type" in doc else None


def _llama_arch(spec: str, cfg: Path, doc: dict) -> dict:
    """The FibLM architecture a Llama ``config.json`` describes; each key's type and range checked, a
    ConfigError naming the file and key otherwise."""
    def bad(key: str, what: str):
        raise ConfigError(f"{_who(spec)}: {cfg} key {key!r} {what}")

    def get(key: str, kind, default, *, positive=True, null_ok=False):
        if key not in doc or (doc[key] is None and null_ok):
            if default is None and not null_ok:
                bad(key, f"is missing ({_KIND_WORDS[kind]} > 0 is required)")
            return default
        v = doc[key]
        ok = (isinstance(v, bool) if kind is bool else not isinstance(v, bool) and isinstance(v, kind)
              and (not isinstance(v, float) or math.isfinite(v)) and (not positive or v > 0))
        if not ok:
            bad(key, f"must be {_KIND_WORDS[kind]}{' > 0' if positive and kind is not bool else ''}, got {v!r}")
        return v

    if get("hidden_act", str, "silu", positive=False) != "silu":
        bad("hidden_act", f"is {doc['hidden_act']!r}; a FibLM has SwiGLU ('silu') only")
    for flag in ("attention_bias", "mlp_bias"):
        if get(flag, bool, False):
            bad(flag, "is true; a FibLM has no biases")
    d, heads = get("hidden_size", int, None), get("num_attention_heads", int, None)
    kv = get("num_key_value_heads", int, heads, null_ok=True) or heads
    if d % heads or (d // heads) % 2:
        bad("hidden_size", f"{d} / num_attention_heads {heads} must be a whole, even head size (RoPE pairs)")
    if heads % kv:
        bad("num_key_value_heads", f"{kv} must divide num_attention_heads {heads}")
    if get("head_dim", int, None, null_ok=True) not in (None, d // heads):
        bad("head_dim", f"{doc['head_dim']} differs from hidden_size / num_attention_heads = {d // heads}")
    rope = {}
    for key in ("rope_parameters", "rope_scaling"):
        if doc.get(key) is not None:
            rope = get(key, dict, None, positive=False)
            break
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        bad("rope_scaling", f"uses RoPE scaling {kind!r}; a FibLM has unscaled RoPE only")
    theta = rope["rope_theta"] if "rope_theta" in rope else get("rope_theta", NUMBER, 1e4)
    if isinstance(theta, bool) or not isinstance(theta, NUMBER) or not 0 < theta < math.inf:
        bad("rope_parameters", f"rope_theta must be a number > 0, got {theta!r}")
    return {"vocab_size": get("vocab_size", int, None), "d_model": d, "n_layers": get("num_hidden_layers", int, None),
            "n_heads": heads, "n_kv_heads": kv, "ffn_dim": get("intermediate_size", int, None),
            "tie_embeddings": get("tie_word_embeddings", bool, False), "rope_theta": float(theta),
            "norm_eps": float(get("rms_norm_eps", NUMBER, 1e-6))}


def _weight_files(spec: str, path: Path) -> dict[str, Path] | list[Path]:
    """The safetensors files of a Llama folder: ``[model.safetensors]``, or the shards its index names
    (tensor name -> shard file), each entry of the index checked."""
    index = path / "model.safetensors.index.json"
    if (path / WEIGHTS).is_file():
        return [path / WEIGHTS]
    if index.is_file():
        def bad(what: str):
            raise ConfigError(f"{_who(spec)}: {index} {what}")
        try:
            doc = read_json(index)
        except (OSError, ValueError) as exc:
            bad(f"is not valid JSON ({str(exc).splitlines()[0]})")
        if not isinstance(doc, dict):
            bad(f"must hold a JSON object, got {type(doc).__name__}")
        wmap = doc.get("weight_map")
        if not isinstance(wmap, dict) or not wmap:
            bad(f"key 'weight_map' must be a non-empty object of tensor name -> shard file, got {wmap!r:.60}")
        for name, shard in wmap.items():
            if not isinstance(shard, str) or Path(shard).name != shard or not (path / shard).is_file():
                bad(f"key 'weight_map' maps {name!r} to {shard!r:.60}, which is not a file of the folder")
        return {name: path / shard for name, shard in wmap.items()}
    pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
    hint = f" ({pickled[0]} is a pickle, which fibattn never loads: save the model with safetensors)" if pickled else ""
    raise ConfigError(f"{_who(spec)}: no {WEIGHTS} or model.safetensors.index.json in {path}{hint}")


def _from_transformers(spec: str, path: Path, doc: dict, weights: bool) -> InitSource:
    cfg = path / "config.json"
    arch = _llama_arch(spec, cfg, doc)
    _check_buildable(spec, cfg, arch)
    files = _weight_files(spec, path)
    if not weights:
        return InitSource(spec, "transformers", path, None, "", arch)
    shards = sorted(set(files.values() if isinstance(files, dict) else files))
    tensors, digests, file_of = {}, [], {}
    for f in shards:
        data = f.read_bytes()
        digests.append(f"{f.name}:{hashlib.sha256(data).hexdigest()}")
        try:
            part = st_load(data)
        except Exception as exc:            # safetensors refuses anything that is not safetensors
            raise ConfigError(f"{_who(spec)}: {f} is not a valid safetensors file ({exc})") from None
        if isinstance(files, dict):         # a shard's tensors are the ones the index places there
            stray = [k for k in part if files.get(k) != f]
            lost = [k for k, v in files.items() if v == f and k not in part]
            if stray or lost:
                raise ConfigError(f"{_who(spec)}: {f} " + (f"holds {stray[0]}, which its index places elsewhere"
                                  if stray else f"lacks {lost[0]}, which its index places there"))
        tensors.update(part)
        file_of.update(dict.fromkeys(part, f))
    # the Llama layout's own shapes, before from_llama reorders q/k rows (a reshape)
    check_shapes(tensors, llama_shapes(expected_shapes(_model(arch))), where=lambda k: f"{_who(spec)}: {file_of[k]}",
                 described=f"{cfg}", error=ConfigError)
    sha = digests[0].split(":", 1)[1] if len(digests) == 1 else hashlib.sha256("\n".join(digests).encode()).hexdigest()
    return InitSource(spec, "transformers", path, None, sha, arch, _llama_to_fib(tensors, arch))


def _llama_to_fib(tensors: dict, arch: dict) -> dict:
    return from_llama(tensors, heads=arch["n_heads"], kv_heads=arch["n_kv_heads"],
                      head_dim=arch["d_model"] // arch["n_heads"], tied=arch["tie_embeddings"])


def check_resumable(spec: str, resume: str, out: Path, saved_from: str | None) -> None:
    """A run that will resume (``resume``: a checkpoint folder, or ``auto`` with checkpoints in ``out``) keeps
    the checkpoint's weights, so a source is only accepted when it is the one that run started from
    (``saved_from``, from its config.json): anything else would apply the fine-tuning recipe without the
    weights and record the wrong origin."""
    if resume not in ("auto", "never"):
        raise ConfigError(f"{_who(spec)}: cannot be combined with --resume {resume} (resume): resuming continues that "
                          f"checkpoint's own weights, so the source would not be loaded; start from the source in a "
                          f"new --out, or resume without it")
    if not saved_from or absolute_spec(saved_from) != absolute_spec(spec):
        origin = "an unreadable config.json" if saved_from is None else saved_from or "scratch (no init_from)"
        raise ConfigError(f"{_who(spec)}: {out} already holds checkpoints of a run that started from {origin}; "
                          f"resuming it would keep its weights, not load this source: choose a new --out "
                          f"(train.out_dir), or continue that run with the source it started from")


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
        raise ConfigError(f"{_who(source.spec)}: {source.path} does not fit the model to train: "
                          f"{'; '.join(problems)}. The source has "
                          f"{', '.join(f'model.{k}={v}' for k, v in source.architecture.items())}: set (or stop "
                          f"setting) the model.* values that differ")
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
