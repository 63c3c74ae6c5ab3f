"""Which settings act in a config: decided once, here, for every key (issue 58, kind 6).

A setting is read only in some configs (``model.base_k`` only with ``model.base=fib``, everything of the
sparse pattern only with ``model.attention=sparse``, ...). :func:`unread` lists the keys a config does not
read and why; one rule follows from it, for every entry point:

- a setting the user *gave* that has no effect is refused (:func:`check_honoured`) -- given with ``--set``
  (named), or by a ``--config`` file with a value other than its default (a saved config lists every key;
  a default value there asks for nothing);
- a run records only what acts (:func:`recorded`: its ``config.json`` leaves the unread keys out; readers
  take their defaults, which are inert too), and comparisons of two configs skip what neither reads.

A preset's values are not the user's: a preset setting read no more after a ``--set`` (``base_k`` of
``tiny`` under ``--set model.base=pow2``) is simply not recorded.
"""
from __future__ import annotations

import dataclasses
import json

from .checks import ConfigError

_SPARSE = ("model.attention", ("sparse",))
_RUNGS = ("model.base", ("fib", "pow2", "custom"))          # none: the window alone, no rung for alpha to place
# key -> what it needs to be read: (setting, the values with which it is read[, only when (setting, values)])
READ_WITH = {
    "model.base": (_SPARSE,), "model.window": (_SPARSE,), "model.backend": (_SPARSE,),
    "model.base_k": (_SPARSE, ("model.base", ("fib",))),
    "model.base_values": (_SPARSE, ("model.base", ("custom",))),
    "model.schedule": (_SPARSE, _RUNGS), "model.a_min": (_SPARSE, _RUNGS), "model.a_max": (_SPARSE, _RUNGS),
    "model.alphas": (_SPARSE, _RUNGS, ("model.schedule", ("custom",))),
    "model.learned_init": (_SPARSE, _RUNGS, ("model.schedule", ("learned",))),
    "model.alpha": (_SPARSE, _RUNGS, ("model.schedule", ("fixed", "learned")),
                    ("model.learned_init", ("fixed",), ("model.schedule", ("learned",)))),
    "model.reach": (_SPARSE,),                               # and see _reach_unread
    "data.vocab_size": (("data.tokenizer", ("bpe",)),),
    "train.wandb_project": (("train.wandb", (True,)),),
    "eval.sparse_lengths": (_SPARSE,),
    "eval.dense_modes": (("model.attention", ("dense",)),),
}
# a source's field -> the source kinds that read it
SOURCE_READ_WITH = {"path": ("files", "hf"), "subset": ("hf",), "split": ("hf",), "text_field": ("files", "hf"),
                    "include": ("files",), "exclude": ("files",)}
RECORDS = ("train.init_source",)          # written by the run from train.init_from: a record, never an input
# (this module works on any config dataclass, so that fibattn.config can record through it)


