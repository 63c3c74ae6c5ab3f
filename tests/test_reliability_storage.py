# ruff: noqa: F811  (pytest fixtures imported from storage_helpers are requested by name)
"""Storage reliability: nothing of the user's is lost, nothing unverified is recorded, and a bad
file gives one line naming it.

- ``export --force`` replaces only what the earlier export's ``config.json`` lists;
- resuming an older checkpoint into a run with newer ones is refused (branch into a new ``--out``);
  pruning never deletes a checkpoint newer than the one just saved; a folder in the way of a
  save is set aside, never deleted;
- a checkpoint is checked against its folder name and its run's ``config.json``; malformed
  ``meta.json`` shapes are verification failures (``--resume auto`` falls back past them).

The results database, ``eval.json`` and ``metrics.jsonl`` are in ``test_reliability_records.py``.
CLI cases run in-process through ``fibattn.cli.main``: exit 2, one stderr line naming the file,
no traceback, and the files compared before and after. Micro runs (d_model 32, one layer, CPU).
"""
import hashlib
import json
import logging
import shutil

import pytest
import torch

from fibattn.storage import checkpoint as ck
from fibattn.storage.export import export_run
from fibattn.storage.pretrained import verify_export
from fibattn.storage.runs import load_run, read_eval_doc
from fibattn.trainer.trainer import train
from storage_helpers import (assert_one_line, data_dir, micro, records, run, run_cli, save_cfg, shared,  # noqa: F401
                             snapshot, steps_of)


# ------------------------------------------------------------------ 1. export --force
def test_export_force_keeps_files_the_user_added(tmp_path, run, capsys):
    out = tmp_path / "exp"
    export_run(run, out, step=6)
    (out / "notes.txt").write_text("my notes")
    (out / "eval-mine").mkdir()
    (out / "eval-mine" / "scores.csv").write_text("a,b\n1,2\n")
    rc, stdout, err = run_cli(capsys, ["export", run, out, "--step", "3", "--force"])
    assert rc == 0 and not err and "wrote" in stdout
    assert (out / "notes.txt").read_text() == "my notes"
    assert (out / "eval-mine" / "scores.csv").read_text() == "a,b\n1,2\n"
    meta = verify_export(out)
    assert meta["source"]["step"] == 3
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "eval-mine", "fibattn_tokenizer.json",
                                                     "model.safetensors", "notes.txt", "tokenizer.json",
                                                     "tokenizer_config.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]          # no staging left


def test_export_force_removes_only_files_the_earlier_export_listed(tmp_path, run, capsys):
    out = tmp_path / "exp"
    export_run(run, out)
    meta = json.loads((out / "config.json").read_text())
    (out / "extra.bin").write_bytes(b"old export part")            # a part of the earlier export ...
    meta["files"]["extra.bin"] = {"sha256": hashlib.sha256(b"old export part").hexdigest(), "bytes": 15}
    (out / "config.json").write_text(json.dumps(meta))              # ... listed by its config.json
    (out / "mine.txt").write_text("keep")
    rc, _, err = run_cli(capsys, ["export", run, out, "--force"])
    assert rc == 0 and not err
    assert not (out / "extra.bin").exists() and (out / "mine.txt").read_text() == "keep"
    verify_export(out)


def test_export_force_refuses_to_overwrite_an_unlisted_user_file(tmp_path, run, capsys):
    out = tmp_path / "exp"
    export_run(run, out)
    meta = json.loads((out / "config.json").read_text())
    del meta["files"]["README.md"]                                  # the earlier export did not write a card
    (out / "config.json").write_text(json.dumps(meta))
    (out / "README.md").write_text("# my own write-up\n")
    before = snapshot(tmp_path)
    rc, _, err = run_cli(capsys, ["export", run, out, "--force"])
    assert_one_line(rc, err, "README.md", str(out))
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("kind", ["not-an-export", "broken-config", "listing-escapes"])
def test_export_force_refuses_a_folder_that_is_not_an_earlier_export(tmp_path, run, capsys, kind):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    victim = tmp_path / "victim.txt"
    victim.write_text("outside")
    if kind == "broken-config":
        (out / "config.json").write_text('{"fibattn_format": 1, "model": ')
    elif kind == "listing-escapes":
        (out / "config.json").write_text(json.dumps({"fibattn_format": 1, "model": {}, "files": {
            "model.safetensors": {"sha256": "0", "bytes": 1}, "../victim.txt": {"sha256": "0", "bytes": 7}}}))
    before = snapshot(tmp_path)
    rc, _, err = run_cli(capsys, ["export", run, out, "--force"])
    assert_one_line(rc, err, str(out))
    assert snapshot(tmp_path) == before and victim.read_text() == "outside"


