"""``fibattn probe --extrapolate``: retrieval past the window and past the training length.

Every variant — ``fib_linear``, ``fib_fixed``, ``window_matched`` (no rungs, the window that
matches ``fib_linear``'s mean attended columns at the training length: :func:`fibattn.schedules.matched_window`)
and ``dense`` — is trained on the probe's plain task (:mod:`fibattn.study.probe_task`) at length ``T``
with the asked distance drawn uniformly from ``1 .. T-2``, then tested at lengths ``f · T`` for each
factor ``f`` with distances up to ``f · T - 2``, by power-of-two distance bucket. The dense model is
also tested with RoPE scaling (``ntk``, ``yarn``; method.md §7) at factor ``f``. Sparse models use
the ``reach`` of method.md §1 (``study``: distance sets rebuilt at the evaluation length).

Beside the accuracy: which distances each model can reach in principle (:mod:`fibattn.study.probe_reach`:
sums of one attended distance per layer at the evaluation length).

No setting is chosen per variant: one preset fixes model size, steps, data, seeds and evaluation
samples for all of them; every variant starts from the same initial weights (the same seed,
and the same parameter shapes), sees the same training batches and is tested on the same samples.
Distractor pairs keep their density at longer lengths (``n_distractors · f``), so a long sample
looks locally like a training sample.

Presets: ``cpu`` (alias ``tiny``; minutes on 2 CPU cores) and ``paper`` (alias ``study``;
sizes meant for a GPU, not run by the tests).
"""
from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field

import torch

from ..checks import UsageError, check_int
from .probe import ProbeModel, batch_accuracy, check_fits, check_training, fit, tail_loss
from .probe_reach import coverage, distance_buckets, reachable, smallest_unreachable
from .probe_task import ProbeTask, make_batch

VARIANTS = ("fib_linear", "fib_fixed", "window_matched", "dense")
DENSE_SCALINGS = ("ntk", "yarn")       # RoPE scalings the dense model is also tested with
PRESET_ALIASES = {"tiny": "cpu", "study": "paper"}


@dataclass
class ExtrapolateConfig:
    seq_len: int = 32                  # T, the training length
    factors: tuple = (1, 4, 16)        # evaluation lengths f · T
    n_layers: int = 2
    model: ProbeModel = field(default_factory=ProbeModel)
    variants: tuple = VARIANTS
    scalings: tuple = DENSE_SCALINGS
    reach: str = "study"
    n_keys: int = 16
    n_values: int = 16
    n_filler: int = 8
    n_distractors: int = 6             # at length T; f times as many at f · T
    steps: int = 2000
    batch_size: int = 64
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.1
    eval_samples: int = 64             # per distance bucket and length
    seed: int = 0
    device: str = "cpu"

    @property
    def lengths(self) -> list[int]:
        return [f * self.seq_len for f in self.factors]

    def task(self, factor: int = 1, distances=None) -> ProbeTask:
        """The plain task at length ``factor · T``; ``distances`` default to all of ``1 .. length-2``."""
        n = factor * self.seq_len
        return ProbeTask(seq_len=n, distances=tuple(distances or range(1, n - 1)), n_keys=self.n_keys,
                         n_values=self.n_values, n_filler=self.n_filler, n_distractors=self.n_distractors * factor)

    def validate(self) -> "ExtrapolateConfig":
        from ..model.attention import REACH_MODES
        from ..model.rope import SCALING_KINDS
        check_training(self)
        check_int("probe --extrapolate seq_len (--seq-len)", self.seq_len, 4)
        check_int("probe --extrapolate n_layers (--depths, one value)", self.n_layers, 1)
        fs = self.factors
        if not fs or any(isinstance(f, bool) or not isinstance(f, int) or f < 1 for f in fs) or len(set(fs)) < len(fs):
            raise UsageError(f"probe --extrapolate factors (--factors) must be distinct integers >= 1, got {list(fs)!r}")
        bad = [v for v in self.variants if v not in VARIANTS]
        if not self.variants or bad or len(set(self.variants)) < len(self.variants):
            raise UsageError(f"probe --extrapolate variants (--variants) must be distinct names among "
                             f"{', '.join(VARIANTS)}, got {list(self.variants)!r}")
        if any(s not in SCALING_KINDS[1:] for s in self.scalings):
            raise UsageError(f"probe --extrapolate scalings must be among {', '.join(SCALING_KINDS[1:])}, "
                             f"got {list(self.scalings)!r}")
        if self.reach not in REACH_MODES:
            raise UsageError(f"probe --extrapolate reach (--reach) must be one of {', '.join(REACH_MODES)}, "
                             f"got {self.reach!r}")
        self.task()                                                   # checks the task fields at length T
        for v in self.variants:
            try:
                self.model_config(v)
            except ValueError as exc:
                raise UsageError(f"probe --extrapolate variant {v}: {exc}") from None
        check_fits(self, self.seq_len, self.n_layers, self.task().vocab_size)
        return self

    def matched_window(self) -> int:
        """``window_matched``'s window: the columns ``fib_linear`` attends per query at length T."""
        from ..schedules import layer_alphas, matched_window
        m = self.model
        alphas = layer_alphas("linear", self.n_layers, a_min=m.a_min, a_max=m.a_max)
        return matched_window(m.window, alphas, f"fib:{m.base_k}", self.seq_len)

    def model_config(self, variant: str):
        from ..config import ModelConfig
        from ..validation import validate_model
        m = self.model
        kw = {"fib_linear": {"schedule": "linear"}, "fib_fixed": {"schedule": "fixed"},
              "window_matched": {"base": "none", "window": self.matched_window(), "schedule": "fixed"},
              "dense": {"attention": "dense"}}[variant]
        cfg = ModelConfig(**{**dict(vocab_size=self.task().vocab_size, d_model=m.d_model, n_layers=self.n_layers,
                                    n_heads=m.n_heads, n_kv_heads=m.n_heads, seq_len=self.seq_len,
                                    max_seq_len=max(self.lengths), window=m.window, base="fib", base_k=m.base_k,
                                    schedule="fixed", alpha=1.0, a_min=m.a_min, a_max=m.a_max, reach=self.reach,
                                    init_std=0.02), **kw})
        validate_model(cfg)
        return cfg

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for name in ("factors", "variants", "scalings"):
            d[name] = list(d[name])
        d["lengths"], d["matched_window"] = self.lengths, self.matched_window()
        return d


