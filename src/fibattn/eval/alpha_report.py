"""The alpha report of a learned schedule: per-layer alpha at the start, during training, at the end.

Sources: the start is the config's schedule (``learned_init``; method.md §2); the trajectory is
the results DB's ``alphas`` table for the run, or, when the DB has none, the ``alphas``
field of ``metrics.jsonl`` (the source is stated in the report); the end is the loaded
model's alphas at its checkpoint step. Layers are numbered from 0, as in method.md §2.

Outputs: a markdown table (:meth:`AlphaReport.markdown`), one line naming the largest move
from the start (:meth:`AlphaReport.largest_move_line`, e.g. ``largest move from start:
layer 3, 1.000 → 1.042 (+0.042)``) and a PNG of alpha vs step per layer (:func:`plot_report`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from ..checks import UsageError
from ..files import TextFileError, atomic_write_text, parse_json

log = logging.getLogger("fibattn")

ALPHAS_MD = "alphas.md"
ALPHAS_PNG = "alphas.png"


@dataclass
class AlphaReport:
    run: str
    start: list
    end: list
    history: list = field(default_factory=list)      # [(step, [alpha per layer])], ascending steps
    end_step: int | None = None
    source: str = "none"                               # results DB | metrics.jsonl | none

    def __post_init__(self):
        n = len(self.start)
        if n < 1 or len(self.end) != n:
            raise UsageError(f"alpha report needs one start and one end value per layer, got {len(self.start)} "
                             f"start and {len(self.end)} end values")
        for step, values in self.history:
            if len(values) != n:
                raise UsageError(f"alpha history at step {step} has {len(values)} layers, expected {n}")
        self.history = sorted((int(s), [float(a) for a in v]) for s, v in self.history)

    @property
    def n_layers(self) -> int:
        return len(self.start)

    def moves(self) -> list[float]:
        """``end - start`` per layer."""
        return [e - s for s, e in zip(self.start, self.end)]

    def max_excursion(self) -> list[float]:
        """Largest ``|alpha - start|`` per layer over the logged history and the end."""
        rows = [v for _, v in self.history] + [self.end]
        return [max(abs(r[i] - s) for r in rows) for i, s in enumerate(self.start)]

    def largest_move(self) -> tuple[int, float, float, float]:
        """``(layer, start, end, end - start)`` of the layer whose end is furthest from its start."""
        moves = self.moves()
        layer = max(range(self.n_layers), key=lambda i: (abs(moves[i]), -i))
        return layer, self.start[layer], self.end[layer], moves[layer]

    def largest_move_line(self) -> str:
        layer, a, b, d = self.largest_move()
        return f"largest move from start: layer {layer}, {a:.3f} → {b:.3f} ({d:+.3f})"

    def _columns(self, max_steps: int) -> list[tuple[int, list[float]]]:
        hist = [(s, v) for s, v in self.history if self.end_step is None or s < self.end_step]
        if len(hist) <= max_steps:
            return hist
        picks = sorted({round(i * (len(hist) - 1) / (max_steps - 1)) for i in range(max_steps)})
        return [hist[i] for i in picks]

    def markdown(self, max_steps: int = 4) -> str:
        """Table: layer | start | a few logged steps | end | move | max |move| during training."""
        cols = self._columns(max_steps)
        end = f"end (step {self.end_step})" if self.end_step is not None else "end"
        head = ["layer", "start"] + [f"step {s}" for s, _ in cols] + [end, "move", "max |move|"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        exc = self.max_excursion()
        for i in range(self.n_layers):
            cells = [str(i), f"{self.start[i]:.4f}"] + [f"{v[i]:.4f}" for _, v in cols]
            cells += [f"{self.end[i]:.4f}", f"{self.end[i] - self.start[i]:+.4f}", f"{exc[i]:.4f}"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        lines.append(self.largest_move_line())
        lines.append(f"(trajectory from {self.source}; {len(self.history)} logged steps)")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        layer, a, b, d = self.largest_move()
        return {"run": self.run, "start": self.start, "end": self.end, "end_step": self.end_step,
                "history": [[s, v] for s, v in self.history], "source": self.source,
                "largest_move": {"layer": layer, "start": a, "end": b, "delta": d},
                "largest_move_line": self.largest_move_line()}


# ----------------------------------------------------------------------------- history sources
def history_from_db(db_path, run: str) -> list:
    from ..storage.results import ResultsDB
    if db_path is None or not Path(db_path).is_file():
        return []
    with ResultsDB(db_path) as db:
        return sorted(db.alphas(run).items())


def history_from_metrics(path) -> list:
    """``[(step, alphas)]`` from the records of a ``metrics.jsonl`` that carry ``alphas``."""
    path = Path(path)
    if not path.is_file():
        return []
    out = {}
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = parse_json(line)
        except TextFileError as exc:           # the cause (binary data, a cut line, ...), with the line
            raise UsageError(f"{path}: line {n} is not JSON: {exc}") from None
        if isinstance(rec, dict) and "alphas" in rec and "step" in rec:
            out[int(rec["step"])] = [float(a) for a in rec["alphas"]]
    return sorted(out.items())


def load_history(run_dir, db_path=None) -> tuple[list, str]:
    """The logged trajectory of a run folder and where it came from."""
    from ..storage.results import run_key
    hist = history_from_db(db_path, run_key(run_dir))
    if hist:
        return hist, f"results DB {db_path}"
    hist = history_from_metrics(Path(run_dir) / "metrics.jsonl")
    if hist:
        return hist, "metrics.jsonl"
    return [], "none (no alphas logged)"


def is_learned(model_cfg) -> bool:
    return model_cfg.attention == "sparse" and model_cfg.schedule == "learned"


def report_for_run(run_dir, model, cfg, *, db_path=None, end_step: int | None = None) -> AlphaReport:
    """The alpha report of a learned run: start from ``cfg``, trajectory logged, end from ``model``."""
    from ..model.attention import config_layer_alphas
    from ..storage.results import run_key
    if not is_learned(cfg.model):
        raise UsageError(f"the alpha report needs a learned schedule (model.schedule=learned), "
                         f"this run has model.schedule={cfg.model.schedule!r}")
    hist, source = load_history(run_dir, db_path)
    return AlphaReport(run=run_key(run_dir), start=config_layer_alphas(cfg.model), end=list(model.alphas()),
                       history=hist, end_step=end_step, source=source)


# ----------------------------------------------------------------------------- outputs
def plot_report(report: AlphaReport, path) -> Path:
    """PNG: alpha vs step, one line per layer (step 0 = start, last point = end)."""
    from ..plots import Panel, Series, save_panels
    series = []
    end_step = report.end_step if report.end_step is not None else (report.history[-1][0] if report.history else 1)
    for i in range(report.n_layers):
        pts = {0: report.start[i]}
        pts.update({s: v[i] for s, v in report.history})
        pts[end_step] = report.end[i]
        xs = sorted(pts)
        series.append(Series(f"layer {i}", xs, [pts[x] for x in xs], marker="." if len(xs) < 30 else ""))
    panel = Panel(f"alpha per layer — {report.run}", "step", "alpha", series)
    return save_panels(path, [panel], suptitle=report.largest_move_line(), panel_size=(7.0, 4.2))


def write_report(report: AlphaReport, out_dir, *, plot: bool = True) -> dict:
    """``alphas.md`` (+ ``alphas.png`` when matplotlib is installed) in ``out_dir``; returns the paths."""
    from .. import plots
    out = Path(out_dir)
    paths = {"markdown": out / ALPHAS_MD}
    atomic_write_text(paths["markdown"], report.markdown() + "\n")
    if plot:
        if plots.available():
            paths["png"] = plot_report(report, out / ALPHAS_PNG)
        else:
            plots.warn_unavailable("the alpha plot")
    return paths
