"""``fibattn demo``: the study's headline on the bundled corpus, on CPU, in minutes.

    fibattn demo                                  # 9 runs under runs/demo, then tables, plots and report
    fibattn demo --only dense,fib_stagger         # a subset (cheap iterations)
    fibattn demo --fresh                          # forget earlier demo runs under --root first

Trains the ``demo`` grid (:func:`fibattn.study.grid.demo_grid`; its setting is
:func:`fibattn.study.grid.demo_setting`): dense attention, six sparse variants and two window-only
controls (no rungs: the fib W, and the W of fib linear's cost per query), evaluates each at
1×, 4×, 16× and 64× the training length (sparse also 256×; the dense model also with RoPE scaling
and a sliding window, method.md §7), writes the report (:mod:`fibattn.study.report`) and states the
headline check: dense perplexity must rise by >= 50 % at 4×, each sparse variant must stay
within ± 5 %. Re-running skips finished runs and resumes interrupted ones.
"""
from __future__ import annotations

import fnmatch
import logging
import shutil
from pathlib import Path

from ..checks import UsageError
from . import report as Rp
from ..storage import results
from .headline import Check

log = logging.getLogger("fibattn")

NOTE = """What this demo can show and what it cannot:
- It can show the length-extrapolation headline at small scale (when the check above passes):
  dense attention trained at {T} tokens breaks down at {L} tokens, while the sparse schedules keep
  their perplexity, because every distance they attend at {L} was already attended in training.
  The exception the study also reports: pow2 bases rebuilt at the evaluation length pick up
  never-trained distances (the study: +11.3 % for pow2 + fixed); `model.reach=train` caps them.
- It asks whether a plain sliding window of the same cost would do as well (window_matched: no
  rungs, as many columns per query at {T} tokens as fib linear; window_rungs_off: fib's W without
  its rungs). A window never attends beyond its W either, so it holds its perplexity too: what
  matters is the level, stated above at 1×, 4× and 64× (one seed: a gap of a percent or two may be seed noise).
- It cannot show the ordering among the sparse schedules (linear ≈ coprime > learned > fixed).
  In the study those gaps are 1-3 % at 60M parameters, 426M tokens and several seeds; at this
  size, with one seed and {steps} steps, they are within seed noise. That needs the `paper`
  grid (`fibattn grid paper`, GPUs) and its seed replicates."""


RETROFIT_NOTE = """What the retrofit demo shows: a dense model trained at {T} tokens for {steps} steps becomes a
sparse one with a short fine-tune (train --init-from; the recipe is in docs/retrofit.md), and the
sparse model keeps its perplexity at {L} tokens where its dense source does not. One seed at this
size: differences of about 1 % between fine-tune lengths are within seed noise."""


def retrofit_lines(files) -> list[str]:
    """The retrofit table's goals as PASS/FAIL lines and a verdict (or why they cannot be judged)."""
    from .retrofit_report import retrofit_checks, retrofits
    items = retrofits([r for r in files.results if r.ppl])
    if not (items and files.factor and files.datasets):
        return ["Retrofit check: not available (no fine-tune evaluated at 1× and 2× or more of the training length)"]
    checks = retrofit_checks(items, files.datasets[0], files.factor)
    w = max(len(name) for name, _, _ in checks)
    lines = [f"Retrofit check ({files.datasets[0]}):"]
    lines += [f"  {'PASS' if ok else 'FAIL'}  {name:<{w}}  {detail}" for name, ok, detail in checks]
    lines.append(f"Retrofit: {sum(ok for _, ok, _ in checks)}/{len(checks)} PASS")
    return lines


