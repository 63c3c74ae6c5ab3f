"""``fibattn export`` + ``fibattn.from_pretrained``: bit-exact, verified, pickle-free."""
import json
import pickle

import pytest
import torch

import fibattn
from fibattn.cli import main as cli_main
from fibattn.data.tokenizers import ByteTokenizer
from fibattn.storage.export import export_run
from fibattn.storage.pretrained import ExportError, is_export, load_model, load_pretrained, verify_export
from fibattn.model.lm import FibLM
from fibattn.presets import tiny
from run_helpers import write_checkpoint  # noqa: E402


def make_run(root, steps=(3, 5), **model_kw):
    """A run folder with real checkpoints (no training: random weights per step)."""
    cfg = tiny()
    m = cfg.model
    m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.seq_len, m.window, m.base_k = 32, 3, 4, 2, 32, 4, 6
    for k, v in model_kw.items():
        setattr(m, k, v)
    cfg.data.out_dir = str(root / "no-data")
    cfg.name = "unit"
    for step in steps:
        torch.manual_seed(step)
        model = FibLM(m)
        write_checkpoint(root, step, model, cfg)
    (root / "eval.json").write_text(json.dumps({"format": 1, "run": "unit", "results": [
        {"dataset": "shakespeare", "length": 32, "mode": "study", "tokens": 64, "ppl": 12.345, "bpb": 3.6,
         "step": steps[-1]}]}))
    return root, cfg


def reference(run, step):
    from fibattn.storage.runs import load_run
    model, _, _ = load_run(run, step=step)
    return model


@pytest.fixture
def run_dir(tmp_path):
    return make_run(tmp_path / "run")[0]


def test_roundtrip_bit_exact(tmp_path, run_dir):
    out = export_run(run_dir, tmp_path / "exp")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "fibattn_tokenizer.json",
                                                     "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    model = fibattn.from_pretrained(out)
    ref = reference(run_dir, 5)
    a, b = model.state_dict(), ref.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    assert isinstance(model.tokenizer, ByteTokenizer)
    meta = json.loads((out / "config.json").read_text())
    assert meta["fibattn_format"] == 1 and meta["fibattn_version"] == fibattn.__version__
    assert meta["model"]["n_layers"] == 3 and meta["source"]["step"] == 5 and len(meta["alphas"]) == 3


def test_model_card(tmp_path, run_dir):
    out = export_run(run_dir, tmp_path / "exp")
    card = (out / "README.md").read_text()
    model = fibattn.from_pretrained(out)
    assert f"{model.num_params(non_embedding=False):,}" in card
    for a in model.alphas():
        assert f"{a:.4f}" in card
    assert "window W=4" in card and "schedule `linear`" in card and "12.345" in card
    assert "shakespeare" in card and "step 5" in card


def test_step_and_learned(tmp_path):
    run, _ = make_run(tmp_path / "run", schedule="learned", learned_init="linear")
    out = export_run(run, tmp_path / "exp", step=3)
    model, ref = fibattn.from_pretrained(out), reference(run, 3)
    x = torch.randint(0, 256, (1, 33))
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    assert json.loads((out / "config.json").read_text())["source"]["step"] == 3


def test_cli_and_overwrite_rules(tmp_path, run_dir, capsys):
    out = tmp_path / "exp"
    assert cli_main(["export", str(run_dir), str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert cli_main(["export", str(run_dir), str(out), "--step", "3"]) == 2
    assert "--force" in capsys.readouterr().err
    assert cli_main(["export", str(run_dir), str(out), "--step", "3", "--force"]) == 0
    assert json.loads((out / "config.json").read_text())["source"]["step"] == 3
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    assert cli_main(["export", str(run_dir), str(other), "--force"]) == 2
    assert (other / "notes.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli_main(["export", str(run_dir), str(empty)]) == 0 and is_export(empty)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]       # no staging left


@pytest.mark.parametrize("name", ["model.safetensors", "fibattn_tokenizer.json"])
def test_corrupted_or_missing_file_is_named(tmp_path, run_dir, name):
    out = export_run(run_dir, tmp_path / "exp")
    data = bytearray((out / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (out / name).write_bytes(bytes(data))
    with pytest.raises(ExportError, match=f"{name} is corrupted"):
        fibattn.from_pretrained(out)
    (out / name).unlink()
    with pytest.raises(ExportError, match=f"{name} is missing"):
        verify_export(out)


def test_bad_config_is_named(tmp_path, run_dir):
    out = export_run(run_dir, tmp_path / "exp")
    (out / "config.json").write_text("{not json")
    with pytest.raises(ExportError, match="config.json is corrupted"):
        load_pretrained(out)
    (out / "config.json").unlink()
    with pytest.raises(ExportError, match="config.json is missing"):
        load_pretrained(out)


def test_no_pickle_on_load(tmp_path, run_dir, monkeypatch):
    out = export_run(run_dir, tmp_path / "exp")

    def banned(*a, **k):
        raise AssertionError("pickle used while loading an export")

    for mod, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(mod, name, banned)
    model, tok = load_model(out)
    assert isinstance(tok, ByteTokenizer) and model.cfg.n_layers == 3


def test_load_model_accepts_runs(tmp_path, run_dir):
    model, tok = load_model(run_dir, step=3)
    assert isinstance(tok, ByteTokenizer)
    assert torch.equal(model.embed.weight, reference(run_dir, 3).embed.weight)
    with pytest.raises(ValueError, match="step"):
        load_model(export_run(run_dir, tmp_path / "exp"), step=3)
