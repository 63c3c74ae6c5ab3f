"""Reliability, round three, for data, training, run folders and torchrun: decisions from content
(a source changed in place at the same size), training reads only verified shards, one writer per
run / data folder (a lock naming the holder's pid; stale locks taken over), readers pin the
checkpoint a live run would prune, and ranks that disagree or fail read as one line per process.

CLI cases go through ``fibattn.cli.main`` (exit 2, one stderr line, no traceback, nothing
written); multi-process cases start real processes (gloo on CPU).
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from fibattn.config import ConfigError, DataConfig, SourceConfig
from fibattn.data import TokenData, prepare, read_manifest, verified
from fibattn.data.shards import write_shard
from fibattn.locks import FolderLock
from fibattn.storage import checkpoint as ck
from fibattn.storage.runs import find_checkpoint
from storage_helpers import assert_one_line, micro, run_cli, snapshot

ROOT = Path(__file__).resolve().parents[1]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(verified.SIDECAR))
    return dst


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _holder(lock_file: Path, folder: Path) -> subprocess.Popen:
    """Another live process holding fibattn's lock on ``lock_file``."""
    code = (f"import sys, time; from fibattn.locks import FolderLock; "
            f"FolderLock({str(lock_file)!r}, {str(folder)!r}, 'x', 'a test holder').acquire(); "
            f"print('held', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.stdout.readline().strip() == "held"
    return proc


# ----------------------------------------------------------------------------- 1. decisions from content
def _files_cfg(src: Path, out: Path) -> DataConfig:
    return DataConfig(out_dir=str(out), sources=[SourceConfig(name="t", kind="files", path=str(src))],
                      val_fraction=0.1)


def test_prepare_reuse_is_decided_by_content_not_size(tmp_path, capsys):
    src = tmp_path / "text.txt"
    src.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    out = tmp_path / "d"
    prepare(_files_cfg(src, out), progress=False)
    old = src.stat()
    os.utime(src, ns=(old.st_atime_ns, old.st_mtime_ns + 10**9))     # touched, same bytes: reused
    assert prepare(_files_cfg(src, out), progress=False) == out
    data = src.read_bytes()
    src.write_bytes(data.replace(b"fox", b"cat"))                     # changed in place, same size
    os.utime(src, ns=(old.st_atime_ns, old.st_mtime_ns))              # and the same mtime
    assert src.stat().st_size == old.st_size
    before = snapshot(tmp_path)
    rc, _, err = run_cli(capsys, ["prepare", "--files", src, "--out", out, "--quiet"])
    assert_one_line(rc, err, str(out), f"the content of data.sources[0] {src} changed")
    assert snapshot(tmp_path) == before
    prepare(_files_cfg(src, out), progress=False, force=True)        # --force rebuilds from the new content
    assert read_manifest(out)["sources"][0]["info"]["sha256"] != json.dumps(None)


def test_source_hash_cache_trusts_only_an_unchanged_stamp(tmp_path, monkeypatch):
    src = tmp_path / "text.txt"
    src.write_text("to be or not to be\n" * 50)
    old = time.time() - 60
    os.utime(src, (old, old))
    monkeypatch.setattr(verified, "RACY_SECONDS", 0.0)                 # ctime is now: trust it anyway here
    out = tmp_path / "d"
    prepare(_files_cfg(src, out), progress=False)
    verified._digests.clear()                                           # a new process: the manifest's stamps
    hashed = []
    real = verified.sha256_file
    monkeypatch.setattr(verified, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))
    assert prepare(_files_cfg(src, out), progress=False) == out
    assert hashed == []                                                 # stamp unchanged: not hashed again
    os.utime(src, (old + 5, old + 5))                                   # stamp changed: hashed, then reused
    assert prepare(_files_cfg(src, out), progress=False) == out
    assert hashed == ["text.txt"]


