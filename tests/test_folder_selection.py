"""What a ``files`` folder contributes: every text file by content, include / exclude globs, and what it
skips said (issue 28, item 1)."""
import json
import logging

import pytest

from fibattn.cli import main
from fibattn.config import ConfigError, RunConfig, SourceConfig
from fibattn.data.manifest import MANIFEST_FILE, read_manifest
from fibattn.data.selection import select_files, skipped_note
from fibattn.data.sources import iter_documents
from fibattn.validation import validate


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / ".git").mkdir()
    (d / "b.txt").write_text("plain text")
    (d / "a.md").write_text("# markdown\nis text")
    (d / "notes.rst").write_text("reStructuredText")
    (d / "sub" / "code.py").write_text("print('hi')\n")
    (d / "sub" / "rows.jsonl").write_text('{"text": "row one"}\n{"text": "row two"}\n')
    (d / ".env").write_text("hidden")
    (d / ".git" / "HEAD").write_text("ref")
    (d / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0")
    (d / "latin.txt").write_bytes(b"caf\xe9 au lait")
    return d


def _src(path, **kw):
    return SourceConfig(name="s", kind="files", path=str(path), **kw)


def test_a_folder_contributes_every_text_file_in_sorted_order_and_says_what_it_skipped(folder):
    sel = select_files(_src(folder), "data.sources[0]")
    assert [p.relative_to(folder).as_posix() for p in sel.files] == [
        "a.md", "b.txt", "notes.rst", "sub/code.py", "sub/rows.jsonl"]
    assert list(iter_documents(_src(folder))) == [
        "# markdown\nis text", "plain text", "reStructuredText", "print('hi')\n", "row one", "row two"]
    assert sel.skipped == {"hidden": [".git/", ".env"], "binary (NUL bytes)": ["logo.png"],
                           "not UTF-8 text": ["latin.txt"]}
    note = skipped_note(_src(folder), "data.sources[0]")
    assert "reading 5 files, skipped 4 entries" in note and "2 hidden: .git/, .env" in note
    assert "1 binary (NUL bytes): logo.png" in note and "not UTF-8 text: latin.txt" in note and "iconv" in note


def test_include_and_exclude_globs_choose_what_a_folder_contributes(folder):
    def names(**kw):
        return [p.relative_to(folder).as_posix() for p in select_files(_src(folder, **kw), "s").files]
    assert names(include=["*.md", "*.py"]) == ["a.md", "sub/code.py"]
    assert names(exclude=["sub"]) == ["a.md", "b.txt", "notes.rst"]                 # a folder left out whole
    assert names(exclude=["sub/*.jsonl", "*.rst"]) == ["a.md", "b.txt", "sub/code.py"]
    assert names(include=["sub/*"], exclude=["*.py"]) == ["sub/rows.jsonl"]
    sel = select_files(_src(folder, include=["*.md"], exclude=["b*"]), "s")
    assert sel.skipped["matched by exclude"] == ["b.txt"] and "notes.rst" in sel.skipped["not matched by include"]
    with pytest.raises(ConfigError, match=r"data.sources\[0\].path '.*docs' is a folder with no file to read; "
                                          r"skipped 9 entries: 2 hidden: .*not matched by include"):
        select_files(_src(folder, include=["*.nothing"]), "data.sources[0]")
    with pytest.raises(ConfigError, match=r"include / exclude choose what a folder contributes; .* is a file"):
        select_files(_src(folder / "a.md", include=["*.md"]), "s")
    cfg = RunConfig()
    cfg.data.sources[0].exclude = ["*.md"]                       # never silently ignored
    with pytest.raises(ConfigError, match=r"data.sources\[0\].exclude .* no effect with kind=bundled"):
        validate(cfg)


def test_a_file_named_directly_is_read_if_it_is_text_whatever_its_name(folder):
    assert list(iter_documents(_src(folder / "sub" / "code.py"))) == ["print('hi')\n"]
    with pytest.raises(ConfigError, match=r"logo.png' is not a text file \(binary \(NUL bytes\)"):
        select_files(_src(folder / "logo.png"), "data.sources[0]")
    with pytest.raises(ConfigError, match=r"latin.txt is not valid UTF-8 text \(byte 3: .*iconv"):
        select_files(_src(folder / "latin.txt"), "data.sources[0]")


def test_prepare_files_with_globs_says_what_it_skipped_and_a_new_selection_is_new_data(folder, tmp_path, capsys,
                                                                                       caplog):
    caplog.set_level(logging.INFO, logger="fibattn")          # the CLI logs to stderr; under pytest, to caplog
    out = tmp_path / "out"
    argv = ["prepare", "--quiet", "--files", str(folder), "--out", str(out)]
    assert main(argv + ["--exclude", "*.rst,latin*", "--exclude", "sub"]) == 0
    err = caplog.text
    assert "reading 2 files, skipped 6 entries" in err and "3 matched by exclude: sub/, latin.txt, notes.rst" in err
    m = read_manifest(out)
    assert m["sources"][0]["info"]["files"] == ["a.md", "b.txt"]
    assert m["config"]["sources"][0]["exclude"] == ["*.rst", "latin*", "sub"]
    assert main(argv + ["--exclude", "*.rst,latin*,sub"]) == 0                       # the same selection: reused
    assert "reusing" in caplog.text
    assert main(argv + ["--include", "*.md"]) == 2                                   # another selection: other data
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "prepared with a different config" in err and "data.sources[0].exclude" in err and "include" in err
    doc = json.loads((out / MANIFEST_FILE).read_text())       # a key an older fibattn did not record: its default
    doc["config"]["sources"][0].pop("include")
    (out / MANIFEST_FILE).write_text(json.dumps(doc))
    assert main(argv + ["--exclude", "*.rst,latin*,sub"]) == 0
    assert main(["prepare", "--files", str(folder / "a.md"), "--include", "*.md", "--out", str(tmp_path / "o")]) == 2
    assert "--files names no folder" in capsys.readouterr().err and not (tmp_path / "o").exists()
