"""C/OpenMP band primitives for CPU tensors, compiled with the system ``gcc`` on first use.

Layout and maths as in :mod:`fibattn.ops.torch_backend` (``scores``, ``wsum``, ``wsum_t``
with rows below 0 clamped to row 0); float32 and float64. Besides the primitives this
kernel set has a fused forward / backward over *columns* (see ``cpu_kernels.c``), which
``engine`` uses for both ops, optionally masked to packed documents (``off``).

The shared library is built from ``cpu_kernels.c`` into ``$FIBATTN_CACHE`` (default
``~/.cache/fibattn``) under a name keyed by the source, the compiler version, the flags
and the CPU's feature flags, and loaded from there only when that folder and the file belong to this user
and neither group nor others may write them (else it is built in a private temporary folder); it is built in a temporary folder next to it (its float and double
halves compiled side by side: gcc takes 8 s instead of 13 s on two cores) and renamed, so concurrent
processes never load a half-written library. Threads: ``torch.get_num_threads()``.
Head sizes of 2, 3, 4, 5, 6, 8, 10, 12, 16 or 32 SIMD vectors (fp32 Dh 16, 24, 32, 40, 48, 64, 80, 96,
128 or 256 with AVX2; 32, 48, 64, 80, 96, 128, 160, 192, 256 or 512 with AVX-512) run vector rows (a
row's columns in SIMD lanes; see ``cpu_kernels.c``); others, or more columns than 16 vectors of lanes,
the generic rows (the kernel before issue 29, about half as fast).
Large outputs, the backward's scratch and copies of strided inputs live on transparent huge pages,
their memory reused between calls (``host_pages``, ``FIBATTN_HOST_POOL_MB``); outputs larger than
the threads' L2 caches are written by streaming stores (:data:`stream_min_bytes`); an interpolated
forward saves its score slopes next to ``P`` (:func:`aux_shape`).
The library needs ``libgomp.so.1``; loaded after torch it binds to the copy torch already
loaded, so the kernels and torch share one OpenMP runtime.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checks import UsageError
from ..devices import cpu_cache_bytes, cpu_flags as _cpu_flags
from ..files import fsync_dir, make_private_file, not_private, private_folder, temporary_private_folder
from .columns import compute_dtype, host_interface
from .host_pages import huge_empty

name = "cpu"
log = logging.getLogger("fibattn")

_SOURCE = Path(__file__).with_name("cpu_kernels.c")
_CFLAGS = ("-O2", "-march=native", "-fopenmp", "-fPIC", "-fno-math-errno")
_LDFLAGS = ("-shared", "-fopenmp")
_PARTS = (1, 2)   # cpu_kernels.c's FA_PART: its float and its double kernels, compiled side by side
_ABI = 14
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_REAL = {torch.float32: ctypes.c_float, torch.float64: ctypes.c_double}
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
# Tests only: the generic rows on every head size, so that they check both kinds of rows on one input
_generic_rows = False
# Outputs of at least this many bytes are written by streaming stores (cpu_kernels.c, tapsums); None:
# the L2 caches of the threads that write them (an output larger than those goes to memory anyway)
stream_min_bytes: int | None = None


@dataclass
class _Build:
    lib: ctypes.CDLL | None = None
    reason: str | None = None


_state: _Build | None = None
_lock = threading.Lock()
_scratch = threading.local()


def _scratch_like(x: torch.Tensor, *shape: int) -> torch.Tensor:
    """An uninitialised tensor of ``x``'s dtype and ``shape`` from a buffer this thread keeps between
    calls (the largest asked for, per dtype): the backward's dS."""
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    n = math.prod(shape)
    buf = bufs.get(x.dtype)
    if buf is None or buf.numel() < n:
        buf = bufs[x.dtype] = huge_empty(x, n)
    return buf[:n].view(shape)


def cache_dir() -> Path:
    return Path(os.environ.get("FIBATTN_CACHE") or Path.home() / ".cache" / "fibattn")


def _library_path(compiler: str, source: bytes) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(_CFLAGS + _LDFLAGS).encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    return cache_dir() / f"cpu_kernels_{key}.so"


