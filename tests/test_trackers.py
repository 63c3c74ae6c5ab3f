"""Experiment trackers: ``train.tensorboard=true`` writes event files, ``train.wandb=true`` an offline run."""
import pytest

from fibattn.trainer.logs import MetricSinks, wandb_run_id


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


def test_wandb_run_id():
    assert wandb_run_id("grid/w8:fib#1?%") == "grid-w8-fib-1--"
    assert wandb_run_id("tiny") == "tiny"


@pytest.mark.slow
def test_train_with_both_trackers(tmp_path, monkeypatch):
    """End to end through ``fibattn.train.train`` with both switches on."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from fibattn.config import TrainConfig
    from fibattn.data import ensure_prepared
    from fibattn.presets import tiny
    from fibattn.train import train
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
