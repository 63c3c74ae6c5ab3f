"""Settings you can discover (issue 28, item 4): every key's help and allowed values, said once next to
the field; 'did you mean' for misspelt keys; TOML config files as well as JSON."""
import dataclasses
import json
import re

import pytest

from fibattn import config as C
from fibattn.config_files import load
from fibattn.cli import main
from fibattn.validation import validate

SECTIONS = (C.RunConfig, C.ModelConfig, C.SourceConfig, C.DataConfig, C.TrainConfig, C.EvalConfig)


def test_every_field_has_its_one_line_help():
    for cls in SECTIONS:
        for f in dataclasses.fields(cls):
            text, _ = C.field_help(cls, f.name)
            assert text and "\n" not in text and len(text) < 140, (cls.__name__, f.name)


def test_validation_refuses_exactly_the_choices_the_field_declares():
    cfg = C.RunConfig()
    sections = {"model": cfg.model, "train": cfg.train, "eval": cfg.eval, "data.sources[0]": cfg.data.sources[0]}
    checked = 0
    for where, obj in sections.items():
        for f in dataclasses.fields(obj):
            choices = C.field_help(type(obj), f.name)[1]
            if not choices or isinstance(getattr(obj, f.name), list):
                continue
            before = getattr(obj, f.name)
            setattr(obj, f.name, "nonsense")
            want = f"{where}.{f.name} must be one of {', '.join(choices)},"
            with pytest.raises(C.ConfigError, match=re.escape(want)):
                validate(cfg)
            setattr(obj, f.name, before)
            checked += 1
    assert checked >= 9
    cfg.eval.dense_modes = ["linear", "nope"]
    with pytest.raises(C.ConfigError, match="eval.dense_modes items must be linear, ntk, yarn, window"):
        validate(cfg)


def _run(capsys, argv):
    capsys.readouterr()
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err.strip()


def test_config_shows_help_and_allowed_values_and_filters_keys(capsys):
    rc, out, _ = _run(capsys, ["config", "attention", "warmup"])
    lines = out.splitlines()
    assert rc == 0 and [line.split("=")[0].strip() for line in lines] == ["model.attention", "train.warmup_steps"]
    assert '= "sparse"' in lines[0] and "(str: dense | sparse)" in lines[0] and "# dense: every earlier" in lines[0]
    rc, out, _ = _run(capsys, ["config", "sources[0].include"])
    assert rc == 0 and "glob patterns" in out
    rc, _, err = _run(capsys, ["config", "wramup"])
    assert rc == 2 and "did you mean 'warmup'" in err


@pytest.mark.parametrize("item, want", [
    ("model.windw=3", "did you mean 'model.window'?"),          # the full key, to paste back
    ("train.window=3", "did you mean 'model.window'?"),         # the right name in another section
    ("windw=3", "did you mean 'model.window'?"),
    ("model.lr=1", "did you mean 'train.lr'?"),
])
def test_a_misspelt_key_gets_the_close_one_not_every_key(item, want):
    with pytest.raises(C.ConfigError, match="unknown config key") as err:
        C.apply_overrides(C.RunConfig(), [item])
    assert want in str(err.value) and "has:" not in str(err.value)
    with pytest.raises(C.ConfigError, match=r"\(model has: a_max, a_min, "):       # nothing close: the section's keys
        C.apply_overrides(C.RunConfig(), ["model.zzzzqq=1"])


def test_a_toml_config_reads_like_json_and_its_errors_name_file_and_line(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text('name = "mine"\n[model]\nwindow = 3\nschedule = "custom"\nalphas = [0.5, 1.5]\n[train]\nlr = 1e-3\n'
                    '[[data.sources]]\nname = "notes"\nkind = "files"\npath = "/tmp/notes"\nexclude = ["*.log"]\n')
    cfg = load(toml)
    assert (cfg.name, cfg.model.window, cfg.model.alphas, cfg.train.lr) == ("mine", 3, [0.5, 1.5], 1e-3)
    assert cfg.data.sources == [C.SourceConfig(name="notes", kind="files", path="/tmp/notes", exclude=["*.log"])]
    (tmp_path / "run.json").write_text(json.dumps(C.to_dict(cfg)))
    assert load(tmp_path / "run.json") == cfg
    rc, out, _ = _run(capsys, ["config", "--config", str(toml), "--set", "model.n_layers=2", "window"])
    assert rc == 0 and out.startswith("model.window = 3")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nwindow = 3\nschedule = linear\n")
    rc, _, err = _run(capsys, ["config", "--config", str(bad)])
    assert rc == 2 and f"config file {bad} is not valid TOML" in err and "line 3" in err
    typo = tmp_path / "typo.toml"
    typo.write_text("[train]\nwarmup_step = 3\n")
    rc, _, err = _run(capsys, ["config", "--config", str(typo)])
    assert rc == 2 and (f"config file {typo}: unknown config key train.warmup_step; did you mean "
                        f"'train.warmup_steps'") in err


def test_one_sources_field_is_set_by_index():
    cfg = C.apply_overrides(C.RunConfig(), ['data.sources=[{"name": "a", "kind": "files", "path": "/x"}]',
                                            "data.sources[0].exclude=*.log,build", "data.sources[0].max_docs=3"])
    assert (cfg.data.sources[0].exclude, cfg.data.sources[0].max_docs) == (["*.log", "build"], 3)
    with pytest.raises(C.ConfigError, match=r"data.sources has 1 entries \(indices 0..0\), got \[1\]"):
        C.apply_overrides(cfg, ["data.sources[1].include=*.md"])
    with pytest.raises(C.ConfigError, match=r"'data.sources\[0\].inclde'; did you mean 'data.sources\[0\].include'"):
        C.apply_overrides(cfg, ["data.sources[0].inclde=*.md"])
