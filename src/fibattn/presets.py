"""Presets: functions returning a full :class:`RunConfig`. Override with ``--set``."""
from __future__ import annotations

from .config import DataConfig, EvalConfig, ModelConfig, RunConfig, SourceConfig, TrainConfig


MATH_SUBSETS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
                "prealgebra", "precalculus")


def study_mixture() -> list[SourceConfig]:
    """method.md §4's training mixture (Hugging Face ids, streamed).

    ``max_docs`` caps each stream at roughly its share of the 426M training tokens plus
    the held-out split (average document lengths: FineWeb-Edu ~1k tokens, Wikipedia
    ~0.7k, TinyStories ~0.2k, maths ~0.3k), so preparing never downloads whole corpora.
    """
    return [
        SourceConfig(name="fineweb_edu", kind="hf", path="HuggingFaceFW/fineweb-edu", subset="sample-10BT",
                     weight=0.35, max_docs=200_000),
        SourceConfig(name="wikipedia", kind="hf", path="wikimedia/wikipedia", subset="20231101.en", weight=0.22,
                     max_docs=200_000),
        SourceConfig(name="tinystories", kind="hf", path="roneneldan/TinyStories", weight=0.20, max_docs=600_000),
        *[SourceConfig(name=f"math_{sub}", kind="hf", path="EleutherAI/hendrycks_math", subset=sub,
                       text_field="solution", weight=0.08 / len(MATH_SUBSETS)) for sub in MATH_SUBSETS],
        SourceConfig(name="openmath", kind="hf", path="nvidia/OpenMathInstruct-2", text_field="generated_solution",
                     weight=0.15, max_docs=300_000),
    ]


def paper() -> RunConfig:
    """The study's model and recipe (method.md §4): 60.9M parameters, 13k steps × 32k tokens."""
    return RunConfig(
        name="paper",
        model=ModelConfig(),
        data=DataConfig(out_dir="data/paper-bpe32k", sources=study_mixture(), tokenizer="bpe",
                        vocab_size=32768, val_fraction=0.005),
        train=TrainConfig(out_dir="runs/paper"),        # micro_batch auto: the largest that fits on CUDA
        eval=EvalConfig(lengths=[1024, 2048, 4096], tokens=1 << 20),
    )


def tiny() -> RunConfig:
    """A CPU-sized model on the bundled Shakespeare corpus (byte tokenizer)."""
    return RunConfig(
        name="tiny",
        model=ModelConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, seq_len=256,
                          window=8, base_k=10),
        data=DataConfig(val_fraction=0.05),
        # 400 x 4096 = 1.6M tokens (~1/3 epoch): val loss ~1.69 nats/byte vs 3.33 unigram, a few CPU minutes
        train=TrainConfig(out_dir="runs/tiny", steps=400, batch_tokens=4096, micro_batch=16, lr=3e-3,
                          warmup_steps=40, log_every=25, eval_every=100, ckpt_every=200, eval_tokens=1 << 15),
        eval=EvalConfig(lengths=[256, 1024], tokens=1 << 16, batch_size=8),
    )


PRESETS = {"paper": paper, "tiny": tiny}


def get_preset(name: str) -> RunConfig:
    if name not in PRESETS:
        from .config import ConfigError
        raise ConfigError(f"--preset must be one of {', '.join(PRESETS)}, got {name!r}")
    return PRESETS[name]()
