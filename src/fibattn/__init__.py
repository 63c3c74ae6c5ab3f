"""fibattn: depth-staggered Fibonacci sparse attention for PyTorch."""
from .ops import BACKENDS, interpolated_sparse_attention, sparse_attention
from .schedules import (Base, InterpolationPlan, LearnedAlphas, as_base, attended_distances, coprime_slots, fib_base,
                        interpolation_plan, layer_alphas, pow2_base)

__version__ = "0.1.0"

__all__ = [
    "BACKENDS", "Base", "InterpolationPlan", "LearnedAlphas", "as_base", "attended_distances", "coprime_slots",
    "fib_base", "interpolated_sparse_attention", "interpolation_plan", "layer_alphas", "pow2_base",
    "sparse_attention", "from_pretrained",
]


def __getattr__(name):
    if name == "from_pretrained":           # lazy: keeps `import fibattn` light
        from .storage.pretrained import from_pretrained
        return from_pretrained
    raise AttributeError(f"module 'fibattn' has no attribute {name!r}")
