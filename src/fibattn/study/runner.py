"""Running a grid: each run's state, sequential or one-per-GPU execution, progress, launch scripts.

A run's state, from ``ROOT/NAME`` and the results database:

- ``done``: training finished and the database holds its evaluation at every ``eval.lengths``
  (skipped);
- ``evaluate``: training finished, evaluation missing (only evaluated);
- ``resume``: checkpoints or a database record exist (``train(..., resume="auto")``);
- ``new``.

A run folder made with other settings (``ROOT/NAME/config.json`` differs in a setting that
changes the result) is an error, never silently reused or overwritten.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .. import config as C
from ..config import ConfigError, RunConfig
from ..data.pipeline import normalise
from ..effective import recorded, unread
from ..launch import launch
from ..devices import resolve_device
from ..ops.backends import check_model_runs
from .grid import Grid, GridRun
from ..storage.results import evaluated_lengths, resolve_db_path, run_status
from ..trainer.logs import fmt_duration

log = logging.getLogger("fibattn")

# settings that do not change a run's result (may differ between invocations)
RUNTIME_KEYS = {"name", "train.out_dir", "train.results_db", "train.threads", "train.device", "train.log_every",
                "train.ckpt_every", "train.keep_ckpts", "train.tensorboard", "train.wandb", "train.wandb_project",
                "train.compile", "train.micro_batch", "train.max_bad_steps", "model.backend", "data.out_dir",
                "eval.batch_size", "eval.lengths", "eval.tokens", "eval.datasets", "eval.sparse_lengths",
                "eval.dense_modes"}


@dataclass
class RunState:
    run: GridRun
    cfg: RunConfig
    status: str                 # done | evaluate | resume | new
    detail: str = ""


@dataclass
class GridSummary:
    done: list = field(default_factory=list)        # names already finished before this call
    ran: list = field(default_factory=list)         # names trained/evaluated by this call
    failed: dict = field(default_factory=dict)      # name -> error text
    elapsed_s: float = 0.0


class GridStopped(RuntimeError):
    """Training was asked to stop (SIGTERM) and checkpointed; the grid stops too (re-run to resume)."""


def is_main_rank() -> bool:
    return launch().rank == 0


# ------------------------------------------------------------------------------ state
def flat_config(d: dict, prefix: str = "") -> dict:
    """``{"section.field": value}`` of a nested config dict."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_config(v, key + "."))
        else:
            out[key] = v
    return out


def settings_diff(saved: dict, cfg: RunConfig) -> list[str]:
    """``key: old -> new`` for every result-changing setting that differs."""
    a, b, off = flat_config(C.with_defaults(saved)), flat_config(C.with_defaults(recorded(cfg))), unread(cfg)
    keys = sorted(k for k in set(a) | set(b) if k not in RUNTIME_KEYS and not k.startswith("train.init_source")
                  and k not in off and a.get(k) != b.get(k))   # init_source: recorded by the trainer from init_from
    # (off: what neither reads -- a run records only what acts)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys]


def check_same_settings(cfg: RunConfig) -> None:
    path = Path(cfg.train.out_dir) / "config.json"
    if not path.is_file():
        return
    diff = settings_diff(json.loads(path.read_text()), cfg)
    if diff:
        shown = "; ".join(diff[:4]) + (f"; ... ({len(diff)} in all)" if len(diff) > 4 else "")
        raise ConfigError(f"run folder {path.parent} was made with other settings ({shown}); delete it, use "
                          f"another --root, or (demo) pass --fresh")


def db_path(cfg: RunConfig) -> Path:
    return resolve_db_path(cfg.train.out_dir, cfg.train.results_db)


def eval_reach(cfg: RunConfig) -> str:
    return cfg.eval.reach


def eval_plan(cfg: RunConfig) -> list[tuple[str, str, list[int]]]:
    """``(mode, recorded mode name, lengths)`` a grid evaluates for a run: its own mode at ``eval.lengths``
    (a sparse model also at ``eval.sparse_lengths``), and a dense model in each of ``eval.dense_modes``."""
    from ..eval.modes import mode_name
    reach = eval_reach(cfg)
    dense = cfg.model.attention == "dense"
    own = list(cfg.eval.lengths) + ([] if dense else [n for n in cfg.eval.sparse_lengths if n not in cfg.eval.lengths])
    docs = cfg.eval.document_masking
    plan = [("none", mode_name("none", reach, documents=docs), own)]
    if dense:
        plan += [(m, mode_name(m, reach, documents=docs), list(cfg.eval.lengths)) for m in cfg.eval.dense_modes]
    return plan


