"""Typed run configuration: one dataclass per concern, presets as functions, overrides.

``RunConfig`` = ``model`` + ``data`` + ``train`` (+ ``eval``). A preset returns a
``RunConfig``; ``apply_overrides(cfg, ["model.window=8", "train.lr=1e-3"])`` changes
fields with type checking; ``to_dict`` / ``from_dict`` round-trip through JSON.
Every field a user can set is checked in ``validate`` with an error that names it.
"""
from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any

# Attention backends: implementations of the same ops (``fibattn.ops.backends`` chooses and runs them).
BACKENDS = ("reference", "torch", "cpu", "triton", "flex")


class ConfigError(ValueError):
    """A bad config value; the message names the field and what is allowed."""


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

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        return 2 * round(self.d_model * 8 / 3 / 2)


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


@dataclass
class EvalConfig:
    lengths: list = field(default_factory=lambda: [1024, 2048, 4096])
    tokens: int = 1 << 20
    datasets: list = field(default_factory=list)    # empty: every validation split
    batch_size: int = 4
    reach: str = "study"


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
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown config key {where + '.' if where else ''}{unknown[0]} "
                          f"(allowed: {', '.join(sorted(known))})")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        path = f"{where}.{name}" if where else name
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, path)
        elif name == "sources":
            kwargs[name] = [_build(SourceConfig, v, f"{path}[{i}]") for i, v in enumerate(value)]
        else:
            kwargs[name] = value
    return cls(**kwargs)


def from_dict(data: dict) -> RunConfig:
    return _build(RunConfig, data, "")


def save(cfg: RunConfig, path) -> None:
    from .files import atomic_write_text
    atomic_write_text(path, json.dumps(to_dict(cfg), indent=2, sort_keys=True) + "\n")


def load(path) -> RunConfig:
    with open(path) as fh:
        try:
            data = json.load(fh)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {path} is not valid JSON: {exc}") from None
    return from_dict(data)


# ----------------------------------------------------------------------------- overrides
def _parse_value(text: str, current: Any, key: str):
    kind = type(current)
    try:
        if kind is bool:
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
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
    except (ValueError, json.JSONDecodeError):
        raise ConfigError(f"{key} expects a {kind.__name__}, got {text!r}") from None


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
                raise ConfigError(f"unknown config key {key!r} ({where} has: {', '.join(sorted(names))})")
            if i == len(parts) - 1:
                current = getattr(target, part)
                if dataclasses.is_dataclass(current):
                    raise ConfigError(f"{key} is a section; set one of its fields, e.g. {key}.<field>=...")
                value = _parse_value(text, current, key)
                if part == "sources":
                    value = [v if isinstance(v, SourceConfig) else _build(SourceConfig, v, f"{key}[{j}]")
                             for j, v in enumerate(value)]
                setattr(target, part, value)
            else:
                target = getattr(target, part)
    return cfg


# ----------------------------------------------------------------------------- validation
def _need(ok: bool, msg: str):
    if not ok:
        raise ConfigError(msg)


def _int_at_least(obj, section: str, name: str, minimum: int):
    v = getattr(obj, name)
    _need(isinstance(v, int) and not isinstance(v, bool) and v >= minimum,
          f"{section}.{name} must be an integer >= {minimum}, got {v!r}")


def _num_in(obj, section: str, name: str, lo: float, hi: float, *, lo_open=False):
    v = getattr(obj, name)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (v > lo if lo_open else v >= lo) and v <= hi
    rng = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
    _need(ok, f"{section}.{name} must be a number in {rng}, got {v!r}")


def _choice(obj, section: str, name: str, allowed):
    v = getattr(obj, name)
    _need(v in allowed, f"{section}.{name} must be one of {', '.join(allowed)}, got {v!r}")


