"""Shared by the bench's tests and the GPU check's: ``fibattn bench train`` without building or timing a model."""
import types

from fibattn.bench import train as bt
from fibattn.bench import train_steps as bts


def fake_train(monkeypatch, durations: dict):
    """Replace model building with recorders and the clock with one that each step advances
    by its variant's duration; returns the call log."""
    log, now = [], [0.0]

    def make_step(model_cfg, batch, device, compiled=False, documents=0, **how):
        name = model_cfg.attention + ("_compiled" if compiled else "")

        def step():
            log.append(name)
            now[0] += durations[name]
        return step, (2 if compiled else 1)

    monkeypatch.setattr(bt, "make_step", make_step)
    monkeypatch.setattr(bts, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    return log
