"""Typed run configuration: one dataclass per concern, presets as functions, overrides.

``RunConfig`` = ``model`` + ``data`` + ``train`` (+ ``eval``). A preset returns a
``RunConfig``; ``apply_overrides(cfg, ["model.window=8", "train.lr=1e-3"])`` changes
fields with type checking; ``to_dict`` / ``from_dict`` round-trip through JSON (config files are read
by :mod:`fibattn.config_files`).
Every field a user can set is checked by :func:`fibattn.validation.validate` with an error that names it.
"""
from __future__ import annotations

import dataclasses
import json
import re
import typing
from dataclasses import dataclass, field
from typing import Any

from .checks import ConfigError, did_you_mean
from .effective import recorded
from .files import atomic_write_text

# Attention backends: implementations of the same ops (``fibattn.ops.backends`` chooses and runs them).
BACKENDS = ("reference", "torch", "cpu", "triton", "flex")
# train.activation_checkpointing: none keeps every block's activations; full recomputes each block in the backward.
ACTIVATION_CHECKPOINTING = ("none", "full")
# The output head's loss (fibattn.model.head_loss): plain logits, chunked rows, or liger-kernel's fused kernels.
LOSS_HEADS = ("plain", "chunked", "liger")
# An on/off setting whose default follows the device: true and false are also read from booleans and from the
# words --set takes for booleans (yes/no, on/off, 1/0), see switch_value.
SWITCH = ("auto", "true", "false")