def _value(cfg, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_source(src) -> bool:
    return dataclasses.is_dataclass(src) and hasattr(src, "kind")


def _words(values) -> str:
    return " or ".join(json.dumps(v) if isinstance(v, bool) else str(v) for v in values)


def _missing(cfg, needs) -> tuple[str, str] | None:
    """``(why, the setting to change)`` for the first requirement of ``needs`` that ``cfg`` does not meet."""
    for need in needs:
        decider, values = need[0], need[1]
        if len(need) > 2 and _value(cfg, need[2][0]) not in need[2][1]:
            continue
        v = _value(cfg, decider)
        if v not in values:
            return f"{decider}={_show(v)} (it is read only with {decider}={_words(values)})", decider
    return None


def _reach_unread(cfg) -> tuple[str, str] | None:
    m = cfg.model
    if m.attention == "sparse" and m.base == "none" and isinstance(m.window, int) and isinstance(m.seq_len, int) \
            and m.window < m.seq_len:
        return (f"model.base='none' and model.window ({m.window}) below model.seq_len ({m.seq_len}) (the training "
                f"length caps no distance then)", "model.base")
    return None


def unread(cfg) -> dict[str, tuple[str, str]]:
    """Every key ``cfg`` does not read: key -> ``(why, the setting that decides)``. Keys of a source are
    ``data.sources[i].FIELD``."""
    out = {}
    for key, needs in READ_WITH.items():
        hit = _missing(cfg, needs) or (_reach_unread(cfg) if key == "model.reach" else None)
        if hit:
            out[key] = hit
    sources = cfg.data.sources if isinstance(cfg.data.sources, list) else []
    for i, src in enumerate(sources):
        if not _is_source(src):
            continue
        for name, kinds in SOURCE_READ_WITH.items():
            if src.kind not in kinds:
                out[f"data.sources[{i}].{name}"] = (f"data.sources[{i}].kind={_show(src.kind)} (it is read "
                                                    f"only with kind={_words(kinds)})", f"data.sources[{i}].kind")
    return out


# ----------------------------------------------------------------------------- what the user gave
def given_by_set(items) -> dict:
    """``--set KEY=VALUE`` items as :func:`check_honoured` takes them; a whole ``data.sources`` list gives each
    field its mappings hold."""
    out = {}
    for item in items or []:
        key, _, text = str(item).partition("=")
        key = key.strip()
        out[key] = f"--set {key}"
        if key == "data.sources":
            try:
                value = json.loads(text)
            except ValueError:
                continue                    # apply_overrides refuses it, naming the key
            for i, src in enumerate(value if isinstance(value, list) else []):
                for name in (src if isinstance(src, dict) else {}):
                    out[f"data.sources[{i}].{name}"] = f"--set {key}"
    return out


def flat_keys(doc: dict) -> dict:
    """``{"section.field": value}`` of a config mapping, each source's fields as ``data.sources[i].FIELD``."""
    out = {}
    for section, fields in doc.items():
        if not isinstance(fields, dict):
            out[section] = fields
            continue
        for name, value in fields.items():
            out[f"{section}.{name}"] = value
            if section == "data" and name == "sources" and isinstance(value, list):
                for i, src in enumerate(value):
                    for field, v in (src.items() if isinstance(src, dict) else ()):
                        out[f"data.sources[{i}].{field}"] = v
    return out


def _defaults(cfg) -> dict:
    """Every key's default, as :func:`flat_keys` names them (a source's fields: the first source's class)."""
    out = flat_keys(dataclasses.asdict(type(cfg)()))
    sources = [s for s in getattr(cfg.data, "sources", []) if _is_source(s)]
    if sources:
        blank = dataclasses.asdict(type(sources[0])())
        out.update({f"data.sources[{i}].{k}": v for i in range(len(cfg.data.sources)) for k, v in blank.items()})
    return out


def given_by_file(cfg, origins) -> dict:
    """The keys ``--config`` files set away from their defaults, as :func:`check_honoured` takes them.
    ``origins``: key -> the file that set it (:func:`fibattn.config_files.load_all`), or one file's path (every key
    from it). A saved config lists every key: a value at its default asks for nothing."""
    now, defaults = flat_keys(dataclasses.asdict(cfg)), _defaults(cfg)
    if not isinstance(origins, dict):
        origins = {k: origins for k in now}
    return {k: f"--config {path}" for k, path in origins.items()
            if k in now and k not in RECORDS and now[k] != defaults.get(k)}


def check_honoured(cfg, given: dict) -> None:
    """Refuse a setting the user gave (``given``: key -> how, e.g. ``--set data.vocab_size``) that ``cfg``
    does not read: silently ignored, it would train something else than asked."""
    off = unread(cfg)
    for key, how in given.items():
        if key in off:
            why, decider = off[key]
            raise ConfigError(f"{how}: {key} has no effect with {why}; drop it, or set {decider}")


# ----------------------------------------------------------------------------- what a run records
def recorded(cfg) -> dict:
    """``cfg`` as a run records it: every key it reads, none it does not (loading fills those with their
    defaults, which are not read either)."""
    doc, off = dataclasses.asdict(cfg), unread(cfg)
    for key in off:
        if key.startswith("data.sources["):
            i, name = key[len("data.sources["):].split("].")
            doc["data"]["sources"][int(i)].pop(name, None)
        else:
            section, name = key.split(".")
            doc[section].pop(name, None)
    return doc


__all__ = ["READ_WITH", "RECORDS", "SOURCE_READ_WITH", "check_honoured", "flat_keys", "given_by_file",
           "given_by_set", "recorded", "unread"]

