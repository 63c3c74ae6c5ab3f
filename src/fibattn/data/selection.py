"""Which files a ``files`` source reads: a folder contributes every text file, decided by content.

A file is *text* when its leading :data:`SNIFF_BYTES` hold no NUL byte and decode as UTF-8 (a
character cut at the chunk's end is fine), whatever its name: ``.md``, ``.rst``, source code and
``.txt`` alike are one document each. ``.jsonl`` and ``.parquet`` files keep their structured
reading (a row per document). In a folder, hidden files and folders (``.git``, ``.env``), files the
``include`` / ``exclude`` globs leave out, binary files and text in another encoding are skipped,
and :func:`skipped_note` says how many and why; nothing is dropped without a word. Files are read in
sorted order of their path under the folder, so a preparation is reproducible.

Globs (``fnmatch``, case-sensitive, ``*`` also crosses ``/``) match a file's path under the folder or
its name; a glob matching a folder's path or name chooses the folder whole (``exclude``: left out,
``include``: every file in it). They are read as people write them (:func:`patterns`, decided here for
every source): ``dir/`` (as .gitignore writes a folder) matches folders only, ``/dir`` and ``./dir`` only
at the top of the source folder, ``**/`` any depth including none, and an absolute path inside the folder
as its path there. A glob that can never match (empty, the folder itself, ``..``, a path outside the
folder) is refused, naming it; one that matched nothing is said in the note.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from functools import lru_cache
from pathlib import Path

from ..config import ConfigError, SourceConfig
from ..files import wide_text

STRUCTURED = (".jsonl", ".parquet")   # read as rows (a document each), not as one text
SNIFF_BYTES = 1 << 13
SHOWN = 3                             # names shown per skip reason
# skip reasons, in the order a file is tested and the note lists them
HIDDEN, EXCLUDED, NOT_INCLUDED, BINARY, NOT_UTF8, WIDE = (
    "hidden", "matched by exclude", "not matched by include", "binary (NUL bytes)", "not UTF-8 text",
    "UTF-16 or UTF-32 text")


@dataclass
class Selection:
    files: list = field(default_factory=list)       # Paths, in reading order
    skipped: dict = field(default_factory=dict)     # reason -> names under the folder (folders end in /)
    unmatched: list = field(default_factory=list)   # "include 'x'" / "exclude 'x'": globs that matched nothing


@dataclass(frozen=True)
class Glob:
    """A glob as the user meant it: ``pattern`` (fnmatch), for folders only (``dir/``), anchored at the top
    of the source folder (``/dir``, ``./dir``, a path with a ``/`` inside) or matching at any depth."""

    text: str
    pattern: str
    folders_only: bool = False
    anchored: bool = False

    def matches(self, rel: str, is_dir: bool) -> bool:
        if self.folders_only and not is_dir:
            return False
        # a/**/b: also a/b (** stands for any folders, none included)
        alts = (self.pattern, self.pattern.replace("/**/", "/")) if "/**/" in self.pattern else (self.pattern,)
        tails = [rel] if self.anchored else [rel] + [rel[i + 1:] for i, c in enumerate(rel) if c == "/"]
        return any(fnmatchcase(t, p) for t in tails for p in alts)


def patterns(globs, where: str, root: Path) -> list[Glob]:
    """``globs`` (a source's ``include`` or ``exclude``, named ``where``) as :class:`Glob`, or a ConfigError
    naming one that can never match a path under ``root``."""
    out = []
    for text in globs:
        g = text.strip()

        def never(why: str):
            raise ConfigError(f"{where} glob {text!r} can never match: {why}")
        if g.startswith("/") and not (root / g.strip("/")).exists():    # an absolute path, not /dir of the folder
            path = Path(g)
            real = path.resolve() if path.exists() else path
            try:
                g = "/" + real.relative_to(root.resolve()).as_posix() + "/" * g.endswith("/")
            except ValueError:
                if path.exists():
                    never(f"{g} is outside the source folder {root}; give a path inside it, or relative to it")
        anchored = g.startswith(("/", "./"))
        g = re.sub(r"/+", "/", g.removeprefix("./").lstrip("/"))
        while g.startswith("./"):
            g = g[2:]
        folders_only = g.endswith("/")
        g = g.rstrip("/")
        if g.startswith("**/"):                     # any depth, none included: what an unanchored glob does
            g, anchored = g[3:], False
        if not g or g == ".":
            itself = " (an empty include reads every file)" if where.endswith("include") else \
                " (it would leave out every file: drop the source instead)"
            never(f"it names the source folder itself{itself}" if text.strip() else "it is empty")
        if g.startswith("!"):
            never("'!' (a .gitignore negation) is not a glob here; list what to read in include instead")
        if ".." in g.split("/"):
            never("'..' leaves the source folder, and only paths inside it are matched")
        anchored = anchored or "/" in g and not g.startswith("*")
        out.append(Glob(text, g, folders_only, anchored))
    return out


def unreadable(path: Path, where: str, exc: OSError) -> ConfigError:
    return ConfigError(f"{where}: {path} cannot be read ({exc.strerror or exc}); make it readable or remove it "
                       f"from the source (or leave it out with an exclude glob)")


@lru_cache(maxsize=1 << 14)
def _sniff_cached(path: str, size: int, mtime_ns: int, ino: int) -> str | None:
    with open(path, "rb") as fh:
        head = fh.read(SNIFF_BYTES)
    if wide_text(head):
        return WIDE
    if b"\0" in head:
        return BINARY
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if not (exc.reason == "unexpected end of data" and len(head) == SNIFF_BYTES):   # a cut character is fine
            return NOT_UTF8
    return None


def sniff(path: Path, where: str) -> str | None:
    """None when ``path`` is text (by its leading bytes), else why not (:data:`BINARY` or :data:`NOT_UTF8`).
    Cached by the file's size, mtime and inode: a source is listed several times per prepare."""
    try:
        st = path.stat()
        return _sniff_cached(str(path), st.st_size, st.st_mtime_ns, st.st_ino)
    except OSError as exc:
        raise unreadable(path, where, exc) from None


def _decode_errors(head: bytes):
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        yield exc


def _matching(rel: str, globs, is_dir: bool, used: set) -> bool:
    hit = [g for g in globs if g.matches(rel, is_dir)]
    used.update(g.text for g in hit)
    return bool(hit)


def _walk(root: Path, src: SourceConfig, where: str) -> Selection:
    """Every file under ``root`` the source reads, and what it skips (linked folders followed, each real
    folder once). A folder that cannot be listed, a broken link or a special file (fifo, device) that
    would be read is an error, never skipped."""
    def fail(exc: OSError):
        raise unreadable(Path(exc.filename or root), where, exc)

    sel, seen, used = Selection(), set(), set()
    include = patterns(src.include, f"{where.removesuffix('.path')}.include", root)
    exclude = patterns(src.exclude, f"{where.removesuffix('.path')}.exclude", root)
    included = set()                        # folders an include glob chose whole (everything below them is in)

    def skip(reason: str, rel: str):
        sel.skipped.setdefault(reason, []).append(rel)

    for folder, subdirs, names in os.walk(root, onerror=fail, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:                 # a link back up the tree: already read
            subdirs[:] = []
            continue
        seen.add(real)
        base = Path(folder).relative_to(root).as_posix()
        prefix = "" if base == "." else base + "/"
        inside = base in included
        keep = []
        for d in sorted(subdirs):
            if d.startswith("."):
                skip(HIDDEN, f"{prefix}{d}/")
            elif _matching(prefix + d, exclude, True, used):
                skip(EXCLUDED, f"{prefix}{d}/")
            else:
                keep.append(d)
                if inside or _matching(prefix + d, include, True, used):
                    included.add(prefix + d)
        subdirs[:] = keep
        for name in sorted(names):
            rel, path = prefix + name, Path(folder) / name
            if name.startswith("."):
                skip(HIDDEN, rel)
            elif _matching(rel, exclude, False, used):
                skip(EXCLUDED, rel)
            elif include and not (_matching(rel, include, False, used) or inside):
                skip(NOT_INCLUDED, rel)
            elif not path.exists():
                raise ConfigError(f"{where}: {path} is a broken link (its target does not exist); fix or remove it "
                                  f"(or leave it out with an exclude glob)")
            elif not path.is_file():
                raise ConfigError(f"{where}: {path} is not a regular file; remove it from the source folder (or "
                                  f"leave it out with an exclude glob)")
            elif not os.access(path, os.R_OK):
                raise unreadable(path, where, PermissionError(13, "permission denied"))
            elif path.suffix in STRUCTURED:
                sel.files.append(path)
            else:
                why = sniff(path, where)
                if why:
                    skip(why, rel)
                else:
                    sel.files.append(path)
    sel.files.sort(key=lambda p: p.relative_to(root).as_posix())
    sel.unmatched = [f"{kind} {g.text!r}" for kind, globs in (("include", include), ("exclude", exclude))
                     for g in globs if g.text not in used]
    return sel


def describe_skipped(skipped: dict) -> str:
    """``"5 entries: 2 hidden: .git/, .env; 3 binary (NUL bytes): a.png, b.png, c.bin"``."""
    order = (HIDDEN, EXCLUDED, NOT_INCLUDED, BINARY, NOT_UTF8, WIDE)
    parts = []
    for reason in order:
        names = skipped.get(reason, [])
        if names:
            more = f", ... {len(names) - SHOWN} more" if len(names) > SHOWN else ""
            parts.append(f"{len(names)} {reason}: {', '.join(names[:SHOWN])}{more}")
    total = sum(len(v) for v in skipped.values())
    return f"{total} {'entry' if total == 1 else 'entries'}: {'; '.join(parts)}"


def select_files(src: SourceConfig, where: str) -> Selection:
    """The files a ``files`` source reads, in reading order (each checked to be readable), and what it
    skipped; ``where``: the source as the user names it (``data.sources[0]``)."""
    root = Path(src.path).expanduser()
    if not root.exists():
        if root.is_symlink():
            raise ConfigError(f"{where}.path {src.path!r} is a broken link (its target does not exist)")
        raise ConfigError(f"{where}.path {src.path!r} does not exist")
    if root.is_file():
        if src.include or src.exclude:
            raise ConfigError(f"{where}.include / exclude choose what a folder contributes; {where}.path "
                              f"{src.path!r} is a file (drop them, or give its folder)")
        if not os.access(root, os.R_OK):
            raise unreadable(root, f"{where}.path", PermissionError(13, "permission denied"))
        why = None if root.suffix in STRUCTURED else sniff(root, f"{where}.path")
        if why == WIDE:
            raise ConfigError(f"{where}.path {root} is {wide_text(root.read_bytes()[:SNIFF_BYTES])}; fibattn reads "
                              f"UTF-8 text files only, convert it (e.g. iconv -f UTF-16 -t UTF-8)")
        if why == NOT_UTF8:              # named directly: say where, as reading it would
            head = root.read_bytes()[:SNIFF_BYTES]
            exc = next(e for e in _decode_errors(head))
            raise ConfigError(f"{where}.path {root} is not valid UTF-8 text (byte {exc.start}: {exc.reason}); "
                              f"fibattn reads UTF-8 text files only, convert it (e.g. iconv -t UTF-8)")
        if why:
            raise ConfigError(f"{where}.path {src.path!r} is not a text file ({why} in its first {SNIFF_BYTES} "
                              f"bytes); fibattn reads UTF-8 text (any name), .jsonl and .parquet files")
        return Selection(files=[root])
    if not root.is_dir():
        raise ConfigError(f"{where}.path {src.path!r} is neither a file nor a folder")
    if not os.access(root, os.R_OK | os.X_OK):
        raise unreadable(root, f"{where}.path", PermissionError(13, "permission denied"))
    sel = _walk(root, src, f"{where}.path")
    if not sel.files:
        why = f"; skipped {describe_skipped(sel.skipped)}" if sel.skipped else " (it is empty)"
        raise ConfigError(f"{where}.path {src.path!r} is a folder with no file to read{why}")
    return sel


def skipped_note(src: SourceConfig, where: str) -> str | None:
    """One line saying what a ``files`` folder source skipped (None when nothing was)."""
    if src.kind != "files":
        return None
    sel = select_files(src, where)
    unmatched = f"; {', '.join(sel.unmatched)} matched nothing" if sel.unmatched else ""
    if not sel.skipped and not unmatched:
        return None
    convert = "; convert other encodings to UTF-8 (e.g. iconv -t UTF-8)" if {NOT_UTF8, WIDE} & set(sel.skipped) \
        else ""
    skipped = f"skipped {describe_skipped(sel.skipped)}" if sel.skipped else "skipped nothing"
    return (f"data: {where} {src.path}: reading {len(sel.files)} files, {skipped}{unmatched} "
            f"(include / exclude globs choose what a folder contributes{convert})")