def test_export_config_with_a_wrong_tokenizer_field_is_named(tmp_path, run):
    from fibattn.storage.pretrained import ExportError, load_model
    out = export_run(run, tmp_path / "exp")
    meta = json.loads((out / "config.json").read_text())
    meta["tokenizer"] = ["tokenizer.json"]                  # was a TypeError (unhashable list) traceback
    (out / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ExportError, match=r"exp: config.json is corrupted \(field 'tokenizer'"):
        load_model(out)


# ------------------------------------------------------------------ 2. resuming an older checkpoint
def test_resume_older_checkpoint_in_place_is_refused_and_changes_nothing(tmp_path, run, data_dir, capsys):
    cfg = save_cfg(micro(run, data_dir), tmp_path / "cfg.json")
    before = snapshot(run)
    rc, _, err = run_cli(capsys, ["train", "--config", cfg, "--resume", run / "checkpoints" / "step-3",
                                  "--stop-at", "5", "--set", "train.lr=0.001"])
    assert_one_line(rc, err, "step-4", "step-6", "--out", "--resume auto")
    assert snapshot(run) == before                    # newer checkpoints, metrics.jsonl: untouched


def test_branch_into_a_new_out_leaves_the_run_untouched(tmp_path, run, data_dir):
    before = snapshot(run)
    branch = tmp_path / "runs" / "branch"
    res = train(micro(branch, data_dir, lr=1e-3), resume=str(run / "checkpoints" / "step-3"), stop_at=5)
    assert res.status == "stopped" and res.step == 5 and [s for s, _ in res.losses] == [4, 5]
    assert snapshot(run) == before
    assert steps_of(branch) == [4, 5]
    marker = [r for r in records(branch) if "resumed_from" in r]
    assert marker and marker[0]["resumed_from"] == 3 and "train.lr" in marker[0]["changed"]
    res = train(micro(branch, data_dir, lr=1e-3), resume="auto")        # the branch continues on its own
    assert res.status == "finished" and res.losses[0][0] == 6
    model, _, _ = load_run(branch)
    other, _, _ = load_run(run)
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))


def test_resume_from_another_run_into_a_run_with_checkpoints_is_refused(tmp_path, run, shared, data_dir, capsys):
    src = tmp_path / "src"
    shutil.copytree(shared / "run", src)
    shutil.rmtree(run / "checkpoints" / "step-6")            # `run` now ends at step 5; src's step-6 is "newer"
    cfg = save_cfg(micro(run, data_dir), tmp_path / "cfg.json")
    before = snapshot(run)
    rc, _, err = run_cli(capsys, ["train", "--config", cfg, "--resume", src / "checkpoints" / "step-6"])
    assert_one_line(rc, err, "another run", "--out")
    assert snapshot(run) == before


def test_prune_never_deletes_a_checkpoint_newer_than_the_one_saved(tmp_path):
    for s in (1, 2, 3, 4, 5):
        tmp = ck.begin(tmp_path, s)
        ck.write_state(tmp, "trainer", {"step": s})
        ck.finish(tmp_path, s)
    gone = ck.prune(tmp_path, 2, upto=3)
    assert [p.name for p in gone] == ["step-1"] and [s for s, _ in ck.list_checkpoints(tmp_path)] == [2, 3, 4, 5]


def test_a_folder_in_the_way_of_a_save_is_set_aside_not_deleted(tmp_path):
    (tmp_path / "step-3").mkdir()
    (tmp_path / "step-3" / "precious.bin").write_bytes(b"user data")
    tmp = ck.begin(tmp_path, 3)
    ck.write_state(tmp, "trainer", {"step": 3})
    ck.finish(tmp_path, 3)
    assert ck.Checkpoint.open(tmp_path / "step-3").step == 3
    assert (tmp_path / "step-3.set-aside" / "precious.bin").read_bytes() == b"user data"
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [3]


# ------------------------------------------------------------------ 3. checkpoint identity
def _plant_renamed(run):
    """A checkpoint folder named step-9 that holds the run's own step 2."""
    shutil.copytree(run / "checkpoints" / "step-2", run / "checkpoints" / "step-9")
    return run / "checkpoints" / "step-9"


def _plant_foreign(run, shared):
    """Another model's step-6 checkpoint copied over the run's step-6 (name and step agree)."""
    shutil.rmtree(run / "checkpoints" / "step-6")
    shutil.copytree(shared / "other" / "checkpoints" / "step-6", run / "checkpoints" / "step-6")
    return run / "checkpoints" / "step-6"