def _run(cmds: list[list[str]]) -> None:
    """Runs the commands side by side; RuntimeError with the first failure's command and stderr."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for cmd in cmds]
    try:
        errs = [proc.communicate(timeout=300)[1] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for cmd, proc, err in zip(cmds, procs, errs):
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {err.strip()[:800]}")   # the first error: the cause


def _compile(compiler: str, target: Path) -> None:
    """Builds the library into ``target``: the float and double halves at once (the build takes about
    the time of the larger), linked in a folder of our own next to it and renamed into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as tmp:
        objs = [str(Path(tmp) / f"part{p}.o") for p in _PARTS]
        _run([[compiler, *_CFLAGS, f"-DFA_PART={p}", "-c", "-o", obj, str(_SOURCE.resolve())]
              for p, obj in zip(_PARTS, objs)])
        lib = str(Path(tmp) / target.name)
        _run([[compiler, *_LDFLAGS, "-o", lib, *objs, "-lm"]])
        make_private_file(lib)
        fd = os.open(lib, os.O_RDONLY)          # on disk before it is renamed into place: a crash leaves the old
        try:                                    # library or the whole new one, never a torn file that loads
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(lib, target)
        fsync_dir(target.parent)


def _private_target(target: Path) -> Path:
    """Where to load (and build) ``target``: there when its folder and, if built already, the file belong to
    this user and no one else may write them; else in a private temporary folder, with a warning. The name
    is predictable, so a library planted in a folder others can write would run their code in this process."""
    folder, why = private_folder(target.parent)
    if why is None and (target.exists() or target.is_symlink()):
        problem = not_private(target, folder=False)
        if problem:
            folder, why = temporary_private_folder(), f"{target} {problem}"
    if why:
        log.warning("fibattn: not loading the CPU kernel library from FIBATTN_CACHE: %s; building it in the "
                    "private folder %s instead (give FIBATTN_CACHE a folder of your own, not writable by group "
                    "or others)", why, folder)
    return folder / target.name


def _load() -> _Build:
    if os.environ.get("FIBATTN_CPU_KERNEL"):      # issue 29's old switch: say so, rather than ignore it
        log.warning("fibattn: FIBATTN_CPU_KERNEL is no longer read: the generic rows run only where the vector "
                    "rows do not (issue 29, docs/cpu_kernels.md)")
    compiler = shutil.which("gcc")
    if compiler is None:
        return _Build(reason="no C compiler: 'gcc' is not on PATH")
    try:
        source = _SOURCE.read_bytes()
        target = _private_target(_library_path(compiler, source))
        if not target.exists():
            log.info("fibattn: compiling CPU kernels into %s", target)
            _compile(compiler, target)
        lib = ctypes.CDLL(str(target))
        if lib.fa_abi_version() != _ABI:
            return _Build(reason=f"kernel library {target} has ABI {lib.fa_abi_version()}, expected {_ABI}")
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return _Build(reason=f"CPU kernels could not be built or loaded: {exc}")
    return _Build(lib=lib)


def _build() -> _Build:
    global _state
    if _state is None:          # the lock for the first load only: every kernel call asks
        with _lock:
            if _state is None:
                _state = _load()
    return _state


def library_file() -> Path | None:
    """The kernel library this process runs (built on first use), or None where it cannot be built."""
    lib = _build().lib
    return None if lib is None else Path(lib._name)


def unavailable(device) -> str | None:
    """``None`` when the kernels can run on ``device``, else the reason they cannot."""
    if torch.device(device).type != "cpu":
        return f"the cpu backend runs on CPU tensors only, got device {device}"
    return _build().reason


def _kernel(stem: str, dtype: torch.dtype):
    build = _build()
    if build.lib is None:
        raise RuntimeError(f"cpu backend unavailable: {build.reason}")
    if dtype not in _SUFFIX:
        raise UsageError(f"cpu backend kernels take float32 or float64 tensors, got {dtype}")
    return getattr(build.lib, f"{stem}_{_SUFFIX[dtype]}")


def vector_rows(dtype: torch.dtype, head_dim: int) -> int:
    """How many SIMD vectors a row of ``head_dim`` takes in the vector rows (0: that head size runs
    the generic rows), on this machine's vector width."""
    return _kernel("fa_vector_nv", dtype)(_i64(head_dim))


def _prep(*xs: torch.Tensor) -> list[torch.Tensor]:
    """The tensors, checked, and contiguous: a strided one (the model's v, the gradient coming back
    through a transpose) is copied into memory on huge pages (``host_pages``), where the kernels'
    reads of rows far back miss the TLB less."""
    dtype = xs[0].dtype
    for x in xs:
        if not x.is_cpu:
            raise UsageError(f"cpu backend needs CPU tensors, got a tensor on {x.device}")
        if x.dtype != dtype:
            raise UsageError(f"cpu backend needs one dtype, got {dtype} and {x.dtype}")
    return [x if x.is_contiguous() else huge_empty(x, *x.shape).copy_(x) for x in xs]


