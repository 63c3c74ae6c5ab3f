"""Context parallelism (method.md §9): the halo plan, and a sequence split across 2 and 4 gloo
processes giving the one-process loss and gradients — distances reaching past a whole chunk,
learned alpha, packed documents, dense layers."""
import os

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from fibattn.config import ModelConfig
from fibattn.model.lm import FibLM
from fibattn.parallel import ContextShard, halo_plan, ring_rows, sharded
from fibattn.parallel.halo import count, needed

CASES = {   # name: model settings
    "fib-linear": dict(schedule="linear", a_max=1.5),
    "fib-learned": dict(schedule="learned", alpha=1.37),
    "pow2": dict(base="pow2", schedule="fixed", alpha=1.0),
    "dense": dict(attention="dense"),
}


def test_the_halo_is_the_largest_distance_from_the_previous_rank_while_it_fits_a_chunk():
    dists = [0, 1, 2, 3, 5, 8, 13, 21]
    for P, c in ((2, 64), (8, 64), (64, 1 << 14)):
        for r in range(P):
            plan = halo_plan(dists, r, P, c)
            assert plan.rows_received == (0 if r == 0 else 21)
            assert [src for src, _ in plan.recv] == ([r - 1] if r else [])
            assert plan.rows_sent == (21 if r < P - 1 else 0)
    assert ring_rows(8, 1 << 15) == 7 << 15


def test_distances_past_a_chunk_take_only_the_referenced_rows_from_several_ranks():
    plan = halo_plan([0, 1, 40], 3, 4, 16)           # rank 3 starts at 48: rows 47 and 8..24 (from 40)
    assert needed([0, 1, 40], 3, 16) == ((8, 24), (47, 48))
    assert [(src, ivs) for src, ivs in plan.recv] == [(0, ((8, 16),)), (1, ((16, 24),)), (2, ((47, 48),))]
    assert plan.before == 48 - 8
    dense = halo_plan(None, 3, 4, 16)
    assert count(needed(None, 3, 16)) == dense.rows_received == 48 == ring_rows(4, 16)
    # what each rank sends is what the others receive from it
    for P, c, d in ((4, 16, [0, 1, 5, 40]), (3, 10, [0, 7, 25])):
        sent = {(r, dst, ivs) for r in range(P) for dst, ivs in halo_plan(d, r, P, c).send}
        got = {(src, r, ivs) for r in range(P) for src, ivs in halo_plan(d, r, P, c).recv}
        assert sent == got


def test_a_sequence_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="divisible by train.context_parallel"):
        ContextShard(None, (0, 1, 2), 0, 64)


def _model(settings) -> FibLM:
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=64, window=3,
                      base_k=8, backend="cpu", **settings)
    torch.manual_seed(0)
    return FibLM(cfg).double()


def _worker(rank: int, P: int, init: str, documents: bool):
    tdist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=P)
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(1)
        x, y = (torch.randint(0, 64, (2, 64), generator=g) for _ in range(2))
        ids = torch.repeat_interleave(torch.arange(4), torch.tensor([5, 30, 1, 28]))[None].expand(2, 64) \
            if documents else None
        for name, settings in CASES.items():
            model = _model(settings)
            _, want_loss = model(x, y, document_ids=ids)
            want_loss.backward()
            want = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad()
            shard = ContextShard(None, tuple(range(P)), rank, 64, document_ids=ids)
            with sharded(model, shard):
                _, loss = model(shard.local(x), shard.local(y), offset=shard.start)
            loss.backward()
            got_loss = loss.detach().clone()
            tdist.all_reduce(got_loss)
            torch.testing.assert_close(got_loss / P, want_loss.detach(), msg=lambda m: f"{name}: {m}")
            for n, p in model.named_parameters():
                grad = p.grad.clone()
                tdist.all_reduce(grad)
                torch.testing.assert_close(grad / P, want[n], msg=lambda m: f"{name} {n}: {m}")
        # evaluation's window mode (a dense model with a band of its training length, 64): at 128 the band
        # reaches into the previous rank's chunk
        import numpy as np
        from fibattn.eval.perplexity import evaluate
        from fibattn.parallel import ContextGroup
        model = _model(CASES["dense"]).float()
        toks = {"val": np.random.default_rng(0).integers(0, 64, 1025)}
        one = evaluate(model, toks, [64, 128], tokens=512, mode="window")
        cp = evaluate(model, toks, [64, 128], tokens=512, mode="window", context=ContextGroup(None, tuple(range(P)), rank))
        for a, b in zip(one.records, cp.records):
            assert (a.length, a.tokens) == (b.length, b.tokens)
            assert b.nll == pytest.approx(a.nll, rel=1e-5)
    finally:
        tdist.destroy_process_group()


