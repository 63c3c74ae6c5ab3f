"""Reliability of the data path: evaluation reads only verified validation tokens, bad data
files and flags fail in one line naming them, killed prepares leave nothing behind for good
(the op's reference backend: ``test_reliability_reference_op.py``).

CLI cases go through ``fibattn.cli.main``: exit status 2, exactly one stderr line naming the
file or flag, no traceback, nothing created. Library cases check the message. Folders are
small copies (``tiny_data`` is copied before it is touched).
"""
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fibattn import config as C
from fibattn.cli import main
from fibattn.config import DataConfig, ModelConfig, SourceConfig
from fibattn.data import ShardError, TokenData, load_tokenizer, prepare, read_manifest, verify_prepared
from fibattn.data import pipeline, shards, staging, verified
from fibattn.data.shards import HEADER_BYTES, write_shard
from fibattn.data.tokenizers import tokenizer_sha256
from fibattn.eval import perplexity as E
from run_helpers import write_checkpoint  # noqa: E402

VAL = "val_shakespeare.bin"


# ----------------------------------------------------------------------------- helpers
def one_error_line(err: str, *needles: str) -> str:
    """``err`` is one line, no traceback, holding every needle."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def cli_fails(capsys, argv, *needles) -> str:
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    assert rc == 2, (rc, cap.out, cap.err)
    return one_error_line(cap.err, *needles)


def listing(folder: Path) -> list:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """One play of the bundled corpus, byte tokens: a small prepared folder to copy."""
    out = tmp_path_factory.mktemp("small") / "d"
    return prepare(DataConfig(out_dir=str(out), sources=[SourceConfig(max_docs=1)], val_fraction=0.05,
                              shard_tokens=1 << 16), progress=False)


@pytest.fixture
def copy(tmp_path, small):
    d = tmp_path / "d"
    shutil.copytree(small, d)
    verified.forget()
    return d


@pytest.fixture
def no_racy(monkeypatch):
    """Cache checks made right after a copy (the files' timestamps are new)."""
    monkeypatch.setattr(verified, "RACY_SECONDS", 0.05)
    time.sleep(0.1)


def rewrite_in_place(path: Path, offset: int, value: int, keep_mtime: bool = True) -> None:
    """Change one token byte (staying a valid id), same size; optionally put the mtime back."""
    st = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(offset)
        old = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([value if value != old else (value + 1) % 200]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def edit_manifest(folder: Path, change) -> None:
    m = json.loads((folder / "manifest.json").read_text())
    change(m)
    (folder / "manifest.json").write_text(json.dumps(m))


def count_hashes(monkeypatch) -> list:
    calls = []
    real = shards.file_sha256

    def counting(path):
        calls.append(Path(path).name)
        return real(path)
    monkeypatch.setattr(shards, "file_sha256", counting)
    return calls


# ------------------------------------------------------------------ 1. verified validation reads
def test_val_changed_in_place_is_refused(copy):
    rewrite_in_place(copy / VAL, HEADER_BYTES + 200, 101)           # still a byte id, same size, same mtime
    data = TokenData(copy)                                           # headers and sizes look fine
    with pytest.raises(ShardError, match=rf"{VAL} is corrupted"):
        data.val_tokens("shakespeare")
    assert data.val_tokens("shakespeare", verify=False).size > 0     # the explicit opt-out still reads


def make_run(root: Path, data_dir: Path) -> Path:
    cfg = C.RunConfig(name="t")
    cfg.model = ModelConfig(vocab_size=256, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, seq_len=32, window=2,
                            base_k=6, backend="torch")
    cfg.data.out_dir = str(data_dir)
    cfg.eval = C.EvalConfig(lengths=[32], tokens=256, batch_size=4)
    run = root / "run"
    cfg.train.out_dir = str(run)
    cfg.train.results_db = "off"
    from fibattn.model.lm import FibLM
    torch.manual_seed(0)
    write_checkpoint(run, 3, FibLM(cfg.model), cfg, tokenizer=False)
    return run


def test_cli_eval_refuses_changed_validation_tokens(tmp_path, tiny_data, capsys):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    verified.forget()
    run = make_run(tmp_path, data)
    before = listing(run)
    argv = ["eval", run, "--device", "cpu", "--db", "off", "--no-plot", "--lengths", "33,47"]
    assert main([str(a) for a in argv]) == 0                         # lengths that do not divide: fine
    out = capsys.readouterr().out
    assert "| shakespeare | 33 |" in out and "| shakespeare | 47 |" in out
    (run / "eval.json").unlink()
    rewrite_in_place(data / VAL, HEADER_BYTES + 1000, 32)
    cli_fails(capsys, argv, "fibattn eval: error:", VAL)
    assert listing(run) == before                                    # no eval.json, no number written


def test_verification_is_cached_in_memory_and_sidecar(copy, monkeypatch, no_racy):
    calls = count_hashes(monkeypatch)
    first = TokenData(copy).val_tokens("shakespeare")
    assert calls == [VAL]
    again = TokenData(copy)
    assert np.array_equal(again.val_tokens("shakespeare"), first) and calls == [VAL]   # memory cache
    assert (copy / verified.SIDECAR).is_file()
    verified.forget()                                                 # a new process: the sidecar serves
    assert np.array_equal(TokenData(copy).val_tokens("shakespeare"), first) and calls == [VAL]
    assert sorted(p.name for p in copy.iterdir()) == sorted(
        [verified.SIDECAR, "manifest.json", "tokenizer.json", VAL] + [p.name for p in copy.glob("train_*.bin")])


def test_cache_entry_is_dropped_when_the_file_changes(copy, monkeypatch, no_racy):
    data = TokenData(copy)
    data.val_tokens("shakespeare")                                    # verified and cached
    assert verified.is_cached(copy, read_manifest(copy)["sources"][0]["val"], 256)
    rewrite_in_place(copy / VAL, HEADER_BYTES + 300, 65)              # mtime put back; ctime moves
    with pytest.raises(ShardError, match=VAL):
        data.val_tokens("shakespeare")
    verified.forget()
    with pytest.raises(ShardError, match=VAL):                        # nor does the sidecar vouch for it
        TokenData(copy).val_tokens("shakespeare")


def test_sidecar_with_a_stale_stamp_or_garbage_is_not_trusted(copy, monkeypatch, no_racy):
    rec = read_manifest(copy)["sources"][0]["val"]
    st = (copy / VAL).stat()
    rewrite_in_place(copy / VAL, HEADER_BYTES + 5, 66)
    stale = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, rec["sha256"], rec["tokens"], 256]
    (copy / verified.SIDECAR).write_text(json.dumps({"format": 1, "files": {VAL: stale}}))
    with pytest.raises(ShardError, match=VAL):
        TokenData(copy).val_tokens("shakespeare")
    (copy / verified.SIDECAR).write_text("{not json")
    with pytest.raises(ShardError, match=VAL):
        TokenData(copy).val_tokens("shakespeare")


def test_unwritable_sidecar_is_not_an_error(copy, monkeypatch, no_racy):
    def refuse(path, text):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(verified, "atomic_write_text", refuse)
    calls = count_hashes(monkeypatch)
    data = TokenData(copy)
    data.val_tokens("shakespeare")
    data.val_tokens("shakespeare")
    assert calls == [VAL] and not (copy / verified.SIDECAR).exists()


def test_val_ids_outside_the_vocabulary_are_refused(copy):
    rec = write_shard(copy / VAL, np.array([1, 2, 300, 4] * 10), np.uint16)     # a self-consistent shard
    edit_manifest(copy, lambda m: m["sources"][0]["val"].update(rec) or m["sources"][0].update(val_tokens=40))
    with pytest.raises(ShardError, match=rf"{VAL} holds token id 300, outside the vocabulary \[0, 255\]"):
        TokenData(copy).val_tokens("shakespeare")
    with pytest.raises(ShardError, match=VAL):
        verify_prepared(copy)


# ------------------------------------------------------------------ 2. evaluation arguments
class Unigram(torch.nn.Module):
    def __init__(self, logits):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(logits, dtype=torch.float32))

    def forward(self, x):
        return self.w.expand(x.shape[0], x.shape[1], -1)


