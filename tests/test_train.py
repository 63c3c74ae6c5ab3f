import json
import logging
import sqlite3

import pytest
import torch
from safetensors.torch import load_file

from fibattn.storage import checkpoint as ck
from fibattn.cli import main as cli_main
from fibattn.config import ConfigError, RunConfig, TrainConfig
from fibattn.presets import tiny
from fibattn.trainer.setup import accum_steps
from fibattn.trainer.trainer import TrainingAborted, train
from run_helpers import micro_config
from fibattn.trainer.optim import lr_at, param_groups


@pytest.fixture(scope="module")
def data_dir(tiny_data):
    return tiny_data


def micro_cfg(out, data_dir, **train_kw) -> RunConfig:
    t = dict(steps=6, batch_tokens=128, micro_batch=2, lr=3e-3, warmup_steps=2, log_every=1, ckpt_every=100,
             eval_tokens=256, threads=1)
    return micro_config(out, data_dir, n_layers=2, **{**t, **train_kw})


def weights(run_dir, step):
    return load_file(str(run_dir / "checkpoints" / f"step-{step}" / "model.safetensors"))


def test_train_writes_outputs(tmp_path, data_dir):
    out = tmp_path / "runs" / "a"
    res = train(micro_cfg(out, data_dir, steps=8, eval_every=4, ckpt_every=4, keep_ckpts=1))
    assert res.status == "finished" and res.step == 8 and res.tokens == 8 * 128 and len(res.losses) == 8
    assert res.losses[-1][1] < res.losses[0][1]
    assert set(res.val_loss) == {"shakespeare"}
    assert json.loads((out / "config.json").read_text())["train"]["steps"] == 8
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == list(range(1, 9))
    assert [r["step"] for r in recs if "val/shakespeare/loss" in r] == [4, 8]
    assert [s for s, _ in ck.list_checkpoints(out / "checkpoints")] == [8]          # keep_ckpts=1
    c = ck.Checkpoint.open(res.checkpoint)
    assert c.state("trainer")["step"] == 8 and (res.checkpoint / "tokenizer.json").is_file()
    db = sqlite3.connect(tmp_path / "runs" / "results.sqlite")
    assert db.execute("SELECT name, status, label FROM runs").fetchall() == [("a", "finished", "tiny")]
    assert db.execute("SELECT COUNT(*) FROM metrics WHERE key='loss'").fetchone() == (8,)


