"""``fibattn report GRID``: the study's tables and plots for a grid's results.

    fibattn report demo                       # runs/demo -> runs/demo/report/{report.md,report.html,*.png}
    fibattn report paper --root runs/paper --out paper-report

Tables: the main table (rows W, columns fixed / learned / linear / coprime / pow2 + linear,
cells perplexity per dataset at the training length, "FW / WP"), the extrapolation table
(1×, 2×, 4× the training length with % change from 1×), seed spread, the headline check
(dense at 4× vs the sparse variants: :mod:`fibattn.study.headline`) and — where run names match
the study's — ours / study / Δ against method.md §5 (:mod:`fibattn.study.published`). Tables are
built from :class:`RunResult` lists, so they can be checked on synthetic numbers.
"""
from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from . import published as S
from .controls import control_blocks, matched_cells
from .grid import VARIANT_TITLES, control_title
from .headline import check_table, headline_check, headline_factor
from .labels import evaluated_count, set_labels
from ..checks import ConfigError, UsageError
from .pages import Heading, Image, Table, Text, fmt_pct, fmt_ppl, pct_change  # noqa: F401
from ..storage.results import eval_ppls
from ..storage.runs import EVAL_JSON, read_eval_doc

log = logging.getLogger("fibattn")

COLUMNS = ("fixed", "learned", "linear", "coprime", "pow2+linear", "window", "window_matched")
COLUMN_TITLES = {"fixed": "fixed", "learned": "learned", "linear": "linear (stagger)", "coprime": "coprime (HDC)",
                 "pow2+linear": "pow2 linear", "window": "window (rungs off)", "window_matched": "window (matched cost)"}


@dataclass
class RunResult:
    """One run's numbers. ``ppl``: ``{(dataset, length): perplexity}``."""

    name: str
    variant: str                     # dense | fixed | learned | linear | coprime | custom | pow2+<schedule> | ...
    window: int | None               # None for dense
    seed: int = 42
    train_len: int = 1024
    ppl: dict = field(default_factory=dict)
    alphas: list | None = None       # final alpha per layer (learned runs)
    positions: dict = field(default_factory=dict)   # (dataset, length) -> [{start, end, loss}] buckets
    model: object = None             # the run's ModelConfig (for the distance picture)
    alpha_line: str = ""             # learned runs: the alpha report's "largest move" line
    steps: int = 0                   # training steps
    mode: str = ""                   # a dense baseline mode of the same model (eval.dense_modes); "" = its own
    init_from: str = ""              # the grid run whose weights started this one (retrofit), if any
    label: str = ""                  # the name tables show (set_labels); "" = the run name

    def get(self, dataset: str, length: int) -> float | None:
        return self.ppl.get((dataset, length))

    def lengths(self) -> list[int]:
        return sorted({n for _, n in self.ppl})


def variant_of(model) -> str:
    """``dense``, ``window`` (no rungs: alpha is inert), the schedule name on the fib base, or ``<base>+<schedule>``."""
    if model.attention == "dense":
        return "dense"
    if model.base == "none":
        return "window"
    return model.schedule if model.base == "fib" else f"{model.base}+{model.schedule}"


# ------------------------------------------------------------------------------ formatting
def abbrev(dataset: str) -> str:
    return S.DATASET_ABBREV.get(dataset, dataset)


def datasets_of(results: list[RunResult]) -> list[str]:
    found = sorted({d for r in results for d, _ in r.ppl})
    study = [d for d in ("fineweb_edu", "wikipedia") if d in found]
    return study or found


def primary(results: list[RunResult]) -> list[RunResult]:
    """One run per (variant, window) trained from scratch: the lowest seed (replicates go to the seed
    table; fine-tunes of another run to the retrofit table)."""
    results = [r for r in results if not r.init_from]
    best: dict = {}
    for r in results:
        key = (r.variant, r.window)
        if key not in best or r.seed < best[key].seed:
            best[key] = r
    return [r for r in results if best[(r.variant, r.window)] is r]


def train_len_of(results: list[RunResult]) -> int:
    lens = [r.train_len for r in results]
    return max(set(lens), key=lens.count) if lens else 0


# ------------------------------------------------------------------------------ tables
def _cell(r: RunResult | None, datasets: list[str], length: int) -> str:
    if r is None:
        return "—"
    return " / ".join(fmt_ppl(r.get(d, length)) for d in datasets)


