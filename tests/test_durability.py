"""Durability of every atomic writer: a file's bytes reach the disk (fsync) before a rename makes it visible
under its final name, and a folder renamed into place has its own entries and every file in it synced first,
its new parent synced after, as is the folder a staged file moves into (docs/reliability.md).

The recorder below watches ``os.fsync``, ``os.rename`` and ``os.replace`` (``Path.rename`` / ``Path.replace``
call them) and identifies files by inode, so it does not care how a writer names its temporary files: at each
rename it lists what the source holds, and every one of those inodes must have been fsync'ed earlier. The
writers: a training run's checkpoints (with their tokenizer, config, meta.json, a re-save of the same step
setting the old one aside) and its config.json and metrics; exports (a new folder and ``--force`` into an old
one); evaluation's eval.json, alpha report and plots; prepared data (shards, tokenizer, manifest, a
``--force`` rebuild); the run config writer; the data folder's verification sidecar.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fibattn import config as C
from run_helpers import micro_config


def _ino(path_or_fd) -> tuple[int, int]:
    st = os.fstat(path_or_fd) if isinstance(path_or_fd, int) else os.lstat(path_or_fd)
    return st.st_dev, st.st_ino


class Recorder:
    """fsync / rename calls in order; ``problems()``: each rename whose source was not durable yet, and each
    folder renamed or file moved from another folder whose new parent was not synced afterwards (a temp file
    renamed within its folder needs no such sync: the old file stays whole until the new one is complete)."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch
        self.synced: set = set()
        self.renames: list = []            # (src, dst, [unsynced paths], directory?, index into self.syncs)
        self.syncs: list = []              # inodes in fsync order
        real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

        def fsync(fd):
            real_fsync(fd)
            key = _ino(fd)
            self.synced.add(key)
            self.syncs.append(key)

        def moving(real):
            def move(src, dst, *a, **kw):
                self._before(Path(os.fsdecode(src)), Path(os.fsdecode(dst)))
                return real(src, dst, *a, **kw)
            return move

        self.hooks = {"fsync": fsync, "rename": moving(real_rename), "replace": moving(real_replace)}

    def start(self) -> "Recorder":
        """Record from now on (what a test's own helpers wrote before is not fibattn's writing)."""
        for name, hook in self.hooks.items():
            self.monkeypatch.setattr(os, name, hook)
        return self

    def _before(self, src: Path, dst: Path) -> None:
        if src.is_symlink() or not src.exists():
            return
        todo = [src]
        if src.is_dir():
            todo += [p for p in src.rglob("*") if not p.is_symlink()]
        missing = [str(p.relative_to(src.parent)) for p in todo if _ino(p) not in self.synced]
        self.renames.append((src, dst, missing, src.is_dir(), len(self.syncs)))

    def problems(self) -> list[str]:
        out = []
        for src, dst, missing, folder, at in self.renames:
            if missing:
                out.append(f"{src} -> {dst}: not fsync'ed before the rename: {', '.join(sorted(missing))}")
            moved_in = folder or src.parent != dst.parent         # installed from elsewhere, not a temp's rename
            if moved_in and dst.parent.exists() and _ino(dst.parent) not in self.syncs[at:]:
                out.append(f"{src} -> {dst}: the new parent {dst.parent} was not fsync'ed after it")
        return out

    def renamed_to(self, name: str) -> list[Path]:
        return [dst for _, dst, _, _, _ in self.renames if dst.name == name]


@pytest.fixture
def recorder(monkeypatch):
    return Recorder(monkeypatch)          # tests call start() once their own set-up is written


def test_the_recorder_tells_a_synced_rename_from_an_unsynced_one(tmp_path, recorder):
    """The check itself: a file written and renamed without fsync is reported, by name; a folder whose file
    was synced but whose own entries were not is reported too."""
    from fibattn.files import atomic_write_text, fsync_dir
    recorder.start()
    (tmp_path / "plain.tmp").write_text("x")
    os.replace(tmp_path / "plain.tmp", tmp_path / "plain")
    atomic_write_text(tmp_path / "good", "y")
    (tmp_path / "stage").mkdir()
    atomic_write_text(tmp_path / "stage" / "f", "z")
    os.rename(tmp_path / "stage", tmp_path / "final")
    found = recorder.problems()
    assert len(found) == 3, found
    assert "plain.tmp" in found[0] and "good" not in " ".join(found)
    assert found[1].endswith("before the rename: stage")            # its file was synced, its entries not
    assert "new parent" in found[2]
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "stage").mkdir()
    atomic_write_text(tmp_path / "sub" / "stage" / "f", "z")
    fsync_dir(tmp_path / "sub" / "stage")
    os.rename(tmp_path / "sub" / "stage", tmp_path / "sub" / "final")
    fsync_dir(tmp_path / "sub")
    assert recorder.problems() == found                          # the folder done right adds nothing


def test_a_training_run_and_its_checkpoints(tmp_path, tiny_data, recorder):
    from fibattn.trainer.trainer import train
    cfg = micro_config(tmp_path / "runs" / "r", tiny_data, steps=2, batch_tokens=64, micro_batch=2, ckpt_every=1,
                       keep_ckpts=1, log_every=1, eval_every=0, threads=1)
    recorder.start()
    train(cfg)
    cfg.train.steps = 3
    train(cfg)                                   # resumes: metrics.jsonl rewritten, step-3 saved, step-2 pruned
    assert recorder.renamed_to("step-3") and recorder.renamed_to("metrics.jsonl")
    ckpt = tmp_path / "runs" / "r" / "checkpoints" / "step-3"
    assert (ckpt / "tokenizer.json").is_file() and (ckpt / "meta.json").is_file()
    assert recorder.problems() == [], "\n".join(recorder.problems())


