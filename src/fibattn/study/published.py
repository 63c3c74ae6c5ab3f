"""The study's published perplexities (method.md §5) as data, to hold a reproduction against.

Run names follow the study: ``dense``, ``fib_<fixed|learned|stagger|hdc>_w<W>``,
``logsparse_w8`` (pow2 + fixed), ``logsparse_stagger_w<W>`` (pow2 + linear); seed
replicates add ``_s43`` / ``_s44``. Datasets: ``fineweb_edu``, ``wikipedia``,
``tinystories``, ``maths`` (the study's maths set; not one split in our mixture).
"""
from __future__ import annotations

import re

TRAIN_LEN = 1024
LENGTHS = (1024, 2048, 4096)
DATASET_ABBREV = {"fineweb_edu": "FW", "wikipedia": "WP", "tinystories": "TS", "maths": "MA"}

# name: (FW 1024, FW 2048, FW 4096, WP 1024, WP 2048, WP 4096)
EXTRAPOLATION = {
    "dense": (33.37, 49.15, 100.36, 27.28, 41.42, 89.19),
    "fib_learned_w6": (43.86, 43.51, 43.32, 39.62, 39.24, 39.05),
    "fib_learned_w8": (43.70, 43.34, 43.15, 39.43, 39.04, 38.84),
    "fib_learned_w10": (42.99, 42.63, 42.44, 38.80, 38.41, 38.21),
    "fib_learned_w12": (42.85, 42.49, 42.30, 38.60, 38.21, 38.02),
    "fib_fixed_w6": (44.35, 44.01, 43.83, 40.24, 39.88, 39.68),
    "fib_fixed_w8": (44.08, 43.74, 43.56, 40.02, 39.65, 39.47),
    "fib_fixed_w10": (43.48, 43.14, 42.97, 39.33, 38.96, 38.78),
    "fib_fixed_w12": (43.12, 42.78, 42.60, 39.05, 38.67, 38.49),
    "logsparse_w8": (44.78, 44.98, 49.86, 40.89, 41.01, 45.61),
    "fib_stagger_w6": (42.93, 42.55, 42.35, 38.59, 38.18, 37.99),
    "fib_stagger_w8": (42.53, 42.17, 41.98, 38.07, 37.68, 37.48),
    "fib_stagger_w10": (42.21, 41.85, 41.66, 37.88, 37.47, 37.28),
    "fib_stagger_w12": (42.02, 41.65, 41.45, 37.59, 37.20, 37.00),
    "fib_hdc_w6": (43.10, 43.90, 44.93, 38.70, 39.36, 40.25),
    "fib_hdc_w8": (42.58, 42.73, 43.10, 38.27, 38.38, 38.75),
    "fib_hdc_w10": (42.28, 42.59, 43.14, 38.00, 38.20, 38.67),
    "fib_hdc_w12": (42.09, 42.53, 43.25, 37.75, 38.14, 38.80),
    "logsparse_stagger_w6": (44.11, 43.88, 44.10, 39.89, 39.64, 39.87),
    "logsparse_stagger_w8": (43.60, 43.32, 43.43, 39.56, 39.23, 39.33),
    "logsparse_stagger_w10": (43.17, 42.89, 43.02, 39.05, 38.72, 38.83),
    "logsparse_stagger_w12": (42.69, 42.40, 42.62, 38.51, 38.17, 38.35),
}

# seed replicates at W=12, length 1024: name -> seed -> (FW, WP, TS, maths); the study has no learned seed 44
SEEDS = {
    "fib_fixed_w12": {42: (43.12, 39.05, 5.44, 3.39), 43: (43.16, 38.79, 5.45, 3.40), 44: (43.27, 38.75, 5.45, 3.39)},
    "fib_learned_w12": {42: (42.85, 38.60, 5.40, 3.35), 43: (42.85, 38.37, 5.41, 3.32)},
    "fib_stagger_w12": {42: (42.02, 37.59, 5.30, 3.25), 43: (41.96, 37.42, 5.32, 3.24), 44: (42.26, 37.49, 5.33, 3.25)},
    "fib_hdc_w12": {42: (42.09, 37.75, 5.30, 3.26), 43: (42.03, 37.57, 5.33, 3.24), 44: (42.43, 37.59, 5.34, 3.27)},
    "logsparse_stagger_w12": {42: (42.69, 38.51, 5.38, 3.36), 43: (42.77, 38.39, 5.40, 3.34),
                              44: (43.08, 38.60, 5.42, 3.35)},
}
SEED_DATASETS = ("fineweb_edu", "wikipedia", "tinystories", "maths")

_SUFFIX = re.compile(r"^(?P<base>.+)_s(?P<seed>\d+)$")


def split_seed(name: str) -> tuple[str, int]:
    """``fib_stagger_w12_s43`` -> ``("fib_stagger_w12", 43)``; no suffix -> seed 42."""
    m = _SUFFIX.match(name)
    return (m["base"], int(m["seed"])) if m else (name, 42)


def study_ppl(name: str, dataset: str, length: int) -> float | None:
    """The study's perplexity for run ``name`` on ``dataset`` at ``length`` (None when not reported)."""
    base, seed = split_seed(name)
    if seed == 42 and base in EXTRAPOLATION and dataset in ("fineweb_edu", "wikipedia") and length in LENGTHS:
        row = EXTRAPOLATION[base]
        return row[(0 if dataset == "fineweb_edu" else 3) + LENGTHS.index(length)]
    if length == TRAIN_LEN and dataset in SEED_DATASETS:
        values = SEEDS.get(base, {}).get(seed)
        if values is not None:
            return values[SEED_DATASETS.index(dataset)]
    return None


_VARIANT_NAMES = {"dense": re.compile(r"^dense$"), "fixed": re.compile(r"^fib_fixed_w\d+$"),
                  "learned": re.compile(r"^fib_learned_w\d+$"), "linear": re.compile(r"^fib_stagger_w\d+$"),
                  "coprime": re.compile(r"^fib_hdc_w\d+$"), "pow2+fixed": re.compile(r"^logsparse_w\d+$"),
                  "pow2+linear": re.compile(r"^logsparse_stagger_w\d+$")}


def study_change(variant: str, dataset: str = "fineweb_edu", factor: int = 4) -> tuple[float, float] | None:
    """(lowest, highest) % change from 1024 to ``factor`` × 1024 the study reports for a variant, over its windows."""
    pat = _VARIANT_NAMES.get(variant)
    if pat is None or dataset not in ("fineweb_edu", "wikipedia") or factor * TRAIN_LEN not in LENGTHS:
        return None
    changes = []
    for name in EXTRAPOLATION:
        if pat.match(name):
            a, b = study_ppl(name, dataset, TRAIN_LEN), study_ppl(name, dataset, factor * TRAIN_LEN)
            changes.append((b - a) / a * 100.0)
    return (min(changes), max(changes)) if changes else None


def fmt_change_range(rng: tuple[float, float] | None) -> str:
    if rng is None:
        return "—"
    lo, hi = rng
    return f"{lo:+.1f} %" if abs(hi - lo) < 0.05 else f"{lo:+.1f} … {hi:+.1f} %"
