"""The report's PNGs, drawn through :mod:`fibattn.plots` (matplotlib Agg).

- ``ppl_vs_length.png``: perplexity against evaluation length, one line per variant, one panel per dataset,
  each beside a panel of the change from the training length without dense (the sparse curves overlap
  on the first: dense's rise sets its scale);
- ``per_position_loss.png``: mean loss by position in the window at 1× and the longest length the dense
  model was evaluated at (so that its curve is there);
- ``fib_vs_window.png``: fib linear against the window of the same cost (and dense) by position, and
  their difference: where in the context each one wins;
- ``alphas.png``: alpha per layer at the end of training for learned runs (static schedules dashed);
- ``distances.png``: the distances each layer attends at the training length, and their union
  (top row), for each schedule — what each schedule actually looks at.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

from .. import plots
from ..plots import Panel, Series


def _label(r) -> str:
    from .grid import control_title
    title = control_title(r.name) if r.variant == "window" else None
    return getattr(r, "label", "") or (f"{r.name}: {title}, W={r.window}" if title else r.name)


def ppl_vs_length(results, datasets: list[str], path) -> Path | None:
    panels = []
    for d in datasets:
        series, rel = [], []
        for r in results:
            pts = sorted((n, v) for (ds, n), v in r.ppl.items() if ds == d)
            if pts:
                series.append(Series(_label(r), [n for n, _ in pts], [v for _, v in pts], marker="o",
                                     linestyle="--" if r.variant.startswith("dense") else "-"))
            at_t = r.get(d, r.train_len)
            if pts and at_t and not r.variant.startswith("dense"):
                rel.append(Series(_label(r), [n for n, _ in pts], [100.0 * (v / at_t - 1) for _, v in pts], marker="o"))
        if series:
            T = results[0].train_len if results else None
            panels.append(Panel(f"{d}: perplexity vs evaluation length", "evaluation length (tokens)", "perplexity",
                                series, logx=True, logy=True, vline=T,
                                vline_label=f"training length {T}" if T else ""))
        if rel:
            panels.append(Panel(f"{d}: change from the training length (dense left out)", "evaluation length (tokens)",
                                "% change in perplexity", rel, logx=True, hline=0.0))
    return plots.save_panels(path, panels, panel_size=(8.0 if len(results) > 6 else 6.0, 4.2)) if panels else None


def per_position(results, dataset: str, path) -> Path | None:
    """``r.positions[(dataset, length)]`` = list of ``{start, end, loss}`` buckets."""
    lengths = sorted({n for r in results for (d, n) in r.positions if d == dataset})
    if not lengths:
        return None
    dense = sorted({n for r in results if r.variant == "dense" for (d, n) in r.positions if d == dataset})
    picks = sorted({lengths[0], (dense or lengths)[-1]})    # sparse runs also go longer: there dense has no curve
    panels = []
    for n in picks:
        series = []
        for r in results:
            buckets = r.positions.get((dataset, n))
            if buckets:
                xs = [(b["start"] + b["end"] - 1) / 2 + 1 for b in buckets]
                series.append(Series(_label(r), xs, [b["loss"] for b in buckets], marker=".",
                                     linestyle="--" if r.variant.startswith("dense") else "-"))
        if series:
            T = results[0].train_len if results else None
            panels.append(Panel(f"{dataset}, windows of {n}", "position in window (1-based)", "mean loss (nats)",
                                series, logx=True, vline=T if T and T < n else None,
                                vline_label=f"training length {T}" if T and T < n else ""))
    return plots.save_panels(path, panels, panel_size=(6.0, 4.2)) if panels else None


def _curve(r, dataset: str, n: int):
    buckets = r.positions.get((dataset, n)) or []
    return [(b["start"] + b["end"] - 1) / 2 + 1 for b in buckets], [b["loss"] for b in buckets]


def fib_vs_window(results, dataset: str, path) -> Path | None:
    """fib linear, the window of the same cost and dense by position at 1× and the longest length all
    three were evaluated at; a last panel: the window's loss minus fib's (above zero: fib wins there)."""
    from .controls import pairs
    found = [(fib, m) for fib, _, m in pairs(results) if m is not None]
    if not found:
        return None
    fib, matched = max(found, key=lambda p: p[0].window)
    dense = next((r for r in results if r.variant == "dense"), None)
    runs = [r for r in (fib, matched, dense) if r is not None]
    common = sorted(set.intersection(*({n for d, n in r.positions if d == dataset} for r in runs)))
    if not common:
        return None
    picks, T = sorted({common[0], common[-1]}), fib.train_len
    panels, diff = [], []
    for n in picks:
        series = []
        for r in runs:
            xs, ys = _curve(r, dataset, n)
            series.append(Series(_label(r), xs, ys, marker=".", linestyle="--" if r is dense else "-"))
        panels.append(Panel(f"{dataset}, windows of {n}", "position in window (1-based)", "mean loss (nats)", series,
                            logx=True, vline=T if T < n else None, vline_label=f"training length {T}" if T < n else ""))
        (xs, f), (_, w) = _curve(fib, dataset, n), _curve(matched, dataset, n)
        if len(f) == len(w):
            diff.append(Series(f"windows of {n}", xs, [b - a for a, b in zip(f, w)], marker="."))
    if diff:
        panels.append(Panel(f"{matched.name} loss minus {fib.name} loss", "position in window (1-based)",
                            "loss difference (nats; > 0: fib better)", diff, logx=True, hline=0.0,
                            vline=T, vline_label=f"training length {T}"))
    return plots.save_panels(path, panels, panel_size=(6.0, 4.2))


def alphas_per_layer(results, path) -> Path | None:
    from ..model.attention import config_layer_alphas
    learned = [r for r in results if r.alphas]
    if not learned:
        return None
    series = [Series(f"{r.name} (learned, end)", list(range(len(r.alphas))), r.alphas, marker="o") for r in learned]
    m = learned[0].model
    if m is not None:
        for schedule in ("linear", "coprime"):
            ref = config_layer_alphas(_with(m, schedule=schedule))
            series.append(Series(f"{schedule} (static, for reference)", list(range(len(ref))), ref, linestyle=":"))
    start = config_layer_alphas(m)[0] if m is not None and len(set(config_layer_alphas(m))) == 1 else None
    panel = Panel("alpha per layer after training", "layer", "alpha", series, hline=start,
                  hline_label="learned start" if start is not None else "", integer_x=True)
    return plots.save_panels(path, [panel], panel_size=(7.0, 4.2))


def _with(model_cfg, **changes):
    import dataclasses
    return dataclasses.replace(model_cfg, **changes)


def layer_distances(r, seq_len: int | None = None) -> list[list[int]]:
    """Attended distances per layer of a run at ``seq_len`` (default: its training length)."""
    from ..model.attention import config_base, config_layer_alphas
    from ..schedules import attended_distances
    m = r.model
    T = seq_len or m.seq_len
    alphas = r.alphas if (m.schedule == "learned" and r.alphas) else config_layer_alphas(m)
    reach = m.seq_len if m.reach == "train" else None
    return [attended_distances(m.window, a, config_base(m), T, reach=reach) for a in alphas]


def _pick_per_variant(results) -> list:
    chosen: dict = {}
    for r in results:
        if r.model is None or r.variant.startswith("dense") or r.variant == "window":   # window: no rungs to draw
            continue
        if r.variant not in chosen or (r.window or 0) > (chosen[r.variant].window or 0):
            chosen[r.variant] = r
    return list(chosen.values())


def distances(results, path) -> Path | None:
    """One panel per sparse variant (its widest window): ticks at each layer's distances, the union on top."""
    runs = _pick_per_variant(results)
    if not runs:
        return None
    plt = plots.require()
    cols = min(3, len(runs))
    rows = (len(runs) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.8 * rows), squeeze=False)
    try:
        for ax in axes.flat[len(runs):]:
            ax.axis("off")
        for ax, r in zip(axes.flat, runs):
            per_layer = layer_distances(r)
            L = len(per_layer)
            union = sorted({d for ds in per_layer for d in ds})
            for y, ds in list(enumerate(per_layer)) + [(L + 0.5, union)]:
                far = [d for d in ds if d > r.window]
                ax.scatter(far, [y] * len(far), marker="|", s=90, color="black" if y > L else "C0")
            # the window 1..W is every distance there: named in the title, not drawn, so the sparse
            # distances get the width
            far_all = [d for d in union if d > r.window] or [r.window + 1]
            ax.set_xscale("log", base=2)
            ax.set_xlim(r.window + 0.5, max(far_all) * 1.4)
            ticks = [2 ** k for k in range(0, 40) if r.window < 2 ** k <= max(far_all) * 1.4]
            ax.set_xticks(ticks)
            ax.set_xticklabels([str(t) for t in ticks], fontsize=7, rotation=45 if len(ticks) > 8 else 0)
            ax.minorticks_off()
            for i, d in enumerate(d for d in union if d > r.window):      # the union's distances, labelled
                ax.annotate(str(d), (d, L + 0.5), xytext=(0, 7 + 7 * (i % 2)), textcoords="offset points",
                            ha="center", fontsize=6)
            ax.set_yticks(list(range(L)) + [L + 0.5])
            ax.set_yticklabels([str(i) for i in range(L)] + ["union"], fontsize=7)
            ax.set_ylim(-0.7, L + 1.6)
            # three short lines: a title wider than its panel is clipped at the figure's edge
            ax.set_title("\n".join(textwrap.wrap(f"{r.name}: {r.variant}, T={r.model.seq_len}", 44)
                                   + [f"window 1..{r.window} (not drawn)",
                                      f"{len(union)} distinct distances (0..{max(union)})"]), fontsize=9)
            ax.set_xlabel("distance (log scale)")
            ax.set_ylabel("layer")
            ax.grid(True, axis="x", alpha=0.3)
    except BaseException:
        plt.close(fig)
        raise
    return plots.save_figure(fig, path, dpi=100)