TOKS = np.random.default_rng(0).integers(0, 4, size=3000).astype(np.uint16)


def test_lengths_that_do_not_divide_score_the_same_targets():
    rep = E.evaluate(Unigram([0.3, -0.2, 0.1, 0.0]), {"a": TOKS}, [33, 47], tokens=2048, batch_size=5)
    n = 2021                                                          # 2048 rounded down to a multiple of 47
    assert {r.tokens for r in rep.records} == {n}
    assert rep.record("a", 33).windows == 62 and rep.record("a", 47).windows == 43
    assert len({round(r.nll, 10) for r in rep.records}) == 1          # same targets, context-free model
    for L in (33, 47):
        assert np.array_equal(E.scored_target_positions(n, L), np.arange(1, n + 1))
    assert E.window_plan(94, 33) == [(0, 0), (33, 0), (61, 5)]        # the tail window ends at target 94
    assert "length 33 (not dividing 2021)" in rep.fairness_lines()[0]


@pytest.mark.parametrize("lengths, needle", [
    ([0, 8], r"lengths \(--lengths\): each evaluation length must be an integer >= 1, got 0"),
    ("33,47", r"lengths \(--lengths\) must be a list of integers >= 1, got '33,47'"),
    ([], r"lengths \(--lengths\) must hold at least one"),
    ([8, 2.5], r"lengths \(--lengths\).*got 2.5"),
])
def test_bad_lengths_name_the_argument(lengths, needle):
    with pytest.raises(ValueError, match=needle):
        E.evaluate(Unigram([0.0, 0.0]), {"a": TOKS}, lengths, tokens=64)