def main_table(results: list[RunResult], datasets: list[str]) -> Table:
    """Rows W, columns the five schedules, cells "FW / WP" perplexity at the training length."""
    prim = primary(results)
    T = train_len_of(prim)
    by = {(r.variant, r.window): r for r in prim}
    by.update(matched_cells(prim))           # row W's matched-cost window has a W of its own
    windows = sorted({r.window for r in prim if r.window is not None and r.variant in COLUMNS[:5]})
    names = " / ".join(abbrev(d) for d in datasets)
    table = Table(f"Perplexity at the training length {T} ({names})", ["W"] + [COLUMN_TITLES[c] for c in COLUMNS])
    for i, w in enumerate(windows):
        row = [str(w)] + [_cell(by.get((c, w)), datasets, T) for c in COLUMNS]
        table.rows.append(row)
        scores = [(by[(c, w)].get(datasets[0], T), j + 1) for j, c in enumerate(COLUMNS)
                  if (c, w) in by and by[(c, w)].get(datasets[0], T) is not None]
        if len(scores) > 1:
            table.bold.add((i, min(scores)[1]))
    placed = {id(by[(c, w)]) for c in COLUMNS for w in windows if (c, w) in by}
    extras = [r for r in prim if id(r) not in placed]
    notes = [f"{label_of(r)}: {_cell(r, datasets, T)}" for r in sorted(extras, key=lambda r: (r.variant, r.window or 0))]
    table.note = ("Bold: lowest " + abbrev(datasets[0]) + " perplexity in the row. " if table.bold else "") + \
        ("; ".join(notes) + "." if notes else "")
    return table


def label_of(r: RunResult) -> str:
    if r.variant == "dense":
        return "dense"
    v = (control_title(r.name) or "window only") if r.variant == "window" else \
        VARIANT_TITLES.get(r.variant, r.variant.replace("+", " + "))
    return f"{v}, W={r.window}"


def extrapolation_table(results: list[RunResult], datasets: list[str]) -> Table:
    """Every run at every evaluated length, % change from the training length."""
    lengths = sorted({n for r in results for n in r.lengths()})
    T = train_len_of(results)
    header = ["model"]
    for d in datasets:
        for n in lengths:
            mult = f"{n / T:g}×" if T else ""
            header.append(f"{abbrev(d)} {n} ({mult})")
    table = Table("Length extrapolation (no fine-tuning): perplexity, % change from the training length", header)
    for r in results:
        row = [r.label or (f"{r.name} ({label_of(r)})" if r.variant == "window" else r.name)]
        for d in datasets:
            base = r.get(d, r.train_len)
            for n in lengths:
                v = r.get(d, n)
                row.append(fmt_ppl(v) if n == r.train_len or v is None else f"{fmt_ppl(v)} ({fmt_pct(pct_change(base, v))})")
        table.rows.append(row)
    table.note = ("A model whose perplexity falls past the training length is using the longer context, not "
                  "overfitting the short one: every length scores its tokens in windows of that length, so at "
                  "4× the average scored token has four times the earlier tokens before it, and a model that "
                  "attends only distances it was trained on (the sparse schedules, a sliding window) turns that "
                  "extra context into better predictions. Dense attention meets distances it never saw and rises "
                  "instead.")
    return table


def seed_table(results: list[RunResult], datasets: list[str]) -> Table | None:
    """Groups with more than one seed: per-seed cells, mean ± sd of the first dataset."""
    groups: dict = {}
    for r in results:
        groups.setdefault((r.variant, r.window), []).append(r)
    groups = {k: sorted(v, key=lambda r: r.seed) for k, v in groups.items() if len(v) > 1}
    if not groups:
        return None
    seeds = sorted({r.seed for v in groups.values() for r in v})
    T = train_len_of(results)
    names = " / ".join(abbrev(d) for d in datasets)
    table = Table(f"Seed replicates at length {T} ({names})", ["model"] + [f"seed {s}" for s in seeds]
                  + [f"{abbrev(datasets[0])} mean ± sd"])
    for (variant, window), runs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        by_seed = {r.seed: r for r in runs}
        vals = [r.get(datasets[0], T) for r in runs if r.get(datasets[0], T) is not None]
        spread = (f"{statistics.mean(vals):.2f} ± {statistics.stdev(vals):.2f}" if len(vals) > 1 else "—")
        table.rows.append([label_of(runs[0])] + [_cell(by_seed.get(s), datasets, T) for s in seeds] + [spread])
    return table


