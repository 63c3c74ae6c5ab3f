"""Config validation, decided once: every field's type and range, checked whatever set it
(presets, ``--set``, ``--config`` files, JSON lists, Python), and model sizes that cannot fit
this machine. Each error is a :class:`~fibattn.config.ConfigError` naming the field, the value
and what is allowed."""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import numbers
import os
import typing

from . import devices
from .checks import SEED_MAX
from .config import (ConfigError, DataConfig, EvalConfig, ModelConfig, RunConfig, SourceConfig, TrainConfig,
                     choice_hint, field_help, show_value, switch_value)
from .effective import check_honoured, given_by_file, given_by_set, recorded, unread   # noqa: F401 (callers')
from .threads import MAX_THREADS

# ----------------------------------------------------------------------------- validation
def _need(ok: bool, msg: str):
    if not ok:
        raise ConfigError(msg)


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string",
               list: "a list"}
_ELEMENTS = {"base_values": int, "alphas": float, "lengths": int, "datasets": str, "sparse_lengths": int,
             "dense_modes": str, "include": str, "exclude": str}   # list fields' items


def _is(value, kind) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, kind)


def _check_types(obj, section: str) -> None:
    """Every field of ``obj`` has its declared type (a JSON file or a Python caller can put anything there)."""
    for name, kind in typing.get_type_hints(type(obj)).items():
        value, key = getattr(obj, name), f"{section}.{name}" if section else name
        if dataclasses.is_dataclass(kind):
            _need(isinstance(value, kind), f"{key} must be a mapping of its fields, got {show_value(value)}")
            continue
        _need(_is(value, kind), f"{key} must be {_TYPE_WORDS.get(kind, kind.__name__)}, "
                                f"got {show_value(value)} ({type(value).__name__})")
        item = _ELEMENTS.get(name)
        if item is not None:
            for i, v in enumerate(value):
                _need(_is(v, item), f"{key}[{i}] must be {_TYPE_WORDS[item]}, got {show_value(v)}")


def _int_at_least(obj, section: str, name: str, minimum: int, maximum: int | None = None):
    v = getattr(obj, name)
    ok = isinstance(v, int) and not isinstance(v, bool) and v >= minimum and (maximum is None or v <= maximum)
    allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    _need(ok, f"{section}.{name} must be an integer {allowed}, got {show_value(v)}")


def _num_in(obj, section: str, name: str, lo: float, hi: float, *, lo_open=False, hi_open=False):
    v = getattr(obj, name)
    ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and (v > lo if lo_open else v >= lo)
          and (v < hi if hi_open else v <= hi))
    rng = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    _need(ok, f"{section}.{name} must be a number in {rng}, got {show_value(v)}")


def _choice(obj, section: str, name: str, allowed=None):
    """``allowed``: by default the field's own ``choices`` (config.setting), so they are written once."""
    allowed = allowed or field_help(type(obj), name)[1]
    v = getattr(obj, name)
    _need(v in allowed, f"{section}.{name} must be one of {', '.join(allowed)}, got {show_value(v)}"
                        f"{choice_hint(f'{section}.{name}', v)}")


# ----------------------------------------------------------------------------- memory
MAX_BASE_K = 90                    # fib_base(90)[-1] ~ 4.7e18: larger rungs overflow 64-bit distances


def estimate_params(m: ModelConfig) -> int:
    """Parameters of a FibLM with config ``m`` (the learned alphas and an untied head included)."""
    hd = m.d_model // m.n_heads
    attn = m.d_model * (m.n_heads + 2 * m.n_kv_heads) * hd + m.n_heads * hd * m.d_model
    block = attn + 3 * m.d_model * m.ffn_hidden + 2 * m.d_model
    learned = m.n_layers if m.attention == "sparse" and m.schedule == "learned" else 0
    head = 0 if m.tie_embeddings else m.vocab_size * m.d_model
    return m.vocab_size * m.d_model + head + m.n_layers * block + m.d_model + learned


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g} GB"