def missing_evals(cfg: RunConfig) -> list[tuple[str, str, list[int]]]:
    """:func:`eval_plan` less what the results database already holds."""
    path, name = db_path(cfg), Path(cfg.train.out_dir).name
    out = []
    for mode, recorded, lengths in eval_plan(cfg):
        have = evaluated_lengths(path, name, recorded)
        todo = [n for n in lengths if n not in have]
        if todo:
            out.append((mode, recorded, todo))
    return out


def run_state(run: GridRun, cfg: RunConfig) -> RunState:
    check_same_settings(cfg)
    path, name = db_path(cfg), Path(cfg.train.out_dir).name
    status = run_status(path, name)
    missing = missing_evals(cfg) if status == "finished" else []
    if status == "finished" and not missing:
        return RunState(run, cfg, "done")
    if status == "finished":
        return RunState(run, cfg, "evaluate", "missing " + "; ".join(f"{r} {n}" for _, r, n in missing))
    ckpts = Path(cfg.train.out_dir) / "checkpoints"
    if status is not None or (ckpts.is_dir() and any(ckpts.iterdir())):
        return RunState(run, cfg, "resume", f"last status {status or 'unknown'}")
    return RunState(run, cfg, "new")


def states(grid: Grid, root) -> list[RunState]:
    return [run_state(r, grid.config(r, root)) for r in grid.runs]