def preset(name: str) -> ExtrapolateConfig:
    """``cpu`` (alias ``tiny``): <= 10 minutes on 2 CPU cores; ``paper`` (alias ``study``): sizes for a GPU."""
    name = PRESET_ALIASES.get(name, name)
    if name == "cpu":
        return ExtrapolateConfig()
    if name == "paper":
        return ExtrapolateConfig(seq_len=512, n_layers=4, model=ProbeModel(d_model=128, n_heads=4, window=12),
                                 n_keys=32, n_values=32, n_filler=16, n_distractors=24, steps=4000, batch_size=64,
                                 lr=1e-3, warmup=200, eval_samples=256)
    raise UsageError(f"--preset must be tiny (= cpu) or paper (= study) with --extrapolate, got {name!r}")


# ----------------------------------------------------------------------------- one variant
@dataclass
class ExtrapolateRow:
    """One model tested one way: ``name`` is the variant, ``+ntk`` / ``+yarn`` for a scaled dense model.
    Per evaluation length: accuracy and reachable share by distance bucket, and the smallest
    unreachable distance (None: every distance up to length - 2 is reachable)."""

    name: str
    variant: str
    scaling: str
    window: int | None                 # None: dense
    alphas: list
    accuracy: dict = field(default_factory=dict)
    coverage: dict = field(default_factory=dict)
    unreachable: dict = field(default_factory=dict)
    final_loss: float = 0.0
    seconds: float = 0.0
    cpu_seconds: float = 0.0           # CPU time of the process: the wall time on an idle core, one thread


def eval_batches(cfg: ExtrapolateConfig, factor: int) -> list:
    """``(bucket, batch)`` per distance bucket at length ``factor · T``: the same samples for every variant."""
    n = factor * cfg.seq_len
    return [(b, make_batch(cfg.task(factor, range(b[0], b[1] + 1)), cfg.eval_samples, [cfg.seed, 3, n, i]))
            for i, b in enumerate(distance_buckets(n - 2))]


def model_reach(model, length: int) -> tuple[dict, int | None]:
    """Coverage by bucket and the smallest unreachable distance of ``model``'s layers at ``length``."""
    reach = reachable(model.distances(length), length)
    return coverage(reach, distance_buckets(length - 2)), smallest_unreachable(reach, length - 2)


def train_variant(cfg: ExtrapolateConfig, variant: str, progress: bool = False) -> list[ExtrapolateRow]:
    """Train ``variant`` at length T and test it at every length (the dense one also RoPE-scaled)."""
    from ..model.lm import FibLM
    from ..model.rope import rope_scaling_mode
    torch.manual_seed(cfg.seed * 1009 + cfg.n_layers)          # the same initial weights for every variant
    mcfg = cfg.model_config(variant)
    model = FibLM(mcfg).to(cfg.device)
    every = max(1, cfg.steps // 4)

    def tell(step: int) -> None:
        if progress and (step % every == 0):
            print(f"probe --extrapolate: {variant} step {step}/{cfg.steps}", file=sys.stderr, flush=True)

    t0, c0 = time.perf_counter(), time.process_time()
    loss = tail_loss(fit(model, cfg.task(), cfg, tell))
    scalings = ["none"] + (list(cfg.scalings) if variant == "dense" else [])
    window = None if variant == "dense" else mcfg.window
    rows = [ExtrapolateRow(variant if s == "none" else f"{variant}+{s}", variant, s, window, model.alphas(),
                           final_loss=loss) for s in scalings]
    for f, n in zip(cfg.factors, cfg.lengths):
        cov, miss = model_reach(model, n)
        batches = eval_batches(cfg, f)
        chunk = max(1, (1 << 14) // n)                          # bounds the dense scores of long samples
        for row in rows:
            with rope_scaling_mode(model, row.scaling, length=n, original_len=cfg.seq_len):
                row.accuracy[n] = {lab: batch_accuracy(model, b, cfg.device, chunk)
                                   for lab, (_, b) in zip(cov, batches)}
            row.coverage[n], row.unreachable[n] = cov, miss
    for row in rows:
        row.seconds, row.cpu_seconds = round(time.perf_counter() - t0, 1), round(time.process_time() - c0, 1)
    return rows
