"""Peak memory of one training step (``fibattn bench train --activation-checkpointing``).

CUDA: the caching allocator's own counters (``max_memory_allocated``). CPU: PyTorch keeps no such counter,
and the process's peak resident size (``getrusage``) is process-wide, never goes down and counts the
interpreter, the libraries and every other model alive in the process. So on CPU the step runs under the
profiler with ``profile_memory``, which reports every allocation and free of PyTorch's CPU allocator (inside
kernels too), and the peak is the running total's maximum: the same quantity as on CUDA, tensor bytes only
(malloc's caching and fragmentation are not counted).
"""
from __future__ import annotations

import os

import torch


def live_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and tied weights count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def step_peak_bytes(step, device: torch.device) -> int:
    """The most bytes ``step()`` holds at once beyond what was allocated before it: activations, gradients,
    temporaries."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")      # its start/stop lines would land in the table
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
                    key=lambda e: e.start_ns())
    if not events:
        raise RuntimeError("the profiler reported no CPU allocations for a training step; cannot measure memory")
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return peak
