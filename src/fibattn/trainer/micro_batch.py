"""``train.micro_batch = 0`` (auto): the micro-batch a run takes when the config leaves it to fibattn.

On CUDA the largest divisor of the rank's sequences per step whose forward + backward fits is chosen by
trying it once, before the first step: the real model, the real loss head and precision, random tokens,
largest first (the memory lower bound of :func:`fibattn.validation.check_training_fits` skips the hopeless
ones), each trial's peak kept under :data:`HEADROOM` of the card once the AdamW moments (allocated at the
first step) are counted. The trial runs eagerly: a compiled step holds no more than the eager one. Elsewhere
(a CPU, context parallelism, whose trial would need the whole group) auto is :data:`FALLBACK`, capped to a
divisor as any micro-batch is. The choice is logged once; ranks of one run take the smallest of theirs.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from ..config import ConfigError

log = logging.getLogger("fibattn")

FALLBACK = 8            # the micro-batch auto means where nothing is tried (the former default)
HEADROOM = 0.9          # of the card's memory a trial may peak at: the allocator's fragmentation, the compiler


def divisors_desc(n: int) -> list[int]:
    """Every micro-batch that splits ``n`` sequences into whole micro-batches, largest first."""
    return [d for d in range(n, 0, -1) if n % d == 0]


def largest_fitting(candidates: list[int], peak: Callable[[int], int | None], budget: int) -> tuple[int, int]:
    """The first of ``candidates`` (largest first) whose ``peak(c)`` bytes (None: out of memory) stay within
    ``budget``, and that peak; a ConfigError naming the setting when not even the last one fits."""
    for c in candidates:
        need = peak(c)
        if need is not None and need <= budget:
            return c, need
    raise ConfigError(f"train.micro_batch auto: not even {candidates[-1]} sequence(s) per micro-batch fit in "
                      f"{budget / 1e9:.3g} GB; lower model.seq_len or set train.activation_checkpointing=full")


def trial_step(model, batch: int, autocast, generator: torch.Generator | None = None) -> None:
    """One forward + backward of ``batch`` random sequences of the model's training length, as training runs
    it (its loss head, precision, checkpointing); the gradients are dropped and the global RNG is untouched."""
    m, device = model.cfg, model.embed.weight.device
    x = torch.randint(0, m.vocab_size, (batch, m.seq_len + 1), generator=generator).to(device)
    try:
        with autocast():
            loss = model(x[:, :-1], x[:, 1:], return_logits=False)[1]
        loss.backward()
    finally:
        model.zero_grad(set_to_none=True)


def cuda_peak(model, autocast) -> Callable[[int], int | None]:
    """``peak(c)``: the bytes a trial step of ``c`` sequences peaks at on the model's CUDA device (None: OOM)."""
    device = model.embed.weight.device

    def peak(c: int) -> int | None:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        try:
            trial_step(model, c, autocast, torch.Generator().manual_seed(c))
            return torch.cuda.max_memory_allocated(device)
        except torch.OutOfMemoryError:
            return None
        finally:
            torch.cuda.empty_cache()
    return peak


def choose(cfg, model, device: torch.device, autocast, per_rank: int, *, context: int = 1, is_main: bool = True,
           peak: Callable[[int], int | None] | None = None, memory: int | None = None) -> int:
    """``train.micro_batch`` for a config that set it to 0 (auto); ``peak`` and ``memory`` stand in for the
    CUDA measurement and the card's size in tests."""
    from .. import devices
    from ..validation import check_training_fits
    cands = divisors_desc(per_rank)
    memory = devices.device_memory_bytes(device) if memory is None else memory
    if (device.type != "cuda" and peak is None) or context > 1 or memory is None:
        micro = next(c for c in cands if c <= FALLBACK)
        if is_main:
            why = "context parallelism: not tried" if context > 1 else f"{device.type}: nothing to try"
            log.info("fibattn: train.micro_batch auto -> %d (%s; set it to choose)", micro, why)
        return micro
    bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device.type == "cuda")
    possible = []
    for c in cands:                        # the lower bound refuses the hopeless ones without a trial
        try:
            check_training_fits(cfg.model, c, bf16, device, checkpointing=cfg.train.activation_checkpointing)
            possible.append(c)
        except ConfigError:
            pass
    moments = 8 * sum(p.numel() for p in model.parameters() if p.requires_grad)   # AdamW's, at the first step
    budget = int(HEADROOM * memory) - moments
    micro, need = largest_fitting(possible or cands[-1:], peak or cuda_peak(model, autocast), budget)
    if is_main:
        log.info("fibattn: train.micro_batch auto -> %d (the largest of %s that fits: a trial step peaked at "
                 "%.3g GB of %.3g GB allowed)", micro, ", ".join(map(str, cands)), need / 1e9, budget / 1e9)
    return micro


def resolve(cfg, model, dist, autocast, per_rank: int) -> int:
    """:func:`choose` on every rank of ``dist``, agreed: the smallest choice (every rank's trial fitted it)."""
    from . import distributed as D
    micro = choose(cfg, model, dist.device, autocast, per_rank, context=cfg.train.context_parallel,
                   is_main=dist.is_main)
    return D.min_int(dist, micro)
