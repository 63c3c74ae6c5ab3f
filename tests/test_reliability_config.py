"""Config and operating-system reliability: every config value is type- and range-checked before
anything is written, whatever its source (``--set``, ``--config`` files, JSON lists, the Python
API); sizes that cannot fit are refused with the estimate; an output path that cannot be
created, a permission error or a full disk is one line naming the path and the setting.

CLI cases run in-process through ``fibattn.cli.main`` in an empty working folder that is
compared before and after: exit 2 (1 for a full disk), one stderr line, no traceback, nothing
created. Tests run as root, where file modes do not stop writes, so permission errors and a
full disk are simulated by patching the calls that would fail.
"""
import errno
import json
import os
from pathlib import Path

import pytest
import torch

from fibattn import config as C
from fibattn import devices
from fibattn import validation as V
from fibattn.cli import main
from fibattn.config import ConfigError, ModelConfig
from fibattn.model.lm import FibLM
from fibattn.presets import tiny
from fibattn.storage import checkpoint as ck
from fibattn.trainer.trainer import train
from run_helpers import micro_config

QUICK = ["--set", "train.steps=2", "--set", "train.eval_tokens=256", "--set", "eval.tokens=512",
         "--set", "eval.lengths=256", "--set", "train.results_db=off"]


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*"))


def run_cli(capsys, argv):
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, [line for line in cap.err.splitlines() if line.strip()]


def refused(capsys, argv, *needles, rc_expected=2):
    rc, err = run_cli(capsys, argv)
    assert rc == rc_expected, err
    assert len(err) == 1 and "Traceback" not in err[0] and "error" in err[0], err
    for n in needles:
        assert str(n) in err[0], err[0]
    return err[0]


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


# ------------------------------------------------------------------ types, from every source
BAD_FILE_VALUES = [
    ({"train": {"device": 5}}, "train.device", "a string"),
    ({"train": {"compile": "maybe"}}, "train.compile", "auto, true, false"),
    ({"train": {"compile": 3}}, "train.compile", "a string"),
    ({"train": {"lr": "3e-4"}}, "train.lr", "a finite number"),
    ({"train": {"out_dir": None}}, "train.out_dir", "a string"),
    ({"train": {"steps": 10.0}}, "train.steps", "an integer"),
    ({"train": {"steps": True}}, "train.steps", "an integer"),
    ({"model": {"d_model": 128.5}}, "model.d_model", "an integer"),
    ({"model": {"rope_theta": [1]}}, "model.rope_theta", "a finite number"),
    ({"model": {"alphas": "abc", "schedule": "custom"}}, "model.alphas", "a list"),
    ({"model": {"alphas": [1, None, 1, 1], "schedule": "custom"}}, "model.alphas[1]", "a finite number"),
    ({"model": {"base_values": [1, 2.5], "base": "custom"}}, "model.base_values[1]", "an integer"),
    ({"model": 5}, "model", "mapping"),
    ({"data": {"sources": 5}}, "data.sources", "list"),
    ({"data": {"sources": [5]}}, "data.sources[0]", "mapping"),
    ({"data": {"sources": [{"kind": "files", "path": 123}]}}, "data.sources[0].path", "a string"),
    ({"data": {"sources": [{"name": "x", "weight": "heavy"}]}}, "data.sources[0].weight", "a finite number"),
    ({"data": {"tokenizer": 7}}, "data.tokenizer", "a string"),
    ({"eval": {"lengths": [256, "a"]}}, "eval.lengths[1]", "an integer"),
    ({"eval": {"datasets": [1]}}, "eval.datasets[0]", "a string"),
    ({"eval": {"lengths": 256}}, "eval.lengths", "a list"),
    ({"name": 3}, "name", "a string"),
    ({"train": {"nope": 1}}, "train.nope", "unknown"),
]


