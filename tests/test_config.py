import json

import pytest

from fibattn import config as C
from fibattn.config_files import load
from fibattn.presets import get_preset, paper, tiny
from fibattn.validation import validate


def test_presets_validate_and_roundtrip(tmp_path):
    for cfg in (paper(), tiny()):
        validate(cfg)
        path = tmp_path / f"{cfg.name}.json"
        C.save(cfg, path)
        assert C.to_dict(load(path)) == C.to_dict(cfg)


def test_overrides_typed():
    cfg = tiny()
    C.apply_overrides(cfg, ["model.window=8", "train.lr=1e-3", "train.compile=true", "model.alphas=0.5,1.0",
                            "model.schedule=coprime", "eval.lengths=[256,512]"])
    assert cfg.model.window == 8 and cfg.train.lr == 1e-3 and cfg.train.compile == "true"
    assert cfg.model.alphas == [0.5, 1.0] and cfg.model.schedule == "coprime" and cfg.eval.lengths == [256, 512]


@pytest.mark.parametrize("item, needle", [
    ("model.windw=3", "model.windw"),
    ("nope.x=1", "nope.x"),
    ("model.window=abc", "model.window"),
    ("model=3", "section"),
    ("train.compile=maybe", "train.compile must be one of auto, true, false"),
    ("novalue", "section.field=value"),
])
def test_bad_overrides(item, needle):
    with pytest.raises(C.ConfigError, match=needle.replace(".", r"\.")):
        C.apply_overrides(tiny(), [item])


@pytest.mark.parametrize("item, needle", [
    ("model.window=-1", "model.window"),
    ("model.n_heads=3", "model.n_heads"),
    ("model.n_kv_heads=3", "model.n_kv_heads"),
    ("model.schedule=zigzag", "model.schedule"),
    ("model.base=pow3", "model.base"),
    ("model.a_min=2.0", "model.a_min"),
    ("model.alpha=3.0", "model.alpha"),
    ("model.base=custom", "model.base_values"),
    ("model.seq_len=0", "model.seq_len"),
    ("train.lr=0", "train.lr"),
    ("train.micro_batch=-1", "train.micro_batch"),
    ("train.batch_tokens=1000", "train.batch_tokens"),
    ("train.device=tpu", "train.device"),
    ("train.precision=fp8", "train.precision"),
    ("data.tokenizer=sentencepiece", "data.tokenizer"),
    ("data.val_fraction=0.9", "data.val_fraction"),
    ("eval.lengths=[0]", "eval.lengths"),
])
def test_validation_names_the_field(item, needle):
    """Refused by --set itself (a value outside a closed set) or by validation (ranges, combinations)."""
    with pytest.raises(C.ConfigError, match=needle.replace(".", r"\.")):
        validate(C.apply_overrides(tiny(), [item]))


def test_unknown_key_in_file():
    data = C.to_dict(tiny())
    data["train"]["lrr"] = 1
    with pytest.raises(C.ConfigError, match="train.lrr"):
        C.from_dict(json.loads(json.dumps(data)))


def test_unknown_preset():
    with pytest.raises(C.ConfigError, match="--preset"):
        get_preset("huge")
