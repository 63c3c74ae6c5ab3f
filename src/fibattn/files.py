"""Files fibattn writes and checks: atomic writes (a temp file in the same folder, fsync, then
rename) and the size + sha256 listings that checkpoints and exports verify against."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path

from .checks import ConfigError, UsageError, shown, utf8_problem


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())      # mkstemp creates 0600; give the usual mode
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_text(path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def give_usual_modes(folder) -> None:
    """Give every file in ``folder`` the mode a plain ``open()`` creates (0666 less the umask): libraries that
    write through a temp file (transformers' ``save_pretrained``) leave 0600, unreadable to others."""
    mode = 0o666 & ~_umask()
    for p in Path(folder).iterdir():
        if p.is_file() and not p.is_symlink():
            os.chmod(p, mode)


# top-level folders fibattn's commands write into by default (runs/NAME, data/NAME, exports/NAME)
IGNORED_ROOTS = ("runs", "data", "exports")
GITIGNORE = "# created by fibattn: models, data and runs are not source; delete this file to track them\n*\n"


def make_parents(path) -> Path:
    """Create the folders above ``path`` (not ``path`` itself). One of them named runs, data or exports that
    this call creates gets a ``.gitignore`` holding ``*`` (as Python's venv does), so a new repository does not
    pick up checkpoints, datasets and exports. Returns ``path``."""
    p = Path(path)
    created = []
    for q in p.parents:
        if q.exists() or q.is_symlink():
            break
        created.append(q)
    p.parent.mkdir(parents=True, exist_ok=True)
    mark_ignored(created)
    return p


def mark_ignored(created) -> None:
    """Write the ``.gitignore`` of ``*`` into each of the just-created folders ``created`` named runs, data or
    exports (see :func:`make_parents`)."""
    for q in created:
        if Path(q).name in IGNORED_ROOTS and not (Path(q) / ".gitignore").exists():
            (Path(q) / ".gitignore").write_text(GITIGNORE)


class PathError(ConfigError):
    """An output path that cannot be created; the message names the path and the setting."""


def check_creatable(path, setting: str, kind: str = "folder") -> Path:
    """Check, creating nothing, that ``path`` is an existing ``kind`` (folder | file) or can be
    created: nothing on its way is a regular file, and the nearest existing folder is writable.
    A :class:`PathError` naming ``setting`` otherwise."""
    p = Path(path).expanduser()
    bad = utf8_problem(str(p.absolute()))        # the path is recorded as text (config.json, the results DB)
    if bad is not None:
        raise PathError(f"{setting} {shown(p.absolute())} holds bytes that are not UTF-8 ({bad}); fibattn records "
                        f"its output paths as UTF-8 text: choose a folder whose path is UTF-8")
    if p.exists() and (p.is_dir() != (kind == "folder")):
        raise PathError(f"{setting} {p} exists and is not a {kind}; choose another {setting}")
    parent = p if kind == "folder" else p.parent
    while not parent.exists() and parent != parent.parent:
        if parent.is_symlink():
            raise PathError(f"{setting} {p} is not writable: {parent} is a broken link; choose another {setting}")
        parent = parent.parent
    if not parent.is_dir():
        raise PathError(f"{setting} {p} is not writable: {parent} is a file, not a folder; choose another "
                        f"{setting}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PathError(f"{setting} {p} is not writable: no write permission on {parent.absolute()}; "
                        f"choose another {setting}")
    return p


@contextlib.contextmanager
def naming_os_errors(path, setting: str):
    """Re-raise an OSError met while writing ``path`` with the path and ``setting`` in its message."""
    try:
        yield
    except OSError as exc:
        if exc.errno is None:                  # a message fibattn wrote already
            raise
        raise OSError(exc.errno, f"cannot write {exc.filename or path} ({setting}): {exc.strerror or exc}") from None


def check_overwritable(folder, files: dict, setting: str) -> None:
    """``files`` maps a name fibattn writes into ``folder`` to text its own copy starts with (within its first
    1 KB); an existing file of that name without it is a user's, and is refused rather than overwritten."""
    for name, mark in files.items():
        path = Path(folder) / name
        if not path.exists():
            continue
        try:
            with open(path, "rb") as fh:
                head = fh.read(1024).decode("utf-8", "replace")
        except OSError:
            head = ""
        if not path.is_file() or mark not in head:
            raise PathError(f"{setting} {folder} holds {name}, which fibattn did not write (it would be "
                            f"overwritten); choose another {setting} or move the file away")


def os_error_line(exc: OSError, setting: str | None = None) -> str:
    """One line for an operating-system error: the path(s), the reason and, when known, the setting."""
    where = " -> ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
    reason = exc.strerror or str(exc) or type(exc).__name__
    if exc.errno == errno.ENOSPC:
        reason += " (the disk is full: free some space, then run the command again)"
    return f"{where + ': ' if where else ''}{reason}{f' (from {setting})' if setting else ''}"


def fsync_dir(path) -> None:
    """Make a rename inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def listed_file_problem(path, info: dict, data: bytes | None = None) -> str | None:
    """How ``path`` differs from its listing ``{"bytes": n, "sha256": hex}`` — ``is missing``,
    ``is truncated or changed (...)`` or ``is corrupted (sha256 mismatch)`` — or None when it
    matches. ``data``: the file's bytes when the caller has read them already."""
    path = Path(path)
    if data is None and not path.is_file():
        return "is missing"
    size = len(data) if data is not None else path.stat().st_size
    if size != info["bytes"]:
        return f"is truncated or changed ({size} bytes, expected {info['bytes']})"
    digest = hashlib.sha256(data).hexdigest() if data is not None else sha256_file(path)
    if digest != info["sha256"]:
        return "is corrupted (sha256 mismatch)"
    return None


# ------------------------------------------------------------------------- caches of code fibattn runs
def not_private(path, *, folder: bool) -> str | None:
    """Why code loaded from ``path`` could be someone else's (None when it cannot): it must belong to this
    user and be writable by neither its group nor others; a file must be a regular file, not a link (a
    folder may be reached through one: its target is checked). Anything else could have been planted."""
    if not hasattr(os, "getuid"):                    # no POSIX owners (Windows): nothing to check
        return None
    try:
        st = os.stat(path) if folder else os.lstat(path)
    except OSError as exc:
        return f"cannot be checked ({exc.strerror or exc})"
    if folder and not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if not folder and not stat.S_ISREG(st.st_mode):
        return "is not a regular file (a link or something else)"
    if st.st_uid != os.getuid():
        return f"belongs to user id {st.st_uid}, not to this user (id {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = " and ".join(w for bit, w in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "others"))
                           if st.st_mode & bit)
        return f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def private_folder(path) -> tuple[Path, str | None]:
    """A folder to keep code fibattn builds and later loads (a compiled library): ``path``, created
    (mode 0700) when missing, if it is this user's alone (:func:`not_private`); else a new private temporary
    folder, removed at exit, and why ``path`` was not used."""
    p = Path(path).expanduser()
    why = None
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        why = f"cannot be created ({exc.strerror or exc})"
    why = why or not_private(p, folder=True)
    if why is None:
        return p, None
    return temporary_private_folder(), f"{p} {why}"


