"""tools/mutations.py stays runnable: every entry still applies, and a stale one is reported, not crashed on."""
from __future__ import annotations

from pathlib import Path

import pytest

from tool_helpers import load_tool

ROOT = Path(__file__).resolve().parents[1]


M = load_tool("mutations", "fibattn_mutations_tool")


@pytest.mark.parametrize("m", M.MUTATIONS, ids=lambda m: m.name)
def test_every_mutation_still_applies(m):
    # a moved file or an edited line would otherwise turn the mutation into a silent no-op
    assert (ROOT / m.file).is_file(), m.file
    assert (ROOT / m.file).read_text().count(m.old) == 1, f"{m.name}: original text not exactly once in {m.file}"
    assert m.old != m.new
    for arg in m.tests:
        if arg.startswith("tests/"):
            assert (ROOT / arg.split("::")[0]).is_file(), arg
    assert M.stale_reason(m) is None


def test_names_are_unique():
    names = [m.name for m in M.MUTATIONS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("fake, why", [
    (dict(file="src/fibattn/no_such_module.py", old="x", new="y"), "does not exist"),
    (dict(file="src/fibattn/schedules.py", old="text that is nowhere in the file", new="y"), "occurs 0 times"),
    (dict(file="src/fibattn/schedules.py", old="import", new="y"), "occurs"),
    (dict(file="src/fibattn/schedules.py", old="        if window < d <= cap:\n", new="z",
          tests=("tests/test_no_such_file.py",)), "test path"),
])
def test_stale_entry_is_reported_by_name_and_fails_the_run(monkeypatch, capsys, fake, why):
    m = M.Mutation(**{"name": "fake-entry", "kind": "test", "tests": ("tests/test_schedules.py",), **fake})
    monkeypatch.setattr(M, "MUTATIONS", [m])
    assert M.main(["--only", "fake-entry"]) == 1          # no pytest run: stale is decided before copying
    out = capsys.readouterr().out
    assert "stale" in out and "fake-entry" in out and why in out
    assert "caught 0/1" in out and "not caught: fake-entry" in out


@pytest.mark.parametrize("rc, tail, verdict", [
    (1, "1 failed, 3 passed in 25.74s", "caught"),
    (1, "1 failed, 2 errors in 3.0s", "caught"),
    (1, "1 error in 1.57s", "ERRORED"),                     # e.g. a fixture that cannot find what it tests
    (0, "4 passed in 2.0s", "SURVIVED"),
    (2, "Interrupted: 1 error during collection", "SURVIVED"),
])
def test_only_a_failing_test_catches_a_mutation(rc, tail, verdict):
    assert M.verdict_of(rc, tail)[0] == verdict


@pytest.fixture
def one_file_copy(monkeypatch):
    """The first entry, copies that hold only its file and its tests' files, and ``pytest_in(fails)``
    installing a fake pytest that fails when ``fails(mutated)`` (the copy holds the replacement)."""
    m = M.MUTATIONS[0]
    calls = []

    def copy(dest):
        for path in (m.file, *(a.split("::")[0] for a in m.tests if a.startswith("tests/"))):
            (dest / path).parent.mkdir(parents=True, exist_ok=True)
            (dest / path).write_text((ROOT / path).read_text())

    def pytest_in(fails):
        def run(tree, cache, tests):
            mutated = m.new in (tree / m.file).read_text()
            calls.append(mutated)
            return (1, "1 failed in 0.1s", 0.0) if fails(mutated) else (0, "3 passed in 0.1s", 0.0)
        monkeypatch.setattr(M, "_pytest", run)
    monkeypatch.setattr(M, "_copy_tree", copy)
    return m, calls, pytest_in


def test_the_selection_runs_unmutated_first(one_file_copy, capsys):
    m, calls, pytest_in = one_file_copy
    pytest_in(lambda mutated: mutated)
    assert M.main(["--only", m.name]) == 0
    assert calls == [False, True]                 # the baseline, then the mutated copy
    out = capsys.readouterr().out
    assert "passes" in out and "caught 1/1" in out


def test_a_selection_that_fails_unmutated_catches_nothing(one_file_copy, capsys):
    m, calls, pytest_in = one_file_copy
    pytest_in(lambda mutated: True)
    assert M.main(["--only", m.name]) == 1
    assert calls == [False]                       # the mutated copy is not run
    out = capsys.readouterr().out
    assert "BASELINE" in out and "fails without the mutation" in out and f"not caught: {m.name}" in out
    calls.clear()
    assert M.main(["--only", m.name, "--no-baseline"]) == 0 and calls == [True]
