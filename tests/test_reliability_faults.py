"""Fault injection: kill -9 mid-checkpoint and mid-training, corrupted files, non-finite
steps, unwritable/full output folders, determinism, and fuzzing of the distance sets.

Micro models only (d_model 32, 1 layer, seq_len 32, CPU, one thread). The kill tests run
``fibattn train`` in a subprocess and send SIGKILL (no handler can run, no cleanup).
"""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from fibattn.storage import checkpoint as ck
from fibattn import config as C
from fibattn.config import ConfigError
from fibattn.data import ShardError, TokenData, verify_prepared
from fibattn.storage.runs import load_run
from fibattn.schedules import attended_distances, interpolation_plan
from fibattn.trainer.trainer import TrainingAborted, train
from run_helpers import micro_config


@pytest.fixture(scope="module")
def data_dir(tiny_data):
    return tiny_data


def micro(out, data_dir, **kw):
    t = dict(steps=6, batch_tokens=64, micro_batch=2, lr=3e-3, warmup_steps=2, log_every=1, ckpt_every=100,
             eval_tokens=64, threads=1, results_db="off")
    return micro_config(out, data_dir, **{**t, **kw})


def final_weights(out, step):
    return load_file(str(Path(out) / "checkpoints" / f"step-{step}" / "model.safetensors"))


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ kill -9 (subprocess)
# The child is ``fibattn train --config ... --resume auto`` with the checkpoint writer's steps
# wrapped (in the child only; fibattn's code is unchanged): at one chosen moment of one
# chosen checkpoint write it announces the moment in a marker file and waits there, so the
# parent's SIGKILL lands inside that write however slow or loaded the machine is.
_CHILD = r"""
import os, sys, time
from pathlib import Path
from fibattn.storage import checkpoint as ck
from fibattn.cli import main

cfg_path, target, phase, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])


def after(fn_name, moment):
    real = getattr(ck, fn_name)

    def hooked(*args, **kwargs):
        out = real(*args, **kwargs)
        at, folder = moment(args, out)
        if at == phase and Path(folder).name == f"step-{target}.tmp":
            Path(str(marker) + ".part").write_text(at)
            os.replace(str(marker) + ".part", marker)
            time.sleep(600)                                  # killed here
        return out
    setattr(ck, fn_name, hooked)


after("begin", lambda a, out: ("begin", out))                # the empty step-N.tmp folder exists
after("write_tensors", lambda a, out: (a[1], a[0]))          # (folder, name, tensors): name "model"
after("write_state", lambda a, out: (a[1], a[0]))            # name "optimizer"
after("fsync_dir", lambda a, out: ("meta", a[0]))            # meta.json written, not yet renamed
sys.exit(main(["train", "--config", cfg_path, "--resume", "auto"]))
"""
PHASES = ("meta", "model", "begin", "optimizer")
# what step-N.tmp holds when the kill lands (beyond the rng/loader states written first)
TMP_HAS = {"begin": set(), "model": {"model.safetensors"},
           "optimizer": {"model.safetensors", "optimizer.json", "optimizer.safetensors"},
           "meta": {"model.safetensors", "optimizer.json", "trainer.json", "config.json", ck.META}}
TMP_LACKS = {"begin": {"model.safetensors"}, "model": {"optimizer.json"}, "optimizer": {ck.META},
             "meta": set()}


def _kill_inside_checkpoint(cfg_path, root: Path, target: int, phase: str, marker: Path, timeout=240.0):
    """Run training until it is inside the ``phase`` moment of step ``target``'s checkpoint
    write, look at the folder, SIGKILL it. Returns (announced moment, checkpoint folder
    listing, step-N.tmp listing), both listings taken while the child was paused there."""
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(cfg_path), str(target), phase, str(marker)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    t0 = time.monotonic()
    try:
        while not marker.exists():
            assert proc.poll() is None, f"training exited ({proc.returncode}) before step {target}'s checkpoint"
            assert time.monotonic() - t0 < timeout, f"step {target}'s checkpoint write not reached in {timeout}s"
            time.sleep(0.01)
        names = set(os.listdir(root))
        tmp_names = set(os.listdir(root / f"step-{target}.tmp"))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return marker.read_text(), names, tmp_names


