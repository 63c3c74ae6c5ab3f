"""Messages that name the cause, not the parser's symptom (issue 58, kind 14): every JSON or TOML file fibattn
reads (config files, tokenizers, manifests, checkpoint and export files, a Llama config or shard index, grid
extensions, jsonl rows) and every text source goes through ``fibattn.files`` (``utf8_text``, ``parse_json``,
``parse_toml``): a UTF-8 byte-order mark is accepted; UTF-16/32, binary data, another encoding, an empty file,
a trailing comma, a comment, single or typographic quotes, Python's True/None, a truncated file are each said
as such, with the line."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fibattn.checks import UsageError
from fibattn.config import SourceConfig
from fibattn.files import TextFileError, parse_json, utf8_text

from storage_helpers import run_cli

BOM = b"\xef\xbb\xbf"
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                max_size=3), max_leaves=8)


@settings(max_examples=80, deadline=None)
@given(value=_JSON, bom=st.booleans(), indent=st.sampled_from([None, 1]))
def test_json_with_or_without_a_byte_order_mark_reads_the_same(value, bom, indent):
    raw = json.dumps(value, indent=indent).encode()
    assert parse_json(BOM + raw if bom else raw) == value
    for enc in ("utf-16", "utf-16-le", "utf-32"):             # the same text in a wide encoding: said so
        with pytest.raises(TextFileError, match=r"it is UTF-(16|32) text"):
            parse_json(json.dumps({"key": value}).encode(enc))


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=40) | st.text(max_size=30).map(str.encode))
def test_any_bytes_are_a_value_or_one_line_saying_what_is_wrong(raw):
    try:
        parse_json(raw)
    except TextFileError as exc:
        text = str(exc)
        assert text and "\n" not in text and "char " not in text, text        # never the bare offset symptom
        assert isinstance(exc, UsageError) and isinstance(exc, json.JSONDecodeError)


@pytest.mark.parametrize("raw, cause", [
    (b"", "it is empty"), (b"  \n", "only whitespace"),
    (b'{"model": {"window": 3,}}', "a comma before '}' (JSON allows no trailing comma)"),
    (b'{"model": {"window": 3}, // mine\n}', "JSON has no comments"),
    (b"{'model': {}}", "need double quotes"), (b'{\xe2\x80\x9cmodel\xe2\x80\x9d: {}}', "typographic quote"),
    (b'{"train": {"wandb": True}}', "'True' is not a JSON value"),
    (b'{"model": {"window": 3}', "it ends before the JSON does"),
    (b'{"model": {"window": 3}}}', "more text after the JSON value ended"),
    (b'{"name": "caf\xe9"}', "byte 0xe9 at offset 13 is not UTF-8"),
    ('{"name": "x"}'.encode("utf-16"), "it is UTF-16 text (it starts with a UTF-16 byte-order mark)"),
    ('{"name": "x"}'.encode("utf-16-le"), "it is UTF-16 text without a byte-order mark"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "it holds binary data"),
])
def test_a_config_file_names_the_cause(tmp_path, capsys, raw, cause):
    path = tmp_path / "c.json"
    path.write_bytes(raw)
    rc, _, err = run_cli(capsys, ["config", "--config", path])
    assert rc == 2 and len(err) == 1 and f"config file {path}" in err[0] and cause in err[0], err
    assert "line 1 column 1 (char 0)" not in err[0]


def test_a_byte_order_mark_is_accepted_in_json_and_toml_configs(tmp_path, capsys):
    j, t = tmp_path / "c.json", tmp_path / "c.toml"
    j.write_bytes(BOM + b'{"model": {"window": 5}}')
    t.write_bytes(BOM + b"[model]\nn_layers = 3\n")
    rc, out, err = run_cli(capsys, ["config", "--config", j, "--config", t, "--json"])
    assert rc == 0, err
    assert (json.loads(out)["model"]["window"], json.loads(out)["model"]["n_layers"]) == (5, 3)
    t.write_bytes("[model]\nn_layers = 3\n".encode("utf-16"))
    rc, _, err = run_cli(capsys, ["config", "--config", t])
    assert rc == 2 and "is not valid TOML: it is UTF-16 text" in err[0], err


def test_every_reader_of_json_and_text_files_names_the_cause(tmp_path):
    """Tokenizers, grid extensions, Llama configs, jsonl rows and text sources: a BOM is fine, a cause is named."""
    from fibattn.data.sources import iter_documents
    from fibattn.data.tokenizers import ByteTokenizer, load_tokenizer
    from fibattn.storage.init_source import open_source
    from fibattn.study.grid import load_extension

    tok = tmp_path / "tokenizer.json"
    ByteTokenizer().save(tok)
    tok.write_bytes(BOM + tok.read_bytes())
    assert isinstance(load_tokenizer(tok), ByteTokenizer)
    tok.write_bytes(tok.read_bytes()[3:].replace(b"}", b",}", 1))
    with pytest.raises(UsageError, match="tokenizer.json is not a tokenizer JSON file: .*trailing comma"):
        load_tokenizer(tok)

    ext = tmp_path / "ext.json"
    ext.write_bytes(BOM + b'[{"name": "mine", "preset": "tiny", "overrides": []}]')
    assert [r.name for r in load_extension(ext)] == ["mine"]
    ext.write_bytes(b'[{"name": "mine",}]')
    with pytest.raises(UsageError, match=r"--extend file .* is not valid JSON: line 1 column 18: a comma before"):
        load_extension(ext)
    ext.write_bytes(b"\xff\xfe[\x00]\x00")
    with pytest.raises(UsageError, match="--extend file .* is not valid JSON: it is UTF-16 text"):
        load_extension(ext)

    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_bytes(b'{"model_type": "llama", # comment\n}')
    with pytest.raises(UsageError, match=r"config.json is not valid JSON \(line 1 column 25: JSON has no comments"):
        open_source(str(llama), weights=False)

    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(BOM + b'{"text": "one"}\n{"text": "two",}\n')
    src = SourceConfig(name="r", kind="files", path=str(rows))
    with pytest.raises(UsageError, match=r"rows.jsonl:2 is not valid JSON: .*a comma before '}'"):
        list(iter_documents(src))
    wide = tmp_path / "wide.txt"
    wide.write_bytes("plain words here".encode("utf-16"))
    with pytest.raises(UsageError, match=r"wide.txt is UTF-16 text \(it starts with a UTF-16 byte-order mark\)"):
        list(iter_documents(SourceConfig(name="w", kind="files", path=str(wide))))
    assert utf8_text(BOM + "naïve".encode()) == "naïve"
