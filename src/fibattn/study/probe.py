"""``fibattn probe``: the mechanistic retrieval probe (method.md §5).

    fibattn probe [--preset tiny|paper] [--depths 2,4,8] [--starts uniform,staggered]
                  [--distances 20,32] [--marked] [--steps N] [--seed S] [--out DIR]

For every depth and start it trains a small :class:`fibattn.model.lm.FibLM` with a learned
alpha per layer on :mod:`fibattn.study.probe_task` samples, the loss on the answer token only
(the next-token prediction at the final position), then reports retrieval accuracy per
distance (fresh samples, argmax over the whole vocabulary) and the alpha of every layer
at the start and the end. ``uniform`` starts every layer at alpha = 1
(``learned_init=fixed``), ``staggered`` at the linear schedule (``learned_init=linear``:
``a_min .. a_max`` over depth). Models of one depth share their initial weights and
every model sees the same training batches. "Retrieves" means accuracy >= 0.5.

Outputs in ``--out``: ``probe.json``, ``probe.md`` (tables) and ``probe.png`` (accuracy
per distance and final alpha per layer). Presets:

- ``cpu`` (default): plain task, length 48, distances 20 and 32, d_model 32, 2 heads,
  window 4, 800 steps × 32 samples; six models in worker processes, minutes on 2 cores.
  The distances are chosen like the study's 350 = round(1.5 · 233): with the staggered
  start the last layer of a depth-2 model (alpha 1.5) attends 20 = round(1.5 · 13) and
  32 = round(1.5 · 21), while alpha = 1 attends 21 and 34 but neither 20 nor 32.
- ``study``: the study's marked setting (distances 200 and 350, one model for both);
  the sizes (length 384, d_model 128, 4 heads, window 8, 3000 steps × 64) are this
  project's choice, meant for a GPU.

``fibattn probe --extrapolate`` (retrieval past the training length) is
:mod:`fibattn.study.probe_extrapolate`; it shares this module's training loop (:func:`fit`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..checks import UsageError
from ..files import atomic_write_text
from .probe_task import ProbeTask, make_batch

log = logging.getLogger("fibattn")

STARTS = {"uniform": "fixed", "staggered": "linear"}
RETRIEVES = 0.5


@dataclass
class ProbeModel:
    d_model: int = 32
    n_heads: int = 2
    window: int = 4
    base_k: int = 15
    a_min: float = 0.5
    a_max: float = 1.5


_FLAG = {"steps": "--steps", "batch_size": "--batch-size"}      # the CLI flag of a setting


@dataclass
class ProbeConfig:
    task: ProbeTask = field(default_factory=ProbeTask)
    model: ProbeModel = field(default_factory=ProbeModel)
    depths: tuple = (2, 4, 8)
    starts: tuple = ("uniform", "staggered")
    steps: int = 800
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 40
    weight_decay: float = 0.1
    eval_samples: int = 256           # per distance
    seed: int = 0
    device: str = "cpu"

    def validate(self) -> "ProbeConfig":
        check_training(self)
        if not self.depths or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in self.depths):
            raise UsageError(f"probe depths must be integers (--depths) >= 1, got {self.depths!r}")
        bad = [s for s in self.starts if s not in STARTS]
        if not self.starts or bad:
            raise UsageError(f"probe starts must be among {', '.join(STARTS)} (--starts), got {list(self.starts)!r}")
        self.task.validate()
        try:                                                     # validates the model shape at every depth
            self.model_config(max(self.depths), self.starts[0])
        except ValueError as exc:
            raise UsageError(f"probe depths (--depths) up to {max(self.depths)}: {exc}") from None
        check_fits(self, self.task.seq_len, max(self.depths), self.task.vocab_size)
        return self

    def model_config(self, depth: int, start: str):
        from ..config import ModelConfig
        from ..validation import validate_model
        m, t = self.model, self.task
        cfg = ModelConfig(vocab_size=t.vocab_size, d_model=m.d_model, n_layers=depth, n_heads=m.n_heads,
                          n_kv_heads=m.n_heads, seq_len=t.seq_len, max_seq_len=t.seq_len, window=m.window,
                          base="fib", base_k=m.base_k, schedule="learned", learned_init=STARTS[start], alpha=1.0,
                          a_min=m.a_min, a_max=m.a_max, init_std=0.02)
        validate_model(cfg)
        return cfg

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["task"] = self.task.to_dict()
        d["depths"], d["starts"] = list(self.depths), list(self.starts)
        return d


MAX_SEED = 2 ** 32 - 1          # each model's torch seed is seed * 1009 + depth, within torch's 64 bits


def check_training(cfg) -> None:
    """The settings every probe mode shares: ``steps``, ``batch_size``, ``eval_samples``, ``lr``, ``seed``."""
    for name in ("steps", "batch_size", "eval_samples"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UsageError(f"probe {name} must be an integer >= 1 ({_FLAG.get(name, name)}), got {v!r}")
    if not (isinstance(cfg.lr, (int, float)) and 0 < cfg.lr <= 1):
        raise UsageError(f"probe lr must be a number in (0, 1] (--lr), got {cfg.lr!r}")
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int) or not 0 <= cfg.seed <= MAX_SEED:
        raise UsageError(f"probe seed must be an integer from 0 to {MAX_SEED} (--seed), got {cfg.seed!r}")


def check_fits(cfg, seq_len: int, depth: int, vocab_size: int) -> None:
    """Refuse sizes whose training batch certainly exceeds the device: per token at least its id, one
    ``d_model`` activation per layer and the logits with their gradient (float32)."""
    from ..validation import check_sizes_fit
    per_token = 8 + 4 * (cfg.model.d_model * depth + 2 * vocab_size)
    shape = f"(d_model {cfg.model.d_model}, depth {depth})"
    check_sizes_fit("--seq-len", [seq_len], lambda T: T * per_token, f"one training sample {shape}",
                    cfg.device)                           # alone first, so a huge batch is blamed on --batch-size
    check_sizes_fit("--batch-size", [cfg.batch_size], lambda b: b * seq_len * per_token,
                    f"one training batch of --seq-len {seq_len} {shape}", cfg.device)


PRESET_ALIASES = {"tiny": "cpu", "paper": "study"}     # the names every other command uses


def preset(name: str) -> ProbeConfig:
    """``cpu`` (alias ``tiny``): minutes on a laptop CPU; ``study`` (alias ``paper``): the study's setting."""
    name = PRESET_ALIASES.get(name, name)
    if name == "cpu":
        return ProbeConfig()
    if name == "study":
        task = ProbeTask(seq_len=384, distances=(200, 350), marked=True, n_keys=32, n_values=32, n_filler=16,
                         n_distractors=24)
        return ProbeConfig(task=task, model=ProbeModel(d_model=128, n_heads=4, window=8), steps=3000,
                           batch_size=64, lr=1e-3, warmup=200, eval_samples=512)
    raise UsageError(f"--preset must be tiny (= cpu) or paper (= study), got {name!r}")


