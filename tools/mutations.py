"""Mutation check: does the test suite catch the one-line bugs that matter?

    python tools/mutations.py [--only NAME[,NAME...]] [--list] [--keep] [--no-baseline]

Each mutation (listed in ``tools/mutation_list.py``) replaces one exact piece of source (it must
occur exactly once, or the mutation is reported *stale*: move it with the code) in a fresh copy of
``src/``, ``tests/``, ``tools/`` and ``pyproject.toml``, then runs the tests that should notice. A mutation
is *caught* when one of those tests fails (tests that only error are *ERRORED*: not caught). First,
each distinct test selection runs once on an unmutated copy: a selection that fails there would
"catch" anything, so its mutations are *BASELINE* (not caught; ``--no-baseline`` skips this, about
half the run's time). The run prints each verdict, then ``caught N/M`` and the survivors (stale
entries among them), and exits 1 unless every mutation is caught. Run on demand (minutes), not in
CI; ``tests/test_mutations_tool.py`` (default suite) checks that every entry still applies.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))   # the list beside this file, however it is loaded
from mutation_list import MUTATIONS, Mutation  # noqa: E402


def _copy_tree(dest: Path) -> None:
    for name in ("src", "tests", "tools"):      # tools: the tests of the repo's tools run them from the copy
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")


def stale_reason(m: Mutation, tree: Path = ROOT) -> str | None:
    """Why ``m`` no longer applies to ``tree`` (its file or a test file moved, its text changed), or None."""
    path = tree / m.file
    if not path.is_file():
        return f"stale: {m.file} does not exist"
    try:
        n = path.read_text().count(m.old)
    except (OSError, UnicodeDecodeError) as exc:
        return f"stale: {m.file} cannot be read ({exc})"
    if n != 1:
        return f"stale: the original text occurs {n} times in {m.file}"
    if m.old == m.new:
        return "stale: the replacement equals the original"
    for arg in m.tests:
        if arg.startswith("tests/") and not (tree / arg.split("::")[0]).is_file():
            return f"stale: test path {arg} does not exist"
    return None


def apply(m: Mutation, tree: Path) -> str | None:
    """Mutate ``tree`` in place; the reason it could not be done, or None."""
    why = stale_reason(m, tree)
    if why:
        return why
    path = tree / m.file
    path.write_text(path.read_text().replace(m.old, m.new))
    return None


def verdict_of(returncode: int, tail: str) -> tuple[str, str]:
    """``(verdict, detail)`` from pytest's exit code and last line: caught only when a test failed. Tests
    that only errored (collection, a fixture) prove nothing about the mutation: the copy may lack
    something they need (it once lacked ``tools/``), so they are ERRORED, which counts as not caught."""
    if returncode == 0:
        return "SURVIVED", tail
    if returncode == 1 and re.search(r"\b\d+ failed\b", tail):
        return "caught", tail
    if returncode == 1:
        return "ERRORED", f"no test failed, some errored: {tail}"
    return "SURVIVED", f"pytest exit {returncode} (not a test failure): {tail}"


def _pytest(tree: Path, cache: Path, tests: tuple[str, ...]) -> tuple[int, str, float]:
    """``(exit code, pytest's last line, seconds)`` of ``tests`` run in the copy ``tree``."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), FIBATTN_CACHE=str(cache), PYTHONDONTWRITEBYTECODE="1")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                         cwd=tree, env=env, capture_output=True, text=True)
    return res.returncode, (res.stdout.strip().splitlines() or [""])[-1], time.monotonic() - t0


def baseline(chosen: list[Mutation], cache: Path) -> dict[tuple[str, ...], str]:
    """Why each distinct test selection of the applicable ``chosen`` fails on an unmutated copy
    (``""`` when it passes), run once each."""
    selections = list(dict.fromkeys(m.tests for m in chosen if stale_reason(m) is None))
    if not selections:
        return {}
    tree = Path(tempfile.mkdtemp(prefix="fibattn-mut-baseline-"))
    try:
        _copy_tree(tree)
        out = {}
        for tests in selections:
            rc, tail, secs = _pytest(tree, cache, tests)
            out[tests] = "" if rc == 0 else f"fails without the mutation (pytest exit {rc}): {tail}"
            print(f"{'baseline':<9} {' '.join(tests)[:50]:<51} {secs:6.1f}s  {out[tests] or 'passes'}", flush=True)
        return out
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def check(m: Mutation, cache: Path, keep: bool) -> tuple[str, float, str]:
    """``(verdict, seconds, detail)`` with verdict caught | SURVIVED | ERRORED | stale."""
    why = stale_reason(m)
    if why:
        return "stale", 0.0, why
    tree = Path(tempfile.mkdtemp(prefix=f"fibattn-mut-{m.name}-"))
    try:
        _copy_tree(tree)
        why = apply(m, tree)
        if why:
            return "stale", 0.0, why
        rc, tail, secs = _pytest(tree, cache, m.tests)
        verdict, detail = verdict_of(rc, tail)
        return verdict, secs, detail
    finally:
        if not keep:
            shutil.rmtree(tree, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated mutation names")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--keep", action="store_true", help="keep each mutated copy (its path is printed)")
    p.add_argument("--no-baseline", action="store_true", help="skip running each test selection unmutated first")
    args = p.parse_args(argv)
    chosen = MUTATIONS
    if args.only:
        names = {n.strip() for n in args.only.split(",") if n.strip()}
        unknown = names - {m.name for m in MUTATIONS}
        if unknown:
            print(f"--only: unknown mutation(s) {', '.join(sorted(unknown))}; see --list", file=sys.stderr)
            return 2
        chosen = [m for m in MUTATIONS if m.name in names]
    if args.list:
        for m in chosen:
            print(f"{m.name:<32} {m.kind:<18} {m.file}")
        return 0
    cache = Path(tempfile.gettempdir()) / "fibattn-mutation-kernels"
    failing = {} if args.no_baseline else baseline(chosen, cache)
    survivors = []
    for m in chosen:
        if failing.get(m.tests):
            verdict, secs, detail = "BASELINE", 0.0, failing[m.tests]
        else:
            verdict, secs, detail = check(m, cache, args.keep)
        print(f"{verdict:<9} {m.name:<32} {m.kind:<18} {secs:6.1f}s  {detail}", flush=True)
        if verdict != "caught":
            survivors.append(m.name)
    print(f"caught {len(chosen) - len(survivors)}/{len(chosen)}")
    if survivors:
        print("not caught: " + ", ".join(survivors))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
