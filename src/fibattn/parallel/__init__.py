"""Parallelism beyond data parallel: context parallelism with a halo bounded by the largest
distance (method.md §9)."""
from .context import ContextGroup, ContextShard, layer_dists, sharded
from .halo import HaloPlan, halo_plan, ring_rows

__all__ = ["ContextGroup", "ContextShard", "HaloPlan", "halo_plan", "layer_dists", "ring_rows", "sharded"]
