"""Experiment grids: named lists of runs, filtering, extension files and the ``fibattn grid`` command.

    fibattn grid paper --root runs/paper                       # every run, one after another
    fibattn grid paper --root runs/paper --devices 0,1,2,3     # one run per GPU, 4 at a time
    fibattn grid paper --only 'fib_*_w12,dense' --dry-run      # what would run, and what is done
    fibattn grid paper --print-commands slurm > paper.sbatch   # a Slurm array script instead
    fibattn grid demo --extend more.json                       # add runs from a JSON list

A run is ``preset + overrides + seed``. It trains into ``ROOT/NAME``, is evaluated at its
``eval.lengths`` and recorded in ``ROOT/results.sqlite`` (see :mod:`fibattn.study.runner`).
Grids are functions returning a :class:`Grid`; ``GRIDS`` maps the names the CLI accepts.
An extension file is a JSON list of ``{"name", "preset", "overrides", "seed"[, "init_from", "init_share"]}``
objects (``init_from``: a run of the grid whose trained weights start this one; ``init_share``: its
steps as a share of the from-scratch steps, see :meth:`GridRun.config`).
"""
from __future__ import annotations

import fnmatch
import json
import logging
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from .. import config as C
from ..checks import UsageError, check_keys
from ..config import ConfigError, RunConfig
from ..effective import check_honoured, given_by_set
from ..files import read_json
from ..presets import PRESETS, get_preset
from ..trainer.init_recipe import apply_recipe
from ..validation import fit_warmup, given_by_set, validate

log = logging.getLogger("fibattn")
_SAID: set = set()                    # config() runs for every state, report and run: say each note once


def demo_setting() -> list[str]:
    """The demo's setting: overrides on top of the ``tiny`` preset (tune here, in one place).

    Trained at 32 tokens, evaluated at 1×, 4×, 16× and 64× (32 … 2048; sparse models also at
    256× = 8192), the dense model also with RoPE scaling (linear, NTK, YaRN) and a sliding window
    (method.md §7): 500 steps × 2048 tokens of a
    5-layer, d_model 96 model (5 layers so that coprime differs from linear: stride 2).
    fib base K=7 (1..21): at alpha 1.5 the longest distance, 32, is beyond the training
    cap, so every sparse distance used at 128 was already used in training; the pow2
    base rebuilt at 128 picks up 32 and 64 (the study's +11 % effect). Tuned on this
    corpus: at 600 steps dense rose +90 % at 4× while fib linear fell 3 %; at 300 steps of
    4096 tokens with 64-token windows dense rose only +29 % (too little training for RoPE's
    positional reliance to show).
    """
    return [
        "model.seq_len=32", "model.d_model=96", "model.n_layers=5", "model.n_heads=4", "model.n_kv_heads=2",
        "model.base_k=7", "model.window=6",
        "train.steps=500", "train.batch_tokens=2048", "train.micro_batch=64", "train.lr=3e-3",
        "train.warmup_steps=30", "train.log_every=50", "train.ckpt_every=250", "train.eval_every=0",
        "train.eval_tokens=8192",
        "eval.lengths=[32,128,512,2048]", "eval.sparse_lengths=[8192]", "eval.dense_modes=linear,ntk,yarn,window",
        "eval.tokens=65536", "eval.batch_size=32",
    ]


def smoke_setting() -> list[str]:
    """A seconds-long setting that exercises the whole pipeline (tests, CI)."""
    return [
        "model.seq_len=32", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
        "model.base_k=6", "model.window=4", "model.backend=torch",
        "train.steps=3", "train.batch_tokens=128", "train.micro_batch=4", "train.warmup_steps=1",
        "train.log_every=1", "train.ckpt_every=100", "train.eval_tokens=256", "train.threads=1",
        "eval.lengths=[32,64]", "eval.tokens=2048", "eval.batch_size=8",
    ]


NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
SCHEDULE_TAGS = {"fixed": "fixed", "learned": "learned", "linear": "stagger", "coprime": "hdc"}
# what the report, the demo and the README call each variant (report.variant_of); the run names
# (fib_hdc, logsparse_stagger, ...) stay the folder and --only names. Controls: CONTROL_TITLES.
VARIANT_TITLES = {"dense": "dense", "fixed": "fib fixed", "learned": "fib learned", "linear": "fib linear (stagger)",
                  "coprime": "fib coprime (HDC)", "pow2+fixed": "pow2 fixed", "pow2+linear": "pow2 linear"}
PAPER_WINDOWS = (6, 8, 10, 12)
REPLICATE_SEEDS = (43, 44)


@dataclass(frozen=True)
class GridRun:
    """One run of a grid: ``preset`` + ``overrides`` (``section.field=value``) + ``seed``."""

    name: str
    preset: str
    overrides: tuple[str, ...] = ()
    seed: int = 42
    init_from: str = ""          # another run of the grid whose trained weights start this one (retrofit)
    init_share: float = 0.0      # with init_from: fine-tune steps as a share of the from-scratch steps
    matches: int = 0             # window_matched: the fib W whose cost its window matches (re-derived after --set)

    def config(self, root, extra: list[str] | tuple[str, ...] = (), data_dir: str | None = None) -> RunConfig:
        """The run's validated config, writing to ``ROOT/NAME``.

        Order: preset, the run's overrides, ``data_dir``, then ``extra`` (the grid's ``--set``). A run
        with ``init_from`` then starts from ``ROOT/<init_from>`` for ``init_share`` of the from-scratch
        steps, with the fine-tuning recipe (:mod:`fibattn.trainer.init_recipe`) wherever ``extra``
        leaves it open: the overrides are the from-scratch recipe the fine-tune's is derived from.
        """
        cfg = get_preset(self.preset)
        C.apply_overrides(cfg, list(self.overrides))
        if data_dir is not None:
            cfg.data.out_dir = data_dir
        C.apply_overrides(cfg, list(extra))
        if self.matches:         # a --set of the model changes fib's cost: the window follows it
            given_w = any(o.split("=", 1)[0].strip() == "model.window" for o in extra)
            cfg.model.window = _matched(cfg.model, cfg.model.window if given_w else self.matches)
        if self.init_from:
            given = {o.split("=", 1)[0].strip() for o in extra}
            if self.init_share:
                cfg.train.steps = max(1, round(self.init_share * cfg.train.steps))
                given.add("train.steps")
            cfg.train.init_from = str(Path(root).absolute() / self.init_from)
            apply_recipe(cfg, given)
        cfg.name = self.name
        cfg.train.seed = self.seed
        cfg.train.out_dir = str(Path(root) / self.name)
        if cfg.train.results_db == "off":
            raise ConfigError("train.results_db=off cannot be used in a grid: the grid records its runs there")
        validate(cfg)
        note = fit_warmup(cfg.train, given_by_set(extra))     # resolved here: the folder's config.json is compared
        if note and note not in _SAID:
            _SAID.add(note)
            log.info(note)
        return cfg


@dataclass
class Grid:
    """A named list of runs. ``data_under_root``: prepare the data in ``ROOT/data/<name>``."""

    name: str
    runs: list[GridRun]
    description: str = ""
    data_under_root: bool = False
    extend_file: str | None = None          # set by :func:`build_grid` (workers re-read it)
    sets: tuple[str, ...] = field(default_factory=tuple)   # grid-wide overrides (``--set``)
    report_dir: str = "report"              # the report's folder under ROOT

    def names(self) -> list[str]:
        return [r.name for r in self.runs]

    def data_dir(self, root) -> str | None:
        if not self.data_under_root:
            return None
        base = Path(get_preset(self.runs[0].preset).data.out_dir).name if self.runs else "data"
        return str(Path(root) / "data" / base)

    def config(self, run: GridRun, root) -> RunConfig:
        return run.config(root, self.sets, self.data_dir(root))


