"""Shared by the storage reliability tests: micro runs, file snapshots, one-line CLI checks."""
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from fibattn import config as C
from fibattn.cli import main
from fibattn.storage import checkpoint as ck
from fibattn.trainer.trainer import train
from run_helpers import micro_config


def micro(out, data_dir, **kw):
    t = dict(steps=6, batch_tokens=64, micro_batch=2, lr=3e-3, warmup_steps=2, log_every=2, ckpt_every=1,
             keep_ckpts=10, eval_tokens=64, threads=1, results_db="off")
    cfg = micro_config(out, data_dir, **{**t, **kw})
    cfg.eval.lengths, cfg.eval.tokens, cfg.eval.batch_size = [32], 128, 2
    return cfg


def snapshot(root: Path) -> dict:
    """Every file (sha256) and folder under ``root``."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(Path(root).rglob("*"))}


def run_cli(capsys, argv):
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, [line for line in cap.err.splitlines() if line.strip()]


def assert_one_line(rc, err, *needles):
    assert rc == 2, err
    assert len(err) == 1, err
    assert "Traceback" not in err[0] and "error" in err[0]
    for n in needles:
        assert str(n) in err[0], err[0]


def steps_of(out) -> list[int]:
    return [s for s, _ in ck.list_checkpoints(Path(out) / "checkpoints")]


def records(out) -> list[dict]:
    return [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def data_dir(tiny_data):
    return tiny_data


@pytest.fixture(scope="module")
def shared(tmp_path_factory, data_dir):
    """``run``: 6 steps, a checkpoint at every step. ``other``: the same with model.window=5 (another model)."""
    w = tmp_path_factory.mktemp("storage")
    train(micro(w / "run", data_dir))
    other = micro(w / "other", data_dir, ckpt_every=2)
    other.model.window = 5
    train(other)
    return w


@pytest.fixture
def run(shared, tmp_path):
    out = tmp_path / "runs" / "run"
    shutil.copytree(shared / "run", out)
    return out


def save_cfg(cfg, path) -> Path:
    C.save(cfg, path)
    return path


