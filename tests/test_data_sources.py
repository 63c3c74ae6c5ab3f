"""Sources: bundled corpus, local files (txt/jsonl/parquet), Hugging Face (offline on a local folder)."""
import json
import shutil
import socket
import sys
from pathlib import Path

import pytest

from fibattn.config import ConfigError, SourceConfig
from fibattn.data import corpus as corpus_mod
from fibattn.data.sources import iter_documents

FIX = Path(__file__).parent / "fixtures" / "data"
ROWS = [json.loads(line) for line in (FIX / "sample.jsonl").read_text(encoding="utf-8").splitlines()]
TEXTS = [r["text"] for r in ROWS if r["text"]]


def _write_parquet(path, rows):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({k: [r[k] for r in rows] for k in rows[0]}), path)


# --------------------------------------------------------------------------- bundled
def test_bundled_corpus_texts():
    texts = corpus_mod.corpus_texts()
    assert len(texts) == 42 and "".join(texts) == corpus_mod.read_corpus()
    assert texts[0].startswith("ALL'S WELL THAT ENDS WELL") and texts[-1].startswith("THE WINTER'S TALE")
    assert all("by William Shakespeare" in t[:300] for t in texts)
    docs = list(iter_documents(SourceConfig(max_docs=2)))
    assert docs == texts[:2]


def test_bundled_checksum_is_verified(monkeypatch):
    monkeypatch.setattr(corpus_mod, "CORPUS_SHA256", "0" * 64)
    corpus_mod.read_corpus.cache_clear()
    try:
        with pytest.raises(ValueError, match="corrupted"):
            corpus_mod.read_corpus()
    finally:
        monkeypatch.undo()
        corpus_mod.read_corpus.cache_clear()
    assert len(corpus_mod.read_corpus()) == 5_057_282


def test_bundled_rejects_a_path():
    with pytest.raises(ConfigError, match=r"path must be empty for kind=bundled"):
        list(iter_documents(SourceConfig(path="x.txt"), "data.sources[0]"))


def test_split_texts_rule():
    text = "PRELUDE\nA\n\nby William Shakespeare\n\nbody one\n\n\nB\n\nBY WILLIAM SHAKESPEARE\nbody two\n"
    parts = corpus_mod.split_texts(text)
    assert "".join(parts) == text and len(parts) == 2 and parts[1].startswith("B\n")
    assert corpus_mod.split_texts("no bylines here") == ["no bylines here"]


# ----------------------------------------------------------------------------- files
def _files(path, **kw):
    return list(iter_documents(SourceConfig(name="f", kind="files", path=str(path), **kw), "data.sources[0]"))


def test_files_txt_jsonl_parquet_and_folder(tmp_path):
    assert _files(FIX / "sample.txt") == [(FIX / "sample.txt").read_text()]
    assert _files(FIX / "sample.jsonl") == TEXTS                      # the empty row is skipped
    assert _files(FIX / "sample.jsonl", max_docs=2) == TEXTS[:2]
    _write_parquet(tmp_path / "d" / "b" / "rows.parquet", ROWS)
    assert _files(tmp_path / "d" / "b" / "rows.parquet") == TEXTS
    shutil.copy(FIX / "sample.jsonl", tmp_path / "d" / "a.jsonl")
    shutil.copy(FIX / "sample.txt", tmp_path / "d" / "c.txt")
    (tmp_path / "d" / "ignored.bin").write_bytes(b"\x89PNG\0\1")     # binary: skipped (and said, see test_selection)
    got = _files(tmp_path / "d")                                      # a.jsonl, b/rows.parquet, c.txt
    assert got == TEXTS + TEXTS + [(FIX / "sample.txt").read_text()]
    assert _files(tmp_path / "d", text_field="meta", max_docs=3) == ["a", "b", "empty documents are skipped"]


def test_files_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"data.sources\[0\].path .* does not exist"):
        _files(tmp_path / "missing")
    (tmp_path / "x.bin").write_bytes(b"a\0b")
    with pytest.raises(ConfigError, match=r"x\.bin' is not a text file \(binary"):
        _files(tmp_path / "x.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is a folder with no file to read"):
        _files(tmp_path / "empty")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2 is not valid JSON"):
        _files(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match=r"sample\.jsonl:1 has no text_field 'body'"):
        _files(FIX / "sample.jsonl", text_field="body")
    with pytest.raises(ValueError, match=r"field 'id' is a int"):
        _files(FIX / "sample.jsonl", text_field="id")
    _write_parquet(tmp_path / "p.parquet", ROWS)
    with pytest.raises(ValueError, match=r"p\.parquet has no text_field column 'body'"):
        _files(tmp_path / "p.parquet", text_field="body")


# -------------------------------------------------------------------------------- hf
def _hub_folder(tmp_path, fmt):
    """A local folder laid out like a hub dataset: data/train-*.{parquet,jsonl}, data/test-*."""
    root = tmp_path / f"hub_{fmt}"
    if fmt == "parquet":
        _write_parquet(root / "data" / "train-00000-of-00001.parquet", ROWS)
        _write_parquet(root / "data" / "test-00000-of-00001.parquet", ROWS[:2])
    else:
        (root / "data").mkdir(parents=True)
        shutil.copy(FIX / "sample.jsonl", root / "data" / "train-00000-of-00001.jsonl")
        (root / "data" / "test-00000-of-00001.jsonl").write_text(
            "\n".join(json.dumps(r) for r in ROWS[:2]) + "\n", encoding="utf-8")
    return root


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_hf_code_path_on_a_local_dataset_folder(tmp_path, monkeypatch, fmt):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root = _hub_folder(tmp_path, fmt)
    src = SourceConfig(name="hub", kind="hf", path=str(root), split="train")
    assert list(iter_documents(src, "data.sources[0]")) == TEXTS
    src.split, src.max_docs = "test", 1
    assert list(iter_documents(src, "data.sources[0]")) == TEXTS[:1]
    src.split, src.text_field = "train", "body"
    with pytest.raises(ValueError, match=r"data.sources\[0\]: row 0 .* no text_field 'body'"):
        list(iter_documents(src, "data.sources[0]"))
    src.text_field, src.split = "text", "nosuchsplit"
    with pytest.raises(ValueError, match=r"data.sources\[0\]: cannot load Hugging Face dataset"):
        list(iter_documents(src, "data.sources[0]"))


def test_hf_missing_datasets_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    src = SourceConfig(name="hub", kind="hf", path="some/dataset")
    with pytest.raises(ImportError, match=r"fibattn\[data\]"):
        list(iter_documents(src, "data.sources[0]"))


def _online():
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.mark.network
def test_hf_hub_streaming():
    pytest.importorskip("datasets")
    if not _online():
        pytest.skip("no network")
    src = SourceConfig(name="ts", kind="hf", path="roneneldan/TinyStories", max_docs=3)
    docs = list(iter_documents(src, "data.sources[0]"))
    assert len(docs) == 3 and all(isinstance(d, str) and d for d in docs)
