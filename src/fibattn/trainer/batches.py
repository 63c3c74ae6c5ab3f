"""How the trainer runs a batch: its packed documents (method.md §8), the data × context mesh of
context parallelism (method.md §9), the forward, and the validation loss.

With ``train.context_parallel = P`` the ``W`` processes form ``W / P`` data-parallel groups of
``P`` consecutive ranks; the ranks of a group read the same sequences (the loader sees ``W / P``
ranks) and each computes its contiguous chunk. A rank's loss is the mean over its chunk, so
averaging gradients over all ``W`` ranks (DDP) gives the one-process gradient.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.device_mesh import init_device_mesh

from ..config import ConfigError, RunConfig
from ..parallel import ContextGroup, sharded
from . import distributed as D


@dataclass(frozen=True)
class Mesh:
    """This process's place: data-parallel rank and size, its context group (None when ``P = 1``),
    and the ``(dp, cp)`` :class:`~torch.distributed.device_mesh.DeviceMesh` (None when ``P = 1``)."""

    dp_rank: int
    dp_size: int
    context: ContextGroup | None = None
    device_mesh: object = None


def build_mesh(cfg: RunConfig, dist: D.DistInfo) -> Mesh:
    P, W = cfg.train.context_parallel, dist.world_size
    if W % P:
        raise ConfigError(f"train.context_parallel ({P}) must divide the number of processes ({W}): each "
                          f"context group is {P} ranks")
    if P == 1:
        return Mesh(dist.rank, W)
    # torch's 2-D mesh, row-major: a context group is P consecutive ranks (torchrun puts them on one node)
    mesh = init_device_mesh(dist.device.type, (W // P, P), mesh_dim_names=("dp", "cp"))
    cp = mesh["cp"]
    ranks = tuple(int(r) for r in cp.mesh.flatten().tolist())
    return Mesh(mesh.get_local_rank("dp"), W // P, ContextGroup(cp.get_group(), ranks, cp.get_local_rank()), mesh)


def to_device(batch, device: torch.device) -> torch.Tensor:
    """A host batch (numpy or tensor) on ``device``. To CUDA through pinned memory with a non-blocking copy:
    the host goes on to the next micro-batch while the copy and the step run (torch's pinned-memory cache
    keeps the buffer until the copy is done)."""
    t = torch.as_tensor(batch)
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


class BatchForward:
    """``(loss, tokens counted)`` of a batch ``(x, y)`` through ``fwd`` (the model, or DDP around it):
    with its documents, and on this rank's chunk under context parallelism."""

    def __init__(self, model, mesh: Mesh, documents):
        self.model, self.mesh, self.documents = model, mesh, documents

    def __call__(self, fwd, x: torch.Tensor, y: torch.Tensor):
        kw, cg = self.documents(x), self.mesh.context
        kw["return_logits"] = False              # the loss only: the model's loss head need not hold the logits
        if cg is None:
            return fwd(x, y, **kw)[1], y.numel()
        T = x.shape[1]
        if T % cg.size:               # a short validation tail: the group's first rank counts it whole
            return fwd(x, y, **kw)[1], (y.numel() if cg.rank == 0 else 0)
        shard = cg.shard(T, kw.get("document_ids"))
        with sharded(self.model, shard):
            loss = fwd(shard.local(x), shard.local(y), offset=shard.start, return_logits=False)[1]
        return loss, y.numel() // cg.size


@torch.no_grad()
def validation_losses(trainer) -> dict[str, float]:
    """Mean token loss on the first ``train.eval_tokens`` tokens of every validation split."""
    model, T, mb = trainer.eval_model, trainer.cfg.model.seq_len, trainer.cfg.train.micro_batch
    mesh, device = trainer.mesh, trainer.dist.device
    model.eval()
    out = {}
    for name in trainer.data.val_names:
        head = trainer.data.val_tokens(name)[: trainer.cfg.train.eval_tokens + 1]
        toks = torch.from_numpy(np.array(head, dtype=np.int64))
        n = (len(toks) - 1) // T
        seqs = [(i * T, T) for i in range(n)] or ([(0, len(toks) - 1)] if len(toks) > 1 else [])
        mine = seqs[mesh.dp_rank::mesh.dp_size]
        acc = torch.zeros(2, dtype=torch.float64, device=device)
        for j in range(0, len(mine), mb):
            chunk = mine[j:j + mb]
            x = torch.stack([toks[s:s + L] for s, L in chunk]).to(device)
            y = torch.stack([toks[s + 1:s + 1 + L] for s, L in chunk]).to(device)
            with trainer.autocast():
                loss, counted = trainer.forward(model, x, y)
            acc += torch.tensor([float(loss) * counted, float(counted)], dtype=torch.float64, device=device)
        D.all_reduce_sum(trainer.dist, acc)
        if acc[1] > 0:
            out[name] = float(acc[0] / acc[1])
    return out
