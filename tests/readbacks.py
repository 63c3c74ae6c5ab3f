"""Counting reads back from the device (the host waiting on it) in tests: a dispatch mode plus ``Tensor.tolist`` /
``.numpy`` counted by hand. A read back is ``aten._local_scalar_dense`` (``.item()``, ``float(t)``, ``bool(t)``),
a copy from a non-CPU tensor to the host, an op whose output size depends on the values (``nonzero``,
``masked_select``, ``unique``), or ``tolist`` / ``numpy`` (which do not dispatch on CPU tensors). On CPU every
tensor is on the host, so each such call is counted wherever it comes from, except the token-id range check of
``FibLM._check_idx``, which runs for CPU tensors only (free there; CUDA skips it)."""
import contextlib
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive",
           "unique_dim"}
HOST_ONLY_CHECKS = {"_check_idx"}           # guarded by ``device.type == "cpu"``


def _host_only() -> bool:
    return any(frame.name in HOST_ONLY_CHECKS for frame in traceback.extract_stack())


class ReadBacks(TorchDispatchMode):
    """Records every read back from the device (see the module's docstring) made while it is active."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in SYNCING and not _host_only():
            self.seen.append(name)
        elif name in ("_to_copy", "copy_") and self._to_host(name, args, kwargs):
            self.seen.append(f"{name} to the host")
        return func(*args, **kwargs)

    @staticmethod
    def _to_host(name, args, kwargs) -> bool:
        if name == "copy_":
            dst, src = args[0], args[1]
            return dst.device.type == "cpu" and src.device.type != "cpu"
        dev = kwargs.get("device")
        return dev is not None and torch.device(dev).type == "cpu" and args[0].device.type != "cpu"


@contextlib.contextmanager
def recording():
    """A :class:`ReadBacks` mode, with ``Tensor.tolist`` and ``.numpy`` (no dispatch on CPU tensors) counted
    by hand while it is active."""
    mode = ReadBacks()
    real = {attr: getattr(torch.Tensor, attr) for attr in ("tolist", "numpy")}

    def counted(attr):
        def read(t, *args, **kwargs):
            if not _host_only():
                mode.seen.append(attr)
            return real[attr](t, *args, **kwargs)
        return read
    for attr in real:
        setattr(torch.Tensor, attr, counted(attr))
    try:
        with mode:
            yield mode.seen
    finally:
        for attr, fn in real.items():
            setattr(torch.Tensor, attr, fn)
