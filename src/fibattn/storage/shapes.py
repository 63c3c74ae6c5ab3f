"""One shape check for every loaded weight: a tensor must have the full shape its model config
describes, not only the element count (a transposed matrix has the right count and would be
reshaped into scrambled weights). Checkpoints, exports and ``--init-from`` sources all call it,
before any tensor is reshaped or copied."""
from __future__ import annotations

from typing import Callable

import torch

from ..checks import UsageError


def expected_shapes(model_cfg) -> dict[str, tuple]:
    """The FibLM tensor shapes of ``model_cfg`` (built on the meta device: nothing allocated)."""
    from ..model.lm import FibLM
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in FibLM(model_cfg).state_dict().items()}


def check_shapes(tensors: dict, expected: dict, *, where: Callable[[str], str] | str, described: str,
                 error=UsageError, missing: bool = False, extra: bool = False) -> None:
    """Raise ``error`` naming the tensor, its file (``where``: a file, or a function of the name), both
    shapes and what described the expected one. ``missing``/``extra``: also refuse a tensor only one
    side has (for strict loads; ``--init-from`` reports those against the target model instead)."""
    def file(name):
        return where(name) if callable(where) else where
    for name, t in tensors.items():
        want = expected.get(name)
        if want is not None and tuple(t.shape) != tuple(want):
            raise error(f"{file(name)}: tensor {name} has shape {tuple(t.shape)}, but {described} describes "
                        f"{tuple(want)}")
    if missing:
        lost = [k for k in expected if k not in tensors]
        if lost:
            raise error(f"{file(lost[0])}: has no tensor {lost[0]}, which "
                        f"{described} describes" + (f" (and {len(lost) - 1} more)" if len(lost) > 1 else ""))
    if extra:
        more = [k for k in tensors if k not in expected]
        if more:
            raise error(f"{file(more[0])}: tensor {more[0]} is not part of the model {described} describes"
                        + (f" (and {len(more) - 1} more)" if len(more) > 1 else ""))


def load_checked(model, tensors: dict, *, file: str, described: str, error=UsageError) -> None:
    """``model.load_state_dict(tensors, strict=True)`` after :func:`check_shapes` (one line per problem,
    never torch's multi-line report)."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    check_shapes(tensors, expected, where=file, described=described, error=error, missing=True, extra=True)
    model.load_state_dict(tensors, strict=True)
