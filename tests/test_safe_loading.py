"""Safe loading: checkpoints and exported models are read without unpickling.

1. A source scan: every ``torch.load`` passes ``weights_only=True``; nothing calls
   ``pickle.load(s)``, ``numpy.load(..., allow_pickle=True)`` or imports ``dill``/``joblib``.
2. A malicious pickle (its ``__reduce__`` would create a marker file) planted where a
   weights or state file is expected -- with the checksums updated, as an attacker who can
   write the folder would -- is refused with an error naming the file; the marker never appears.
"""
import hashlib
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest

from fibattn.storage import checkpoint as ck
from fibattn.trainer.trainer import train
from run_helpers import micro_config

SRC = Path(__file__).resolve().parents[1] / "src" / "fibattn"


def _sources():
    return sorted(SRC.rglob("*.py"))


def test_every_torch_load_is_weights_only():
    calls = 0
    for path in _sources():
        text = path.read_text()
        for m in re.finditer(r"torch\.load\(", text):
            depth, i = 1, m.end()
            while depth and i < len(text):
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            call = text[m.start():i]
            calls += 1
            assert re.search(r"weights_only\s*=\s*True", call), f"{path.name}: {call}"


@pytest.mark.parametrize("pattern", [r"\bpickle\.loads?\(", r"\bcPickle\b", r"allow_pickle\s*=\s*True",
                                     r"^\s*(import|from)\s+(dill|joblib|cloudpickle)\b", r"\bUnpickler\("])
def test_no_unpickling_in_the_source(pattern):
    bad = [f"{p.relative_to(SRC)}:{n}" for p in _sources() for n, line in enumerate(p.read_text().splitlines(), 1)
           if re.search(pattern, line)]
    assert bad == []


class _Boom:
    """Unpickling this creates the marker file (what an attacker's payload would run)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _evil_bytes(marker) -> bytes:
    return pickle.dumps({"weight": _Boom(marker)})


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_data):
    w = tmp_path_factory.mktemp("safe")
    train(micro_config(w / "run", tiny_data, steps=2, batch_tokens=64, micro_batch=2, log_every=1, ckpt_every=100,
                       eval_tokens=64, threads=1, results_db="off"))
    return w / "run"


def _plant_in_checkpoint(ckpt: Path, name: str, payload: bytes) -> None:
    """Replace ``name`` and re-sign meta.json so the hash check passes (a determined attacker)."""
    (ckpt / name).write_bytes(payload)
    meta = json.loads((ckpt / ck.META).read_text())
    meta["files"][name] = {"sha256": hashlib.sha256(payload).hexdigest(), "bytes": len(payload)}
    (ckpt / ck.META).write_text(json.dumps(meta))


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "optimizer.json"])
def test_pickle_in_checkpoint_is_refused(run_dir, tmp_path, name):
    from fibattn.storage.runs import load_run
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    ckpt = run / "checkpoints" / "step-2"
    marker = tmp_path / "PWNED"
    _plant_in_checkpoint(ckpt, name, _evil_bytes(marker))
    if name == "model.safetensors":
        with pytest.raises(ck.CheckpointError, match="model.safetensors"):
            load_run(run, step=2)
    with pytest.raises(ValueError, match=re.escape(name.split(".")[0])):
        c = ck.Checkpoint.open(ckpt)
        c.tensors("model") if name == "model.safetensors" else c.state("optimizer")
    assert not marker.exists()


def test_pickle_checkpoint_refused_on_resume_and_cli(run_dir, tmp_path, capsys):
    from fibattn.cli import main
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    marker = tmp_path / "PWNED"
    _plant_in_checkpoint(run / "checkpoints" / "step-2", "model.safetensors", _evil_bytes(marker))
    assert main(["generate", str(run), "--prompt", "To be", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.safetensors" in err[0]
    cfg_path = run / "config.json"
    assert main(["train", "--config", str(cfg_path), "--out", str(run), "--resume",
                 str(run / "checkpoints" / "step-2"), "--set", "train.steps=3"]) == 2
    assert "model.safetensors" in capsys.readouterr().err
    assert not marker.exists()


def test_pickle_in_export_is_refused(run_dir, tmp_path):
    export = pytest.importorskip("fibattn.storage.export")
    hub = pytest.importorskip("fibattn.storage.pretrained")
    out = export.export_run(run_dir, tmp_path / "exp")
    marker = tmp_path / "PWNED"
    payload = _evil_bytes(marker)
    (out / "model.safetensors").write_bytes(payload)
    cfg = json.loads((out / "config.json").read_text())
    cfg["files"]["model.safetensors"] = {"sha256": hashlib.sha256(payload).hexdigest(), "bytes": len(payload)}
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model.safetensors"):
        hub.load_pretrained(out)
    assert not marker.exists()
    # a torch-pickle file dropped next to it is never looked at
    (out / "pytorch_model.bin").write_bytes(payload)
    with pytest.raises(ValueError):
        hub.load_pretrained(out)
    assert not marker.exists()
