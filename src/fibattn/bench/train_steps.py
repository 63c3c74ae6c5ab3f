"""``fibattn bench train``'s steps: one training step of a variant built (:func:`make_step`, its dense
attention on the SDPA backends asked for), the variants timed interleaved (:func:`interleave`,
:func:`timed`, the median and spread by :func:`summarize`) and, on CUDA, each one's peak memory and MFU
(:func:`device_fields`). :mod:`fibattn.bench.train` decides what to time and shows it.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch

from ..devices import synchronize
from ..model.lm import FibLM
from ..trainer.throughput import flops_per_token, peak_flops
from .attention_paths import equal_documents
from .memory import live_bytes, step_peak_bytes


def sdpa_backends(name: str, device: torch.device):
    """The SDPA backends, in priority order, that ``--dense-sdpa name`` allows, or None for torch's own choice
    (auto on a CPU). A named backend alone: SDPA then fails loudly where it cannot run."""
    from torch.nn.attention import SDPBackend as B
    if name == "auto":
        if device.type != "cuda":
            return None
        return [B.CUDNN_ATTENTION, B.FLASH_ATTENTION, B.EFFICIENT_ATTENTION, B.MATH]
    return [{"cudnn": B.CUDNN_ATTENTION, "flash": B.FLASH_ATTENTION, "efficient": B.EFFICIENT_ATTENTION,
             "math": B.MATH}[name]]


def _sdpa_context(backends):
    if backends is None:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel
    return sdpa_kernel(backends, set_priority=True)


def make_step(model_cfg, batch: int, device: torch.device, compiled: bool = False, checkpointing: str = "none",
              documents: int = 0, loss_head: str = "plain", sdpa=None):
    """A fresh model (seed 0), its AdamW and random tokens; returns ``(step, warmup_steps)``
    where ``step()`` runs one forward + backward + optimizer step and ``step.state_bytes()`` counts
    the weights, optimizer moments and batch every step starts with; ``documents``: that many packed
    documents per row, attention masked to each (0: one document); ``loss_head``: the model's
    :meth:`~fibattn.model.lm.FibLM.set_loss_head`; ``sdpa``: :func:`sdpa_backends` for the dense attention."""
    torch.manual_seed(0)
    model = FibLM(model_cfg).to(device).set_activation_checkpointing(checkpointing).set_loss_head(loss_head)
    if compiled:
        model.warm()                 # the tables built before tracing, as training does
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    fwd = torch.compile(model, fullgraph=True) if compiled else model
    T = model_cfg.seq_len
    x = torch.randint(0, model_cfg.vocab_size, (batch, T), device=device)
    y = torch.randint(0, model_cfg.vocab_size, (batch, T), device=device)
    docs = {"document_ids": equal_documents(batch, T, documents, device)} if documents else {}
    cuda = device.type == "cuda"

    def step():
        with _sdpa_context(sdpa if model_cfg.attention == "dense" else None):
            with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext():
                _, loss = fwd(x, y, **docs, return_logits=False)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step.state_bytes = lambda: live_bytes(*model.parameters(), *model.buffers(), x, y, *(
        v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)))
    # the backward graph of a compiled model is built on its first use, after the forward's
    return step, (2 if compiled else 1)


def interleave(steps: dict, n: int, device: torch.device, clock=None) -> dict[str, list[float]]:
    """Seconds of each of ``n`` timed calls per variant, run round-robin in ``steps``' order
    (v1, v2, ..., v1, v2, ...); each call is synchronised before and after on CUDA."""
    clock = clock or time.perf_counter
    secs: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(n):
        for name, step in steps.items():
            synchronize(device)
            t0 = clock()
            step()
            synchronize(device)
            secs[name].append(clock() - t0)
    return secs


def summarize(tokens_per_step: int, secs: list[float]) -> dict:
    """Median tokens/s over the timed steps and the min–max spread of the per-step rates."""
    rates = [tokens_per_step / s for s in secs]
    return {"tok_s": statistics.median(rates), "min": min(rates), "max": max(rates), "steps": len(rates)}


def timed(built: dict, steps: int, dev: torch.device, tokens_per_step: int) -> dict:
    """Warm every ``(step, warmup_steps)`` in ``built`` up (its seconds: ``NAME_warmup_s``, a compiled
    model's compile time), time them interleaved; each one's row fields."""
    row = {}
    for name, (step, warmup) in built.items():
        synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(warmup):
            step()
        synchronize(dev)
        row[f"{name}_warmup_s"] = time.perf_counter() - t0
    secs = interleave({name: step for name, (step, _) in built.items()}, steps, dev)
    for name in built:
        s = summarize(tokens_per_step, secs[name])
        row.update({f"{name}_tok_s": s["tok_s"], f"{name}_tok_s_min": s["min"], f"{name}_tok_s_max": s["max"]})
    return row


def device_fields(row: dict, built: dict, cfgs: dict, dev: torch.device) -> None:
    """On CUDA: each variant's peak memory of one more step (MB) and MFU against the card's bf16 peak."""
    if dev.type != "cuda":
        return
    peak = peak_flops(dev, True)[0]
    for name, (step, _) in built.items():
        row[f"{name}_peak_mb"] = (step.state_bytes() + step_peak_bytes(step, dev)) / 2 ** 20
        if peak:
            row[f"{name}_mfu"] = row[f"{name}_tok_s"] * flops_per_token(cfgs[name])[0] / peak