def show_value(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# other words for a choice (the demo's run names fib_stagger / fib_hdc, the README's prose): refused with the
# choice they mean, so that one name stays in configs, records and exports
CHOICE_WORDS = {"model.schedule": {"stagger": "linear", "staggered": "linear", "hdc": "coprime"}}


def choice_hint(key: str, value) -> str:
    """`` ('stagger' is what ... : use linear)`` for another word of a choice of ``key``, else ``""``."""
    meant = CHOICE_WORDS.get(key, {}).get(value) if isinstance(value, str) else None
    return f" ({value!r} is what the run names call {key}={meant}: use {meant})" if meant else ""


def switch_value(value):
    """A :data:`SWITCH` setting's value from what users and older config files write: ``True`` / ``"on"`` /
    ``"yes"`` / ``"1"`` -> ``"true"``, their opposites -> ``"false"``; anything else is returned as given (and
    refused by validation, naming the allowed words)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        low = value.strip().lower()
        return {"1": "true", "yes": "true", "on": "true", "0": "false", "no": "false", "off": "false"}.get(low, low)
    return value


def setting(default=dataclasses.MISSING, help: str = "", *, choices: tuple = (), factory=None):
    """A config field with its one-line ``help`` and, for a closed set of values, its ``choices``: said once,
    here; ``fibattn config`` shows both and :mod:`fibattn.validation` checks the choices."""
    meta = {"help": help, "choices": tuple(choices)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def field_help(cls, name: str) -> tuple[str, tuple]:
    """``(help, choices)`` of field ``name`` of config class ``cls`` (``("", ())`` for a field without)."""
    meta = {f.name: f.metadata for f in dataclasses.fields(cls)}.get(name, {})
    return meta.get("help", ""), tuple(meta.get("choices", ()))


@dataclass
class ModelConfig:
    vocab_size: int = setting(32768, "vocabulary size (train --data sets it from the prepared folder)")
    d_model: int = setting(512, "width of the residual stream")
    n_layers: int = setting(16, "number of transformer blocks")
    n_heads: int = setting(8, "query heads per layer (d_model / n_heads must be even, for RoPE)")
    n_kv_heads: int = setting(2, "key/value heads (grouped-query attention; divides n_heads)")
    seq_len: int = setting(1024, "training length in tokens (also the default reach)")
    max_seq_len: int = setting(1 << 20, "longest sequence RoPE and positions accept")
    rope_theta: float = setting(1e4, "RoPE base frequency")
    norm_eps: float = setting(1e-5, "RMSNorm epsilon")
    attention: str = setting("sparse", "dense: every earlier token; sparse: the Fibonacci attended set (method.md §1)",
                             choices=("dense", "sparse"))
    base: str = setting("fib", "distances beyond the window: none is the window alone (a sliding-window control)",
                        choices=("fib", "pow2", "custom", "none"))
    base_k: int = setting(15, "number of Fibonacci rungs (base=fib)")
    base_values: list = setting(factory=list, help="the distances of a custom base (base=custom)")
    window: int = setting(12, "every distance 1..window is attended (method.md §1)")
    schedule: str = setting("linear", "alpha across depth (method.md §2)",
                            choices=("fixed", "linear", "coprime", "learned", "custom"))
    alpha: float = setting(1.0, "alpha of a fixed schedule; the start of a learned one when learned_init=fixed")
    a_min: float = setting(0.5, "smallest alpha a schedule uses (first layer of linear)")
    a_max: float = setting(1.5, "largest alpha a schedule uses (last layer of linear)")
    alphas: list = setting(factory=list, help="one alpha per layer (schedule=custom)")
    learned_init: str = setting("fixed", "start of a learned schedule (method.md §3)",
                                choices=("fixed", "linear", "coprime"))
    reach: str = setting("study", "study: rebuild distances at the eval length; train: cap them at seq_len",
                         choices=("study", "train"))
    backend: str = setting("auto", "attention backend (auto: the fastest that runs here)", choices=("auto",) + BACKENDS)
    init_std: float = setting(0.02, "standard deviation of the initial weights")
    ffn_dim: int = setting(0, "SwiGLU hidden size; 0: 2 * round(d_model * 8 / 3 / 2)")
    tie_embeddings: bool = setting(True, "the output head is the token embedding (false: a head of its own)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        return self.ffn_dim or 2 * round(self.d_model * 8 / 3 / 2)


@dataclass
class SourceConfig:
    name: str = setting("shakespeare", "the source's name (its validation split is named after it)")
    kind: str = setting("bundled", "bundled: the packaged corpus; files: a local file or folder; hf: a Hugging Face "
                        "dataset", choices=("bundled", "files", "hf"))
    path: str = setting("", "files: a text/.jsonl/.parquet file or a folder; hf: a dataset id or local folder")
    subset: str = setting("", "hf config name (e.g. sample-10BT)")
    split: str = setting("train", "hf split to read")
    text_field: str = setting("text", "the text column of .jsonl/.parquet rows and hf datasets")
    weight: float = setting(1.0, "share of training batches drawn from this source, relative to the others")
    max_docs: int = setting(0, "read at most this many documents (0: all)")
    include: list = setting(factory=list, help="files: glob patterns a folder's files must match (empty: every file)")
    exclude: list = setting(factory=list, help="files: glob patterns of a folder's files to leave out")


@dataclass
class DataConfig:
    out_dir: str = setting("data/shakespeare-byte", "the prepared folder")
    sources: list = setting(factory=lambda: [SourceConfig()], help="the document sources (each field: "
                            "--set data.sources[i].FIELD=...)")
    tokenizer: str = setting("byte", "byte | bpe (trained on the data) | the path of a tokenizer.json to reuse")
    vocab_size: int = setting(256, "vocabulary of a bpe tokenizer (tokenizer=bpe only)")
    val_fraction: float = setting(0.01, "held-out share of each source (deterministic)")
    val_tokens_max: int = setting(1 << 21, "at most this many validation tokens per source")
    shard_tokens: int = setting(1 << 26, "tokens per shard file")


@dataclass
class TrainConfig:
    out_dir: str = setting("runs/run", "the run folder (checkpoints, metrics, config.json)")
    steps: int = setting(13000, "optimiser steps")
    batch_tokens: int = setting(32768, "global tokens per optimiser step (a multiple of micro_batch * seq_len)")
    micro_batch: int = setting(0, "sequences per forward on each rank; 0 (auto): on CUDA the largest that fits "
                               "(one trial step each), 8 elsewhere")
    lr: float = setting(3e-4, "peak learning rate (cosine decay after the warm-up)")
    min_lr_ratio: float = setting(0.1, "final learning rate as a fraction of lr")
    warmup_steps: int = setting(300, "linear warm-up steps (cut to steps when a preset's is longer than the run)")
    weight_decay: float = setting(0.1, "AdamW weight decay")
    beta1: float = setting(0.9, "AdamW beta1")
    beta2: float = setting(0.95, "AdamW beta2")
    grad_clip: float = setting(1.0, "gradient-norm clip (0: none)")
    precision: str = setting("auto", "auto: bf16 on CUDA, fp32 on CPU", choices=("auto", "fp32", "bf16"))
    compile: str = setting("auto", "torch.compile the model, fullgraph (auto: on for CUDA, off for CPU)",
                           choices=SWITCH)
    loss_head: str = setting("auto", "the head's loss: plain (whole logits), chunked (never all logits), liger "
                             "(liger-kernel, CUDA); auto: chunked on CUDA, plain on CPU",
                             choices=("auto",) + LOSS_HEADS)
    activation_checkpointing: str = setting("none", "none keeps every block's activations; full recomputes each "
                                            "block in the backward (less memory)", choices=ACTIVATION_CHECKPOINTING)
    seed: int = setting(42, "random seed (weights, data order)")
    device: str = setting("auto", "auto | cpu | cuda | cuda:N")
    log_every: int = setting(10, "steps between log lines")
    eval_every: int = setting(0, "steps between validation evaluations (0: only at the end)")
    eval_tokens: int = setting(1 << 16, "validation tokens scored per source at each evaluation")
    ckpt_every: int = setting(1000, "steps between checkpoints")
    keep_ckpts: int = setting(2, "checkpoints kept (older ones are deleted)")
    max_bad_steps: int = setting(5, "consecutive non-finite steps before aborting")
    threads: int = setting(0, "CPU threads (0: torch default)")
    tensorboard: bool = setting(False, "write TensorBoard event files")
    wandb: bool = setting(False, "log to Weights & Biases")
    wandb_project: str = setting("fibattn", "Weights & Biases project")
    results_db: str = setting("", "SQLite results DB: empty = <parent of out_dir>/results.sqlite, off = none")
    init_from: str = setting("", "start from trained weights: a run (RUN@STEP), checkpoint, export or Llama folder")
    init_source: dict = setting(factory=dict, help="recorded at the start: path, kind, step, sha256 of init_from")
    document_masking: bool = setting(False, "attend inside each document of a packed row (its <eos> ends it; "
                                     "method.md §8)")
    context_parallel: int = setting(1, "ranks sharing one sequence, each a contiguous chunk (method.md §9)")


@dataclass
class EvalConfig:
    lengths: list = setting(factory=lambda: [1024, 2048, 4096], help="evaluation lengths in tokens")
    tokens: int = setting(1 << 20, "tokens scored per source and length")
    datasets: list = setting(factory=list, help="validation splits to score (empty: every one)")
    batch_size: int = setting(4, "sequences per forward")
    reach: str = setting("study", "study: rebuild distances at the eval length; train: cap them at the training "
                         "length", choices=("study", "train"))
    sparse_lengths: list = setting(factory=list, help="more lengths for sparse models only (dense would not fit)")
    dense_modes: list = setting(factory=list, help="dense baselines of the same trained model, each at every "
                                "eval.lengths (method.md §7)", choices=("linear", "ntk", "yarn", "window"))
    document_masking: bool = setting(False, "score each document on its own within a window (recorded in the mode "
                                     "name)")


@dataclass
class RunConfig:
    name: str = setting("run", "the run's name (train --out names it after the folder)")
    model: ModelConfig = setting(factory=ModelConfig, help="the model")
    data: DataConfig = setting(factory=DataConfig, help="the data")
    train: TrainConfig = setting(factory=TrainConfig, help="training")
    eval: EvalConfig = setting(factory=EvalConfig, help="evaluation")


# ------------------------------------------------------------------------- (de)serialise
def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _build(cls, data: dict, where: str):
    if isinstance(data, SourceConfig) and cls is SourceConfig:
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping, got {type(data).__name__}"
                          + (f" {show_value(data)}" if not isinstance(data, (list, tuple)) else ""))
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown config key {where + '.' if where else ''}{unknown[0]}"
                          f"{_suggest(unknown[0], known, where)}")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        path = f"{where}.{name}" if where else name
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, path)
        elif name == "sources":
            if not isinstance(value, list):
                raise ConfigError(f"{path} must be a list of source mappings, got {show_value(value)}")
            kwargs[name] = [_build(SourceConfig, v, f"{path}[{i}]") for i, v in enumerate(value)]
        else:
            kwargs[name] = value
    return cls(**kwargs)


def with_defaults(doc: dict) -> dict:
    """A saved config document with the keys added since it was written set to their defaults, so that a
    run made by an older fibattn compares equal to the same settings today."""
    out = dict(doc)
    train = out.get("train")
    if isinstance(train, dict) and isinstance(train.get("compile"), bool):     # older runs' files hold a boolean
        out["train"] = {**train, "compile": switch_value(train["compile"])}
    for section, defaults in to_dict(RunConfig()).items():
        if isinstance(defaults, dict) and isinstance(doc.get(section), dict):
            out[section] = {**{k: v for k, v in defaults.items() if k not in doc[section]}, **doc[section]}
    sources = out.get("data", {}).get("sources") if isinstance(out.get("data"), dict) else None
    if isinstance(sources, list):                   # source keys added since (include, exclude), at defaults
        blank = dataclasses.asdict(SourceConfig())
        out["data"] = {**out["data"], "sources": [{**blank, **s} if isinstance(s, dict) else s for s in sources]}
    return out


def from_dict(data: dict) -> RunConfig:
    return _build(RunConfig, data, "")


def save(cfg: RunConfig, path) -> None:
    """Write ``cfg`` as a config file (a run's ``config.json``), atomically: only the settings that act
    (:func:`fibattn.effective.recorded`; loading gives the others their defaults, which do not act either)."""
    atomic_write_text(path, json.dumps(recorded(cfg), indent=2, sort_keys=True) + "\n")


def all_keys(cls=None, prefix: str = "") -> list[str]:
    """Every settable key (``model.window``, ...), sections walked, in declaration order."""
    out, hints = [], typing.get_type_hints(cls or RunConfig)
    for f in dataclasses.fields(cls or RunConfig):
        hint = hints[f.name]
        out += all_keys(hint, f"{prefix}{f.name}.") if dataclasses.is_dataclass(hint) else [prefix + f.name]
    return out


def _suggest(name: str, names, section: str) -> str:
    """The closest key to a misspelt ``name`` of ``section`` (its own fields first, then every key, so that
    ``train.window`` finds ``model.window``); the section's keys listed only when nothing is close."""
    import difflib
    leaves = {}
    for key in reversed(all_keys()):                # leaf name -> its first key
        leaves[key.rsplit(".", 1)[-1]] = key
    own = difflib.get_close_matches(name, sorted(names), n=1)       # the full key, to paste back
    close = did_you_mean(leaves[name], [leaves[name]]) if name in leaves else (
        f"; did you mean {(f'{section}.' if section else '') + own[0]!r}?" if own else "")
    if not close:                                   # misspelt, and in the wrong section (or none)
        near = difflib.get_close_matches(name, sorted(leaves), n=1)
        close = did_you_mean(leaves[near[0]], [leaves[near[0]]]) if near else ""
    if close:
        return f"{close} (`fibattn config` lists every key with its help)"
    return f" ({section or 'config'} has: {', '.join(sorted(names))})"


# ----------------------------------------------------------------------------- overrides
SOURCES_EXAMPLE = ("""--set 'data.sources=[{"name":"mine","kind":"files","path":"mytext/"}]' """
                   """--set data.out_dir=data/mine (a text, .jsonl or .parquet file, or a folder)""")

_KIND_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list"}


def _parse_value(text: str, kind: type, key: str):
    """``text`` as the field's declared type ``kind`` (bool, int, float, list or str)."""
    try:
        if kind is bool:
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ConfigError(key)            # caught below: one message for every kind
        if kind is int:
            return int(float(text)) if "e" in text.lower() and float(text).is_integer() else int(text)
        if kind is float:
            return float(text)
        if kind is list:
            value = json.loads(text) if text.strip().startswith("[") else [
                json.loads(x) if x.strip() and x.strip()[0] in "-0123456789" else x.strip()
                for x in text.split(",") if x.strip()]
            return value
        return text
    except (ValueError, json.JSONDecodeError, RecursionError, OverflowError):
        raise ConfigError(f"{key} expects {_KIND_WORDS.get(kind, kind.__name__)}, got {text!r}") from None


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply ``section.field=value`` strings in place (values parsed by the field's type)."""
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override must look like section.field=value, got {item!r}")
        key, text = item.split("=", 1)
        key = key.strip()
        target: Any = cfg
        parts = key.split(".")
        for i, part in enumerate(parts):
            names = {f.name for f in dataclasses.fields(target)} if dataclasses.is_dataclass(target) else set()
            entry = re.fullmatch(r"(\w+)\[(\d+)\]", part)
            if entry and entry.group(1) == "sources" and "sources" in names and i < len(parts) - 1:
                items, j = getattr(target, "sources"), int(entry.group(2))     # one source's field
                if j >= len(items):
                    raise ConfigError(f"{key}: data.sources has {len(items)} entries (indices 0..{len(items) - 1}), "
                                      f"got [{j}]; set the list whole to add one: {SOURCES_EXAMPLE}")
                target = items[j]
                continue
            if part not in names:
                where = ".".join(parts[:i]) or "config"
                if not dataclasses.is_dataclass(target):
                    raise ConfigError(f"{where} is a value, not a section: set it whole, e.g. "
                                      f"{SOURCES_EXAMPLE if where == 'data.sources' else where + '=...'}")
                hint = f"; your own text: {SOURCES_EXAMPLE}" if where == "data" else ""
                raise ConfigError(f"unknown config key {key!r}{_suggest(part, names, '.'.join(parts[:i]))}{hint}")
            if i == len(parts) - 1:
                current = getattr(target, part)
                if dataclasses.is_dataclass(current):
                    raise ConfigError(f"{key} is a section; set one of its fields, e.g. {key}.<field>=...")
                kind = typing.get_type_hints(type(target)).get(part, type(current))
                value = _parse_value(text, kind, key)
                allowed = field_help(type(target), part)[1]
                if kind is str and allowed:                       # a closed set: refused here, naming it
                    value = switch_value(value) if allowed == SWITCH else value
                    if value not in allowed:
                        raise ConfigError(f"{key} must be one of {', '.join(allowed)}, got {text!r}"
                                          f"{choice_hint(key, value)}")
                if part == "sources":
                    if not all(isinstance(v, dict) for v in value):
                        raise ConfigError(f"{key} must be a JSON list of source mappings, got {text!r}; e.g. "
                                          f"{SOURCES_EXAMPLE}")
                    value = [_build(SourceConfig, v, f"{key}[{j}]") for j, v in enumerate(value)]
                setattr(target, part, value)
            else:
                target = getattr(target, part)
    return cfg