@pytest.mark.parametrize("P,documents", [(2, False), pytest.param(4, True, marks=pytest.mark.slow)])
def test_context_parallel_gives_the_one_process_loss_and_gradients(tmp_path, P, documents):
    """fp64, real processes and collectives. Geometry: P=2 (chunks of 32) takes each halo from the previous
    rank alone, and every earlier row is read by some first tap, so it cannot tell a halo that forgets the
    second taps of interpolated rungs; P=4 (chunks of 16, longer than the window 3, shorter than pow2's 32,
    fib 1.5 x 21 and learned alpha's taps up to 47) takes halos from several ranks and needs each rung's
    second tap. The P=4 geometries (and P=8) run in the default suite without processes:
    tests/test_context_parallel_plan.py."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(P, str(tmp_path / "init"), documents), nprocs=P, join=True)


def test_training_under_torchrun_with_context_parallel_matches_one_process(tmp_path, tiny_data):
    """2 processes, one context group of 2 (each half of every sequence, the tiny preset shrunk, pow2 reaching
    past a chunk): per-step losses and final weights match one process."""
    _train_matches_one_process(tmp_path, tiny_data, 2, 2, base="pow2")


def test_a_context_split_that_does_not_fit_is_refused_before_anything_is_written(tmp_path, tiny_data):
    from fibattn.cli import main as cli_main
    from test_train_ddp import cfg_for
    from fibattn import config as C
    cfg = cfg_for(tmp_path / "unused", tiny_data)
    cfg.train.context_parallel = 3
    C.save(cfg, tmp_path / "cfg.json")
    assert cli_main(["train", "--config", str(tmp_path / "cfg.json"), "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_eval_under_torchrun_with_context_parallel_matches_one_process(tmp_path, tiny_data):
    import json
    import subprocess
    import sys
    from run_helpers import micro_config, write_checkpoint
    from fibattn.cli import main as cli_main
    cfg = micro_config(tmp_path / "run", tiny_data, n_layers=2)
    cfg.model.backend, cfg.model.base = "cpu", "pow2"
    torch.manual_seed(0)
    write_checkpoint(tmp_path / "run", 1, FibLM(cfg.model), cfg)
    args = ["eval", str(tmp_path / "run"), "--lengths", "32,64", "--tokens", "512", "--no-plot", "--db", "off"]
    assert cli_main(args + ["--json", str(tmp_path / "one.json")]) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "fibattn.cli",
           *args, "--json", str(tmp_path / "cp.json"), "--context-parallel", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    one, cp = (json.loads((tmp_path / f).read_text())["results"] for f in ("one.json", "cp.json"))
    assert [(r["length"], r["tokens"]) for r in cp] == [(r["length"], r["tokens"]) for r in one]
    for a, b in zip(one, cp):
        assert b["nll"] == pytest.approx(a["nll"], rel=1e-5)
    assert cli_main(args + ["--context-parallel", "2"]) == 2          # not under torchrun: one line, nothing run


def test_a_world_size_that_is_not_a_multiple_of_the_context_size_is_refused(tiny_data, tmp_path):
    from test_train_ddp import cfg_for
    from fibattn.config import ConfigError
    from fibattn.trainer.batches import build_mesh
    from fibattn.trainer.distributed import DistInfo
    cfg = cfg_for(tmp_path / "unused", tiny_data)
    cfg.train.context_parallel = 4
    with pytest.raises(ConfigError, match=r"train.context_parallel \(4\) must divide the number of processes \(2\)"):
        build_mesh(cfg, DistInfo(rank=0, world_size=2))



def _torchrun(nproc, cfg_path, out, *extra):
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "fibattn.cli", "train", "--config", str(cfg_path), "--out", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _train_matches_one_process(tmp_path, tiny_data, nproc: int, P: int, document_masking=False, **model):
    """Train in one process, then under torchrun with ``nproc`` processes in context groups of ``P``: per-step
    losses and the final weights agree to 1e-5. Returns the config."""
    from safetensors.torch import load_file
    from test_train_ddp import cfg_for, losses
    from fibattn import config as C
    from fibattn.trainer.trainer import train
    cfg = cfg_for(tmp_path / "one", tiny_data)
    for k, v in {"backend": "cpu", **model}.items():
        setattr(cfg.model, k, v)
    cfg.train.document_masking = document_masking
    single = train(cfg)
    cfg.train.context_parallel = P
    C.save(cfg, tmp_path / "cfg.json")
    assert "finished: step 4" in _torchrun(nproc, tmp_path / "cfg.json", tmp_path / "cp")
    assert losses(tmp_path / "cp") == pytest.approx([v for _, v in single.losses], rel=1e-5)
    one = load_file(str(tmp_path / "one" / "checkpoints" / "step-4" / "model.safetensors"))
    cp = load_file(str(tmp_path / "cp" / "checkpoints" / "step-4" / "model.safetensors"))
    for k in one:
        torch.testing.assert_close(cp[k], one[k], rtol=1e-5, atol=1e-5)
    return cfg


@pytest.mark.slow
def test_data_2_by_context_2_with_learned_alpha_and_documents_matches_one_process_and_cp_resumes_bit_exact(
        tmp_path, tiny_data):
    from safetensors.torch import load_file
    from test_train_ddp import losses
    from fibattn import config as C
    cfg = _train_matches_one_process(tmp_path, tiny_data, 4, 2, document_masking=True, schedule="learned")
    # stop and resume bit for bit on all 4 ranks (the gradients' ordered all-reduce: grad_reduce)
    C.save(cfg, tmp_path / "cfg2.json")
    assert "finished: step 4" in _torchrun(4, tmp_path / "cfg2.json", tmp_path / "whole")
    assert "stopped: step 2" in _torchrun(4, tmp_path / "cfg2.json", tmp_path / "resumed", "--stop-at", "2")
    assert "finished: step 4" in _torchrun(4, tmp_path / "cfg2.json", tmp_path / "resumed")
    whole = load_file(str(tmp_path / "whole" / "checkpoints" / "step-4" / "model.safetensors"))
    again = load_file(str(tmp_path / "resumed" / "checkpoints" / "step-4" / "model.safetensors"))
    assert all(torch.equal(again[k], whole[k]) for k in whole)
    assert losses(tmp_path / "resumed") == losses(tmp_path / "whole")


@pytest.mark.slow
def test_context_4_training_under_torchrun_matches_one_process(tmp_path, tiny_data):
    """4 processes, one context group of 4 (chunks of a quarter; pow2 reaches past a chunk): per-step losses and
    final weights match one process."""
    _train_matches_one_process(tmp_path, tiny_data, 4, 4, base="pow2")


@pytest.mark.slow
def test_a_grid_under_torchrun_with_context_parallelism_trains_and_evaluates(tmp_path):
    """The smoke grid's sparse run, its every sequence split over 2 processes: trained, evaluated and recorded
    like a one-process grid; its validation losses are the one-process ones."""
    import json
    import sqlite3
    import subprocess
    import sys
    from fibattn.cli import main as cli_main
    args = ["grid", "smoke", "--only", "fib_stagger", "--set", "model.backend=cpu"]
    assert cli_main(args + ["--root", str(tmp_path / "one")]) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "fibattn.cli",
           *args, "--root", str(tmp_path / "cp"), "--set", "train.context_parallel=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    db = sqlite3.connect(tmp_path / "cp" / "results.sqlite")
    assert db.execute("SELECT name, status FROM runs").fetchall() == [("fib_stagger", "finished")]
    one, cp = (json.loads((tmp_path / r / "fib_stagger" / "eval.json").read_text())["results"] for r in ("one", "cp"))
    assert [(r["length"], r["tokens"]) for r in cp] == [(r["length"], r["tokens"]) for r in one]
    for a, b in zip(one, cp):
        assert b["nll"] == pytest.approx(a["nll"], rel=1e-4)
