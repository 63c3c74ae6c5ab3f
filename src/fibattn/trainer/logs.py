"""Progress lines, a terminal progress bar and metric sinks (JSONL, SQLite, TensorBoard, W&B).

The progress line (stdout, rank 0, every ``log_every`` steps) is greppable::

    step 25/600 | loss 2.4817 | lr 3.00e-03 | grad_norm 0.412 | tok/s 10234 | eta 2m31s
    step 25/600 | loss 2.4817 | lr 3.00e-03 | grad_norm 0.412 | tok/s 10234 | mfu 41.2% | eta 2m31s

(``mfu`` where the device's peak is known: :mod:`.throughput`.)

A one-line bar redrawn in place is added only when stdout is a terminal.

``metrics.jsonl`` holds one JSON object per line with a ``step``. A resume first drops the
records past the checkpoint's step (they are logged again), then appends a marker record
``{"step": N, "resumed_from": N, "checkpoint": PATH}``. A torn last line (what a process
killed while appending leaves) is dropped with a one-line warning; a damaged line before
the last is an error naming the file and the line.
"""
from __future__ import annotations

import json
import logging
import math
import re
import sys
import time
from pathlib import Path

from ..checks import UsageError
from ..config import ConfigError
from ..files import atomic_write_text
from ..storage.results import ResultsDB, ResultsDBError

log = logging.getLogger("fibattn")


def fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    if h >= 24:                               # days, as a long run on a slow device is read
        return f"{h // 24}d{h % 24:02d}h"
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def progress_line(step: int, total: int, loss: float, lr: float, grad_norm: float, tok_s: float,
                  eta_s: float, mfu: float | None = None) -> str:
    util = f"mfu {mfu:.1%} | " if mfu is not None else ""
    return (f"step {step}/{total} | loss {loss:.4f} | lr {lr:.2e} | grad_norm {grad_norm:.3f} | "
            f"tok/s {tok_s:.0f} | {util}eta {fmt_duration(eta_s)}")


class ProgressBar:
    """``[#####-----] 120/600 20% loss 2.41 eta 1m10s`` redrawn with ``\\r``; TTY only."""

    def __init__(self, total: int, stream=None, width: int = 30, silent: bool = False):
        self.stream = stream or sys.stdout
        self.total, self.width, self.silent = total, width, silent
        self.enabled = not silent and bool(getattr(self.stream, "isatty", lambda: False)())
        self._shown = False

    def update(self, step: int, loss: float, eta_s: float) -> None:
        if not self.enabled:
            return
        frac = step / self.total if self.total else 1.0
        fill = int(self.width * frac)
        bar = "#" * fill + "-" * (self.width - fill)
        self.stream.write(f"\r[{bar}] {step}/{self.total} {frac:4.0%} loss {loss:.3f} eta {fmt_duration(eta_s)}\033[K")
        self.stream.flush()
        self._shown = True

    def clear(self) -> None:
        if self.enabled and self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._shown = False

    def println(self, text: str) -> None:
        """Print a full line above the bar."""
        if self.silent:
            return
        self.clear()
        print(text, file=self.stream, flush=True)


def wandb_run_id(run: str) -> str:
    """W&B run ids may not contain ``/ \\ # ? % :``; those become ``-`` (the display name keeps them)."""
    return re.sub(r"[/\\#?%:]", "-", run)


def _record(line: str):
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("step", 0), int) or isinstance(rec.get("step"), bool):
        return None
    return rec


def is_metrics_log(path: Path) -> bool:
    """True when ``path`` looks like a log this module wrote (every line a record that starts with its step)."""
    try:
        with open(path, encoding="utf-8") as fh:
            for i, line in enumerate(fh):
                head = '{"step": '
                if line.strip() and not (line.startswith(head) or head.startswith(line)):   # (or a torn prefix)
                    return False
                if i >= 100:                        # a sample is enough to tell fibattn's log from a user's file
                    break
    except (OSError, ValueError):
        return False
    return True


