"""CPU threads, decided once (issue 60 item 3): a count given is used; the default takes the cores free now,
so that a busy machine does not collapse torch's default of one thread per core; logged once."""
import logging

import pytest
import torch

from fibattn import threads
from fibattn.checks import UsageError


@pytest.fixture(autouse=True)
def restore(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_told", set())
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("usable, busy, processes, cap, want", [
    (2, 0.0, 1, 2, 2),        # idle: torch's default
    (2, 2.0, 1, 2, 1),        # both cores busy: one thread, never zero
    (2, 1.4, 1, 2, 1),        # 0.6 free rounds to 1
    (16, 6.0, 1, 16, 10),     # a shared 16-core machine
    (16, 0.0, 4, 16, 4),      # four processes on the node share the cores
    (64, 0.0, 1, 32, 32),     # never above torch's own default
    (8, 100.0, 8, 8, 1),
])
def test_the_default_takes_the_free_cores(usable, busy, processes, cap, want):
    n, why = threads.default_threads(processes, usable=usable, busy=busy, torch_default=cap)
    assert n == want and f"of {usable} cores free" in why


def test_busy_cores_are_the_machines_load_spread_over_it():
    assert threads.busy_cores(2, load=3.0, machine=2) == 2.0        # more load than cores: all busy
    assert threads.busy_cores(2, load=32.0, machine=64) == 1.0      # a container's 2 cores on a 64-core host
    assert threads.busy_cores(4, load=0.0, machine=4) == 0.0


def test_a_count_given_is_used_and_the_default_is_logged_once(monkeypatch, caplog):
    assert threads.use_threads(1, "--threads") == 1 and torch.get_num_threads() == 1
    monkeypatch.setattr(threads, "default_threads", lambda processes=1: (1, "1 of 2 cores free"))
    with caplog.at_level(logging.INFO, logger="fibattn"):
        for _ in range(3):
            assert threads.use_threads(0, "train.threads") == 1
    said = [r.getMessage() for r in caplog.records if "auto ->" in r.getMessage()]
    assert said == ["fibattn: train.threads auto -> 1 CPU thread (1 of 2 cores free; torch's default "
                    f"{threads.TORCH_DEFAULT}; train.threads=N chooses)"]
    for bad in (-1, 1.5, True, "2", threads.MAX_THREADS + 1):
        with pytest.raises(UsageError, match=f"train.threads must be an integer from 0 to {threads.MAX_THREADS}"):
            threads.use_threads(bad, "train.threads")


def test_omp_num_threads_set_by_the_user_is_respected(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    n, why = threads.default_threads(1)
    assert n == max(1, threads.TORCH_DEFAULT) and "OMP_NUM_THREADS=3" in why


def test_bench_train_times_the_default_beside_a_chosen_count(monkeypatch, capsys):
    """``--threads 0,1``: each count's rows in turn, labelled with the count asked and the count used."""
    import json
    from fibattn.bench import train as bt
    from fibattn.cli import main
    seen = []

    def fake_bench(lengths, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return [{"length": T, "batch": 1, "dense_tok_s": 100.0 * seen[-1], "sparse_tok_s": 150.0 * seen[-1],
                 "ratio": 1.5} for T in lengths]
    monkeypatch.setattr(bt, "bench", fake_bench)
    monkeypatch.setattr(threads, "default_threads", lambda processes=1: (2, "2 of 2 cores free"))
    assert main(["bench", "train", "--lengths", "64", "--threads", "0,1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert seen == [2, 1] and doc["threads_asked"] == [0, 1] and doc["threads"] == [1, 2]
    assert [(r["threads_asked"], r["threads"]) for r in doc["rows"]] == [(0, 2), (1, 1)]
    assert bt.thread_summary(doc["rows"], [0, 1]).splitlines()[1] == "  T=64: 1 thread: dense 0.50x, sparse 0.50x"
    assert main(["bench", "train", "--threads", "1,1"]) == 2 and "twice" in capsys.readouterr().err


def test_a_resume_with_threads_auto_keeps_the_count_the_checkpoint_was_written_with():
    """PyTorch's CPU reductions split by thread: a resume is bit for bit only on the run's own count, so with
    train.threads auto the checkpoint's count is taken back; a count given, a GPU run or an older checkpoint (no
    count) keep today's choice."""
    import types

    from fibattn.config import TrainConfig
    from fibattn.trainer.setup import keep_threads
    cpu = types.SimpleNamespace(device=torch.device("cpu"), is_main=True)
    torch.set_num_threads(1)
    keep_threads(TrainConfig(threads=0), 2, cpu)
    assert torch.get_num_threads() == 2
    for t, saved, dist in ((TrainConfig(threads=1), 3, cpu), (TrainConfig(threads=0), None, cpu),
                           (TrainConfig(threads=0), True, cpu), (TrainConfig(threads=0), 10 ** 9, cpu),
                           (TrainConfig(threads=0), 3, types.SimpleNamespace(device=torch.device("cuda"),
                                                                             is_main=True))):
        torch.set_num_threads(1)
        keep_threads(t, saved, dist)
        assert torch.get_num_threads() == 1, (t.threads, saved)