def test_folder_name_must_match_meta_step(run):
    bad = _plant_renamed(run)
    with pytest.raises(ck.CheckpointError, match=r"step-9.*named for step 9.*says step 2"):
        ck.verify(bad)
    with pytest.raises(ck.CheckpointError, match="step-9"):
        load_run(run, step=9)
    assert ck.latest_valid(run / "checkpoints").name == "step-6"


def test_checkpoint_of_another_model_is_not_the_runs(run, shared):
    bad = _plant_foreign(run, shared)
    with pytest.raises(ck.CheckpointError, match=r"does not belong to run .*model.window is 5"):
        ck.verify(bad)
    model, cfg, _ = load_run(run)                           # latest skips it: the run's own step 5
    assert cfg.model.window == 4
    ref = ck.Checkpoint.open(run / "checkpoints" / "step-5").tensors("model")
    assert all(torch.equal(model.state_dict()[k], ref[k]) for k in ref)


def test_eval_of_a_renamed_checkpoint_is_refused_and_records_nothing(tmp_path, run, data_dir, capsys):
    _plant_renamed(run)
    before = snapshot(tmp_path)
    rc, _, err = run_cli(capsys, ["eval", run, "--step", "9", "--data", data_dir, "--no-plot", "--db", "off",
                                  "--device", "cpu"])
    assert_one_line(rc, err, "step-9", "says step 2")
    assert snapshot(tmp_path) == before


def test_eval_latest_skips_a_foreign_checkpoint_and_records_the_real_step(tmp_path, run, shared, data_dir, capsys):
    _plant_foreign(run, shared)
    rc, _, err = run_cli(capsys, ["eval", run, "--data", data_dir, "--no-plot", "--db", "off", "--device", "cpu"])
    assert rc == 0, err
    doc = read_eval_doc(run / "eval.json")
    assert {r["step"] for r in doc["results"]} == {5} and doc["last_settings"]["step"] == 5


def test_export_of_a_foreign_checkpoint_is_refused(tmp_path, run, shared, capsys):
    _plant_foreign(run, shared)
    rc, _, err = run_cli(capsys, ["export", run, tmp_path / "exp", "--step", "6"])
    assert_one_line(rc, err, "step-6", "does not belong")
    assert not (tmp_path / "exp").exists()


def test_resume_auto_falls_back_past_a_foreign_checkpoint_and_never_deletes_it(run, shared, data_dir):
    bad = _plant_foreign(run, shared)
    foreign = snapshot(bad)
    res = train(micro(run, data_dir, steps=7), resume="auto")
    assert res.status == "finished" and res.losses[0][0] == 6       # resumed from the run's own step 5
    assert snapshot(run / "checkpoints" / "step-6.set-aside") == foreign
    assert ck.Checkpoint.open(run / "checkpoints" / "step-6").step == 6
    ck.verify(run / "checkpoints" / "step-7")


META_DAMAGE = {
    "files-null": lambda m: {**m, "files": None},
    "files-list": lambda m: {**m, "files": list(m["files"])},
    "meta-list": lambda m: [m],
    "step-string": lambda m: {**m, "step": "6"},
    "entry-bytes-string": lambda m: {**m, "files": {k: {**v, "bytes": str(v["bytes"])} for k, v in m["files"].items()}},
    "entry-escapes": lambda m: {**m, "files": {**m["files"], "../../config.json": {"sha256": "0", "bytes": 1}}},
}


@pytest.mark.parametrize("damage", list(META_DAMAGE))
def test_malformed_meta_json_is_named_and_resume_auto_falls_back(run, data_dir, damage, caplog):
    path = run / "checkpoints" / "step-6" / ck.META
    path.write_text(json.dumps(META_DAMAGE[damage](json.loads(path.read_text()))))
    with pytest.raises(ck.CheckpointError, match=r"step-6: meta.json"):
        ck.verify(path.parent)
    with caplog.at_level(logging.WARNING, logger="fibattn"):
        res = train(micro(run, data_dir, steps=7), resume="auto")
    assert res.losses[0][0] == 6 and "step-6" in caplog.text          # fell back to step 5, no traceback


def test_resume_auto_refuses_when_no_checkpoint_verifies(tmp_path, run, data_dir, capsys):
    for _, p in ck.list_checkpoints(run / "checkpoints"):
        (p / ck.META).write_text('{"files": null}')
    cfg = save_cfg(micro(run, data_dir), tmp_path / "cfg.json")
    before = snapshot(run)
    rc, _, err = run_cli(capsys, ["train", "--config", cfg, "--resume", "auto"])
    assert_one_line(rc, err, str(run / "checkpoints"), "none verifies")
    assert snapshot(run) == before                     # not restarted from step 0 over the run's files
