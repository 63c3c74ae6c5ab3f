"""The fine-tuning recipe of a run that starts from trained weights (``train --init-from``;
docs/retrofit.md has the measurements behind it).

Relative to the config's own from-scratch recipe, for every key the user did not set:

- ``train.steps``: a tenth of the from-scratch steps;
- ``train.lr``: where the from-scratch schedule ends (``lr * min_lr_ratio``): the source was
  trained down to about that rate, and a higher one first undoes part of its training;
- ``train.warmup_steps``: a tenth of the fine-tune (at least 1 step).

The cosine decay to ``min_lr_ratio`` is kept. Nothing is frozen: sparse attention changes which
keys each layer reads, and every weight adapts to that.
"""
from __future__ import annotations

from ..checks import ConfigError

STEPS_FRACTION = 0.1
WARMUP_FRACTION = 0.1
RECIPE_KEYS = ("train.steps", "train.lr", "train.warmup_steps")


def apply_recipe(cfg, given: set | list | tuple) -> list[str]:
    """Set the recipe's keys that are not in ``given`` (keys the user set); returns ``key=value`` of
    what was set. ``cfg`` holds the from-scratch recipe with the user's settings applied."""
    t, done = cfg.train, []
    if "train.steps" not in given:
        t.steps = max(1, round(STEPS_FRACTION * t.steps))
        done.append(f"train.steps={t.steps}")
    if "train.lr" not in given:
        if not t.lr * t.min_lr_ratio > 0:           # else a learning rate of 0 blamed on train.lr, never set
            raise ConfigError(f"--init-from fine-tunes at train.lr * train.min_lr_ratio, which is 0 with "
                              f"train.min_lr_ratio={t.min_lr_ratio}: set train.lr, or train.min_lr_ratio > 0")
        t.lr = float(f"{t.lr * t.min_lr_ratio:.6g}")          # 3e-4, not 3.0000000000000003e-4
        done.append(f"train.lr={t.lr:g}")
    if "train.warmup_steps" not in given:
        t.warmup_steps = max(1, round(WARMUP_FRACTION * t.steps))
        done.append(f"train.warmup_steps={t.warmup_steps}")
    return done