def _ints(values) -> ctypes.Array:
    values = list(values)
    return (ctypes.c_int64 * max(len(values), 1))(*values)


def _dims(q: torch.Tensor, kv: torch.Tensor) -> tuple:
    B, H, T, D = q.shape
    return _i64(B), _i64(H), _i64(kv.shape[1]), _i64(T), _i64(D)


def _call_band(stem, a, b, out, dists, dims):
    fn = _kernel(stem, a.dtype)
    if out.numel():
        failed = fn(_ptr(a.data_ptr()), _ptr(b.data_ptr()), _ptr(out.data_ptr()), *dims, _ints(dists),
                    _i64(len(dists)), ctypes.c_int(torch.get_num_threads()))
        if failed:
            raise MemoryError(f"{stem} could not allocate its scratch buffers")
    return out


# ------------------------------------------------------------------------- primitives
def scores(q: torch.Tensor, k: torch.Tensor, dists: list[int], group: int) -> torch.Tensor:
    q, k = _prep(q, k)
    out = q.new_zeros(*q.shape[:3], len(dists))
    return _call_band("fa_scores", q, k, out, dists, _dims(q, k))


def wsum(p: torch.Tensor, v: torch.Tensor, dists: list[int], group: int) -> torch.Tensor:
    p, v = _prep(p, v)
    B, H, T, _ = p.shape
    out = v.new_zeros(B, H, T, v.shape[-1])
    return _call_band("fa_wsum", p, v, out, dists, _dims(out, v))


