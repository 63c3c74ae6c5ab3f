"""Shared by the training tests: the smallest run configuration that trains in seconds."""
from fibattn.config import RunConfig, TrainConfig
from fibattn.presets import tiny


def micro_config(out, data_dir, *, n_layers: int = 1, **train) -> RunConfig:
    """The ``tiny`` preset shrunk to d_model 32, 2 query / 1 key-value heads, T=32, W=4, fib:6,
    on the ``torch`` backend; ``train`` sets :class:`TrainConfig` fields."""
    cfg = tiny()
    m = cfg.model
    m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.seq_len, m.window, m.base_k = 32, n_layers, 2, 1, 32, 4, 6
    m.backend = "torch"
    cfg.data.out_dir = str(data_dir)
    cfg.train = TrainConfig(out_dir=str(out), **train)
    return cfg


def write_checkpoint(run, step: int, model, cfg, *, tokenizer: bool = True):
    """A verified ``RUN/checkpoints/step-N`` of ``model`` (weights only) with ``cfg`` as its config and,
    with ``tokenizer``, a byte tokenizer: a run folder without training."""
    import json
    from fibattn.config import to_dict
    from fibattn.data.tokenizers import ByteTokenizer
    from fibattn.storage import checkpoint as ck
    root = ck.ckpt_root(run)
    tmp = ck.begin(root, step)
    ck.write_tensors(tmp, "model", model.state_dict())
    (tmp / "config.json").write_text(json.dumps(to_dict(cfg)))
    if tokenizer:
        ByteTokenizer().save(tmp / "tokenizer.json")
    return ck.finish(root, step)
