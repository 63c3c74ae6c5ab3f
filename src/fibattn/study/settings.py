"""The settings a report's runs were trained with: what they share and what sets each apart.

A reader comparing perplexities needs the recipe next to them (steps, tokens, model size, and
every override). Runtime keys that do not change results (:data:`runner.RUNTIME_KEYS`) are left out.
"""
from __future__ import annotations

import json

from .. import config as C
from .pages import Table, Text
from .runner import RUNTIME_KEYS, flat_config

_HEADLINE = ("train.steps", "train.batch_tokens", "model.seq_len", "model.d_model", "model.n_layers",
             "model.n_heads", "model.n_kv_heads", "model.vocab_size", "train.lr", "train.seed")


SPARSE_ONLY = {f"model.{k}" for k in ("base", "base_k", "base_values", "window", "schedule", "alpha", "a_min",
                                       "a_max", "alphas", "learned_init", "reach")}   # no meaning for dense attention


RUNG_ONLY = SPARSE_ONLY - {"model.base", "model.window"}     # no meaning without rungs (model.base=none)


def _cell(flat: dict, key: str) -> str:
    if flat.get("model.attention") == "dense" and key in SPARSE_ONLY:
        return "—"
    return "—" if flat.get("model.base") == "none" and key in RUNG_ONLY else _show(flat.get(key, ""))


def _show(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def settings_blocks(grid, root) -> list:
    """A sentence with the shared recipe and a table of what differs between the grid's runs."""
    flats = {run.name: {k: v for k, v in flat_config(C.to_dict(grid.config(run, root))).items()
                        if k not in RUNTIME_KEYS} for run in grid.runs}
    if not flats:
        return []
    keys = sorted(set().union(*flats.values()))
    shared = {k: next(iter(flats.values())).get(k) for k in keys
              if len({json.dumps(f.get(k), sort_keys=True) for f in flats.values()}) == 1}
    first = next(iter(flats.values()))
    tokens = first.get("train.steps", 0) * first.get("train.batch_tokens", 0) if "train.steps" in shared and \
        "train.batch_tokens" in shared else None
    head = ", ".join(f"`{k}` {_show(shared[k])}" for k in _HEADLINE if k in shared)
    text = f"Shared by every run: {head}" + (f" ({tokens:,} training tokens each)" if tokens else "") + \
        ". Every other shared setting is in each run's `config.json`."
    differ = [k for k in keys if k not in shared]
    blocks: list = [Text(text)]
    if differ:
        table = Table("What sets the runs apart", ["run"] + differ)
        table.rows = [[name] + [_cell(f, k) for k in differ] for name, f in flats.items()]
        blocks.append(table)
    return blocks