def test_too_long_lengths_say_what_fits():
    with pytest.raises(ValueError, match=r"'tiny' has 50 tokens .*lengths \(--lengths\) up to 96 needs at least 97"
                                         r".*allowed here: lengths up to 49"):
        E.scored_budget(50, 500, [24, 96], "tiny")
    with pytest.raises(ValueError, match=r"tokens=10; .*allowed here: lengths up to 10"):
        E.scored_budget(3000, 10, [24], "a")


# ------------------------------------------------------------------ 3. killed prepares
def _kill_inside_build(cfg: DataConfig, monkeypatch, *, force=False, at="_build") -> None:
    """Run ``prepare`` in a forked child that SIGKILLs itself (no cleanup can run) mid-build, or,
    ``at="rmtree"``, when a force rebuild starts deleting the folder it replaced."""
    def dies(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
    rmtree = shutil.rmtree

    def dies_on_old(path, *args, **kwargs):
        return dies() if Path(path).name == "old" else rmtree(path, *args, **kwargs)
    pid = os.fork()
    if pid == 0:                                                      # the child
        try:
            monkeypatch.setattr(pipeline, "_build", dies) if at == "_build" else \
                monkeypatch.setattr(pipeline.shutil, "rmtree", dies_on_old)
            prepare(cfg, progress=False, force=force)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_kill9_leftovers_are_removed_by_the_next_prepare(tmp_path, monkeypatch, caplog):
    out = tmp_path / "d"
    cfg = DataConfig(out_dir=str(out), sources=[SourceConfig(max_docs=1)], val_fraction=0.05)
    _kill_inside_build(cfg, monkeypatch)
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".d.partial-")]
    assert len(left) == 1 and (left[0] / staging.STAGING_MARKER).is_file()
    foreign = tmp_path / ".d.partial-mine"                            # the pattern, but not fibattn's
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    other = tmp_path / ".e.partial-x"                                 # another target's name
    other.mkdir()
    with caplog.at_level("WARNING", logger="fibattn"):
        prepare(cfg, progress=False)
    notices = [r.getMessage() for r in caplog.records if "interrupted fibattn prepare" in r.getMessage()]
    assert len(notices) == 1 and left[0].name in notices[0] and "\n" not in notices[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".d.partial-mine", ".e.partial-x", "d"]
    assert (foreign / "notes.txt").read_text() == "keep"
    _kill_inside_build(cfg, monkeypatch, force=True)                  # a killed --force rebuild: same
    assert (out / "manifest.json").is_file()                          # the old folder is still in place
    _kill_inside_build(cfg, monkeypatch, force=True, at="rmtree")     # killed while dropping the replaced one
    trash = [p for p in tmp_path.iterdir() if p.name.startswith(".d.partial-") and (p / "old").is_dir()]
    assert len(trash) == 1 and (out / "manifest.json").is_file()      # the new folder is in place
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".d.partial-") and p != foreign] == trash
    prepare(cfg, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".d.partial-mine", ".e.partial-x", "d"]


def test_live_staging_and_foreign_old_folders_are_kept(tmp_path):
    out = tmp_path / "d"
    live = staging.Staging(out)                                     # a prepare running right now
    try:
        legacy = tmp_path / ".d.old-999999999"                        # pid gone, prepared-folder files only
        legacy.mkdir()
        (legacy / "manifest.json").write_text("{}")
        (legacy / "train_x_00000.bin").write_bytes(b"")
        mine = tmp_path / ".d.old-999999998"                          # pid gone, but holds a user's file
        mine.mkdir()
        (mine / "thesis.docx").write_text("x")
        removed = staging.clean_leftovers(out)
        assert removed == [legacy]
        assert live.path.is_dir() and mine.is_dir()
    finally:
        live.close()
    assert staging.clean_leftovers(out) == [live.path]               # its process let go of it


