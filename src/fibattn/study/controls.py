"""The window-only controls beside the fib model (issue 27): would a plain sliding window do as well?

Two runs per fib window ``W`` (:func:`fibattn.study.grid.window_controls`), both ``model.base=none``:
``window_rungs_off`` (the same ``W``, no rungs: what the rungs add) and ``window_matched`` (``W'`` with
as many columns per query at the training length as fib linear: the same cost). Both are found here
from the configs alone -- the matched run is the rung-free run whose ``W`` is fib linear's
:func:`fibattn.schedules.matched_window` -- so an extension run with ``model.base=none`` is placed too.
"""
from __future__ import annotations

from .pages import Heading, Table, Text, fmt_pct, fmt_ppl, pct_change

FIB = "linear"                       # the fib model the controls are measured against (the stagger)
MULTIPLES = (1, 4, 64)               # the lengths the comparison is stated at (× the training length)


def columns_per_query(model) -> float:
    """Mean over layers of the columns a query attends at the training length (the cost per query)."""
    from ..model.attention import config_base, config_layer_alphas
    from ..schedules import attended_distances
    counts = [len(attended_distances(model.window, a, config_base(model), model.seq_len))
              for a in config_layer_alphas(model)]
    return sum(counts) / len(counts)


def matched_of(model) -> int:
    """``W'`` of the window that costs what ``model`` (a fib config) costs per query."""
    from ..model.attention import config_base, config_layer_alphas
    from ..schedules import matched_window
    return matched_window(model.window, config_layer_alphas(model), config_base(model), model.seq_len)


def pairs(results) -> list[tuple]:
    """``(fib, rungs_off, matched)`` per fib linear run that has a control (``None`` for a missing one);
    ``results``: one run per (variant, window) (``report.primary``)."""
    by = {(r.variant, r.window): r for r in results}
    out = []
    for fib in sorted((r for r in results if r.variant == FIB and r.model is not None), key=lambda r: r.window):
        w = matched_of(fib.model)
        off, matched = by.get(("window", fib.window)) if w != fib.window else None, by.get(("window", w))
        if off is not None or matched is not None:
            out.append((fib, off, matched))
    return out


def matched_cells(results) -> dict:
    """``{("window_matched", W): run}`` for the main table's matched-cost column at row ``W``."""
    return {("window_matched", fib.window): m for fib, _, m in pairs(results) if m is not None}


def _multiples(runs, dataset: str) -> list[int]:
    """``MULTIPLES`` that every run was evaluated at; the longest common multiple stands in for 64×."""
    T = runs[0].train_len
    common = set.intersection(*({n // T for d, n in r.ppl if d == dataset and n % T == 0} for r in runs))
    shown = [m for m in MULTIPLES if m in common]
    if MULTIPLES[-1] not in common and common and max(common) > max(shown, default=0):
        shown.append(max(common))
    return shown


def _fib_vs(fib, other, dataset: str, mult: int) -> float | None:
    """fib's perplexity relative to ``other``'s at ``mult`` × the training length (negative: fib is better)."""
    T = fib.train_len
    return pct_change(other.get(dataset, mult * T), fib.get(dataset, mult * T))


def control_table(results, dataset: str) -> Table | None:
    """fib linear, window (rungs off) and window (matched cost) per W: columns per query, perplexity
    at 1×, 4×, 64× with the change from 1×, and fib relative to each control."""
    found = pairs(results)
    if not found:
        return None
    from .grid import CONTROL_TITLES
    runs = [r for p in found for r in p if r is not None and r.ppl]
    mults = _multiples(runs, dataset) if runs else []
    header = ["W", "model", "columns per query"] + [f"{m}×" for m in mults] + \
        [f"fib vs this at {m}×" for m in mults]
    table = Table(f"Window-only controls ({dataset} perplexity, change from 1×): would a sliding window of the "
                  f"same cost do as well?", header,
                  note="window (rungs off): the fib model's W without its rungs (what the rungs add). window "
                       "(matched cost): no rungs, W chosen before training so that each query attends as many "
                       "columns at the training length as fib linear does (mean over layers). Same recipe for "
                       "every run. \"fib vs this\": fib linear's perplexity relative to the row's (negative: fib "
                       "is better).")
    titles = {"off": CONTROL_TITLES["window_rungs_off"], "matched": CONTROL_TITLES["window_matched"]}
    for fib, off, matched in found:
        for kind, r in (("fib", fib), ("off", off), ("matched", matched)):
            if r is None:
                continue
            cost = f"{columns_per_query(r.model):.1f}" if kind == "fib" else str(r.window + 1)
            T = r.train_len
            cells = []
            for m in mults:
                v = r.get(dataset, m * T)
                cells.append(fmt_ppl(v) if m == 1 or v is None else
                             f"{fmt_ppl(v)} ({fmt_pct(pct_change(r.get(dataset, T), v))})")
            vs = ["—" if kind == "fib" else fmt_pct(_fib_vs(fib, r, dataset, m)) for m in mults]
            label = f"fib linear (stagger), {r.name}" if kind == "fib" else f"{titles[kind]}, {r.name}"
            table.rows.append([str(r.window), label, cost] + cells + vs)
    return table


def control_lines(results, dataset: str) -> list[str]:
    """fib linear against window (matched cost) at 1×, 4× and 64×, in numbers (the report and the demo)."""
    lines = []
    for fib, off, matched in pairs(results):
        for r, title in ((matched, "window (matched cost)"), (off, "window (rungs off)")):
            if r is None or not r.ppl or not fib.ppl:
                continue
            T = fib.train_len
            parts = []
            for m in _multiples([fib, r], dataset):
                a, b = fib.get(dataset, m * T), r.get(dataset, m * T)
                parts.append(f"{m}× {fmt_ppl(a)} vs {fmt_ppl(b)} ({fmt_pct(pct_change(b, a))})")
            lines.append(f"fib linear W={fib.window} ({columns_per_query(fib.model):.1f} columns per query) against "
                         f"{title} W={r.window} ({r.window + 1} columns), {dataset}: " + "; ".join(parts))
    if lines:
        lines.append("(fib's perplexity first, then the window's; in brackets fib relative to the window: "
                     "negative means fib is better)")
    return lines


def control_blocks(results, datasets: list[str]) -> tuple[list, list]:
    """The report's section stating fib against the windows in numbers, and the control table (or nothing)."""
    if not results or not datasets:
        return [], []
    lines, table = control_lines(results, datasets[0]), control_table(results, datasets[0])
    blocks = [Heading("Would a sliding window do as well?"), Text("\n\n".join(lines))] if lines else []
    return blocks, [table] if table is not None else []