@pytest.mark.parametrize("rounds", [1, pytest.param(5, marks=pytest.mark.slow)])
def test_kill9_mid_checkpoint_then_resume_is_bit_exact(tmp_path, data_dir, rounds):
    """Each round starts ``fibattn train --resume auto`` in a subprocess (about 10 s of torch
    import on a busy 2-core box) and SIGKILLs it inside a checkpoint write: right after the
    ``step-N.tmp`` folder is created, after the weights, after the optimizer state, or after
    ``meta.json`` (a complete-looking ``.tmp`` folder not yet renamed). One round kills after
    ``meta.json``; five rounds cover every moment and resume over a stale ``.tmp`` folder."""
    steps = 8 + 4 * rounds
    out = tmp_path / "killed"
    cfg = micro(out, data_dir, steps=steps, ckpt_every=1, keep_ckpts=2)
    out.mkdir()
    cfg_path = tmp_path / "cfg.json"
    C.save(cfg, cfg_path)
    rng = random.Random(1234 + rounds)
    root = out / "checkpoints"
    start, inside, resumed_from = 0, [], []
    for r in range(rounds):
        target = min(start + rng.randint(2, 4), steps - 1)
        phase = PHASES[r % len(PHASES)]
        at, names, tmp_names = _kill_inside_checkpoint(cfg_path, root, target, phase, tmp_path / f"paused-{r}")
        # where the kill landed: inside step `target`'s write, at the chosen moment
        assert at == phase
        assert f"step-{target}.tmp" in names and f"step-{target}" not in names and f"step-{target - 1}" in names
        assert TMP_HAS[phase] <= tmp_names and not TMP_LACKS[phase] & tmp_names
        inside.append((target, phase))
        # no cleanup ran: the partial folder is still there, and is never taken for a checkpoint
        assert (root / f"step-{target}.tmp").is_dir() and not (root / f"step-{target}").exists()
        newest = ck.latest_valid(root)
        assert newest == root / f"step-{target - 1}"
        model, got_cfg, tok = load_run(out)                  # the previous checkpoint still loads
        assert got_cfg.train.steps == steps and tok is not None
        resumed_from.append(ck.Checkpoint.open(newest).step)
        start = resumed_from[-1]
        if start >= steps - 2:
            break
    assert len(inside) == len(resumed_from) >= 1
    # --resume auto picks the newest complete checkpoint (stale .tmp folders are ignored) and finishes
    res = train(cfg, resume="auto")
    assert res.status == "finished" and res.step == steps
    assert res.losses and res.losses[0][0] == resumed_from[-1] + 1
    assert not list(root.glob("*.tmp"))                      # the stale folder was replaced by a good save
    clean = train(micro(tmp_path / "clean", data_dir, steps=steps, ckpt_every=1000))
    assert same_weights(final_weights(out, steps), final_weights(tmp_path / "clean", steps))
    assert [v for _, v in res.losses] == [v for _, v in clean.losses[resumed_from[-1]:]]
    print(f"kill -9 inside checkpoint writes (step, moment): {inside}; resumed from steps {resumed_from}")


# ------------------------------------------------------------------ corrupted files
def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage, needle", [
    ("flip-payload", "corrupted"), ("truncate", "truncated"), ("magic", "not a fibattn token shard"),
    ("extend", "too long"), ("flip-header-count", "truncated")])
def test_corrupted_shards_are_named(tmp_path, data_dir, damage, needle):
    import shutil
    d = tmp_path / "d"
    shutil.copytree(data_dir, d)
    shard = d / "train_shakespeare_00000.bin"
    raw = shard.read_bytes()
    if damage == "flip-payload":
        _flip(shard, 64 + 17)
    elif damage == "truncate":
        shard.write_bytes(raw[:-5])
    elif damage == "magic":
        shard.write_bytes(b"NOTTOKEN" + raw[8:])
    elif damage == "extend":
        shard.write_bytes(raw + b"\0\0")
    else:
        _flip(shard, 16 + 3)                  # token count in the header
    with pytest.raises(ShardError, match=needle) as info:
        TokenData(d, verify=True)
        verify_prepared(d)
    assert "train_shakespeare_00000.bin" in str(info.value)
    if damage != "flip-payload":              # header/size damage is caught even without verify
        with pytest.raises(ShardError, match="train_shakespeare_00000.bin"):
            TokenData(d)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete-meta", "delete-file"])
def test_corrupted_checkpoint_is_named_and_resume_falls_back(tmp_path, data_dir, damage):
    out = tmp_path / "r"
    train(micro(out, data_dir, steps=4, ckpt_every=2, keep_ckpts=3))
    bad = out / "checkpoints" / "step-4"
    f = bad / "model.safetensors"
    if damage == "flip":
        _flip(f, f.stat().st_size - 7)
    elif damage == "truncate":
        f.write_bytes(f.read_bytes()[:-3])
    elif damage == "delete-meta":
        (bad / ck.META).unlink()
    else:
        f.unlink()
    needle = ck.META if damage == "delete-meta" else "model.safetensors"
    with pytest.raises(ck.CheckpointError, match=needle):
        load_run(out, step=4)
    with pytest.raises(ck.CheckpointError, match=needle):
        train(micro(out, data_dir, steps=6, ckpt_every=2), resume=str(bad))
    assert ck.Checkpoint.open(ck.latest_valid(out / "checkpoints")).step == 2
    res = train(micro(out, data_dir, steps=6, ckpt_every=2, keep_ckpts=3), resume="auto")
    assert res.losses[0][0] == 3 and res.step == 6


