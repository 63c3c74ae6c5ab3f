"""The settings a report's runs were trained with: what they share and what sets each apart.

A reader comparing perplexities needs the recipe next to them (steps, tokens, model size, and
every override). Runtime keys that do not change results (:data:`runner.RUNTIME_KEYS`) are left out.
"""
from __future__ import annotations

import json

from .. import config as C
from ..effective import unread
from .pages import Table, Text
from .runner import RUNTIME_KEYS, flat_config

_HEADLINE = ("train.steps", "train.batch_tokens", "model.seq_len", "model.d_model", "model.n_layers",
             "model.n_heads", "model.n_kv_heads", "model.vocab_size", "train.lr", "train.seed")


def _cell(flat: dict, key: str, off) -> str:
    """A run's value of ``key``, or a dash where the run does not read it (:func:`fibattn.effective.unread`)."""
    return "—" if key in off else _show(flat.get(key, ""))


def _show(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def settings_blocks(grid, root) -> list:
    """A sentence with the shared recipe and a table of what differs between the grid's runs."""
    cfgs = {run.name: grid.config(run, root) for run in grid.runs}
    offs = {name: unread(cfg) for name, cfg in cfgs.items()}
    flats = {name: {k: v for k, v in flat_config(C.to_dict(cfg)).items() if k not in RUNTIME_KEYS}
             for name, cfg in cfgs.items()}
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
        table.rows = [[name] + [_cell(f, k, offs[name]) for k in differ] for name, f in flats.items()]
        blocks.append(table)
    return blocks
