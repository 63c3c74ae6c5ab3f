"""Run ``fibattn probe --extrapolate`` and write its outputs: ``probe_extrapolate.json``,
``probe_extrapolate.md`` (accuracy and reach by variant × length × distance bucket) and
``probe_extrapolate.png`` (a heat map per tested model: distance bucket × length -> accuracy)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from .probe import RETRIEVES, resolve_jobs, run_jobs, write_outputs
from .probe_extrapolate import ExtrapolateConfig, ExtrapolateRow, train_variant
from .probe_reach import bucket_label, distance_buckets

TITLE = "# Retrieval past the training length"


@dataclass
class ExtrapolateReport:
    config: dict
    rows: list = field(default_factory=list)            # ExtrapolateRow, in the config's variant order

    @property
    def lengths(self) -> list[int]:
        return list(self.config["lengths"])

    @property
    def labels(self) -> list[str]:
        """Every bucket label up to the longest length, shortest distances first."""
        return [bucket_label(b) for b in distance_buckets(max(self.lengths) - 2)]

    def _grid(self, head: list[str], cells) -> str:
        rows = ["| " + " | ".join(head + self.labels) + " |", "|" + "---|" * (len(head) + len(self.labels))]
        for r in self.rows:
            for n in self.lengths:
                got = cells(r, n)
                rows.append("| " + " | ".join([r.name, f"{n} ({n // self.config['seq_len']}×)"]
                                              + [got.get(lab, "—") for lab in self.labels]) + " |")
        return "\n".join(rows)

    def accuracy_table(self) -> str:
        return self._grid(["model", "length"], lambda r, n: {k: f"{a:.2f}" for k, a in r.accuracy[n].items()})

    def reach_table(self) -> str:
        """Reachable share of each bucket, and the smallest unreachable distance (— if none)."""
        table = self._grid(["model", "length"], lambda r, n: {k: f"{c:.0%}" for k, c in r.coverage[n].items()})
        lines = table.splitlines()
        lines[0] += " smallest unreachable |"
        lines[1] += "---|"
        i = 2
        for r in self.rows:
            for n in self.lengths:
                lines[i] += f" {r.unreachable[n] if r.unreachable[n] is not None else '—'} |"
                i += 1
        return "\n".join(lines)

    def summary(self) -> list[str]:
        c = self.config
        lines = [f"chance accuracy {1 / c['n_values']:.3f}; a bucket is 'retrieved' at accuracy >= {RETRIEVES}; "
                 f"trained at T = {c['seq_len']} on distances 1..{c['seq_len'] - 2}"]
        for r in self.rows:
            far = []
            for n in self.lengths:
                ok = [lab for lab, a in r.accuracy[n].items() if a >= RETRIEVES]
                far.append(f"{n}: {ok[-1] if ok else 'none'}")
            kind = "dense" if r.window is None else f"window {r.window}"
            lines.append(f"{r.name} ({kind}, loss {r.final_loss:.3f}): farthest retrieved bucket by "
                         f"length — {', '.join(far)}")
        return lines

    def markdown(self) -> str:
        c = self.config
        m = c["model"]
        head = (f"{TITLE}\n\ntrain: plain task at T = {c['seq_len']}, distances 1..{c['seq_len'] - 2}, "
                f"{c['n_layers']} layers, d_model {m['d_model']}, {m['n_heads']} heads, window {m['window']} "
                f"(window_matched: {c['matched_window']}), fib base k = {m['base_k']}, reach {c['reach']}; "
                f"{c['steps']} steps × {c['batch_size']}, seed {c['seed']}; test: lengths {self.lengths}, "
                f"{c['eval_samples']} samples per distance bucket (power-of-two buckets; the last one of a length "
                f"is cut at length - 2); dense also with RoPE scaling {', '.join(c['scalings']) or 'none'}")
        return "\n\n".join([head, "## Accuracy", self.accuracy_table(),
                            "## Reach in principle (sums of one attended distance per layer)", self.reach_table(),
                            "\n".join(f"- {s}" for s in self.summary())])

    def to_dict(self) -> dict:
        return {"config": self.config, "rows": [dataclasses.asdict(r) for r in self.rows], "summary": self.summary()}


def plot_report(report: ExtrapolateReport, path) -> Path:
    """One heat map per tested model: buckets down, lengths across, accuracy as colour and text;
    a cell whose distances are not all reachable in principle also shows the reachable share."""
    import numpy as np

    from ..plots import require, save_figure
    plt = require()
    labels, lengths = report.labels, report.lengths
    cols = min(3, len(report.rows))
    nrows = -(-len(report.rows) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(1.2 + 1.2 * len(lengths) * cols, 0.6 + 0.35 * len(labels) * nrows),
                             squeeze=False)
    for ax in axes.flat[len(report.rows):]:
        ax.axis("off")
    for ax, r in zip(axes.flat, report.rows):
        grid = np.array([[r.accuracy[n].get(lab, np.nan) for n in lengths] for lab in labels])
        ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto", origin="lower")
        for i, lab in enumerate(labels):
            for j, n in enumerate(lengths):
                if lab in r.accuracy[n]:
                    cov = r.coverage[n][lab]
                    text = f"{grid[i, j]:.2f}" + ("" if cov == 1.0 else f"\nr{cov:.0%}")
                    ax.text(j, i, text, ha="center", va="center", fontsize=6,
                            color="black" if grid[i, j] > 0.6 else "white")
        ax.set_xticks(range(len(lengths)))
        ax.set_xticklabels([str(n) for n in lengths])
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=7)
        ax.set_title(r.name, fontsize=9)
        ax.set_xlabel("length")
        ax.set_ylabel("distance bucket")
    fig.suptitle(f"retrieval accuracy past the training length T = {report.config['seq_len']} (colour: 0 dark "
                 f"to 1 light; r: share reachable in principle)", fontsize=10)
    return save_figure(fig, path)


def run_extrapolate(cfg: ExtrapolateConfig, out_dir=None, *, plot: bool = True, echo=print,
                    jobs: int = 1) -> ExtrapolateReport:
    """Train and test every variant (``jobs`` worker processes); write the outputs to ``out_dir``."""
    cfg.validate()
    report = ExtrapolateReport(cfg.to_dict())
    done: dict = {}

    def collect(rows: list[ExtrapolateRow]) -> None:
        done[rows[0].variant] = rows
        for r in rows:
            acc = " | ".join(f"{n}: " + " ".join(f"{a:.2f}" for a in r.accuracy[n].values()) for n in cfg.lengths)
            echo(f"{r.name}: loss {r.final_loss:.3f} | accuracy by bucket at {acc} | {r.seconds:.0f}s "
                 f"({r.cpu_seconds:.0f}s CPU)")

    todo = [(cfg, v, True) for v in sorted(cfg.variants, key=lambda v: v != "dense")]    # dense is the slowest
    run_jobs(train_variant, todo, resolve_jobs(jobs, cfg, len(todo)), collect)
    report.rows = [r for v in cfg.variants for r in done[v]]
    if out_dir is not None:
        write_outputs(report, out_dir, "probe_extrapolate", plot_report if plot else None,
                      "the extrapolation probe plot")
    return report
