"""AdamW with decoupled weight decay on matrices only, and the learning-rate schedule.

Weight decay applies to every parameter with two or more dimensions: the attention and
FFN matrices and the tied token embedding (it is also the output head, as in GPT-2).
Norm gains and the learned-alpha ``theta`` (1-D) are never decayed.

Schedule for update ``s = 0 .. steps-1``: linear warm-up ``lr * (s + 1) / warmup_steps``
for ``s < warmup_steps``, then cosine decay from ``lr`` to ``min_lr_ratio * lr`` at the
last step.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, t: TrainConfig) -> torch.optim.AdamW:
    """AdamW; the fused implementation (one kernel for all parameters) on CPU and CUDA."""
    fused = all(p.device.type in ("cpu", "cuda") for p in model.parameters())
    return torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8,
                             fused=fused)


def param_names(model: nn.Module) -> list[str]:
    """Parameter names in the optimiser's order (decay group first)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [n for n, p in named if p.dim() >= 2] + [n for n, p in named if p.dim() < 2]


def lr_at(step: int, t: TrainConfig) -> float:
    """Learning rate of update number ``step`` (0-based)."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - 1 - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    low = t.lr * t.min_lr_ratio
    return low + 0.5 * (t.lr - low) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