def test_a_local_hf_dataset_folder_is_also_identified_by_content(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "hub" / "data" / "train-00000-of-00001.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text("".join(json.dumps({"text": f"document number {i} about foxes"}) + "\n" for i in range(40)))
    cfg = DataConfig(out_dir=str(tmp_path / "d"), val_fraction=0.1,
                     sources=[SourceConfig(name="h", kind="hf", path=str(tmp_path / "hub"), split="train")])
    prepare(cfg, progress=False)
    assert prepare(cfg, progress=False) == tmp_path / "d"
    data.write_bytes(data.read_bytes().replace(b"foxes", b"hares"))    # same size
    with pytest.raises(ConfigError, match="sha256"):
        prepare(cfg, progress=False)


def test_a_reused_tokenizer_file_is_identified_by_content(tmp_path, tiny_data):
    tok = tmp_path / "tok.json"
    shutil.copy(tiny_data / "tokenizer.json", tok)
    cfg = DataConfig(out_dir=str(tmp_path / "d"), sources=[SourceConfig(max_docs=1)], val_fraction=0.05,
                     tokenizer=str(tok))
    prepare(cfg, progress=False)
    assert prepare(cfg, progress=False) == tmp_path / "d"
    tok.write_text(tok.read_text() + " ")                               # the same name, other bytes
    with pytest.raises(ConfigError, match=r"data.tokenizer \(sha256 of the file\)"):
        prepare(cfg, progress=False)


# ----------------------------------------------------------------------------- 2. training reads verified shards
def _train_argv(data: Path, out: Path) -> list:
    return ["train", "--data", data, "--out", out, "--set", "model.d_model=32", "--set", "model.n_layers=1",
            "--set", "model.n_heads=2", "--set", "model.n_kv_heads=1", "--set", "model.seq_len=32",
            "--set", "model.window=4", "--set", "model.base_k=6", "--set", "model.backend=torch",
            "--set", "train.steps=2", "--set", "train.batch_tokens=64", "--set", "train.micro_batch=2",
            "--set", "train.eval_tokens=64", "--set", "train.threads=1", "--set", "train.results_db=off",
            "--set", "train.ckpt_every=1", "--set", "train.keep_ckpts=1"]


def _first_shard(data: Path) -> Path:
    return data / read_manifest(data)["sources"][0]["shards"][0]["file"]


def test_train_refuses_a_shard_overwritten_after_prepare(tmp_path, tiny_data, capsys):
    data = _copy(tiny_data, tmp_path / "data")
    TokenData(data).val_tokens("shakespeare")                          # the sidecar cache exists
    shard = _first_shard(data)
    st = shard.stat()
    tokens = np.array(np.memmap(shard, dtype="<u2", mode="r", offset=64))
    write_shard(shard, (tokens + 1) % 200, np.uint16)                  # a consistent shard of other tokens
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))               # same size, mtime put back
    assert shard.stat().st_size == st.st_size
    out = tmp_path / "run"
    rc, _, err = run_cli(capsys, _train_argv(data, out))
    assert_one_line(rc, err, str(shard), "manifest")
    assert not out.exists()


def test_train_names_the_shard_with_out_of_range_ids(tmp_path, tiny_data, capsys):
    data = _copy(tiny_data, tmp_path / "data")
    shard = _first_shard(data)
    n = read_manifest(data)["sources"][0]["shards"][0]["tokens"]
    rec = write_shard(shard, np.full(n, 300), np.uint16)               # a consistent file, ids >= vocab 257
    man = json.loads((data / "manifest.json").read_text())
    man["sources"][0]["shards"][0].update(sha256=rec["sha256"], bytes=rec["bytes"])
    (data / "manifest.json").write_text(json.dumps(man))
    out = tmp_path / "run"
    rc, _, err = run_cli(capsys, _train_argv(data, out))
    assert_one_line(rc, err, str(shard), "token id 300")
    assert not out.exists()


def test_training_verification_shares_the_validation_cache(tmp_path, tiny_data):
    data = _copy(tiny_data, tmp_path / "data")
    td = TokenData(data)
    rec = read_manifest(data)["sources"][0]["shards"][0]
    assert not verified.is_cached(data, rec, td.vocab_size)
    td.train_loader(32, 2, seed=1)
    for _ in range(30):                                                 # a fresh copy is "racy" for 2 s
        if verified.is_cached(data, rec, td.vocab_size):
            break
        time.sleep(0.1)
        verified.forget(data)
        TokenData(data).train_loader(32, 2, seed=1)
    assert verified.is_cached(data, rec, td.vocab_size)


# ----------------------------------------------------------------------------- 4. one writer per folder
def test_second_writer_of_a_run_folder_is_refused_naming_the_holder(tmp_path, tiny_data, capsys):
    out = tmp_path / "run"
    out.mkdir()
    holder = _holder(out / ".fibattn-lock", out)
    try:
        before = snapshot(out)
        rc, _, err = run_cli(capsys, _train_argv(tiny_data, out))
        assert_one_line(rc, err, "train.out_dir", f"process {holder.pid}")
        assert snapshot(out) == before
    finally:
        holder.kill()
        holder.wait()
    rc, _, err = run_cli(capsys, _train_argv(tiny_data, out))         # its holder died: taken over
    assert rc == 0, err
    assert not (out / ".fibattn-lock").exists()                        # released when training returns


