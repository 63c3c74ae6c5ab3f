"""Process-group setup from ``torchrun``'s environment, device choice and small collectives.

Under ``torchrun`` (single or multi-node) ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``
are set; with ``WORLD_SIZE > 1`` a process group is created (``nccl`` on CUDA, ``gloo``
on CPU) and each process uses ``cuda:LOCAL_RANK`` (or the CPU). Without them, or with
``WORLD_SIZE=1``, training runs in one process and nothing is initialised.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from ..config import ConfigError, TrainConfig
from ..devices import check_cuda
from ..launch import launch

log = logging.getLogger("fibattn")


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    initialised: bool = False          # True when this module created the process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(t: TrainConfig, local_rank: int, world_size: int) -> torch.device:
    if t.device == "cpu":
        return torch.device("cpu")
    if t.device.startswith("cuda:") and world_size > 1:
        raise ConfigError(f"train.device={t.device} cannot be used with WORLD_SIZE={world_size}: each process uses "
                          f"cuda:LOCAL_RANK; set train.device=cuda or auto")
    if t.device.startswith("cuda"):
        check_cuda(t.device, "train.device", "=")          # the one device check every command makes
        return torch.device("cuda", local_rank) if t.device == "cuda" else torch.device(t.device)
    chosen = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    log.info("fibattn: train.device auto -> %s", chosen)
    return chosen


def init(t: TrainConfig) -> DistInfo:
    """Read torchrun's variables, pick the device, create the process group if needed."""
    return connect(plan(t))


def plan(t: TrainConfig) -> DistInfo:
    """Read torchrun's variables (checked as a whole: :func:`fibattn.launch.launch`) and pick the device; no
    process group yet."""
    place = launch()
    world, rank, local_rank, local_world = place.world_size, place.rank, place.local_rank, place.local_world_size
    device = pick_device(t, local_rank, world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return DistInfo(rank, world, local_rank, local_world, device)


def connect(info: DistInfo) -> DistInfo:
    """Create the process group of a :func:`plan` with more than one process (nccl on CUDA, else gloo)."""
    world, rank, device = info.world_size, info.rank, info.device
    if world > 1 and not tdist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        tdist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world, **kwargs)
        info.initialised = True
        if rank == 0:
            log.info("fibattn: distributed training on %d processes (%s)", world, backend)
    return info


def shutdown(info: DistInfo) -> None:
    if info.initialised and tdist.is_initialized():
        tdist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.distributed:
        if info.device.type == "cuda":
            tdist.barrier(device_ids=[info.device.index])
        else:
            tdist.barrier()


def all_reduce_sum(info: DistInfo, x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (in place, returns ``x``); a no-op in one process."""
    if info.distributed:
        tdist.all_reduce(x, op=tdist.ReduceOp.SUM)
    return x


def min_int(info: DistInfo, value: int) -> int:
    """The smallest of the ranks' ``value`` on every rank."""
    if not info.distributed:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=info.device)
    tdist.all_reduce(t, op=tdist.ReduceOp.MIN)
    return int(t.item())


def broadcast_int(info: DistInfo, value: int) -> int:
    """Rank 0's ``value`` on every rank (a tensor broadcast: no pickling)."""
    if not info.distributed:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=info.device)
    tdist.broadcast(t, src=0)
    return int(t.item())


# ------------------------------------------------------------------------------ agreeing across ranks
class RankError(ConfigError):
    """Another rank refused, stopped, or disagrees with this one (one line naming the rank and the cause)."""


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def gather_text(info: DistInfo, text: str) -> list[str]:
    """Every rank's ``text``, in rank order (byte tensors: no pickling)."""
    if not info.distributed:
        return [text]
    data = torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8)
    n = torch.tensor([data.numel()], dtype=torch.int64, device=info.device)
    sizes = [torch.zeros_like(n) for _ in range(info.world_size)]
    tdist.all_gather(sizes, n)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(max(longest, 1), dtype=torch.uint8)
    buf[:data.numel()] = data
    buf = buf.to(info.device)
    parts = [torch.zeros_like(buf) for _ in range(info.world_size)]
    tdist.all_gather(parts, buf)
    return [bytes(p[:int(s.item())].cpu().tolist()).decode("utf-8", "replace") for p, s in zip(parts, sizes)]


@contextlib.contextmanager
def together(info: DistInfo, what: str):
    """Run one setup step on every rank, then agree on its outcome: a rank that raised re-raises its own
    error; every other rank raises a :class:`RankError` naming that rank and its cause (instead of waiting
    in a collective for a process that is gone). Nothing extra in one process."""
    if not info.distributed:
        yield
        return
    error = None
    try:
        yield
    except Exception as exc:          # noqa: BLE001 - passed on to the other ranks, then re-raised here
        error = exc
    said = gather_text(info, "" if error is None else _one_line(error))
    if error is not None:
        raise error
    bad = [(r, m) for r, m in enumerate(said) if m]
    if bad:
        r, m = bad[0]
        raise RankError(f"rank {r} of {info.world_size} refused while {what}, so rank {info.rank} stops too: {m}")