def wsum_t(p: torch.Tensor, x: torch.Tensor, dists: list[int], group: int) -> torch.Tensor:
    p, x = _prep(p, x)
    B, H, T, D = x.shape
    out = x.new_zeros(B, H // group, T, D)
    return _call_band("fa_wsum_t", p, x, out, dists, _dims(x, out))


# ------------------------------------------------------------------------- fused op
@functools.lru_cache(maxsize=64)
def _fixed(cols, dtype, shape, Hk: int, scale: float) -> tuple:
    """The arguments of a fused kernel call that its columns, q's ``shape``, ``Hk`` and the scale fix:
    ``B, H, Hk, T, D, C``, the column arrays and the scale, built once (the kernels only read them; a
    public call is host-bound below ~1K tokens, and building them cost 8 µs of its ~25 µs)."""
    if not cols.lo or cols.lo[0] != 0:
        raise UsageError(f"fused columns must start with distance 0 (every row attends to itself), got {cols.lo}")
    real = _REAL[dtype]
    n = max(len(cols.lo), 1)
    B, H, T, D = shape
    return (*(_i64(x) for x in (B, H, Hk, T, D, len(cols.lo))), _ints(cols.lo), (real * n)(*cols.wlo),
            (real * n)(*cols.whi), (ctypes.c_int * n)(*[int(t) for t in cols.two]), real(scale))


def _positions(off, q: torch.Tensor):
    """``off`` (each row's position inside its document, ``(B, T)`` int32; None for one document
    per row), checked for shape and type; its values are the caller's to check (out-of-range ones
    would make the kernels read outside k and v)."""
    if off is None:
        return None
    shape = (q.shape[0], q.shape[2])
    if off.dtype != torch.int32 or off.device.type != "cpu" or tuple(off.shape) != shape:
        raise UsageError(f"off must be a CPU int32 tensor of shape (B, T) = {shape}, "
                         f"got {off.dtype} {tuple(off.shape)} on {off.device}")
    return off.contiguous()


def _fast() -> ctypes.c_int:
    return ctypes.c_int(not _generic_rows)


@functools.cache                  # every kernel call asks (_stream_out): one lookup, as before
def _l2_bytes() -> int:
    """One core's L2 cache in bytes (1 MiB where it cannot be read)."""
    return cpu_cache_bytes().get(2, 1 << 20)


def _stream_out(x: torch.Tensor) -> ctypes.c_int:
    """Whether the kernels write ``x`` (an output) by streaming stores: too large to stay in the
    writing threads' caches, its lines need not be read before they are written (0.92x the op at 4K)."""
    limit = stream_min_bytes if stream_min_bytes is not None else _l2_bytes() * torch.get_num_threads()
    return ctypes.c_int(x.numel() * x.element_size() >= limit)


def _pointer(x: torch.Tensor | None):
    return None if x is None else _ptr(x.data_ptr())


def aux_shape(q: torch.Tensor, count: int, interpolated: bool) -> tuple[int, ...]:
    """The saved state: ``P`` ``(B, H, T, C)``; for interpolated columns ``(B, H, 2T, C)``, each head's
    ``P`` rows and then the score slopes ``q . (k_hi - k_lo)`` of its two-tap columns (the alpha
    gradient then needs no dots of its own: a sixth of the interpolated backward's instructions)."""
    B, H, T = q.shape[:3]
    return (B, H, 2 * T if interpolated else T, count)


def _split(aux: torch.Tensor, q: torch.Tensor, C: int) -> tuple:
    """``(P, G or None, head stride)`` pointers of a contiguous saved state for the kernels."""
    B, H, T, _ = q.shape
    shape = aux.shape
    if shape != (B, H, T, C) and shape != (B, H, 2 * T, C):
        raise UsageError(f"the saved state must have shape {aux_shape(q, C, False)} or {aux_shape(q, C, True)}, "
                         f"got {tuple(shape)}")
    p = aux.data_ptr()
    G = _ptr(p + T * C * aux.element_size()) if shape[2] != T else None     # each head's rows T.. (contiguous)
    return _ptr(p), G, _i64(shape[2] * C)


_NO_STATE = (None, None, _i64(0))


def attn_forward(q, k, v, cols, scale: float, off=None, into=None, save: bool = True):
    """``(out, aux)``: softmax attention over ``cols`` (an ``engine.Columns``); ``aux`` is the
    saved state (:func:`aux_shape`), None when ``save`` is False (no backward follows: the kernels
    skip its stores). ``off`` (B, T) int32: each row's position inside its document (None: one
    document per row). ``into``: ``(out, aux)`` to write instead of new tensors (contiguous, the
    right shapes; the kernels alone, for ``bench attention``)."""
    q, k, v = _prep(q, k, v)
    off = _positions(off, q)
    fn = _kernel("fa_attn_fwd", q.dtype)
    C = len(cols.lo)
    out, aux = into or (huge_empty(q, *q.shape), huge_empty(q, *aux_shape(q, C, cols.interpolated)) if save else None)
    if out.numel():
        state = _split(aux, q, C) if aux is not None else _NO_STATE
        failed = fn(_ptr(q.data_ptr()), _ptr(k.data_ptr()), _ptr(v.data_ptr()), _ptr(out.data_ptr()), *state,
                    *_fixed(cols, q.dtype, q.shape, k.shape[1], scale), _pointer(off), _fast(), _stream_out(out),
                    ctypes.c_int(torch.get_num_threads()))
        if failed:
            raise MemoryError("fa_attn_fwd could not allocate its scratch buffers")
    return out, aux


def attn_backward(q, k, v, out, aux, dout, cols, scale: float, need_dfrac: bool = False, off=None, into=None):
    """``(dq, dk, dv, dfrac)``; ``aux`` the forward's; ``dfrac[c]`` (float64, or None) is d loss / d frac
    of column ``c``; ``off`` as in :func:`attn_forward`; ``into``: ``(dq, dk, dv)`` to write, as there."""
    q, k, v, out, aux, dout = _prep(q, k, v, out, aux, dout)
    off = _positions(off, q)
    fn = _kernel("fa_attn_bwd", q.dtype)
    C = len(cols.lo)
    dq, dk, dv = into or (huge_empty(q, *q.shape), huge_empty(k, *k.shape), huge_empty(v, *v.shape))
    B, H, T = q.shape[:3]
    dS = _scratch_like(q, B, H, T, C)
    dfrac = torch.zeros(max(C, 1), dtype=torch.float64) if need_dfrac else None
    if aux.numel():
        failed = fn(*[_ptr(x.data_ptr()) for x in (q, k, v, out, dout)], *_split(aux, q, C),
                    *[_ptr(x.data_ptr()) for x in (dS, dq, dk, dv)], _pointer(dfrac),
                    *_fixed(cols, q.dtype, q.shape, k.shape[1], scale), _pointer(off), _fast(), _stream_out(dq),
                    ctypes.c_int(torch.get_num_threads()))
        if failed:
            raise MemoryError("fa_attn_bwd could not allocate its scratch buffers")
    else:
        dq.zero_(), dk.zero_(), dv.zero_()
    return dq, dk, dv, (dfrac[:C] if need_dfrac else None)


forward, backward, _, plan = host_interface(attn_forward, attn_backward)      # the op interface


def aux_like(q, spec):
    """The saved state of :func:`forward` (:func:`aux_shape`), in the compute dtype."""
    return q.new_empty(aux_shape(q, spec.count, spec.interpolated), dtype=compute_dtype(q.dtype))
