"""Logs go to stderr and text to stdout, the notes before the text (issue 28 item 6: on a terminal
a log line once landed inside generated text, ``This program is free software; fibattn: backend
auto -> cpu on cpu``: the prefill's note was logged after the prompt was printed)."""
import json
import logging
import subprocess
import sys

import pytest
import torch

from fibattn.cli import main
from fibattn.model.lm import FibLM
from fibattn.generation.decode import DecodeSession

from run_helpers import micro_config, write_checkpoint

PROMPT = "This program is free software;"


class Tag:
    """A stream that records each write with its stream's name, in order."""

    def __init__(self, name, events):
        self.name, self.events = name, events

    def write(self, s):
        self.events.append((self.name, s))
        return len(s)

    def flush(self):
        pass


def _run_folder(tmp_path, backend="auto"):
    cfg = micro_config(tmp_path / "run", tmp_path / "data")
    cfg.model.backend = backend                # auto logs "backend auto -> ..." at the first forward (the prefill)
    torch.manual_seed(0)
    write_checkpoint(tmp_path / "run", 1, FibLM(cfg.model), cfg)
    return ["generate", str(tmp_path / "run"), "--prompt", PROMPT, "--max-new-tokens", "12", "--temperature", "0",
            "--device", "cpu"]


def _check_order(events, stdout: str, stderr: str, note: str = "backend auto -> ") -> None:
    kinds = [k for k, s in events if s]
    first, last = kinds.index("out"), len(kinds) - 1 - kinds[::-1].index("out")
    assert set(kinds[first:last + 1]) == {"out"}          # no stderr write between the first and last text
    assert "".join(s for k, s in events if k == "out") == stdout
    assert "".join(s for k, s in events if k == "err") == stderr
    assert note in "".join(s for _, s in events[:first])                  # the prefill's note came first
    assert stdout.startswith(PROMPT) and stdout.endswith("\n") and "fibattn" not in stdout
    assert "tok/s" in stderr


def test_generate_notes_go_to_stderr_before_the_text(tmp_path, monkeypatch, one_thread):
    argv = _run_folder(tmp_path, backend="torch")     # no kernel build; the prefill logs a note instead
    prefill = DecodeSession.prefill

    def noisy_prefill(self, *a, **kw):
        logging.getLogger("fibattn").info("fibattn: a note from the prefill")
        return prefill(self, *a, **kw)

    monkeypatch.setattr(DecodeSession, "prefill", noisy_prefill)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])             # main() then sets up its own stderr logging
    monkeypatch.setattr(root, "level", root.level)
    events = []
    monkeypatch.setattr(sys, "stdout", Tag("out", events))
    monkeypatch.setattr(sys, "stderr", Tag("err", events))
    assert main(argv) == 0
    monkeypatch.undo()
    _check_order(events, "".join(s for k, s in events if k == "out"), "".join(s for k, s in events if k == "err"),
                 note="a note from the prefill")


# records every write with its stream, in order, and passes it on to the real stream
TAGGED = """
import json, sys
events = []
class Tag:
    def __init__(self, name, real):
        self.name, self.real = name, real
    def write(self, s):
        events.append((self.name, s)); return self.real.write(s)
    def flush(self):
        self.real.flush()
    def __getattr__(self, name):
        return getattr(self.real, name)
sys.stdout, sys.stderr = Tag("out", sys.stdout), Tag("err", sys.stderr)
from fibattn.cli import main
code = main(sys.argv[2:])
json.dump([code, events], open(sys.argv[1], "w"))
"""


@pytest.mark.slow
def test_generate_streams_apart_in_a_fresh_process(tmp_path):
    """The same in a fresh process with stdout and stderr captured apart (the real file descriptors)."""
    argv = _run_folder(tmp_path)
    done = subprocess.run([sys.executable, "-c", TAGGED, str(tmp_path / "events.json"), *argv, "--threads", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    code, events = json.loads((tmp_path / "events.json").read_text())
    assert code == 0
    _check_order(events, done.stdout, done.stderr)
