"""The retrofit part of a report: a dense run fine-tuned to sparse schedules (runs with ``init_from``),
next to the same schedules trained from scratch and the dense source (docs/retrofit.md).

- a table: per fine-tune, its steps (and share of the source's), perplexity at 1× and at the
  headline multiple, the gap to the from-scratch model of its schedule at 1×, and its own change
  from 1×;
- ``retrofit.png``: perplexity at 1× and at the headline multiple against fine-tune steps, one line
  per schedule, the from-scratch models and the dense source as flat reference lines;
- the goals of the retrofit issue as checks (:func:`retrofit_checks`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .pages import Table, fmt_pct, fmt_ppl, pct_change

GAP_GOAL_PCT = 3.0          # a fine-tune of <= GOAL_SHARE of the source's steps: within this of from-scratch at 1×
HOLD_GOAL_PCT = 5.0         # ... and at the headline multiple within + this of its own 1×
GOAL_SHARE = 0.10
DENSE_GOAL_PCT = 50.0       # the dense source collapses: + at least this at the headline multiple


@dataclass
class Retrofit:
    """A fine-tune and what it is compared with."""

    run: object               # RunResult
    source: object            # the dense source's RunResult
    scratch: object | None    # the same schedule trained from scratch

    @property
    def share(self) -> float:
        return self.run.steps / self.source.steps if self.source.steps else 0.0


def retrofits(results) -> list[Retrofit]:
    """Every evaluated run with ``init_from``, its source and its from-scratch counterpart, by schedule then steps."""
    by_name = {r.name: r for r in results}
    scratch = {(r.variant, r.window): r for r in results if not r.init_from and r.variant != "dense" and r.ppl}
    out = [Retrofit(r, by_name[r.init_from], scratch.get((r.variant, r.window)))
           for r in results if r.init_from and r.ppl and r.init_from in by_name]
    return sorted(out, key=lambda x: (x.run.variant, x.run.steps))


def _long(x: Retrofit, factor: int) -> int:
    return factor * x.run.train_len


def retrofit_table(items: list[Retrofit], dataset: str, factor: int) -> Table:
    T = items[0].run.train_len
    table = Table(f"Retrofit: the dense run fine-tuned to sparse attention ({dataset}, perplexity at {T} = 1× and "
                  f"{factor * T} = {factor}×)",
                  ["model", "schedule", "fine-tune steps", "1×", "vs from scratch at 1×", f"{factor}×",
                   f"{factor}× vs its 1×"])
    shown = set()
    for x in items:
        for ref in (x.source, x.scratch):
            if ref is not None and ref.name not in shown:
                shown.add(ref.name)
                a, b = ref.get(dataset, T), ref.get(dataset, factor * T)
                table.rows.append([ref.name, ref.variant, f"{ref.steps} (from scratch)", fmt_ppl(a), "—", fmt_ppl(b),
                                   fmt_pct(pct_change(a, b))])
    for x in items:
        a, b = x.run.get(dataset, T), x.run.get(dataset, _long(x, factor))
        gap = pct_change(x.scratch.get(dataset, T), a) if x.scratch is not None else None
        table.rows.append([x.run.name, x.run.variant, f"{x.run.steps} ({100 * x.share:.0f} %)", fmt_ppl(a),
                           fmt_pct(gap), fmt_ppl(b), fmt_pct(pct_change(a, b))])
    table.note = (f"Fine-tune steps as a share of the dense source's {items[0].source.steps}. Goals: a fine-tune of "
                  f"<= {100 * GOAL_SHARE:.0f} % within {GAP_GOAL_PCT:g} % of the from-scratch model at 1×, and at "
                  f"{factor}× within +{HOLD_GOAL_PCT:g} % of its own 1×, while the dense source collapses.")
    return table


def retrofit_checks(items: list[Retrofit], dataset: str, factor: int) -> list[tuple[str, bool, str]]:
    """``(name, passed, detail)`` for the goals, judged on the fib linear fine-tunes (docs/retrofit.md)."""
    T = items[0].run.train_len
    src = items[0].source
    d1, d4 = src.get(dataset, T), src.get(dataset, factor * T)
    rise = pct_change(d1, d4)
    checks = [("dense source collapses", rise is not None and rise >= DENSE_GOAL_PCT,
               f"{fmt_ppl(d1)} -> {fmt_ppl(d4)} ({fmt_pct(rise)}; goal >= +{DENSE_GOAL_PCT:g} %)")]
    linear = [x for x in items if x.run.variant == "linear" and x.scratch is not None]
    within = [x for x in linear if x.share <= GOAL_SHARE + 1e-9]
    if not within:
        return checks + [("retrofit fib linear", False, f"no fib linear fine-tune of <= {100 * GOAL_SHARE:.0f} %")]
    x = max(within, key=lambda y: y.run.steps)
    a, b, ref = x.run.get(dataset, T), x.run.get(dataset, _long(x, factor)), x.scratch.get(dataset, T)
    gap, hold = pct_change(ref, a), pct_change(a, b)
    checks.append((f"{x.run.name} at 1×", gap is not None and gap <= GAP_GOAL_PCT,
                   f"{fmt_ppl(a)} vs {fmt_ppl(ref)} from scratch ({fmt_pct(gap)}; goal <= +{GAP_GOAL_PCT:g} %)"))
    checks.append((f"{x.run.name} at {factor}×", hold is not None and hold <= HOLD_GOAL_PCT,
                   f"{fmt_ppl(a)} -> {fmt_ppl(b)} ({fmt_pct(hold)}; goal <= +{HOLD_GOAL_PCT:g} %)"))
    return checks


def retrofit_plot(items: list[Retrofit], dataset: str, factor: int, path) -> Path | None:
    from .. import plots
    from ..plots import Panel, Series
    T = items[0].run.train_len
    steps = sorted({x.run.steps for x in items})
    span = [0, max(steps)]
    panels = []
    for mult in (1, factor):
        series, refs = [], {}
        for variant in sorted({x.run.variant for x in items}):
            mine = [x for x in items if x.run.variant == variant and x.run.get(dataset, mult * T) is not None]
            if mine:
                series.append(Series(f"fib {variant}: fine-tuned from dense", [x.run.steps for x in mine],
                                     [x.run.get(dataset, mult * T) for x in mine], marker="o"))
            for x in mine:
                if x.scratch is not None and x.scratch.get(dataset, mult * T) is not None:
                    refs[f"fib {variant}: from scratch ({x.scratch.steps} steps)"] = x.scratch.get(dataset, mult * T)
        src = items[0].source
        if src.get(dataset, mult * T) is not None:
            refs[f"dense source ({src.steps} steps)"] = src.get(dataset, mult * T)
        series += [Series(label, span, [v, v], linestyle="--") for label, v in refs.items()]
        panels.append(Panel(f"{dataset} at {mult * T} tokens ({mult}× the training length)", "fine-tune steps",
                            "perplexity", series))
    return plots.save_panels(path, panels, panel_size=(6.0, 4.2)) if panels else None
