"""Folder selection as people write it (issue 58, kind 15): ``dir/`` (as .gitignore and fibattn's notes write
a folder), ``/dir``, ``./dir``, ``**/dir`` and an absolute path inside the folder all choose that folder; a glob
that can never match is refused naming it, one that matched nothing is said (:func:`selection.patterns`)."""
from __future__ import annotations

import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fibattn.cli import main
from fibattn.config import ConfigError, SourceConfig
from fibattn.data.selection import select_files, skipped_note

_PART = st.sampled_from(["a", "b", "docs", "x.md", "y.txt"])
_TREE = st.lists(st.lists(_PART, min_size=1, max_size=3).map("/".join), min_size=1, max_size=8)


def _make(root, paths) -> list[str]:
    """Files at ``paths`` under ``root`` (a path that would need a file as a folder is skipped); their paths."""
    made = []
    for rel in sorted(set(paths), key=len):
        target = root / rel
        if any(str(target).startswith(str(root / m) + "/") for m in made) or target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(f"text of {rel}")
        made.append(rel)
    return sorted(made)


def _read(root, **globs):
    sel = select_files(SourceConfig(name="s", kind="files", path=str(root), **globs), "data.sources[0]")
    return sorted(p.relative_to(root).as_posix() for p in sel.files), sel.unmatched


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(paths=_TREE, data=st.data())
def test_every_spelling_of_a_folder_chooses_that_folder(tmp_path_factory, paths, data):
    root = tmp_path_factory.mktemp("tree")
    files = _make(root, paths)
    folders = sorted({f.rsplit("/", 1)[0] for f in files if "/" in f})
    if not folders:
        return
    d = data.draw(st.sampled_from(folders), "folder")
    under = [f for f in files if f.startswith(d + "/")]
    rest = [f for f in files if f not in under]
    spellings = (f"/{d}/", f"/{d}", f"./{d}/", f"./{d}", f"{root}/{d}/", f"{root}/{d}", f"{d}/" if "/" in d else None)
    for spelling in spellings:
        if spelling is None:
            continue
        if rest:
            assert _read(root, exclude=[spelling]) == (rest, []), spelling
        assert _read(root, include=[spelling]) == (under, []), spelling
    # written without an anchor, a folder name matches every folder of that name (as .gitignore reads it)
    name = d.rsplit("/", 1)[-1]
    named = [f for f in files if f"/{name}/" in f"/{f}"]                # under a folder of that name
    if len(named) < len(files):
        assert _read(root, exclude=[f"{name}/"])[0] == [f for f in files if f not in named]
        assert _read(root, exclude=[f"**/{name}/"])[0] == [f for f in files if f not in named]


def test_a_folder_glob_only_matches_folders_and_double_stars_match_no_folder_too(tmp_path):
    for rel in ("docs/x.md", "docs/sub/y.md", "notes/docs", "a/b/c.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("t")
    assert _read(tmp_path, exclude=["docs/"])[0] == ["a/b/c.txt", "notes/docs"]        # the file named docs stays
    assert _read(tmp_path, exclude=["docs"])[0] == ["a/b/c.txt"]                       # no slash: both
    assert _read(tmp_path, exclude=["docs/**/y.md"])[0] == ["a/b/c.txt", "docs/x.md", "notes/docs"]
    assert _read(tmp_path, exclude=["a/**/c.txt"])[0] == ["docs/sub/y.md", "docs/x.md", "notes/docs"]
    assert _read(tmp_path, include=["docs/"])[0] == ["docs/sub/y.md", "docs/x.md"]


@pytest.mark.parametrize("glob, needle", [
    ("", "it is empty"), (".", "the source folder itself"), ("/", "the source folder itself"),
    ("./", "the source folder itself"), ("../other", "'..' leaves the source folder"),
    ("a/../../b", "'..' leaves"), ("/etc/", "outside the source folder"), ("!keep.md", "negation"),
])
def test_a_glob_that_can_never_match_is_refused_naming_it(tmp_path, glob, needle):
    (tmp_path / "a.txt").write_text("t")
    for kind in ("include", "exclude"):
        with pytest.raises(ConfigError, match=rf"data.sources\[0\].{kind} glob .* can never match: .*{needle}"):
            _read(tmp_path, **{kind: [glob]})


def test_a_glob_that_matched_nothing_is_said_and_prepare_refuses_before_writing(tmp_path, capsys, caplog):
    src = tmp_path / "text"
    (src / "drafts").mkdir(parents=True)
    (src / "a.txt").write_text("keep me " * 20)
    (src / "drafts" / "b.txt").write_text("leave me out " * 20)
    note = skipped_note(SourceConfig(name="s", kind="files", path=str(src), exclude=["drafs/", "drafts/"]),
                        "data.sources[0]")
    assert "exclude 'drafs/' matched nothing" in note and "1 matched by exclude: drafts/" in note
    out = tmp_path / "data"
    assert main(["prepare", "--files", str(src), "--exclude", "../x", "--out", str(out)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "exclude glob '../x' can never match" in err[0] and not out.exists(), err
    caplog.set_level(logging.INFO, logger="fibattn")
    assert main(["prepare", "--files", str(src), "--exclude", "drafts/", "--out", str(out)]) == 0
    assert "reading 1 files, skipped 1 entry: 1 matched by exclude: drafts/" in caplog.text