def validate_model(m: ModelConfig) -> None:
    s = "model"
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "seq_len", "max_seq_len", "base_k"):
        _int_at_least(m, s, name, 1)
    _int_at_least(m, s, "window", 0)
    _need(m.d_model % m.n_heads == 0, f"model.d_model ({m.d_model}) must be divisible by model.n_heads ({m.n_heads})")
    _need(m.head_dim % 2 == 0, f"model.d_model / model.n_heads must be even for RoPE, got {m.head_dim}")
    _need(m.n_heads % m.n_kv_heads == 0,
          f"model.n_heads ({m.n_heads}) must be divisible by model.n_kv_heads ({m.n_kv_heads})")
    _need(m.seq_len <= m.max_seq_len, f"model.seq_len must be <= model.max_seq_len ({m.max_seq_len}), got {m.seq_len}")
    _num_in(m, s, "rope_theta", 0, 1e12, lo_open=True)
    _num_in(m, s, "norm_eps", 0, 1, lo_open=True)
    _num_in(m, s, "init_std", 0, 10, lo_open=True)
    _choice(m, s, "attention", ("dense", "sparse"))
    _choice(m, s, "base", ("fib", "pow2", "custom"))
    _choice(m, s, "schedule", ("fixed", "linear", "coprime", "learned", "custom"))
    _choice(m, s, "learned_init", ("fixed", "linear", "coprime"))
    _choice(m, s, "reach", ("study", "train"))
    _choice(m, s, "backend", ("auto",) + BACKENDS)
    _num_in(m, s, "a_min", 0, 1e6, lo_open=True)
    _num_in(m, s, "a_max", 0, 1e6, lo_open=True)
    _need(m.a_min <= m.a_max, f"model.a_min must be <= model.a_max, got {m.a_min} > {m.a_max}")
    _num_in(m, s, "alpha", m.a_min, m.a_max)
    if m.base == "custom":
        _need(bool(m.base_values) and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1
                                           for b in m.base_values),
              f"model.base_values must be a non-empty list of positive integers when model.base=custom, "
              f"got {m.base_values!r}")
    if m.schedule == "custom":
        _need(len(m.alphas) == m.n_layers, f"model.alphas must hold model.n_layers={m.n_layers} values, "
              f"got {len(m.alphas)}")
        for a in m.alphas:
            _need(isinstance(a, (int, float)) and m.a_min <= a <= m.a_max,
                  f"model.alphas values must lie in [a_min, a_max] = [{m.a_min}, {m.a_max}], got {a!r}")
    if m.schedule == "learned":
        _need(m.a_min < m.a_max, f"model.a_min must be < model.a_max for a learned schedule, got {m.a_min}")


def validate_data(d: DataConfig) -> None:
    _choice(d, "data", "tokenizer", ("byte", "bpe"))
    _int_at_least(d, "data", "vocab_size", 256 if d.tokenizer == "bpe" else 1)
    _num_in(d, "data", "val_fraction", 0, 0.5, lo_open=True)
    _int_at_least(d, "data", "val_tokens_max", 1)
    _int_at_least(d, "data", "shard_tokens", 1024)
    _need(bool(d.sources), "data.sources must list at least one source")
    names = set()
    for i, src in enumerate(d.sources):
        s = f"data.sources[{i}]"
        _choice(src, s, "kind", ("bundled", "files", "hf"))
        _need(isinstance(src.name, str) and src.name.replace("-", "").replace("_", "").isalnum(),
              f"{s}.name must be a non-empty name of letters, digits, - and _, got {src.name!r}")
        _need(src.name not in names, f"{s}.name {src.name!r} is used twice; source names must be unique")
        names.add(src.name)
        _num_in(src, s, "weight", 0, 1e9, lo_open=True)
        _int_at_least(src, s, "max_docs", 0)
        if src.kind != "bundled":
            _need(bool(src.path), f"{s}.path is required for kind={src.kind}")


def validate_train(t: TrainConfig) -> None:
    s = "train"
    for name in ("steps", "batch_tokens", "micro_batch", "log_every", "ckpt_every", "keep_ckpts",
                 "max_bad_steps", "eval_tokens"):
        _int_at_least(t, s, name, 1)
    for name in ("warmup_steps", "eval_every", "threads", "seed"):
        _int_at_least(t, s, name, 0)
    _num_in(t, s, "lr", 0, 10, lo_open=True)
    _num_in(t, s, "min_lr_ratio", 0, 1)
    _num_in(t, s, "weight_decay", 0, 10)
    _num_in(t, s, "beta1", 0, 1)
    _num_in(t, s, "beta2", 0, 1)
    _num_in(t, s, "grad_clip", 0, 1e9)
    _choice(t, s, "precision", ("auto", "fp32", "bf16"))
    _need(t.device in ("auto", "cpu", "cuda") or (t.device.startswith("cuda:") and t.device[5:].isdigit()),
          f"train.device must be auto, cpu, cuda or cuda:N, got {t.device!r}")
    _need(isinstance(t.results_db, str), f"train.results_db must be a path, '' (default) or 'off', got {t.results_db!r}")


def validate_eval(e: EvalConfig) -> None:
    _need(bool(e.lengths) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in e.lengths),
          f"eval.lengths must be a non-empty list of positive integers, got {e.lengths!r}")
    _int_at_least(e, "eval", "tokens", 1)
    _int_at_least(e, "eval", "batch_size", 1)
    _choice(e, "eval", "reach", ("study", "train"))


def validate(cfg: RunConfig) -> RunConfig:
    validate_model(cfg.model)
    validate_data(cfg.data)
    validate_train(cfg.train)
    validate_eval(cfg.eval)
    tokens_per_micro = cfg.train.micro_batch * cfg.model.seq_len
    _need(cfg.train.batch_tokens % tokens_per_micro == 0,
          f"train.batch_tokens ({cfg.train.batch_tokens}) must be a multiple of "
          f"train.micro_batch * model.seq_len ({tokens_per_micro})")
    return cfg
