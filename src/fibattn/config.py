"""Typed run configuration: one dataclass per concern, presets as functions, overrides.

``RunConfig`` = ``model`` + ``data`` + ``train`` (+ ``eval``). A preset returns a
``RunConfig``; ``apply_overrides(cfg, ["model.window=8", "train.lr=1e-3"])`` changes
fields with type checking; ``to_dict`` / ``from_dict`` round-trip through JSON.
Every field a user can set is checked by :func:`fibattn.validation.validate` with an error that names it.
"""
from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any

from .checks import ConfigError, did_you_mean

# Attention backends: implementations of the same ops (``fibattn.ops.backends`` chooses and runs them).
BACKENDS = ("reference", "torch", "cpu", "triton", "flex")
# train.activation_checkpointing: none keeps every block's activations; full recomputes each block in the backward.
ACTIVATION_CHECKPOINTING = ("none", "full")


def show_value(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass
class ModelConfig:
    vocab_size: int = 32768
    d_model: int = 512
    n_layers: int = 16
    n_heads: int = 8
    n_kv_heads: int = 2
    seq_len: int = 1024            # training length (also the default `reach`)
    max_seq_len: int = 1 << 20     # longest sequence RoPE/positions accept
    rope_theta: float = 1e4
    norm_eps: float = 1e-5
    attention: str = "sparse"      # dense | sparse
    base: str = "fib"              # fib | pow2 | custom
    base_k: int = 15               # number of Fibonacci rungs
    base_values: list = field(default_factory=list)  # custom base
    window: int = 12
    schedule: str = "linear"       # fixed | linear | coprime | learned | custom
    alpha: float = 1.0             # fixed value; learned start when learned_init == "fixed"
    a_min: float = 0.5
    a_max: float = 1.5
    alphas: list = field(default_factory=list)      # custom schedule
    learned_init: str = "fixed"    # start of a learned schedule: fixed | linear | coprime
    reach: str = "study"           # study (rebuild distances at eval length) | train (cap at seq_len)
    backend: str = "auto"          # attention backend
    init_std: float = 0.02
    ffn_dim: int = 0               # SwiGLU hidden size; 0: 2 * round(d_model * 8 / 3 / 2)
    tie_embeddings: bool = True    # the output head is the token embedding (False: a head of its own)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        return self.ffn_dim or 2 * round(self.d_model * 8 / 3 / 2)


@dataclass
class SourceConfig:
    name: str = "shakespeare"      # validation split is named after it
    kind: str = "bundled"          # bundled | files | hf
    path: str = ""                 # files: a file or folder (.txt/.jsonl/.parquet); hf: dataset id
    subset: str = ""               # hf config name (e.g. sample-10BT)
    split: str = "train"
    text_field: str = "text"
    weight: float = 1.0
    max_docs: int = 0              # 0: all


@dataclass
class DataConfig:
    out_dir: str = "data/shakespeare-byte"
    sources: list = field(default_factory=lambda: [SourceConfig()])
    tokenizer: str = "byte"        # byte | bpe
    vocab_size: int = 256          # bpe only
    val_fraction: float = 0.01     # held-out share of each source (deterministic)
    val_tokens_max: int = 1 << 21
    shard_tokens: int = 1 << 26


@dataclass
class TrainConfig:
    out_dir: str = "runs/run"
    steps: int = 13000
    batch_tokens: int = 32768      # global tokens per optimiser step
    micro_batch: int = 8           # sequences per forward on each rank
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 300
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    precision: str = "auto"        # auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16
    compile: bool = False
    activation_checkpointing: str = "none"   # none | full (recompute each block in the backward: less memory)
    seed: int = 42
    device: str = "auto"           # auto | cpu | cuda | cuda:N
    log_every: int = 10
    eval_every: int = 0            # 0: only at the end
    eval_tokens: int = 1 << 16
    ckpt_every: int = 1000
    keep_ckpts: int = 2
    max_bad_steps: int = 5         # consecutive non-finite steps before aborting
    threads: int = 0               # CPU threads (0: torch default)
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "fibattn"
    results_db: str = ""           # SQLite results DB: "" = <parent of out_dir>/results.sqlite, "off" = none
    init_from: str = ""            # start from trained weights: a run (RUN@STEP), checkpoint, export or Llama folder
    init_source: dict = field(default_factory=dict)   # recorded at the start: path, kind, step, sha256 of init_from
    document_masking: bool = False   # attend inside each document of a packed row (its <eos> ends it; method.md §8)
    context_parallel: int = 1      # ranks sharing one sequence, each a contiguous chunk (method.md §9)


@dataclass
class EvalConfig:
    lengths: list = field(default_factory=lambda: [1024, 2048, 4096])
    tokens: int = 1 << 20
    datasets: list = field(default_factory=list)    # empty: every validation split
    batch_size: int = 4
    reach: str = "study"
    sparse_lengths: list = field(default_factory=list)   # more lengths for sparse models only (dense would not fit)
    dense_modes: list = field(default_factory=list)      # dense baselines of the same trained model (method.md §7):
                                                          # linear | ntk | yarn | window, each at every eval.lengths
    document_masking: bool = False   # score each document on its own within a window (recorded in the mode name)


@dataclass
class RunConfig:
    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


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
        raise ConfigError(f"unknown config key {where + '.' if where else ''}{unknown[0]} "
                          f"(allowed: {', '.join(sorted(known))}){did_you_mean(unknown[0], known)}")
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
    for section, defaults in to_dict(RunConfig()).items():
        if isinstance(defaults, dict) and isinstance(doc.get(section), dict):
            out[section] = {**{k: v for k, v in defaults.items() if k not in doc[section]}, **doc[section]}
    return out


def from_dict(data: dict) -> RunConfig:
    return _build(RunConfig, data, "")


def save(cfg: RunConfig, path) -> None:
    from .files import atomic_write_text
    atomic_write_text(path, json.dumps(to_dict(cfg), indent=2, sort_keys=True) + "\n")


def load(path) -> RunConfig:
    """Read a config file (e.g. a run's ``config.json``); errors name the file. Call :func:`validate`
    on the result before using it."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a folder, not a JSON file") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else exc
        raise ConfigError(f"config file {path} is not valid JSON: {reason}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a JSON object (a mapping of sections), got "
                          f"{type(data).__name__}")
    try:
        return from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None


# ----------------------------------------------------------------------------- overrides
SOURCES_EXAMPLE = ("""--set 'data.sources=[{"name":"mine","kind":"files","path":"mytext/"}]' """
                   """--set data.out_dir=data/mine (a .txt/.jsonl/.parquet file or folder)""")

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
            if part not in names:
                where = ".".join(parts[:i]) or "config"
                if not dataclasses.is_dataclass(target):
                    raise ConfigError(f"{where} is a value, not a section: set it whole, e.g. "
                                      f"{SOURCES_EXAMPLE if where == 'data.sources' else where + '=...'}")
                hint = f"; your own text: {SOURCES_EXAMPLE}" if where.startswith("data") else ""
                raise ConfigError(f"unknown config key {key!r} ({where} has: {', '.join(sorted(names))})"
                                  f"{did_you_mean(part, names)}{hint}")
            if i == len(parts) - 1:
                current = getattr(target, part)
                if dataclasses.is_dataclass(current):
                    raise ConfigError(f"{key} is a section; set one of its fields, e.g. {key}.<field>=...")
                kind = typing.get_type_hints(type(target)).get(part, type(current))
                value = _parse_value(text, kind, key)
                if part == "sources":
                    if not all(isinstance(v, dict) for v in value):
                        raise ConfigError(f"{key} must be a JSON list of source mappings, got {text!r}; e.g. "
                                          f"{SOURCES_EXAMPLE}")
                    value = [_build(SourceConfig, v, f"{key}[{j}]") for j, v in enumerate(value)]
                setattr(target, part, value)
            else:
                target = getattr(target, part)
    return cfg
