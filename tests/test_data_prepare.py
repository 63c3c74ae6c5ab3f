"""``prepare`` / ``fibattn prepare``: manifest, determinism, validation split, reuse, verify, bad input."""
import json
import math
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from fibattn.cli import main
from fibattn.config import ConfigError, DataConfig, SourceConfig
from fibattn.data import (MANIFEST_FILE, ShardError, TokenData, corpus_texts, ensure_prepared, prepare,
                          read_manifest, verify_prepared)
from fibattn.data.shards import HEADER_BYTES, file_sha256, open_shard

FIX = Path(__file__).parent / "fixtures" / "data"


def small_cfg(out, **kw) -> DataConfig:
    """Two plays of the bundled corpus (~310K byte tokens), several shards."""
    base = dict(out_dir=str(out), sources=[SourceConfig(max_docs=2)], val_fraction=0.05, shard_tokens=1 << 16)
    base.update(kw)
    return DataConfig(**base)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return prepare(small_cfg(tmp_path_factory.mktemp("p") / "byte"), progress=False)


def _stream(folder, manifest, src):
    train = [open_shard(folder / r["file"]) for r in src["shards"]]
    return np.concatenate(train), open_shard(folder / src["val"]["file"])


def test_manifest_contents(prepared):
    m = read_manifest(prepared)
    assert m["format_version"] == 1 and m["vocab_size"] == 256 and m["eos_id"] == 255 and m["dtype"] == "uint16"
    assert m["tokenizer"]["name"] == "byte" and m["tokenizer"]["sha256"] == file_sha256(prepared / "tokenizer.json")
    assert m["config"]["val_fraction"] == 0.05 and "out_dir" not in m["config"]
    assert m["validation"] == {"shakespeare": "val_shakespeare.bin"}
    (src,) = m["sources"]
    texts = corpus_texts()[:2]
    assert src["docs"] == 2 and src["tokens"] == sum(len(t.encode()) + 1 for t in texts)
    assert src["val_tokens"] == math.ceil(0.05 * src["tokens"])
    assert src["train_tokens"] + src["val_tokens"] == src["tokens"] == sum(r["tokens"] for r in src["shards"]) + \
        src["val"]["tokens"]
    assert len(src["shards"]) == math.ceil(src["train_tokens"] / (1 << 16))
    assert all(r["tokens"] == 1 << 16 for r in src["shards"][:-1])
    for rec in src["shards"] + [src["val"]]:
        path = prepared / rec["file"]
        assert file_sha256(path) == rec["sha256"] and path.stat().st_size == rec["bytes"]
    assert src["info"]["corpus_sha256"].startswith("3237e332")
    assert sorted(p.name for p in prepared.iterdir()) == sorted(
        [MANIFEST_FILE, "tokenizer.json", "val_shakespeare.bin"] + [r["file"] for r in src["shards"]])


def test_validation_split_is_the_tail_and_disjoint(prepared):
    m = read_manifest(prepared)
    train, val = _stream(prepared, m, m["sources"][0])
    texts = corpus_texts()[:2]
    full = np.concatenate([np.append(np.frombuffer(t.encode(), np.uint8), 255) for t in texts])
    assert np.array_equal(np.concatenate([train, val]), full)         # train ++ val == whole stream
    assert val.size == m["sources"][0]["val_tokens"] and train.size + val.size == full.size
    assert bytes(val[-5:].astype(np.uint8)).endswith(b"\xff")         # the tail ends with the last eos


def test_prepare_is_deterministic_and_cap(tmp_path, prepared):
    again = prepare(small_cfg(tmp_path / "again"), progress=False)
    a, b = read_manifest(prepared), read_manifest(again)
    assert a == b                                                     # same digests, counts, everything
    capped = read_manifest(prepare(small_cfg(tmp_path / "cap", val_tokens_max=1000), progress=False))
    assert capped["sources"][0]["val_tokens"] == 1000


