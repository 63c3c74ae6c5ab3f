"""Config files (``--config``): one file read with its errors naming it, several merged in order.

A file is JSON (e.g. a run's ``config.json``, which :func:`fibattn.config.save` writes) or TOML when its
name ends in ``.toml``. :func:`load_all` also says which file set each key, so that a refusal can name
the file (:func:`fibattn.validation.validate_given`).
"""
from __future__ import annotations

import json
import re

from .checks import ConfigError
from .config import RunConfig, from_dict
from .files import parse_json, parse_toml


def read_file(path) -> dict:
    """The mapping a config file holds: JSON (e.g. a run's ``config.json``), or TOML when its name ends in
    ``.toml``; errors name the file (and, for TOML, the line). Keys and types are not checked here."""
    toml = str(path).lower().endswith(".toml")
    kind = "TOML" if toml else "JSON"
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        data = parse_toml(raw) if toml else parse_json(raw)      # a byte-order mark is fine; causes are named
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a folder, not a {kind} file") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else exc
        looks_toml = re.match(r"\s*(\[[\w.\[\]]+\]|[\w.]+\s*=)", getattr(exc, "doc", "") or "")
        hint = " (a TOML config must end in .toml)" if not toml and looks_toml else ""
        raise ConfigError(f"config file {path} is not valid {kind}: {reason}{hint}") from None
    except ValueError as exc:            # tomllib.TOMLDecodeError: its message names the line and column
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a JSON object (a mapping of sections), got "
                          f"{type(data).__name__}")
    try:
        from_dict(data)                  # unknown keys and malformed sections, named in this file
    except ConfigError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    return data


def load(path) -> RunConfig:
    """Read a config file (:func:`read_file`). Call :func:`validate` on the result before using it."""
    return from_dict(read_file(path))


def merge(base: dict, over: dict) -> dict:
    """``over`` laid on ``base``: sections merged key by key, every value (a list too: ``data.sources``
    whole) replaced by ``over``'s."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_all(paths) -> tuple[RunConfig, dict]:
    """Several ``--config`` files merged in order, a later file's values replacing an earlier one's
    (:func:`merge`): ``(config, key -> the file that set it)``, keys as ``section.field`` and
    ``data.sources[i].FIELD``. Call :func:`validate` on the config before using it."""
    doc, origins = {}, {}
    for path in paths:
        data = read_file(path)
        if isinstance(data.get("data"), dict) and "sources" in data["data"]:    # a new list: none of the old fields
            origins = {k: v for k, v in origins.items() if not k.startswith("data.sources")}
        for section, fields in data.items():
            origins[section] = path
            if isinstance(fields, dict):
                for name, value in fields.items():
                    origins[f"{section}.{name}"] = path
                    if section == "data" and name == "sources" and isinstance(value, list):
                        for i, src in enumerate(value):
                            origins.update({f"data.sources[{i}].{k}": path for k in src})
        doc = merge(doc, data)
    return from_dict(doc), origins