@pytest.mark.parametrize("doc,field,allowed", BAD_FILE_VALUES, ids=[c[1] for c in BAD_FILE_VALUES])
def test_config_file_values_are_type_checked(cwd, capsys, doc, field, allowed):
    base = C.to_dict(tiny())
    for section, value in doc.items():
        if isinstance(value, dict) and isinstance(base.get(section), dict):
            base[section].update(value)
        else:
            base[section] = value
    (cwd / "c.json").write_text(json.dumps(base))
    before = tree(cwd)
    refused(capsys, ["train", "--config", "c.json"], field, allowed)
    assert tree(cwd) == before


@pytest.mark.parametrize("text", ["[1, 2]", "5", '"x"', "{", "\xff"])
def test_config_file_that_is_not_a_json_object(cwd, capsys, text):
    (cwd / "c.json").write_bytes(text.encode("latin-1"))
    refused(capsys, ["train", "--config", "c.json"], "c.json")
    assert tree(cwd) == ["c.json"]


def test_config_file_missing_or_a_folder(cwd, capsys):
    refused(capsys, ["train", "--config", "missing.json"], "missing.json", "does not exist")
    (cwd / "dir.json").mkdir()
    refused(capsys, ["train", "--config", "dir.json"], "dir.json", "folder")


@pytest.mark.parametrize("item,field", [
    ("model.d_model=12.5", "model.d_model"), ("train.compile=maybe", "train.compile"),
    ("train.lr=fast", "train.lr"), ("eval.lengths=[1,", "eval.lengths"), ("model.alpha=nan", "model.alpha"),
    ("train.lr=inf", "train.lr"), ("data.sources=[5]", "data.sources"), ("data.sources=mytext", "data.sources=[{"),
    ("data.path=mytext", "data.sources=[{"), ("data.sources.path=x", "data.sources=[{"),
    ("data.sources=[{\"kind\": \"files\", \"path\": 1}]", "data.sources[0].path"),
    ("eval.lengths=[256, \"x\"]", "eval.lengths[1]"), ("model.base_values=[1, true]", "model.base_values[1]"),
])
def test_set_values_are_type_checked(cwd, capsys, item, field):
    refused(capsys, ["train", "--set", item], field)
    assert tree(cwd) == []


@pytest.mark.parametrize("section,name,value,needle", [
    ("train", "device", 5, "train.device"), ("model", "window", "8", "model.window"),
    ("data", "sources", "mytext", "data.sources"), ("eval", "lengths", (256,), "eval.lengths"),
    ("train", "out_dir", "", "train.out_dir"), ("data", "out_dir", " ", "data.out_dir"),
])
def test_python_api_values_are_type_checked(section, name, value, needle):
    cfg = tiny()
    setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        V.validate(cfg)


# ------------------------------------------------------------------ sizes that cannot fit
@pytest.mark.parametrize("change", [
    {}, {"attention": "dense"}, {"schedule": "learned"}, {"n_heads": 8, "n_kv_heads": 8, "d_model": 64},
    {"n_kv_heads": 1, "vocab_size": 1000, "n_layers": 3},
])
def test_parameter_estimate_is_exact(change):
    m = tiny().model
    for k, v in change.items():
        setattr(m, k, v)
    assert V.estimate_params(m) == sum(p.numel() for p in FibLM(m).parameters())


@pytest.mark.parametrize("item,needle", [
    ("model.d_model=1e9", "parameters"), ("model.vocab_size=5000000000", "model.vocab_size"),
    ("model.base_k=1000000", "model.base_k"), ("model.window=1e12", "model.window"),
])
def test_sizes_that_cannot_exist_are_refused_before_allocating(cwd, capsys, item, needle):
    line = refused(capsys, ["train", "--set", item], needle)
    assert "Traceback" not in line
    assert tree(cwd) == []


def test_model_weights_larger_than_memory_name_the_estimate(monkeypatch):
    monkeypatch.setattr(devices, "host_memory_bytes", lambda: 1_000_000)      # 1 MB machine
    m = ModelConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, seq_len=256)
    with pytest.raises(ConfigError, match=r"estimated 7\.56e\+05 parameters.*this machine has 0\.001 GB"):
        FibLM(m)


