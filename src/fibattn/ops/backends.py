"""Which backend runs an op: the names, what each can run on, and ``auto`` (logged once).

- ``reference``: dense mask / explicit columns; small T; the definition of correctness.
- ``torch``: shifted slices in pure PyTorch; any device; the portable fallback.
- ``cpu``: C kernels (OpenMP) compiled on first use; CPU tensors.
- ``triton``: fused Triton kernels; CUDA tensors (CPU tensors under ``TRITON_INTERPRET=1``).
- ``flex``: FlexAttention with a block mask; integer distances only; a comparison point.

``auto`` picks ``cpu`` on CPU and ``triton`` on CUDA, and ``torch`` when that one cannot
run (the log line gives the reason).
"""
from __future__ import annotations

import functools
import importlib
import logging

import torch

from ..checks import BackendUnavailable, UsageError
from ..config import BACKENDS

log = logging.getLogger("fibattn")

KERNEL_SETS = ("torch", "cpu", "triton")          # the backends behind fibattn's custom ops
_MODULES = {"torch": "torch_backend", "cpu": "cpu_backend", "triton": "triton_backend", "flex": "flex_backend"}
_PREFERRED = {"cpu": "cpu", "cuda": "triton"}
_auto_logged: set = set()


@functools.cache                  # import_module's lookup costs ~1 µs, and every call asks
def _module(name: str):
    return importlib.import_module(f"{__package__}.{_MODULES[name]}")


def constant_result(fn):
    """``torch.compiler.assume_constant_result``: ``torch.compile`` runs ``fn`` while tracing and keeps its result
    as a constant. That decorator only sets this flag, but imports ``torch._dynamo`` to do it — 1.3 s at every
    start of ``fibattn``'s command line, most of which never compiles (tests/test_startup.py holds the two
    equal)."""
    fn._dynamo_marked_constant = True
    return fn


@constant_result
def backend_available(name: str, device: torch.device) -> str | None:
    """``None`` when backend ``name`` can run on ``device``, else the reason it cannot."""
    if name in ("reference", "torch"):
        return None
    return _module(name).unavailable(device)


def _auto(device: torch.device) -> tuple[str, str | None]:
    preferred = _PREFERRED.get(device.type)
    if preferred is None:
        return "torch", f"no fused backend for {device.type} tensors"
    why = backend_available(preferred, device)
    return (preferred, None) if why is None else ("torch", f"{preferred} backend: {why}")


def check_name(backend: str) -> None:
    if backend not in BACKENDS + ("auto",):
        raise UsageError(f"backend must be one of auto, {', '.join(BACKENDS)}, got {backend!r}")


@constant_result
def resolve_backend(backend: str, device: torch.device, *, interpolated: bool = False) -> str:
    """Turn ``auto`` into a concrete backend and check an explicit one can run here (no logging)."""
    check_name(backend)
    device = torch.device(device)
    if backend == "auto":
        return _auto(device)[0]
    if interpolated and backend == "flex":
        raise BackendUnavailable("backend 'flex' supports integer distances only; use 'triton', 'cpu', 'torch' or "
                                 "'reference' for interpolated_sparse_attention")
    why = backend_available(backend, device)
    if why is not None:
        raise BackendUnavailable(f"backend {backend!r} cannot run on {device}: {why}")
    return backend


FLEX_NO_CPU_BACKWARD = ("backend 'flex' has no backward on CPU in this torch (forward only); use backend 'cpu' or "
                        "'torch' when gradients are needed")


def check_model_runs(m, device, *, grad: bool, field: str = "model.backend") -> None:
    """Refuse, before any work or output, a ``ModelConfig`` whose backend cannot run it on ``device``
    (``grad``: it will be trained), naming the setting; the same errors would otherwise come mid-run."""
    if m.attention != "sparse":
        return
    try:
        resolve_backend(m.backend, device, interpolated=m.schedule == "learned")
        if grad and m.backend == "flex" and torch.device(device).type == "cpu":
            raise BackendUnavailable(FLEX_NO_CPU_BACKWARD)
    except BackendUnavailable as exc:
        raise BackendUnavailable(f"{field}={m.backend}: {exc}") from None


def announce(backend: str, device: torch.device, chosen: str | None = None) -> None:
    """Log what ``auto`` picked on this kind of device, once per process (``chosen``, when the
    caller resolved it already, makes the logged-before case a set lookup)."""
    if backend != "auto":
        return
    device = torch.device(device)
    if (device.type, chosen) in _auto_logged:
        return
    chosen, why = _auto(device)
    key = (device.type, chosen)
    if key not in _auto_logged:
        _auto_logged.add(key)
        log.info("fibattn: backend auto -> %s on %s%s", chosen, key[0], f" ({why})" if why else "")


def kernels(name: str):
    """The module implementing ``forward`` / ``backward`` / ``aux_like`` for resolved backend ``name``."""
    if name not in KERNEL_SETS:
        raise UsageError(f"backend {name!r} has no fused kernel set (one of {', '.join(KERNEL_SETS)})")
    return _module(name)


def compiled_triton(name: str, device: torch.device) -> bool:
    """Whether a call on ``device`` resolved to backend ``name`` goes through ``triton_ops``' traced ops: a CUDA
    call being compiled, with Triton's own kernels (the interpreter cannot run on the compiler's fake tensors)."""
    return name == "triton" and device.type == "cuda" and torch.compiler.is_compiling() and _triton_ops_ready()


@constant_result
def _triton_ops_ready() -> bool:
    """Run, not traced: imports the ``triton`` backend and, with real kernels, registers ``triton_ops``' ops on
    first use — registering a ``triton_op`` imports ``torch._inductor`` (a second more at every start)."""
    if kernels("triton").interpreting():
        return False
    importlib.import_module(f"{__package__}.triton_ops")
    return True


def kernel_set(backend: str, device: torch.device, *, interpolated: bool = False, log: bool = True):
    """:func:`kernels` of ``backend`` resolved on ``device`` (``auto`` logged once unless ``log`` is False)."""
    name = resolve_backend(backend, device, interpolated=interpolated)
    kern = kernels(name)
    if log:
        announce(backend, device, name)
    return kern
