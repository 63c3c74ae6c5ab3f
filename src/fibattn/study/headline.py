"""The report's headline check: dense attention must degrade past the training length, the sparse variants
hold (method.md §5), each beside the study's own change for that variant.

The runs are :class:`fibattn.study.report.RunResult` lists (``results``); :func:`headline_factor` picks the
length multiple the check is made at.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import published as S
from .pages import Table, fmt_pct, fmt_ppl, pct_change

DENSE_GOAL_PCT = 50.0          # dense perplexity must rise by at least this much at 4×
SPARSE_TOL_PCT = 5.0           # sparse variants must stay within ± this


def headline_factor(results: list) -> int | None:
    """4 when 4× the training length was evaluated, else the largest whole multiple >= 2 (None if none)."""
    mults = {n // r.train_len for r in results for n in r.lengths() if r.train_len and n % r.train_len == 0}
    mults = {m for m in mults if m >= 2}
    return 4 if 4 in mults else (max(mults) if mults else None)


@dataclass
class Check:
    name: str
    short: float | None          # perplexity at the training length
    long: float | None           # perplexity at factor × the training length
    change: float | None         # percent
    goal: str
    passed: bool
    study: str = "—"             # the study's change at 4× for this variant (FineWeb-Edu, over its windows)


def headline_check(results: list, dataset: str, factor: int = 4, *, dense_goal: float = DENSE_GOAL_PCT,
                   sparse_tol: float = SPARSE_TOL_PCT) -> list[Check]:
    """Dense must degrade by ``>= dense_goal`` % at ``factor``× the training length; sparse stay within ± tol."""
    out = []
    for r in results:
        a, b = r.get(dataset, r.train_len), r.get(dataset, factor * r.train_len)
        ch = pct_change(a, b)
        if r.variant == "dense":
            goal, ok = f">= +{dense_goal:g} %", ch is not None and ch >= dense_goal
        else:
            goal, ok = f"within ±{sparse_tol:g} %", ch is not None and abs(ch) <= sparse_tol
        out.append(Check(r.label or r.name, a, b, ch, goal, ok, S.fmt_change_range(S.study_change(r.variant, factor=factor))))
    return out


def check_table(checks: list[Check], dataset: str, factor: int) -> Table:
    table = Table(f"Headline check: {dataset} perplexity change at {factor}× the training length",
                  ["model", "1×", f"{factor}×", "change", "goal", "result", f"study at {factor}× (FW)"],
                  note="The study's column: its FineWeb-Edu change from 1024 to 4096 for the same variant, over "
                       "W = 6..12 (method.md §5); pow2 + fixed degrades there too (+11.3 %: never-trained distances).")
    for c in checks:
        table.rows.append([c.name, fmt_ppl(c.short), fmt_ppl(c.long), fmt_pct(c.change), c.goal,
                           "PASS" if c.passed else "FAIL", c.study])
    return table
