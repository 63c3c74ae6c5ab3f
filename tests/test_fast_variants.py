"""Default-suite variants of behaviours otherwise checked only by tests marked ``slow`` (docs/testing.md lists
every slow test with its variant here or elsewhere, or why it stays slow). Each variant keeps the behaviour and
drops what made its test slow: processes, inductor's code generation, training."""
from __future__ import annotations

import os
import signal

import pytest
import torch

from fibattn.trainer import distributed as D


# ------------------------------------------------------------------ compile (test_activation_checkpointing, test_compile)
def test_learned_alpha_with_full_checkpointing_traces_as_one_graph_with_the_eager_values():
    """For the slow inductor runs (test_compiled_fullgraph_with_full_matches_eager and the learned case of
    test_fullgraph_compiled_fiblm_matches_eager): dynamo captures the learned-alpha model with full
    activation checkpointing as one graph (fullgraph, so no break), each block half as dynamo's checkpoint
    operator, and the captured graph run eagerly gives eager's loss and gradients, alpha's included. Only
    inductor's code generation is left to the slow tests."""
    from torch._dynamo.testing import EagerAndRecordGraphs
    from test_activation_checkpointing import _loss_and_grads, _model
    model = _model("learned")
    want_loss, want = _loss_and_grads(model, model.set_activation_checkpointing("none"))
    model.set_activation_checkpointing("full")
    torch._dynamo.reset()
    rec = EagerAndRecordGraphs()
    try:
        got_loss, got = _loss_and_grads(torch.compile(model, backend=rec, fullgraph=True), model)
    finally:
        torch._dynamo.reset()
    code = "\n".join(g.code for g in rec.graphs)
    assert len(rec.graphs) == 1 and code.count("higher_order.tag_activation_checkpoint(") == 4    # 2 blocks x 2
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7)
    assert all(got[k].abs().item() > 0 for k in got if "alphas" in k)


# ------------------------------------------------------------------ ranks agreeing (test_reliability_writers, test_train_ddp)
def _ranks_in_turn(monkeypatch, refusals: dict):
    """Run a ``together`` block as each rank of 2, rank by rank; ``refusals`` rank -> the error it raises.
    The gather every rank makes is served from the one-line texts of the refusals."""
    said = {r: D._one_line(e) for r, e in refusals.items()}
    monkeypatch.setattr(D, "gather_text", lambda info, text: [said.get(r, "") if r != info.rank else text
                                                             for r in range(info.world_size)])
    out = {}
    for rank in range(2):
        try:
            with D.together(D.DistInfo(rank, 2), "reading the data"):
                if rank in refusals:
                    raise refusals[rank]
            out[rank] = None
        except Exception as exc:          # noqa: BLE001 - what each rank would stop with
            out[rank] = exc
    return out


def test_one_ranks_refusal_reaches_every_rank_as_its_line(monkeypatch):
    """For test_together_passes_one_ranks_refusal_to_every_rank and test_one_ranks_refusal_reads_as_one_line
    (gloo processes): the refusing rank keeps its own error; the other stops with a RankError naming that
    rank, what was being done and the cause, in one line; nobody refusing, nobody stops."""
    err = ValueError("shard /x/train_a_00000.bin does not match\nthe manifest")
    out = _ranks_in_turn(monkeypatch, {1: err})
    assert out[1] is err
    assert isinstance(out[0], D.RankError) and "\n" not in str(out[0])
    assert str(out[0]).startswith("rank 1 of 2 refused while reading the data, so rank 0 stops too: shard "
                                  "/x/train_a_00000.bin does not match the manifest")
    both = _ranks_in_turn(monkeypatch, {0: KeyError("a"), 1: ValueError("b")})
    assert isinstance(both[0], KeyError) and isinstance(both[1], ValueError)       # each its own
    assert _ranks_in_turn(monkeypatch, {}) == {0: None, 1: None}


class FakeStore:
    """torchrun's agent store as the ranks of one job share it (a dict); ``on_check`` runs at each poll."""

    data: dict = {}
    on_check = None

    def __init__(self, *args, **kwargs):
        pass

    def set(self, key, value):
        FakeStore.data[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys):
        if FakeStore.on_check is not None:
            FakeStore.on_check()
        return all(k in FakeStore.data for k in keys)

    def get(self, key):
        return FakeStore.data[key]


@pytest.fixture
def torchrun_env(monkeypatch):
    monkeypatch.setattr(D.tdist, "TCPStore", FakeStore)
    monkeypatch.setattr(FakeStore, "data", {})
    monkeypatch.setattr(FakeStore, "on_check", None)
    for k, v in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999",
                 "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "t"}.items():
        monkeypatch.setenv(k, v)

    def as_rank(rank):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
    return as_rank


def test_a_rank_that_refuses_before_the_process_group_is_named_by_the_other(torchrun_env, monkeypatch):
    """For test_a_rank_that_refuses_before_the_process_group_is_named_by_every_rank (torchrun): before the
    process group, a refusal goes through torchrun's store; the refusing rank raises its own error, the
    waiting one a RankError naming the rank and the cause. Both pass the same starting() blocks in order."""
    monkeypatch.setattr(D, "_rounds", iter(range(100)))
    torchrun_env(1)
    with pytest.raises(ValueError, match="train.lr"):
        with D.starting():
            raise ValueError("train.lr must be > 0, got -1")
    monkeypatch.setattr(D, "_rounds", iter(range(100)))      # rank 0 is another process: its own count
    torchrun_env(0)
    with pytest.raises(D.RankError, match=r"^rank 1 of 2 refused before training started, so rank 0 stops too: "
                                          r"train.lr must be > 0, got -1$"):
        with D.starting():
            pass