def check_training_fits(m: ModelConfig, micro_batch: int, bf16: bool, device, *,
                        flags: str = "train.micro_batch / model.seq_len", checkpointing: str = "none",
                        context: int = 1, logit_rows: int | None = None) -> None:
    """Refuse training that certainly exceeds ``device``'s memory, naming the estimate. A lower bound:
    fp32 weights, gradients and both AdamW moments (16 bytes per parameter), eight saved ``d_model``
    activations per token and layer (``checkpointing="full"``: one per layer plus one recomputed block's
    eight), and one micro-batch's logits with their gradient; ``context``: a context-parallel rank holds
    1/``context`` of each sequence's activations; ``logit_rows``: a loss head that holds at most that many rows
    of logits at once (the chunked heads)."""
    n, tokens = estimate_params(m), micro_batch * m.seq_len // context
    rows = tokens if logit_rows is None else min(tokens, logit_rows)
    saved = m.n_layers + 8 if checkpointing == "full" else 8 * m.n_layers
    need = 16 * n + tokens * (2 if bf16 else 4) * saved * m.d_model + rows * 4 * 2 * m.vocab_size
    mem = devices.device_memory_bytes(device)
    if mem is not None and need > mem:
        raise ConfigError(f"training this model needs at least {_gb(need)} ({n:.3g} parameters at 16 bytes each for "
                          f"weights, gradients and AdamW state, plus activations of {micro_batch} x {m.seq_len} "
                          f"tokens per micro-batch); {device} has {_gb(mem)}: lower {flags}, model.d_model, "
                          f"model.n_layers or model.vocab_size")


def check_sizes_fit(flag: str, values, need, what: str, device="cpu") -> None:
    """Refuse a size flag whose work certainly exceeds ``device``'s memory: the one check behind every
    command's size flags. ``need(v)``: a lower bound of the bytes value ``v`` takes (increasing in ``v``);
    the error names ``flag``, the value, the estimate of ``what`` and the largest value that fits."""
    mem = devices.device_memory_bytes(device)
    if mem is None:
        return
    for v in sorted(values):
        if need(v) > mem:
            lo, hi = 0, v                          # need(lo) fits (or lo = 0), need(hi) does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if need(mid) <= mem else (lo, mid)
            fits = f"at most {lo} fits" if lo >= 1 else "no value fits with the other sizes given"
            raise ConfigError(f"{flag} {v} needs at least {_gb(need(v))} for {what}; {device} has {_gb(mem)} "
                              f"of memory: {fits}")


def check_weights_fit(m: ModelConfig) -> None:
    """Refuse a model whose fp32 weights alone exceed this machine's memory (they are built on the host)."""
    n, mem = estimate_params(m), devices.host_memory_bytes()
    if mem is not None and 4 * n > mem:
        raise ConfigError(f"model (d_model={m.d_model}, n_layers={m.n_layers}, vocab_size={m.vocab_size}) has an "
                          f"estimated {n:.3g} parameters, {_gb(4 * n)} of fp32 weights; this machine has "
                          f"{_gb(mem)} of memory: lower model.d_model, model.n_layers or model.vocab_size")


def validate_model(m: ModelConfig) -> None:
    s = "model"
    _check_types(m, s)
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "seq_len", "max_seq_len"):
        _int_at_least(m, s, name, 1)
    _int_at_least(m, s, "vocab_size", 1, 1 << 32)             # shards hold uint32 ids at most
    _int_at_least(m, s, "base_k", 1, MAX_BASE_K)
    _int_at_least(m, s, "window", 0, m.max_seq_len)
    _int_at_least(m, s, "ffn_dim", 0)
    _need(m.d_model % m.n_heads == 0, f"model.d_model ({m.d_model}) must be divisible by model.n_heads ({m.n_heads})")
    _need(m.head_dim % 2 == 0, f"model.d_model / model.n_heads must be even for RoPE, got {m.head_dim}")
    _need(m.n_heads % m.n_kv_heads == 0,
          f"model.n_heads ({m.n_heads}) must be divisible by model.n_kv_heads ({m.n_kv_heads})")
    _need(m.seq_len <= m.max_seq_len, f"model.seq_len must be <= model.max_seq_len ({m.max_seq_len}), got {m.seq_len}")
    _num_in(m, s, "rope_theta", 0, 1e12, lo_open=True)
    _num_in(m, s, "norm_eps", 0, 1, lo_open=True)
    _num_in(m, s, "init_std", 0, 10, lo_open=True)
    _choice(m, s, "attention")
    _choice(m, s, "base")
    _choice(m, s, "schedule")
    _choice(m, s, "learned_init")
    _choice(m, s, "reach")
    _choice(m, s, "backend")
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
        # no rungs, no alpha to learn: it would get a zero gradient every step (any other schedule is inert)
        _need(m.base != "none" or m.attention == "dense", "model.schedule=learned has nothing to learn with "
              "model.base=none (alpha places rungs, and there are none): use model.schedule=fixed")
    check_weights_fit(m)