def extrapolation_lines(results, dataset: str) -> list[str]:
    """What the extrapolation table shows, in numbers: each dense mode's change from 1× at 4× and at
    the longest multiple a dense model was evaluated at, and the sparse models' range there and beyond."""
    rows = [r for r in results if r.ppl and not r.init_from]
    dense = [r for r in rows if r.variant.startswith("dense")]
    sparse = [r for r in rows if not r.variant.startswith("dense") and r.variant != "window"]  # windows: controls
    if not dense or not sparse:
        return []
    T = dense[0].train_len

    def change(r, mult):
        return Rp.pct_change(r.get(dataset, T), r.get(dataset, mult * T))

    def mults(group):
        return sorted({n // T for r in group for d, n in r.ppl if d == dataset and n % T == 0 and n > T})

    far = max(mults(dense), default=None)
    if far is None:
        return []
    shown = sorted({m for m in (4, far) if m in mults(dense)})
    lines = [f"Beyond the training length ({dataset}, change from 1×):"]
    for m in shown:
        parts = ", ".join(f"{r.name} {Rp.fmt_pct(change(r, m))}" for r in sorted(dense, key=lambda r: change(r, m)
                                                                                    if change(r, m) is not None else 1e9))
        lines.append(f"  at {m}× ({m * T} tokens), dense from best to worst: {parts}")
    for m in sorted(set(shown) | set(mults(sparse))):
        ch = [c for c in (change(r, m) for r in sparse) if c is not None]
        if ch and (m in shown or m > far):
            lines.append(f"  at {m}× ({m * T} tokens), the {len(ch)} sparse models: {Rp.fmt_pct(min(ch))} … "
                         f"{Rp.fmt_pct(max(ch))}" + (" (beyond what the dense model was evaluated at)" if m > far else ""))
    return lines


def headline_lines(checks: list[Check], dataset: str, factor: int, train_len: int) -> list[str]:
    """The headline check as text lines with PASS/FAIL marks, and a one-line verdict."""
    lines = [f"Headline check: {dataset} perplexity from {train_len} to {factor * train_len} tokens "
             f"({factor}× the training length)"]
    w = max((len(c.name) for c in checks), default=5)
    for c in checks:
        lines.append(f"  {'PASS' if c.passed else 'FAIL'}  {c.name:<{w}}  {Rp.fmt_ppl(c.short):>8} -> "
                     f"{Rp.fmt_ppl(c.long):>8}  {Rp.fmt_pct(c.change):>10}  goal {c.goal:<13}  study {c.study}")
    n = sum(c.passed for c in checks)
    dense = [c for c in checks if c.name == "dense"]
    sparse = [c for c in checks if c.name != "dense"]
    verdict = f"Headline: {n}/{len(checks)} PASS"
    if dense and sparse:
        verdict += (" — dense degrades and the sparse variants hold" if all(c.passed for c in checks)
                    else " — see FAIL lines above")
    lines.append(verdict)
    return lines


# ------------------------------------------------------------------------------ --fresh
# what fibattn writes into a run folder and a report folder; --fresh removes these and nothing else
RUN_ENTRIES = ("config.json", "metrics.jsonl", "eval.json", "grid.log", "alphas.md", "alphas.png", "tensorboard",
               "checkpoints", "eval_positions_*.png", ".*.tmp", ".write-test-*")
REPORT_ENTRIES = ("report.md", "report.html", "ppl_vs_length.png", "per_position_loss.png", "fib_vs_window.png",
                  "alphas.png",
                  "distances.png", "retrofit.png", ".*.tmp")


def _remove_ours(folder: Path, patterns) -> list[str]:
    """Remove the entries of ``folder`` that match ``patterns`` (and the folder, once empty);
    returns the names of what was kept because fibattn did not write it."""
    kept = []
    for entry in sorted(folder.iterdir()):
        if not any(fnmatch.fnmatchcase(entry.name, pat) for pat in patterns):
            kept.append(entry.name)
        elif entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    if kept:
        log.warning("--fresh: kept %s in %s (not written by fibattn)", ", ".join(kept), folder)
    else:
        folder.rmdir()
    return kept


def forget_runs(grid, root: Path) -> list[str]:
    """Delete the grid's runs (what fibattn wrote in their folders), their database rows and the
    report under ``root``; data, and any file fibattn did not write, are kept."""
    removed = []
    for run in grid.runs:
        folder = root / run.name
        if folder.exists():
            made_by_us = (folder / "config.json").is_file() or (folder / "checkpoints").is_dir() or \
                all(any(fnmatch.fnmatchcase(e.name, pat) for pat in RUN_ENTRIES) for e in folder.iterdir())
            if not made_by_us:
                raise UsageError(f"--fresh: {folder} does not look like a run folder (no config.json or "
                                 f"checkpoints/); remove it yourself or choose another --root")
            removed.append(run.name)
    # the database first: a bad one fails before anything is deleted
    results.forget_runs(root / "results.sqlite", [run.name for run in grid.runs])
    for name in removed:
        _remove_ours(root / name, RUN_ENTRIES)
    if (root / grid.report_dir).is_dir():
        _remove_ours(root / grid.report_dir, REPORT_ENTRIES)
    return removed
