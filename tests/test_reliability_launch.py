"""A half-set torchrun environment (issue 58, kind 9): torchrun's variables set by hand with some missing,
not integers or out of range are refused in one line naming the variable, by every command that reads them
(:func:`fibattn.launch.launch`), before anything is written or any rendezvous is waited for."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fibattn.launch import NEEDED, PLACE, RENDEZVOUS, Launch, LaunchError, launch

from storage_helpers import run_cli

ALL = PLACE + RENDEZVOUS
_VALUES = st.sampled_from(["0", "1", "2", "3", "-1", "x", "", " ", "65536", "29500", "localhost"])


@settings(max_examples=300, deadline=None)
@given(env=st.dictionaries(st.sampled_from(ALL), _VALUES))
def test_any_torchrun_environment_is_a_place_or_one_line_naming_a_variable(env):
    try:
        place = launch(env)
    except LaunchError as exc:
        text = str(exc)
        assert "\n" not in text and any(f"variable {name} " in text for name in ALL), text
        return
    given_place = [n for n in PLACE if env.get(n, "").strip()]
    if not given_place:
        assert place == Launch()
        return
    assert all(env.get(n, "").strip() for n in NEEDED)
    assert 0 <= place.rank < place.world_size and 0 <= place.local_rank < place.local_world_size <= place.world_size
    if place.world_size > 1:
        assert env["MASTER_ADDR"].strip() and 1 <= int(env["MASTER_PORT"]) <= 65535


@pytest.mark.parametrize("env, name", [
    ({"RANK": "0"}, "WORLD_SIZE"),
    ({"WORLD_SIZE": "2"}, "RANK"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, "LOCAL_RANK"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "MASTER_ADDR"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT"),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK"),
    ({"RANK": "a", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "http"}, "MASTER_PORT"),
])
def test_train_refuses_a_half_set_environment_naming_the_variable(env, name, tmp_path, capsys, monkeypatch):
    for var in ALL:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    out = tmp_path / "run"
    rc, _, err = run_cli(capsys, ["train", "--preset", "tiny", "--out", out, "--set", "train.steps=1"])
    assert rc == 2 and len(err) == 1 and "Traceback" not in err[0] and f"variable {name} " in err[0], err
    assert not out.exists()


def test_every_reader_of_the_environment_refuses_it_alike(monkeypatch):
    """Context-parallel evaluation's group and the grid's main-rank test read the same place."""
    from fibattn.parallel.context import joined
    from fibattn.study.runner import is_main_rank
    for var in ALL:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(LaunchError, match="variable RANK is not set, but WORLD_SIZE is"):
        with joined(2):
            pass
    with pytest.raises(LaunchError, match="variable RANK is not set"):
        is_main_rank()
    monkeypatch.delenv("WORLD_SIZE")
    assert is_main_rank() and launch() == Launch()