def validate_data(d: DataConfig) -> None:
    _check_types(d, "data")
    _need(d.out_dir.strip() != "", "data.out_dir must name a folder, got ''")
    # else the path of a pretrained tokenizer.json (or a folder holding one): a prepared folder keeps its own copy,
    # so the file itself is checked where a folder is built (data.pipeline), not here
    t = d.tokenizer
    _need(t in ("byte", "bpe") or t.endswith(".json") or "/" in t or os.sep in t,
          f"data.tokenizer must be byte, bpe, or the path of a tokenizer.json (or of a folder holding one) to reuse, "
          f"got {show_value(t)}")
    _int_at_least(d, "data", "vocab_size", 256 if d.tokenizer == "bpe" else 1, 1 << 32)
    _num_in(d, "data", "val_fraction", 0, 0.5, lo_open=True)
    _int_at_least(d, "data", "val_tokens_max", 1)
    _int_at_least(d, "data", "shard_tokens", 1024)
    _need(bool(d.sources), "data.sources must list at least one source")
    names = set()
    for i, src in enumerate(d.sources):
        s = f"data.sources[{i}]"
        _need(isinstance(src, SourceConfig), f"{s} must be a source mapping, got {show_value(src)}")
        _check_types(src, s)
        _choice(src, s, "kind")
        _need(isinstance(src.name, str) and src.name.replace("-", "").replace("_", "").isalnum(),
              f"{s}.name must be a non-empty name of letters, digits, - and _, got {src.name!r}")
        _need(src.name not in names, f"{s}.name {src.name!r} is used twice; source names must be unique")
        names.add(src.name)
        _num_in(src, s, "weight", 0, 1e9, lo_open=True)
        _int_at_least(src, s, "max_docs", 0)
        if src.kind != "bundled":
            _need(bool(src.path), f"{s}.path is required for kind={src.kind}")
        globs = "include" if src.include else "exclude" if src.exclude else ""
        _need(not globs or src.kind == "files", f"{s}.{globs} chooses the files of a kind=files folder; it has no "
                                                 f"effect with kind={src.kind}: drop it")


def validate_train(t: TrainConfig) -> None:
    s = "train"
    t.compile = switch_value(t.compile)          # true/false as JSON booleans or --set's boolean words
    _check_types(t, s)
    _need(t.out_dir.strip() != "", "train.out_dir must name a folder, got ''")
    for name in ("steps", "batch_tokens", "log_every", "ckpt_every", "keep_ckpts",
                 "max_bad_steps", "eval_tokens", "context_parallel"):
        _int_at_least(t, s, name, 1)
    for name in ("warmup_steps", "eval_every", "micro_batch"):     # micro_batch 0: auto
        _int_at_least(t, s, name, 0)
    _int_at_least(t, s, "threads", 0, MAX_THREADS)   # 0: the free cores (fibattn.threads)
    _int_at_least(t, s, "seed", 0, SEED_MAX)        # what torch.manual_seed takes
    _num_in(t, s, "lr", 0, 10, lo_open=True)
    _num_in(t, s, "min_lr_ratio", 0, 1)
    _num_in(t, s, "weight_decay", 0, 10)
    _num_in(t, s, "beta1", 0, 1, hi_open=True)      # AdamW's moments need beta < 1 (1: never forget, no update)
    _num_in(t, s, "beta2", 0, 1, hi_open=True)
    _num_in(t, s, "grad_clip", 0, 1e9)
    _choice(t, s, "precision")
    _choice(t, s, "activation_checkpointing")
    _choice(t, s, "compile")
    _choice(t, s, "loss_head")
    if t.loss_head == "liger":
        _need(importlib.util.find_spec("liger_kernel") is not None,
              "train.loss_head=liger needs liger-kernel: pip install liger-kernel (or set chunked or auto)")
    _need(t.device in ("auto", "cpu", "cuda") or (t.device.startswith("cuda:") and t.device[5:].isdigit()),
          f"train.device must be auto, cpu, cuda or cuda:N, got {t.device!r}")


