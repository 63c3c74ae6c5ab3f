"""Before the first step: the output folder, disk space, precision, accumulation, data,
threads and seeds — each checked with an error that names the setting."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from .. import config as C
from .. import validation as V
from ..config import ConfigError, RunConfig
from ..files import check_creatable, make_parents
from ..locks import check_unlocked
from ..model.head_loss import logit_rows
from ..storage import checkpoint as ck
from ..storage.results import check_db_path, resolve_db_path
from ..threads import MAX_THREADS, use_threads
from . import distributed as D
from .logs import is_metrics_log

log = logging.getLogger("fibattn")


def _is_run_config(path: Path) -> bool:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and all(isinstance(doc.get(k), dict) for k in ("model", "data", "train"))


def check_not_foreign(out: Path) -> None:
    """A run starting from step 0 writes ``config.json`` and ``metrics.jsonl`` into ``out``: refuse when
    either exists and is not fibattn's (a user's file of that name would be overwritten)."""
    for name, ours in (("config.json", _is_run_config), ("metrics.jsonl", is_metrics_log)):
        path = out / name
        if path.exists() and not ours(path):
            raise ConfigError(f"train.out_dir {out} holds {name}, which is not fibattn's (training would overwrite "
                              f"it); choose another --out or move the file away")


def prepare_out_dir(path) -> Path:
    """Create ``path`` and prove it is writable, else raise a ConfigError naming it."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"train.out_dir {p} exists and is not a folder")
    try:
        make_parents(p).mkdir(exist_ok=True)        # a new runs/ gets a .gitignore of "*"
        with tempfile.NamedTemporaryFile(dir=p, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise ConfigError(f"train.out_dir {p} is not writable: {exc.strerror or exc}") from None
    return p


def check_out_dir(out: Path, results_db: str, dist: D.DistInfo) -> None:
    """Rank 0 checks ``train.out_dir`` and the results DB before anything is written (outputs are created
    when the run starts, once every input is checked); every rank hears of a refusal."""
    with D.together(dist, "checking train.out_dir"):
        if dist.is_main:
            check_creatable(out, "train.out_dir")
            check_unlocked(run_lock_path(out), out, "train.out_dir")     # another train writes it
            if not ck.list_checkpoints(ck.ckpt_root(out)):
                check_not_foreign(out)          # a fresh run must not overwrite a user's file
            db_path = resolve_db_path(out, results_db)
            db = check_db_path(db_path) if db_path is not None else None   # corrupted, read-only, uncreatable
            if db is not None:
                db.close()


def check_data(cfg: RunConfig, data, dist: D.DistInfo) -> None:
    """The training data against the run: the same data on every rank, a vocabulary the model holds, and a
    step no larger than the data."""
    t = cfg.train
    if hasattr(data, "data_id"):
        D.check_same(dist, {"data_id": data.data_id()}, "training data (its manifest's shard digests)")
    if data.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's "
                          f"vocabulary ({data.vocab_size}); set model.vocab_size >= {data.vocab_size}")
    sources = (getattr(data, "manifest", None) or {}).get("sources") or []
    if sources and hasattr(data, "train_tokens"):      # a step past the whole data: unbounded, meaningless
        have = sum(data.train_tokens(src["name"]) for src in sources)
        if t.batch_tokens > have:
            raise ConfigError(f"train.batch_tokens ({t.batch_tokens}) is more than the training data holds ({have} "
                              f"tokens in {getattr(data, 'path', 'the data')}): one step would read it "
                              f"{t.batch_tokens / max(have, 1):.3g} times over; set train.batch_tokens <= {have}")


def check_fits(cfg: RunConfig, device: torch.device, loss_head: str = "plain") -> None:
    """Refuse a config whose training state certainly exceeds the device's memory, naming the estimate."""
    t = cfg.train
    bf16 = t.precision == "bf16" or (t.precision == "auto" and device.type == "cuda")
    V.check_training_fits(cfg.model, max(t.micro_batch, 1), bf16, device, checkpointing=t.activation_checkpointing,
                          context=t.context_parallel, logit_rows=logit_rows(loss_head, cfg.model.vocab_size))