def test_reuse_mismatch_and_force(tmp_path, capsys):
    cfg = small_cfg(tmp_path / "d", sources=[SourceConfig(max_docs=1)])
    out = prepare(cfg, progress=False)
    stamp = os.stat(out / MANIFEST_FILE).st_mtime_ns
    assert ensure_prepared(cfg, progress=False) == out and os.stat(out / MANIFEST_FILE).st_mtime_ns == stamp
    other = small_cfg(tmp_path / "d", sources=[SourceConfig(max_docs=1)], val_fraction=0.1)
    with pytest.raises(ConfigError, match=r"different config \(data.val_fraction: 0.05 -> 0.1\).*--force"):
        prepare(other, progress=False)
    prepare(other, progress=False, force=True)
    assert read_manifest(out)["config"]["val_fraction"] == 0.1
    assert [p.name for p in tmp_path.iterdir()] == ["d"]               # no staging or old folders left
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file.txt").write_text("x")
    for force in (False, True):                                       # never replaced, even with force
        with pytest.raises(ConfigError, match="is not a prepared data folder"):
            prepare(small_cfg(tmp_path / "junk"), progress=False, force=force)
    assert (tmp_path / "junk" / "file.txt").read_text() == "x"
    stamp = os.stat(out / MANIFEST_FILE).st_mtime_ns                  # force rebuilds even a matching folder
    prepare(other, progress=False, force=True)
    assert os.stat(out / MANIFEST_FILE).st_mtime_ns != stamp and read_manifest(out)["config"]["val_fraction"] == 0.1