def validate_eval(e: EvalConfig) -> None:
    _check_types(e, "eval")
    _need(bool(e.lengths) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in e.lengths),
          f"eval.lengths must be a non-empty list of positive integers, got {e.lengths!r}")
    _int_at_least(e, "eval", "tokens", 1)
    _int_at_least(e, "eval", "batch_size", 1)
    _choice(e, "eval", "reach")
    _need(all(n >= 1 for n in e.sparse_lengths), f"eval.sparse_lengths must hold positive integers, got "
          f"{show_value(e.sparse_lengths)}")
    baselines = field_help(EvalConfig, "dense_modes")[1]
    for m in e.dense_modes:
        _need(m in baselines, f"eval.dense_modes items must be {', '.join(baselines)}, got {show_value(m)}")


def validate_given(cfg: RunConfig, config_file=None, sets=()) -> RunConfig:
    """:func:`validate`, naming the ``--config`` file when a field the refusal names came from it (a field no
    ``--set`` gave; the first such field). ``config_file``: one file, or key -> file (:func:`fibattn.
    config_files.load_all`)."""
    try:
        return validate(cfg)
    except ConfigError as exc:
        keys = {s.split("=", 1)[0].strip() for s in sets or ()}
        named = [w.rstrip(":,.;)") for w in str(exc).replace("(", " ").split()]
        named = [w for w in named if "." in w and w.split("[", 1)[0].split(".", 1)[0] in _SECTIONS]
        for field in named:
            for key in (field, field.split("[", 1)[0]):
                path = (config_file.get(key) if isinstance(config_file, dict)
                        else config_file if config_file else None)
                if path and key not in keys:
                    raise ConfigError(f"config file {path}: {exc}") from None
        raise


_SECTIONS = ("name", "model", "data", "train", "eval")


def fit_warmup(t: TrainConfig, given: dict | None = None) -> str | None:
    """A warm-up longer than the run never reaches ``train.lr``. One the user gave (``given``: key -> how) is
    refused; a preset's or the default's (a shortened preset run) is cut to ``train.steps`` -- the user asked
    for ``train.lr``, and gets it at the last step -- and the note to log is returned."""
    if t.warmup_steps <= t.steps:
        return None
    if given and "train.warmup_steps" in given:
        raise ConfigError(f"{given['train.warmup_steps']}: train.warmup_steps ({t.warmup_steps}) must be <= "
                          f"train.steps ({t.steps}); a longer warm-up never reaches train.lr")
    note = (f"fibattn: train.warmup_steps {t.warmup_steps} (not set by you) is longer than train.steps {t.steps}: "
            f"warming up over all {t.steps} steps (set train.warmup_steps to choose)")
    t.warmup_steps = t.steps
    return note


def validate(cfg: RunConfig) -> RunConfig:
    _check_types(cfg, "")
    _need(cfg.name.strip() != "", "name must be a non-empty string, got ''")
    validate_model(cfg.model)
    validate_data(cfg.data)
    validate_train(cfg.train)
    validate_eval(cfg.eval)
    mb = cfg.train.micro_batch                 # 0 (auto) is chosen among the divisors later
    tokens_per_micro = max(mb, 1) * cfg.model.seq_len
    per = f"train.micro_batch * model.seq_len ({tokens_per_micro})" if mb else f"model.seq_len ({tokens_per_micro})"
    _need(cfg.train.batch_tokens % tokens_per_micro == 0,
          f"train.batch_tokens ({cfg.train.batch_tokens}) must be a multiple of {per}")
    P = cfg.train.context_parallel
    _need(cfg.model.seq_len % P == 0, f"model.seq_len ({cfg.model.seq_len}) must be divisible by "
          f"train.context_parallel ({P}): each rank of a context group takes an equal chunk")
    _need(P == 1 or cfg.train.compile != "true", f"train.compile=true with train.context_parallel={P} is not "
          "supported yet (the halo exchange is not traced); set one of them back (auto leaves it off)")
    return cfg