def warn_disk_space(path: Path, n_params: int, keep: int) -> None:
    one = n_params * 4 * 3                        # weights + two AdamW moments, fp32, per checkpoint
    need = one * (keep + 1)
    while not path.exists() and path != path.parent:     # checked before the folder is created
        path = path.parent
    free = shutil.disk_usage(path).free
    if free < one:
        raise ConfigError(f"train.out_dir {path} is full: {free} bytes free, one checkpoint needs about "
                          f"{one} bytes; free some space or choose another --out")
    if free < need:
        log.warning("fibattn: only %.1f GB free in %s; %d checkpoints need about %.1f GB",
                    free / 1e9, path, keep + 1, need / 1e9)


def autocast_for(precision: str, device: torch.device):
    use_bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    if precision == "auto":
        log.info("fibattn: train.precision auto -> %s", "bf16 autocast" if use_bf16 else "fp32")
    if use_bf16:
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def compile_wanted(t: C.TrainConfig, device: torch.device, is_main: bool = True) -> bool:
    """``train.compile`` resolved: ``auto`` compiles on CUDA (where the host's Python would otherwise set the
    pace) but not on a CPU (compiling takes longer than most CPU runs gain), nor with context parallelism
    (its halo exchange is not traced); the choice is logged once."""
    if t.compile != "auto":
        return t.compile == "true"
    on = device.type == "cuda" and t.context_parallel == 1
    if is_main:
        why = ("CUDA" if on else "context parallelism is not traced" if device.type == "cuda"
               else f"{device.type}: set train.compile=true to compile anyway")
        log.info("fibattn: train.compile auto -> %s (%s)", "torch.compile, fullgraph" if on else "eager", why)
    return on


def loss_head_for(how: str, device: torch.device, is_main: bool = True, field: str = "train.loss_head") -> str:
    """``train.loss_head`` (or the bench's ``field``) resolved: ``auto`` keeps the plain head on a CPU (its
    losses stay those of earlier runs, bit for bit) and takes the chunked head on CUDA (never the whole logits,
    no read back, traced by ``torch.compile``; liger-kernel's head reads its token count back once per
    micro-batch, so it is a choice, not the default); logged once. ``liger`` runs where Triton does (CUDA, or
    ``TRITON_INTERPRET=1``)."""
    if how == "auto":
        how = "chunked" if device.type == "cuda" else "plain"
        if is_main:
            log.info("fibattn: %s auto -> %s (%s)", field, how, "CUDA" if device.type == "cuda" else
                     f"{device.type}: set {field}=chunked to hold less memory")
    if how == "liger" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ConfigError(f"{field}=liger runs on CUDA (liger-kernel's Triton kernels), not on {device.type}; "
                          f"set chunked or auto")
    return how


