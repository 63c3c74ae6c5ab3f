"""DDP on CPU (gloo): ``torchrun`` with 2 or 4 processes matches one process with the same global batch."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from fibattn import config as C
from fibattn.config import TrainConfig
from fibattn.presets import tiny
from fibattn.trainer.trainer import train


def cfg_for(out, data_dir):
    cfg = tiny()
    m = cfg.model
    m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.seq_len, m.window, m.base_k = 32, 2, 2, 1, 32, 4, 6
    m.backend = "torch"
    cfg.data.out_dir = str(data_dir)
    cfg.train = TrainConfig(out_dir=str(out), steps=4, batch_tokens=256, micro_batch=2, lr=3e-3, warmup_steps=1,
                            log_every=1, ckpt_every=100, eval_tokens=256, threads=1)
    return cfg


def torchrun(cfg_path, out, *extra, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "fibattn.cli", "train", "--config", str(cfg_path), "--out", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def losses(out):
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if "loss" in r]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_data):
    root = tmp_path_factory.mktemp("ddp")
    data_dir = tiny_data
    single = train(cfg_for(root / "one", data_dir))
    cfg_path = root / "cfg.json"
    C.save(cfg_for(root / "unused", data_dir), cfg_path)
    return root, cfg_path, single


def check_matches(root, out, single):
    assert losses(out) == pytest.approx([v for _, v in single.losses], rel=1e-4)
    a = load_file(str(root / "one" / "checkpoints" / "step-4" / "model.safetensors"))
    b = load_file(str(out / "checkpoints" / "step-4" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


def test_two_processes_match_one(setup, tmp_path):
    root, cfg_path, single = setup
    out = tmp_path / "two"
    assert "finished: step 4" in torchrun(cfg_path, out)
    check_matches(root, out, single)
    files = set(os.listdir(out / "checkpoints" / "step-4"))
    assert {"loader-rank0.json", "loader-rank1.json", "rng-rank0.json", "rng-rank1.json"} <= files


def test_four_processes_match_one(setup, tmp_path):
    """More than two processes: gradients go through the ordered all-reduce hook (logged), and the run still
    matches one process."""
    root, cfg_path, single = setup
    out = tmp_path / "four"
    log = torchrun(cfg_path, out, nproc=4)
    assert "finished: step 4" in log and "all-reduced once per step in parameter order" in log
    check_matches(root, out, single)


@pytest.mark.slow
def test_four_processes_stop_and_resume_bit_for_bit(setup, tmp_path):
    """DDP rebuilds its buckets after a process's first step, so a resumed run's first step used another
    layout, and a ring all-reduce over four processes rounded differently: the ordered hook makes the
    resumed weights equal to an uninterrupted run's, bit for bit."""
    root, cfg_path, _ = setup
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert "finished: step 4" in torchrun(cfg_path, whole, nproc=4)
    assert "stopped: step 2" in torchrun(cfg_path, resumed, "--stop-at", "2", nproc=4)
    assert "finished: step 4" in torchrun(cfg_path, resumed, nproc=4)
    a = load_file(str(whole / "checkpoints" / "step-4" / "model.safetensors"))
    b = load_file(str(resumed / "checkpoints" / "step-4" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert losses(resumed) == losses(whole)


@pytest.mark.slow
def test_two_processes_stop_and_resume(setup, tmp_path):
    root, cfg_path, single = setup
    out = tmp_path / "two"
    assert "stopped: step 2" in torchrun(cfg_path, out, "--stop-at", "2")
    assert "finished: step 4" in torchrun(cfg_path, out)
    check_matches(root, out, single)


@pytest.mark.slow
def test_two_processes_with_activation_checkpointing_match_one_without(setup, tmp_path):
    """Recomputed blocks under DDP (non-reentrant checkpoint, gradients reduced as usual)."""
    root, cfg_path, single = setup
    out = tmp_path / "two"
    assert "finished: step 4" in torchrun(cfg_path, out, "--set", "train.activation_checkpointing=full")
    assert json.loads((out / "config.json").read_text())["train"]["activation_checkpointing"] == "full"
    check_matches(root, out, single)


@pytest.mark.parametrize("name", ["tiny", pytest.param("paper", marks=pytest.mark.slow)])
def test_presets_batch_settings_run_under_two_processes(name, tiny_data, tmp_path):
    """Each preset's batch (global tokens, micro-batch, sequence length) as written, under torchrun with
    2 processes: the micro-batch adapts and the split is logged; only the model is shrunk."""
    from fibattn.presets import PRESETS
    cfg = PRESETS[name]()
    m, t = cfg.model, cfg.train
    m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.vocab_size, m.backend = 32, 1, 2, 1, 256, "torch"
    cfg.data = tiny().data
    cfg.data.out_dir = str(tiny_data)
    t.steps, t.eval_tokens, t.ckpt_every, t.log_every, t.warmup_steps, t.threads = 1, m.seq_len, 100, 1, 1, 1
    t.results_db, t.precision, t.device = "off", "fp32", "cpu"
    cfg_path = tmp_path / "cfg.json"
    C.save(cfg, cfg_path)
    per_rank = t.batch_tokens // (m.seq_len * 2)
    micro = min(t.micro_batch, per_rank)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "fibattn.cli", "train", "--config", str(cfg_path), "--out", str(tmp_path / "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "finished: step 1" in proc.stdout
    split = (f"batch {t.batch_tokens} tokens = 2 process(es) x {per_rank // micro} micro-batch(es) x {micro} "
             f"sequences x {m.seq_len} tokens")
    assert split in proc.stdout + proc.stderr


ENTRY = """import os, signal, sys, time
from fibattn.cli import main
argv = sys.argv[1:]
if os.environ["RANK"] == "1":
    if os.environ["HOW"] == "dies":             # a rank that dies after starting, before the process group
        time.sleep(3)
        os.kill(os.getpid(), signal.SIGKILL)
    argv += ["--set", "train.lr=-1"]              # a rank that refuses its input
sys.exit(main(argv))
"""


def rank_errors(tmp_path, how, tiny_data):
    """torchrun with 2 processes, rank 1 refusing or dying before the process group exists: each rank's own
    stderr (torchrun --redirects), as lines."""
    (tmp_path / "entry.py").write_text(ENTRY)
    args = ["train", "--preset", "tiny", "--out", str(tmp_path / "run"), "--set", f"data.out_dir={tiny_data}",
            "--set", "model.d_model=32", "--set", "model.n_layers=1", "--set", "model.seq_len=32",
            "--set", "train.batch_tokens=128", "--set", "train.micro_batch=2", "--set", "train.steps=1",
            "--set", "train.results_db=off", "--set", "model.backend=torch", "--set", "train.threads=1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--redirects", "2",
           "--log-dir", str(tmp_path / "logs"), str(tmp_path / "entry.py"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HOW": how})
    assert proc.returncode != 0
    return {int(p.parent.name): p.read_text().splitlines() for p in (tmp_path / "logs").rglob("stderr.log")}


def one_error(lines):
    errors = [line for line in lines if "error" in line]
    assert len(errors) == 1 and not any("Traceback" in line for line in lines), lines
    return errors[0]


@pytest.mark.slow
def test_a_rank_that_refuses_before_the_process_group_is_named_by_every_rank(tiny_data, tmp_path):
    err = rank_errors(tmp_path, "refuses", tiny_data)
    assert "train.lr" in one_error(err[1])
    line = one_error(err[0])
    assert ("rank 1 of 2 refused" in line and "train.lr" in line) or "torchrun stopped it" in line, line


@pytest.mark.slow
def test_a_rank_that_dies_before_the_process_group_is_reported_by_the_others(tiny_data, tmp_path):
    err = rank_errors(tmp_path, "dies", tiny_data)
    assert "rank 0 of 2 stops: torchrun stopped it because another process" in one_error(err[0])