def test_stale_lock_of_a_dead_process_is_taken_over_with_a_notice(tmp_path, tiny_data, caplog):
    from fibattn.trainer.trainer import train
    out = tmp_path / "run"
    out.mkdir()
    pid = _dead_pid()
    (out / ".fibattn-lock").write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "what": "x"}))
    with caplog.at_level("WARNING", logger="fibattn"):
        train(micro(out, tiny_data, steps=1))
    assert any(f"process {pid}" in r.getMessage() and "gone" in r.getMessage() for r in caplog.records)
    assert not (out / ".fibattn-lock").exists()


def test_second_prepare_of_a_data_folder_is_refused(tmp_path, capsys):
    out = tmp_path / "d"
    holder = _holder(tmp_path / ".d.fibattn-lock", out)
    try:
        before = snapshot(tmp_path)
        rc, _, err = run_cli(capsys, ["prepare", "--out", out, "--quiet", "--set", "data.sources=[{\"max_docs\": 1}]"])
        assert_one_line(rc, err, "data.out_dir", str(out), f"process {holder.pid}")
        assert snapshot(tmp_path) == before
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_is_one_writer_even_inside_one_process(tmp_path):
    a = FolderLock(tmp_path / "l", tmp_path, "train.out_dir", "first").acquire()
    with pytest.raises(ConfigError, match=f"process {os.getpid()}"):
        FolderLock(tmp_path / "l", tmp_path, "train.out_dir", "second").acquire()
    a.release()
    FolderLock(tmp_path / "l", tmp_path, "train.out_dir", "third").acquire().release()
    assert list(tmp_path.iterdir()) == []


def test_pruning_keeps_a_checkpoint_a_reader_has_pinned(tmp_path, tiny_data):
    from fibattn.trainer.trainer import train
    run = tmp_path / "run"
    train(micro(run, tiny_data, steps=3, keep_ckpts=10))
    root = ck.ckpt_root(run)
    assert find_checkpoint(run) == ck.step_dir(root, 3)                # pinned by this (reader) process
    prune = (f"from fibattn.storage import checkpoint as ck; "
             f"print([p.name for p in ck.prune({str(root)!r}, 1, upto=2)])")
    done = subprocess.run([sys.executable, "-c", prune], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.stdout.strip() == "['step-1']"                         # step-2 (kept) and pinned step-3 are there
    assert [s for s, _ in ck.list_checkpoints(root)] == [2, 3]
    ck.unpin(ck.step_dir(root, 3))
    (ck.step_dir(root, 3) / ck.META).unlink()                         # as a pruner leaves it midway
    assert find_checkpoint(run) == ck.step_dir(root, 2)                # the next complete one


# ----------------------------------------------------------------------------- 3 + 5. ranks
_WORKER = textwrap.dedent("""
    import sys
    from fibattn.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(argvs: list[list], timeout: int = 120) -> list[subprocess.CompletedProcess]:
    """Start one process per argv as the ranks of one gloo job (what torchrun sets up), each with its own
    arguments; returns their results."""
    port = _free_port()
    procs = []
    for rank, argv in enumerate(argvs):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(len(argvs)),
               "LOCAL_WORLD_SIZE": str(len(argvs)), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
        procs.append(subprocess.Popen([sys.executable, "-c", _WORKER, *map(str, argv)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def _gloo_pair(code: str):
    """Run ``code`` as ranks 0 and 1 of a gloo job; ``(processes, [(stdout, stderr)])``."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", code], text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), "PYTHONPATH": str(ROOT / "src")}) for r in (0, 1)]
    return procs, [p.communicate(timeout=120) for p in procs]


def _lines(res) -> list[str]:
    """The error lines of a process (its info lines, ``fibattn: ...``, aside)."""
    return [ln for ln in res.stderr.splitlines() if "error" in ln.lower() or "Traceback" in ln]


def test_ranks_with_different_configs_refuse_naming_the_keys(tmp_path, tiny_data):
    out = tmp_path / "run"
    base = _train_argv(tiny_data, out)
    results = _two_ranks([base + ["--set", "model.window=4"], base + ["--set", "model.window=6"]])
    for res in results:
        lines = _lines(res)
        assert res.returncode == 2, res.stderr
        assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
        assert "model.window" in lines[0] and "rank 0 4" in lines[0] and "rank 1 6" in lines[0], lines[0]
    assert not out.exists()                                              # nothing written, config.json included


