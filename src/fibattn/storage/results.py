"""A SQLite results database shared by the runs of one folder.

Tables::

    runs(name PK, label, out_dir, config JSON, status, started, finished)
    metrics(run, step, key, value)              PK (run, step, key)
    alphas(run, step, layer, alpha)             PK (run, step, layer)
    eval_results(run, dataset, length, reach, ppl, bpb, tokens, json, created)
                                                PK (run, dataset, length, reach)

A run's key (``name``) is the basename of its output folder (:func:`run_key`); folders
that share a parent share a database, so the key is unique within it. The default
database is ``<parent of train.out_dir>/results.sqlite`` (:func:`default_db_path`);
``train.results_db`` overrides it (``off`` disables it). Status: running | finished |
failed | stopped. Writes are short transactions with a generous busy timeout, so
several training processes may share one database.

Every SQLite failure (a corrupted file, a read-only database, a lock held too long) raises
:class:`ResultsDBError`, a ValueError whose one-line message names the database file and
the setting that chose it (``train.results_db``, or ``--db`` for ``fibattn eval``).
"""
from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from pathlib import Path
from typing import Iterable

from ..checks import UsageError
from ..files import PathError, check_creatable

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    name TEXT PRIMARY KEY, label TEXT, out_dir TEXT, config TEXT, status TEXT,
    started REAL, finished REAL);
CREATE TABLE IF NOT EXISTS metrics (
    run TEXT NOT NULL, step INTEGER NOT NULL, key TEXT NOT NULL, value REAL,
    PRIMARY KEY (run, step, key));
CREATE TABLE IF NOT EXISTS alphas (
    run TEXT NOT NULL, step INTEGER NOT NULL, layer INTEGER NOT NULL, alpha REAL,
    PRIMARY KEY (run, step, layer));
CREATE TABLE IF NOT EXISTS eval_results (
    run TEXT NOT NULL, dataset TEXT NOT NULL, length INTEGER NOT NULL, reach TEXT NOT NULL,
    ppl REAL, bpb REAL, tokens INTEGER, json TEXT, created REAL,
    PRIMARY KEY (run, dataset, length, reach));
"""
STATUSES = ("running", "finished", "failed", "stopped")
SETTING = "train.results_db"


class ResultsDBError(UsageError):
    """The results database cannot be read or written; the message names the file and the setting."""


def db_problem(path, setting: str, exc: BaseException) -> str:
    """One line naming the database, the setting and what is wrong."""
    text = str(exc) or type(exc).__name__
    low = text.lower()
    if "readonly" in low or "read-only" in low:
        what = f"is read-only ({text})"
    elif "not a database" in low or "malformed" in low or "corrupt" in low:
        what = f"is corrupted ({text})"
    elif "locked" in low or "busy" in low:
        what = f"is locked by another process ({text})"
    else:
        what = f"cannot be used ({type(exc).__name__}: {text})"
    return (f"results database {path} ({setting}) {what}; repair or move it away, or point {setting} at "
            f"another file")


def check_db_path(path, setting: str = SETTING) -> ResultsDB | None:
    """Check the database at ``path`` before work whose results go there starts: an existing file is
    opened and proven intact and writable (the open database is returned); for a file not created yet,
    its folder must be writable (None is returned and nothing is created). A ResultsDBError otherwise."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        db = ResultsDB(path, setting=setting)
        try:
            db.check()
        except BaseException:
            db.close()
            raise
        return db
    try:
        check_creatable(path, setting, "file")
    except PathError as exc:
        raise ResultsDBError(f"results database: {exc}") from None
    return None