def compile_cache() -> str:
    """Where torch.compile keeps what it compiled, said when a run compiles: a resumed or repeated run with
    the same model reuses it (inductor's FX-graph and autograd caches) and compiles in seconds."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        return f"inductor cache {cache_dir()}; TORCHINDUCTOR_CACHE_DIR moves it"
    except (ImportError, OSError, RuntimeError):
        return "inductor cache in torch's default folder"


def sequences_per_rank(cfg: RunConfig, world: int) -> int:
    """``batch_tokens / (seq_len * world)``: the sequences each of ``world`` processes takes per step."""
    t, T = cfg.train, cfg.model.seq_len
    if t.batch_tokens % (T * world):
        raise ConfigError(f"train.batch_tokens ({t.batch_tokens}) must be a multiple of model.seq_len * world_size "
                          f"({T} * {world} = {T * world}) so that every process trains whole sequences")
    return t.batch_tokens // (T * world)


def accum_steps(cfg: RunConfig, world: int) -> int:
    """Gradient-accumulation steps that keep ``train.batch_tokens`` global for ``world`` processes.

    Each process takes :func:`sequences_per_rank` sequences per step. When ``train.micro_batch``
    (already chosen, when auto) does not divide that (more processes than the preset was written for),
    it is lowered to the largest divisor that does, logged once: the global batch, and so the
    optimisation, stay those of the config."""
    t, T = cfg.train, cfg.model.seq_len
    per_rank = sequences_per_rank(cfg, world)
    micro = max(d for d in range(1, min(t.micro_batch, per_rank) + 1) if per_rank % d == 0)
    if micro != t.micro_batch:
        log.info("fibattn: train.micro_batch %d -> %d: train.batch_tokens %d over %d process(es) is %d sequences "
                 "each", t.micro_batch, micro, t.batch_tokens, world, per_rank)
        t.micro_batch = micro
    log.info("fibattn: batch %d tokens = %d process(es) x %d micro-batch(es) x %d sequences x %d tokens",
             t.batch_tokens, world, per_rank // micro, micro, T)
    return per_rank // micro


def document_kwargs(masking: bool, data, field: str = "train.document_masking"):
    """``kwargs(x)`` for the model's forward on a batch ``x``: its packed documents, each ended by the
    data's ``<eos>`` (method.md §8), when ``masking``; nothing otherwise."""
    from ..data.loader import masking_eos
    from ..ops.documents import document_ids_from_eos
    eos = masking_eos(masking, data, field)
    if eos is None:
        return lambda x: {}
    return lambda x: {"document_ids": document_ids_from_eos(x, eos)}


def load_data(cfg: RunConfig, dist: D.DistInfo):
    from ..data import TokenData, ensure_prepared
    data = None
    with D.together(dist, "preparing the data"):
        if dist.is_main:                 # prepared (or reused) and verified once, by rank 0
            data = TokenData(ensure_prepared(cfg.data))
            data.verify_train()          # the other ranks then find the check cached
    return data if data is not None else TokenData(Path(cfg.data.out_dir).expanduser())


RUN_LOCK = ".fibattn-lock"


def run_lock_path(out: Path) -> Path:
    return Path(out) / RUN_LOCK


def lock_run(out: Path):
    """The run folder's writer lock (one ``train`` per ``--out``), held until training returns."""
    from ..locks import FolderLock
    return FolderLock(run_lock_path(out), out, "train.out_dir", "fibattn train").acquire()


def tokenizer_file(data) -> Path | None:
    """The data folder's tokenizer file (copied into checkpoints), if the data has one."""
    path, manifest = getattr(data, "path", None), getattr(data, "manifest", None) or {}
    name = (manifest.get("tokenizer") or {}).get("file") if isinstance(manifest, dict) else None
    if path is None or not name or not (Path(path) / name).is_file():
        return None
    return Path(path) / name


def set_threads(t: C.TrainConfig, dist: D.DistInfo) -> None:
    """train.threads, or the free cores shared among this node's processes (:mod:`fibattn.threads`)."""
    shared = dist.distributed and dist.device.type == "cpu"
    use_threads(t.threads, "train.threads", dist.local_world_size if shared else 1, tell=dist.is_main)


def keep_threads(t: C.TrainConfig, saved, dist: D.DistInfo) -> None:
    """On a resume with ``train.threads`` auto, the thread count the checkpoint was written with (PyTorch's CPU
    reductions split by thread, so another count changes the last bits: a resume stays bit for bit only on
    the run's own count); a count given, a GPU run or an older checkpoint keep today's choice."""
    if t.threads or dist.device.type != "cpu" or isinstance(saved, bool) or not isinstance(saved, int) \
            or not 1 <= saved <= MAX_THREADS or saved == torch.get_num_threads():
        return
    torch.set_num_threads(saved)
    if dist.is_main:
        log.info("fibattn: train.threads auto -> %d CPU thread%s, as the checkpoint was written (the same bits as "
                 "the run; train.threads=N chooses)", saved, "s" if saved != 1 else "")


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % (1 << 32))
    random.seed(seed)