def temporary_private_folder() -> Path:
    """A new folder only this user may use (mode 0700), removed when the process exits."""
    import atexit
    import shutil
    tmp = Path(tempfile.mkdtemp(prefix="fibattn-private-"))       # mode 0700, this user's
    atexit.register(shutil.rmtree, tmp, True)
    return tmp


def make_private_file(path) -> None:
    """Give a file fibattn built for itself (before it is renamed into a cache) a mode no one else may write:
    a umask of 002 would leave it group-writable, and the next process would refuse it."""
    os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))


# ------------------------------------------------------------------------- reading text files: the cause
_WIDE_BOMS = ((b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe\x00\x00", "UTF-32"), (b"\xfe\xff", "UTF-16"),
              (b"\xff\xfe", "UTF-16"))


class TextFileError(UsageError, json.JSONDecodeError):
    """What is wrong with a file's text, said as its cause (UTF-16 text, binary data, an empty file, a trailing
    comma, a comment in JSON) rather than as the parser's symptom ("line 1 column 1"). A JSONDecodeError too, so
    that readers which caught the parser's errors catch these."""

    def __init__(self, cause: str, doc: str = "", pos: int = 0):
        json.JSONDecodeError.__init__(self, cause, doc, pos)
        self.args = (cause,)

    def __str__(self) -> str:
        return self.args[0]


def wide_text(raw: bytes) -> str | None:
    """Why ``raw`` reads as UTF-16 or UTF-32 text (its byte-order mark, or a NUL in most odd or even bytes of its
    start, as ASCII in those encodings has), else None: such a file is text in another encoding, not binary data."""
    for bom, name in _WIDE_BOMS:
        if raw.startswith(bom):
            return f"{name} text (it starts with a {name} byte-order mark)"
    head = raw[:64] if len(raw) >= 64 else raw[:len(raw) - len(raw) % 4]
    if len(head) >= 4:
        odd, even = head[1::2], head[0::2]
        for half in (odd, even):
            if half.count(0) * 4 >= len(half) * 3 and (odd if half is even else even).count(0) * 4 < len(half):
                return "UTF-16 text without a byte-order mark"
        quads = [head[k::4] for k in range(4)]
        if sum(q.count(0) * 4 >= len(q) * 3 for q in quads) == 3:
            return "UTF-32 text without a byte-order mark"
    return None


def utf8_text(raw: bytes) -> str:
    """``raw`` as UTF-8 text, a leading byte-order mark dropped (editors on Windows write one); UTF-16/32, binary
    data and other encodings are a :class:`TextFileError` naming the cause and where."""
    wide = wide_text(raw)
    if wide:
        raise TextFileError(f"it is {wide}; save it as UTF-8")
    raw = raw[3:] if raw.startswith(b"\xef\xbb\xbf") else raw
    nul = raw.find(b"\0")
    if nul >= 0:
        line = raw.count(b"\n", 0, nul) + 1
        raise TextFileError(f"it holds binary data (a NUL byte at offset {nul}, line {line}), not text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        lines = raw.count(b"\n", 0, exc.start)
        at = f"offset {exc.start}" + (f", line {lines + 1}" if lines or raw.count(b"\n") > 1 else "")
        raise TextFileError(f"byte 0x{raw[exc.start]:02x} at {at} is not UTF-8 (another encoding, such as Latin-1 or "
                            f"Windows-1252?); save it as UTF-8") from None


def _json_cause(exc: json.JSONDecodeError, text: str) -> str:
    pos, line, col = exc.pos, exc.lineno, exc.colno
    where = f"line {line} column {col}"
    here = text[pos] if pos < len(text) else ""
    before = text[:pos].rstrip()[-1:]
    shown = text.splitlines()[line - 1].strip() if text.splitlines() else ""
    shown = f": {shown[:60]!r}" if shown else ""
    if not text[pos:].strip() and exc.msg != "Extra data" or exc.msg.startswith("Unterminated string"):
        what = exc.msg.lower() + ("" if exc.msg.endswith(" at") else " at")
        return f"it ends before the JSON does ({what} {where}: a bracket, brace or quote left open, or the file cut short)"
    if here and here in "/#":
        return f"{where}: JSON has no comments{shown}"
    if exc.msg == "Extra data":
        return f"{where}: more text after the JSON value ended (two values, or a stray character){shown}"
    if here == "'":
        return f"{where}: JSON strings and names need double quotes (\"), not single ones{shown}"
    if here and here in "\u201c\u201d\u2018\u2019":
        return f"{where}: a typographic quote ({here}); JSON needs straight double quotes (\"){shown}"
    if before == "," and here and here in "}]":
        return f"{where}: a comma before {here!r} (JSON allows no trailing comma){shown}"
    if exc.msg.startswith("Invalid control character"):
        return f"{where}: a line break or tab inside a string (write it as \\n or \\t){shown}"
    if here.isalpha() and exc.msg == "Expecting value":
        word = "".join(c for c in text[pos:pos + 12].split()[0] if c.isalnum() or c == "_") if text[pos:].split() \
            else here
        return (f"{where}: {word!r} is not a JSON value (strings need double quotes; true, false and null are "
                f"lower case){shown}")
    return f"{exc.msg} at {where}{shown}"


def parse_json(raw):
    """The JSON value of a file's bytes (or text): a leading byte-order mark is accepted; anything unreadable is a
    :class:`TextFileError` that names the cause (see :func:`utf8_text`; an empty file, a trailing comma, a comment,
    single quotes, Python's True/None, a truncated file, ...) with the line and its text."""
    text = utf8_text(raw) if isinstance(raw, (bytes, bytearray)) else str(raw).removeprefix("\ufeff")
    if not text.strip():
        raise TextFileError("it is empty" if not text else "it holds only whitespace, no JSON value")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TextFileError(_json_cause(exc, text), text, exc.pos) from None
    except RecursionError:
        raise TextFileError("it is nested too deeply") from None


def read_json(path):
    """:func:`parse_json` of the file at ``path`` (an ``OSError`` when it cannot be read)."""
    with open(path, "rb") as fh:
        return parse_json(fh.read())


def parse_toml(raw: bytes) -> dict:
    """The TOML document of a file's bytes, decoded as :func:`utf8_text` does (tomllib's own errors name the line)."""
    import tomllib
    return tomllib.loads(utf8_text(raw))
