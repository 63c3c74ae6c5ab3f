"""The fine-tune recipe and the learning-rate schedule with settings that do not coincide: the defaults
make min_lr_ratio, weight_decay, the recipe's step fraction and its warm-up fraction all 0.1, so a
formula that reads the wrong one passes every test that keeps them."""
import math

import pytest

from fibattn.config import TrainConfig
from fibattn.presets import tiny
from fibattn.trainer import init_recipe as R
from fibattn.trainer.optim import lr_at


def _cfg(**train):
    cfg = tiny()
    cfg.train = TrainConfig(**{"steps": 1000, "lr": 4e-3, "min_lr_ratio": 0.25, "warmup_steps": 77,
                               "weight_decay": 0.05, **train})
    return cfg


def test_recipe_from_its_definition(monkeypatch):
    monkeypatch.setattr(R, "STEPS_FRACTION", 0.2)
    monkeypatch.setattr(R, "WARMUP_FRACTION", 0.3)
    cfg = _cfg()
    done = R.apply_recipe(cfg, set())
    t = cfg.train
    assert t.steps == 200                                  # STEPS_FRACTION of the from-scratch steps
    assert t.lr == pytest.approx(4e-3 * 0.25)              # where the from-scratch schedule ends
    assert t.warmup_steps == 60                            # WARMUP_FRACTION of the fine-tune
    assert done == ["train.steps=200", "train.lr=0.001", "train.warmup_steps=60"]


def test_recipe_keeps_what_the_user_set():
    cfg = _cfg()
    assert R.apply_recipe(cfg, {"train.steps", "train.lr"}) == ["train.warmup_steps=100"]
    assert (cfg.train.steps, cfg.train.lr, cfg.train.warmup_steps) == (1000, 4e-3, 100)
    cfg = _cfg(steps=3)
    R.apply_recipe(cfg, set())
    assert (cfg.train.steps, cfg.train.warmup_steps) == (1, 1)          # at least one step of each


@pytest.mark.parametrize("warmup", [1, 5])
def test_schedule_from_its_definition(warmup):
    t = TrainConfig(steps=40, lr=2e-3, min_lr_ratio=0.25, warmup_steps=warmup, weight_decay=0.05)
    for s in range(warmup):
        assert lr_at(s, t) == pytest.approx(2e-3 * (s + 1) / warmup)
    assert lr_at(warmup, t) == pytest.approx(2e-3)                       # the peak, then cosine
    assert lr_at(39, t) == pytest.approx(2e-3 * 0.25)                    # min_lr_ratio * lr at the last step
    mid = warmup + (39 - warmup) / 2
    if mid == int(mid):
        assert lr_at(int(mid), t) == pytest.approx(2e-3 * (0.25 + 0.75 * 0.5 * (1 + math.cos(math.pi / 2))))
