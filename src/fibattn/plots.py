"""Shared matplotlib helpers: the Agg backend, imported lazily (optional extra ``plot``).

A figure is described by data, not by matplotlib calls: a list of :class:`Panel`, each
holding :class:`Series` drawn as lines (``kind="line"``) or grouped bars (``kind="bar"``).
:func:`save_panels` draws them side by side and writes the PNG atomically.

Callers that plot by default check :func:`available` first and log (once) that plots are
skipped when matplotlib is missing; :func:`require` raises an ImportError naming the extra.
"""
from __future__ import annotations

import io
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from .checks import UsageError
from .files import atomic_write_bytes

log = logging.getLogger("fibattn")
PLOT_EXTRA = "pip install 'fibattn[plot]'"
_warned: set = set()


@dataclass
class Series:
    label: str
    x: Sequence
    y: Sequence
    marker: str = ""
    linestyle: str = "-"


@dataclass
class Panel:
    title: str
    xlabel: str
    ylabel: str
    series: list = field(default_factory=list)
    kind: str = "line"              # line | bar (bar: x holds category labels, shared by every series)
    hline: float | None = None      # a dotted reference line (e.g. chance level, or the start alpha)
    hline_label: str = ""
    logx: bool = False
    logy: bool = False
    ylim: tuple | None = None       # (low, high)
    vline: float | None = None      # a dashed vertical marker (e.g. the training length)
    vline_label: str = ""
    integer_x: bool = False         # ticks on whole numbers only (layers)


def available() -> bool:
    """True when matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def warn_unavailable(what: str) -> None:
    """Log once per ``what`` that a PNG is skipped because matplotlib is missing."""
    if what not in _warned:
        _warned.add(what)
        log.warning("fibattn: matplotlib is not installed, %s skipped (%s)", what, PLOT_EXTRA)


def require():
    """``matplotlib.pyplot`` on the Agg backend, or an ImportError naming the extra."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(f"plots need matplotlib: {PLOT_EXTRA}") from exc
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def colours(panels: list[Panel]) -> dict:
    """One colour per series label across all ``panels`` of a figure, so that a model keeps its colour in every
    panel (one panel leaving a series out must not shift the others'); tab20 past 10 labels, where the default
    cycle would repeat."""
    import matplotlib
    labels = list(dict.fromkeys(s.label for p in panels for s in p.series))
    palette = matplotlib.colormaps["tab20" if len(labels) > 10 else "tab10"].colors
    return {label: palette[i % len(palette)] for i, label in enumerate(labels)}


def _draw_line(ax, panel: Panel, colour: dict) -> None:
    for s in panel.series:
        ax.plot(list(s.x), list(s.y), label=s.label, marker=s.marker or None, linestyle=s.linestyle,
                color=colour.get(s.label))
    if panel.logx:
        ax.set_xscale("log", base=2)
    if panel.logy:
        from matplotlib.ticker import FuncFormatter
        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")           # 40, not 4×10^1
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)


def _draw_bar(ax, panel: Panel, colour: dict) -> None:
    n = max(1, len(panel.series))
    cats = list(panel.series[0].x) if panel.series else []
    width = 0.8 / n
    for i, s in enumerate(panel.series):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(cats))]
        ax.bar(xs, list(s.y), width=width, label=s.label, color=colour.get(s.label))
    ax.set_xticks(range(len(cats)))
    ax.set_xticklabels([str(c) for c in cats])


def save_panels(path, panels: list[Panel], *, suptitle: str = "", panel_size=(5.0, 3.6)) -> Path:
    """Draw ``panels`` in one row and write a PNG to ``path`` (atomic); returns the path."""
    if not panels:
        raise UsageError("save_panels needs at least one panel")
    plt = require()
    fig, axes = plt.subplots(1, len(panels), figsize=(panel_size[0] * len(panels), panel_size[1]), squeeze=False)
    try:
        colour = colours(panels)
        for ax, panel in zip(axes[0], panels):
            if panel.kind == "bar":
                _draw_bar(ax, panel, colour)
            elif panel.kind == "line":
                _draw_line(ax, panel, colour)
            else:
                raise UsageError(f"panel kind must be line or bar, got {panel.kind!r}")
            if panel.hline is not None:
                ax.axhline(panel.hline, color="grey", linestyle=":", linewidth=1, label=panel.hline_label or None)
            if panel.vline is not None:
                ax.axvline(panel.vline, color="black", linestyle="--", linewidth=0.8, label=panel.vline_label or None)
            if panel.integer_x:
                from matplotlib.ticker import MaxNLocator
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if panel.ylim is not None:
                ax.set_ylim(*panel.ylim)
            ax.set_title(panel.title, fontsize=10)
            ax.set_xlabel(panel.xlabel)
            ax.set_ylabel(panel.ylabel)
            ax.grid(True, alpha=0.3)
            if panel.series and (len(panel.series) > 1 or panel.hline_label or panel.vline_label):
                if len(panel.series) > 6:          # beside the axes: a long legend would hide the lines
                    ax.legend(fontsize=7, bbox_to_anchor=(1.02, 1), loc="upper left", borderaxespad=0)
                else:
                    ax.legend(fontsize=7)
        if suptitle:
            fig.suptitle(suptitle, fontsize=11)
    except BaseException:
        plt.close(fig)
        raise
    return save_figure(fig, path, dpi=110)


def save_figure(fig, path, *, dpi: int = 110) -> Path:
    """Lay out ``fig``, write it as a PNG atomically and close it."""
    import matplotlib.pyplot as plt
    try:
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return Path(path)