def _vs(ours: float | None, study: float | None) -> str:
    return f"{fmt_ppl(ours)} / {fmt_ppl(study)} / {fmt_pct(pct_change(study, ours))}"


def study_table(results: list[RunResult]) -> Table | None:
    """Ours / study / Δ (our value relative to the study's) for runs named as in the study."""
    rows = [r for r in results if r.train_len == S.TRAIN_LEN and S.study_ppl(r.name, "fineweb_edu", S.TRAIN_LEN)
            is not None]
    if not rows:
        return None
    L = S.TRAIN_LEN
    header = ["model", f"FW {L}", f"WP {L}", f"TS {L}", f"FW {4 * L}", "FW change at 4×"]
    table = Table("Ours vs the study (method.md §5): ours / study / Δ", header,
                  note="Δ is our perplexity relative to the study's. The change column is ours / study. "
                       "TinyStories is reported by the study for the W=12 seed table only.")
    for r in rows:
        change_ours = pct_change(r.get("fineweb_edu", L), r.get("fineweb_edu", 4 * L))
        change_study = pct_change(S.study_ppl(r.name, "fineweb_edu", L), S.study_ppl(r.name, "fineweb_edu", 4 * L))
        table.rows.append([r.name]
                          + [_vs(r.get(d, L), S.study_ppl(r.name, d, L)) for d in ("fineweb_edu", "wikipedia",
                                                                                       "tinystories")]
                          + [_vs(r.get("fineweb_edu", 4 * L), S.study_ppl(r.name, "fineweb_edu", 4 * L)),
                             f"{fmt_pct(change_ours)} / {fmt_pct(change_study)}"])
    return table


# ------------------------------------------------------------------------------ collect
def _eval_doc(run_dir: Path) -> dict:
    try:
        return read_eval_doc(run_dir / EVAL_JSON) or {}
    except ValueError as exc:
        log.warning("fibattn report: %s; per-position loss and alphas of that run skipped", exc)
        return {}


def collect(grid, root) -> list[RunResult]:
    """Every run of ``grid`` under ``root`` with its evaluation (runs without results have empty ``ppl``)."""
    from ..eval.modes import mode_name
    from .runner import db_path
    out = []
    for run in grid.runs:
        cfg = grid.config(run, root)
        m = cfg.model
        r = RunResult(run.name, variant_of(m), None if m.attention == "dense" else m.window, cfg.train.seed,
                      m.seq_len, model=m, steps=cfg.train.steps, init_from=run.init_from)
        mode = mode_name("none", cfg.eval.reach, documents=cfg.eval.document_masking)
        for dataset, length, ppl in eval_ppls(db_path(cfg), run.name, mode):
            r.ppl[(dataset, length)] = ppl
        doc = _eval_doc(Path(cfg.train.out_dir))
        for rec in doc.get("results", []):
            if rec.get("mode") == mode and rec.get("buckets"):
                r.positions[(rec["dataset"], int(rec["length"]))] = rec["buckets"]
        if isinstance(doc.get("alphas"), dict):
            r.alphas = [float(a) for a in doc["alphas"].get("end", [])] or None
            r.alpha_line = doc["alphas"].get("largest_move_line", "")
        out.append(r)
        if m.attention == "dense":
            out += _baselines(run, cfg)
    set_labels(out)
    return out



BASELINE_LABELS = {"linear": "RoPE linear", "ntk": "RoPE NTK", "yarn": "YaRN", "window": "sliding window"}


def _baselines(run, cfg) -> list[RunResult]:
    """One row per ``eval.dense_modes`` entry of a dense run: the same model evaluated in that mode."""
    from ..eval.modes import mode_name
    from .runner import db_path
    m, rows = cfg.model, []
    for dm in cfg.eval.dense_modes:
        r = RunResult(f"{run.name} + {BASELINE_LABELS.get(dm, dm)}", f"dense+{dm}", None, cfg.train.seed, m.seq_len,
                      model=m, steps=cfg.train.steps, mode=dm)
        for dataset, length, ppl in eval_ppls(db_path(cfg), run.name, mode_name(dm, cfg.eval.reach, documents=cfg.eval.document_masking)):
            r.ppl[(dataset, length)] = ppl
        rows.append(r)
    return rows


