"""Exports ready to share (issue 28, item 8): every file of an export has the usual mode (the umask's, not
save_pretrained's 0600), a byte tokenizer's transformers config names no BOS (it has none), the model card opens
with the YAML front matter hubs read, and the runs/, data/, exports/ folders fibattn creates ignore themselves in
git (a ``.gitignore`` of ``*``, as Python's venv does)."""
import json
import os

import pytest
import yaml

from fibattn.config import SourceConfig
from fibattn.files import GITIGNORE, give_usual_modes, make_parents
from fibattn.presets import tiny
from fibattn.storage.export import card_metadata, export_run


def front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_hf_export_modes_bos_and_card(tmp_path, umask022):
    pytest.importorskip("transformers")
    from fibattn.interop.hf_export import export_hf
    from test_export_hf_remote import make_run
    run = make_run(tmp_path / "run")
    out = export_hf(run, tmp_path / "exports" / "tiny-hf")
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert set(modes.values()) == {"0o644"}, modes                     # model.safetensors included
    config = json.loads((out / "config.json").read_text())
    assert config["bos_token_id"] is None and config["eos_token_id"] == 255        # bytes: no BOS exists
    assert "bos_token_id" not in json.loads((out / "generation_config.json").read_text())
    meta = front_matter((out / "README.md").read_text())
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert {"fibattn", "sparse-attention", "custom_code", "llama"} <= set(meta["tags"])
    assert (tmp_path / "exports" / ".gitignore").read_text() == GITIGNORE     # exports/ was created here
    assert not (out / ".gitignore").exists()


def test_fibattn_export_card_and_gitignore(tmp_path, umask022):
    from test_export_hf_remote import make_run
    run = make_run(tmp_path / "run")
    (tmp_path / "mine").mkdir()
    out = export_run(run, tmp_path / "exports" / "tiny")
    export_run(run, tmp_path / "mine" / "tiny")
    assert (tmp_path / "exports" / ".gitignore").read_text() == GITIGNORE
    assert not (tmp_path / "mine" / ".gitignore").exists()              # a folder of the user's: untouched
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {"0o644"}
    meta = front_matter((out / "README.md").read_text())
    assert meta["library_name"] == "fibattn" and "base_model" not in meta and "datasets" not in meta


def test_card_metadata_names_the_base_model_and_hub_datasets():
    cfg = tiny()
    cfg.data.sources = [SourceConfig(name="edu", kind="hf", path="HuggingFaceFW/fineweb-edu", subset="sample-10BT"),
                        SourceConfig(name="local", kind="files", path="corpus.txt"),
                        SourceConfig(name="mirror", kind="hf", path="/data/hub/datasets--org--set/snapshots/1")]
    cfg.train.init_from = "/home/me/.cache/huggingface/hub/models--meta-llama--Llama-3.2-1B/snapshots/abc"
    meta = yaml.safe_load("\n".join(card_metadata(cfg, library="transformers")).split("---\n")[1])
    assert meta["base_model"] == "meta-llama/Llama-3.2-1B"
    assert meta["datasets"] == ["HuggingFaceFW/fineweb-edu", "org/set"]
    cfg.train.init_from = "/tmp/runs/base"                              # a local run: no hub id to cite
    assert "base_model" not in yaml.safe_load("\n".join(card_metadata(cfg)).split("---\n")[1])


def test_make_parents_and_the_trainers_run_folder(tmp_path, umask022):
    from fibattn.trainer.setup import prepare_out_dir
    prepare_out_dir(tmp_path / "runs" / "a")
    assert (tmp_path / "runs" / ".gitignore").read_text() == GITIGNORE
    assert [p.name for p in (tmp_path / "runs" / "a").iterdir()] == []
    make_parents(tmp_path / "x" / "data" / "set" / "shard")            # data/ created: ignored; x/ is not named so
    assert (tmp_path / "x" / "data" / ".gitignore").is_file() and not (tmp_path / "x" / ".gitignore").exists()
    assert not (tmp_path / "x" / "data" / "set" / "shard").exists()
    f = tmp_path / "w"
    f.write_text("x")
    os.chmod(f, 0o600)
    give_usual_modes(tmp_path)
    assert oct(f.stat().st_mode & 0o777) == "0o644"