def metrics_to_keep(path, after_step: int) -> tuple[list[str], str | None]:
    """The lines of ``metrics.jsonl`` at ``path`` to keep when (re)starting at ``after_step``, and the
    torn last line that must be dropped (None when there is none). A malformed line before the last
    raises a ValueError naming the file and the line."""
    path = Path(path)
    if not path.exists():
        return [], None
    if not path.is_file():
        raise UsageError(f"{path} is not a file (the run's metrics log)")
    text = path.read_bytes().decode("utf-8", errors="replace")
    lines = text.split("\n")
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    keep, torn = [], None
    for i, (n, line) in enumerate(numbered):
        rec = _record(line)
        if rec is None:
            if i == len(numbered) - 1:
                torn = line
                break
            raise UsageError(f"{path}: line {n} is not a metrics record (a JSON object with an integer 'step'); "
                             f"repair the line or move the file away, then resume")
        if rec.get("step", 0) <= after_step:
            keep.append(line.strip())
    return keep, torn


class MetricSinks:
    """Rank 0's metric outputs: ``metrics.jsonl``, the results DB and optional trackers.

    A database write that fails during training does not stop the JSONL log: the error is kept in
    :attr:`db_error` (the trainer then stops with a checkpoint) and the database is not used again.
    """

    def __init__(self, out_dir: Path, run: str, db_path: Path | None, *, tensorboard: bool = False,
                 wandb: bool = False, wandb_project: str = "fibattn", config: dict | None = None):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.run = run
        self.db, self.db_error = None, None
        self.tb = self.wb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("train.tensorboard=true needs the tensorboard package "
                                  "(pip install tensorboard, or the [track] extra)") from None
            self.tb = SummaryWriter(log_dir=str(Path(out_dir) / "tensorboard"))
        if wandb:
            try:
                import wandb as wandb_mod
            except ImportError:
                raise ConfigError("train.wandb=true needs the wandb package (pip install wandb, or the "
                                  "[track] extra)") from None
            self.wb = wandb_mod.init(project=wandb_project, name=run, config=config, dir=str(out_dir),
                                     resume="allow", id=wandb_run_id(run))
        if db_path is not None:              # last: a tracker that fails leaves no database open
            self.db = ResultsDB(db_path)

    def truncate(self, after_step: int) -> None:
        """Drop records past ``after_step`` (a resumed run logs them again) and a torn last line."""
        if self.path.exists():
            keep, torn = metrics_to_keep(self.path, after_step)
            if torn is not None:
                log.warning("fibattn: %s: dropped its last line, torn by an interrupted write (%d characters: %r)",
                            self.path, len(torn), torn[:40])
            atomic_write_text(self.path, "".join(line + "\n" for line in keep))
        if self.db is not None:
            self.db.truncate(self.run, after_step)

    def mark_resume(self, step: int, checkpoint, changed: list[str] | None = None,
                    window: dict | None = None) -> None:
        """Append the marker record of a resume at ``step`` (metrics.jsonl only). ``changed``: settings that
        differ from the checkpoint's; ``window``: the checkpoint's partial loss window when the trainer restarts
        it (its mean and step count are kept here, so no step's loss goes unlogged)."""
        record = {"step": step, "time": round(time.time(), 3), "resumed_from": step, "checkpoint": str(checkpoint)}
        if changed:
            record["changed"] = list(changed)
        if window and window.get("steps"):
            record["window_loss"] = window["loss"] / window["n"] if window.get("n") else float("nan")
            record["window_steps"] = int(window["steps"])
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def log(self, step: int, values: dict, alphas: list[float] | None = None) -> None:
        record = {"step": step, "time": round(time.time(), 3), **values}
        if alphas is not None:
            record["alphas"] = alphas
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.db is not None and self.db_error is None:
            try:
                self.db.log_metrics(self.run, step, values)
                if alphas is not None:
                    self.db.log_alphas(self.run, step, alphas)
            except ResultsDBError as exc:
                self.db_error = str(exc)
                log.error("fibattn: %s", exc)
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
            for i, a in enumerate(alphas or []):
                self.tb.add_scalar(f"alpha/layer{i}", a, step)
        if self.wb is not None:
            extra = {f"alpha/layer{i}": a for i, a in enumerate(alphas or [])}
            self.wb.log({**values, **extra}, step=step)

    def close(self, status: str) -> None:
        if self.db is not None:
            try:
                if self.db_error is None:
                    self.db.finish_run(self.run, status)
            except ResultsDBError as exc:
                log.error("fibattn: could not record status %s: %s", status, exc)
            finally:
                self.db.close()
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish(exit_code=0 if status in ("finished", "stopped") else 1)