# ------------------------------------------------------------------------------ the report
@dataclass
class ReportFiles:
    markdown: Path
    html: Path
    images: list
    tables: list                     # the Table objects (the demo prints them)
    checks: list                     # the headline check (empty without a run at >= 2× the training length)
    datasets: list
    factor: int | None               # the headline check's length multiple
    results: list


def build_blocks(grid_name: str, results: list[RunResult], datasets: list[str], images,
                 settings: list | None = None) -> tuple[list, list, list]:
    done = [r for r in results if r.ppl]
    blocks: list = [Text(f"Grid `{grid_name}`: {evaluated_count(results)}. Perplexity is token-level "
                         f"(exp of the mean loss over every position of back-to-back windows; the same tokens at "
                         f"every length). Datasets: {', '.join(d if abbrev(d) == d else f'{abbrev(d)} = {d}' for d in datasets)}.")]
    own = [r for r in done if not r.mode]           # the dense baselines go to the extrapolation table only
    tables = [main_table(own, datasets)] if own else []
    study = study_table(results)
    if study is not None:
        tables.append(study)
    if done:
        tables.append(extrapolation_table(done, datasets))
    seeds = seed_table(done, datasets) if done else None
    if seeds is not None:
        tables.append(seeds)
    versus, controls = control_blocks(primary(own), datasets)
    tables += controls
    checks, factor = [], headline_factor(done)
    if factor and datasets:
        checks = headline_check(primary(own), datasets[0], factor)
        tables.append(check_table(checks, datasets[0], factor))
    from .retrofit_report import retrofit_table, retrofits
    retro = retrofits(done)
    if retro and datasets and factor:
        tables.append(retrofit_table(retro, datasets[0], factor))
    if settings:
        blocks += [Heading("Settings")] + settings
    blocks += versus
    blocks += [Heading("Tables")] + tables
    lines = [f"{r.name}: {r.alpha_line}" for r in results if r.alpha_line]
    if lines:
        blocks += [Heading("Learned alphas"), Text("\n\n".join(lines))]
    if images:
        blocks.append(Heading("Plots"))
        blocks += [Image(p, c) for p, c in images]
    return blocks, tables, checks


def _retrofit_image(results, datasets, out: Path) -> list:
    from .retrofit_report import retrofit_plot, retrofits
    done = [r for r in results if r.ppl]
    items, factor = retrofits(done), headline_factor(done)
    if not (items and datasets and factor):
        return []
    png = retrofit_plot(items, datasets[0], factor, out / "retrofit.png")
    return [(png, "Retrofit: perplexity against fine-tune steps; dashed: trained from scratch and the dense "
                  "source")] if png else []


def build_report(grid, root, out=None, *, datasets: list[str] | None = None, plot: bool = True) -> ReportFiles:
    """Collect ``grid``'s results under ``root`` and write ``report.md``, ``report.html`` and PNGs to ``out``."""
    from . import figures as report_plots
    from ..files import atomic_write_text
    from .pages import to_html, to_markdown
    root = Path(root)
    out = Path(out) if out is not None else root / grid.report_dir
    results = collect(grid, root)
    if not any(r.ppl for r in results):        # an empty report would read as a finished study
        names = grid.names()
        raise ConfigError(f"--root {root} holds no evaluated run of grid {grid.name} (runs "
                          f"{', '.join(names[:4])}{', ...' if len(names) > 4 else ''}): nothing to report; "
                          f"run `fibattn grid {grid.name} --root {root}` first")
    found = datasets_of(results)
    if datasets:
        bad = [d for d in datasets if d not in found]
        if bad:
            raise UsageError(f"--datasets: no results for {bad[0]!r} (evaluated: {', '.join(found) or 'none'})")
    out.mkdir(parents=True, exist_ok=True)                 # only once the request is known to make sense
    ds = list(datasets or found)
    images = report_plots.draw_all(primary([r for r in results if r.ppl]), ds, out) if plot else []
    images += _retrofit_image(results, ds, out) if plot else []
    from .settings import settings_blocks
    blocks, tables, checks = build_blocks(grid.name, results, ds, images, settings_blocks(grid, root))
    title = f"fibattn report: grid {grid.name}"
    md, page = out / "report.md", out / "report.html"
    atomic_write_text(md, to_markdown(title, blocks, out))
    atomic_write_text(page, to_html(title, blocks))
    return ReportFiles(md, page, [p for p, _ in images], tables, checks, ds,
                       headline_factor([r for r in results if r.ppl]), results)