def test_resume_is_bit_identical(tmp_path, data_dir):
    full = train(micro_cfg(tmp_path / "full", data_dir))
    part = train(micro_cfg(tmp_path / "part", data_dir), stop_at=3)
    assert part.status == "stopped" and part.step == 3
    rest = train(micro_cfg(tmp_path / "part", data_dir), resume="auto")
    assert rest.status == "finished" and [s for s, _ in rest.losses] == [4, 5, 6]
    assert [v for _, v in rest.losses] == [v for _, v in full.losses[3:]]
    a, b = weights(tmp_path / "full", 6), weights(tmp_path / "part", 6)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    recs = [json.loads(line) for line in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_resume_skips_corrupted_checkpoint(tmp_path, data_dir, caplog):
    out = tmp_path / "r"
    train(micro_cfg(out, data_dir, ckpt_every=2, keep_ckpts=5), stop_at=4)
    f = out / "checkpoints" / "step-4" / "optimizer.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="fibattn"):
        res = train(micro_cfg(out, data_dir, ckpt_every=2, keep_ckpts=5))
    assert "optimizer.safetensors is truncated" in caplog.text
    assert [s for s, _ in res.losses] == [3, 4, 5, 6]
    with pytest.raises(ck.CheckpointError, match="already holds checkpoints"):
        train(micro_cfg(out, data_dir), resume="never")
    changed = micro_cfg(out, data_dir, steps=8)
    changed.model.window = 5
    with pytest.raises(ck.CheckpointError, match="model.window is 5"):
        train(changed)


def test_nonfinite_steps_are_skipped_then_abort(tmp_path, data_dir):
    nan = float("nan")
    res = train(micro_cfg(tmp_path / "s", data_dir), loss_hook=lambda step, loss: loss * nan if step == 2 else loss)
    assert res.skipped_steps == 1 and res.status == "finished"
    recs = [json.loads(line) for line in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r.get("skipped") == 1.0] == [2]
    out = tmp_path / "abort"
    with pytest.raises(TrainingAborted, match="2 consecutive non-finite steps .*step 4.*step-2"):
        train(micro_cfg(out, data_dir, ckpt_every=2, max_bad_steps=2),
              loss_hook=lambda step, loss: loss * nan if step >= 3 else loss)
    assert [s for s, _ in ck.list_checkpoints(out / "checkpoints")] == [2]
    ck.verify(out / "checkpoints" / "step-2")


def test_grad_clip_rescales_the_gradient_adamw_steps_with(tmp_path, data_dir):
    """train.grad_clip: the accumulated gradient is scaled to that global norm before the
    optimiser step (torch's clip_grad_norm_: ``g * clip / (norm + 1e-6)``) when its norm is
    larger; 0 turns clipping off. The logged grad_norm is the norm before clipping."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    seen = {}
    clip_now = []

    def record(opt, args, kwargs):          # the gradients the AdamW step is about to use
        seen.setdefault(clip_now[-1], []).append(
            [p.grad.detach().double().clone() for g in opt.param_groups for p in g["params"]])
    handle = register_optimizer_step_pre_hook(record)
    try:
        for clip in (0.0, 1e-3, 1e6):
            clip_now.append(clip)
            res = train(micro_cfg(tmp_path / f"clip-{clip}", data_dir, steps=1, warmup_steps=1, grad_clip=clip,
                                  eval_tokens=32, results_db="off"))
            assert res.step == 1 and res.skipped_steps == 0
    finally:
        handle.remove()
    assert all(len(steps) == 1 for steps in seen.values()) and len(seen) == 3
    raw, clipped, loose = (seen[c][0] for c in (0.0, 1e-3, 1e6))

    def norm(grads):
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    n = norm(raw)
    assert n > 0.05                                     # far above the clip: clipping must act
    assert norm(clipped) == pytest.approx(1e-3, rel=1e-4)
    coef = 1e-3 / (n + 1e-6)
    for a, b in zip(raw, clipped):                      # same direction, every tensor scaled alike
        torch.testing.assert_close(b, a * coef, rtol=1e-5, atol=1e-12)
    assert all(torch.equal(a, b) for a, b in zip(raw, loose))      # a clip above the norm changes nothing
    recs = [json.loads(line) for line in (tmp_path / "clip-0.001" / "metrics.jsonl").read_text().splitlines()]
    logged = [r["grad_norm"] for r in recs if "grad_norm" in r]
    assert logged == [pytest.approx(n, rel=1e-5)]


def test_learned_alphas_are_logged(tmp_path, data_dir):
    cfg = micro_cfg(tmp_path / "runs" / "learned", data_dir, steps=3)
    cfg.model.schedule = "learned"
    train(cfg)
    db = sqlite3.connect(tmp_path / "runs" / "results.sqlite")
    rows = db.execute("SELECT step, layer, alpha FROM alphas WHERE run='learned' ORDER BY step, layer").fetchall()
    assert [(s, layer) for s, layer, _ in rows] == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    assert all(0.5 <= a <= 1.5 for _, _, a in rows)


def test_config_errors(tmp_path, data_dir):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="train.out_dir .* not writable"):
        train(micro_cfg(blocker / "sub", data_dir))
    with pytest.raises(ConfigError, match="train.out_dir .* not a folder"):
        train(micro_cfg(blocker, data_dir))
    with pytest.raises(ConfigError, match="world_size"):
        accum_steps(micro_cfg(tmp_path, data_dir, batch_tokens=96, micro_batch=1), 2)
    cfg = micro_cfg(tmp_path / "v", data_dir)
    cfg.model.vocab_size = 100
    with pytest.raises(ConfigError, match="model.vocab_size"):
        train(cfg)
    with pytest.raises(ValueError, match="stop_at"):
        train(cfg, stop_at=0)


@pytest.mark.parametrize("preset,world,micro,accum", [("paper", 8, 4, 1), ("paper", 2, 8, 2), ("paper", 1, 8, 4),
                                                      ("tiny", 2, 8, 1), ("tiny", 3, None, None)])
def test_micro_batch_follows_the_world_size_and_keeps_the_global_batch(preset, world, micro, accum):
    from fibattn.presets import get_preset
    from fibattn.trainer.micro_batch import FALLBACK
    cfg = get_preset(preset)
    if micro is None:                        # 4096 tokens of 256 cannot split over 3 processes
        with pytest.raises(ConfigError, match="world_size"):
            accum_steps(cfg, world)
        return
    if cfg.train.micro_batch == 0:           # auto: what a CPU takes (tests/test_micro_batch_auto.py tries CUDA's)
        cfg.train.micro_batch = FALLBACK
    assert accum_steps(cfg, world) == accum and cfg.train.micro_batch == micro
    assert accum * micro * cfg.model.seq_len * world == cfg.train.batch_tokens


def test_lr_schedule_and_decay_groups():
    t = TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, t) == pytest.approx(0.1) and lr_at(9, t) == pytest.approx(1.0)
    assert lr_at(10, t) == pytest.approx(1.0) and lr_at(99, t) == pytest.approx(0.1)
    assert lr_at(54, t) == pytest.approx(0.55, abs=0.01)
    from fibattn.model.lm import FibLM
    cfg = tiny().model
    cfg.schedule = "learned"
    decay, no_decay = param_groups(FibLM(cfg), 0.1)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert no_decay["weight_decay"] == 0.0 and any(p.numel() == 1 for p in no_decay["params"])


def test_cli(tmp_path, data_dir, capsys):
    out = tmp_path / "cli"
    args = ["train", "--preset", "tiny", "--out", str(out), "--set", f"data.out_dir={data_dir}",
            "--set", "model.d_model=32", "--set", "model.n_layers=1", "--set", "model.seq_len=32",
            "--set", "train.batch_tokens=64", "--set", "train.micro_batch=2", "--set", "train.steps=2",
            "--set", "train.log_every=1", "--set", "model.backend=torch", "--set", "train.eval_tokens=64"]
    assert cli_main(args) == 0
    text = capsys.readouterr().out
    assert "step 2/2 | loss " in text and "| tok/s " in text and "finished: step 2" in text
    assert cli_main(["train", "--preset", "tiny", "--config", "x.json"]) == 2
    assert cli_main(["train", "--preset", "tiny", "--set", "train.steps=-1"]) == 2


def test_load_run(tmp_path, data_dir):
    from fibattn.storage.runs import load_run
    out = tmp_path / "lr"
    train(micro_cfg(out, data_dir, steps=4, ckpt_every=2, keep_ckpts=3))
    model, cfg, tok = load_run(out)
    assert cfg.train.steps == 4 and not model.training
    w = weights(out, 4)
    assert all(torch.equal(model.state_dict()[k], w[k]) for k in w)
    assert tok.decode(tok.encode("To be")) == "To be"
    model2, cfg2, _ = load_run(out / "checkpoints" / "step-2", model_overrides=["model.reach=train"])
    assert cfg2.model.reach == "train" and not torch.equal(model2.embed.weight, model.embed.weight)
    f = out / "checkpoints" / "step-4" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1])
    assert load_run(out)[1].train.steps == 4                           # falls back to step-2
    with pytest.raises(ck.CheckpointError, match="model.safetensors"):
        load_run(out, step=4)
    with pytest.raises(FileNotFoundError, match="have: 2, 4"):
        load_run(out, step=3)
    with pytest.raises(ValueError, match="model_overrides"):
        load_run(out, model_overrides=["model.window=3"])


def test_sigterm_stops_with_checkpoint(tmp_path, data_dir):
    import os
    import signal

    def hook(step, loss):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss
    res = train(micro_cfg(tmp_path / "t", data_dir), loss_hook=hook)
    assert res.status == "stopped" and res.step == 3
    ck.verify(tmp_path / "t" / "checkpoints" / "step-3")
    assert train(micro_cfg(tmp_path / "t", data_dir)).status == "finished"


@pytest.mark.parametrize("kw, package", [({"tensorboard": True}, "tensorboard"), ({"wandb": True}, "wandb")])
def test_trackers_need_their_package(tmp_path, data_dir, monkeypatch, kw, package):
    """The package's absence is simulated (``sys.modules[name] = None``, and torch's cached
    tensorboard bridge dropped so that it is imported again), installed or not."""
    import sys
    from fibattn.trainer.logs import MetricSinks
    for mod in list(sys.modules):
        if mod == "torch.utils.tensorboard" or mod.startswith("torch.utils.tensorboard."):
            monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(ConfigError, match=f"train.{package}=true needs the {package} package"):
        MetricSinks(tmp_path, "r", None, **kw)
    # through train(): refused before the first step, with nothing logged
    steps = []
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=f"train.{package}=true needs the {package} package"):
        train(micro_cfg(out, data_dir, results_db="off", **kw), loss_hook=lambda step, loss: steps.append(step) or loss)
    assert steps == [] and not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


@pytest.mark.slow
def test_tiny_preset_learns_shakespeare(tmp_path, data_dir):
    """The tiny preset as shipped (a few CPU minutes): loss falls far below the unigram entropy (3.33 nats)."""
    cfg = tiny()
    cfg.data.out_dir = str(data_dir)
    cfg.train.out_dir = str(tmp_path / "tiny")
    res = train(cfg)
    assert res.status == "finished" and res.step == cfg.train.steps
    assert res.val_loss["shakespeare"] < 2.0