def draw_all(results, datasets: list[str], out_dir) -> list[tuple[Path, str]]:
    """Every report PNG that has data, as ``(path, caption)``; none when matplotlib is missing."""
    if not plots.available():
        plots.warn_unavailable("the report plots")
        return []
    out = Path(out_dir)
    items = [
        (ppl_vs_length(results, datasets, out / "ppl_vs_length.png"),
         "Perplexity against evaluation length (dense dashed), and beside it each sparse or window model's change "
         "from the training length (dense left out: its rise would flatten the others)."),
        (per_position(results, datasets[0], out / "per_position_loss.png") if datasets else None,
         f"Per-position loss on {datasets[0] if datasets else ''}: mean loss by position in the window, at 1× and "
         "the longest length the dense model was evaluated at (dense dashed)."),
        (fib_vs_window(results, datasets[0], out / "fib_vs_window.png") if datasets else None,
         f"fib linear against the sliding window of the same cost per query, and dense, on "
         f"{datasets[0] if datasets else ''}: loss by position, and the window's loss minus fib's (above zero: "
         "fib is better at that position)."),
        (alphas_per_layer(results, out / "alphas.png"),
         "Alpha per layer at the end of training for learned runs (static linear / coprime schedules dotted)."),
        (distances(results, out / "distances.png"),
         "Attended distances beyond the local window per layer at the training length, and their union (top "
         "row), per schedule (log scale; the window 0..W is attended by every layer and not drawn)."),
    ]
    return [(p, c) for p, c in items if p is not None]
