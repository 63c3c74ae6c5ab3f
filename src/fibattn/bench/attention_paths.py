"""What each path of ``fibattn bench attention`` runs, on which inputs (see ``bench.attention``).

``make_step`` returns one forward+backward (or forward) of a path; the dense path runs under
the first SDPA kernel that accepts the inputs (:func:`pick_sdpa`), named in the results.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fibattn
from ..checks import UsageError
from ..ops import resolve_backend
from ..schedules import attended_distances

PATHS = ("dense", "mask", "flex", "torch", "integer", "interpolated", "integer-docs", "interpolated-docs")
DOC_PATHS = {"integer": "integer-docs", "interpolated": "interpolated-docs"}   # with --documents N
DEFAULT_PATHS = {"cpu": ("dense", "mask", "integer", "interpolated"), "cuda": PATHS}
CUDA_LENGTHS = [1024, 4096, 16384, 65536]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BenchConfig:
    lengths: list[int] = field(default_factory=lambda: [1024, 4096, 16384])
    repeats: int = 3
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    window: int = 12
    fib_k: int = 15
    alpha: float = 1.5
    device: str = "cpu"
    mask_budget_gb: float = 8.0
    memory: bool = True
    memory_check: int | None = None
    batch: int = 1
    dtype: str = "float32"
    paths: list[str] = field(default_factory=lambda: list(DEFAULT_PATHS["cpu"]))
    forward_lengths: list[int] = field(default_factory=list)
    documents: int = 0             # the -docs paths: this many equal documents per row

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")



def _inputs(cfg: BenchConfig, T: int):
    g = torch.Generator().manual_seed(0)
    dev = torch.device(cfg.device)

    def rnd(h):
        return torch.randn(cfg.batch, h, T, cfg.head_dim, generator=g).to(dev, _DTYPES[cfg.dtype])

    q, k, v = rnd(cfg.heads), rnd(cfg.kv_heads), rnd(cfg.kv_heads)
    return [x.requires_grad_() for x in (q, k, v)], rnd(cfg.heads)


def _distances(cfg: BenchConfig, T: int) -> list[int]:
    return attended_distances(cfg.window, cfg.alpha, f"fib:{cfg.fib_k}", T)


MASK_BYTES_PER_ENTRY = 17


def mask_bytes(T: int) -> int:
    """Estimated peak extra memory of the mask path (see the module docstring)."""
    return MASK_BYTES_PER_ENTRY * T * T


SDPA_NAMES = {SDPBackend.FLASH_ATTENTION: "flash", SDPBackend.EFFICIENT_ATTENTION: "efficient",
              SDPBackend.CUDNN_ATTENTION: "cudnn", SDPBackend.MATH: "math"}
SDPA_BY_NAME = {name: b for b, name in SDPA_NAMES.items()}


def sdpa_order() -> list[str]:
    """SDPA backends to try for the dense path: torch's own priority order (flash, efficient, ...)
    restricted to the four named ones, with math (the unfused reference) last."""
    try:
        order = [SDPBackend(int(i)) for i in torch._C._get_sdp_priority_order()]
    except (AttributeError, RuntimeError, TypeError, ValueError):
        order = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    names = [SDPA_NAMES[b] for b in order if b in SDPA_NAMES and b != SDPBackend.MATH]
    names += [n for n in ("flash", "efficient", "cudnn") if n not in names]
    return names + ["math"]


def sdpa_label(name: str, device: str) -> str:
    """The backend column for the dense path: ``sdpa-flash`` on CUDA, ``sdpa-cpu-flash`` on CPU."""
    return f"sdpa-{name}" if device.startswith("cuda") else f"sdpa-{device.split(':')[0]}-{name}"


def pick_sdpa(step_under) -> str:
    """Run ``step_under(name)`` for each backend of :func:`sdpa_order` and return the first name
    that runs (that call doubles as the warm-up). ``RuntimeError`` (no kernel for these inputs,
    or out of memory) moves on to the next; if none runs, a RuntimeError naming each failure."""
    errors = []
    for name in sdpa_order():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")           # "Flash attention kernel not used because ..."
                step_under(name)
            return name
        except (RuntimeError, NotImplementedError) as exc:
            errors.append((name, exc))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    tried = "; ".join(f"{n}: {str(e).splitlines()[0][:200]}" for n, e in errors)
    raise RuntimeError(f"dense SDPA: no backend runs these inputs ({tried})") from errors[0][1]


def check_documents(n: int, lengths, given: bool = True) -> None:
    """Refuse ``--documents N`` (``given``; else the -docs paths' default count) above a timed length:
    :func:`equal_documents` would pack fewer documents than the results say (a row of ``T`` tokens holds at most
    ``T``)."""
    short = min(lengths, default=n)
    if n > short:
        from ..checks import ConfigError
        what = f"--documents {n}" if given else f"the -docs paths' default of {n} documents per row"
        raise ConfigError(f"{what} is more than the {short} tokens of a row at length {short} (each "
                          f"document needs a token); give --documents <= {short} or longer --lengths")


def equal_documents(batch: int, T: int, n: int, device) -> torch.Tensor:
    """``document_ids`` of ``n`` documents of (nearly) equal length in every row."""
    n = max(1, min(n, T))
    return (torch.arange(T, device=device) * n // T).expand(batch, T).contiguous()


def document_ids(cfg: BenchConfig, T: int, device) -> torch.Tensor:
    return equal_documents(cfg.batch, T, cfg.documents, device)


def make_step(cfg: BenchConfig, path: str, T: int, inputs=None, backward: bool = True, sdpa: str | None = None):
    """A closure running one forward+backward (or forward) of ``path`` (on ``inputs`` or fresh ones).
    ``sdpa`` (dense path only): run SDPA under that backend alone (flash, efficient, cudnn, math)."""
    (q, k, v), dout = inputs or _inputs(cfg, T)
    gqa = cfg.kv_heads != cfg.heads
    if path == "dense":
        def fwd():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    elif path == "mask":
        dists = torch.tensor(_distances(cfg, T), device=q.device)
        pos = torch.arange(T, device=q.device)
        rel = pos[:, None] - pos[None, :]
        allowed = torch.zeros(T, dtype=torch.bool, device=q.device)
        allowed[dists] = True
        mask = (rel >= 0) & allowed[rel.clamp(min=0)]
        del rel

        def fwd():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    elif path in ("integer", "torch", "flex", "integer-docs"):
        dists = _distances(cfg, T)
        backend = path if path in ("torch", "flex") else "auto"
        docs = document_ids(cfg, T, q.device) if path.endswith("-docs") else None

        def fwd():
            return fibattn.sparse_attention(q, k, v, dists, backend=backend, document_ids=docs)
    elif path in ("interpolated", "interpolated-docs"):
        alpha = torch.tensor(cfg.alpha, device=q.device, requires_grad=True)
        docs = document_ids(cfg, T, q.device) if path.endswith("-docs") else None

        def fwd():
            return fibattn.interpolated_sparse_attention(q, k, v, alpha=alpha, base=f"fib:{cfg.fib_k}",
                                                         window=cfg.window, backend="auto", document_ids=docs)
    else:
        raise UsageError(f"path must be one of {PATHS}, got {path!r}")

    def run():
        if not backward:
            with torch.no_grad():
                return fwd()
        for x in (q, k, v):
            x.grad = None
        fwd().backward(dout)

    if path != "dense" or sdpa is None:
        return run
    backend = SDPA_BY_NAME[sdpa]

    def step():
        with sdpa_kernel([backend]):
            return run()
    return step


def backend_name(cfg: BenchConfig, path: str) -> str:
    if path in ("dense", "mask"):
        return "sdpa"
    if path in ("torch", "flex"):
        return path
    return resolve_backend("auto", torch.device(cfg.device), interpolated=path.startswith("interpolated"))


def traffic_bytes(cfg: BenchConfig, T: int, backward: bool = True) -> int:
    """Bytes the fused kernels must move when each reads its inputs and writes its outputs once:
    forward q, k, v -> out, lse; backward q, dout, out, k, v, lse -> dq, delta and
    q, dout, k, v, lse, delta -> dk, dv."""
    es = torch.empty((), dtype=_DTYPES[cfg.dtype]).element_size()
    nq = cfg.batch * cfg.heads * T * cfg.head_dim * es
    nkv = cfg.batch * cfg.kv_heads * T * cfg.head_dim * es
    ns = cfg.batch * cfg.heads * T * 4
    fwd = 2 * nq + 2 * nkv + ns
    return fwd + (4 * nq + 2 * nkv + 2 * ns) + (2 * nq + 4 * nkv + 2 * ns) if backward else fwd


def document_lines(records, documents: int) -> list[str]:
    """Document masking's cost over the plain op, measured side by side, per (length, mode), from
    ``bench.attention.Record``s."""
    by = {(r.T, r.mode, r.path): r.ms for r in records if r.ms is not None}
    lines = []
    for (T, mode, path), ms in by.items():
        plain = next((p for p, d in DOC_PATHS.items() if d == path), None)
        if plain is not None and (T, mode, plain) in by:
            lines.append(f"document masking ({documents} documents per row), {plain} {mode} at T={T}: "
                         f"{ms:.1f} ms vs {by[(T, mode, plain)]:.1f} ms ({ms / by[(T, mode, plain)] - 1:+.1%})")
    return lines
