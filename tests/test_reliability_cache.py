"""Code fibattn caches and later runs (issue 58, kind 13): the CPU kernel library is loaded from
``FIBATTN_CACHE`` only when that folder and the file belong to this user and neither group nor others may
write them; anything else is never loaded, and the library is built in a private folder instead.

Tests run as root: another owner is simulated by reporting another user id, group- and other-writable
modes by chmod. No test compiles: a "build" copies the library this process already runs."""
from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path

import pytest

from fibattn import files
from fibattn.ops import cpu_backend

pytestmark = pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX owners and modes")


@pytest.fixture
def kernels(tmp_path, monkeypatch):
    """``(cache folder, the library's path in it, the library this process runs)``; builds copy that one."""
    real = cpu_backend.library_file()
    if real is None:
        pytest.skip("no CPU kernel library here (no gcc)")
    cache = tmp_path / "cache"
    monkeypatch.setenv("FIBATTN_CACHE", str(cache))
    built = []

    def fake_compile(compiler, target):
        built.append(Path(target))
        shutil.copyfile(real, target)
    monkeypatch.setattr(cpu_backend, "_compile", fake_compile)
    target = cpu_backend._library_path(shutil.which("gcc"), cpu_backend._SOURCE.read_bytes())
    assert target.parent == cache
    return cache, target, built


def _plant(target: Path) -> bytes:
    target.parent.mkdir(parents=True, exist_ok=True)
    data = b"not a library: loading this would run someone else's code"
    target.write_bytes(data)
    return data


def _as_other_user(monkeypatch, path: Path, uid: int = 4242):
    """``os.lstat`` / ``os.stat`` of ``path`` report it as belonging to user ``uid``."""
    real_lstat, real_stat = os.lstat, os.stat

    def fake(fn):
        def call(p, *a, **kw):
            st = fn(p, *a, **kw)
            if Path(p) == path:
                fields = list(st)
                fields[stat.ST_UID] = uid
                return os.stat_result(fields)
            return st
        return call
    monkeypatch.setattr(os, "lstat", fake(real_lstat))
    monkeypatch.setattr(os, "stat", fake(real_stat))


def _load_refusing(caplog, target: Path, needle: str):
    with caplog.at_level(logging.WARNING, logger="fibattn"):
        build = cpu_backend._load()
    assert build.lib is not None, build.reason
    loaded = Path(build.lib._name)
    assert loaded.parent != target.parent and loaded.name == target.name
    assert stat.S_IMODE(os.stat(loaded.parent).st_mode) == 0o700
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "not loading the CPU kernel library" in warned and needle in warned, warned
    return loaded


@pytest.mark.parametrize("mode, needle", [(0o775, "writable by its group"), (0o757, "writable by others"),
                                          (0o777, "its group and others")])
def test_a_planted_library_in_a_folder_others_can_write_is_never_loaded(kernels, caplog, mode, needle):
    cache, target, built = kernels
    data = _plant(target)
    os.chmod(cache, mode)
    _load_refusing(caplog, target, needle)
    assert target.read_bytes() == data            # never loaded, never touched: it is not fibattn's to delete
    assert built and built[0].parent != cache


def test_a_folder_of_another_user_is_not_used(kernels, caplog, monkeypatch):
    cache, target, built = kernels
    _plant(target)
    os.chmod(cache, 0o700)
    _as_other_user(monkeypatch, cache)
    _load_refusing(caplog, target, "belongs to user id 4242")


@pytest.mark.parametrize("how", ["group-writable", "other-writable", "another owner", "a link"])
def test_a_library_file_someone_else_could_have_written_is_not_loaded(kernels, caplog, monkeypatch, tmp_path, how):
    cache, target, built = kernels
    cache.mkdir(mode=0o700)
    if how == "a link":                          # even to a real library: the link's target is not checked
        elsewhere = tmp_path / "elsewhere.so"
        shutil.copyfile(cpu_backend.library_file(), elsewhere)
        target.symlink_to(elsewhere)
        needle = "not a regular file"
    else:
        shutil.copyfile(cpu_backend.library_file(), target)
        os.chmod(target, {"group-writable": 0o775, "other-writable": 0o757, "another owner": 0o755}[how])
        if how == "another owner":
            _as_other_user(monkeypatch, target)
        needle = {"group-writable": "its group", "other-writable": "others", "another owner": "user id 4242"}[how]
    _load_refusing(caplog, target, needle)


def test_a_private_cache_is_used_as_it_is(kernels, caplog):
    """This user's folder (created 0700 when missing) and file: loaded from there, built once."""
    cache, target, built = kernels
    with caplog.at_level(logging.WARNING, logger="fibattn"):
        first = cpu_backend._load()
        second = cpu_backend._load()
    assert Path(first.lib._name) == Path(second.lib._name) == target
    assert built == [target]                       # the second load found it: not built again
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    assert not [r for r in caplog.records if "not loading" in r.getMessage()]


def test_the_built_library_is_not_writable_by_others_whatever_the_umask(tmp_path, monkeypatch):
    """A umask of 002 (common for users) would leave gcc's output group-writable, and the next process
    would refuse its own cache: the build takes that write bit away before renaming it into place."""
    fake_gcc = tmp_path / "gcc"
    fake_gcc.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then shift; echo x > "$1"; fi; '
                        'shift; done\n')
    fake_gcc.chmod(0o755)
    target = tmp_path / "cache" / "lib.so"
    old = os.umask(0o002)
    try:
        cpu_backend._compile(str(fake_gcc), target)
    finally:
        os.umask(old)
    assert files.not_private(target, folder=False) is None
    assert sorted(p.name for p in target.parent.iterdir()) == ["lib.so"]      # the build folder is gone


def test_not_private_says_why(tmp_path):
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    assert files.not_private(d, folder=True) is None
    os.chmod(d, 0o770)
    assert "its group" in files.not_private(d, folder=True)
    assert "is not a folder" in files.not_private(tmp_path / "missing", folder=True) or \
        "cannot be checked" in files.not_private(tmp_path / "missing", folder=True)
    folder, why = files.private_folder(d)
    assert folder != d and "its group" in why and stat.S_IMODE(os.stat(folder).st_mode) == 0o700