# ------------------------------------------------------------------ non-finite steps
def test_nonfinite_gradients_skip_then_abort_keeps_last_good_checkpoint(tmp_path, data_dir, capsys):
    inf = float("inf")

    def poison_grads(step, loss):
        if step >= 3:
            loss.register_hook(lambda g: g * inf)        # finite loss, non-finite gradients
        return loss
    out = tmp_path / "a"
    with pytest.raises(TrainingAborted, match=r"3 consecutive non-finite steps.*train.max_bad_steps"):
        train(micro(out, data_dir, steps=10, ckpt_every=2, max_bad_steps=3), loss_hook=poison_grads)
    assert "skipped: non-finite" in capsys.readouterr().out
    # step-4 was saved during the bad streak: its weights are step 2's (no update was applied)
    assert [s for s, _ in ck.list_checkpoints(out / "checkpoints")] == [2, 4]
    model, _, _ = load_run(out)
    good = final_weights(out, 2)
    assert all(torch.equal(model.state_dict()[k], good[k]) for k in good)
    assert all(torch.isfinite(v).all() for v in good.values())
    # isolated bad steps (fewer than max_bad_steps in a row) are skipped and the run finishes
    res = train(micro(tmp_path / "b", data_dir, steps=6, max_bad_steps=2),
                loss_hook=lambda s, loss: loss * inf if s in (2, 4) else loss)
    assert res.status == "finished" and res.skipped_steps == 2
    logged = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if r.get("skipped")] == [2, 4]


# ------------------------------------------------------------------ output folder
@pytest.mark.parametrize("where", ["under-file", "proc"])
def test_unwritable_out_dir_detected_before_anything(tmp_path, data_dir, where):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = blocker / "sub" if where == "under-file" else Path("/proc/fibattn-run")   # root cannot write /proc
    if where == "proc" and not Path("/proc").is_dir():
        pytest.skip("no /proc")
    # /proc reports 0 bytes free, so it may be refused as full before the write test: both name the field
    with pytest.raises(ConfigError, match="train.out_dir .* (not writable|is full)"):
        train(micro(out, data_dir))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_full_out_dir_detected_before_training(tmp_path, data_dir, monkeypatch):
    """Simulated: shutil.disk_usage reports 1 KB free (a real full disk is not created)."""
    import shutil

    from fibattn.trainer import setup as T
    monkeypatch.setattr(T.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 ** 9, 10 ** 9 - 1024, 1024))
    called = []
    out = tmp_path / "runs" / "full"
    with pytest.raises(ConfigError, match="train.out_dir .* is full"):
        train(micro(out, data_dir), loss_hook=lambda s, loss: called.append(s) or loss)
    assert called == [] and not out.exists()


# ------------------------------------------------------------------ determinism
def test_same_seed_same_loss_curve(tmp_path, data_dir):
    a = train(micro(tmp_path / "a", data_dir, steps=4))
    b = train(micro(tmp_path / "b", data_dir, steps=4))
    c = train(micro(tmp_path / "c", data_dir, steps=4, seed=7))
    assert [v for _, v in a.losses] == [v for _, v in b.losses]
    assert a.val_loss == b.val_loss
    assert same_weights(final_weights(tmp_path / "a", 4), final_weights(tmp_path / "b", 4))
    assert [v for _, v in a.losses] != [v for _, v in c.losses]


# ------------------------------------------------------------------ fuzzing the distance sets
bases = st.one_of(st.integers(1, 12).map(lambda k: f"fib:{k}"), st.just("pow2"),
                  st.lists(st.integers(1, 200), min_size=1, max_size=8))


@settings(max_examples=200, deadline=None)
@given(window=st.integers(0, 40), alpha=st.floats(0.05, 4.0), base=bases, seq_len=st.integers(1, 300),
       reach=st.none() | st.integers(1, 300))
def test_distance_set_properties(window, alpha, base, seq_len, reach):
    from fibattn.schedules import as_base
    d = attended_distances(window, alpha, base, seq_len, reach=reach)
    cap = min(seq_len, reach or seq_len) - 1
    assert d == sorted(set(d)) and d[0] == 0
    assert d[:min(window, cap) + 1] == list(range(min(window, cap) + 1))
    assert all(0 <= x <= cap for x in d)
    rungs = {round(alpha * b) for b in as_base(base).resolve(seq_len, reach)}
    assert set(d) - set(range(window + 1)) == {x for x in rungs if window < x <= cap}
    plan = interpolation_plan(window, alpha, base, seq_len, reach=reach)
    los = [lo for lo, _ in plan.rungs]
    assert len(los) == len(set(los)) and all(window < lo <= cap for lo in los)
    assert set(plan.window) <= set(plan.entries) and plan.span <= cap + 2
    if float(alpha).is_integer():                    # integer alpha: the plan's rungs are the extra distances
        assert set(los) == set(d) - set(plan.window)


@settings(max_examples=50, deadline=None)
@given(window=st.integers(-5, -1) | st.just(1.5), alpha=st.floats(-2, 0) | st.just(float("nan")))
def test_distance_set_rejects_bad_arguments(window, alpha):
    with pytest.raises(ValueError, match="window"):
        attended_distances(window, 1.0, "fib", 16)
    with pytest.raises(ValueError, match="alpha"):
        attended_distances(4, alpha, "fib", 16)
