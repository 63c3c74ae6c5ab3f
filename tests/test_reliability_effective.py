"""Config input that would be dropped or do nothing (issue 58, kind 6): one rule for every key
(:mod:`fibattn.effective`). A setting the user gives that the config does not read is refused in one line
naming it and what decides; several ``--config`` files merge in order; a run records only what acts."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fibattn import config as C
from fibattn.config_files import load_all
from fibattn import effective as E
from fibattn.model.lm import FibLM
from fibattn.presets import get_preset
from fibattn.validation import validate

from storage_helpers import run_cli

# another valid value for each model key the rule can call unread (validation accepts it in any config)
_OTHER = {"model.base": "pow2", "model.window": 2, "model.backend": "reference", "model.base_k": 3,
          "model.base_values": [3, 5], "model.schedule": "coprime", "model.a_min": 0.25, "model.a_max": 2.0,
          "model.learned_init": "linear", "model.alpha": 1.25, "model.reach": "train"}


def _micro(attention, base, schedule, learned_init, window) -> C.RunConfig:
    cfg = get_preset("tiny")
    m = cfg.model
    m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.seq_len, m.base_k = 16, 1, 2, 1, 16, 6
    m.attention, m.base, m.schedule, m.learned_init, m.window, m.backend = (attention, base, schedule, learned_init,
                                                                            window, "torch")
    if base == "custom":
        m.base_values = [2, 7]
    if schedule == "custom":
        m.alphas = [0.75]
    return cfg


def _outputs(m: C.ModelConfig, x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(0)
    model = FibLM(m)
    with torch.no_grad():                           # at twice the training length: the reach shows there
        return model(x)[0]


configs = st.builds(_micro, st.sampled_from(["sparse", "dense"]), st.sampled_from(["fib", "pow2", "custom", "none"]),
                    st.sampled_from(["fixed", "linear", "coprime", "learned", "custom"]),
                    st.sampled_from(["fixed", "linear", "coprime"]), st.sampled_from([1, 3, 16, 40]))


def _valid(cfg) -> bool:
    try:
        validate(cfg)
        return True
    except C.ConfigError:
        return False


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])
@given(cfg=configs)
def test_a_setting_called_unread_changes_nothing_and_is_refused_when_given(one_thread, cfg):
    """The rule is sound: any other value of a key :func:`unread` names gives the same model outputs (the
    same weights, at twice the training length, where the reach acts); and given with --set it is refused
    in one line naming the key and the setting that decides."""
    if not _valid(cfg):
        return
    off = E.unread(cfg)
    x = torch.randint(0, cfg.model.vocab_size, (1, 2 * cfg.model.seq_len))
    want = _outputs(cfg.model, x)
    for key, other in _OTHER.items():
        if key not in off:
            continue
        changed = C.from_dict(C.to_dict(cfg))
        C.apply_overrides(changed, [f"{key}={json.dumps(other) if isinstance(other, list) else other}"])
        if not _valid(changed):
            continue
        assert torch.equal(_outputs(changed.model, x), want), key
        with pytest.raises(C.ConfigError) as err:
            E.check_honoured(changed, E.given_by_set([f"{key}=x"]))
        assert key in str(err.value) and off[key][1] in str(err.value) and "no effect" in str(err.value)


@pytest.mark.parametrize("sets, needles", [
    (["model.base=none", "model.alpha=1.2"], ("--set model.alpha", "model.base='none'")),
    (["model.base=none", "model.schedule=fixed"], ("--set model.schedule", "model.base='none'")),
    (["model.attention=dense", "model.window=4"], ("--set model.window", "model.attention='dense'")),
    (["model.attention=dense", "model.base_k=4"], ("--set model.base_k", "model.attention='dense'")),
    (["model.schedule=learned", "model.learned_init=linear", "model.alpha=1.2"],
     ("--set model.alpha", "model.learned_init='linear'")),
    (["model.base=none", "model.reach=train"], ("--set model.reach", "model.window")),
    (["train.wandb_project=x"], ("--set train.wandb_project", "train.wandb")),
    (["eval.dense_modes=ntk"], ("--set eval.dense_modes", "model.attention='sparse'")),
    (['data.sources=[{"name": "b", "kind": "bundled", "subset": "x"}]'],
     ("data.sources[0].subset", "kind='bundled'")),
    (['data.sources=[{"name": "f", "kind": "files", "path": "/x"}]', "data.sources[0].split=test"],
     ("--set data.sources[0].split", "kind='files'")),
])
def test_a_given_setting_without_effect_is_refused_in_one_line(capsys, sets, needles):
    argv = ["config"] + [a for s in sets for a in ("--set", s)]
    rc, _, err = run_cli(capsys, argv)
    assert rc == 2 and len(err) == 1 and "Traceback" not in err[0] and "has no effect" in err[0], err
    for n in needles:
        assert n in err[0], err[0]


def test_a_config_file_value_without_effect_is_refused_and_a_default_one_is_not(tmp_path, capsys):
    """A file sets a key when it holds it away from its default (a saved config lists every key)."""
    inert = tmp_path / "inert.json"
    inert.write_text(json.dumps({"model": {"base": "none", "alpha": 1.2}}))
    rc, _, err = run_cli(capsys, ["config", "--config", inert])
    assert rc == 2 and len(err) == 1 and f"--config {inert}" in err[0] and "model.alpha" in err[0], err
    default = tmp_path / "default.json"
    default.write_text(json.dumps({"model": {"base": "none", "alpha": 1.0, "schedule": "linear"}}))
    rc, out, err = run_cli(capsys, ["config", "--config", default, "--json"])
    assert rc == 0, err
    model = json.loads(out)["model"]
    assert model["base"] == "none" and "alpha" not in model and "schedule" not in model     # only what acts


def test_repeated_config_files_merge_in_order_and_errors_name_the_file(tmp_path, capsys):
    a, b, bad = tmp_path / "a.json", tmp_path / "b.toml", tmp_path / "bad.json"
    a.write_text(json.dumps({"model": {"window": 5, "n_layers": 3}, "train": {"lr": 0.002}}))
    b.write_text("[model]\nwindow = 7\n")
    rc, out, err = run_cli(capsys, ["config", "--config", a, "--config", b, "--set", "train.steps=9", "--json"])
    assert rc == 0, err
    doc = json.loads(out)
    assert (doc["model"]["window"], doc["model"]["n_layers"], doc["train"]["lr"], doc["train"]["steps"]) == \
        (7, 3, 0.002, 9)
    bad.write_text(json.dumps({"model": {"n_heads": 3}}))           # 512 / 3: refused, naming this file
    rc, _, err = run_cli(capsys, ["config", "--config", a, "--config", bad])
    assert rc == 2 and len(err) == 1 and f"config file {bad}" in err[0], err
    inert = tmp_path / "inert.json"                                  # the value without effect: the first file's
    inert.write_text(json.dumps({"model": {"alpha": 1.2}}))
    fixed = tmp_path / "fixed.json"
    fixed.write_text(json.dumps({"model": {"schedule": "linear"}}))
    rc, _, err = run_cli(capsys, ["config", "--config", inert, "--config", fixed])
    assert rc == 2 and f"--config {inert}" in err[0] and "model.alpha" in err[0], err
    # a later file's data.sources replaces the list whole: the earlier fields are gone, not merged
    s1, s2 = tmp_path / "s1.json", tmp_path / "s2.json"
    s1.write_text(json.dumps({"data": {"sources": [{"name": "x", "kind": "files", "path": "/x", "subset": "q"}]}}))
    s2.write_text(json.dumps({"data": {"sources": [{"name": "y"}]}}))
    cfg, origins = load_all([s1, s2])
    assert [s.name for s in cfg.data.sources] == ["y"] and "data.sources[0].subset" not in origins


def test_a_run_records_only_what_acts_and_its_config_trains_again(tiny_data, tmp_path, capsys):
    """tiny's base_k (10) is not read under model.base=pow2: the run's config.json leaves it out; the file
    given back as --config trains (nothing in it lacks effect), and resuming compares only what acts."""
    out = tmp_path / "run"
    common = ["--set", f"data.out_dir={tiny_data}", "--set", "train.steps=1", "--set", "train.results_db=off",
              "--set", "train.batch_tokens=64", "--set", "train.micro_batch=2", "--set", "model.seq_len=32",
              "--set", "train.eval_tokens=64", "--set", "model.d_model=32", "--set", "model.n_layers=1",
              "--set", "model.backend=torch"]
    rc, _, err = run_cli(capsys, ["train", "--preset", "tiny", "--out", out, *common, "--set", "model.base=pow2"])
    assert rc == 0, err
    saved = json.loads((out / "config.json").read_text())
    assert saved["model"]["base"] == "pow2" and "base_k" not in saved["model"] and "alpha" not in saved["model"]
    assert "vocab_size" not in saved["data"] and "wandb_project" not in saved["train"]
    ckpt = sorted((out / "checkpoints").glob("step-*"))[-1]
    assert "base_k" not in json.loads((ckpt / "config.json").read_text())["model"]
    rc, _, err = run_cli(capsys, ["train", "--config", out / "config.json", "--out", tmp_path / "again"])
    assert rc == 0, err
    rc, _, err = run_cli(capsys, ["train", "--preset", "tiny", "--out", out, *common, "--set", "model.base=pow2",
                                  "--set", "train.steps=2"])
    assert rc == 0, err                             # resumed: tiny's base_k differs from the recorded default


def test_a_runtime_override_a_run_does_not_read_is_refused(tmp_path):
    """generate --set / model_overrides: model.reach on a dense run changes nothing, and is refused."""
    from fibattn.storage.runs import load_run
    from run_helpers import write_checkpoint
    cfg = get_preset("tiny")
    m = cfg.model
    m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.seq_len, m.attention = 16, 1, 2, 1, 16, "dense"
    write_checkpoint(tmp_path / "run", 1, FibLM(m), cfg)
    assert load_run(tmp_path / "run", model_overrides=["model.max_seq_len=64"])[1].model.max_seq_len == 64
    with pytest.raises(C.ConfigError, match=r"generate --set\) model.reach: model.reach has no effect with "
                                            r"model.attention='dense'"):
        load_run(tmp_path / "run", model_overrides=["model.reach=train"])


def test_a_grid_extension_run_with_a_setting_it_does_not_read_is_refused(tmp_path):
    from fibattn.checks import UsageError
    from fibattn.study.grid import load_extension
    ext = tmp_path / "ext.json"
    ext.write_text(json.dumps([{"name": "w", "preset": "tiny", "overrides": ["model.base=none", "model.alpha=1.2"]}]))
    with pytest.raises(UsageError, match=r"ext.json\[0\] \(w\): --set model.alpha: model.alpha has no effect"):
        load_extension(ext)
    ext.write_text(json.dumps([{"name": "w", "preset": "tiny", "overrides": ["model.base=none"]}]))
    assert [r.name for r in load_extension(ext)] == ["w"]