def test_training_state_larger_than_the_device_is_refused_first(cwd, capsys, monkeypatch):
    # 16 bytes per parameter + activations: fits the weights check, not the training check
    n = V.estimate_params(tiny().model)
    monkeypatch.setattr(devices, "host_memory_bytes", lambda: 8 * n)
    line = refused(capsys, ["train", *QUICK, "--set", f"data.out_dir={cwd / 'data'}"],
                   "needs at least", "train.micro_batch", "cpu has")
    assert "GB" in line
    assert tree(cwd) == []                                       # not even the data folder


# ------------------------------------------------------------------ output paths and OS errors
def test_out_paths_below_a_file_name_their_setting(cwd, capsys, tiny_data, tmp_path):
    (cwd / "afile").write_text("mine\n")
    runs = tmp_path / "runs"
    run = runs / "r"
    assert train(micro_config(run, tiny_data, steps=1, batch_tokens=64, micro_batch=2, results_db="off",
                              eval_tokens=64)).status == "finished"
    before = tree(cwd)
    cases = [
        (["train", *QUICK, "--out", "afile/r"], "train.out_dir"),
        (["train", *QUICK, "--out", "afile"], "train.out_dir"),
        (["train", *QUICK, "--out", "r", "--set", "train.results_db=afile/x.sqlite"], "train.results_db"),
        (["prepare", "--out", "afile/d"], "--out"),
        (["prepare", "--set", "data.out_dir=afile/d"], "data.out_dir"),
        (["eval", run, "--json", "afile/x.json", "--db", "off", "--lengths", "32"], "--json"),
        (["eval", run, "--json", "afile/..", "--db", "off", "--lengths", "32"], "--json"),
        (["export", run, "afile/exp"], "the export folder (OUT)"),
        (["grid", "demo", "--root", "afile/g", "--dry-run"], "--root"),
        (["demo", "--root", "afile/g"], "--root"),
        (["report", "demo", "--root", runs, "--out", "afile/rep"], "--out"),
        (["probe", "--out", "afile/p"], "--out"),
    ]
    for argv, setting in cases:
        refused(capsys, argv, setting, "afile")
        assert tree(cwd) == before, argv


def test_permission_denied_names_train_out_dir(cwd, capsys, monkeypatch):
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p).resolve() == cwd else real(p, mode))
    refused(capsys, ["train", *QUICK, "--out", "r", "--set", f"data.out_dir={cwd / 'd'}"], "train.out_dir",
            "no write permission", str(cwd))
    assert tree(cwd) == []


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_while_checkpointing_is_one_line_and_keeps_the_last_checkpoint(cwd, capsys, monkeypatch,
                                                                                  tiny_data):
    cfg = micro_config(cwd / "r", tiny_data, steps=4, batch_tokens=64, micro_batch=2, ckpt_every=1, keep_ckpts=5,
                       results_db="off", eval_tokens=64)
    C.save(cfg, cwd / "c.json")
    real = ck.write_tensors
    calls = []

    def fills_up(folder, name, tensors):
        calls.append(folder)
        if len(calls) == 3:
            full_disk()
        real(folder, name, tensors)

    monkeypatch.setattr(ck, "write_tensors", fills_up)
    line = refused(capsys, ["train", "--config", "c.json"], "train.out_dir", "step-3.tmp", "disk is full",
                   "step-2", rc_expected=1)
    assert "--resume auto" in line
    assert [s for s, _ in ck.list_checkpoints(cwd / "r" / "checkpoints")] == [1, 2]
    assert not list((cwd / "r" / "checkpoints").glob("*.tmp"))
    monkeypatch.setattr(ck, "write_tensors", real)
    assert train(cfg).step == 4                                  # --resume auto continues from step 2