def _missing_table(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and "no such table" in str(exc)


def run_key(out_dir) -> str:
    """The database key of the run written to ``out_dir``: the folder's name."""
    return Path(out_dir).resolve().name


def default_db_path(out_dir) -> Path:
    return Path(out_dir).resolve().parent / "results.sqlite"


def resolve_db_path(out_dir, setting: str = "") -> Path | None:
    """``train.results_db`` -> a path (``""``: the default, ``off``: ``None``)."""
    if setting == "off":
        return None
    return Path(setting) if setting else default_db_path(out_dir)


class ResultsDB:
    """Thin wrapper over ``sqlite3``; use as a context manager or call :meth:`close`."""

    def __init__(self, path, *, timeout: float = 60.0, setting: str = SETTING):
        self.path = Path(path)
        self.setting = setting
        self.conn = None
        if self.path.exists() and not self.path.is_file():
            raise ResultsDBError(f"results database {self.path} ({setting}) is not a file")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ResultsDBError(f"results database {self.path} ({setting}): cannot create its folder "
                                 f"({exc.strerror or exc})") from None
        try:
            with self._guard():
                self.conn = sqlite3.connect(str(self.path), timeout=timeout)
                with self.conn:
                    self.conn.executescript(SCHEMA)
        except ResultsDBError:
            self.close()
            raise

    @contextlib.contextmanager
    def _guard(self):
        """Turn any SQLite failure into a :class:`ResultsDBError` naming the file and the setting."""
        try:
            yield
        except sqlite3.Error as exc:
            raise ResultsDBError(db_problem(self.path, self.setting, exc)) from None

    def check(self) -> None:
        """Prove the database is intact and writable (an integrity check and a rolled-back write),
        before any work whose results go there starts."""
        with self._guard():
            rows = self.conn.execute("PRAGMA quick_check").fetchall()
            if [r[0] for r in rows] != ["ok"]:
                raise sqlite3.DatabaseError(f"database disk image is malformed: {rows[0][0] if rows else '?'}")
            try:
                self.conn.execute("INSERT OR REPLACE INTO metrics (run, step, key, value) VALUES ('', -1, '', 0)")
            finally:
                self.conn.rollback()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----------------------------------------------------------------- runs
    def start_run(self, name: str, *, config: dict, out_dir: str = "", label: str = "", fresh: bool = False) -> None:
        """Insert or update a run as ``running``; a resumed run keeps its first ``started`` time,
        a ``fresh`` one (training from step 0) resets it."""
        with self._guard(), self.conn:
            if fresh:
                self.conn.execute("DELETE FROM runs WHERE name=?", (name,))
            self.conn.execute(
                "INSERT INTO runs (name, label, out_dir, config, status, started, finished) "
                "VALUES (?, ?, ?, ?, 'running', ?, NULL) ON CONFLICT(name) DO UPDATE SET "
                "label=excluded.label, out_dir=excluded.out_dir, config=excluded.config, "
                "status='running', finished=NULL",
                (name, label, str(out_dir), json.dumps(config, sort_keys=True), time.time()))

    def finish_run(self, name: str, status: str = "finished") -> None:
        if status not in STATUSES:
            raise UsageError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
        with self._guard(), self.conn:
            self.conn.execute("UPDATE runs SET status=?, finished=? WHERE name=?", (status, time.time(), name))

    def runs(self) -> list[dict]:
        with self._guard():
            cur = self.conn.execute("SELECT name, label, out_dir, config, status, started, finished FROM runs "
                                    "ORDER BY name")
            cols = [c[0] for c in cur.description]
            return [dict(zip(cols, row)) for row in cur.fetchall()]

    def truncate(self, name: str, after_step: int) -> None:
        """Forget metrics and alphas logged after ``after_step`` (a resumed run rewrites them)."""
        with self._guard(), self.conn:
            self.conn.execute("DELETE FROM metrics WHERE run=? AND step>?", (name, after_step))
            self.conn.execute("DELETE FROM alphas WHERE run=? AND step>?", (name, after_step))

    # ----------------------------------------------------------------- metrics
    def log_metrics(self, name: str, step: int, values: dict[str, float]) -> None:
        rows = [(name, step, k, float(v)) for k, v in values.items()]
        with self._guard(), self.conn:
            self.conn.executemany("INSERT OR REPLACE INTO metrics (run, step, key, value) VALUES (?, ?, ?, ?)", rows)

    def log_alphas(self, name: str, step: int, alphas: Iterable[float]) -> None:
        rows = [(name, step, i, float(a)) for i, a in enumerate(alphas)]
        with self._guard(), self.conn:
            self.conn.executemany("INSERT OR REPLACE INTO alphas (run, step, layer, alpha) VALUES (?, ?, ?, ?)", rows)

    def metrics(self, name: str, key: str) -> list[tuple[int, float]]:
        with self._guard():
            cur = self.conn.execute("SELECT step, value FROM metrics WHERE run=? AND key=? ORDER BY step", (name, key))
            return [(int(s), v) for s, v in cur.fetchall()]

    def alphas(self, name: str) -> dict[int, list[float]]:
        """``{step: [alpha per layer]}``."""
        out: dict[int, list[float]] = {}
        with self._guard():
            for step, layer, alpha in self.conn.execute(
                    "SELECT step, layer, alpha FROM alphas WHERE run=? ORDER BY step, layer", (name,)):
                out.setdefault(int(step), []).append(alpha)
        return out

    # ----------------------------------------------------------------- evaluation
    def log_eval(self, name: str, dataset: str, length: int, reach: str, *, ppl: float, bpb: float | None = None,
                 tokens: int = 0, extra: dict | None = None) -> None:
        with self._guard(), self.conn:
            self.conn.execute(
                "INSERT OR REPLACE INTO eval_results (run, dataset, length, reach, ppl, bpb, tokens, json, created) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (name, dataset, int(length), reach, float(ppl), None if bpb is None else float(bpb), int(tokens),
                 json.dumps(extra or {}, sort_keys=True), time.time()))

    def eval_results(self, name: str | None = None) -> list[dict]:
        sql = "SELECT run, dataset, length, reach, ppl, bpb, tokens, json, created FROM eval_results"
        with self._guard():
            cur = self.conn.execute(sql + (" WHERE run=? ORDER BY dataset, length, reach" if name else
                                           " ORDER BY run, dataset, length, reach"), (name,) if name else ())
            cols = [c[0] for c in cur.description]
            return [dict(zip(cols, row)) for row in cur.fetchall()]


