"""The names the report and the demo show for runs (one vocabulary with the README), and the count
of evaluated runs (issue 28).

The titles live beside the variant definitions (:data:`fibattn.study.grid.VARIANT_TITLES`,
``CONTROL_TITLES``); this module makes them unique within one set of results.
"""
from __future__ import annotations

from collections import Counter

from .grid import run_title


def set_labels(results) -> None:
    """Each result's ``label``: its variant's title (``fib coprime (HDC)``), then ``, W=..`` where runs
    share a title and ``, seed ..`` where they still do; dense baselines (``dense + YaRN``) and fine-tunes
    keep their run names, and so does any run whose label would still not be unique."""
    for r in results:
        r.label = r.name if r.mode or r.init_from else run_title(r.name, r.variant)
    for more in (lambda r: f", W={r.window}", lambda r: f", seed {r.seed}"):
        seen = Counter(r.label for r in results)
        for r in results:
            if seen[r.label] > 1 and r.label != r.name and r.window is not None:
                r.label += more(r)
    seen = Counter(r.label for r in results)
    for r in results:
        r.label = r.label if seen[r.label] == 1 else r.name


def evaluated_count(results) -> str:
    """``9 of 9 runs evaluated (the dense runs also in 4 evaluation modes)``: a dense baseline mode
    (``eval.dense_modes``) is another evaluation of a run, not a run."""
    runs, modes = [r for r in results if not r.mode], {r.mode for r in results if r.mode and r.ppl}
    also = f" (the dense runs also in {len(modes)} evaluation modes)" if modes else ""
    return f"{sum(bool(r.ppl) for r in runs)} of {len(runs)} runs evaluated{also}"