def _flat(doc, where: str = "") -> dict:
    if isinstance(doc, dict) and doc:
        out = {}
        for k, v in doc.items():
            out.update(_flat(v, f"{where}.{k}" if where else str(k)))
        return out
    return {where: doc}


def check_same(info: DistInfo, record: dict, what: str) -> None:
    """Refuse (on every rank) when the ranks' ``record`` differ, naming the differing keys and values."""
    if not info.distributed:
        return
    mine = json.dumps(record, sort_keys=True, default=str)
    digest = hashlib.sha256(mine.encode()).hexdigest()
    if len(set(gather_text(info, digest))) == 1:
        return
    docs = [_flat(json.loads(t)) for t in gather_text(info, mine)]
    keys = sorted({k for d in docs for k in d if any(d.get(k) != docs[0].get(k) for d in docs)})
    shown = "; ".join(f"{k}: " + ", ".join(f"rank {r} {d.get(k)!r}" for r, d in enumerate(docs)) for k in keys[:4])
    more = f"; ... ({len(keys)} keys in all)" if len(keys) > 4 else ""
    raise RankError(f"the {info.world_size} processes disagree on the {what} ({shown}{more}); every rank must be "
                    f"started with the same command, files and settings")


def peer_lost(info: DistInfo, exc: BaseException) -> RankError | None:
    """A :class:`RankError` for a collective that failed because another rank died (None for anything else)."""
    if not info.distributed or not isinstance(exc, RuntimeError):
        return None
    dist_error = getattr(tdist, "DistError", ())
    text = str(exc)
    if not (isinstance(exc, dist_error) or any(w in text for w in ("Connection closed", "Connection reset", "gloo",
                                                                  "NCCL", "Broken pipe", "Socket Timeout"))):
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return RankError(f"rank {info.rank} of {info.world_size} stops: another process of this job died or stopped "
                     f"(its own line, or torchrun's report, names the cause): {first[:200]}")


# ------------------------------------------------------------------------------ before the process group exists
START_TIMEOUT_S = 1800.0          # as long as the process group's own rendezvous waits
_rounds = iter(range(1 << 62))    # every rank passes the same starting() blocks in the same order


@contextlib.contextmanager
def starting():
    """Wrap what a rank checks before its process group exists (the config, the files). Under torchrun the
    ranks then agree on the outcome through torchrun's own store, before any of them waits in the group's
    rendezvous: a rank that refused raises its own error; every other rank raises a :class:`RankError`
    naming that rank and its cause; a rank that torchrun stops meanwhile (another one died) says so, instead
    of hanging or dying silently. Nothing in one process, or without torchrun's agent store."""
    place = launch()                  # a half-set torchrun environment: one line naming the missing variable
    world, rank = place.world_size, place.rank
    if world <= 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        yield
        return
    prefix = (f"fibattn/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
              f"/start{next(_rounds)}")
    old = _on_sigterm(rank, world)
    error = None
    try:
        yield
    except Exception as exc:          # noqa: BLE001 - passed on to the other ranks, then re-raised here
        error = exc
    try:
        store = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                               timeout=datetime.timedelta(seconds=60))
        store.set(f"{prefix}/{rank}", "ok" if error is None else "refused " + _one_line(error))
        if error is None:
            _wait_for_peers(store, prefix, rank, world)
    except Exception:                 # noqa: BLE001 - the store failing must not hide this rank's own error
        if error is None:
            raise
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    if error is not None:
        raise error


def _on_sigterm(rank: int, world: int):
    """torchrun stops the other ranks with SIGTERM when one fails: say so in one line (the old handler)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stopped(signum, frame):
        raise RankError(f"rank {rank} of {world} stops: torchrun stopped it because another process of this job "
                        f"failed before training started (its own line, or torchrun's report, names the cause)")
    return signal.signal(signal.SIGTERM, stopped)


def _wait_for_peers(store, prefix: str, rank: int, world: int) -> None:
    """Poll (sleeping in Python, so that SIGTERM is handled at once) until every other rank reported."""
    pending, deadline = [r for r in range(world) if r != rank], time.monotonic() + START_TIMEOUT_S
    while pending:
        for r in [r for r in pending if store.check([f"{prefix}/{r}"])]:
            said = store.get(f"{prefix}/{r}").decode("utf-8", "replace")
            if said != "ok":
                raise RankError(f"rank {r} of {world} refused before training started, so rank {rank} stops too: "
                                f"{said.removeprefix('refused ')}")
            pending.remove(r)
        if pending and time.monotonic() > deadline:
            raise RankError(f"rank {rank} of {world} stops: rank {pending[0]} did not start within "
                            f"{START_TIMEOUT_S:g} s")
        time.sleep(0.05)