def test_full_disk_during_export_and_prepare_leaves_nothing(cwd, capsys, monkeypatch, tiny_data, tmp_path):
    from fibattn.data import pipeline
    from fibattn.storage import export
    run = tmp_path / "r"
    train(micro_config(run, tiny_data, steps=1, batch_tokens=64, micro_batch=2, results_db="off", eval_tokens=64))
    monkeypatch.setattr(export, "_write_folder", full_disk)
    refused(capsys, ["export", run, "exp"], "the export folder (OUT)", "exp", "disk is full", rc_expected=1)
    monkeypatch.setattr(pipeline, "_build", full_disk)
    refused(capsys, ["prepare", "--out", "sub/d"], "data.out_dir", "disk is full", rc_expected=1)
    assert tree(cwd) == []


def test_nothing_is_written_before_a_late_validation_error(cwd, capsys):
    # valid field by field; only the combination is wrong (checked after the preset and overrides)
    refused(capsys, ["train", "--set", "train.batch_tokens=1000", "--out", "r"], "train.batch_tokens")
    refused(capsys, ["train", "--set", "model.alpha=2", "--out", "r"], "model.alpha")
    assert tree(cwd) == []


def test_bad_resume_or_stop_at_fails_before_the_data_is_prepared(cwd, capsys):
    (cwd / "afile").write_text("mine\n")
    refused(capsys, ["train", "--resume", "missing"], "missing")
    refused(capsys, ["train", "--resume", "afile"], "afile")
    refused(capsys, ["train", "--stop-at", "0"], "--stop-at", ">= 1")
    assert tree(cwd) == ["afile"]


def test_no_verified_checkpoint_says_why(cwd, capsys, tiny_data):
    run = cwd / "r"
    train(micro_config(run, tiny_data, steps=1, batch_tokens=64, micro_batch=2, results_db="off", eval_tokens=64))
    (run / "config.json").write_text("garbage\n")
    refused(capsys, ["eval", run, "--lengths", "32", "--db", "off"], "none verifies", "config.json")


def test_a_warmup_longer_than_the_run_is_refused_when_given_and_cut_to_the_run_when_a_presets(cwd, capsys, tiny_data):
    """Given: the user asked for a peak rate the run never reaches -- refused. A preset's or the default's
    warm-up on a shortened run: cut to train.steps and said, so the last step trains at train.lr."""
    from fibattn.cli import build_parser
    from fibattn.cli.train import build_config
    from fibattn.trainer.optim import lr_at
    refused(capsys, ["train", *QUICK, "--set", "train.warmup_steps=3", "--set", f"data.out_dir={tiny_data}"],
            "--set train.warmup_steps", "train.warmup_steps (3)", "train.steps (2)")
    assert tree(cwd) == []
    notes: list = []
    cfg = build_config(build_parser().parse_args(["train", *QUICK, "--set", f"data.out_dir={tiny_data}"]), notes)
    assert cfg.train.warmup_steps == 2 and lr_at(1, cfg.train) == cfg.train.lr
    assert any("train.warmup_steps 40 (not set by you)" in n and "all 2 steps" in n for n in notes), notes
    run = train(micro_config(cwd / "r", tiny_data, steps=1, batch_tokens=64, micro_batch=2, results_db="off",
                             eval_tokens=64, threads=1))              # the API: TrainConfig's default 300
    assert json.loads((run.checkpoint / "config.json").read_text())["train"]["warmup_steps"] == 1
    from fibattn.study.grid import GridRun           # a grid resolves it too (its folders' config.json is compared)
    assert GridRun("r", "tiny").config(cwd, ["train.steps=2"]).train.warmup_steps == 2
    with pytest.raises(ConfigError, match=r"--set train.warmup_steps: train.warmup_steps \(5\)"):
        GridRun("r", "tiny").config(cwd, ["train.steps=2", "train.warmup_steps=5"])


@pytest.mark.parametrize("argv,needles", [
    (["bench", "attention", "--lengths", "1000000000"], ["--lengths 1000000000", "GB", "at most"]),
    (["bench", "attention", "--lengths", "64", "--forward-lengths", "2000000000"], ["--forward-lengths", "GB"]),
    (["bench", "train", "--lengths", "100000000", "--steps", "5"], ["--tokens / --lengths", "GB"]),
    (["bench", "train", "--lengths", "64", "--tokens", "2000000000", "--steps", "5"], ["--tokens / --lengths"]),
    (["bench", "train", "--lengths", "64", "--tokens", "10000000000"], ["--tokens", "<= 2147483647"]),   # parsed
])
def test_bench_sizes_that_cannot_fit_are_refused_before_allocating(cwd, capsys, argv, needles):
    refused(capsys, argv, *needles)
    assert tree(cwd) == []


