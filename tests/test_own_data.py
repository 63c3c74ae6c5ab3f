"""Training on your own text: ``prepare --files`` and ``train --data`` (the README's recipe).

The recipe's lines are read from the README, so the documented commands are the tested ones.
The default suite shortens training with ``--set``; ``-m slow`` runs the lines exactly.
"""
import json
import re
import shlex
from pathlib import Path

import pytest

from fibattn.cli import main
from fibattn.data import corpus_texts

README = Path(__file__).resolve().parents[1] / "README.md"
FAST = ["--set", "train.steps=2", "--set", "train.eval_tokens=512", "--set", "train.results_db=off"]


def recipe() -> list[list[str]]:
    """The ``fibattn`` lines of the README's own-text recipe, as argument lists."""
    text = README.read_text()
    block = re.search(r"<!-- own-text recipe.*?```bash\n(.*?)```", text, re.S).group(1)
    lines = [shlex.split(line.split("#")[0]) for line in block.splitlines() if line.strip()]
    assert [a[:2] for a in lines] == [["fibattn", "prepare"], ["fibattn", "train"], ["fibattn", "eval"]]
    return [a[1:] for a in lines]


@pytest.fixture
def mytext(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("mytext.txt").write_text("".join(corpus_texts()[:2]))
    return tmp_path


def run(capsys, argv) -> str:
    capsys.readouterr()
    rc = main(argv)
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    return cap.out


def check_run(root: Path, capsys, monkeypatch, evaluate):
    cfg = json.loads((root / "runs" / "mine" / "config.json").read_text())
    assert cfg["name"] == "mine"                                       # named after its folder
    assert cfg["data"]["out_dir"] == str((root / "data" / "mine").resolve())
    assert cfg["data"]["sources"] == [{**cfg["data"]["sources"][0], "name": "mytext", "kind": "files",
                                       "path": str((root / "mytext.txt").resolve())}]
    assert not (root / "data" / "shakespeare-byte").exists()
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)                                       # eval from another directory
    out = run(capsys, [evaluate[0], str(root / evaluate[1]), *evaluate[2:], "--db", "off", "--json",
                       str(elsewhere / "e.json")])
    assert "mytext" in out
    rows = json.loads((elsewhere / "e.json").read_text())["results"]
    assert sorted(r["length"] for r in rows) == [256, 1024]


def test_readme_recipe_with_short_training(mytext, capsys, monkeypatch):
    prep, tr, ev = recipe()
    run(capsys, prep)
    run(capsys, tr + FAST)
    check_run(mytext, capsys, monkeypatch, ev + ["--tokens", "2048"])


@pytest.mark.slow
def test_readme_recipe_exactly(mytext, capsys, monkeypatch):
    prep, tr, ev = recipe()
    run(capsys, prep)
    run(capsys, tr)
    check_run(mytext, capsys, monkeypatch, ev)


def test_bpe_vocabulary_comes_from_the_folder(mytext, capsys):
    run(capsys, ["prepare", "--files", "mytext.txt", "--tokenizer", "bpe", "--vocab-size", "300", "--out", "d"])
    run(capsys, ["train", "--data", "d", "--out", "r", *FAST])
    cfg = json.loads(Path("r/config.json").read_text())
    assert cfg["model"]["vocab_size"] == 300 and cfg["data"]["tokenizer"] == "bpe"


def test_own_sources_never_go_into_the_presets_folder(mytext, capsys):
    run(capsys, ["prepare", "--files", "mytext.txt"])
    run(capsys, ["prepare", "--set", 'data.sources=[{"name": "x", "kind": "files", "path": "mytext.txt"}]'])
    assert sorted(p.name for p in Path("data").iterdir()) == ["mytext", "x"]


def test_data_with_data_settings_or_a_missing_folder_is_refused(mytext, capsys):
    run(capsys, ["prepare", "--files", "mytext.txt", "--out", "d"])
    for argv, needle in [(["train", "--data", "d", "--set", "data.val_fraction=0.1"], "data.val_fraction"),
                         (["train", "--data", "nowhere"], "nowhere"),
                         (["prepare", "--files", "missing.txt"], "missing.txt")]:
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    assert sorted(p.name for p in Path(".").iterdir()) == ["d", "mytext.txt"]


def test_config_lists_every_key_with_overrides_applied(capsys):
    out = run(capsys, ["config", "--preset", "tiny", "--set", "model.window=3"])
    keys = [line.split("=")[0].strip() for line in out.splitlines()]
    assert "model.window" in keys and "train.lr" in keys and "data.sources" in keys and "eval.lengths" in keys
    values = {line.split("=")[0].strip(): line.split("=", 1)[1].split()[0] for line in out.splitlines()}
    assert values["model.window"] == "3" and values["name"] == '"tiny"'
    from fibattn.presets import tiny
    assert json.loads(run(capsys, ["config", "--json"]))["model"]["window"] == tiny().model.window


def test_the_data_folder_is_stored_absolute(tmp_path, monkeypatch, capsys, tiny_data):
    import shutil
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_data, tmp_path / "d")
    run(capsys, ["train", "--set", "data.out_dir=d", "--out", "r", *FAST])
    assert json.loads(Path("r/config.json").read_text())["data"]["out_dir"] == str(tmp_path / "d")