def describe(grid: Grid, root) -> str:
    rows = states(grid, root)
    lines = [f"grid {grid.name}: {len(rows)} runs under {root} ({grid.description})"]
    w = max(len(s.run.name) for s in rows) if rows else 4
    for s in rows:
        sets = " ".join(o for o in s.run.overrides if o.startswith("model."))
        lines.append(f"  {s.run.name:<{w}}  {s.status:<8}  seed {s.run.seed}  {s.run.preset}  {sets}")
    counts = {k: sum(s.status == k for s in rows) for k in ("done", "evaluate", "resume", "new")}
    lines.append("  " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return "\n".join(lines)


# ------------------------------------------------------------------------------ one run
def evaluate_config(cfg: RunConfig, *, mode: str = "none", lengths: list[int] | None = None) -> None:
    """Evaluate a trained run in ``mode`` at ``lengths`` (default ``eval.lengths``) and record it
    (``RUN/eval.json`` + the database). The token budget is rounded to a multiple of the longest length
    the grid evaluates at all, so calls for a few lengths score the same targets as one call for all
    (when the lengths divide each other, as the grids' multiples of the training length do)."""
    from ..eval.run_folder import evaluate_run
    longest = max([*cfg.eval.lengths, *cfg.eval.sparse_lengths])
    tokens = max(longest, cfg.eval.tokens // longest * longest)
    evaluate_run(cfg.train.out_dir, lengths=list(lengths or cfg.eval.lengths), tokens=tokens,
                 datasets=list(cfg.eval.datasets) or None, batch_size=cfg.eval.batch_size, reach=cfg.eval.reach,
                 device=cfg.train.device, precision=cfg.train.precision, data=cfg.data.out_dir,
                 db=str(db_path(cfg)), mode=mode, plot=mode == "none")


def execute(state: RunState, say: Callable[[str], None]) -> None:
    """Train (resuming) unless trained, then evaluate on rank 0."""
    from ..trainer.trainer import train
    cfg = state.cfg
    if state.status in ("new", "resume"):
        result = train(cfg, resume="auto")
        if result.status != "finished":
            raise GridStopped(f"training of {state.run.name} {result.status} at step {result.step}/"
                              f"{cfg.train.steps} (checkpointed)")
    if is_main_rank():
        for mode, recorded, lengths in missing_evals(cfg):
            say(f"evaluating {state.run.name} at lengths {lengths}" + ("" if mode == "none" else f" ({recorded})"))
            evaluate_config(cfg, mode=mode, lengths=lengths)


def prepare_data(rows: list[RunState], progress: bool = True) -> None:
    """Prepare each distinct data setting once (before parallel workers race to do it)."""
    from ..data import ensure_prepared
    seen = set()
    for s in rows:
        key = repr(C.to_dict(s.cfg)["data"])
        if key not in seen:
            seen.add(key)
            ensure_prepared(s.cfg.data, progress=progress)


# ------------------------------------------------------------------------------ the grid
class Progress:
    """``[grid demo] run 3/7 fib_fixed: training | elapsed 2m10s | eta 5m02s`` lines."""

    def __init__(self, grid: str, total: int, out: Callable[[str], None]):
        self.grid, self.total, self.out = grid, total, out
        self.t0 = time.perf_counter()
        self.durations: list[float] = []
        self.lock = threading.Lock()

    def eta(self, remaining: int, workers: int = 1) -> float:
        if not self.durations:
            return float("nan")
        return sum(self.durations) / len(self.durations) * remaining / max(workers, 1)

    def line(self, i: int, name: str, what: str, remaining: int, workers: int = 1) -> None:
        elapsed = time.perf_counter() - self.t0
        with self.lock:
            self.out(f"[grid {self.grid}] run {i}/{self.total} {name}: {what} | elapsed {fmt_duration(elapsed)} | "
                     f"eta {fmt_duration(self.eta(remaining, workers))}")


def run_grid(grid: Grid, root, *, devices: list[str] | None = None, out: Callable[[str], None] = print,
             progress_data: bool = True) -> GridSummary:
    """Run every unfinished run of ``grid`` under ``root``; returns what was done, skipped and failed."""
    root = Path(root)
    rows = states(grid, root)           # checks every run's settings before anything runs
    summary = GridSummary(done=[s.run.name for s in rows if s.status == "done"])
    todo = [(i + 1, s) for i, s in enumerate(rows) if s.status != "done"]
    sources = set()
    for _, s in todo:                   # and that each model's backend and data sources work where it will train
        gpus = devices and not devices[0].startswith("cpu")           # CPU workers are named cpu0, cpu1, ...
        device = "cuda" if gpus else resolve_device(s.cfg.train.device, flag="train.device")
        check_model_runs(s.cfg.model, device, grad=s.status != "evaluate", field=f"run {s.run.name}: model.backend")
        if s.status != "evaluate" and repr(s.cfg.data.sources) not in sources:
            sources.add(repr(s.cfg.data.sources))
            normalise(s.cfg.data)        # one line for a source every run would fail on, before any run starts
    main = is_main_rank()
    say = out if main else (lambda _text: None)
    say(f"[grid {grid.name}] {len(rows)} runs under {root}: {len(summary.done)} done, {len(todo)} to run"
        + (f" on devices {','.join(devices)}" if devices else ""))
    if devices and len(todo) == 1:
        devices = None                     # one run: in this process, with its progress lines
    prog = Progress(grid.name, len(rows), say)
    for i, s in enumerate(rows):
        if s.status == "done":
            prog.line(i + 1, s.run.name, "done, skipped", len(todo))
    names = {s.run.name for _, s in todo}
    todo = sorted(todo, key=lambda item: item[1].run.init_from in names)    # sources before their fine-tunes
    if todo and devices:
        _run_parallel(grid, root, todo, devices, prog, summary, progress_data)
    elif todo:
        _run_sequential(todo, prog, summary, say)
    summary.elapsed_s = time.perf_counter() - prog.t0
    say(f"[grid {grid.name}] finished in {fmt_duration(summary.elapsed_s)}: {len(summary.done)} skipped, "
        f"{len(summary.ran)} run, {len(summary.failed)} failed"
        + "".join(f"\n  FAILED {n}: {e}" for n, e in summary.failed.items()))
    return summary


def _source_failed(s: RunState, summary: GridSummary) -> str | None:
    if s.run.init_from in summary.failed:
        return f"its source run {s.run.init_from} failed; re-run to retry both"
    return None


def _run_sequential(todo, prog: Progress, summary: GridSummary, say) -> None:
    for k, (i, s) in enumerate(todo):
        why = _source_failed(s, summary)
        if why:
            summary.failed[s.run.name] = why
            prog.line(i, s.run.name, f"skipped: {why}", len(todo) - k - 1)
            continue
        what = {"new": "training", "resume": "resuming training", "evaluate": "evaluating"}[s.status]
        prog.line(i, s.run.name, what, len(todo) - k)
        t0 = time.perf_counter()
        try:
            execute(s, say)
        except KeyboardInterrupt:
            raise
        except GridStopped as exc:
            summary.failed[s.run.name] = str(exc)
            say(f"[grid {prog.grid}] stopped: {exc}; re-run the same command to resume")
            return
        except Exception as exc:            # one failed run does not stop the grid
            log.debug("run %s failed", s.run.name, exc_info=True)
            summary.failed[s.run.name] = f"{type(exc).__name__}: {exc}"
            prog.line(i, s.run.name, f"FAILED ({type(exc).__name__}: {exc})", len(todo) - k - 1)
            continue
        prog.durations.append(time.perf_counter() - t0)
        summary.ran.append(s.run.name)
        prog.line(i, s.run.name, f"finished in {fmt_duration(prog.durations[-1])}", len(todo) - k - 1)


def worker_command(grid: Grid, root, name: str, launcher: list[str] | None = None) -> list[str]:
    """The command that runs one run of ``grid`` (re-reading the grid by name, extension and ``--set``)."""
    cmd = list(launcher or [sys.executable, "-m", "fibattn.cli"])
    cmd += ["grid", grid.name, "--root", str(root), "--only", name]
    if grid.extend_file:
        cmd += ["--extend", grid.extend_file]
    for item in grid.sets:
        cmd += ["--set", item]
    return cmd


def _run_logged(cmd: list[str], env: dict, log_path: Path, echo: Callable[[str], None]) -> int:
    """Run ``cmd`` writing its output to ``log_path``; echo its progress lines (``step …``)."""
    with open(log_path, "a") as fh, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                                     stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            fh.write(line)
            fh.flush()
            if line.startswith(("step ", "eval step", "evaluating")):
                echo(line.rstrip())
        return proc.wait()


def _run_parallel(grid, root, todo, devices, prog: Progress, summary: GridSummary, progress_data: bool) -> None:
    prepare_data([s for _, s in todo], progress=progress_data)
    free: queue.Queue = queue.Queue()
    for d in devices:
        free.put(d)
    remaining = [len(todo)]
    finished = {s.run.name: threading.Event() for _, s in todo}

    def work(item):
        i, s = item
        try:
            _work(i, s)
        finally:
            finished[s.run.name].set()

    def _work(i, s):
        if s.run.init_from in finished:              # a fine-tune waits for its source (queued before it)
            finished[s.run.init_from].wait()
        why = _source_failed(s, summary)
        if why:
            with prog.lock:
                remaining[0] -= 1
            summary.failed[s.run.name] = why
            prog.line(i, s.run.name, f"skipped: {why}", remaining[0], len(devices))
            return
        dev = free.get()
        log_path = Path(s.cfg.train.out_dir) / "grid.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        where = f"CPU worker {dev[3:]}" if dev.startswith("cpu") else f"GPU {dev}"
        prog.line(i, s.run.name, f"started on {where} (log {log_path})", remaining[0], len(devices))
        t0 = time.perf_counter()
        try:
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": dev}
            if dev.startswith("cpu"):           # a CPU worker: no GPU, one thread (no OpenMP contention)
                env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
            for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
                env.pop(key, None)
            rc = _run_logged(worker_command(grid, root, s.run.name), env, log_path,
                             lambda line: prog.out(f"  [{s.run.name}] {line}"))
        finally:
            free.put(dev)
        dt = time.perf_counter() - t0
        with prog.lock:
            remaining[0] -= 1
        if rc == 0:
            prog.durations.append(dt)
            summary.ran.append(s.run.name)
            prog.line(i, s.run.name, f"finished on {where} in {fmt_duration(dt)}", remaining[0], len(devices))
        else:
            summary.failed[s.run.name] = f"exit status {rc}; see {log_path}"
            prog.line(i, s.run.name, f"FAILED (exit status {rc}, see {log_path})", remaining[0], len(devices))

    with ThreadPoolExecutor(max_workers=len(devices)) as pool:
        list(pool.map(work, todo))