@pytest.mark.parametrize("name,content", [("config.json", '{"mine": 1}\n'), ("metrics.jsonl", "my notes\n"),
                                          ("metrics.jsonl", '{"epoch": 1, "loss": 2.0}\n')])
def test_a_fresh_run_never_overwrites_a_users_file(cwd, capsys, tiny_data, name, content):
    (cwd / "proj").mkdir()
    (cwd / "proj" / name).write_text(content)
    refused(capsys, ["train", *QUICK, "--out", "proj", "--set", f"data.out_dir={tiny_data}"], "train.out_dir",
            name, "not fibattn's")
    assert tree(cwd) == ["proj", f"proj/{name}"] and (cwd / "proj" / name).read_text() == content


def test_report_and_probe_never_overwrite_a_users_file(cwd, capsys):
    (cwd / "runs" / "report").mkdir(parents=True)
    (cwd / "runs" / "report" / "report.md").write_text("# my report\n")
    (cwd / "p").mkdir()
    (cwd / "p" / "probe.md").write_text("my probe notes\n")
    before = tree(cwd)
    refused(capsys, ["report", "demo", "--root", "runs"], "--out", "report.md", "did not write")
    refused(capsys, ["probe", "--out", "p"], "--out", "probe.md", "did not write")
    assert tree(cwd) == before and (cwd / "p" / "probe.md").read_text() == "my probe notes\n"


def test_prepare_takes_data_settings_only(cwd, capsys):
    refused(capsys, ["prepare", "--set", "train.steps=3"], "train.steps", "data.*")
    assert tree(cwd) == []


def test_every_option_has_help_and_version_prints(capsys):
    import argparse
    from fibattn.cli import build_parser

    def missing(p, path):
        out = []
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    out += missing(sp, f"{path} {name}")
            elif not a.help:
                out.append(f"{path} {'/'.join(a.option_strings) or a.dest}")
        return out

    assert missing(build_parser(), "fibattn") == []
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("fibattn ")


@pytest.mark.parametrize("call, needle", [
    (lambda ops: ops.document_ids_from_position_ids(torch.zeros(2, 2, 4, dtype=torch.long)), "position_ids"),
    (lambda ops: ops.document_ids_from_position_ids(torch.tensor([0.0, 1.0, 0.5])), "position_ids"),
    (lambda ops: ops.document_ids_from_position_ids("abc"), "position_ids"),
    (lambda ops: ops.document_ids_from_eos(torch.tensor([1.0, 2.0, 0.0]), 0), "ids"),
    (lambda ops: ops.document_ids_from_eos(torch.tensor([1, 2, 0]), "eos"), "eos"),
    (lambda ops: ops.document_ids_from_eos(torch.tensor([1, 2, 0]), 0.5), "eos"),
], ids=["position-ids-3d", "position-ids-float", "position-ids-text", "eos-float-ids", "eos-text", "eos-float"])
def test_document_id_conversions_refuse_what_would_give_wrong_ids(call, needle):
    """Held-out round three: a 3-D or float position_ids gave ids of a wrong shape (or from rounded values) and a
    text eos an AttributeError; each is a UsageError naming the argument. Lists of ints still work."""
    from fibattn import ops
    from fibattn.checks import UsageError
    with pytest.raises(UsageError, match=needle):
        call(ops)
    assert ops.document_ids_from_position_ids([0, 1, 2, 0, 1]).tolist() == [[0, 0, 0, 1, 1]]
    assert ops.document_ids_from_eos(torch.tensor([[5, 0, 7, 0]]), 0).tolist() == [[0, 0, 1, 1]]