# --------------------------------------------------------------------- read-only queries
def _read(path, sql: str, args: tuple, setting: str = SETTING) -> list[tuple]:
    """Rows of a query on an existing database; none when the file or its tables do not exist
    yet (never creates the file). Any other SQLite failure (corrupted, locked) is a
    :class:`ResultsDBError` naming the file and ``setting``."""
    path = Path(path)
    if not path.exists():
        return []
    if not path.is_file():
        raise ResultsDBError(f"results database {path} ({setting}) is not a file")
    try:
        conn = sqlite3.connect(str(path), timeout=60)
    except sqlite3.Error as exc:
        raise ResultsDBError(db_problem(path, setting, exc)) from None
    try:
        return conn.execute(sql, args).fetchall()
    except sqlite3.Error as exc:
        if _missing_table(exc):
            return []
        raise ResultsDBError(db_problem(path, setting, exc)) from None
    finally:
        conn.close()


def run_status(path, name: str) -> str | None:
    rows = _read(path, "SELECT status FROM runs WHERE name=?", (name,))
    return rows[0][0] if rows else None


def evaluated_lengths(path, name: str, reach: str) -> set[int]:
    return {int(r[0]) for r in _read(path, "SELECT DISTINCT length FROM eval_results WHERE run=? AND reach=?",
                                     (name, reach))}


def eval_ppls(path, name: str, reach: str) -> list[tuple[str, int, float]]:
    """``(dataset, length, ppl)`` of every recorded evaluation of ``name`` in mode ``reach``."""
    return [(d, int(n), float(p)) for d, n, p in _read(
        path, "SELECT dataset, length, ppl FROM eval_results WHERE run=? AND reach=?", (name, reach))]


def forget_runs(path, names) -> None:
    """Delete every row of the runs ``names`` (runs, metrics, alphas, evaluations)."""
    path = Path(path)
    if not path.is_file():
        return
    try:
        conn = sqlite3.connect(str(path), timeout=60)
    except sqlite3.Error as exc:
        raise ResultsDBError(db_problem(path, SETTING, exc)) from None
    try:
        with conn:
            for name in names:
                for table, col in (("runs", "name"), ("metrics", "run"), ("alphas", "run"), ("eval_results", "run")):
                    try:
                        conn.execute(f"DELETE FROM {table} WHERE {col}=?", (name,))
                    except sqlite3.OperationalError as exc:
                        if not _missing_table(exc):   # a table not created yet: nothing recorded there
                            raise
    except sqlite3.Error as exc:
        raise ResultsDBError(db_problem(path, SETTING, exc)) from None
    finally:
        conn.close()