def test_a_checkpoint_saved_again_over_the_same_step(tmp_path, recorder):
    """``state.save`` as the trainer calls it, twice for one step: the second sets the first aside."""
    from fibattn.data.tokenizers import ByteTokenizer
    from fibattn.model.lm import FibLM
    from fibattn.trainer import state as S
    from fibattn.trainer.distributed import DistInfo
    cfg = micro_config(tmp_path / "run", tmp_path / "data")
    torch.manual_seed(0)
    model = FibLM(cfg.model)
    opt = torch.optim.AdamW(model.parameters())
    tok = tmp_path / "tokenizer.json"
    ByteTokenizer().save(tok)

    class FakeLoader:
        def state_dict(self):
            return {"cursor": 4}
    recorder.start()
    for _ in range(2):
        S.save(tmp_path / "run", 5, model=model, optimizer=opt, names=[n for n, _ in model.named_parameters()],
               loader=FakeLoader(), trainer={"tokens": 0}, cfg=cfg, dist=DistInfo(), keep=3, tokenizer_file=tok)
    assert len(recorder.renamed_to("step-5")) == 2 and recorder.renamed_to("step-5.set-aside")
    assert recorder.problems() == [], "\n".join(recorder.problems())


def test_exports_new_and_forced(tmp_path, recorder):
    from fibattn.model.lm import FibLM
    from fibattn.storage.export import export_run
    from run_helpers import write_checkpoint
    cfg = micro_config(tmp_path / "runs" / "r", tmp_path / "data")
    torch.manual_seed(0)
    write_checkpoint(tmp_path / "runs" / "r", 3, FibLM(cfg.model), cfg)
    recorder.start()
    export_run(tmp_path / "runs" / "r", tmp_path / "exports" / "e")            # a new folder, renamed into place
    export_run(tmp_path / "runs" / "r", tmp_path / "exports" / "e", force=True)   # file by file into the old one
    assert recorder.renamed_to("e") and recorder.renamed_to("config.json")
    assert recorder.problems() == [], "\n".join(recorder.problems())


def test_evaluation_outputs(tmp_path, recorder):
    from fibattn.config import EvalConfig, ModelConfig, RunConfig
    from fibattn.data.tokenizers import ByteTokenizer
    from fibattn.eval.run_folder import evaluate_run
    from fibattn.model.lm import FibLM
    from run_helpers import write_checkpoint

    class Data:
        val_names, tokenizer = ["x"], ByteTokenizer()

        def val_tokens(self, name):
            return np.random.default_rng(0).integers(0, 255, 300)
    cfg = RunConfig(name="t")
    cfg.model = ModelConfig(vocab_size=256, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, seq_len=32, window=2,
                            base_k=6, schedule="learned", backend="torch")
    cfg.eval = EvalConfig(lengths=[32], tokens=64, batch_size=2)
    run = tmp_path / "runs" / "r"
    cfg.train.out_dir = str(run)
    torch.manual_seed(0)
    write_checkpoint(run, 2, FibLM(cfg.model), cfg, tokenizer=False)
    recorder.start()
    evaluate_run(run, data=Data(), device="cpu")
    evaluate_run(run, data=Data(), device="cpu")          # merged into the existing eval.json
    assert len(recorder.renamed_to("eval.json")) == 2 and recorder.renamed_to("alphas.md")
    assert recorder.problems() == [], "\n".join(recorder.problems())


def test_prepared_data_new_and_forced(tmp_path, recorder):
    from fibattn.config import DataConfig, SourceConfig
    from fibattn.data import TokenData, prepare
    fixture = Path(__file__).parent / "fixtures" / "data" / "sample.jsonl"
    cfg = DataConfig(out_dir=str(tmp_path / "data" / "d"), val_fraction=0.1, shard_tokens=2048,
                     sources=[SourceConfig(name="lines", kind="files", path=str(fixture))])
    recorder.start()
    out = prepare(cfg, progress=False)
    TokenData(out).val_tokens("lines")                 # the verification sidecar
    prepare(cfg, progress=False, force=True)          # the old folder moved away, the new one renamed in
    assert len(recorder.renamed_to("d")) == 2 and recorder.renamed_to("manifest.json")
    assert recorder.problems() == [], "\n".join(recorder.problems())


def test_run_config_writer(tmp_path, recorder):
    recorder.start()
    C.save(C.RunConfig(name="x"), tmp_path / "config.json")
    assert json.loads((tmp_path / "config.json").read_text())["name"] == "x"
    assert recorder.renamed_to("config.json") and recorder.problems() == []


def test_the_cpu_kernel_library_build(tmp_path, recorder):
    """The compiled CPU kernels are loaded by name from a cache folder: the library is on disk before it is
    renamed into place (a crash never leaves a torn file that the next process would load)."""
    import shutil
    from fibattn.ops import cpu_backend
    compiler = shutil.which("gcc")
    if compiler is None:
        pytest.skip("no gcc")
    recorder.start()
    cpu_backend._compile(compiler, tmp_path / "lib.so")
    assert recorder.renamed_to("lib.so") and recorder.problems() == [], "\n".join(recorder.problems())