# ----------------------------------------------------------------------------- training
@dataclass
class ProbeResult:
    depth: int
    start: str
    accuracy: dict                    # distance -> accuracy
    alpha_start: list
    alpha_end: list
    alpha_history: list               # [(step, [alpha per layer])]
    final_loss: float
    seconds: float

    def max_move(self) -> float:
        return max(abs(b - a) for a, b in zip(self.alpha_start, self.alpha_end))


def _lr(step: int, cfg: ProbeConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - 1 - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def answer_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits ``(N, V)`` at the final position only."""
    h = model.hidden(tokens)[:, -1]
    return model.logits(h)


@torch.inference_mode()
def batch_accuracy(model, batch, device, chunk: int = 64) -> float:
    """Share of ``batch``'s samples whose argmax over the whole vocabulary is the answer (``chunk`` at a time)."""
    was_training = model.training
    model.eval()
    hits = 0
    for i in range(0, len(batch.answers), chunk):
        pred = answer_logits(model, torch.from_numpy(batch.tokens[i:i + chunk]).to(device)).argmax(-1).cpu().numpy()
        hits += int(np.sum(pred == batch.answers[i:i + chunk]))
    model.train(was_training)
    return hits / len(batch.answers)


def accuracy(model, cfg: ProbeConfig) -> dict:
    return {d: batch_accuracy(model, make_batch(cfg.task, cfg.eval_samples, [cfg.seed, 2, j], distance=d), cfg.device)
            for j, d in enumerate(cfg.task.distances)}


def fit(model, task: ProbeTask, cfg, on_step=None) -> list[float]:
    """Train ``model`` on ``task`` samples, the loss on the answer token only; returns the losses.

    ``cfg`` gives the optimiser settings (``steps``, ``batch_size``, ``lr``, ``warmup``, ``weight_decay``,
    ``seed``, ``device``); the batches depend on ``cfg.seed`` and the step only, so every model trained
    with the same settings sees the same data. ``on_step(step)`` runs after each step (1-based)."""
    from ..trainer.optim import param_groups
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95))
    losses = []
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = _lr(step, cfg)
        b = make_batch(task, cfg.batch_size, [cfg.seed, 1, step])
        x = torch.from_numpy(b.tokens).to(cfg.device)
        y = torch.from_numpy(b.answers).to(cfg.device)
        loss = F.cross_entropy(answer_logits(model, x).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step + 1)
    return losses


