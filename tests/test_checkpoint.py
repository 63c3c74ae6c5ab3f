import json
import logging
import random

import numpy as np
import pytest
import torch

from fibattn.storage import checkpoint as ck


def make(root, step, payload=1.0):
    tmp = ck.begin(root, step)
    ck.write_tensors(tmp, "model", {"w": torch.full((4, 4), payload)})
    ck.write_state(tmp, "trainer", {"step": step, "note": "x"})
    return ck.finish(root, step)


def test_codec_roundtrip_optimizer_and_rng():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.95))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = {"opt": opt.state_dict(), "np": np.random.get_state(), "py": random.getstate(),
             "torch": torch.get_rng_state(), "misc": {1: (2, [3.5, None]), "s": "t"}}
    js, st = ck.encode_state(state)
    assert b"pickle" not in js
    back = ck.decode_state(js, st)
    assert back["opt"]["param_groups"][0]["betas"] == (0.9, 0.95)
    torch.testing.assert_close(back["opt"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert back["misc"] == {1: (2, [3.5, None]), "s": "t"}
    np.random.set_state(back["np"])
    random.setstate(back["py"])
    torch.set_rng_state(back["torch"])
    opt2 = torch.optim.AdamW(model.parameters())
    opt2.load_state_dict(back["opt"])
    with pytest.raises(TypeError, match="cannot store"):
        ck.encode_state({"f": object()})


def test_write_verify_and_read(tmp_path):
    path = make(tmp_path, 5, 2.0)
    assert path.name == "step-5" and not (tmp_path / "step-5.tmp").exists()
    c = ck.Checkpoint.open(path)
    assert c.step == 5 and c.has("trainer") and not c.has("optimizer")
    torch.testing.assert_close(c.tensors("model")["w"], torch.full((4, 4), 2.0))
    assert c.state("trainer") == {"step": 5, "note": "x"}
    assert set(json.loads((path / "meta.json").read_text())["files"]) == {"model.safetensors", "trainer.json"}


@pytest.mark.parametrize("damage, needle", [
    ("truncate", "model.safetensors is truncated"),
    ("flip", "model.safetensors is corrupted"),
    ("delete", "model.safetensors is missing"),
    ("meta", "incomplete"),
])
def test_damage_is_detected_and_named(tmp_path, damage, needle):
    path = make(tmp_path, 3)
    f = path / "model.safetensors"
    data = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(data[:-10])
    elif damage == "flip":
        f.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "delete":
        f.unlink()
    else:
        (path / "meta.json").unlink()
    with pytest.raises(ck.CheckpointError, match=needle):
        ck.verify(path)


def test_latest_valid_skips_bad_and_prune(tmp_path, caplog):
    for s in (1, 2, 3):
        make(tmp_path, s, float(s))
    (tmp_path / "step-4.tmp").mkdir()                   # an interrupted save is never listed
    f = tmp_path / "step-3" / "trainer.json"
    f.write_text(f.read_text().replace("x", "y"))
    with caplog.at_level(logging.WARNING, logger="fibattn"):
        assert ck.latest_valid(tmp_path).name == "step-2"
    assert "step-3" in caplog.text and "trainer.json" in caplog.text
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [1, 2, 3]
    ck.prune(tmp_path, 2)
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [2, 3]
    ck.clean_tmp(tmp_path)
    assert not (tmp_path / "step-4.tmp").exists()
    assert ck.latest_valid(tmp_path / "nothing") is None


def test_begin_replaces_a_stale_tmp_folder(tmp_path):
    # a save interrupted in this process (no resume ran clean_tmp) must not block or leak into the next one
    stale = tmp_path / "step-3.tmp"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half a file")
    tmp = ck.begin(tmp_path, 3)
    assert tmp == stale and list(tmp.iterdir()) == []