# ------------------------------------------------------------------ 4. prepare flags
@pytest.mark.parametrize("extra, named", [
    (["--out", "o2"], "--out"), (["--force"], "--force"), (["--set", "data.val_fraction=0.3"], "--set"),
    (["--preset", "tiny"], "--preset"), (["--out", "o2", "--force"], "--out, --force"),
])
def test_cli_verify_rejects_build_flags(tmp_path, small, capsys, monkeypatch, extra, named):
    monkeypatch.chdir(tmp_path)
    cli_fails(capsys, ["prepare", "--verify", small, *extra], "fibattn prepare: error:", "--verify", named)
    assert not (tmp_path / "o2").exists() and list(tmp_path.iterdir()) == []


def test_cli_out_under_a_file_and_parents_not_left(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    cli_fails(capsys, ["prepare", "--out", tmp_path / "afile" / "sub" / "d"], "afile is a file", "--out")
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 au lait")
    src = json.dumps([{"name": "b", "kind": "files", "path": str(tmp_path / "bad.txt")}])
    before = listing(tmp_path)
    cli_fails(capsys, ["prepare", "--quiet", "--set", f"data.sources={src}", "--out", tmp_path / "a" / "b" / "d"],
              "bad.txt is not valid UTF-8 text", "UTF-8 text files only")
    assert listing(tmp_path) == before                                # no staging, no created parents


# ------------------------------------------------------------------ 6. data files
@pytest.mark.parametrize("change, needle", [
    (lambda m: m["sources"][0].pop("shards"), r"sources\[0\]\.shards is missing"),
    (lambda m: m.update(vocab_size="256"), r"vocab_size must be an integer, got '256'"),
    (lambda m: m["sources"][0]["val"].update(file="../../etc/passwd"), r"sources\[0\]\.val\.file must be a plain file name"),
    (lambda m: m["sources"][0]["val"].update(tokens=0), r"sources\[0\]\.val\.tokens must be >= 1"),
    (lambda m: m["tokenizer"].update(sha256=None), r"tokenizer\.sha256 must be a non-empty string"),
    (lambda m: m.update(sources=[]), r"sources must list at least one source"),
    (lambda m: m["sources"][0].update(weight=True), r"sources\[0\]\.weight must be a finite number"),
])
def test_manifest_with_wrong_keys_or_types_is_named(copy, capsys, change, needle):
    edit_manifest(copy, change)
    with pytest.raises(ValueError, match=rf"manifest\.json is not a valid fibattn manifest: {needle}"):
        TokenData(copy)
    cli_fails(capsys, ["prepare", "--verify", copy], "manifest.json", "prepare the data again with --force")


def test_manifest_not_an_object_or_not_utf8(copy, capsys):
    (copy / "manifest.json").write_text("[1, 2]")
    cli_fails(capsys, ["prepare", "--verify", copy], "manifest.json", "must be a JSON object")
    (copy / "manifest.json").write_bytes(b"\xff\xfe{}")                 # the cause, not a decoding symptom
    cli_fails(capsys, ["prepare", "--verify", copy], "manifest.json", "it is UTF-16 text")
    (copy / "manifest.json").write_bytes(b'{"a": "caf\xe9"}')
    cli_fails(capsys, ["prepare", "--verify", copy], "manifest.json", "byte 0xe9 at offset 10 is not UTF-8")


def test_tokenizer_json_that_is_not_json(copy, capsys):
    tok = copy / "tokenizer.json"
    tok.write_text("this is not json")
    cli_fails(capsys, ["prepare", "--verify", copy], "tokenizer.json", "does not match the manifest sha256")
    edit_manifest(copy, lambda m: m["tokenizer"].update(sha256=tokenizer_sha256(tok)))   # even when listed so
    data = TokenData(copy)
    with pytest.raises(ValueError, match=r"tokenizer\.json is not a tokenizer JSON file: line 1 column 1: 'this' is "
                                         r"not a JSON value"):
        data.tokenizer
    tok.write_text(json.dumps({"model": {"type": "nonsense"}}))
    pytest.importorskip("tokenizers")
    with pytest.raises(ValueError, match=r"tokenizer\.json is not a valid Hugging Face tokenizer\.json"):
        load_tokenizer(tok)


def test_empty_or_one_token_validation_split(copy, capsys):
    (copy / VAL).write_bytes(b"")
    with pytest.raises(ShardError, match=rf"{VAL} is truncated: 0 bytes"):
        TokenData(copy)
    rec = write_shard(copy / VAL, np.array([7]), np.uint16)
    edit_manifest(copy, lambda m: m["sources"][0]["val"].update(rec) or m["sources"][0].update(val_tokens=1))
    arr = TokenData(copy).val_tokens("shakespeare")
    with pytest.raises(ValueError, match=r"'shakespeare' has 1 tokens .*lengths \(--lengths\) up to 8 needs at least 9"):
        E.evaluate(Unigram([0.0] * 256), {"shakespeare": arr}, [8])


def _files_source(path) -> list:
    return ["--set", "data.sources=" + json.dumps([{"name": "s", "kind": "files", "path": str(path)}])]


@pytest.mark.parametrize("name, content, needle", [
    ("a.txt", b"fine\n\xff\xfe broken", "not UTF-8 text: a.txt"),      # in a folder: skipped, and said
    ("a.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "a.jsonl:2 is not valid UTF-8 text"),
])
def test_source_not_utf8_is_named(tmp_path, capsys, name, content, needle):
    src = tmp_path / "src"
    src.mkdir()
    (src / name).write_bytes(content)
    cli_fails(capsys, ["prepare", "--quiet", *_files_source(src), "--out", tmp_path / "o"], needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_source_that_is_not_parquet_is_named(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.parquet").write_text("not parquet at all")
    cli_fails(capsys, ["prepare", "--quiet", *_files_source(src), "--out", tmp_path / "o"],
              "a.parquet is not a readable parquet file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_missing_optional_package_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)               # as if not installed
    src = json.dumps([{"name": "h", "kind": "hf", "path": "some/dataset"}])
    cli_fails(capsys, ["prepare", "--quiet", "--set", f"data.sources={src}", "--out", tmp_path / "o"],
              "'datasets'", "fibattn[data]")
    assert list(tmp_path.iterdir()) == []


def test_shard_replaced_by_a_folder_is_named(copy, capsys):
    (copy / VAL).unlink()
    (copy / VAL).mkdir()
    cli_fails(capsys, ["prepare", "--verify", copy], f"{VAL} cannot be read")
    with pytest.raises(ShardError, match=rf"{VAL} cannot be read"):
        TokenData(copy)


def test_jsonl_with_byte_order_mark_is_read(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "' + b"x" * 400 + b'"}\n')
    out = prepare(DataConfig(out_dir=str(tmp_path / "o"), sources=[SourceConfig(name="s", kind="files",
                                                                                 path=str(tmp_path / "a.jsonl"))],
                             val_fraction=0.1), progress=False)
    assert read_manifest(out)["sources"][0]["docs"] == 1


def test_unreadable_source_file_is_named_before_anything(tmp_path, capsys, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok.txt").write_text("fine text")
    locked = src / "locked.txt"
    locked.write_text("secret")
    locked.chmod(0)
    if os.access(locked, os.R_OK):                                   # root reads anything: say it is unreadable
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == locked else real(p, mode, **kw))
    try:
        cli_fails(capsys, ["prepare", "--quiet", *_files_source(src), "--out", tmp_path / "o"],
                  "data.sources[0].path", "locked.txt cannot be read", "make it readable")
    finally:
        locked.chmod(0o644)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("kind", ["broken-link", "fifo"])
def test_source_entries_that_cannot_be_read_are_not_skipped(tmp_path, capsys, kind):
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok.txt").write_text("fine text")
    if kind == "broken-link":
        (src / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
        needle = "gone.txt is a broken link"
    else:
        if not hasattr(os, "mkfifo"):
            pytest.skip("no fifos here")
        os.mkfifo(src / "pipe.txt")
        needle = "pipe.txt is not a regular file"
    cli_fails(capsys, ["prepare", "--quiet", *_files_source(src), "--out", tmp_path / "o"], needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_an_empty_source_names_the_file(tmp_path, capsys):
    """Held-out round three: the error named data.sources[0] (e) only; the user gave --files e.txt."""
    (tmp_path / "e.txt").write_text("")
    cli_fails(capsys, ["prepare", "--quiet", "--files", tmp_path / "e.txt", "--out", tmp_path / "o"],
              "data.sources[0]", str(tmp_path / "e.txt"), "is empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.txt"]