def test_changed_input_files_are_a_mismatch(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(FIX / "sample.jsonl", folder / "a.jsonl")
    cfg = small_cfg(tmp_path / "out", sources=[SourceConfig(name="s", kind="files", path=str(folder))],
                    val_fraction=0.2)
    prepare(cfg, progress=False)
    (folder / "b.txt").write_text("another document")
    with pytest.raises(ConfigError, match=r"sources\[0\]\.files"):
        ensure_prepared(cfg, progress=False)


def test_verify_detects_corruption(tmp_path):
    out = prepare(small_cfg(tmp_path / "v", sources=[SourceConfig(max_docs=1)]), progress=False)
    assert verify_prepared(out)["files"] == len(read_manifest(out)["sources"][0]["shards"]) + 1
    shard = out / "train_shakespeare_00001.bin"
    data = bytearray(shard.read_bytes())
    data[HEADER_BYTES + 7] ^= 1
    shard.write_bytes(bytes(data))
    TokenData(out)                                                    # headers alone look fine
    with pytest.raises(ShardError, match="train_shakespeare_00001.bin"):
        TokenData(out, verify=True)
    with pytest.raises(ShardError, match="train_shakespeare_00001.bin"):
        verify_prepared(out)
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(ShardError, match=r"train_shakespeare_00001.bin is truncated"):
        TokenData(out)


def test_bpe_prepare(tmp_path):
    pytest.importorskip("tokenizers")
    cfg = small_cfg(tmp_path / "bpe", sources=[SourceConfig(max_docs=1)], tokenizer="bpe", vocab_size=400)
    out = prepare(cfg, progress=False)
    m = read_manifest(out)
    assert m["tokenizer"]["name"] == "bpe" and 257 <= m["vocab_size"] <= 400 and m["dtype"] == "uint16"
    assert m["tokenizer"]["trained_on_chars"] == {"shakespeare": len(corpus_texts()[0])}
    data = TokenData(out)
    tok = data.tokenizer
    val = data.val_tokens("shakespeare")
    assert tok.vocab_size == data.vocab_size and int(val.max()) < data.vocab_size
    assert tok.decode(val[-200:].tolist()) in corpus_texts()[0]
    assert m["sources"][0]["tokens"] < 0.6 * len(corpus_texts()[0])  # BPE compresses
    assert read_manifest(prepare(cfg, progress=False)) == m            # reused


# -------------------------------------------------------------------------------- CLI
def test_cli_prepare_progress_and_verify(tmp_path, capsys):
    out = tmp_path / "cli"
    rc = main(["prepare", "--preset", "tiny", "--set", "data.val_fraction=0.05", "--set",
               "data.shard_tokens=65536", "--set", 'data.sources=[{"max_docs": 2}]', "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 0
    assert re.search(r"^prepare: source=shakespeare docs=2 tokens=\d+ tok/s=\S+ elapsed=\S+s$", cap.err, re.M)
    assert f"prepared {out}" in cap.out and "val_shakespeare.bin" in cap.out
    assert main(["prepare", "--verify", str(out)]) == 0
    assert "all checksums match" in capsys.readouterr().out
    import fibattn.data as D                                          # the name stays the function
    assert D.prepare is prepare and callable(D.prepare)
    (out / "val_shakespeare.bin").write_bytes((out / "val_shakespeare.bin").read_bytes()[:-1])
    assert main(["prepare", "--verify", str(out)]) == 2
    assert "val_shakespeare.bin is truncated" in capsys.readouterr().err


@pytest.mark.parametrize("sets, needle", [
    (['data.sources=[{"kind": "web"}]'], r"data.sources\[0\].kind must be one of bundled, files, hf"),
    (['data.sources=[{"name": "x", "kind": "files", "path": "/no/such/path"}]'],
     r"data.sources\[0\].path '/no/such/path' does not exist"),
    (['data.sources=[{"name": "x", "kind": "files"}]'], r"data.sources\[0\].path is required for kind=files"),
    (['data.sources=[{"weight": 0}]'], r"data.sources\[0\].weight must be a number in \(0"),
    (['data.sources=[{"weight": -1.5}]'], r"data.sources\[0\].weight"),
    (['data.sources=[{"name": "a"}, {"name": "a"}]'], r"used twice"),
    (['data.sources=[{"colour": "red"}]'], r"unknown (config )?key data.sources\[0\].colour"),
    (["data.sources=[]"], r"data.sources must list at least one source"),
    (["data.tokenizer=wordpiece"], r"data.tokenizer must be byte, bpe, or the path of a tokenizer.json"),
    (["data.tokenizer=bpe", "data.vocab_size=256"], r"data.vocab_size must be >= 257"),
])
def test_cli_bad_input(tmp_path, capsys, sets, needle):
    args = ["prepare", "--out", str(tmp_path / "o")]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 2
    assert re.search(needle, capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


def test_empty_corpus_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    (tmp_path / "empty" / "b.jsonl").write_text('{"text": ""}\n')
    cfg = small_cfg(tmp_path / "o", sources=[SourceConfig(name="e", kind="files", path=str(tmp_path / "empty"))])
    with pytest.raises(ValueError, match=r"data.sources\[0\] \(e\) produced no tokens"):
        prepare(cfg, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]    # nothing half-written


def test_multi_source_files_prepare(tmp_path):
    cfg = small_cfg(tmp_path / "mix", val_fraction=0.2, sources=[
        SourceConfig(max_docs=1, weight=3.0),
        SourceConfig(name="lines", kind="files", path=str(FIX / "sample.jsonl"), weight=1.0)])
    m = read_manifest(prepare(cfg, progress=False))
    assert [s["name"] for s in m["sources"]] == ["shakespeare", "lines"]
    assert m["validation"] == {"shakespeare": "val_shakespeare.bin", "lines": "val_lines.bin"}
    assert m["sources"][1]["docs"] == 4 and m["sources"][1]["info"]["files"] == ["sample.jsonl"]
    json.dumps(m)


def test_full_bundled_corpus_tiny_setup(tmp_path):
    """The tiny preset's data with val_fraction=0.05: >= 250K validation tokens; the streaming tail path."""
    out = prepare(DataConfig(out_dir=str(tmp_path / "full"), val_fraction=0.05, shard_tokens=1 << 20),
                  progress=False)
    m = read_manifest(out)
    (src,) = m["sources"]
    assert src["docs"] == 42 and src["tokens"] == 5_057_282 + 42 and src["val_tokens"] >= 250_000
    train, val = _stream(out, m, src)
    full = np.concatenate([np.append(np.frombuffer(t.encode(), np.uint8), 255) for t in corpus_texts()])
    assert np.array_equal(train, full[:train.size]) and np.array_equal(val, full[train.size:])