# ------------------------------------------------------------------------------ grids
def _sparse(base: str, schedule: str, window: int) -> tuple[str, ...]:
    extra = ("model.learned_init=fixed", "model.alpha=1.0") if schedule == "learned" else ()
    return ("model.attention=sparse", f"model.base={base}", f"model.schedule={schedule}",
            f"model.window={window}", *extra)


# the window-only controls (issue 27): name prefix -> what the outputs call them
CONTROL_TITLES = {"window_rungs_off": "window (rungs off)", "window_matched": "window (matched cost)"}


def run_title(name: str, variant: str) -> str:
    """What outputs call run ``name`` of ``variant``: VARIANT_TITLES, a control's title, else the name."""
    return (control_title(name) if variant == "window" else VARIANT_TITLES.get(variant)) or name


def control_title(name: str) -> str | None:
    """``window (rungs off)`` / ``window (matched cost)`` for a control run's name, else None."""
    return next((t for p, t in CONTROL_TITLES.items() if name == p or name.startswith(p + "_")), None)


def matched_window_of(preset: str, setting: tuple[str, ...], window: int) -> int:
    """W of the ``window_matched`` control: as many columns per query, at the training length, as the
    fib linear (stagger) model of this preset, setting and ``window`` (:func:`fibattn.schedules.matched_window`).
    Fixed by the configs alone, before any run: no number is tuned toward an answer."""
    probe = get_preset(preset)
    C.apply_overrides(probe, list(setting))
    return _matched(probe.model, window)


def _matched(model, window: int) -> int:
    from ..model.attention import config_base, config_layer_alphas
    from ..schedules import matched_window
    m = replace(model, attention="sparse", base="fib", schedule="linear", window=window)
    return matched_window(m.window, config_layer_alphas(m), config_base(m), m.seq_len)


def window_controls(preset: str, setting: tuple[str, ...], window: int, suffix: str = "") -> list[GridRun]:
    """``window_rungs_off`` (the fib model's W, no rungs: what the rungs add) and ``window_matched`` (no
    rungs, the fib linear model's cost per query); same recipe as every other run. Alpha is inert
    without rungs: both use the fixed schedule."""
    return [GridRun(f"window_rungs_off{suffix}", preset, setting + _window_only(window)),
            GridRun(f"window_matched{suffix}", preset, setting + _window_only(matched_window_of(preset, setting, window)),
                    matches=window)]


def _window_only(window: int) -> tuple[str, ...]:
    return ("model.attention=sparse", "model.base=none", "model.schedule=fixed", f"model.window={window}")


def paper_runs(preset: str = "paper", setting: tuple[str, ...] = ()) -> list[GridRun]:
    """method.md §4: dense, fib × {fixed, learned, linear, coprime} × W, pow2 + linear × W, pow2 + fixed at W=8;
    and at every W the two window-only controls (:func:`window_controls`)."""
    runs = [GridRun("dense", preset, setting + ("model.attention=dense",))]
    for w in PAPER_WINDOWS:
        for schedule, tag in SCHEDULE_TAGS.items():
            runs.append(GridRun(f"fib_{tag}_w{w}", preset, setting + _sparse("fib", schedule, w)))
        runs.append(GridRun(f"logsparse_stagger_w{w}", preset, setting + _sparse("pow2", "linear", w)))
        runs += window_controls(preset, setting, w, f"_w{w}")
    runs.append(GridRun("logsparse_w8", preset, setting + _sparse("pow2", "fixed", 8)))
    return runs


# 1×, 4×, 16×, 64× the training length (sparse models also 256×), dense also in every baseline mode
PAPER_EVAL = ("eval.lengths=[1024,4096,16384,65536]", "eval.sparse_lengths=[262144]",
              "eval.dense_modes=linear,ntk,yarn,window")


