"""Gradients summed across processes in an order that survives a restart.

DDP all-reduces its buckets as they fill. After its first step it rebuilds them in the order the
gradients became ready, and a restarted process starts again from the first layout. A ring
all-reduce over more than two processes adds each element's terms in an order set by where the
element sits in its bucket, so the step after a resume rounded differently from the same step of
an uninterrupted run. With two processes the sum of two terms is the same either way.

:func:`attach` registers a DDP communication hook that waits for the last bucket and then
all-reduces every gradient once, laid out in the model's parameter order: the same layout at
every step of every run, so ``--resume`` continues bit for bit with any number of processes (the
same before and after). The price is the overlap of the all-reduce with the backward (one
all-reduce per step, after it).
"""
from __future__ import annotations

import torch
import torch.distributed as tdist


class OrderedReduce:
    """The hook's state: the buckets of this backward so far, and the parameters' fixed order."""

    def __init__(self, params, group=None):
        self.position = {id(p): i for i, p in enumerate(params)}
        self.group = group
        self.pending: list[tuple[object, torch.futures.Future]] = []

    def add(self, bucket) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        self.pending.append((bucket, fut))
        if not bucket.is_last():
            return fut       # completed by the last bucket's call, before DDP waits on it
        grads = sorted(((self.position[id(p)], g) for b, _ in self.pending
                        for p, g in zip(b.parameters(), b.gradients())), key=lambda t: t[0])
        flat = torch.cat([g.reshape(-1) for _, g in grads])
        tdist.all_reduce(flat, group=self.group)
        flat.div_(tdist.get_world_size(self.group))
        offset = 0
        for _, g in grads:       # the bucket's gradients are views of its buffer
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        for b, f in self.pending:
            f.set_result(b.buffer())
        self.pending = []
        return fut


def ordered_reduce_hook(state: OrderedReduce, bucket):   # no return annotation: DDP checks it against its own
    return state.add(bucket)


def attach(ddp_module, params) -> bool:
    """Registers :class:`OrderedReduce` on ``ddp_module`` when its group has more than two processes
    (with two, DDP's own overlapped all-reduce is already the same after a restart); returns whether it did."""
    group = getattr(ddp_module, "process_group", None)
    if tdist.get_world_size(group) <= 2:
        return False
    ddp_module.register_comm_hook(OrderedReduce(list(params), group), ordered_reduce_hook)
    return True
