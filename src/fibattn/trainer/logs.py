"""Progress lines, a terminal progress bar and metric sinks (JSONL, SQLite, TensorBoard, W&B).

The progress line (stdout, rank 0, every ``log_every`` steps) is greppable::

    step 25/600 | loss 2.4817 | lr 3.00e-03 | grad_norm 0.412 | tok/s 10234 | eta 2m31s

A one-line bar redrawn in place is added only when stdout is a terminal.
"""
from __future__ import annotations

import json
import math
import re
import sys
import time
from pathlib import Path

from ..config import ConfigError
from ..files import atomic_write_text
from ..storage.results import ResultsDB


def fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def progress_line(step: int, total: int, loss: float, lr: float, grad_norm: float, tok_s: float,
                  eta_s: float) -> str:
    return (f"step {step}/{total} | loss {loss:.4f} | lr {lr:.2e} | grad_norm {grad_norm:.3f} | "
            f"tok/s {tok_s:.0f} | eta {fmt_duration(eta_s)}")


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


class MetricSinks:
    """Rank 0's metric outputs: ``metrics.jsonl``, the results DB and optional trackers."""

    def __init__(self, out_dir: Path, run: str, db_path: Path | None, *, tensorboard: bool = False,
                 wandb: bool = False, wandb_project: str = "fibattn", config: dict | None = None):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.run = run
        self.db = ResultsDB(db_path) if db_path is not None else None
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

    def truncate(self, after_step: int) -> None:
        """Drop records past ``after_step`` (a resumed run logs them again)."""
        if self.path.exists():
            keep = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= after_step]
            atomic_write_text(self.path, "".join(line + "\n" for line in keep))
        if self.db is not None:
            self.db.truncate(self.run, after_step)

    def log(self, step: int, values: dict, alphas: list[float] | None = None) -> None:
        record = {"step": step, "time": round(time.time(), 3), **values}
        if alphas is not None:
            record["alphas"] = alphas
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.db is not None:
            self.db.log_metrics(self.run, step, values)
            if alphas is not None:
                self.db.log_alphas(self.run, step, alphas)
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
            self.db.finish_run(self.run, status)
            self.db.close()
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish(exit_code=0 if status in ("finished", "stopped") else 1)