def paper_grid() -> Grid:
    runs = paper_runs(setting=PAPER_EVAL)
    base = {r.name: r for r in runs}
    w12 = [f"fib_{tag}_w12" for tag in SCHEDULE_TAGS.values()] + ["logsparse_stagger_w12"]
    for seed in REPLICATE_SEEDS:
        runs += [replace(base[n], name=f"{n}_s{seed}", seed=seed) for n in w12]
    return Grid("paper", runs, "the study's 21-model matrix + dense + seed replicates 43, 44 at W=12 (method.md §4) "
                "+ the window-only controls at every W")


def demo_runs(setting: tuple[str, ...], preset: str = "tiny") -> list[GridRun]:
    """Dense, the six sparse variants and the two window-only controls at the setting's one window
    (names without ``_wW``)."""
    runs = [GridRun("dense", preset, setting + ("model.attention=dense",))]
    probe = get_preset(preset)
    C.apply_overrides(probe, list(setting))
    w = probe.model.window
    for schedule, tag in SCHEDULE_TAGS.items():
        runs.append(GridRun(f"fib_{tag}", preset, setting + _sparse("fib", schedule, w)))
    runs += window_controls(preset, setting, w)              # beside the fib rows in every table
    runs.append(GridRun("logsparse", preset, setting + _sparse("pow2", "fixed", w)))
    runs.append(GridRun("logsparse_stagger", preset, setting + _sparse("pow2", "linear", w)))
    return runs


def demo_grid() -> Grid:
    return Grid("demo", demo_runs(tuple(demo_setting())), "dense + 6 sparse variants + 2 window-only controls, tiny "
                "preset, bundled corpus",
                data_under_root=True)


RETROFIT_FRACTIONS = (0.05, 0.1, 0.2, 0.4)        # fine-tune steps as a fraction of the dense run's


def retrofit_runs(setting: tuple[str, ...], preset: str = "tiny") -> list[GridRun]:
    """The demo's dense, fib_stagger and fib_fixed runs, and fine-tunes of the dense run to fib linear
    (stagger) and fib fixed of ``RETROFIT_FRACTIONS`` of its steps (names ``retro_<tag>_<pct>pct``)."""
    scratch = [r for r in demo_runs(setting, preset) if r.name in ("dense", "fib_stagger", "fib_fixed")]
    probe = get_preset(preset)
    C.apply_overrides(probe, list(setting))
    w, T = probe.model.window, probe.model.seq_len
    at = (f"eval.lengths=[{T},{4 * T}]", "eval.sparse_lengths=[]")      # the goals are at 1× and 4×
    runs = list(scratch)
    for schedule, tag in (("linear", "stagger"), ("fixed", "fixed")):
        for f in RETROFIT_FRACTIONS:
            runs.append(GridRun(f"retro_{tag}_{round(100 * f)}pct", preset, setting + _sparse("fib", schedule, w) + at,
                                init_from="dense", init_share=f))
    return runs


def retrofit_grid() -> Grid:
    return Grid("retrofit", retrofit_runs(tuple(demo_setting())), "the dense demo run fine-tuned to sparse schedules "
                "for 5-40 % of its steps, next to the sparse runs trained from scratch", data_under_root=True,
                report_dir="report-retrofit")


def smoke_grid() -> Grid:
    runs = [r for r in demo_runs(tuple(smoke_setting())) if r.name in ("dense", "fib_stagger")]
    return Grid("smoke", runs, "two micro runs in seconds (pipeline check)", data_under_root=True)


GRIDS = {"paper": paper_grid, "demo": demo_grid, "retrofit": retrofit_grid, "smoke": smoke_grid}


