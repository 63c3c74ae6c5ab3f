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
    assert sorted(p.name for p in Path("data").iterdir()) == [".gitignore", "mytext", "x"]     # data/ was new


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


def test_a_pretrained_tokenizer_is_reused_as_it_is(tmp_path, monkeypatch):
    """``prepare --tokenizer FILE``: a model's own tokenizer.json (here Llama-style, eos ``</s>``) is copied
    into the folder and tokenizes the data; ``train --data`` takes its vocabulary; a missing file is refused."""
    tokenizers = pytest.importorskip("tokenizers")
    monkeypatch.chdir(tmp_path)
    tk = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(corpus_texts()[:1], trainer)
    (tmp_path / "model").mkdir()
    tk.save(str(tmp_path / "model" / "tokenizer.json"))
    (tmp_path / "mytext.txt").write_text(corpus_texts()[0][:200_000])
    assert main(["prepare", "--files", "mytext.txt", "--tokenizer", "model", "--out", "data/mine", "--quiet"]) == 0
    manifest = json.loads((tmp_path / "data" / "mine" / "manifest.json").read_text())
    assert manifest["eos_id"] == tk.token_to_id("</s>") and manifest["vocab_size"] == tk.get_vocab_size()
    assert manifest["tokenizer"]["source"] == str(tmp_path / "model")
    from fibattn.data import load_tokenizer
    text = "ROMEO: what light"
    assert load_tokenizer(tmp_path / "data" / "mine").encode(text) == tk.encode(text).ids
    assert main(["train", "--data", "data/mine", "--out", "runs/mine", *FAST, "--set", "train.steps=1"]) == 0
    cfg = json.loads((tmp_path / "runs" / "mine" / "config.json").read_text())
    assert cfg["model"]["vocab_size"] == tk.get_vocab_size()
    assert main(["prepare", "--files", "mytext.txt", "--tokenizer", "nowhere.json", "--out", "data/x"]) == 2
    assert not (tmp_path / "data" / "x").exists()