@pytest.mark.slow
def test_one_ranks_refusal_reads_as_one_line_per_process(tmp_path, tiny_data):
    """rank 0 alone checks the output folder (a foreign config.json there): both processes say so."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("not fibattn's")
    results = _two_ranks([_train_argv(tiny_data, out)] * 2)
    for rank, res in enumerate(results):
        lines = _lines(res)
        assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
        assert "config.json" in lines[0], lines[0]
    assert "rank 0 of 2 refused" in _lines(results[1])[0]


@pytest.mark.slow
def test_a_dead_rank_reads_as_one_line(tmp_path):
    """A peer that dies mid-job: the survivor's collective fails as one line naming the cause."""
    code = textwrap.dedent("""
        import os, sys
        import torch.distributed as tdist
        from fibattn.trainer import distributed as D
        info = D.DistInfo(int(os.environ["RANK"]), 2)
        tdist.init_process_group("gloo", rank=info.rank, world_size=2)
        D.gather_text(info, "hello")
        if info.rank == 1:
            os._exit(9)
        try:
            D.gather_text(info, "again")
        except RuntimeError as exc:
            lost = D.peer_lost(info, exc)
            print(lost if lost is not None else f"unconverted: {exc!r}")
            sys.exit(2)
    """)
    procs, outs = _gloo_pair(code)
    assert procs[1].returncode == 9
    line = outs[0][0].strip()
    assert procs[0].returncode == 2 and "\n" not in line, outs[0]
    assert line.startswith("rank 0 of 2 stops: another process of this job died"), line


def test_a_collective_failure_becomes_one_line_naming_the_rank():
    from fibattn.trainer import distributed as D
    info = D.DistInfo(1, 2)
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                        "[127.0.0.1]:29500\nException raised from ... (most recent call first):\nframe #0: ...")
    lost = D.peer_lost(info, gloo)
    assert isinstance(lost, ConfigError) and "\n" not in str(lost)
    assert str(lost).startswith("rank 1 of 2 stops: another process of this job died") and "Connection closed" in str(lost)
    assert D.peer_lost(info, RuntimeError("CUDA out of memory")) is None          # not a peer: left as it is
    assert D.peer_lost(D.DistInfo(), gloo) is None                                 # one process: nothing to say
    with pytest.raises(ValueError, match="^bad$"):                                 # one process: transparent
        with D.together(D.DistInfo(), "x"):
            raise ValueError("bad")


@pytest.mark.slow
def test_together_passes_one_ranks_refusal_to_every_rank(tmp_path):
    code = textwrap.dedent("""
        import os
        import torch.distributed as tdist
        from fibattn.trainer import distributed as D
        info = D.DistInfo(int(os.environ["RANK"]), 2)
        tdist.init_process_group("gloo", rank=info.rank, world_size=2)
        try:
            with D.together(info, "reading the data"):
                if info.rank == 1:
                    raise ValueError("shard /x/train_a_00000.bin does not match the manifest")
        except ValueError as exc:
            print(type(exc).__name__, exc)
    """)
    outs = [out.strip() for out, _ in _gloo_pair(code)[1]]
    assert outs[1] == "ValueError shard /x/train_a_00000.bin does not match the manifest"
    assert outs[0].startswith("RankError rank 1 of 2 refused while reading the data"), outs[0]
    assert "train_a_00000.bin" in outs[0]


# ----------------------------------------------------------------------------- real concurrency (slow)
def _cli_process(argv) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _WORKER, *map(str, argv)], text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT / "src"),
                                                         "OMP_NUM_THREADS": "1"})


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None and time.time() < end, proc.communicate()
        time.sleep(0.05)


@pytest.mark.slow
def test_two_train_processes_into_one_folder(tmp_path, tiny_data, capsys):
    import signal
    out = tmp_path / "run"
    first = _cli_process(_train_argv(tiny_data, out) + ["--set", "train.steps=100000"])
    try:
        _wait_for(ck.ckpt_root(out) / "step-1", first)
        rc, _, err = run_cli(capsys, _train_argv(tiny_data, out) + ["--set", "train.steps=100000"])
        assert_one_line(rc, err, str(out), f"process {first.pid}")
    finally:
        first.send_signal(signal.SIGTERM)
        _, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr
    assert not list(ck.ckpt_root(out).glob("*.set-aside*"))


@pytest.mark.slow
def test_readers_of_a_run_that_prunes_always_read_a_whole_checkpoint(tmp_path, tiny_data):
    from fibattn.storage.runs import load_run
    out = tmp_path / "run"
    trainer = _cli_process(_train_argv(tiny_data, out) + ["--set", "train.steps=60"])
    _wait_for(ck.ckpt_root(out) / "step-1", trainer)
    reads = 0
    while trainer.poll() is None:
        model, _, _ = load_run(out)                  # never "not a valid safetensors file" nor a missing file
        reads += 1
        for _, path in ck.list_checkpoints(ck.ckpt_root(out)):
            ck.unpin(path)                           # as a short-lived reader process would
    _, stderr = trainer.communicate()
    assert trainer.returncode == 0, stderr
    left = [s for s, _ in ck.list_checkpoints(ck.ckpt_root(out))]
    assert reads > 3 and left[-1] == 60 and len(left) <= 2       # one kept while pinned, for a later prune
