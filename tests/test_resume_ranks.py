"""Resuming a data-parallel run on every rank, without processes: a checkpoint holding two ranks' states
(written by ``state.save`` for rank 1, then rank 0, in one process) is restored with a fake rank and world
size. Same world size: each rank continues with its own loader cursor and its own RNG streams. Another world
size or micro-batch: the ranks' next batches, together, are the uninterrupted run's next global batches.
(The torchrun tests in test_train_ddp.py check the same end to end, marked slow.)"""
from __future__ import annotations

import contextlib
import random

import numpy as np
import pytest
import torch

from fibattn.data import TokenData
from fibattn.model.lm import FibLM
from fibattn.storage import checkpoint as ck
from fibattn.trainer import state as S
from fibattn.trainer.distributed import DistInfo
from run_helpers import micro_config

SEQ, SEED, STEPS = 32, 3, 3
TRAINER = {"tokens": 0, "skipped": 0, "bad": 0, "elapsed": 0.0}


@pytest.fixture(scope="module")
def data(tiny_data):
    return TokenData(tiny_data)


def loaders(data, world: int, micro: int):
    return [data.train_loader(SEQ, micro, seed=SEED, rank=r, world_size=world) for r in range(world)]


def rows(x) -> list:
    return sorted(tuple(r) for r in x.tolist())          # a list: a batch read twice would show


def _seed_all(n: int) -> None:
    torch.manual_seed(n)
    np.random.seed(n)
    random.seed(n)


def _draws() -> tuple:
    return torch.rand(4).tolist(), np.random.rand(4).tolist(), [random.random() for _ in range(4)]


def _model_and_opt(cfg):
    torch.manual_seed(0)
    model = FibLM(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, [n for n, _ in model.named_parameters()]


@pytest.fixture
def two_rank_checkpoint(tmp_path, data, monkeypatch):
    """``(path, ranks' loaders continued past the save, ranks' RNG draws right after the save)`` of a
    checkpoint at an optimiser-step boundary (after 3 steps) of a world of 2 ranks of micro-batch 2, written
    as ``state.save`` writes it on each rank (rank 1's files first, rank 0 finishing the folder)."""
    cfg = micro_config(tmp_path / "run", data.path)
    model, opt, names = _model_and_opt(cfg)
    ranks = loaders(data, 2, 2)
    for _ in range(STEPS):
        for ld in ranks:
            ld.next()
    monkeypatch.setattr(S, "together", lambda *a, **k: contextlib.nullcontext())    # no collectives
    ck.begin(ck.ckpt_root(tmp_path / "run"), STEPS)
    monkeypatch.setattr(ck, "begin", lambda root, step: None)                         # rank 0 keeps rank 1's files
    draws = {}
    for rank in (1, 0):
        _seed_all(100 + rank)                            # each rank's own random streams
        before = (torch.get_rng_state(), np.random.get_state(), random.getstate())
        draws[rank] = _draws()
        torch.set_rng_state(before[0])
        np.random.set_state(before[1])
        random.setstate(before[2])
        path = S.save(tmp_path / "run", STEPS, model=model, optimizer=opt, names=names, loader=ranks[rank],
                      trainer=TRAINER, cfg=cfg, dist=DistInfo(rank=rank, world_size=2), keep=3)
    monkeypatch.undo()
    assert {f"loader-rank{r}.json" for r in (0, 1)} <= set(ck.verify(path)["files"])
    return path, ranks, draws, cfg


def _restore(path, cfg, loader, rank: int, world: int):
    model, opt, names = _model_and_opt(cfg)
    _seed_all(999)                                       # whatever a fresh process starts with
    S.restore(path, model=model, optimizer=opt, names=names, loader=loader, dist=DistInfo(rank=rank, world_size=world))


def test_each_rank_resumes_with_its_own_cursor_and_random_state(two_rank_checkpoint, data):
    path, ranks, draws, cfg = two_rank_checkpoint
    assert draws[0] != draws[1]
    for rank in (1, 0):
        fresh = data.train_loader(SEQ, 2, seed=SEED, rank=rank, world_size=2)
        _restore(path, cfg, fresh, rank, 2)
        assert _draws() == draws[rank], f"rank {rank} resumed another rank's random state"
        assert fresh.cursor == ranks[rank].cursor
        for _ in range(2):
            x, y = fresh.next()
            want_x, want_y = ranks[rank].next()
            assert torch.equal(x, want_x) and torch.equal(y, want_y), f"rank {rank} read another rank's batch"


@pytest.mark.parametrize("world, micro", [(4, 1), (1, 4), (2, 1), (4, 2)])
def test_resharded_ranks_together_read_the_uninterrupted_runs_batches(two_rank_checkpoint, data, world, micro):
    """The checkpoint's run (2 ranks x micro-batch 2: 4 sequences a step) resumed on ``world`` ranks of
    ``micro`` sequences: a step takes ``4 / (world * micro)`` micro-batches of accumulation on each rank (or
    ``world * micro / 4`` steps' worth in one, when larger), and every rank, rank > 0 included, continues from
    the global position."""
    path, ranks, _, cfg = two_rank_checkpoint
    per_step = 4
    fresh = []
    for rank in range(world):
        ld = data.train_loader(SEQ, micro, seed=SEED, rank=rank, world_size=world)
        _restore(path, cfg, ld, rank, world)
        fresh.append(ld)
    calls = max(1, per_step // (world * micro))           # micro-batches per rank per optimiser step
    steps = max(1, world * micro // per_step)             # uninterrupted steps that one round covers
    for _ in range(2):
        got = rows(torch.cat([ld.next()[0] for _ in range(calls) for ld in fresh]))
        want = rows(torch.cat([ld.next()[0] for _ in range(steps) for ld in ranks]))
        assert got == want


def test_a_rank_the_checkpoint_does_not_have_resumes_from_the_global_position(two_rank_checkpoint, data):
    """Rank 3 of 4: the checkpoint has no loader-rank3; its first batch is sequence ``next_global + 3``."""
    path, ranks, _, cfg = two_rank_checkpoint
    ld = data.train_loader(SEQ, 1, seed=SEED, rank=3, world_size=4)
    _restore(path, cfg, ld, 3, 4)
    g = ranks[0].state_dict()["next_global"]
    assert g == STEPS * 4
    assert torch.equal(ld.next()[0], torch.from_numpy(ld.sequences([g + 3])[:, :-1]))
