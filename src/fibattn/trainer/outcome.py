"""What a training run gives back (:class:`TrainResult`, :class:`TrainingAborted`) and the reading of its
steps' values from the device, done only at the steps that log, evaluate or checkpoint (:func:`settle`):
between them the host queues steps without waiting for the GPU."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import state as S


class TrainingAborted(RuntimeError):
    """Too many consecutive non-finite steps; the last good checkpoint is left intact."""


@dataclass
class TrainResult:
    out_dir: Path
    status: str                        # finished | stopped
    step: int
    tokens: int
    losses: list = field(default_factory=list)        # (step, loss) of every step run by this call
    val_loss: dict = field(default_factory=dict)       # split -> loss at the last evaluation
    checkpoint: Path | None = None
    skipped_steps: int = 0
    elapsed_s: float = 0.0


def settle(trainer, pending: list, sinks, result: TrainResult, bar) -> float:
    """Read a :class:`~fibattn.trainer.trainer.Trainer`'s steps run since the last read (one device-to-host
    copy for all of them), in order: their losses, skipped updates and the abort on ``train.max_bad_steps`` in
    a row. The wait for the device is training time, counted in the window's. Returns the last grad norm."""
    t, world = trainer.cfg.train, trainer.dist.world_size
    t0 = time.perf_counter()
    values = torch.stack([torch.stack([loss, gnorm, ok.float()]) for _, loss, gnorm, ok in pending]).tolist()
    wait = time.perf_counter() - t0
    trainer.elapsed += wait
    trainer.window["time"] += wait
    gnorm = float("nan")
    for (step, *_), (loss, gnorm, ok) in zip(pending, values):
        loss /= world
        result.losses.append((step, loss))
        if ok:
            trainer.bad = 0
            trainer.window["loss"] += loss
            trainer.window["n"] += 1
            continue
        trainer.bad += 1
        trainer.skipped += 1
        bar.println(f"step {step}/{t.steps} | skipped: non-finite loss {loss} or grad_norm {gnorm} "
                    f"({trainer.bad} in a row, limit train.max_bad_steps={t.max_bad_steps})")
        if sinks is not None:
            sinks.log(step, {"skipped": 1.0})
        if trainer.bad >= t.max_bad_steps:
            newest = S.ck.latest_valid(S.ck.ckpt_root(trainer.out)) if trainer.dist.is_main else None
            raise TrainingAborted(
                f"{trainer.bad} consecutive non-finite steps (last at step {step}: loss={loss}, "
                f"grad_norm={gnorm}); aborting. Last good checkpoint: {newest or 'none'}. Lower train.lr, "
                f"check the data, or raise train.max_bad_steps")
    pending.clear()
    return gnorm
