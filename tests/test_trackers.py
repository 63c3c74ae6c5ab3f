"""Experiment trackers: ``train.tensorboard=true`` writes event files, ``train.wandb=true`` an offline run.

The real packages are used where installed; the calls fibattn makes are also checked against
stand-in modules, and a missing package is simulated, so every branch runs in any environment.
"""
import sys
import types

import pytest

from fibattn.config import ConfigError
from fibattn.trainer.logs import MetricSinks, wandb_run_id


def hide_package(monkeypatch, name, *dependents):
    """Make ``import name`` fail as if it were not installed (``sys.modules[name] = None``);
    cached ``dependents`` (modules importing it, e.g. ``torch.utils.tensorboard``) are dropped
    so that their import runs again and fails the same way. Undone after the test."""
    for mod in list(sys.modules):
        if any(mod == d or mod.startswith(d + ".") for d in dependents):
            monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, name, None)


class Recorder:
    """Records every call made on it (and on what its calls return) as ``(name, args, kwargs)``."""

    def __init__(self, calls, prefix=""):
        self._calls, self._prefix = calls, prefix

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self._calls.append((self._prefix + name, args, kwargs))
            return Recorder(self._calls, self._prefix + name + ".")
        return call


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    sinks = MetricSinks(tmp_path, "tb-run", None, tensorboard=True)
    sinks.log(1, {"loss": 2.5, "lr": 1e-3}, alphas=[0.5, 1.5])
    sinks.log(2, {"loss": 2.25, "lr": 1e-3}, alphas=[0.6, 1.4])
    sinks.close("finished")
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    got = _scalars(tmp_path / "tensorboard")
    assert got["loss"] == [(1, 2.5), (2, 2.25)]
    assert [s for s, _ in got["alpha/layer1"]] == [1, 2] and got["alpha/layer1"][1][1] == pytest.approx(1.4)
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2


def test_wandb_offline_run_folder(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    sinks = MetricSinks(tmp_path, "wb:run", None, wandb=True, config={"model": {"window": 8}})
    sinks.log(1, {"loss": 3.0}, alphas=[1.0])
    sinks.close("finished")
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and runs[0].name.endswith("-wb-run")
    assert list(runs[0].glob("run-*.wandb"))


def test_tensorboard_calls_with_a_stand_in_writer(tmp_path, monkeypatch):
    """What MetricSinks asks of SummaryWriter, whether or not tensorboard is installed."""
    calls = []
    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = lambda **kw: calls.append(("SummaryWriter", (), kw)) or Recorder(calls)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    sinks = MetricSinks(tmp_path, "tb-run", None, tensorboard=True)
    sinks.log(3, {"loss": 2.5, "lr": 1e-3}, alphas=[0.5, 1.5])
    sinks.log(4, {"loss": 2.25})
    sinks.close("finished")
    assert calls == [
        ("SummaryWriter", (), {"log_dir": str(tmp_path / "tensorboard")}),
        ("add_scalar", ("loss", 2.5, 3), {}), ("add_scalar", ("lr", 1e-3, 3), {}),
        ("add_scalar", ("alpha/layer0", 0.5, 3), {}), ("add_scalar", ("alpha/layer1", 1.5, 3), {}),
        ("add_scalar", ("loss", 2.25, 4), {}),
        ("close", (), {})]


@pytest.mark.parametrize("status, code", [("finished", 0), ("stopped", 0), ("failed", 1)])
def test_wandb_calls_with_a_stand_in_module(tmp_path, monkeypatch, status, code):
    """What MetricSinks asks of wandb, whether or not wandb is installed."""
    calls = []
    monkeypatch.setitem(sys.modules, "wandb", Recorder(calls, "wandb."))
    sinks = MetricSinks(tmp_path, "grid/w8:fib", None, wandb=True, wandb_project="proj", config={"a": 1})
    sinks.log(7, {"loss": 3.0}, alphas=[1.0, 1.25])
    sinks.log(8, {"loss": 2.0})
    sinks.close(status)
    assert calls == [
        ("wandb.init", (), {"project": "proj", "name": "grid/w8:fib", "config": {"a": 1}, "dir": str(tmp_path),
                            "resume": "allow", "id": "grid-w8-fib"}),
        ("wandb.init.log", ({"loss": 3.0, "alpha/layer0": 1.0, "alpha/layer1": 1.25},), {"step": 7}),
        ("wandb.init.log", ({"loss": 2.0},), {"step": 8}),
        ("wandb.init.finish", (), {"exit_code": code})]


@pytest.mark.parametrize("package, kw, dependents", [
    ("tensorboard", {"tensorboard": True}, ("torch.utils.tensorboard",)),
    ("wandb", {"wandb": True}, ())])
def test_missing_tracker_package_is_a_config_error(tmp_path, monkeypatch, package, kw, dependents):
    hide_package(monkeypatch, package, *dependents)
    with pytest.raises(ConfigError, match=rf"train.{package}=true needs the {package} package \(pip install "
                                          rf"{package}, or the \[track\] extra\)"):
        MetricSinks(tmp_path, "r", None, **kw)
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "wandb").exists()
    MetricSinks(tmp_path, "r", None).close("finished")       # no tracker asked for: no import needed


def test_wandb_run_id():
    assert wandb_run_id("grid/w8:fib#1?%") == "grid-w8-fib-1--"
    assert wandb_run_id("tiny") == "tiny"


@pytest.mark.slow
def test_train_with_both_trackers(tmp_path, monkeypatch):
    """End to end through ``fibattn.trainer.trainer.train`` with both switches on."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from fibattn.config import TrainConfig
    from fibattn.data import ensure_prepared
    from fibattn.presets import tiny
    from fibattn.trainer.trainer import train
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = tiny()
    m = cfg.model
    m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.seq_len, m.window, m.base_k = 32, 2, 2, 1, 32, 4, 6
    cfg.data.out_dir = str(tmp_path / "data")
    ensure_prepared(cfg.data, progress=False)
    out = tmp_path / "run"
    cfg.train = TrainConfig(out_dir=str(out), steps=3, batch_tokens=128, micro_batch=2, lr=3e-3, warmup_steps=1,
                            log_every=1, ckpt_every=100, eval_tokens=256, threads=1, tensorboard=True, wandb=True,
                            results_db="off")
    assert train(cfg).status == "finished"
    got = _scalars(out / "tensorboard")
    assert [s for s, _ in got["loss"]] == [1, 2, 3] and "val/shakespeare/loss" in got
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))
