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
