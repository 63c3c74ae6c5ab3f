"""What a training run says about its work: parameter counts, tokens per parameter, the learning-rate
plan, flops per token and model FLOPs utilisation (MFU) against the device's peak."""
from __future__ import annotations

import logging
import math

import torch

from ..config import ModelConfig, RunConfig, TrainConfig
from ..model.attention import config_base, config_layer_alphas
from ..schedules import attended_distances

log = logging.getLogger("fibattn")

# Dense (no 2:4 sparsity) peak FLOP/s by a fragment of torch.cuda.get_device_name, most specific first:
# (bf16 tensor cores, fp32 without TF32 -- torch's default matmul precision). Vendors' data sheets.
PEAK_TFLOPS = (("H200", 989.0, 67.0), ("H100 PCIe", 756.0, 51.0), ("H100", 989.0, 67.0),
               ("A100", 312.0, 19.5), ("L40S", 362.0, 91.6), ("L4", 121.0, 30.3))


def human(n: float) -> str:
    """``1234567`` -> ``1.23M``."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def mean_columns(m: ModelConfig, seq_len: int | None = None) -> float:
    """Keys a query attends, averaged over the positions of a ``seq_len`` row and the layers (method.md §1):
    a distance ``d`` is used by the ``T - d`` queries at positions ``>= d``. Dense: ``(T + 1) / 2``. A
    learned schedule's fractional rungs read two neighbouring columns each (method.md §3), counted so."""
    T = seq_len or m.seq_len
    if m.attention == "dense":
        return (T + 1) / 2
    base, alphas = config_base(m), config_layer_alphas(m)
    total = 0.0
    for alpha in alphas:
        dists = attended_distances(m.window, alpha, base, T)
        per = sum(T - d for d in dists) / T
        if m.schedule == "learned":                              # each rung beyond the window: two columns
            per += sum(T - d for d in dists if d > m.window) / T
        total += per
    return total / len(alphas)


def flops_per_token(m: ModelConfig, seq_len: int | None = None) -> tuple[float, float]:
    """Training matmul FLOPs per token (forward + backward = 3 x forward) and :func:`mean_columns`:
    ``6 x`` the matmul weights (q/k/v/o projections, SwiGLU, the output head -- a matmul even when tied to
    the embedding) plus ``12 x d_model`` per attended column per layer (``q.k`` and ``p.v``, 2 FLOPs a
    multiply-add each, times 3). Norms, RoPE and the softmax are left out, as is activation recomputation
    (model FLOPs, not hardware FLOPs); document masking only removes work, so this is an upper bound."""
    hd = m.d_model // m.n_heads
    per_layer = m.d_model * (m.n_heads + 2 * m.n_kv_heads) * hd + m.n_heads * hd * m.d_model \
        + 3 * m.d_model * m.ffn_hidden
    weights = m.n_layers * per_layer + m.d_model * m.vocab_size
    cols = mean_columns(m, seq_len)
    return 6.0 * weights + 12.0 * m.n_layers * m.n_heads * hd * cols, cols


def peak_flops(device: torch.device, bf16: bool) -> tuple[float | None, str]:
    """The device's dense peak FLOP/s for this precision and what it is, or ``(None, why not)``: there is
    no reliable number for a CPU (it depends on cores, vector units and clocks), nor for a GPU not listed."""
    if device.type != "cuda":
        return None, f"no known peak FLOP/s for {device.type}"
    name = torch.cuda.get_device_name(device)
    for fragment, bf16_peak, fp32_peak in PEAK_TFLOPS:
        if fragment in name:
            peak = bf16_peak if bf16 else fp32_peak
            return peak * 1e12, f"{name} {'bf16' if bf16 else 'fp32'} peak {peak:g} TFLOP/s"
    return None, f"no known peak FLOP/s for {name}"


def start_lines(m: ModelConfig, t: TrainConfig, params: int, non_embedding: int, peak: tuple, world: int) -> list:
    """What the run is about to do: its size, its token budget, its learning-rate plan, its flops."""
    tokens = t.steps * t.batch_tokens
    flops, cols = flops_per_token(m)
    mfu = (f"MFU against {peak[1]}" + (f" x {world} devices" if world > 1 else "")) if peak[0] else \
        f"MFU not shown: {peak[1]}"
    share = t.warmup_steps / t.steps
    why = ("; all of the run: train.lr is reached at its last step" if t.warmup_steps >= t.steps else
           "; train.warmup_steps does not shrink with train.steps: set it to choose" if share > 0.1 else "")
    warm = (f"linear warm-up over {t.warmup_steps} of {t.steps} steps ({share:.1%}{why}), then" if t.warmup_steps
            else "no warm-up,")
    return [f"fibattn: model {human(params)} parameters ({human(non_embedding)} without embeddings); "
            f"{t.steps} steps x {t.batch_tokens} tokens = {human(tokens)} tokens, {tokens / params:.3g} per "
            f"parameter",
            f"fibattn: lr {t.lr:.2e}: {warm} cosine to {t.lr * t.min_lr_ratio:.2e} at step {t.steps}",
            f"fibattn: {human(flops)}FLOP per token (matmuls, attention over {cols:.1f} keys per query on "
            f"average); {mfu}"]


def announce(cfg: RunConfig, model, dist) -> tuple[float | None, float]:
    """Log :func:`start_lines` (main process) and return the device's peak FLOP/s (None: unknown) and the
    flops per token, for :func:`mfu`."""
    t = cfg.train
    bf16 = t.precision == "bf16" or (t.precision == "auto" and dist.device.type == "cuda")
    peak = peak_flops(dist.device, bf16)
    if dist.is_main:
        for line in start_lines(cfg.model, t, model.num_params(False), model.num_params(), peak, dist.world_size):
            log.info("%s", line)
    return peak[0], flops_per_token(cfg.model)[0]


def mfu(tok_s: float, flops: float, peak: float | None, world: int) -> float | None:
    """Model FLOPs utilisation: ``tok_s`` (all devices) x flops per token over ``world`` devices' peak."""
    return None if not peak else tok_s * flops / (peak * world)


def eval_line(step: int, val: dict, data, cfg: RunConfig) -> str:
    """The in-training evaluation's line, with the tokens it scored: fewer, and at the training length
    only, than ``fibattn eval`` (eval.tokens at eval.lengths), so the two are not mistaken for each other."""
    scored = eval_tokens_scored(data, cfg.train.eval_tokens, cfg.model.seq_len)
    splits = " | ".join(f"{n} loss {v:.4f} ppl {math.exp(min(v, 50)):.2f} over {scored.get(n, '?')} tokens"
                        for n, v in val.items())
    return f"eval step {step} | {splits} (length {cfg.model.seq_len}; train.eval_tokens, not fibattn eval's budget)"


def eval_tokens_scored(data, eval_tokens: int, seq_len: int) -> dict:
    """Tokens the in-training evaluation scores per split (``validation_losses``: the first ``eval_tokens``
    targets in whole rows of ``seq_len``, or the whole split when it is shorter than a row)."""
    out = {}
    for name in data.val_names:
        available = min(eval_tokens + 1, len(data.val_tokens(name))) - 1
        out[name] = (available // seq_len) * seq_len or max(available, 0)
    return out