def test_a_rank_torchrun_stops_while_it_waits_says_so_in_one_line(torchrun_env, monkeypatch):
    """For test_a_rank_that_dies_before_the_process_group_is_reported_by_the_others: while rank 0 waits for
    a rank that never reports, torchrun's SIGTERM (sent here by the store's poll) becomes one line; the
    handler that was there before is put back."""
    monkeypatch.setattr(D, "_rounds", iter(range(100)))
    torchrun_env(0)
    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(FakeStore, "on_check", lambda: os.kill(os.getpid(), signal.SIGTERM))
    with pytest.raises(D.RankError, match="^rank 0 of 2 stops: torchrun stopped it because another process"):
        with D.starting():
            pass
    assert signal.getsignal(signal.SIGTERM) is before


# ------------------------------------------------------------------ exports (test_window_controls)
def test_a_window_only_model_exports_and_loads_in_transformers_with_its_logits(tmp_path):
    """For test_export_and_transformers_drop_in_round_trip (which trains first): base none, exported in
    fibattn's format (its card says sliding window) and as transformers remote code, gives the same logits
    past the training length from both, and attends the window alone at any length."""
    pytest.importorskip("transformers")
    import fibattn
    from fibattn.interop import hf_llama as H
    from fibattn.interop.hf_export import export_hf
    from fibattn.model.lm import FibLM
    from fibattn.storage.export import export_run
    from run_helpers import micro_config, write_checkpoint
    cfg = micro_config(tmp_path / "run", tmp_path / "data", n_layers=2)
    cfg.model.base, cfg.model.schedule = "none", "fixed"
    torch.manual_seed(0)
    write_checkpoint(tmp_path / "run", 1, FibLM(cfg.model), cfg)
    out = export_run(tmp_path / "run", tmp_path / "exp")
    assert f"sliding window only (no rungs, base `none`): each query attends distances 0..{cfg.model.window}" in \
        (out / "README.md").read_text()
    model = fibattn.from_pretrained(out)
    x = torch.randint(0, 256, (1, 45), generator=torch.Generator().manual_seed(2))     # 45 > seq_len 32
    assert all(d == list(range(cfg.model.window + 1)) for d in model.distances(45))
    with torch.no_grad():
        want = model(x)
        got = H.from_pretrained(export_hf(tmp_path / "run", tmp_path / "hf")).eval()(x).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ worker processes (test_probe)
def test_probe_results_finishing_in_any_order_are_reported_in_order(monkeypatch):
    """For test_probe_in_worker_processes (a pool of 2 spawned workers): with ``jobs=2`` every (depth, start)
    model is handed to the pool once, and results arriving in the reverse order (the longest depth runs
    first, so it may well finish last) are reported in (depth, start) order. The pool itself stays slow."""
    from fibattn.study import probe as P
    from fibattn.study.probe_task import ProbeTask
    handed = []

    def pool(fn, todo, jobs, on_result):
        handed.append((jobs, [(d, s) for _, d, s in todo]))
        for args in reversed(todo):
            on_result(fn(*args))
    monkeypatch.setattr(P, "run_jobs", pool)
    monkeypatch.setattr(P, "train_one", lambda cfg, d, s: P.ProbeResult(d, s, {6: 1.0}, [1.0], [1.0], [], 0.0, 0.0))
    cfg = P.ProbeConfig(task=ProbeTask(seq_len=24, distances=(6, 9), n_distractors=2), depths=(1, 2, 3), steps=2,
                        batch_size=4, eval_samples=8, warmup=1)
    report = P.run_probe(cfg, None, echo=lambda s: None, jobs=2)
    want = [(d, s) for d in (1, 2, 3) for s in ("uniform", "staggered")]
    assert [(r.depth, r.start) for r in report.results] == want
    assert handed[0][0] == 2 and sorted(handed[0][1]) == sorted(want)


# ------------------------------------------------------------------ the CLI (test_context_parallel)
def test_eval_with_context_parallelism_outside_torchrun_is_one_line(tmp_path, capsys, monkeypatch):
    """For the end of test_eval_under_torchrun_with_context_parallel_matches_one_process: ``eval
    --context-parallel 2`` in one process is refused in one line naming the flag and torchrun, exit 2,
    nothing evaluated or written."""
    from fibattn.cli import main as cli_main
    from fibattn.model.lm import FibLM
    from run_helpers import micro_config, write_checkpoint
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    cfg = micro_config(tmp_path / "run", tmp_path / "data")
    torch.manual_seed(0)
    write_checkpoint(tmp_path / "run", 1, FibLM(cfg.model), cfg)
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert cli_main(["eval", str(tmp_path / "run"), "--context-parallel", "2", "--db", "off", "--no-plot"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "--context-parallel 2" in err[0] and "torchrun" in err[0], err
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before