def tail_loss(losses: list[float]) -> float:
    """Mean loss over the last tenth of training."""
    return float(np.mean(losses[-max(1, len(losses) // 10):]))


def train_one(cfg: ProbeConfig, depth: int, start: str) -> ProbeResult:
    """Train one probe model and measure it."""
    from ..model.lm import FibLM
    torch.manual_seed(cfg.seed * 1009 + depth)              # same initial weights for both starts
    model = FibLM(cfg.model_config(depth, start)).to(cfg.device)
    alpha_start = model.alphas()
    history = [(0, alpha_start)]
    every = max(1, cfg.steps // 20)

    def record(step: int) -> None:
        if step % every == 0 or step == cfg.steps:
            history.append((step, model.alphas()))

    t0 = time.perf_counter()
    losses = fit(model, cfg.task, cfg, record)
    acc = accuracy(model, cfg)
    return ProbeResult(depth, start, acc, alpha_start, model.alphas(), history, tail_loss(losses),
                       round(time.perf_counter() - t0, 1))


# ----------------------------------------------------------------------------- report
@dataclass
class ProbeReport:
    config: dict
    results: list = field(default_factory=list)

    @property
    def distances(self) -> list:
        return list(self.config["task"]["distances"])

    def table(self) -> str:
        ds = self.distances
        head = ["depth", "start"] + [f"acc d={d}" for d in ds] + ["loss", "max |alpha move|", "time"]
        rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.results:
            cells = [str(r.depth), r.start] + [f"{r.accuracy[d]:.3f}" for d in ds]
            cells += [f"{r.final_loss:.3f}", f"{r.max_move():.4f}", f"{r.seconds:.0f}s"]
            rows.append("| " + " | ".join(cells) + " |")
        return "\n".join(rows)

    def alpha_table(self) -> str:
        rows = ["| depth | start | alpha per layer: start → end |", "|---|---|---|"]
        for r in self.results:
            pairs = ", ".join(f"{a:.3f}→{b:.3f}" for a, b in zip(r.alpha_start, r.alpha_end))
            rows.append(f"| {r.depth} | {r.start} | {pairs} |")
        return "\n".join(rows)

    def summary(self) -> list[str]:
        chance = 1.0 / self.config["task"]["n_values"]
        lines = [f"chance accuracy {chance:.3f}; 'retrieves' = accuracy >= {RETRIEVES} at every distance"]
        for start in self.config["starts"]:
            mine = [r for r in self.results if r.start == start]
            ok = [r.depth for r in mine if min(r.accuracy.values()) >= RETRIEVES]
            moves = max((r.max_move() for r in mine), default=0.0)
            lines.append(f"{start} start: retrieves at depths {ok or 'none'}; largest alpha move {moves:.4f}")
        lines.append("study (method.md §5): alphas barely move (uniform within 0.05 of 1.0); uniform retrieves nothing "
                     "at depth >= 4; staggered retrieves at depths 2 and 4")
        return lines

    def markdown(self) -> str:
        t = self.config["task"]
        head = (f"# Retrieval probe\n\ntask: seq_len {t['seq_len']}, distances {t['distances']}, "
                f"{'marked' if t['marked'] else 'plain'}, {t['n_keys']} keys, {t['n_values']} values, "
                f"{t['n_distractors']} distractor pairs; {self.config['steps']} steps × {self.config['batch_size']}")
        return "\n\n".join([head, self.table(), self.alpha_table(), "\n".join(f"- {s}" for s in self.summary())])

    def to_dict(self) -> dict:
        return {"config": self.config, "results": [dataclasses.asdict(r) for r in self.results],
                "summary": self.summary()}


def plot_report(report: ProbeReport, path) -> Path:
    from ..plots import Panel, Series, save_panels
    names = [f"L{r.depth} {r.start[:4]}" for r in report.results]
    acc = [Series(f"d={d}", names, [r.accuracy[d] for r in report.results]) for d in report.distances]
    chance = 1.0 / report.config["task"]["n_values"]
    p1 = Panel("retrieval accuracy", "model (depth, start)", "accuracy", acc, kind="bar", hline=chance,
               hline_label="chance", ylim=(0.0, 1.0))
    alpha = [Series(n, list(range(r.depth)), r.alpha_end, marker="o") for n, r in zip(names, report.results)]
    p2 = Panel("final alpha per layer", "layer", "alpha", alpha, hline=1.0)
    return save_panels(path, [p1, p2], suptitle="retrieval probe")


def _in_worker(fn, *args):
    torch.set_num_threads(1)                  # tiny models: one thread per process beats intra-op threads
    return fn(*args)


def resolve_jobs(jobs: int, cfg, models: int | None = None) -> int:
    """``jobs`` worker processes; ``0`` (auto): one per CPU core up to the number of ``models``, 1 on CUDA."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 0:
        raise UsageError(f"--jobs must be an integer >= 0 (0: auto), got {jobs!r}")
    if jobs:
        return jobs
    models = len(cfg.depths) * len(cfg.starts) if models is None else models
    n = 1 if cfg.device != "cpu" else max(1, min(os.cpu_count() or 1, models))
    log.info("fibattn probe: --jobs auto -> %d process%s", n, "es" if n > 1 else "")
    return n


def run_jobs(fn, todo: list[tuple], jobs: int, on_result) -> None:
    """``fn(*args)`` for every ``args`` in ``todo``: here when ``jobs <= 1``, else in ``jobs`` spawned worker
    processes (one torch thread each); ``on_result(result)`` in this process as each one finishes."""
    if jobs <= 1:
        for args in todo:
            on_result(fn(*args))
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        for fut in as_completed([pool.submit(_in_worker, fn, *args) for args in todo]):
            on_result(fut.result())


def _train_all(cfg: ProbeConfig, jobs: int, echo) -> list[ProbeResult]:
    todo = sorted(((cfg, d, s) for d in cfg.depths for s in cfg.starts), key=lambda x: -x[1])    # longest first
    done: dict = {}

    def report(r: ProbeResult) -> None:
        done[(r.depth, r.start)] = r
        accs = ", ".join(f"d={d}: {a:.3f}" for d, a in r.accuracy.items())
        echo(f"depth {r.depth} {r.start}: {accs} | loss {r.final_loss:.3f} | max alpha move {r.max_move():.4f} "
             f"| {r.seconds:.0f}s")

    run_jobs(train_one, todo, jobs, report)
    return [done[(d, s)] for d in cfg.depths for s in cfg.starts]


def run_probe(cfg: ProbeConfig, out_dir=None, *, plot: bool = True, echo=print, jobs: int = 1) -> ProbeReport:
    """Train every (depth, start) model; write ``probe.json``/``probe.md``/``probe.png`` to ``out_dir``.

    ``jobs``: worker processes (each with one torch thread); 1 trains in this process.
    Every model is seeded on its own, so the job count changes results only through
    floating-point summation order (thread count).
    """
    cfg.validate()
    report = ProbeReport(cfg.to_dict())
    report.results = _train_all(cfg, resolve_jobs(jobs, cfg), echo)
    if out_dir is not None:
        write_outputs(report, out_dir, "probe", plot_report if plot else None, "the probe plot")
    return report


def write_outputs(report, out_dir, stem: str, plot_fn, what: str) -> None:
    """``<stem>.json`` and ``<stem>.md`` of ``report`` in ``out_dir``; ``<stem>.png`` by ``plot_fn(report, path)``
    unless it is None (skipped with one logged line, naming ``what``, when matplotlib is missing)."""
    from .. import plots
    out = Path(out_dir)
    atomic_write_text(out / f"{stem}.json", json.dumps(report.to_dict(), indent=1) + "\n")
    atomic_write_text(out / f"{stem}.md", report.markdown() + "\n")
    if plot_fn is not None:
        if plots.available():
            plot_fn(report, out / f"{stem}.png")
        else:
            plots.warn_unavailable(what)