# ------------------------------------------------------------------------------ select / extend
def select(runs: list[GridRun], only: str | None) -> list[GridRun]:
    """Runs whose name matches one of the comma-separated fnmatch patterns (all when ``only`` is None)."""
    if only is None:
        return list(runs)
    patterns = [p.strip() for p in str(only).split(",") if p.strip()]
    if not patterns:
        raise UsageError(f"--only must hold at least one name pattern (e.g. 'fib_*_w12,dense'), got {only!r}")
    names = [r.name for r in runs]
    for p in patterns:
        if not fnmatch.filter(names, p):
            raise UsageError(f"--only pattern {p!r} matches no run (runs: {', '.join(names)})")
    return [r for r in runs if any(fnmatch.fnmatchcase(r.name, p) for p in patterns)]


def _entry(item, where: str) -> GridRun:
    if not isinstance(item, dict):
        raise UsageError(f"{where} must be an object with name, preset, overrides, seed; got {type(item).__name__}")
    check_keys(where, item, ("name", "preset", "overrides", "seed", "init_from", "init_share"))
    name = item.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise UsageError(f"{where}.name must be 1-100 letters, digits, '_', '-', '.' (not starting with a "
                         f"punctuation mark), got {name!r}")
    preset = item.get("preset")
    if preset not in PRESETS:
        raise UsageError(f"{where}.preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    overrides = item.get("overrides", [])
    if not isinstance(overrides, list) or not all(isinstance(o, str) and "=" in o for o in overrides):
        raise UsageError(f"{where}.overrides must be a list of 'section.field=value' strings, got {overrides!r}")
    seed = item.get("seed", 42)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UsageError(f"{where}.seed must be an integer >= 0, got {seed!r}")
    init_from = item.get("init_from", "")
    if not isinstance(init_from, str) or (init_from and not NAME_RE.match(init_from)):
        raise UsageError(f"{where}.init_from must name another run of the grid, got {init_from!r}")
    share = item.get("init_share", 0.0)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 10 or (share and not init_from):
        raise UsageError(f"{where}.init_share must be a number in (0, 10], given with init_from; got {share!r}")
    run = GridRun(name, preset, tuple(overrides), seed, init_from, float(share))
    try:
        check_honoured(run.config("runs"), given_by_set(overrides))     # the user's overrides: each one acts
    except ConfigError as exc:
        raise UsageError(f"{where} ({name}): {exc}") from None
    return run


def load_extension(path) -> list[GridRun]:
    """Runs from a JSON file holding a list of ``{name, preset, overrides, seed}`` objects."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--extend file {p} does not exist")
    try:
        data = read_json(p)
    except OSError as exc:
        raise UsageError(f"--extend file {p} cannot be read: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:          # files.TextFileError: the cause, with the line
        raise UsageError(f"--extend file {p} is not valid JSON: {exc}") from None
    if not isinstance(data, list) or not data:
        raise UsageError(f"--extend file {p} must hold a non-empty JSON list of runs, got {type(data).__name__}")
    runs = [_entry(item, f"{p.name}[{i}]") for i, item in enumerate(data)]
    seen: set[str] = set()
    for r in runs:
        if r.name in seen:
            raise UsageError(f"--extend file {p} names run {r.name!r} twice")
        seen.add(r.name)
    return runs


def build_grid(name: str, *, only: str | None = None, extend: str | None = None,
               sets: list[str] | tuple[str, ...] = ()) -> Grid:
    """The named grid, extended by ``extend`` (a JSON file), filtered by ``only``, with ``sets`` for every run."""
    if name not in GRIDS:
        raise UsageError(f"grid must be one of {', '.join(GRIDS)}, got {name!r}")
    grid = GRIDS[name]()
    if extend:
        more = load_extension(extend)
        clash = sorted(set(grid.names()) & {r.name for r in more})
        if clash:
            raise UsageError(f"--extend file {extend} reuses run name {clash[0]!r} of grid {name}; pick another name")
        grid.runs = grid.runs + more
        grid.extend_file = str(Path(extend).resolve())
    grid.runs = select(grid.runs, only)
    grid.sets = tuple(sets or ())
    for item in grid.sets:
        if "=" not in item:
            raise UsageError(f"--set must look like section.field=value, got {item!r}")
    return grid
